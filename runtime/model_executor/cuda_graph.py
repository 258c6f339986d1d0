"""CUDA graphs for decode: capture the model once per padded batch size, replay with the inputs copied in.

A batch of B requests replays the graph of the smallest captured size >= B; padding rows write their KV to the
pool's dummy slot 0 and attend over one token, and their outputs are dropped. With LoRA adapters served, the
graphs read each token's adapter slot from a static index buffer ([rows] int64, -1: the base model), so one graph
serves any mix of adapters and the base model; a decode batch on the base model alone replays a second set captured
without the delta ops.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Optional

import torch

from braid.runtime.core import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)


@torch.inference_mode()
def capture_graphs(sizes: list[int], prepare, pool=None) -> tuple[dict, dict]:
    """One CUDA graph per size, the largest first, all in one memory pool (`pool`, else a new one). prepare(size)
    fills the static inputs and returns the pass to capture (a no-argument callable), which runs twice outside the
    graph first (warm-up: Triton compiles and picks its kernels, torch.compile traces). -> ({size: graph}, {size: its
    output})."""
    graphs, outputs = {}, {}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for size in reversed(sizes):
            run = prepare(size)
            for _ in range(2):
                run()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                outputs[size] = run()
            pool = pool or graph.pool()
            graphs[size] = graph
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return graphs, outputs


def capture_batch_sizes(max_bs: int, chosen: Optional[tuple[int, ...]] = None) -> list[int]:
    """The decode batch sizes to capture: `chosen` (--cuda-graph-bs) or the default ladder, none above max_bs."""
    sizes = chosen or [1, 2, 3, 4] + list(range(8, 33, 4)) + list(range(40, 161, 8)) + list(range(176, 513, 16))
    kept = [s for s in sizes if s <= max_bs]
    return kept or [max_bs]


class CudaGraphRunner:
    def __init__(self, model_runner):
        self.runner = model_runner
        self.model = model_runner.model
        self.attn_backend = model_runner.attn_backend
        max_reqs = model_runner.req_to_token_pool.size
        self.batch_sizes = capture_batch_sizes(min(model_runner.server_args.cuda_graph_max_bs, max_reqs),
                                               model_runner.server_args.cuda_graph_bs)
        self.max_bs = self.batch_sizes[-1]
        dev = model_runner.device
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.req_pool_indices = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(self.max_bs, dtype=torch.int32, device=dev)
        self.out_cache_loc = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.lora = model_runner.lora_manager
        self.lora_idx = torch.full((self.max_bs,), -1, dtype=torch.int64, device=dev) if self.lora else None
        self.num_replays = 0  # decode steps served by a graph
        self.num_padded_replays = 0  # of those, steps that ran a larger captured size
        self.compiled = None
        if model_runner.server_args.enable_torch_compile:
            self._enable_compile()
        self.attn_backend.init_cuda_graph_state(self.max_bs)
        logger.info("capturing CUDA graphs for %d decode batch sizes (max %d)%s", len(self.batch_sizes), self.max_bs,
                    ", torch.compile first" if self.compiled is not None else "")  # can take a while: say so first
        start = time.perf_counter()
        self.graphs, self.outputs = capture_graphs(self.batch_sizes, self._prepare_capture)
        # with adapters served, a second set without the delta ops for batches on the base model alone (they would
        # launch every LoRA kernel to add nothing); in the same pool, as no two graphs replay at once
        self.base_graphs = self.base_outputs = None
        self.num_base_replays = 0  # of the replays, those of a batch without adapter rows
        if self.lora is not None:
            self.base_graphs, self.base_outputs = capture_graphs(
                self.batch_sizes, lambda bs: self._prepare_capture(bs, with_adapters=False),
                pool=self.graphs[self.max_bs].pool())
            self.lora.clear()
        logger.info("CUDA graphs captured in %.1f s", time.perf_counter() - start)

    def _enable_compile(self) -> None:
        import torch._dynamo

        from braid.runtime.layers import device_info

        device_info.fill(self.runner.device)  # read as constants in the compiled region
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        limit = self.runner.server_args.torch_compile_max_bs
        self.batch_sizes_compiled = {b for b in self.batch_sizes if b <= limit}
        # graphs are captured on top, so inductor must not add its own; one specialization per captured batch size
        self.compiled = torch.compile(self.model.forward, dynamic=False)

    def _static_batch(self, bs: int) -> ForwardBatch:
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs,
            input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            req_pool_indices=self.req_pool_indices[:bs], seq_lens=self.seq_lens[:bs],
            out_cache_loc=self.out_cache_loc[:bs], seq_lens_cpu=[1] * bs,
        )
        fb.req_to_token_pool = self.runner.req_to_token_pool
        fb.kv_pool = self.runner.kv_pool
        fb.attn_backend = self.attn_backend
        return fb

    def _forward_fn(self, bs: int):
        if self.compiled is not None and bs in self.batch_sizes_compiled:
            return self.compiled
        return self.model.forward

    def _prepare_capture(self, bs: int, with_adapters: bool = True):
        """The pass to capture at batch size bs; with LoRA served, it reads the static idx buffer (with_adapters) or
        runs no delta ops (the base-model set)."""
        fb = self._static_batch(bs)
        self.attn_backend.init_forward_metadata_capture(bs, fb)
        forward = self._forward_fn(bs)

        def run():
            if self.lora is not None:
                if with_adapters:
                    self.lora.use_static_idx(self.lora_idx[:bs])
                else:
                    self.lora.clear()
            return forward(fb)
        return run

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.batch_size <= self.max_bs

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        bs = fb.batch_size
        padded = self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs)]
        self.num_replays += 1
        if padded != bs:
            self.num_padded_replays += 1
            self.seq_lens[bs:padded].fill_(1)
            self.req_pool_indices[bs:padded].zero_()
            self.out_cache_loc[bs:padded].zero_()
            self.input_ids[bs:padded].zero_()
            self.positions[bs:padded].zero_()
        self.input_ids[:bs].copy_(fb.input_ids)
        self.positions[:bs].copy_(fb.positions)
        self.req_pool_indices[:bs].copy_(fb.req_pool_indices)
        self.seq_lens[:bs].copy_(fb.seq_lens)
        self.out_cache_loc[:bs].copy_(fb.out_cache_loc)
        graphs, outputs = self.graphs, self.outputs
        if self.lora is not None and not self.lora.load_static_idx(fb, self.lora_idx, padded):
            graphs, outputs = self.base_graphs, self.base_outputs
            self.num_base_replays += 1
        static = self._static_batch(padded)
        static.seq_lens_cpu = list(fb.seq_lens_cpu) + [1] * (padded - bs)
        self.attn_backend.init_forward_metadata_replay(padded, static)
        graphs[padded].replay()
        return outputs[padded][:bs]


def extend_token_buckets(max_tokens: int) -> list[int]:
    """Padded token counts of the extend graphs up to max_tokens: steps of 16 to 64, then of an eighth (at least 32)."""
    sizes = [16, 32, 48, 64, 96, 128]
    while sizes[-1] < max_tokens:
        sizes.append(sizes[-1] + max(sizes[-1] // 8, 32) // 16 * 16)
    return [s for s in sizes if s < max_tokens] + [max_tokens]


class ExtendCudaGraphRunner:
    """CUDA graphs for extend (prefill) passes: one per padded token count T, each taking up to min(T, max_reqs)
    requests. An eager extend pass launches a few hundred kernels from Python (~30 ms on the H200's host for an 8B
    model), more than the GPU needs for a few hundred tokens; a replay is one launch.

    Padding: token rows past the batch read token 0 at position 0 and write their KV to the pool's dummy slot 0;
    request rows past the batch have no new tokens. The attention kernel runs on a fixed grid through a block
    table the graph rebuilds from the request lengths (TritonAttnBackend.init_extend_graph_metadata). With
    capture=False (CPU tests) the same padded pass runs eagerly."""

    def __init__(self, model_runner, max_tokens: int, capture: bool = True):
        sa = model_runner.server_args
        self.runner = model_runner
        self.model = model_runner.model
        self.attn_backend = model_runner.attn_backend
        self.token_buckets = extend_token_buckets(max_tokens)
        self.max_tokens = self.token_buckets[-1]
        self.max_reqs = min(sa.cuda_graph_max_extend_reqs, model_runner.req_to_token_pool.size)
        dev = model_runner.device
        self.input_ids = torch.zeros(self.max_tokens, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(self.max_tokens, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(self.max_tokens, dtype=torch.int64, device=dev)
        self.req_pool_indices = torch.zeros(self.max_reqs, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(self.max_reqs, dtype=torch.int32, device=dev)
        self.extend_seq_lens = torch.zeros(self.max_reqs, dtype=torch.int32, device=dev)
        self.extend_prefix_lens = torch.zeros(self.max_reqs, dtype=torch.int32, device=dev)
        self.extend_start_loc = torch.zeros(self.max_reqs, dtype=torch.int32, device=dev)
        self.lora = model_runner.lora_manager
        self.lora_idx = torch.full((self.max_tokens,), -1, dtype=torch.int64, device=dev) if self.lora else None
        self.attn_backend.init_extend_graph_state(self.max_tokens, self.max_reqs, model_runner.kv_pool,
                                                  model_runner.req_to_token_pool.req_to_token, model_runner.dtype)
        self.num_replays = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.captured = capture
        if capture:
            logger.info("capturing CUDA graphs for %d extend token counts (max %d tokens, %d requests)",
                        len(self.token_buckets), self.max_tokens, self.max_reqs)
            start = time.perf_counter()
            self.graphs, self.outputs = capture_graphs(self.token_buckets, self._prepare_capture)
            if self.lora is not None:
                self.lora.clear()
            logger.info("extend CUDA graphs captured in %.1f s", time.perf_counter() - start)

    def _reqs(self, tokens: int) -> int:
        return min(tokens, self.max_reqs)

    def _static_batch(self, tokens: int) -> ForwardBatch:
        reqs = self._reqs(tokens)
        fb = ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=reqs,
            input_ids=self.input_ids[:tokens], positions=self.positions[:tokens],
            req_pool_indices=self.req_pool_indices[:reqs], seq_lens=self.seq_lens[:reqs],
            out_cache_loc=self.out_cache_loc[:tokens], seq_lens_cpu=[],
            extend_prefix_lens=self.extend_prefix_lens[:reqs], extend_seq_lens=self.extend_seq_lens[:reqs],
            extend_start_loc=self.extend_start_loc[:reqs],
        )
        fb.req_to_token_pool = self.runner.req_to_token_pool
        fb.kv_pool = self.runner.kv_pool
        fb.attn_backend = self.attn_backend
        return fb

    def _run_static(self, tokens: int) -> torch.Tensor:
        fb = self._static_batch(tokens)
        self.attn_backend.init_extend_graph_metadata(tokens, fb)
        if self.lora is not None:
            self.lora.use_static_idx(self.lora_idx[:tokens])
        return self.model(fb)

    def _prepare_capture(self, tokens: int):
        # a valid batch to capture with: one request of `tokens` new tokens, no prefix, KV to slot 0
        self._load(tokens, [tokens], [0])
        self.req_pool_indices[:1].zero_()
        return lambda: self._run_static(tokens)

    def _load(self, tokens: int, extend_lens: list[int], prefix_lens: list[int]) -> None:
        """The requests' lengths (host lists) into the static request rows, the rows past them zero-length; token
        rows and req_pool_indices are the caller's."""
        n = len(extend_lens)
        ext = torch.tensor(extend_lens, dtype=torch.int32)
        prefix = torch.tensor(prefix_lens, dtype=torch.int32)
        # [4, n]: new tokens, prefix, total, first row
        rows = torch.stack([ext, prefix, ext + prefix, torch.cumsum(ext, 0, dtype=torch.int32) - ext])
        if rows.device != self.extend_seq_lens.device:
            rows = rows.pin_memory().to(self.extend_seq_lens.device, non_blocking=True)
        self.extend_seq_lens[:n].copy_(rows[0])
        self.extend_prefix_lens[:n].copy_(rows[1])
        self.seq_lens[:n].copy_(rows[2])
        self.extend_start_loc[:n].copy_(rows[3])
        self.extend_seq_lens[n:self._reqs(tokens)].zero_()

    def can_run(self, fb: ForwardBatch) -> bool:
        return (fb.forward_mode.is_extend() and fb.extend_seq_lens_cpu is not None
                and fb.extend_prefix_lens_cpu is not None and 0 < fb.input_ids.shape[0] <= self.max_tokens
                and fb.batch_size <= self._reqs(self.max_tokens)
                and not any(fb.mm_inputs or ()) and fb.tree_mask is None)

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """fb's hidden states [T, hidden] (rows of the graph's static output)."""
        tokens = fb.input_ids.shape[0]
        padded = self.token_buckets[bisect.bisect_left(self.token_buckets, tokens)]  # its min(T, max_reqs) >= B
        self.num_replays += 1
        self.input_ids[:tokens].copy_(fb.input_ids)
        self.positions[:tokens].copy_(fb.positions)
        self.out_cache_loc[:tokens].copy_(fb.out_cache_loc)
        self.input_ids[tokens:padded].zero_()
        self.positions[tokens:padded].zero_()
        self.out_cache_loc[tokens:padded].zero_()
        self.req_pool_indices[:fb.batch_size].copy_(fb.req_pool_indices)
        self._load(padded, fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu)
        if self.lora is not None:
            self.lora.load_static_idx(fb, self.lora_idx, padded)
        if self.captured:
            self.graphs[padded].replay()
            return self.outputs[padded][:tokens]
        out = self._run_static(padded)[:tokens]
        if self.lora is not None:
            self.lora.clear()
        return out
