"""The scheduler: one loop for the in-process Engine and the server process.

A step: poll grammars -> release aborted requests -> (overlap: launch the next decode step behind the one in
flight, commit the one in flight) -> an extend batch if admission finds one, else a decode step (retracting when
the KV pool runs out) -> commit the sampled tokens -> report. Admission and chunking live in prefill.py, decode
and overlap in decode.py, token commit, finish checks and reports in output.py, request checks in intake.py.
"""

from __future__ import annotations

import atexit
import gc
import itertools
import logging
import time
from collections import deque
from typing import Callable, Optional, Protocol

from braid.runtime.config import (DEFAULT_CUDA_ADMISSION_MIN_EXTEND_TOKENS, DEFAULT_CUDA_CONTINUOUS_DECODE_STEPS,
                                  DEFAULT_CUDA_MAX_CONTINUOUS_DECODE_STEPS, ServerArgs)
import torch

from braid.runtime.constrained.grammar import accept_tokens
from braid.runtime.core import FinishReason, ForwardOutput, Req, ReqOutput, RequestError, host_tensor
from braid.runtime.error_kind import ErrorKind
from braid.runtime.layers.sampler import SamplingBatchInfo
from braid.runtime.loader.gguf import release_gguf_readers
from braid.runtime.loader.tokenizer import get_tokenizer
from braid.runtime.mem_cache.chunk_cache import ChunkCache
from braid.runtime.mem_cache.radix_cache import RadixCache
from braid.runtime.model_executor.model_runner import ModelRunner
from braid.runtime.scheduler.decode import DecodeInFlight, DecodeRunner
from braid.runtime.scheduler.intake import RequestIntake
from braid.runtime.scheduler.lora_admission import LoraAdapters
from braid.runtime.scheduler.output import FinishTable, NextStep, OutputProcessor
from braid.runtime.scheduler.prefill import PrefillPlanner, record_prompt_logprobs

logger = logging.getLogger(__name__)

__all__ = ["Scheduler", "SchedulerIO", "RequestError", "freeze_startup_objects", "run_scheduler_loop"]


class SchedulerIO(Protocol):
    def receive(self, scheduler, block: bool) -> bool:
        """Apply the commands that arrived (add, abort, queries) to the scheduler, waiting for one if `block`.
        False: stop the loop."""

    def send_outputs(self, outputs: list[ReqOutput]) -> None: ...


GRAMMAR_WAIT_POLL_S = 0.002


def run_scheduler_loop(scheduler, io: SchedulerIO) -> None:
    timing = getattr(scheduler, "timing", None)  # HostTiming (stand-in schedulers in tests have none)
    while io.receive(scheduler, block=not scheduler.has_work()):
        if scheduler.has_work():
            if scheduler.only_waits_for_grammars():
                time.sleep(GRAMMAR_WAIT_POLL_S)  # compiles run in worker processes; spinning would starve the host
            outputs = scheduler.step()
            if outputs:
                start = time.perf_counter()
                io.send_outputs(outputs)
                if timing is not None:
                    timing.send_s += time.perf_counter() - start


def freeze_startup_objects() -> None:
    """For a process that runs one scheduler for its life, once it is built: every object alive now (the model,
    the tokenizer, the libraries) is moved out of the garbage collector's reach. A full collection walks every
    tracked object, and the per-step allocations over a large batch bring one every few dozen decode steps
    (docs/benchmarks.md has the cost). The objects are handed back at exit, so that the shutdown's collection still
    sees them."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)


_REFUSED = "refused"  # _advance_grammars: the grammar refused the sampled token


class HostTiming:
    """Where the scheduler's wall time goes, in seconds summed over its life: inside `step()`, inside
    `ModelRunner.forward` (on CUDA: launching the pass), waiting for a pass's results to reach the host, and handing
    a step's outputs to the I/O (the server process: building, encoding and sending the output batch). The rest of a
    step is the host's own work (admission, batch building, commits, reports). `extend_s`: the part of `step()` spent
    on extend passes (built, run to their results and committed; the decode pass before one is committed first), so
    that a decoding request's time per token splits into its decode passes and the prefills between them; of it,
    `extend_forward_s` inside `ModelRunner.forward` (with the grammar masks of the pass, `extend_grammar_mask_s`
    of that) and `extend_wait_s` waiting for the pass's results."""

    def __init__(self):
        self.steps = 0
        self.step_s = 0.0
        self.extend_s = 0.0
        self.extend_forward_s = 0.0
        self.extend_wait_s = 0.0
        self.extend_grammar_mask_s = 0.0
        self.forward_s = 0.0
        self.device_wait_s = 0.0
        self.send_s = 0.0
        self.grammar_accept_s = 0.0  # the batch's grammars taking their sampled tokens

    def forward(self, runner, fb):
        start = time.perf_counter()
        out = runner.forward(fb)
        self.forward_s += time.perf_counter() - start
        return out

    def wait(self, output: ForwardOutput) -> dict:
        start = time.perf_counter()
        host = output.host_tensors()
        self.device_wait_s += time.perf_counter() - start
        return host

    def stats(self) -> dict:
        return dict(num_steps=self.steps, step_time_s_total=self.step_s, forward_time_s_total=self.forward_s,
                    device_wait_s_total=self.device_wait_s, send_time_s_total=self.send_s,
                    extend_time_s_total=self.extend_s, extend_forward_time_s_total=self.extend_forward_s,
                    extend_device_wait_s_total=self.extend_wait_s,
                    extend_grammar_mask_time_s_total=self.extend_grammar_mask_s,
                    grammar_accept_time_s_total=self.grammar_accept_s)


class Scheduler:
    def __init__(self, server_args: ServerArgs):
        self.server_args = server_args
        self.runner = ModelRunner(server_args)
        self.tokenizer = get_tokenizer(server_args)
        release_gguf_readers()  # a GGUF's conversions are on disk now
        self.device = self.runner.device
        self.context_len = self.runner.context_len
        self.max_running_requests = self.runner.max_running_requests  # the cap, derived from the KV pool if unset
        # admission pacing: the waiting queue is looked at once per continuous_decode_steps decode steps, and past that
        # only when the free slots would take admission_min_extend_tokens prompt tokens, until max_continuous_...
        cuda_defaults = self.device.type == "cuda" and server_args.num_continuous_decode_steps is None
        self.continuous_decode_steps = server_args.num_continuous_decode_steps or (
            DEFAULT_CUDA_CONTINUOUS_DECODE_STEPS if self.device.type == "cuda" else 1)
        self.max_continuous_decode_steps = max(self.continuous_decode_steps, server_args.max_continuous_decode_steps or (
            DEFAULT_CUDA_MAX_CONTINUOUS_DECODE_STEPS if cuda_defaults else self.continuous_decode_steps))
        self.admission_min_extend_tokens = (server_args.admission_min_extend_tokens
                                            if server_args.admission_min_extend_tokens is not None else
                                            DEFAULT_CUDA_ADMISSION_MIN_EXTEND_TOKENS if cuda_defaults else 0)
        self.vocab_size = self.runner.vocab_size
        self.model_config = self.runner.model_config
        self.req_to_token_pool = self.runner.req_to_token_pool
        self.kv_pool = self.runner.kv_pool
        cache_cls = ChunkCache if server_args.disable_radix_cache else RadixCache
        self.prefix_cache = cache_cls(self.req_to_token_pool, self.kv_pool)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.timing = HostTiming()
        self.finish_table = FinishTable(self.req_to_token_pool.size, eos, self.context_len)
        self.prefill = PrefillPlanner(server_args, self.prefix_cache, self.req_to_token_pool, self.device,
                                      self.max_running_requests)
        self.output = OutputProcessor(server_args, self.tokenizer, eos, self.context_len, self.vocab_size,
                                      self.prefix_cache, self.device)
        self.decode = DecodeRunner(server_args, self.runner, self.prefix_cache, self.device, self.timing,
                                   self.finish_table, self.output)
        # --speculative-algorithm: decode steps verify drafts, synchronously (runtime/speculative/verify.py); only
        # the steps --speculative-disable-by-batch-size leaves to plain decode may overlap (`_spec_sits_out`)
        self.spec = None
        if server_args.speculative_algorithm is not None:
            from braid.runtime.speculative.verify import SpeculativeDecoder

            self.spec = SpeculativeDecoder(server_args, self.runner, self.prefix_cache, self.output, self.context_len)
        self.intake = RequestIntake(server_args, self.tokenizer, self.vocab_size, self.context_len, self.kv_pool.size,
                                    share_prefill=not self.prefix_cache.disabled)
        # --enable-lora: adapter admission, loading and unloading (lora_admission.py)
        self.lora = (LoraAdapters(self.runner.lora_manager, server_args, self.prefix_cache)
                     if self.runner.lora_manager is not None else None)

        self.waiting: list[Req] = []  # hold no KV
        self.running: list[Req] = []  # decode next step
        self.resume_queue: deque[Req] = deque()  # hold KV, need an extend (chunked prefill, jump-forward)
        self.in_flight: Optional[DecodeInFlight] = None
        self.outputs: list[ReqOutput] = []
        self.aborts_pending = False  # a request holding KV was aborted: release it at the next step
        # --num-continuous-decode-steps: decode steps left before the waiting queue is looked at again
        self.decode_steps_before_admit = 0
        self.stats = dict(num_prompt_tokens_total=0, num_computed_prompt_tokens_total=0, num_cached_tokens_total=0,
                          num_forward_extend=0, num_tokens_through_model_total=0, num_decode_tokens_mixed=0)

    # ---- requests ----
    def add_request(self, req: Req) -> None:
        if req.lora_path is not None and self.lora is None:
            raise RequestError("this server serves no LoRA adapters (start it with --enable-lora or --lora-paths)",
                               param="lora_path")
        if self.lora is not None:
            self.lora.check_request(req)
        self.waiting.extend(self.intake.add(req))

    # ---- LoRA adapters (lora_admission.py) ----
    def load_lora_adapter(self, name: str, path: str) -> None:
        """Register the adapter folder `path` as `name`; raises LoraError naming what is wrong."""
        self._lora_on().load(name, path)

    def unload_lora_adapter(self, name: str, done: Callable[[], None]) -> None:
        """Stop taking requests on `name`; `done` runs once the requests already on it have finished and it is gone.
        Raises LoraError for an adapter that is not loaded."""
        self._lora_on().unload(name, done, self._adapters_in_use())

    def _lora_on(self) -> LoraAdapters:
        if self.lora is None:
            from braid.runtime.lora.adapter import LoraError

            raise LoraError("this server serves no LoRA adapters (start it with --enable-lora)", code="lora_disabled",
                            param="lora_name")
        return self.lora

    def _adapters_in_use(self) -> set:
        """The adapters of every request the scheduler holds, queued or running."""
        in_flight = self.in_flight.reqs if self.in_flight is not None else []
        reqs = itertools.chain(self.waiting, self.running, self.resume_queue, in_flight,
                               (r for r, _ in self.intake.grammar_queue))
        return {r.lora_path for r in reqs if r.lora_path is not None}

    def abort_request(self, rid: str) -> None:
        reason = FinishReason("abort", message="aborted by request")
        for req in [r for r in self.waiting if r.rid == rid]:
            self.waiting.remove(req)
            self.finish(req, reason)
        for req in self.intake.abort(rid, reason):
            self.finish(req, reason)
        # requests holding KV are released at the start of the next step, outside any forward pass
        in_flight = self.in_flight.reqs if self.in_flight is not None else []
        for req in [*self.running, *self.resume_queue, *in_flight]:
            if req.rid == rid and not req.finished:
                req.finished_reason = reason
                self.aborts_pending = True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.intake.grammar_queue or self.resume_queue or self.outputs
                    or self.in_flight is not None)

    def only_waits_for_grammars(self) -> bool:
        return bool(self.intake.grammar_queue) and not (self.waiting or self.running or self.resume_queue
                                                        or self.outputs or self.in_flight is not None)

    def shutdown(self) -> None:
        self.intake.shutdown()

    def flush_cache(self) -> bool:
        if self.waiting or self.running or self.resume_queue or self.intake.grammar_queue or self.in_flight:
            return False
        self.prefix_cache.reset()
        return True

    def get_stats(self) -> dict:
        s = dict(self.stats)
        kv_used = self.kv_pool.size - self.kv_pool.available_size() - self.prefix_cache.evictable_size()
        s.update(
            num_running_reqs=len(self.running) + len(self.resume_queue) + (
                len(self.in_flight.reqs) if self.in_flight is not None else 0),
            num_waiting_reqs=len(self.waiting) + len(self.intake.grammar_queue), num_requests_total=self.intake.num_requests,
            num_generated_tokens_total=self.output.num_generated_tokens, num_forward_decode=self.decode.num_forward,
            num_decode_overlapped=self.decode.num_overlapped, num_retractions=self.decode.num_retractions,
            kv_total_tokens=self.kv_pool.size, kv_free_tokens=self.kv_pool.available_size(),
            kv_cached_tokens=self.prefix_cache.evictable_size(), kv_used_tokens=kv_used,
            **self._window_kv_stats(),
            cache_hit_rate=(s["num_cached_tokens_total"] / s["num_prompt_tokens_total"]) if s["num_prompt_tokens_total"] else 0.0,
            new_token_ratio=self.decode.new_token_ratio, effective_max_running_requests=self.max_running_requests,
            effective_num_continuous_decode_steps=self.continuous_decode_steps,
            effective_max_continuous_decode_steps=self.max_continuous_decode_steps,
            effective_admission_min_extend_tokens=self.admission_min_extend_tokens,
            num_forward_extend_graphed=getattr(getattr(self.runner, "extend_graph_runner", None), "num_replays", 0),
            num_forward_decode_graphed=getattr(getattr(self.runner, "cuda_graph_runner", None), "num_replays", 0),
            **self.timing.stats(), grammar_mask_time_s_total=self.output.grammar_mask_s,
            grammar=self.intake.grammar_stats(), **(self.spec.stats() if self.spec is not None else {}),
            **(self.lora.stats() if self.lora is not None else {}),
        )
        return s

    def _window_kv_stats(self) -> dict:
        """Hybrid KV pool (window layers trimmed): the window slot space, counted like the full one."""
        pool = self.prefix_cache.window_pool
        if pool is None:
            return {}
        free, cached = pool.window_available_size(), self.prefix_cache.window_evictable_size()
        return dict(window_kv_total_tokens=pool.window_size, window_kv_free_tokens=free,
                    window_kv_cached_tokens=cached, window_kv_used_tokens=pool.window_size - free - cached)

    # ---- the step ----
    def step(self) -> list[ReqOutput]:
        start = time.perf_counter()
        self._step()
        if self.lora is not None and self.lora.unloading:
            self.lora.settle(self._adapters_in_use())
        self.timing.steps += 1
        self.timing.step_s += time.perf_counter() - start
        return self._take_outputs()

    def _step(self) -> None:
        self._poll_grammars()
        if self.aborts_pending:
            self._release_aborted()
        if self.in_flight is not None:
            if self._chain_decode():
                return
            prev, self.in_flight = self.in_flight, None
            self._commit(prev.reqs, prev.output, slots=prev.slots)
        batch = self._admit() if self._admission_due() else []
        if batch:
            start = time.perf_counter()
            self._run_extend(batch, self._mix_in_running(batch))
            self.timing.extend_s += time.perf_counter() - start
        elif self.running:
            for victim in self.decode.retract(self.running):
                self.waiting.insert(0, victim)
            if self.running:
                self._run_decode()

    def _admission_due(self) -> bool:
        """--num-continuous-decode-steps N: the waiting queue is looked at once per N decode steps (at once when
        nothing is decoding), so that up to N steps chain on the device without an extend between them; past N, an
        extend that the free running slots would keep under --admission-min-extend-tokens prompt tokens waits
        until --max-continuous-decode-steps (a chunked prefill's next chunk does not)."""
        if not (self.running or self.in_flight is not None):
            return True
        if self.decode_steps_before_admit > 0:
            return False
        waited = self.continuous_decode_steps - self.decode_steps_before_admit
        if self.resume_queue or waited >= self.max_continuous_decode_steps:
            return True
        return self._prompt_tokens_for_free_slots() >= self.admission_min_extend_tokens

    def _prompt_tokens_for_free_slots(self) -> int:
        """Prompt tokens of the waiting requests that the free running slots would take next (queue order, cached
        prefixes not subtracted), counted up to admission_min_extend_tokens."""
        decoding = len(self.running) + (len(self.in_flight.reqs) if self.in_flight is not None else 0)
        tokens = 0
        for req in itertools.islice(self.waiting, max(0, self.max_running_requests - decoding)):
            tokens += len(req.input_ids)
            if tokens >= self.admission_min_extend_tokens:
                break
        return tokens

    def _take_outputs(self) -> list[ReqOutput]:
        out, self.outputs = self.outputs, []
        return out

    def _poll_grammars(self) -> None:
        ready, failed = self.intake.poll_grammars()
        self.waiting.extend(ready)
        for req, reason in failed:
            self.finish(req, reason)

    def _release_aborted(self) -> None:
        self.aborts_pending = False
        for name in ("running", "resume_queue"):
            queue = getattr(self, name)
            if any(r.finished for r in queue):
                for r in [r for r in queue if r.finished]:
                    self.finish(r, r.finished_reason)
                setattr(self, name, type(queue)(r for r in queue if not r.finished))

    def _admit(self) -> list[Req]:
        if not self.waiting and not self.resume_queue:
            return []
        self.decode_steps_before_admit = self.continuous_decode_steps
        if not self.resume_queue and len(self.running) >= self.max_running_requests:
            return []  # full: not even the decode reservation needs adding up
        adapters = None
        if self.lora is not None:
            in_flight = self.in_flight.reqs if self.in_flight is not None else []
            adapters = self.lora.admission(itertools.chain(self.running, self.resume_queue, in_flight))
        batch, admitted = self.prefill.plan(self.waiting, self.resume_queue, len(self.running),
                                            self.decode.reserved_tokens(self.running), self.decode.new_token_ratio,
                                            adapters)
        if admitted:
            taken = {id(r) for r in admitted}
            self.waiting = [r for r in self.waiting if id(r) not in taken]
            for req in admitted:
                self.finish_table.set(req)
                if req.scheduled_time is None:
                    req.scheduled_time = time.time()
                if req.retracted_count == 0 and not req.output_ids:
                    req.cached_tokens = req.kv_committed_len
                    self.stats["num_prompt_tokens_total"] += len(req.input_ids)
                    self.stats["num_cached_tokens_total"] += req.kv_committed_len
        return batch

    def _mix_in_running(self, prefill: list[Req]) -> list[Req]:
        """--enable-mixed-chunk: the running requests, each as a one-token extend, when the pool holds their tokens."""
        if not self.server_args.enable_mixed_chunk or not self.running:
            return []
        if self.prefix_cache.available_slots() < sum(r.extend_input_len for r in prefill) + len(self.running):
            return []
        for req in self.running:
            req.extend_input_len, req.is_chunked = 1, False
        decoding, self.running = self.running, []
        self.stats["num_decode_tokens_mixed"] += len(decoding)
        return decoding

    def _run_extend(self, prefill: list[Req], decoding: list[Req]) -> None:
        batch = prefill + decoding
        built = self.prefill.build_batch(batch)
        if built is None:
            raise RuntimeError("KV pool exhausted during extend admission (scheduler accounting bug)")
        fb, logprob_slices = built
        samples = [not r.is_chunked and r.sampling_params.max_new_tokens > 0 for r in batch]
        fb.sampling_info = SamplingBatchInfo.build(batch, self.vocab_size, self.device)
        fb.sampling_info.fill_token_bitmask = self.output.bitmask_filler(batch)
        if self.spec is not None:
            self.spec.prepare_extend(fb)  # EAGLE: the draft head reads this pass's hidden states
        self.stats["num_forward_extend"] += 1
        self.stats["num_tokens_through_model_total"] += sum(fb.extend_seq_lens_cpu)
        self.stats["num_computed_prompt_tokens_total"] += sum(
            max(0, min(p + n, len(r.input_ids)) - p)
            for r, p, n in zip(batch, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu))
        timing, mask_s = self.timing, self.output.grammar_mask_s
        start = time.perf_counter()
        output = timing.forward(self.runner, fb)
        waited = time.perf_counter()
        timing.wait(output)
        timing.extend_forward_s += waited - start
        timing.extend_wait_s += time.perf_counter() - waited
        timing.extend_grammar_mask_s += self.output.grammar_mask_s - mask_s
        host = output.host()
        if self.spec is not None:
            self.spec.record_extend(batch, fb, output)
        for req, n in zip(batch, fb.extend_seq_lens_cpu):
            req.kv_committed_len += n
        self.prefix_cache.trim_window_kv(batch)
        record_prompt_logprobs(logprob_slices, host)
        rows = list(range(len(prefill), len(batch)))
        for i, req in enumerate(prefill):
            if req.is_chunked:
                self.prefix_cache.cache_unfinished_req(req)
                self.resume_queue.append(req)
            elif not samples[i]:
                self.finish(req, FinishReason("length"))  # prefill only (cache warm-up, prompt logprobs)
            else:
                # publish the prompt's KV now, so requests arriving while this one decodes share it
                self.prefix_cache.cache_unfinished_req(req)
                rows.append(i)
        if rows:
            rows.sort()
            self._commit([batch[i] for i in rows], output, rows)

    def _run_decode(self) -> None:
        reqs, self.running = self.running, []
        self.decode_steps_before_admit -= 1
        if self.spec is not None and self.spec.step(self, reqs):
            return
        self.stats["num_tokens_through_model_total"] += len(reqs)
        if self.decode.overlap and self._spec_sits_out(len(reqs)) and self.decode.can_overlap(reqs, 0):
            self.in_flight = self.decode.launch(reqs, None)
            return
        info = SamplingBatchInfo.build(reqs, self.vocab_size, self.device)
        info.fill_token_bitmask = self.output.bitmask_filler(reqs)
        output, slots = self.decode.forward(reqs, None, info)
        self._commit(reqs, output, slots=slots)

    def _spec_sits_out(self, num_reqs: int) -> bool:
        """True when a decode step of num_reqs requests runs without drafts whatever they are (no speculation, or
        more requests than --speculative-disable-by-batch-size), so it may overlap the host's work; a step that may
        verify drafts runs synchronously, as the drafts come from the tokens of the step before."""
        limit = None if self.spec is None else self.spec.disable_by_batch_size
        return self.spec is None or (limit is not None and num_reqs > limit)

    def _chain_decode(self) -> bool:
        """Launch the next decode step behind the one in flight, then commit the one in flight. False: not possible."""
        prev = self.in_flight
        if not self._spec_sits_out(len(prev.reqs)):
            return False  # the next step speculates: it needs this one's tokens committed
        if self.spec is not None:
            self.spec.num_steps_too_large += 1
        admissible = (self.waiting and len(prev.reqs) < self.max_running_requests
                      and self.req_to_token_pool.available_size() > 0)
        if (self.resume_queue or admissible) and self._admission_due():
            return False  # an extend is due: settle the step in flight first
        nxt = self.decode.chain(prev)
        if nxt is None:
            return False
        self.stats["num_tokens_through_model_total"] += len(nxt.reqs)
        self.decode_steps_before_admit -= 1
        self.in_flight = nxt
        self._commit(prev.reqs, prev.output, slots=prev.slots, jump_forward=False,
                     grammars_advanced=None if nxt.sampled else lambda: self.decode.start_mask_fill(nxt))
        self.running = []  # the survivors are in the step now in flight
        if not nxt.sampled:
            self.decode.sample_pending(nxt)
        return True

    # ---- commit and finish ----
    def _commit(self, reqs: list[Req], output: ForwardOutput, rows: Optional[list[int]] = None,
                slots: Optional[torch.Tensor] = None, jump_forward: bool = True,
                grammars_advanced: Optional[Callable[[], None]] = None) -> None:
        """Append each request's sampled token (rows: each request's row in `output`, default 0..; slots: their
        req_pool_idx as an int64 CPU tensor when the caller has it). The finish checks run over the batch at once
        (FinishTable); only the requests they flag, and those with stop strings, grammars or logprobs, go through
        OutputProcessor.commit one by one. jump_forward=False: a step is in flight behind this one (its inputs are
        these tokens), so no request may jump forward now. grammars_advanced: called once every grammar has taken
        its token (the next step's masks may be filled from then on, beside the rest of the commit)."""
        host = self.timing.wait(output)
        token_ids = host["next_token_ids"]
        if rows is not None:
            token_ids = token_ids[torch.tensor(rows, dtype=torch.int64)]
        if slots is None:
            slots = host_tensor([r.req_pool_idx or 0 for r in reqs], torch.int64)
        out_lens = host_tensor([len(r.output_ids) for r in reqs], torch.int64) + 1
        check = self.finish_table.candidates(slots, token_ids, out_lens).tolist()
        tokens = token_ids.tolist()
        grammar_ended = self._advance_grammars(reqs, tokens, check, jump_forward)
        if grammars_advanced is not None:
            grammars_advanced()
        host_lists = None
        now = time.time()
        running, make_output, outputs = self.running, self.output.make_output, self.outputs
        appended = 0
        for i, (req, tok, slow) in enumerate(zip(reqs, tokens, check)):
            if req.finished_reason is not None:  # aborted while its step ran: its token is dropped
                if req.req_pool_idx is not None:
                    self.finish(req, req.finished_reason)
                continue
            ended = grammar_ended.get(i)
            if ended is _REFUSED:
                self.finish(req, FinishReason("abort", message=f"grammar error: the sampled token {tok} was refused "
                                                                "by the grammar", kind=ErrorKind.GRAMMAR_INVALID))
                continue
            if slow:
                if host_lists is None:
                    host_lists = {name: t.tolist() for name, t in host.items()}
                goes_to, reason = self.output.commit(req, host_lists, rows[i] if rows is not None else i, jump_forward,
                                                     grammar_ended=ended)
                if reason is not None:
                    self.finish(req, reason)
                    continue
                (running if goes_to is NextStep.DECODE else self.resume_queue).append(req)
            else:  # neither finished nor in need of Python checks: OutputProcessor.append_token's plain case
                req.output_ids.append(tok)
                req.fill_ids.append(tok)
                if req.first_token_time is None:
                    req.first_token_time = now
                appended += 1
                running.append(req)
            out = make_output(req)
            if out is not None:
                outputs.append(out)
        self.output.num_generated_tokens += appended

    def _advance_grammars(self, reqs: list[Req], tokens: list[int], check: list[bool],
                          jump_forward: bool) -> dict[int, bool]:
        """Each live grammar request's grammar takes its sampled token, for the batch at once. -> {row: whether its
        grammar ended, or _REFUSED}; flags in `check` the rows that need OutputProcessor.commit: a grammar that
        ended or refused the token, and with jump_forward every grammar row (it may jump; with jump-forward off for the
        server none does, and the rest take the commit's plain path)."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None and r.finished_reason is None]
        if not rows:
            return {}
        jump_forward = jump_forward and self.output.jump_forward_enabled
        start = time.perf_counter()
        ok = accept_tokens([reqs[i].grammar for i in rows], [tokens[i] for i in rows])
        ended = {}
        for i, good in zip(rows, ok):
            ended[i] = reqs[i].grammar.is_terminated() if good else _REFUSED
            if jump_forward or ended[i] is not False:
                check[i] = True
        self.timing.grammar_accept_s += time.perf_counter() - start
        return ended

    def finish(self, req: Req, reason: FinishReason) -> None:
        req.finished_reason = reason
        if self.spec is not None:
            self.spec.release(req)
        if req.req_pool_idx is not None:
            req.fill_ids = req.input_ids + req.output_ids
            req.kv_committed_len = min(req.kv_committed_len, len(req.fill_ids))
            self.prefix_cache.cache_finished_req(req)
        req.last_node = None
        if req.is_internal:
            start, done = self.intake.prefill_done(req, reason)
            self.waiting.extend(self.intake.enqueue(start))
            for child in done:
                self.emit(child)
            return
        self.emit(req)

    def emit(self, req: Req) -> None:
        out = self.output.make_output(req)
        if out is not None:
            self.outputs.append(out)
