"""Intake: checking a request against the model and pool, fanning out n > 1 samples, compiling grammars.

`RequestIntake.add` turns one submitted request into the requests the scheduler queues: itself, or for n > 1 its
n samples (after an internal prefill of the shared prompt when the radix cache can share it). Requests with a
grammar wait in the grammar queue until it compiled (on the grammar engine's workers).
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Optional

from braid.runtime.constrained.grammar_errors import GrammarBusyError, GrammarError
from braid.runtime.core import FinishReason, Req
from braid.runtime.error_kind import ErrorKind
from braid.runtime.request_checks import RequestLimits, check_request
from braid.runtime.sampling_params import GRAMMAR_FIELDS


def error_kind_of(exc: BaseException) -> ErrorKind:
    """The kind of an exception raised while adding a request or compiling its grammar: the compile queue full is a
    load condition, any other grammar failure (timeouts included) the grammar's fault, any other ValueError the
    request's (RequestError, SamplingParamsError), anything else a bug."""
    if isinstance(exc, GrammarBusyError):
        return ErrorKind.GRAMMAR_BUSY
    if isinstance(exc, GrammarError):
        return ErrorKind.GRAMMAR_INVALID
    return ErrorKind.INVALID_REQUEST if isinstance(exc, ValueError) else ErrorKind.INTERNAL


def validate_request(req: Req, limits: RequestLimits, grammar_backend) -> None:
    """grammar_backend: a callable returning the GrammarBackend (started only for requests with a grammar)."""
    model_ids = req.input_ids if req.mm_inputs is None else req.mm_inputs.model_ids(req.input_ids, 0)
    check_request(limits, model_ids, req.sampling_params, req.logprob_start_len, req.top_logprobs_num)
    grammar = req.sampling_params.grammar()
    if grammar is not None:
        grammar_backend().validate(*grammar)


def fan_out(req: Req, share_prefill: bool) -> tuple[Optional[Req], list[Req]]:
    """An n > 1 request as n requests (seeds seed + i). With share_prefill, also an internal prefill-only parent:
    the prompt is computed once and the n samples share its KV through the radix cache."""
    sp = req.sampling_params
    children = [Req(rid=req.rid, index=i, input_ids=list(req.input_ids),
                    sampling_params=sp.merged(n=1, seed=None if sp.seed is None else sp.seed + i),
                    return_logprob=req.return_logprob, logprob_start_len=req.logprob_start_len,
                    top_logprobs_num=req.top_logprobs_num, stream=req.stream, mm_inputs=req.mm_inputs,
                    lora_path=req.lora_path)
                for i in range(sp.n)]
    if not share_prefill:
        return None, children
    prefill_only = dataclasses.replace(sp, n=1, max_new_tokens=0, min_new_tokens=0, **dict.fromkeys(GRAMMAR_FIELDS))
    parent = Req(rid=req.rid, index=-1, input_ids=list(req.input_ids), sampling_params=prefill_only, is_internal=True,
                 mm_inputs=req.mm_inputs, lora_path=req.lora_path)
    return parent, children


class RequestIntake:
    def __init__(self, server_args, tokenizer, vocab_size: int, context_len: int, kv_pool_size: int,
                 share_prefill: bool):
        self.server_args = server_args
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.kv_pool_size = kv_pool_size
        self.share_prefill = share_prefill
        self.grammar_queue: list[tuple[Req, Future]] = []
        self.pending_children: dict[int, list[Req]] = {}  # n > 1: id(prefill parent) -> its samples
        self.num_requests = 0
        self._grammar_backend = None

    @property
    def grammar_backend(self):
        if self._grammar_backend is None:
            from braid.runtime.constrained.grammar import GrammarBackend

            args = self.server_args
            self._grammar_backend = GrammarBackend(
                self.tokenizer, self.vocab_size, args.constrained_json_whitespace_pattern,
                timeout_s=args.grammar_timeout_s, num_workers=args.grammar_workers, engine=args.grammar_backend,
                max_queued=args.grammar_max_queued, max_queued_per_client=args.grammar_max_queued_per_client,
                cache_size=args.grammar_cache_size, json_strict=args.grammar_json_strict)
        return self._grammar_backend

    def grammar_stats(self) -> Optional[dict]:
        """The grammar backend's counters (GrammarBackend.stats); None until a request with a grammar started it."""
        return None if self._grammar_backend is None else self._grammar_backend.stats()

    def add(self, req: Req) -> list[Req]:
        """Validate (raises RequestError / SamplingParamsError / GrammarError); the requests ready to wait for
        admission now (the others wait for their grammar)."""
        validate_request(req, RequestLimits(self.vocab_size, self.context_len, self.kv_pool_size),
                         lambda: self.grammar_backend)
        self.num_requests += 1
        if req.sampling_params.n == 1:
            return self.enqueue([req])
        parent, children = fan_out(req, self.share_prefill)
        if parent is None:
            return self.enqueue(children)
        self.pending_children[id(parent)] = children
        return self.enqueue([parent])

    def enqueue(self, reqs: list[Req]) -> list[Req]:
        ready = []
        for req in reqs:
            sp = req.sampling_params
            grammar = sp.grammar()
            if grammar is None:
                ready.append(req)
                continue
            fut = self.grammar_backend.submit(*grammar, client=req.client)
            if self.compiled_now(req, fut):  # compiled before: admissible at once, not a step later
                req.grammar = fut.result().new_state()
                ready.append(req)
            else:
                self.grammar_queue.append((req, fut))
        return ready

    def compiled_now(self, req: Req, fut) -> bool:
        """Whether `req` skips the grammar queue: its grammar is compiled already. (Under tensor parallelism rank 0
        decides this for every rank: processes/tensor_parallel.GrammarGate replaces it.)"""
        return fut.done() and fut.exception() is None

    def poll_grammars(self) -> tuple[list[Req], list[tuple[Req, FinishReason]]]:
        """(requests whose grammar is ready, requests whose grammar failed with their abort reason)."""
        ready, failed, still = [], [], []
        for req, fut in self.grammar_queue:
            if not fut.done():
                still.append((req, fut))
                continue
            try:
                req.grammar = fut.result().new_state()
                ready.append(req)
            except Exception as e:  # GrammarError, timeouts, the compile queue full (GrammarBusyError)
                # any other failure of the compile (a worker that died, too) is answered as the grammar's
                busy = error_kind_of(e) == ErrorKind.GRAMMAR_BUSY
                kind = ErrorKind.GRAMMAR_BUSY if busy else ErrorKind.GRAMMAR_INVALID
                label = "grammar compiler busy" if busy else "grammar error"
                failed.append((req, FinishReason("abort", message=f"{label}: {e}", kind=kind)))
        self.grammar_queue = still
        return ready, failed

    def abort(self, rid: str, reason: FinishReason) -> list[Req]:
        """Drop `rid` from the grammar queue (returned: they must be finished) and mark its unstarted samples."""
        dropped = [r for r, _ in self.grammar_queue if r.rid == rid]
        self.grammar_queue = [(r, f) for r, f in self.grammar_queue if r.rid != rid]
        for children in self.pending_children.values():
            for child in children:
                if child.rid == rid:
                    child.finished_reason = reason
        return dropped

    def prefill_done(self, parent: Req, reason: FinishReason) -> tuple[list[Req], list[Req]]:
        """An internal prefill parent finished: (samples to queue, samples to report as finished)."""
        start, done = [], []
        for child in self.pending_children.pop(id(parent), []):
            if reason.type == "abort" or child.finished:
                child.finished_reason = child.finished_reason or reason
                done.append(child)
            else:
                start.append(child)
        return start, done

    def shutdown(self) -> None:
        if self._grammar_backend is not None:
            self._grammar_backend.shutdown()
