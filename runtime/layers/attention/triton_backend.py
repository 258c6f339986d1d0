"""TritonAttnBackend: paged-KV attention through braid's Triton kernels (the default on GPU).

What it reads from the model runner (all through getattr, so the runner can adapt); only the decode
scratch is sized from it, and a layer wider than these numbers grows the scratch (outside CUDA graphs):
  model_runner.device                         torch device (or its name) the scratch buffers live on
  model_runner.model_config.num_attention_heads, .num_key_value_heads
                                              the model's (global) head counts, divided by the TP size:
  model_runner.tp_size, else model_runner.server_args.tp_size (default 1)
  model_runner.model_config.head_dim          (default hidden_size // num_attention_heads)
  model_runner.model_config.v_head_dim        (default head_dim)
  model_runner.model_config.attention_arch == "mla": one latent KV head, Dv = .kv_lora_rank
  model_runner.server_args.triton_attention_num_kv_splits   (optional; else the constructor's value; else the
                                              split count per decode batch size: decode_kv_splits)
The KV pool and the req_to_token table are taken from each ForwardBatch (fb.kv_pool,
fb.req_to_token_pool.req_to_token); the pool must offer set_kv(layer_id, loc, k, v) with
k: [T, Hkv, D], v: [T, Hkv, Dv], get_key_buffer / get_value_buffer(layer_id) -> [S, Hkv, D|Dv] (read only)
and kv_scales(layer_id) -> (k_scale, v_scale), which dequantise what an fp8 cache holds.

Per-layer attributes used: layer_id, num_heads, num_kv_heads, head_dim, v_head_dim, scaling,
logit_cap (0 = off), sliding_window (-1 = off; W > 0 means a query at position p sees (p - W, p]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from braid.runtime.layers.attention.base import AttentionBackend
from braid.runtime.layers.attention.triton_ops import decode_attention_fwd, extend_attention_fwd
from braid.runtime.layers.attention.triton_ops.extend_attention import extend_block_m, extend_block_table

if TYPE_CHECKING:
    from braid.runtime.core import ForwardBatch

__all__ = ["TritonAttnBackend", "TritonAttnMetadata"]

# The least split count on a GPU: 8 splits beat 16 for every KV dtype at batches of 8 and more
# (benchmarks/gpu/decode_attention_kv_dtype.py and gemma2_decode_attention.py; docs/benchmark_history.md).
DEFAULT_NUM_KV_SPLITS_GPU = 8
DEFAULT_NUM_KV_SPLITS_CPU = 4  # the interpreter runs programs one by one
# Small decode batches split the keys further, so that stage 1 has about this many programs per SM: with one program
# per SM the added KV of a long context streams well below the copy rate. The count is where
# benchmarks/gpu/gemma2_decode_attention.py's sweep of split counts peaked (docs/benchmark_history.md, 2026-12-04):
# 8 KV heads take 32 splits at batch 1, 16 at batches 2-3 and the least, 8, from batch 4.
DECODE_PROGRAMS_PER_SM = 1.9
# Window layers take the batch's split count too: half as many for Gemma-2's (which read half the keys at 8K) made
# no difference end to end (docs/benchmark_history.md, session 16).
MAX_NUM_KV_SPLITS_GPU = 64
QUERY_HEADS_PER_PROGRAM = 16  # decode_attention's _BLOCK_H: one stage-1 program per 16 query heads of a KV head


@dataclass
class TritonAttnMetadata:
    max_len_extend: int = 0  # EXTEND: longest new-token run in the batch (sizes the kernel grid)
    extend_start_loc: Optional[torch.Tensor] = None  # EXTEND: [B] offset of each request's rows
    attn_logits: Optional[torch.Tensor] = None  # DECODE: fp32 scratch [B, H, splits, Dv + 1] (decode_kv_splits(B))
    in_cuda_graph: bool = False  # scratch is the static graph buffer; it must not be reallocated
    # EXTEND in a CUDA graph: (request, query block) per program of a fixed grid (extend_block_table), int32 [E] each
    block_table: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    # hybrid KV pool (mem_cache/window_pool.py): window layers read [B, L] rows of window slots, indexed 0..B-1
    window_req_to_token: Optional[torch.Tensor] = None
    window_req_indices: Optional[torch.Tensor] = None


class TritonAttnBackend(AttentionBackend):
    supports_extend_cuda_graph = True
    supports_tree_mask = True

    def __init__(self, model_runner, num_kv_splits: Optional[int] = None):
        self.device = torch.device(getattr(model_runner, "device", "cuda"))
        mc = model_runner.model_config
        server_args = getattr(model_runner, "server_args", None)
        tp_size = getattr(model_runner, "tp_size", None) or getattr(server_args, "tp_size", None) or 1
        tp_size = max(1, int(tp_size))
        total_heads = int(mc.num_attention_heads)
        self.num_heads = max(1, total_heads // tp_size)
        total_kv = int(getattr(mc, "num_key_value_heads", None) or total_heads)
        self.num_kv_heads = max(1, total_kv // tp_size)  # KV heads are replicated when tp_size > total_kv
        self.head_dim = int(getattr(mc, "head_dim", None) or mc.hidden_size // total_heads)
        self.v_head_dim = int(getattr(mc, "v_head_dim", None) or self.head_dim)
        if getattr(mc, "attention_arch", None) == "mla":
            # absorbed MLA attends over the latent: keys [kv_lora_rank + rope], values [kv_lora_rank]
            self.num_kv_heads = 1
            self.v_head_dim = max(self.v_head_dim, int(getattr(mc, "kv_lora_rank", 0) or 0))

        splits = num_kv_splits or getattr(server_args, "triton_attention_num_kv_splits", None)
        if splits is None:
            splits = DEFAULT_NUM_KV_SPLITS_GPU if self.device.type == "cuda" else DEFAULT_NUM_KV_SPLITS_CPU
        if int(splits) < 1:
            raise ValueError(f"num_kv_splits must be >= 1, got {splits}")
        self.num_kv_splits = int(splits)  # the least split count: decode_kv_splits raises it for small batches
        self.fixed_num_kv_splits = bool(num_kv_splits or getattr(server_args, "triton_attention_num_kv_splits", None))
        self.sm_count = (torch.cuda.get_device_properties(self.device).multi_processor_count
                         if self.device.type == "cuda" else 0)
        self.cuda_graph_attn_logits: Optional[torch.Tensor] = None  # the max batch's view of _graph_scratch
        self._graph_scratch: Optional[torch.Tensor] = None
        # hybrid KV pool: the decode graphs' and the extend graphs' static window-slot tables (_window_tables)
        self._decode_window_tables: Optional[tuple] = None
        self._extend_window_tables: Optional[tuple] = None

    # ------------------------------------------------------------------ metadata

    def decode_kv_splits(self, bs: int) -> int:
        """Split count of a decode batch of bs requests (fixed per CUDA graph, as the scratch's dim 2): the default,
        or more when bs x KV heads gives stage 1 fewer than DECODE_PROGRAMS_PER_SM programs per SM (up to
        MAX_NUM_KV_SPLITS_GPU, a multiple of 8). A split count given explicitly is used for every batch."""
        if self.fixed_num_kv_splits or not self.sm_count:
            return self.num_kv_splits
        head_blocks = math.ceil(max(1, self.num_heads // self.num_kv_heads) / QUERY_HEADS_PER_PROGRAM)
        wanted = math.ceil(DECODE_PROGRAMS_PER_SM * self.sm_count / (max(1, bs) * self.num_kv_heads * head_blocks))
        return max(self.num_kv_splits, min(MAX_NUM_KV_SPLITS_GPU, math.ceil(wanted / 8) * 8))

    def _decode_scratch(self, bs: int, num_heads: int, v_head_dim: int) -> torch.Tensor:
        return torch.empty((bs, num_heads, self.decode_kv_splits(bs), v_head_dim + 1), dtype=torch.float32,
                           device=self.device)

    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        self._init_metadata(fb)
        md = fb.attn_metadata
        if hasattr(fb.kv_pool, "window_rows") and fb.batch_size and isinstance(md, TritonAttnMetadata):
            width = max(fb.seq_lens_cpu) if fb.seq_lens_cpu else fb.req_to_token_pool.req_to_token.shape[1]
            md.window_req_to_token = fb.kv_pool.window_rows(fb.req_to_token_pool.req_to_token,
                                                                     fb.req_pool_indices, width)
            md.window_req_indices = torch.arange(fb.batch_size, device=md.window_req_to_token.device)
            if fb.out_cache_loc is not None:  # the new tokens' window slots, once for every window layer
                fb.kv_pool.translate_batch_slots(fb.out_cache_loc)

    def _init_metadata(self, fb: "ForwardBatch") -> None:
        if fb.forward_mode.is_decode():
            fb.attn_metadata = TritonAttnMetadata(
                attn_logits=self._decode_scratch(fb.batch_size, self.num_heads, self.v_head_dim))
            return
        if not fb.forward_mode.is_extend():
            fb.attn_metadata = TritonAttnMetadata()
            return
        if fb.extend_seq_lens_cpu is not None:
            max_len_extend = max(fb.extend_seq_lens_cpu, default=0)
        else:
            max_len_extend = int(fb.extend_seq_lens.max().item()) if fb.batch_size else 0
        start_loc = fb.extend_start_loc
        if start_loc is None:
            start_loc = torch.zeros_like(fb.extend_seq_lens)
            start_loc[1:] = torch.cumsum(fb.extend_seq_lens[:-1], dim=0)
        fb.attn_metadata = TritonAttnMetadata(max_len_extend=int(max_len_extend), extend_start_loc=start_loc)

    def _metadata(self, fb: "ForwardBatch") -> TritonAttnMetadata:
        md = fb.attn_metadata
        if not isinstance(md, TritonAttnMetadata):
            raise RuntimeError("TritonAttnBackend: call init_forward_metadata(forward_batch) before the layers run")
        return md

    # ------------------------------------------------------------------ forward

    @staticmethod
    def _layer_dims(layer) -> tuple[int, int, int, int]:
        d = layer.head_dim
        return layer.num_heads, layer.num_kv_heads, d, getattr(layer, "v_head_dim", None) or d

    @staticmethod
    def _token_table(layer, fb: "ForwardBatch", md: TritonAttnMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(req_to_token, row indices) the kernels read the layer's KV slots through: a hybrid pool's window
        layers read window slots (translated once per batch), every other layer the full slots."""
        pool = fb.kv_pool
        if hasattr(pool, "is_window_layer") and pool.is_window_layer(layer.layer_id):
            if md.window_req_to_token is None:
                raise RuntimeError("TritonAttnBackend: the batch's window slots were not translated; call "
                                   "init_forward_metadata(forward_batch) first")
            return md.window_req_to_token, md.window_req_indices
        return fb.req_to_token_pool.req_to_token, fb.req_pool_indices

    @staticmethod
    def _layer_options(layer) -> tuple[float, int]:
        logit_cap = getattr(layer, "logit_cap", 0.0) or 0.0
        window = getattr(layer, "sliding_window", -1)
        return float(logit_cap), (-1 if window is None else int(window))

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True) -> torch.Tensor:
        h, h_kv, d, dv = self._layer_dims(layer)
        md = self._metadata(fb)
        q3 = q.reshape(-1, h, d)
        k3 = k.reshape(-1, h_kv, d)
        v3 = v.reshape(-1, h_kv, dv)
        pool = fb.kv_pool
        if save_kv_cache:
            pool.set_kv(layer.layer_id, fb.out_cache_loc, k3, v3)
        # a graphed pass's padding rows belong to no request and are not written: zeros keep them finite for what
        # follows (per-tensor activation scales)
        o = q3.new_zeros((q3.shape[0], h, dv)) if md.block_table is not None else q3.new_empty((q3.shape[0], h, dv))
        logit_cap, window = self._layer_options(layer)
        req_to_token, req_indices = self._token_table(layer, fb, md)
        extend_attention_fwd(
            q3, k3, v3, o,
            pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id),
            req_to_token, req_indices, fb.seq_lens,
            fb.extend_seq_lens, md.extend_start_loc, fb.extend_prefix_lens, md.max_len_extend,
            layer.scaling, logit_cap, window, *pool.kv_scales(layer.layer_id), block_table=md.block_table,
            tree_mask=fb.tree_mask, tree_mask_start=fb.tree_mask_start,
        )
        return o.view(-1, h * dv)

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True) -> torch.Tensor:
        h, h_kv, d, dv = self._layer_dims(layer)
        md = self._metadata(fb)
        q3 = q.reshape(-1, h, d)
        pool = fb.kv_pool
        if save_kv_cache:
            pool.set_kv(layer.layer_id, fb.out_cache_loc, k.reshape(-1, h_kv, d), v.reshape(-1, h_kv, dv))
        bs = q3.shape[0]
        scratch = md.attn_logits
        if scratch is None or scratch.shape[0] < bs or scratch.shape[1] < h or scratch.shape[3] < dv + 1:
            if md.in_cuda_graph:
                raise RuntimeError(
                    f"TritonAttnBackend: the CUDA-graph scratch {tuple(scratch.shape)} is too small for a layer "
                    f"with {h} heads and v_head_dim {dv} at batch {bs}; check model_config's head counts")
            # a layer wider than model_config said (e.g. heads already divided by TP): grow the scratch
            scratch = md.attn_logits = self._decode_scratch(bs, h, dv)
        o = q3.new_empty((bs, h, dv))
        logit_cap, window = self._layer_options(layer)
        req_to_token, req_indices = self._token_table(layer, fb, md)
        decode_attention_fwd(
            q3, pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id), o,
            req_to_token, req_indices, fb.seq_lens,
            scratch, scratch.shape[2], layer.scaling, logit_cap, window, *pool.kv_scales(layer.layer_id),
        )
        return o.view(-1, h * dv)

    # ------------------------------------------------------------------ CUDA graphs (decode)

    def init_cuda_graph_state(self, max_bs: int) -> None:
        # one static buffer; batch size b views its first b * splits(b) rows as [b, H, splits(b), Dv + 1]
        rows = max(b * self.decode_kv_splits(b) for b in range(1, max_bs + 1))
        self._graph_scratch = torch.empty(rows * self.num_heads * (self.v_head_dim + 1), dtype=torch.float32,
                                          device=self.device)
        self.cuda_graph_attn_logits = self._graph_scratch_view(max_bs)

    def _graph_scratch_view(self, bs: int) -> torch.Tensor:
        shape = (bs, self.num_heads, self.decode_kv_splits(bs), self.v_head_dim + 1)
        return self._graph_scratch[:math.prod(shape)].view(shape)

    def _graph_metadata(self, bs: int, fb: "ForwardBatch") -> None:
        if self.cuda_graph_attn_logits is None:
            raise RuntimeError("TritonAttnBackend: call init_cuda_graph_state(max_bs) first")
        if bs > self.cuda_graph_attn_logits.shape[0]:
            raise ValueError(f"batch {bs} exceeds the CUDA-graph capacity {self.cuda_graph_attn_logits.shape[0]}")
        # a view of the static buffer: the same address at capture and at every replay
        fb.attn_metadata = md = TritonAttnMetadata(attn_logits=self._graph_scratch_view(bs), in_cuda_graph=True)
        if hasattr(fb.kv_pool, "window_rows"):
            # hybrid KV pool: whole rows translated into a static buffer before each replay (a gather, no sync)
            if self._decode_window_tables is None:
                max_bs = self.cuda_graph_attn_logits.shape[0]
                self._decode_window_tables = self._window_tables(max_bs, max_bs, fb.req_to_token_pool.req_to_token)
            self._fill_window_tables(md, fb, self._decode_window_tables)

    def _window_tables(self, max_reqs: int, max_tokens: int, req_to_token: torch.Tensor) -> tuple:
        """A graph's static window-slot tables for a hybrid pool: the requests' whole rows [max_reqs, width] int32,
        the row ids 0..max_reqs-1, the new tokens' window slots [max_tokens] int64."""
        return (torch.zeros((max_reqs, req_to_token.shape[1]), dtype=torch.int32, device=self.device),
                torch.arange(max_reqs, device=self.device),
                torch.zeros(max_tokens, dtype=torch.int64, device=self.device))

    @staticmethod
    def _fill_window_tables(md: TritonAttnMetadata, fb: "ForwardBatch", tables: tuple) -> None:
        # every request's whole row: a graph cannot cut it to the batch's longest sequence on the host
        rows, row_ids, loc = tables
        req_to_token = fb.req_to_token_pool.req_to_token
        md.window_req_to_token = fb.kv_pool.window_rows(req_to_token, fb.req_pool_indices,
                                                                 req_to_token.shape[1], out=rows)
        md.window_req_indices = row_ids[:fb.batch_size]
        fb.kv_pool.translate_batch_slots(fb.out_cache_loc, out=loc)

    # ------------------------------------------------------------------ CUDA graphs (extend)

    def init_extend_graph_state(self, max_tokens: int, max_reqs: int, pool, req_to_token: torch.Tensor,
                                query_dtype: torch.dtype) -> None:
        """Static buffers of the extend graphs: the block table; for a hybrid pool (window layers) the requests'
        whole req_to_token rows in window slots and the new tokens' window slots, refilled inside each replay."""
        self.graph_extend_block_m = extend_block_m(self.head_dim, self.v_head_dim, self.device, query_dtype)
        entries = self.extend_table_entries(max_tokens, max_reqs)
        self._graph_block_table = (torch.full((entries,), -1, dtype=torch.int32, device=self.device),
                                   torch.zeros(entries, dtype=torch.int32, device=self.device))
        if hasattr(pool, "window_rows"):
            self._extend_window_tables = self._window_tables(max_reqs, max_tokens, req_to_token)

    def extend_table_entries(self, tokens: int, reqs: int) -> int:
        # every request's last query block may be partial: at most cdiv(tokens, block) + reqs blocks
        return -(-tokens // self.graph_extend_block_m) + reqs

    def init_extend_graph_metadata(self, tokens: int, fb: "ForwardBatch") -> None:
        """fb: a padded extend batch of static tensors (tokens rows, fb.batch_size requests, those past the real
        ones with no new tokens). Runs inside the capture: the block table is rebuilt from fb.extend_seq_lens at
        every replay."""
        entries = self.extend_table_entries(tokens, fb.batch_size)
        table = extend_block_table(fb.extend_seq_lens, self.graph_extend_block_m, entries,
                                   out=(self._graph_block_table[0][:entries], self._graph_block_table[1][:entries]))
        fb.attn_metadata = md = TritonAttnMetadata(extend_start_loc=fb.extend_start_loc, block_table=table,
                                                   in_cuda_graph=True)
        if self._extend_window_tables is not None:
            self._fill_window_tables(md, fb, self._extend_window_tables)

    def init_forward_metadata_capture(self, bs: int, fb: "ForwardBatch") -> None:
        self._graph_metadata(bs, fb)

    def init_forward_metadata_replay(self, bs: int, fb: "ForwardBatch") -> None:
        self._graph_metadata(bs, fb)
