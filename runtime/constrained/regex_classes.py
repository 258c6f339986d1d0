"""`\\d`, `\\w`, `\\s` and their negations as ASCII classes, as SGLang and vLLM (Python's `re` on `str` patterns
aside) constrain them.

outlines-core compiles with Rust's regex syntax, where these escapes are Unicode classes: `\\d` admits every
Unicode decimal digit (U+0661, U+1FBF1, ...), and a sampled model does emit them. Every regex braid compiles
(a user's regex, a JSON schema's generated regex with its `pattern`s, choices) passes through
`ascii_shorthand_classes` first. `\\p{...}` classes and `.` keep their Unicode meaning.
"""

from __future__ import annotations

ASCII_CLASS_BODIES = {"d": "0-9", "w": "0-9A-Za-z_", "s": "\\t\\n\\x0B\\f\\r "}

# escapes whose argument is braced: \x{263a}, \u{..}, \p{Greek}, \P{..}
_BRACED_ESCAPES = set("xuUpP")


def ascii_shorthand_classes(regex: str) -> str:
    """`regex` with each `\\d \\w \\s \\D \\W \\S` written as an explicit ASCII class. Outside brackets `\\d`
    becomes `[0-9]`; inside, its body is spliced in (`[\\d.]` -> `[0-9.]`) and a negated one becomes a nested
    class (`[a\\D]` -> `[a[^0-9]]`, Rust's class union)."""
    out: list[str] = []
    depth = 0  # bracket nesting; Rust opens a nested class at an unescaped '[' inside a class
    i, n = 0, len(regex)
    while i < n:
        c = regex[i]
        if c == "\\" and i + 1 < n:
            escaped = regex[i + 1]
            body = ASCII_CLASS_BODIES.get(escaped.lower())
            if body is not None:
                negated = escaped.isupper()
                if depth == 0 or negated:
                    out.append(f"[{'^' if negated else ''}{body}]")
                else:
                    out.append(body)
                i += 2
                continue
            end = i + 2
            if escaped in _BRACED_ESCAPES and regex.startswith("{", end):
                close = regex.find("}", end)
                end = n if close == -1 else close + 1
            out.append(regex[i:end])
            i = end
            continue
        if c == "[":
            if depth > 0 and regex.startswith("[:", i):  # POSIX class such as [[:alpha:]]
                close = regex.find(":]", i + 2)
                if close != -1:
                    out.append(regex[i:close + 2])
                    i = close + 2
                    continue
            depth += 1
            out.append(c)
            i += 1
            if regex.startswith("^", i):
                out.append("^")
                i += 1
            if regex.startswith("]", i):  # a ']' first in a class is literal
                out.append("]")
                i += 1
            continue
        if c == "]" and depth > 0:
            depth -= 1
        out.append(c)
        i += 1
    return "".join(out)
