"""Incremental, UTF-8-safe detokenization with stop strings matched across token boundaries."""

from __future__ import annotations

from typing import Optional

from braid.runtime.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Feed it output token ids as they come; it returns only text that is final: no half of a multi-byte
    character, and no tail that might still turn out to be the start of a stop string."""

    def __init__(self, tokenizer, sampling_params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special_tokens = sampling_params.skip_special_tokens
        self.stops = list(sampling_params.stop or [])
        self.no_stop_trim = sampling_params.no_stop_trim
        self.ids: list[int] = []
        self.decoded = ""  # text of ids[:read_offset], complete characters only
        self.prefix_offset = 0
        self.read_offset = 0
        self.emitted = 0  # characters of the visible text already returned
        self.stopped_at: Optional[int] = None

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self) -> None:
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            self.decoded += full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)

    def _visible(self, final: bool) -> str:
        text = self.decoded
        if self.stopped_at is not None:
            return text[: self.stopped_at]
        for s in self.stops:
            pos = text.find(s)
            if pos != -1:
                end = pos + len(s) if self.no_stop_trim else pos
                if self.stopped_at is None or end < self.stopped_at:
                    self.stopped_at = end
        if self.stopped_at is not None:
            return text[: self.stopped_at]
        if final or not self.stops:
            return text
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return text[: len(text) - hold]

    def update(self, offset: int, new_ids: list[int]) -> str:
        self.ids = self.ids[:offset] + list(new_ids)
        if offset < self.read_offset:
            # jump-forward retokenized ids that were already decoded: decode again from the start
            self.decoded, self.prefix_offset, self.read_offset = "", 0, 0
        self._advance()
        visible = self._visible(final=False)
        delta = visible[self.emitted:]
        self.emitted = max(self.emitted, len(visible))
        return delta

    def finish(self) -> str:
        """Flush the rest. Callers leave a matched stop token out of the ids they feed in."""
        ids = self.ids
        self.decoded = self._decode(ids).rstrip(_REPLACEMENT) if ids else ""
        visible = self._visible(final=True)
        delta = visible[self.emitted:]
        self.emitted = len(visible)
        return delta

    @property
    def text(self) -> str:
        return self._visible(final=self.stopped_at is not None)[: self.emitted]
