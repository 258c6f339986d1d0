"""Prefill: which waiting requests enter the next extend batch (queue order, token and KV budgets, chunking), and
the extend batch's tensors.

Order: `lpm` (longest cached prefix first) matches every waiting request against the radix tree and sorts; a
request that has waited LPM_MAX_WAIT_S goes ahead of the sort (in arrival order), so a stream of requests sharing
a long prefix cannot starve one that shares none. Past LPM_MAX_QUEUE waiting requests matching the whole queue
every step costs more than it saves: the queue is taken in arrival order and each request is matched only when
admission reaches it. `dfs-weight` (matched and aged like lpm) and `random`: queue_order.py; `fcfs`: arrival order.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch

from braid.runtime.core import ForwardBatch, ForwardMode, Req, batch_lora_paths, host_to_device
from braid.runtime.multimodal.inputs import item_aligned_chunk_len, item_aligned_prefix_len
from braid.runtime.scheduler.queue_order import RandomOrder, dfs_weight_order

LPM_MAX_QUEUE = 128
LPM_MAX_WAIT_S = 5.0
# a waiting request whose next this-many uncached tokens equal those of a request in the batch waits one round
_IN_BATCH_PREFIX_MIN = 32


def max_prefix_len(req: Req) -> int:
    """How much of fill_ids may come from the cache: at least one token must run through the model (it yields the
    next-token logits), and prompt logprobs from logprob_start_len need the logits of the tokens before it."""
    limit = len(req.fill_ids) - 1
    if wants_prompt_logprobs(req):
        limit = min(limit, max(req.logprob_start_len - 1, 0))
    return max(limit, 0)


def wants_prompt_logprobs(req: Req) -> bool:
    return req.return_logprob and req.logprob_start_len >= 0 and req.input_token_logprobs is None


def match_prefix(req: Req, prefix_cache) -> None:
    req.fill_ids = req.input_ids + req.output_ids
    req.prefix_indices, req.last_node = prefix_cache.match_prefix(req.fill_ids[: max_prefix_len(req)],
                                                                namespace=req.lora_path)
    if req.mm_inputs is not None:  # an image or video is computed whole or taken whole from the cache
        req.prefix_indices = req.prefix_indices[:item_aligned_prefix_len(req.mm_inputs, len(req.prefix_indices))]


@dataclass
class PromptLogprobSlice:
    """Rows [row0, row0 + hi - lo) of the pass's prompt logprobs score req.input_ids[lo + 1 : hi + 1]."""

    req: Req
    row0: int
    lo: int
    hi: int
    chunk_end: int  # fill position this chunk reaches


class PrefillPlanner:
    def __init__(self, server_args, prefix_cache, req_to_token_pool, device: torch.device,
                 max_running_requests: Optional[int] = None):
        self.server_args = server_args
        # the scheduler's cap (derived from the KV pool when the flag is unset)
        self.max_running_requests = max_running_requests or server_args.max_running_requests
        self.prefix_cache = prefix_cache
        self.req_to_token_pool = req_to_token_pool
        self.device = device
        self.clock = time.time  # under TP every rank reads rank 0's clock here (processes/tensor_parallel.py)
        chunk = server_args.chunked_prefill_size
        self.token_budget = min(server_args.max_prefill_tokens, (1 << 30) if chunk == -1 else chunk)
        self.random_order = RandomOrder(server_args.random_seed) if server_args.schedule_policy == "random" else None

    # ---- admission ----
    def plan(self, waiting: list[Req], resume_queue: deque, num_running: int, reserved_decode: int,
             new_token_ratio: float, adapters=None) -> tuple[list[Req], list[Req]]:
        """(the extend batch, the waiting requests admitted into it). Resumed requests (chunked prefill continuations,
        jump-forward extends) hold KV already and go first. Admitted requests get a req_to_token row. adapters: the
        round's lora_admission.AdapterAdmission with LoRA on (a request it holds back stays waiting)."""
        token_budget = self.token_budget
        kv_budget = self.prefix_cache.available_slots() - reserved_decode
        batch: list[Req] = []
        running_slots = self.max_running_requests - num_running
        while resume_queue and token_budget > 0:
            req = resume_queue[0]
            remaining = len(req.fill_ids) - req.kv_committed_len
            if kv_budget < item_aligned_chunk_len(req.mm_inputs, req.kv_committed_len, min(remaining, token_budget)):
                break
            resume_queue.popleft()
            _set_extend_len(req, remaining, token_budget)
            token_budget -= req.extend_input_len
            kv_budget -= req.extend_input_len
            batch.append(req)
        if token_budget <= 0 or running_slots - len(batch) <= 0 or not waiting:
            return batch, []

        ordered, matched = self._order(waiting)
        admitted: list[Req] = []
        reserved_new = 0
        for req in ordered:
            if token_budget <= 0 or len(batch) >= running_slots or self.req_to_token_pool.available_size() == 0:
                break
            if adapters is not None and not adapters.admits(req):
                continue
            if not matched and req.req_pool_idx is None:
                match_prefix(req, self.prefix_cache)
            if self._shares_prefix_with_batch(req, admitted):
                continue  # computing it now would duplicate a prefix this batch computes; next round it is cached
            prefix_len = len(req.prefix_indices)
            extend = len(req.fill_ids) - prefix_len
            decode_need = int((req.sampling_params.max_new_tokens - len(req.output_ids)) * new_token_ratio)
            take = item_aligned_chunk_len(req.mm_inputs, prefix_len, min(extend, token_budget))
            self.prefix_cache.inc_lock_ref(req.last_node)  # before anything is evicted, so its own prefix survives
            kv_left = (self.prefix_cache.available_slots() - reserved_decode - reserved_new
                       - sum(r.extend_input_len for r in batch))
            # a chunk is taken only when the whole request fits, unless the batch would otherwise be empty
            need = take + decode_need if (take < extend and batch) or take == extend else take
            if need > kv_left:
                self.prefix_cache.dec_lock_ref(req.last_node)
                break
            self._admit(req, prefix_len)
            if adapters is not None:
                adapters.take(req)
            _set_extend_len(req, extend, token_budget)
            token_budget -= req.extend_input_len
            reserved_new += decode_need
            admitted.append(req)
            batch.append(req)
        return batch, admitted

    def _order(self, waiting: list[Req]) -> tuple[list[Req], bool]:
        """(waiting in admission order, whether every request's prefix is matched already)."""
        policy = self.server_args.schedule_policy
        if policy in ("lpm", "dfs-weight") and not self.prefix_cache.disabled and len(waiting) <= LPM_MAX_QUEUE:
            for req in waiting:
                if req.req_pool_idx is None:
                    match_prefix(req, self.prefix_cache)
            overdue = self.clock() - LPM_MAX_WAIT_S
            if policy == "dfs-weight":  # queue_order.py; overdue requests first here too
                return sorted(dfs_weight_order(waiting, self.prefix_cache.root_node),
                              key=lambda r: r.created_time > overdue), True
            # stable: ties keep arrival order
            return sorted(waiting, key=lambda r: (r.created_time > overdue, -len(r.prefix_indices))), True
        if self.random_order is not None:
            return self.random_order(waiting), False
        return waiting, False

    def _admit(self, req: Req, prefix_len: int) -> None:
        idx = self.req_to_token_pool.alloc()
        req.req_pool_idx = idx
        if prefix_len:
            self.req_to_token_pool.req_to_token[idx, :prefix_len] = req.prefix_indices.to(torch.int32)
        req.kv_committed_len = prefix_len

    def _shares_prefix_with_batch(self, req: Req, admitted: list[Req]) -> bool:
        if self.prefix_cache.disabled or not admitted:
            return False
        start = len(req.prefix_indices)
        probe = req.fill_ids[start:start + _IN_BATCH_PREFIX_MIN]
        if len(probe) < _IN_BATCH_PREFIX_MIN:
            return False
        return any(other.fill_ids[start:start + _IN_BATCH_PREFIX_MIN] == probe
                   and other.fill_ids[:start] == req.fill_ids[:start] for other in admitted)

    # ---- the batch ----
    def build_batch(self, batch: list[Req]) -> Optional[tuple[ForwardBatch, list[PromptLogprobSlice]]]:
        """The extend ForwardBatch (KV slots allocated and written to req_to_token), and where each request's prompt
        logprobs land. None if the pool cannot hold the batch (an accounting bug: admission checked it)."""
        lens = [r.extend_input_len for r in batch]
        out_loc = self.prefix_cache.alloc_slots(sum(lens))
        if out_loc is None:
            return None
        input_ids, positions, logit_rows, targets, slices, prefix_lens = [], [], [], [], [], []
        mm_inputs = [r.mm_inputs for r in batch]
        offset = 0
        req_to_token = self.req_to_token_pool.req_to_token
        for req, n in zip(batch, lens):
            start = req.kv_committed_len
            prefix_lens.append(start)
            req_to_token[req.req_pool_idx, start:start + n] = out_loc[offset:offset + n].to(torch.int32)
            input_ids.extend(_model_ids(req, req.fill_ids[start:start + n], start))
            positions.extend(range(start, start + n))
            if wants_prompt_logprobs(req):
                # the logits at position p score token p + 1
                lo = max(start, req.logprob_start_len - 1, 0)
                hi = max(lo, min(start + n, len(req.input_ids) - 1))
                slices.append(PromptLogprobSlice(req, len(logit_rows), lo, hi, start + n))
                logit_rows.extend(range(offset + lo - start, offset + hi - start))
                targets.extend(_model_ids(req, req.input_ids[lo + 1:hi + 1], lo + 1))
            offset += n
        dev = self.device
        seq_lens_cpu = [p + n for p, n in zip(prefix_lens, lens)]
        ext = host_to_device(lens, torch.int32, dev)
        fb = ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=len(batch),
            input_ids=host_to_device(input_ids, torch.int64, dev),
            positions=host_to_device(positions, torch.int64, dev),
            req_pool_indices=host_to_device([r.req_pool_idx for r in batch], torch.int64, dev),
            seq_lens=host_to_device(seq_lens_cpu, torch.int32, dev),
            out_cache_loc=out_loc, seq_lens_cpu=seq_lens_cpu,
            extend_prefix_lens=host_to_device(prefix_lens, torch.int32, dev),
            extend_seq_lens=ext,
            extend_start_loc=torch.cumsum(ext, 0, dtype=torch.int32) - ext,
            extend_prefix_lens_cpu=prefix_lens, extend_seq_lens_cpu=lens,
            logits_indices=host_to_device(logit_rows, torch.int64, dev) if logit_rows else None,
            logits_targets=host_to_device(targets, torch.int64, dev) if logit_rows else None,
            mm_inputs=mm_inputs if any(m is not None for m in mm_inputs) else None,
            lora_paths=batch_lora_paths(batch),
        )
        return fb, slices


def record_prompt_logprobs(slices: list[PromptLogprobSlice], host: dict) -> None:
    """Append this pass's prompt logprobs to each request's; complete once its prefill reaches the prompt's end."""
    lps = host.get("input_token_logprobs")
    top_v, top_i = host.get("input_top_logprobs"), host.get("input_top_ids")
    for s in slices:
        req = s.req
        if req.input_logprobs_partial is None:
            req.input_logprobs_partial = ([], [])
            if req.logprob_start_len == 0:
                req.input_logprobs_partial[0].append((None, _model_ids(req, req.input_ids[:1], 0)[0]))
                req.input_logprobs_partial[1].append(None)
        token_lps, top_lps = req.input_logprobs_partial
        n = req.top_logprobs_num
        scored = _model_ids(req, req.input_ids[s.lo + 1:s.hi + 1], s.lo + 1)
        for j in range(s.hi - s.lo):
            row = s.row0 + j
            token_lps.append((lps[row], scored[j]))
            top_lps.append(list(zip(top_v[row][:n], top_i[row][:n])) if n and top_v is not None else None)
        if s.chunk_end >= len(req.input_ids) - 1:
            req.input_token_logprobs, req.input_top_logprobs = token_lps, top_lps
            req.input_logprobs_partial = None


def _model_ids(req: Req, ids: list[int], start: int) -> list[int]:
    """What the model sees at positions start..: image/video placeholders as the model's media token ids."""
    return ids if req.mm_inputs is None else req.mm_inputs.model_ids(ids, start)


def _set_extend_len(req: Req, remaining: int, token_budget: int) -> None:
    # a chunk ends at an image/video boundary (an item longer than the budget is taken whole)
    req.extend_input_len = item_aligned_chunk_len(req.mm_inputs, req.kv_committed_len, min(remaining, token_budget))
    req.is_chunked = req.extend_input_len < remaining
