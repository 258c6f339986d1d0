"""Decode: one token for each running request per step, retraction when the KV pool runs out, and the overlapped
launch of step i+1 while the host commits step i.

Overlap (CUDA, unless --disable-overlap-schedule): step i+1 is launched with step i's sampled ids still on the
device; the host then waits for step i's ids (a pinned copy behind an event) and commits them while the GPU runs
i+1. A request that finishes at step i has already been fed to i+1: that one extra token is dropped. With grammars,
step i+1's pass is launched unsampled: once step i is committed, the host fills the masks from the grammar states
(while the pass runs) and then samples. A commit with a step in flight does no jump-forward (the forced tokens are
sampled, one a step, under their masks). Batches with penalties, logprobs or pending min_new_tokens, and any step
with an extend to run, run synchronously.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import torch

from braid.runtime.core import (ForwardBatch, ForwardMode, ForwardOutput, Req, batch_lora_paths, host_tensor,
                                host_to_device, tensor_to_device)
from braid.runtime.layers.sampler import SamplingBatchInfo

logger = logging.getLogger(__name__)

_INIT_NEW_TOKEN_RATIO = 0.7
_MIN_NEW_TOKEN_RATIO = 0.1
_NEW_TOKEN_RATIO_DECAY = 0.001
_RETRACT_NEW_TOKEN_RATIO_BUMP = 0.2


@dataclass
class DecodeInFlight:
    """A launched decode step whose sampled ids the host has not read yet."""

    reqs: list[Req]
    output: ForwardOutput  # host copy started; unsampled (pending_logits) until DecodeRunner.sample_pending
    sampling_info: SamplingBatchInfo
    slots: torch.Tensor  # [B] int64 on the host: each request's req_pool_idx
    mask_fill: Optional[Future] = None  # its token bitmask being filled on the mask thread (start_mask_fill)

    @property
    def sampled(self) -> bool:
        return self.output.pending_logits is None


class DecodeRunner:
    def __init__(self, server_args, runner, prefix_cache, device: torch.device, timing, finish_table, output):
        self.runner = runner
        self.bitmask_filler = output.bitmask_filler
        self.bitmask_to_device = output.bitmask_to_device
        self._mask_thread: Optional[ThreadPoolExecutor] = None
        self.timing = timing  # scheduler.HostTiming
        self.finish_table = finish_table  # output.FinishTable
        self.prefix_cache = prefix_cache
        self.req_to_token_pool = runner.req_to_token_pool
        self.device = device
        self.vocab_size = runner.vocab_size
        # the share of each running request's remaining max_new_tokens that admission keeps free for decoding
        self.init_new_token_ratio = min(1.0, _INIT_NEW_TOKEN_RATIO * server_args.schedule_conservativeness)
        self.new_token_ratio = self.init_new_token_ratio
        self.overlap = device.type == "cuda" and not server_args.disable_overlap_schedule
        self.num_forward = 0
        self.num_overlapped = 0
        self.num_retractions = 0

    def reserved_tokens(self, running: list[Req]) -> int:
        """KV tokens kept free for the running requests' decoding (new_token_ratio of what each may still add)."""
        if not running:
            return 0
        slots = host_tensor([r.req_pool_idx for r in running], torch.int64)
        out_lens = host_tensor([len(r.output_ids) for r in running], torch.float64)
        return self.finish_table.reserved_tokens(slots, out_lens, self.new_token_ratio)

    # ---- one step ----
    def forward(self, reqs: list[Req], input_ids: Optional[torch.Tensor], info: SamplingBatchInfo,
                defer_sampling: bool = False) -> tuple[ForwardOutput, torch.Tensor]:
        """One decode pass (input_ids [B] on the device, or each request's last token), sampled with `info` (or
        left unsampled: defer_sampling). -> (its output, the requests' req_pool_idx as a [B] int64 host tensor)."""
        B = len(reqs)
        out_loc = self.prefix_cache.alloc_slots(B)
        dev = self.device
        seq_lens_cpu = [r.kv_committed_len + 1 for r in reqs]
        seq_lens_host = host_tensor(seq_lens_cpu, torch.int64)
        slots = host_tensor([r.req_pool_idx for r in reqs], torch.int64)
        req_idx = tensor_to_device(slots, dev)
        positions = tensor_to_device(seq_lens_host - 1, dev)
        self.req_to_token_pool.req_to_token[req_idx, positions] = out_loc.to(torch.int32)
        if input_ids is None:
            input_ids = host_to_device([r.fill_ids[-1] for r in reqs], torch.int64, dev)
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=B, input_ids=input_ids, positions=positions,
            req_pool_indices=req_idx, seq_lens=tensor_to_device(seq_lens_host.to(torch.int32), dev),
            out_cache_loc=out_loc, seq_lens_cpu=seq_lens_cpu, sampling_info=info, defer_sampling=defer_sampling,
            lora_paths=batch_lora_paths(reqs),
        )
        self.num_forward += 1
        out = self.timing.forward(self.runner, fb)
        for r in reqs:
            r.kv_committed_len += 1
        # the release is queued behind this pass on the device, and the next query's window starts past it
        self.prefix_cache.trim_window_kv(reqs)
        self.new_token_ratio = max(_MIN_NEW_TOKEN_RATIO, self.new_token_ratio - _NEW_TOKEN_RATIO_DECAY)
        return out, slots

    # ---- overlap ----
    def can_overlap(self, reqs: list[Req], tokens_in_flight: int) -> bool:
        """True when sampling these requests needs nothing the host learns from the step before
        (each has `tokens_in_flight` sampled tokens not yet in output_ids)."""
        slots = host_tensor([r.req_pool_idx for r in reqs], torch.int64)
        out_lens = host_tensor([len(r.output_ids) for r in reqs], torch.int64) + tokens_in_flight
        return self.finish_table.can_overlap(slots, out_lens)

    def launch(self, reqs: list[Req], input_ids: Optional[torch.Tensor],
               info: Optional[SamplingBatchInfo] = None, defer_sampling: bool = False) -> DecodeInFlight:
        """defer_sampling: the requests' grammar states are a step behind (step i is not committed yet), so the
        pass is sampled later by `sample_pending`."""
        info = info or SamplingBatchInfo.build(reqs, self.vocab_size, self.device)
        info.token_bitmask, info.fill_token_bitmask = None, None if defer_sampling else self.bitmask_filler(reqs)
        output, slots = self.forward(reqs, input_ids, info, defer_sampling)
        return DecodeInFlight(reqs, output if defer_sampling else output.copy_to_host(), info, slots)

    def start_mask_fill(self, step: DecodeInFlight) -> None:
        """Fill the masks of a step launched with defer_sampling on the mask thread, now that every grammar has
        taken the token of the step before (the engines drop the GIL while they compute masks, so the rest of that
        step's commit runs beside it)."""
        filler = self.bitmask_filler(step.reqs)
        if filler is not None:
            if self._mask_thread is None:
                self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
            step.mask_fill = self._mask_thread.submit(filler, False)

    def sample_pending(self, step: DecodeInFlight) -> None:
        """Sample a step launched with defer_sampling, now that the step before it is committed: the masks are
        those start_mask_fill is filling, or are filled now from the grammar states."""
        fill = step.mask_fill
        step.sampling_info.fill_token_bitmask = self.bitmask_filler(step.reqs) if fill is None \
            else lambda: self.bitmask_to_device(fill.result())
        start = time.perf_counter()
        step.output = self.runner.sample(step.output.pending_logits, step.sampling_info).copy_to_host()
        self.timing.forward_s += time.perf_counter() - start

    def chain(self, prev: DecodeInFlight) -> Optional[DecodeInFlight]:
        """Launch the step after `prev` for its requests that go on; None when that needs prev's results first."""
        # with the token in flight each has len(output_ids) + 1 outputs; those at their length limit end with it
        out_lens = host_tensor([len(r.output_ids) for r in prev.reqs], torch.int64) + 1
        ends = self.finish_table.ends_by_length(prev.slots, out_lens).tolist()
        keep = [i for i, (r, end) in enumerate(zip(prev.reqs, ends)) if not end and r.finished_reason is None]
        reqs = [prev.reqs[i] for i in keep]
        if not reqs:
            return None
        keep_t = torch.tensor(keep, dtype=torch.int64)
        if not self.finish_table.can_overlap(prev.slots[keep_t], out_lens[keep_t]) \
                or self.prefix_cache.available_slots() < len(reqs):
            return None
        ids, info = prev.output.next_token_ids, prev.sampling_info
        if len(keep) != len(prev.reqs):
            keep_dev = host_to_device(keep, torch.int64, self.device)
            ids = ids.index_select(0, keep_dev)
            info = info.filter(keep, keep_dev)
        self.num_overlapped += 1
        return self.launch(reqs, ids, info, defer_sampling=any(r.grammar is not None for r in reqs))

    # ---- memory pressure ----
    def retract(self, running: list[Req]) -> list[Req]:
        """Take requests out of `running` (in place) until each remaining one can get a slot for its next token;
        their KV stays in the cache (evictable) for the resume. Returns them, most progressed last."""
        victims = []
        while running and self.prefix_cache.available_slots() < len(running):
            # the request with the least progress is the cheapest to recompute; it keeps its output
            victim = min(running, key=lambda r: (len(r.output_ids), -len(r.input_ids)))
            running.remove(victim)
            self.prefix_cache.cache_finished_req(victim)
            victim.retracted_count += 1
            victim.prefix_indices = None
            self.num_retractions += 1
            self.new_token_ratio = min(1.0, self.new_token_ratio + _RETRACT_NEW_TOKEN_RATIO_BUMP)
            logger.info("KV pool full: retracted request %s (%d tokens decoded)", victim.rid, len(victim.output_ids))
            victims.append(victim)
        return victims
