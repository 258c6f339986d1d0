"""Incremental, UTF-8-safe detokenization with stop strings matched across token boundaries.

Stop matching costs O(new characters + longest stop) per update, never O(text so far): a stop that completes
with new text starts at most len(stop) - 1 characters before it, and the held-back tail (a possible stop
prefix) is tracked per stop with a Knuth-Morris-Pratt automaton fed only the new characters."""

from __future__ import annotations

from typing import Callable, Optional

from braid.runtime.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"


def _failure_table(pattern: str) -> list[int]:
    """failure[i]: length of the longest proper prefix of pattern[:i + 1] that is also its suffix."""
    failure = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = failure[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        failure[i] = k
    return failure


def _common_prefix_length(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # invariant: a[:lo] == b[:lo] and a[:hi + 1] != b[:hi + 1]
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def backend_decode(tokenizer) -> Optional[Callable[..., str]]:
    """The `tokenizers` decode under a transformers fast tokenizer, when calling it directly gives the same text as
    `tokenizer.decode` (no clean-up of tokenization spaces, decode and _decode not overridden): it skips the wrapper's
    argument conversion, which costs more than the decode of a token or two."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(tokenizer)
    if not (isinstance(tokenizer, TokenizersBackend) and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is TokenizersBackend._decode and not tokenizer.clean_up_tokenization_spaces):
        return None
    return tokenizer._tokenizer.decode


class _StopPrefixTracker:
    """Length of the longest suffix of the text fed so far that is a proper prefix of `stop`."""

    def __init__(self, stop: str):
        self.stop = stop
        self.failure = _failure_table(stop)
        self.matched = 0

    def reset_to_tail(self, text: str) -> None:
        # a proper prefix of stop is shorter than stop, so the last len(stop) - 1 characters determine it
        self.matched = 0
        self.feed(text[len(text) - (len(self.stop) - 1):] if len(self.stop) > 1 else "")

    def feed(self, chars: str) -> None:
        stop, failure, k = self.stop, self.failure, self.matched
        for c in chars:
            if k == len(stop):
                k = failure[k - 1]
            while k and c != stop[k]:
                k = failure[k - 1]
            if c == stop[k]:
                k += 1
        self.matched = k


class IncrementalDetokenizer:
    """Feed it output token ids as they come; it returns only text that is final: no half of a multi-byte
    character, and no tail that might still turn out to be the start of a stop string."""

    def __init__(self, tokenizer, sampling_params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special_tokens = sampling_params.skip_special_tokens
        # passed to decode only when turned off: on (the default) is what tokenizers do without the argument
        self._decode_options = ({} if sampling_params.spaces_between_special_tokens
                                else {"spaces_between_special_tokens": False})
        self._backend_decode = backend_decode(tokenizer)
        self.stops = list(sampling_params.stop or [])
        self.no_stop_trim = sampling_params.no_stop_trim
        self.ids: list[int] = []
        self.decoded = ""  # text of ids[:read_offset], complete characters only
        self.prefix_offset = 0
        self.read_offset = 0
        self.emitted = 0  # characters of the visible text already returned
        self.stopped_at: Optional[int] = None
        self.scanned = 0  # decoded[:scanned] holds no stop string and the prefix trackers have seen it
        self._prefix_trackers = [_StopPrefixTracker(s) for s in self.stops]
        self._trackers_stale = False
        self.chars_searched = 0  # characters passed to stop searches so far (the per-update cost, for tests)
        # min_new_tokens: a stop string counts only if it ends in the text of the min_new_tokens-th token or later
        # (the scheduler's rule, OutputProcessor._match_stop_str); the text before it is searched by nobody, but a
        # tail of it that may begin a stop string is still held back
        self.min_new_tokens = sampling_params.min_new_tokens if self.stops else 0
        self._held_off_chars: Optional[int] = None  # characters of the first min_new_tokens - 1 tokens' text

    def _decode(self, ids) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens, **self._decode_options)

    def _advance(self) -> None:
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            self.decoded += full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)

    def _replace_decoded(self, text: str) -> None:
        """Swap in re-decoded text; the part that stayed the same needs no second stop search."""
        unchanged = _common_prefix_length(self.decoded, text)
        if unchanged < self.scanned:
            self.scanned = unchanged
            self._trackers_stale = True
        self.decoded = text

    def _scan(self) -> None:
        """Search the text decoded since the last scan for stop strings; feed it to the prefix trackers."""
        text = self.decoded
        if self.stopped_at is not None or not self.stops:
            return
        if self.min_new_tokens > 1:
            # raising `scanned` past the held-off text leaves it out of the search; stale trackers re-read the tail
            floor = self._stop_search_floor()
            if self.scanned < floor:
                self.scanned = floor
                self._trackers_stale = True
        if self.scanned >= len(text) and not self._trackers_stale:
            return
        for s in self.stops:
            start = max(0, self.scanned - len(s) + 1)
            self.chars_searched += len(text) - start
            pos = text.find(s, start)
            if pos != -1:
                end = pos + len(s) if self.no_stop_trim else pos
                if self.stopped_at is None or end < self.stopped_at:
                    self.stopped_at = end
        if self.stopped_at is not None:
            return
        for tracker in self._prefix_trackers:
            if self._trackers_stale or len(text) - self.scanned >= len(tracker.stop):
                tracker.reset_to_tail(text)
                self.chars_searched += min(len(text), len(tracker.stop) - 1)
            else:
                tracker.feed(text[self.scanned:])
                self.chars_searched += len(text) - self.scanned
        self._trackers_stale = False
        self.scanned = len(text)

    def _stop_search_floor(self) -> int:
        if len(self.ids) < self.min_new_tokens:
            return len(self.decoded)
        if self._held_off_chars is None:
            held_off = self._decode(self.ids[:self.min_new_tokens - 1])
            self._held_off_chars = len(held_off.rstrip(_REPLACEMENT))  # a cut character belongs to the text after
        return self._held_off_chars

    def _visible(self, final: bool) -> str:
        self._scan()
        text = self.decoded
        if self.stopped_at is not None:
            return text[: self.stopped_at]
        if final or not self.stops:
            return text
        hold = max(tracker.matched for tracker in self._prefix_trackers)
        return text[: len(text) - hold]

    def update(self, offset: int, new_ids: list[int]) -> str:
        if offset < self.min_new_tokens - 1:  # jump-forward rewrote held-off tokens
            self._held_off_chars = None
        if offset < len(self.ids):
            del self.ids[offset:]
        self.ids.extend(new_ids)
        if offset < self.read_offset:
            # jump-forward retokenized ids that were already decoded: decode again from the start
            previous, self.decoded, self.prefix_offset, self.read_offset = self.decoded, "", 0, 0
            self._advance()
            redecoded, self.decoded = self.decoded, previous
            self._replace_decoded(redecoded)
        else:
            self._advance()
        visible = self._visible(final=False)
        delta = visible[self.emitted:]
        self.emitted = max(self.emitted, len(visible))
        return delta

    def finish(self) -> str:
        """Flush the rest. Callers leave a matched stop token out of the ids they feed in unless no_stop_trim."""
        ids = self.ids
        self._replace_decoded(self._decode(ids).rstrip(_REPLACEMENT) if ids else "")
        visible = self._visible(final=True)
        delta = visible[self.emitted:]
        self.emitted = len(visible)
        return delta

    @property
    def text(self) -> str:
        return self._visible(final=self.stopped_at is not None)[: self.emitted]
