"""The scheduler: queues, batch selection under the KV budget, forward, sampling, finish checks, outputs.

One iteration (`step`): admit grammar-ready requests -> pick a batch (extend first, else decode, retracting
when decode runs out of KV) -> ModelRunner.forward -> sample -> update requests -> outputs.

Overlapped decode (CUDA, unless --disable-overlap-schedule): consecutive decode steps are chained on the device.
Step N+1 is launched with step N's sampled ids still on the GPU, and only then does the host wait for step N's
ids (a pinned copy behind an event) and do its bookkeeping (finish checks, stop strings, outputs) while the GPU
runs N+1. A request that finishes at step N has already been fed to N+1: that one extra token is dropped.
Batches with grammars, penalties, logprobs or pending min_new_tokens, and any step with an extend to run,
take the plain synchronous path.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from concurrent.futures import Future
from typing import Optional

import torch

from braid.runtime.config import ServerArgs
from braid.runtime.core import FinishReason, ForwardBatch, ForwardMode, Req, ReqOutput
from braid.runtime.layers.sampler import Sampler, SamplingBatchInfo, apply_penalties, token_logprobs
from braid.runtime.loader.tokenizer import get_tokenizer
from braid.runtime.mem_cache.chunk_cache import ChunkCache
from braid.runtime.mem_cache.radix_cache import RadixCache
from braid.runtime.model_executor.model_runner import ModelRunner
from braid.runtime.scheduler.policy import order_waiting

logger = logging.getLogger(__name__)

_INIT_NEW_TOKEN_RATIO = 0.7
_MIN_NEW_TOKEN_RATIO = 0.1
_NEW_TOKEN_RATIO_DECAY = 0.001
# a waiting request whose next this-many uncached tokens equal those of a request in the batch waits one round
_IN_BATCH_PREFIX_MIN = 32


@dataclasses.dataclass
class _DecodeInFlight:
    """A launched decode step whose sampled ids the host has not read yet."""

    reqs: list[Req]
    next_ids: torch.Tensor  # [B] int64 on the device: the next step's input ids
    host_ids: torch.Tensor  # [B] int64, pinned: filled by an async copy of next_ids
    ready: Optional[torch.cuda.Event]  # recorded after that copy


class RequestError(ValueError):
    """Bad input in a request (prompt too long, ...). `param` names the field."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


class Scheduler:
    def __init__(self, server_args: ServerArgs):
        self.server_args = server_args
        if torch.device(server_args.resolved_device).type == "cpu":
            from braid.runtime.layers.cpu_tuning import tune_malloc_for_cpu_inference

            tune_malloc_for_cpu_inference()
        self.runner = ModelRunner(server_args)
        self.tokenizer = get_tokenizer(server_args)
        self.device = self.runner.device
        self.context_len = self.runner.context_len
        self.vocab_size = self.runner.vocab_size
        self.req_to_token_pool = self.runner.req_to_token_pool
        self.kv_pool = self.runner.token_to_kv_pool
        cache_cls = ChunkCache if server_args.disable_radix_cache else RadixCache
        self.tree_cache = cache_cls(self.req_to_token_pool, self.kv_pool)
        self.sampler = Sampler()
        eos = set(self.runner.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = eos
        self._grammar_backend = None
        self.overlap = self.device.type == "cuda" and not server_args.disable_overlap_schedule
        self.decode_in_flight: Optional[_DecodeInFlight] = None

        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.grammar_queue: list[tuple[Req, Future]] = []
        self.resume_queue: deque[Req] = deque()  # hold KV, need an extend (chunked prefill, jump-forward)
        self.pending_children: dict[int, list[Req]] = {}  # n > 1: id(prefill parent) -> children
        self.outputs: list[ReqOutput] = []
        self.new_token_ratio = _INIT_NEW_TOKEN_RATIO
        self.stats = dict(num_prompt_tokens_total=0, num_computed_prompt_tokens_total=0, num_cached_tokens_total=0,
                          num_generated_tokens_total=0, num_forward_extend=0, num_forward_decode=0,
                          num_retractions=0, num_requests_total=0, num_tokens_through_model_total=0,
                          num_decode_overlapped=0)

    # ------------------------------------------------------------------ requests
    @property
    def grammar_backend(self):
        if self._grammar_backend is None:
            from braid.runtime.constrained.grammar import GrammarBackend

            self._grammar_backend = GrammarBackend(self.tokenizer, self.vocab_size,
                                                   self.server_args.constrained_json_whitespace_pattern,
                                                   timeout_s=self.server_args.grammar_timeout_s)
        return self._grammar_backend

    def validate_request(self, req: Req) -> None:
        sp = req.sampling_params
        sp.verify(self.vocab_size)
        if not req.input_ids:
            raise RequestError("the prompt is empty", "prompt")
        if any((not isinstance(t, int)) or t < 0 or t >= self.vocab_size for t in req.input_ids):
            raise RequestError("input_ids contain a token id outside the vocabulary", "input_ids")
        if len(req.input_ids) >= self.context_len:
            raise RequestError(f"the prompt has {len(req.input_ids)} tokens; the model's context is {self.context_len}",
                               "prompt")
        if len(req.input_ids) + sp.max_new_tokens > self.context_len:
            raise RequestError(f"prompt ({len(req.input_ids)} tokens) + max_new_tokens ({sp.max_new_tokens}) exceeds "
                               f"the context length {self.context_len}", "max_new_tokens")
        if len(req.input_ids) + sp.max_new_tokens > self.kv_pool.size:
            raise RequestError(f"prompt + max_new_tokens ({len(req.input_ids) + sp.max_new_tokens}) exceeds the KV pool "
                               f"({self.kv_pool.size} tokens)", "max_new_tokens")
        if req.top_logprobs_num < 0 or req.top_logprobs_num > 20:
            raise RequestError("top_logprobs_num must be in [0, 20]", "top_logprobs_num")
        if req.logprob_start_len >= len(req.input_ids):
            raise RequestError("logprob_start_len must be < the prompt length", "logprob_start_len")
        if sp.regex is not None:
            self.grammar_backend.validate("regex", sp.regex)
        if sp.json_schema is not None:
            self.grammar_backend.validate("json", sp.json_schema)

    def add_request(self, req: Req) -> None:
        self.validate_request(req)
        self.stats["num_requests_total"] += 1
        sp = req.sampling_params
        if sp.n == 1:
            self._enqueue(req)
            return
        children = []
        for i in range(sp.n):
            child_sp = sp.merged(n=1, seed=None if sp.seed is None else sp.seed + i)
            children.append(Req(rid=req.rid, index=i, input_ids=list(req.input_ids), sampling_params=child_sp,
                                return_logprob=req.return_logprob, logprob_start_len=req.logprob_start_len,
                                top_logprobs_num=req.top_logprobs_num, stream=req.stream))
        if self.tree_cache.disabled:
            for c in children:
                self._enqueue(c)
            return
        # prefill the prompt once; the n samples then share its KV through the radix cache
        prefill_only = dataclasses.replace(sp, n=1, max_new_tokens=0, min_new_tokens=0, regex=None, json_schema=None)
        parent = Req(rid=req.rid, index=-1, input_ids=list(req.input_ids), sampling_params=prefill_only, is_internal=True)
        self.pending_children[id(parent)] = children
        self._enqueue(parent)

    def _enqueue(self, req: Req) -> None:
        sp = req.sampling_params
        if sp.seed is not None:
            req.generator = torch.Generator(device=self.device).manual_seed(sp.seed)
        if sp.regex is not None or sp.json_schema is not None:
            kind, spec = ("regex", sp.regex) if sp.regex is not None else ("json", sp.json_schema)
            self.grammar_queue.append((req, self.grammar_backend.submit(kind, spec)))
        else:
            self.waiting.append(req)

    def abort_request(self, rid: str) -> None:
        reason = FinishReason("abort", message="aborted by request")
        for req in [r for r in self.waiting if r.rid == rid]:
            self.waiting.remove(req)
            self._finish(req, reason)
        for req, _ in [(r, f) for r, f in self.grammar_queue if r.rid == rid]:
            self._finish(req, reason)
        self.grammar_queue = [(r, f) for r, f in self.grammar_queue if r.rid != rid]
        for key, children in self.pending_children.items():
            for child in [c for c in children if c.rid == rid]:
                child.finished_reason = reason
        # requests holding KV are released at the start of the next step, outside any forward pass
        in_flight = self.decode_in_flight.reqs if self.decode_in_flight is not None else []
        for req in list(self.running) + list(self.resume_queue) + in_flight:
            if req.rid == rid and not req.finished:
                req.finished_reason = reason

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.grammar_queue or self.resume_queue or self.outputs
                    or self.decode_in_flight is not None)

    def flush_cache(self) -> bool:
        if self.waiting or self.running or self.resume_queue or self.grammar_queue or self.decode_in_flight:
            return False
        self.tree_cache.reset()
        return True

    def kv_used_tokens(self) -> int:
        return self.kv_pool.size - self.kv_pool.available_size() - self.tree_cache.evictable_size()

    def get_stats(self) -> dict:
        s = dict(self.stats)
        s.update(
            num_running_reqs=len(self.running) + len(self.resume_queue) + (
                len(self.decode_in_flight.reqs) if self.decode_in_flight is not None else 0),
            num_waiting_reqs=len(self.waiting) + len(self.grammar_queue),
            kv_total_tokens=self.kv_pool.size,
            kv_free_tokens=self.kv_pool.available_size(),
            kv_cached_tokens=self.tree_cache.evictable_size(),
            kv_used_tokens=self.kv_used_tokens(),
            cache_hit_rate=(s["num_cached_tokens_total"] / s["num_prompt_tokens_total"]) if s["num_prompt_tokens_total"] else 0.0,
            new_token_ratio=self.new_token_ratio,
        )
        return s

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[ReqOutput]:
        self._poll_grammars()
        self._release_aborted()
        if self.decode_in_flight is not None:
            if self._chain_decode():
                out, self.outputs = self.outputs, []
                return out
            self._commit_in_flight()
        batch = self._get_extend_batch()
        if batch:
            self._run_extend(batch)
        elif self.running:
            self._retract_if_needed()  # may send every running request back to the queue
            if self.running and self.overlap and self._can_overlap(self.running, 0):
                batch, self.running = self.running, []
                self.decode_in_flight = self._launch_decode(batch, None)
            elif self.running:
                self._run_decode()
        out, self.outputs = self.outputs, []
        return out

    def _release_aborted(self) -> None:
        for queue_name in ("running", "resume_queue"):
            queue = getattr(self, queue_name)
            if any(r.finished for r in queue):
                for r in [r for r in queue if r.finished]:
                    self._finish(r, r.finished_reason)
                setattr(self, queue_name, type(queue)(r for r in queue if not r.finished))

    def _poll_grammars(self) -> None:
        still = []
        for req, fut in self.grammar_queue:
            if not fut.done():
                still.append((req, fut))
                continue
            try:
                req.grammar = fut.result().new_state()
                self.waiting.append(req)
            except Exception as e:  # GrammarError, timeouts
                self._finish(req, FinishReason("abort", message=f"grammar error: {e}"))
        self.grammar_queue = still

    # ------------------------------------------------------------------ memory
    def _alloc_kv(self, n: int) -> Optional[torch.Tensor]:
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        if self.kv_pool.available_size() < n:
            self.tree_cache.evict(n - self.kv_pool.available_size())
        return self.kv_pool.alloc(n)

    def _available_kv(self) -> int:
        return self.kv_pool.available_size() + self.tree_cache.evictable_size()

    def _reserved_decode_tokens(self) -> int:
        return sum(int((r.sampling_params.max_new_tokens - len(r.output_ids)) * self.new_token_ratio) for r in self.running)

    # ------------------------------------------------------------------ extend
    def _get_extend_batch(self) -> list[Req]:
        if not self.waiting and not self.resume_queue:
            return []
        chunk_budget = self.server_args.chunked_prefill_size
        if chunk_budget == -1:
            chunk_budget = 1 << 30
        token_budget = min(self.server_args.max_prefill_tokens, chunk_budget)
        kv_budget = self._available_kv() - self._reserved_decode_tokens()
        batch: list[Req] = []
        running_slots = self.server_args.max_running_requests - len(self.running)

        # requests that already hold KV: chunked prefill continuations and jump-forward extends
        while self.resume_queue and token_budget > 0:
            req = self.resume_queue[0]
            remaining = len(req.fill_ids) - req.kv_committed_len
            if kv_budget < min(remaining, token_budget):
                break
            self.resume_queue.popleft()
            self._set_extend_len(req, remaining, token_budget)
            token_budget -= req.extend_input_len
            kv_budget -= req.extend_input_len
            batch.append(req)
        if token_budget <= 0 or running_slots - len(batch) <= 0 or not self.waiting:
            return batch

        self.waiting = order_waiting(self.waiting, self.server_args.schedule_policy, self.tree_cache)
        admitted = []
        reserved_new = 0
        for req in self.waiting:
            if token_budget <= 0 or len(batch) >= running_slots:
                break
            if self.req_to_token_pool.available_size() == 0:
                break
            prefix_len = len(req.prefix_indices)
            if self._shares_prefix_with_batch(req, admitted):
                continue  # computing it now would duplicate a prefix this batch computes; next round it is cached
            extend = len(req.fill_ids) - prefix_len
            decode_need = int((req.sampling_params.max_new_tokens - len(req.output_ids)) * self.new_token_ratio)
            take = min(extend, token_budget)
            # lock before evicting so this request's own prefix survives
            self.tree_cache.inc_lock_ref(req.last_node)
            kv_budget = (self._available_kv() - self._reserved_decode_tokens() - reserved_new
                         - sum(r.extend_input_len for r in batch))
            if take < extend:
                # only chunk when it fits; a chunked request continues through resume_queue
                if take + decode_need > kv_budget and batch:
                    self.tree_cache.dec_lock_ref(req.last_node)
                    break
            if (take + (decode_need if take == extend else 0)) > kv_budget:
                self.tree_cache.dec_lock_ref(req.last_node)
                break
            idx = self.req_to_token_pool.alloc()
            req.req_pool_idx = idx
            if prefix_len:
                self.req_to_token_pool.req_to_token[idx, :prefix_len] = req.prefix_indices.to(torch.int32)
            req.kv_committed_len = prefix_len
            if req.retracted_count == 0 and not req.output_ids:
                req.cached_tokens = prefix_len
                self.stats["num_prompt_tokens_total"] += len(req.input_ids)
                self.stats["num_cached_tokens_total"] += prefix_len
            self._set_extend_len(req, extend, token_budget)
            token_budget -= req.extend_input_len
            reserved_new += decode_need
            admitted.append(req)
            batch.append(req)
        if admitted:
            ids = {id(r) for r in admitted}
            self.waiting = [r for r in self.waiting if id(r) not in ids]
        return batch

    def _shares_prefix_with_batch(self, req: Req, admitted: list[Req]) -> bool:
        if self.tree_cache.disabled or not admitted:
            return False
        start = len(req.prefix_indices)
        probe = req.fill_ids[start:start + _IN_BATCH_PREFIX_MIN]
        if len(probe) < _IN_BATCH_PREFIX_MIN:
            return False
        return any(other.fill_ids[start:start + _IN_BATCH_PREFIX_MIN] == probe
                   and other.fill_ids[:start] == req.fill_ids[:start] for other in admitted)

    @staticmethod
    def _set_extend_len(req: Req, remaining: int, token_budget: int) -> None:
        req.extend_input_len = min(remaining, token_budget)
        req.is_chunked = req.extend_input_len < remaining

    def _run_extend(self, batch: list[Req]) -> None:
        lens = [r.extend_input_len for r in batch]
        out_loc = self._alloc_kv(sum(lens))
        if out_loc is None:
            raise RuntimeError("KV pool exhausted during extend admission (scheduler accounting bug)")
        input_ids, positions, logits_rows, logprob_plan = [], [], [], []
        offset = 0
        prefix_lens = []
        for req, n in zip(batch, lens):
            start = req.kv_committed_len
            prefix_lens.append(start)
            self.req_to_token_pool.req_to_token[req.req_pool_idx, start:start + n] = out_loc[offset:offset + n].to(torch.int32)
            input_ids.extend(req.fill_ids[start:start + n])
            positions.extend(range(start, start + n))
            computed_prompt = max(0, min(start + n, len(req.input_ids)) - start)
            self.stats["num_computed_prompt_tokens_total"] += computed_prompt
            # prompt logprobs: logits at position p score token p + 1
            if req.return_logprob and req.logprob_start_len >= 0 and req.input_token_logprobs is None:
                lo = max(start, req.logprob_start_len - 1, 0)
                hi = max(lo, min(start + n, len(req.input_ids) - 1))
                logprob_plan.append((req, len(logits_rows), lo, hi, start + n))
                logits_rows.extend(range(offset + lo - start, offset + hi - start))
            offset += n
        self.stats["num_tokens_through_model_total"] += offset
        self.stats["num_forward_extend"] += 1
        B = len(batch)
        dev = self.device
        ext = torch.tensor(lens, dtype=torch.int32, device=dev)
        seq_lens_cpu = [p + n for p, n in zip(prefix_lens, lens)]
        fb = ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=B,
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            req_pool_indices=torch.tensor([r.req_pool_idx for r in batch], dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(seq_lens_cpu, dtype=torch.int32, device=dev),
            out_cache_loc=out_loc, seq_lens_cpu=seq_lens_cpu,
            extend_prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32, device=dev),
            extend_seq_lens=ext,
            extend_start_loc=torch.cumsum(ext, 0, dtype=torch.int32) - ext,
            extend_prefix_lens_cpu=prefix_lens, extend_seq_lens_cpu=lens,
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=dev) if logits_rows else None,
        )
        logits = self.runner.forward(fb)
        for req, n in zip(batch, lens):
            req.kv_committed_len += n
        self._record_input_logprobs(logprob_plan, logits.extra_logits)

        sample_reqs, sample_rows = [], []
        for i, req in enumerate(batch):
            if req.is_chunked:
                self.tree_cache.cache_unfinished_req(req)
                self.resume_queue.append(req)
            elif req.sampling_params.max_new_tokens == 0:
                self._finish(req, FinishReason("length"))  # prefill only (cache warm-up, prompt logprobs)
            else:
                # publish the prompt's KV now, so requests arriving while this one decodes share it
                self.tree_cache.cache_unfinished_req(req)
                sample_reqs.append(req)
                sample_rows.append(i)
        if sample_reqs:
            rows = torch.tensor(sample_rows, dtype=torch.int64, device=dev)
            self._sample_and_update(sample_reqs, logits.next_token_logits.index_select(0, rows))

    def _record_input_logprobs(self, plan, extra_logits) -> None:
        for req, row0, lo, hi, chunk_end in plan:
            if req.input_logprobs_partial is None:
                req.input_logprobs_partial = ([], [])
                if req.logprob_start_len == 0:
                    req.input_logprobs_partial[0].append((None, req.input_ids[0]))
                    req.input_logprobs_partial[1].append(None)
            token_lps, top_lps = req.input_logprobs_partial
            if hi > lo:
                targets = req.input_ids[lo + 1:hi + 1]
                lp, top_v, top_i = token_logprobs(extra_logits[row0:row0 + hi - lo],
                                                  torch.tensor(targets, dtype=torch.int64, device=self.device),
                                                  req.top_logprobs_num)
                token_lps.extend(zip(lp.tolist(), targets))
                if top_v is not None:
                    top_lps.extend([list(zip(v, i)) for v, i in zip(top_v.tolist(), top_i.tolist())])
                else:
                    top_lps.extend([None] * (hi - lo))
            if chunk_end >= len(req.input_ids) - 1:
                req.input_token_logprobs, req.input_top_logprobs = token_lps, top_lps
                req.input_logprobs_partial = None

    # ------------------------------------------------------------------ decode
    def _run_decode(self) -> None:
        batch = self.running
        logits = self._forward_decode(batch, None)
        self.running = []
        self._sample_and_update(batch, logits)

    def _forward_decode(self, batch: list[Req], input_ids: Optional[torch.Tensor]) -> torch.Tensor:
        """One decode forward of `batch` (input_ids [B] on the device, or each request's last token) -> logits [B, V]."""
        B = len(batch)
        out_loc = self._alloc_kv(B)
        dev = self.device
        seq_lens_cpu = [r.kv_committed_len + 1 for r in batch]
        req_idx = torch.tensor([r.req_pool_idx for r in batch], dtype=torch.int64, device=dev)
        positions = torch.tensor([s - 1 for s in seq_lens_cpu], dtype=torch.int64, device=dev)
        self.req_to_token_pool.req_to_token[req_idx, positions] = out_loc.to(torch.int32)
        if input_ids is None:
            input_ids = torch.tensor([r.fill_ids[-1] for r in batch], dtype=torch.int64, device=dev)
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=B, input_ids=input_ids,
            positions=positions, req_pool_indices=req_idx,
            seq_lens=torch.tensor(seq_lens_cpu, dtype=torch.int32, device=dev),
            out_cache_loc=out_loc, seq_lens_cpu=seq_lens_cpu,
        )
        self.stats["num_forward_decode"] += 1
        self.stats["num_tokens_through_model_total"] += B
        logits = self.runner.forward(fb)
        for r in batch:
            r.kv_committed_len += 1
        self.new_token_ratio = max(_MIN_NEW_TOKEN_RATIO, self.new_token_ratio - _NEW_TOKEN_RATIO_DECAY)
        return logits.next_token_logits

    # ------------------------------------------------------------------ overlapped decode
    def _can_overlap(self, batch: list[Req], tokens_in_flight: int) -> bool:
        """True when sampling these requests needs nothing the host learns from the step before
        (each has `tokens_in_flight` sampled tokens not yet in output_ids)."""
        for r in batch:
            sp = r.sampling_params
            if (r.grammar is not None or r.return_logprob or sp.frequency_penalty or sp.presence_penalty
                    or sp.repetition_penalty != 1.0 or len(r.output_ids) + tokens_in_flight < sp.min_new_tokens):
                return False
        return True

    def _will_finish_by_length(self, r: Req) -> bool:
        # with the token in flight it has len(output_ids) + 1 outputs
        return len(r.output_ids) + 1 >= r.sampling_params.max_new_tokens or r.seqlen + 1 >= self.context_len

    def _launch_decode(self, batch: list[Req], input_ids: Optional[torch.Tensor]) -> _DecodeInFlight:
        logits = self._forward_decode(batch, input_ids)
        info = SamplingBatchInfo.build(batch, self.vocab_size, self.device)
        next_ids = self.sampler(logits, info)
        on_cuda = self.device.type == "cuda"
        host_ids = torch.empty(len(batch), dtype=torch.int64, pin_memory=on_cuda)
        host_ids.copy_(next_ids, non_blocking=True)
        ready = None
        if on_cuda:
            ready = torch.cuda.Event()
            ready.record()
        return _DecodeInFlight(batch, next_ids, host_ids, ready)

    def _chain_decode(self) -> bool:
        """Launch the next decode step behind the one in flight, then commit the one in flight. False: not possible."""
        prev = self.decode_in_flight
        admissible = (self.waiting and len(prev.reqs) < self.server_args.max_running_requests
                      and self.req_to_token_pool.available_size() > 0)
        if self.resume_queue or admissible:
            return False  # an extend may be due: settle the step in flight first
        keep = [i for i, r in enumerate(prev.reqs) if not r.finished and not self._will_finish_by_length(r)]
        batch = [prev.reqs[i] for i in keep]
        if not batch or not self._can_overlap(batch, 1) or self._available_kv() < len(batch):
            return False
        ids = prev.next_ids
        if len(keep) != len(prev.reqs):
            ids = ids.index_select(0, torch.tensor(keep, dtype=torch.int64, device=self.device))
        self.decode_in_flight = self._launch_decode(batch, ids)
        self.stats["num_decode_overlapped"] += 1
        self._commit(prev)
        self.running = []  # the survivors are in the step now in flight
        return True

    def _commit_in_flight(self) -> None:
        prev, self.decode_in_flight = self.decode_in_flight, None
        self._commit(prev)

    def _commit(self, step: _DecodeInFlight) -> None:
        """Read a launched step's ids and update its requests (those finished meanwhile drop their token)."""
        if step.ready is not None:
            step.ready.synchronize()
        for req, tok in zip(step.reqs, step.host_ids.tolist()):
            if req.finished:
                if req.req_pool_idx is not None:  # aborted while in flight: release it now
                    self._finish(req, req.finished_reason)
                continue
            self._append_token(req, tok, None)

    def _retract_if_needed(self) -> None:
        while self.running and self._available_kv() < len(self.running):
            # retract the request with the least progress (cheapest to recompute), keep its output
            victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.input_ids)))
            self.running.remove(victim)
            self.tree_cache.cache_finished_req(victim)  # its KV stays in the tree (evictable) for the resume
            victim.retracted_count += 1
            victim.prefix_indices = None
            self.stats["num_retractions"] += 1
            self.waiting.insert(0, victim)
            self.new_token_ratio = min(1.0, self.new_token_ratio + 0.2)
            logger.info("KV pool full: retracted request %s (%d tokens decoded)", victim.rid, len(victim.output_ids))

    # ------------------------------------------------------------------ sampling and finishing
    def _sample_and_update(self, reqs: list[Req], logits: torch.Tensor) -> None:
        info = SamplingBatchInfo.build(reqs, self.vocab_size, self.device)
        info.vocab_mask = self._vocab_mask(reqs)
        processed = apply_penalties(logits, info)
        next_ids = self.sampler(processed, info)
        want_lp = [i for i, r in enumerate(reqs) if r.return_logprob]
        lp_rows = {}
        if want_lp:
            rows = torch.tensor(want_lp, dtype=torch.int64, device=self.device)
            k = max(reqs[i].top_logprobs_num for i in want_lp)
            lp, top_v, top_i = token_logprobs(logits.index_select(0, rows), next_ids.index_select(0, rows), k)
            lp = lp.tolist()
            top_v = top_v.tolist() if top_v is not None else None
            top_i = top_i.tolist() if top_i is not None else None
            for j, i in enumerate(want_lp):
                n = reqs[i].top_logprobs_num
                lp_rows[i] = (lp[j], list(zip(top_v[j][:n], top_i[j][:n])) if n and top_v is not None else None)
        for i, (req, tok) in enumerate(zip(reqs, next_ids.tolist())):
            self._append_token(req, tok, lp_rows.get(i))

    def _append_token(self, req: Req, tok: int, logprobs: Optional[tuple]) -> None:
        req.output_ids.append(tok)
        req.fill_ids.append(tok)
        self.stats["num_generated_tokens_total"] += 1
        if req.first_token_time is None:
            req.first_token_time = time.time()
        if logprobs is not None:
            req.output_token_logprobs.append((logprobs[0], tok))
            req.output_top_logprobs.append(logprobs[1])
        self._after_token(req, tok)

    def _vocab_mask(self, reqs: list[Req]) -> Optional[torch.Tensor]:
        grammar_rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        ban_rows = [i for i, r in enumerate(reqs) if len(r.output_ids) < r.sampling_params.min_new_tokens]
        if not grammar_rows and not ban_rows:
            return None
        mask = torch.ones(len(reqs), self.vocab_size, dtype=torch.bool, device=self.device)
        for i in grammar_rows:
            mask[i] = False
            reqs[i].grammar.fill_vocab_mask(mask, i)
        for i in ban_rows:
            r = reqs[i]
            banned = set() if r.sampling_params.ignore_eos else set(self.eos_token_ids)
            banned |= set(r.sampling_params.stop_token_ids or ())
            if banned:
                row = mask[i].clone()
                row[list(banned)] = False
                if row.any():
                    mask[i] = row
        return mask

    def _after_token(self, req: Req, tok: int) -> None:
        sp = req.sampling_params
        reason = None
        if req.grammar is not None:
            req.grammar.accept_token(tok)
        if not sp.ignore_eos and tok in self.eos_token_ids and len(req.output_ids) >= sp.min_new_tokens:
            reason = FinishReason("stop", matched=tok)
        elif sp.stop_token_ids and tok in sp.stop_token_ids:
            reason = FinishReason("stop", matched=tok)
        elif sp.stop and (matched := self._match_stop_str(req)) is not None:
            reason = FinishReason("stop", matched=matched)
        elif req.grammar is not None and req.grammar.is_terminated():
            reason = FinishReason("stop", matched=None)
        elif len(req.output_ids) >= sp.max_new_tokens or req.seqlen >= self.context_len:
            reason = FinishReason("length")
        if reason is not None:
            self._finish(req, reason)
            return
        if req.grammar is not None and not self.server_args.disable_jump_forward:
            if self._jump_forward(req):
                return
        self.running.append(req)
        self._emit(req)

    def _match_stop_str(self, req: Req) -> Optional[str]:
        stops = req.sampling_params.stop
        longest = max(len(s) for s in stops)
        tail = self.tokenizer.decode(req.output_ids[-(longest + 2):], skip_special_tokens=False)
        for s in stops:
            if s in tail:
                return s
        return None

    def _jump_forward(self, req: Req) -> bool:
        jf = req.grammar.jump_forward(req.output_ids)
        if jf is None or (jf.num_rollback == 0 and not jf.token_ids):
            return False
        keep = len(req.output_ids) - jf.num_rollback
        req.dirty_offset = min(req.dirty_offset, keep) if req.dirty_offset is not None else keep
        req.output_ids = req.output_ids[:keep] + list(jf.token_ids)
        req.jump_forward_tokens += len(jf.token_ids) - jf.num_rollback
        req.fill_ids = req.input_ids + req.output_ids
        new_committed = min(req.kv_committed_len, len(req.input_ids) + keep)
        if new_committed < req.kv_committed_len:
            tree_owned = len(req.prefix_indices) if req.prefix_indices is not None else 0
            row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
            lo = max(new_committed, tree_owned)
            if lo < req.kv_committed_len:
                self.kv_pool.free(row[lo:req.kv_committed_len].long().clone())
            if req.prefix_indices is not None and new_committed < tree_owned:
                req.prefix_indices = req.prefix_indices[:new_committed]
            req.kv_committed_len = new_committed
        sp = req.sampling_params
        if len(req.output_ids) >= sp.max_new_tokens or req.seqlen >= self.context_len:
            req.output_ids = req.output_ids[:sp.max_new_tokens]
            req.fill_ids = req.input_ids + req.output_ids
            req.kv_committed_len = min(req.kv_committed_len, len(req.fill_ids) - 1)
            self._finish(req, FinishReason("length"))
            return True
        if req.grammar.is_terminated():
            self._finish(req, FinishReason("stop", matched=None))
            return True
        self.resume_queue.append(req)
        self._emit(req)
        return True

    def _release(self, req: Req) -> None:
        if req.req_pool_idx is not None:
            req.fill_ids = req.input_ids + req.output_ids
            req.kv_committed_len = min(req.kv_committed_len, len(req.fill_ids))
            self.tree_cache.cache_finished_req(req)
        req.last_node = None

    def _finish(self, req: Req, reason: FinishReason) -> None:
        req.finished_reason = reason
        self._release(req)
        if req.is_internal:
            for child in self.pending_children.pop(id(req), []):
                if reason.type == "abort" or child.finished:
                    child.finished_reason = child.finished_reason or reason
                    self._emit(child)
                else:
                    self._enqueue(child)
            return
        self._emit(req)

    def _emit(self, req: Req) -> None:
        if req.is_internal:
            return
        if not req.finished and not req.stream:
            return
        offset = req.sent_offset if req.dirty_offset is None else min(req.sent_offset, req.dirty_offset)
        lp_off = req.sent_logprob_offset
        out = ReqOutput(
            rid=req.rid, index=req.index, output_ids_offset=offset, new_token_ids=req.output_ids[offset:],
            finished=req.finished, finish_reason=req.finished_reason.to_json() if req.finished else None,
            prompt_tokens=len(req.input_ids), completion_tokens=len(req.output_ids), cached_tokens=req.cached_tokens,
            completion_tokens_wo_jump_forward=len(req.output_ids) - req.jump_forward_tokens,
            output_token_logprobs=req.output_token_logprobs[lp_off:] if req.return_logprob else None,
            output_top_logprobs=req.output_top_logprobs[lp_off:] if req.return_logprob else None,
            input_token_logprobs=req.input_token_logprobs if (req.return_logprob and not req.sent_input_logprobs) else None,
            input_top_logprobs=req.input_top_logprobs if (req.return_logprob and not req.sent_input_logprobs) else None,
        )
        if req.return_logprob and req.input_token_logprobs is not None:
            req.sent_input_logprobs = True
        req.sent_offset = len(req.output_ids)
        req.sent_logprob_offset = len(req.output_token_logprobs)
        req.dirty_offset = None
        self.outputs.append(out)
