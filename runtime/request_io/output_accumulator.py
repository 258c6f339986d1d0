"""Folding a choice's scheduler outputs into its result: ids (jump-forward may rewrite recent ones), text
(detokenized incrementally, stop token and stop strings trimmed unless no_stop_trim), logprobs and usage. The Engine
and the server's request handles both use `OutputAccumulator`; an output may carry any number of new tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from braid.runtime.sampling_params import SamplingParams
from braid.runtime.request_io.detokenizer import IncrementalDetokenizer

ABORTED = {"type": "abort", "matched": None}


def _pairs(entries: Optional[list]) -> list:
    return [tuple(x) for x in entries or []]


def _top_pairs(entries: Optional[list]) -> list:
    return [None if pos is None else [tuple(y) for y in pos] for pos in entries or []]


@dataclass(slots=True)
class ChoiceUpdate:
    """One output applied to one choice: `delta` is the new text; the `new_*` lists are its logprobs. The rest is the
    choice as of this update (the server applies outputs on its detokenizer thread, which may run ahead of the
    handler writing this update): its text, the counts, and its output ids when the accumulator keeps snapshots."""

    choice: "OutputAccumulator"
    delta: str
    new_token_logprobs: list
    new_top_logprobs: list
    finished: bool
    text: str
    output_ids: Optional[list[int]]  # None unless the accumulator was made with snapshot_ids
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    completion_tokens_wo_jump_forward: int
    num_token_logprobs: int  # len(choice.output_token_logprobs) then (those lists only ever grow)

    @property
    def index(self) -> int:
        return self.choice.index


class OutputAccumulator:
    """Everything received so far for one choice (one of the n outputs of a request)."""

    def __init__(self, index: int, tokenizer: Any, sampling_params: SamplingParams, prompt_tokens: int,
                 return_logprob: bool = False, snapshot_ids: bool = False):
        self.index = index
        self.snapshot_ids = snapshot_ids  # updates carry a copy of output_ids (the native stream sends them all)
        self.detokenizer = IncrementalDetokenizer(tokenizer, sampling_params)
        # no_stop_trim (vLLM's include_stop_str_in_output) keeps a matched stop token's text too, as in vLLM and
        # SGLang; an EOS token's text is empty anyway unless skip_special_tokens is off
        self.keep_stop_token = sampling_params.no_stop_trim
        self.return_logprob = return_logprob
        self.output_ids: list[int] = []
        self.text = ""  # text emitted so far (stop strings trimmed, no partial characters)
        self.output_token_logprobs: list = []  # [(logprob, id)]
        self.output_top_logprobs: list = []  # [[(logprob, id), ...] | None]
        self.input_token_logprobs: Optional[list] = None
        self.input_top_logprobs: Optional[list] = None
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens_wo_jump_forward = 0
        self.finish_reason: Optional[dict] = None
        self.finished = False
        # wall-clock times (time.time()): the request's arrival (set by the server's handle) and its first token (from
        # the scheduler's finished output); together they give meta_info's time_to_first_token
        self.arrival_time: Optional[float] = None
        self.first_token_time: Optional[float] = None
        self.spec_accept_length: Optional[float] = None  # from the finished output, when drafts were verified

    def add(self, out: Any) -> Optional[ChoiceUpdate]:
        """Apply one scheduler output (a `ReqOutput` or a wire `Output`); None once the choice has finished."""
        if self.finished:
            return None
        offset = out.output_ids_offset
        new_ids = list(out.new_token_ids)
        self.output_ids[offset:] = new_ids
        new_lp, new_top = [], []
        if self.return_logprob:
            # logprobs only ever append (jump-forward tokens were not sampled and carry none)
            new_lp, new_top = _pairs(out.output_token_logprobs), _top_pairs(out.output_top_logprobs)
            self.output_token_logprobs.extend(new_lp)
            self.output_top_logprobs.extend(new_top)
            if out.input_token_logprobs is not None:
                self.input_token_logprobs = _pairs(out.input_token_logprobs)
                self.input_top_logprobs = _top_pairs(out.input_top_logprobs)
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.completion_tokens = out.completion_tokens
        self.cached_tokens = out.cached_tokens
        self.completion_tokens_wo_jump_forward = out.completion_tokens_wo_jump_forward
        self.first_token_time = getattr(out, "first_token_time", None) or self.first_token_time
        self.spec_accept_length = getattr(out, "spec_accept_length", None) or self.spec_accept_length
        detok_ids = new_ids
        matched = (out.finish_reason or {}).get("matched")
        if (out.finished and isinstance(matched, int) and new_ids and new_ids[-1] == matched
                and not self.keep_stop_token):
            # the stop token (EOS or a stop_token_ids entry) is no part of the text: never show it to the detokenizer
            detok_ids = new_ids[:-1]
        delta = self.detokenizer.update(offset, detok_ids)
        if out.finished:
            self.finish_reason = out.finish_reason or dict(ABORTED)
            delta += self.detokenizer.finish()
            self.finished = True
        self.text += delta
        return ChoiceUpdate(self, delta, new_lp, new_top, self.finished, self.text,
                            list(self.output_ids) if self.snapshot_ids else None, self.prompt_tokens,
                            self.completion_tokens, self.cached_tokens, self.completion_tokens_wo_jump_forward,
                            len(self.output_token_logprobs))

    def abort(self, message: Optional[str] = None) -> Optional[ChoiceUpdate]:
        """Finish the choice with finish_reason abort, keeping what it produced."""
        reason = dict(ABORTED)
        if message:
            reason["message"] = message
        return self.add(_Abort(self.index, len(self.output_ids), reason, self.prompt_tokens, self.completion_tokens,
                               self.cached_tokens, self.completion_tokens_wo_jump_forward))

    def meta_info(self, rid: str, token_text: Optional[Callable[[int], str]] = None,
                  update: Optional[ChoiceUpdate] = None) -> dict:
        """The native API's meta_info (as of `update` when given); with `token_text`, logprob entries carry the
        token's text third."""
        now = self if update is None else update
        meta = {"id": rid, "prompt_tokens": now.prompt_tokens, "completion_tokens": now.completion_tokens,
                "cached_tokens": now.cached_tokens,
                "completion_tokens_wo_jump_forward": now.completion_tokens_wo_jump_forward,
                "finish_reason": self.finish_reason if update is None or update.finished else None}
        if self.arrival_time is not None and self.first_token_time is not None and (update is None or update.finished):
            meta["time_to_first_token"] = max(self.first_token_time - self.arrival_time, 0.0)
        if self.spec_accept_length is not None and (update is None or update.finished):
            meta["spec_accept_length"] = self.spec_accept_length
        if self.return_logprob:
            n = len(self.output_token_logprobs) if update is None else update.num_token_logprobs
            meta["input_token_logprobs"] = _entries(self.input_token_logprobs, token_text)
            meta["input_top_logprobs"] = _top_entries(self.input_top_logprobs, token_text)
            meta["output_token_logprobs"] = _entries(self.output_token_logprobs[:n], token_text)
            meta["output_top_logprobs"] = _top_entries(self.output_top_logprobs[:n], token_text)
        return meta

    def native_result(self, rid: str, token_text: Optional[Callable[[int], str]] = None,
                      update: Optional[ChoiceUpdate] = None) -> dict:
        """The native API's result object; with `update` (from an accumulator made with snapshot_ids), the text,
        ids and counts as of that update."""
        text, ids = (self.text, list(self.output_ids)) if update is None else (update.text, update.output_ids)
        return {"text": text, "output_ids": ids, "meta_info": self.meta_info(rid, token_text, update)}


@dataclass
class _Abort:
    """A scheduler-output-shaped record for a choice finished on this side."""

    index: int
    output_ids_offset: int
    finish_reason: dict
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    completion_tokens_wo_jump_forward: int
    new_token_ids: tuple = ()
    finished: bool = True
    output_token_logprobs: None = None
    output_top_logprobs: None = None
    input_token_logprobs: None = None
    input_top_logprobs: None = None


def _entries(entries: Optional[list], token_text: Optional[Callable[[int], str]]) -> Optional[list]:
    if entries is None:
        return None
    if token_text is None:
        return [[lp, tid] for lp, tid in entries]
    return [[lp, tid, token_text(tid)] for lp, tid in entries]


def _top_entries(entries: Optional[list], token_text: Optional[Callable[[int], str]]) -> Optional[list]:
    if entries is None:
        return None
    return [None if pos is None else _entries(pos, token_text) for pos in entries]
