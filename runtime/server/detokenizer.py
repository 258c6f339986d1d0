"""Incremental, UTF-8-safe detokenization with stop strings matched across token boundaries, and the
accumulation of scheduler outputs into the native /generate result shape (shared by the Engine and the server)."""

from __future__ import annotations

from typing import Optional

from braid.runtime.core import ReqOutput
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

    def finish(self, finish_reason: Optional[dict]) -> str:
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


class OutputAccumulator:
    """Folds a request's ReqOutputs into the native API's result dict (`text`, `output_ids`, `meta_info`)."""

    def __init__(self, rid: str, tokenizer, sampling_params: SamplingParams, return_logprob: bool = False):
        self.rid = rid
        self.detok = IncrementalDetokenizer(tokenizer, sampling_params)
        self.return_logprob = return_logprob
        self.text = ""
        self.output_ids: list[int] = []
        self.meta: dict = {"id": rid}
        self.finished = False
        if return_logprob:
            self.meta.update(input_token_logprobs=None, input_top_logprobs=None,
                             output_token_logprobs=[], output_top_logprobs=[])

    def add(self, out: ReqOutput) -> str:
        """Apply one output; returns the new text."""
        self.output_ids[out.output_ids_offset:] = out.new_token_ids
        new_ids = out.new_token_ids
        matched = (out.finish_reason or {}).get("matched") if out.finished else None
        if isinstance(matched, int) and new_ids and new_ids[-1] == matched:
            new_ids = new_ids[:-1]  # a stop token's own text never reaches the output
        delta = self.detok.update(out.output_ids_offset, new_ids)
        if out.finished:
            delta += self.detok.finish(out.finish_reason)
            self.finished = True
        self.text += delta
        self.meta.update(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                         cached_tokens=out.cached_tokens,
                         completion_tokens_wo_jump_forward=out.completion_tokens_wo_jump_forward,
                         finish_reason=out.finish_reason)
        if self.return_logprob:
            if out.input_token_logprobs is not None:
                self.meta["input_token_logprobs"] = [list(x) for x in out.input_token_logprobs]
                self.meta["input_top_logprobs"] = [None if t is None else [list(y) for y in t] for t in out.input_top_logprobs]
            if out.output_token_logprobs:
                self.meta["output_token_logprobs"].extend(list(x) for x in out.output_token_logprobs)
                self.meta["output_top_logprobs"].extend(None if t is None else [list(y) for y in t]
                                                        for t in out.output_top_logprobs)
        return delta

    def result(self) -> dict:
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": dict(self.meta)}
