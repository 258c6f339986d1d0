"""Exact regexes for bounded JSON integers and for numbers between whole-number bounds.

Digit runs stay bounded as in json_schema.py: at most 19 integer digits, 16 fraction digits; a bound beyond 19 digits
is clamped to the largest 19-digit magnitude (a narrowing: every text the regex admits still satisfies the schema).
"""

from __future__ import annotations

MAX_DIGITS = 19
LARGEST = 10 ** MAX_DIGITS - 1
_ANY_FRACTION = r"(\.[0-9]{1,16})?"
_ZERO_FRACTION = r"(\.0{1,16})?"
_NONZERO_FRACTION = r"\.0{0,15}[1-9][0-9]{0,15}"


def _same_length_range(low: str, high: str) -> str:
    """Regex for the decimal strings of one length n between low and high (both n digits, low <= high)."""
    if not low:
        return ""
    if low == high:
        return low
    rest = len(low) - 1
    if low[0] == high[0]:
        return low[0] + _group(_same_length_range(low[1:], high[1:]))
    if low[1:] == "0" * rest and high[1:] == "9" * rest:
        return _digit_class(low[0], high[0]) + _any_digits(rest)
    parts = [low[0] + _group(_same_length_range(low[1:], "9" * rest))]
    if int(high[0]) - int(low[0]) > 1:
        parts.append(_digit_class(str(int(low[0]) + 1), str(int(high[0]) - 1)) + _any_digits(rest))
    parts.append(high[0] + _group(_same_length_range("0" * rest, high[1:])))
    return "|".join(parts)


def _group(regex: str) -> str:
    return f"({regex})" if "|" in regex else regex


def _digit_class(low: str, high: str) -> str:
    return low if low == high else f"[{low}-{high}]"


def _any_digits(count: int) -> str:
    return "" if count == 0 else "[0-9]" if count == 1 else f"[0-9]{{{count}}}"


def magnitude_range_regex(low: int, high: int) -> str | None:
    """Regex for the canonical decimal forms (no sign, no leading zeros) of low..high; None when empty."""
    low, high = max(low, 0), min(high, LARGEST)
    if low > high:
        return None
    parts = []
    full_lengths: list[int] = []  # lengths >= 2 whose every number is in range: merged into one [1-9][0-9]{a,b}
    for length in range(len(str(low)), len(str(high)) + 1):
        start = max(low, 10 ** (length - 1) if length > 1 else 0)
        end = min(high, 10 ** length - 1)
        if length > 1 and start == 10 ** (length - 1) and end == 10 ** length - 1:
            full_lengths.append(length)
        elif start <= end:
            parts.append(_same_length_range(str(start), str(end)))
    if full_lengths:
        first, last = full_lengths[0] - 1, full_lengths[-1] - 1
        digits = _any_digits(first) if first == last else f"[0-9]{{{first},{last}}}"
        parts.insert(1 if parts and len(str(low)) < full_lengths[0] else 0, f"[1-9]{digits}")
    return "|".join(parts)


def integer_range_regex(minimum: int | None, maximum: int | None) -> str | None:
    """Regex for the JSON integers in [minimum, maximum] (None: unbounded on that side); None when the range is empty."""
    low = -LARGEST if minimum is None else minimum
    high = LARGEST if maximum is None else maximum
    parts = []
    negative = magnitude_range_regex(max(-high, 1), -low)
    if negative is not None:
        parts.append(f"-({negative})")
    non_negative = magnitude_range_regex(low, high)
    if non_negative is not None:
        parts.append(f"({non_negative})")
    return "|".join(parts) if parts else None


def _magnitude_decimal_regex(low: int, low_exclusive: bool, high: int | None, high_exclusive: bool) -> str | None:
    """Unsigned decimals d(.f)? with low <(=) value <(=) high; low, high whole and >= 0; high None = unbounded."""
    if high is not None and (low > high or (low == high and (low_exclusive or high_exclusive))):
        return None
    if high is not None and low == high:
        return f"{low}{_ZERO_FRACTION}"
    parts = [f"{low}{_NONZERO_FRACTION if low_exclusive else _ANY_FRACTION}"]
    middle = magnitude_range_regex(low + 1, LARGEST if high is None else high - 1)
    if middle is not None:
        parts.append(f"({middle}){_ANY_FRACTION}")
    if high is not None and not high_exclusive:
        parts.append(f"{high}{_ZERO_FRACTION}")
    return "|".join(f"({part})" for part in parts)


def number_range_regex(minimum: int | None, minimum_exclusive: bool, maximum: int | None,
                       maximum_exclusive: bool) -> str | None:
    """Regex for JSON numbers (no exponent) between whole-number bounds; None when no number fits."""
    parts = []
    # Negative numbers -m: the magnitude m lies in [max(-maximum, 0), -minimum], and m > 0 ("-0" is left out).
    if minimum is None or minimum < 0:
        if maximum is not None and maximum < 0:
            magnitude_low, magnitude_low_exclusive = -maximum, maximum_exclusive
        else:
            magnitude_low, magnitude_low_exclusive = 0, True
        negative = _magnitude_decimal_regex(magnitude_low, magnitude_low_exclusive,
                                            None if minimum is None else -minimum, minimum_exclusive)
        if negative is not None:
            parts.append(f"-({negative})")
    # Non-negative numbers.
    if minimum is None or minimum <= 0:
        low, low_exclusive = 0, minimum == 0 and minimum_exclusive
    else:
        low, low_exclusive = minimum, minimum_exclusive
    if maximum is None or maximum >= 0:
        non_negative = _magnitude_decimal_regex(low, low_exclusive, maximum, maximum_exclusive)
        if non_negative is not None:
            parts.append(f"({non_negative})")
    return "|".join(parts) if parts else None
