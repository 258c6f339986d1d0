"""attention_backend="flashinfer": FlashInfer's FA2 paged prefill/decode kernels (flashinfer-python 0.7.x).

Importing this module raises ImportError with the reason when flashinfer cannot be imported; the registry turns
that into a clear ValueError at startup. The Triton backend ("triton", the GPU default) needs no extra package.

How braid's pool maps onto FlashInfer's paged KV: page_size 1, NHD layout, one page per token slot, so a request's
page list is its row of req_to_token, `kv_indices = req_to_token[req_pool_indices[i], :seq_lens[i]]` concatenated
over the batch (CSR with `kv_indptr`), and every last page holds one token. Each layer's K and V buffers
[S, Hkv, D] are passed as the pair of [S, 1, Hkv, D] views.

FlashInfer fixes sm_scale, the soft cap and the sliding window when a wrapper is planned, so layers are grouped
into variants (heads, head_dim, window, soft cap, scale) with one wrapper each; every variant is planned once per
batch in init_forward_metadata. A window-W variant is planned over its own page lists, which start at the first
query's window (FlashInfer's kernels load every listed key and only mask those outside window_left): its layers
read W - 1 + new tokens per request, not the whole context, and never a hybrid pool's released window KV. The variants are read from the model's RadixAttention modules when the runner
has a model; a layer of a variant not seen yet is planned when it first runs (never inside a graph capture).

plan() runs the scheduler on the host: braid hands it host copies of the indptr arrays (built from
fb.seq_lens_cpu), so it does not wait for the device; it then copies its schedule from a pinned buffer to the
device asynchronously. Because that pinned buffer is reused by the wrapper's next plan(), the next plan() first
waits for the previous copy (an event; with a synchronous scheduler it has long completed).

CUDA graphs (decode): one wrapper per captured batch size and variant, in use_cuda_graph mode over fixed indptr /
indices / last-page-length buffers shared by all of them. Capture plans outside the graph; every replay writes
the new indptr and indices into those buffers and plans again (FlashInfer's graph-mode schedule keeps the
launch shape of a batch size fixed and puts what changes into device memory the captured kernels read).

FP8 KV caches (--kv-cache-dtype fp8_e5m2 / fp8_e4m3): the wrappers are planned with the cache's fp8 dtype for the
keys and values (queries and output in the model dtype) and read the pool's fp8 views; each layer's
(k_scale, v_scale) go to run() (FlashInfer multiplies the softmax scale by k_scale and the output by v_scale).

What it reads from the model runner:
  model_runner.device, .dtype (fp16 or bf16: FlashInfer has no fp32 kernels), .model_config (head_dim,
  v_head_dim, attention_arch), .kv_pool (its cache dtype and per-layer KV scales; without a pool,
  .server_args.kv_cache_dtype), .model (its RadixAttention layers), all through getattr. Per layer: layer_id,
  num_heads, num_kv_heads, head_dim, v_head_dim, scaling, logit_cap (0 = off), sliding_window (-1 = off).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

try:
    from flashinfer.decode import BatchDecodeWithPagedKVCacheWrapper
    from flashinfer.prefill import BatchPrefillWithPagedKVCacheWrapper
except Exception as e:  # an import that fails for any reason (missing package, CUDA libraries) means "not available"
    raise ImportError(f"attention_backend='flashinfer' needs the flashinfer package (pip install flashinfer-python), "
                      f"which did not import here ({type(e).__name__}: {e}); the default 'triton' backend needs "
                      f"nothing extra") from e

from braid.runtime.layers import pdl
from braid.runtime.layers.attention.base import AttentionBackend
from braid.runtime.layers.attention.triton_ops.kv_indices import build_kv_indices, csr_indptr, window_kv_spans
from braid.runtime.dtypes import FP8_DTYPES, kv_cache_dtype

if TYPE_CHECKING:
    from braid.runtime.core import ForwardBatch

__all__ = ["FlashInferAttnBackend", "FlashInferMetadata"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
DEFAULT_WORKSPACE_BYTES = 256 * 1024 * 1024
# from this query/KV head ratio on, decode runs FlashInfer's tensor-core (prefill) kernel instead of the CUDA-core
# decode kernel, which is also compiled only for ratios 1, 2, 3, 4, 6, 8 and 16
TENSOR_CORE_DECODE_MIN_GROUP = 4
_indptr = csr_indptr


# ---------------------------------------------------------------------------------------------- metadata

@dataclass(frozen=True)
class _Variant:
    """What a FlashInfer plan fixes for the layers that share it."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    window_left: int  # -1: no window; braid's window W (a query at p sees (p - W, p]) is window_left W - 1
    logit_cap: float  # 0: off
    sm_scale: float

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def window(self) -> int:
        return self.window_left + 1 if self.window_left >= 0 else 0


@dataclass
class FlashInferMetadata:
    mode: str  # "decode", "extend" or "idle"
    batch_size: int = 0
    qo_indptr_cpu: Optional[torch.Tensor] = None  # EXTEND: [B + 1] int32, host
    kv_indptr_cpu: Optional[torch.Tensor] = None  # [B + 1] int32, host
    kv_indices: Optional[torch.Tensor] = None  # [>= kv_indptr[B]] int32, device
    last_page_len_cpu: Optional[torch.Tensor] = None  # [B] int32 ones, host
    graph_bs: Optional[int] = None  # DECODE under CUDA graphs: the captured batch size whose wrappers are used
    wrappers: dict = field(default_factory=dict)  # _Variant -> wrapper planned for this batch
    # window W -> (kv_indptr_cpu, kv_indices) over only the keys a window-W layer sees (from the first query's
    # window on), in a hybrid KV pool's window slots (mem_cache/window_pool.py) when the pool keeps them apart
    window_kv: dict = field(default_factory=dict)
    source: Optional["ForwardBatch"] = None  # for a window first seen mid-batch
    qo_lens: Optional[list] = None  # EXTEND: new tokens per request (DECODE: one each)


def _variant_of(layer) -> _Variant:
    window = getattr(layer, "sliding_window", -1)
    window = -1 if window is None or window <= 0 else int(window)
    return _Variant(num_heads=int(layer.num_heads), num_kv_heads=int(layer.num_kv_heads),
                    head_dim=int(layer.head_dim), window_left=window - 1 if window > 0 else -1,
                    logit_cap=float(getattr(layer, "logit_cap", 0.0) or 0.0), sm_scale=float(layer.scaling))


def _check_dims(head_dim: int, v_head_dim: int, where: str) -> None:
    if head_dim != v_head_dim:
        raise ValueError(f"attention_backend='flashinfer' needs equal key and value head dims; {where} has "
                         f"head_dim {head_dim} and v_head_dim {v_head_dim} (use attention_backend='triton')")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"attention_backend='flashinfer' supports head_dim {SUPPORTED_HEAD_DIMS}; {where} has "
                         f"{head_dim} (use attention_backend='triton')")


# ---------------------------------------------------------------------------------------------- backend

class FlashInferAttnBackend(AttentionBackend):
    def __init__(self, model_runner, workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
                 enable_pdl: Optional[bool] = None):
        mc = model_runner.model_config
        server_args = getattr(model_runner, "server_args", None)
        if getattr(mc, "attention_arch", None) == "mla":
            raise ValueError("attention_backend='flashinfer' does not run MLA models in braid; "
                             "use attention_backend='triton'")
        pool = getattr(model_runner, "kv_pool", None)
        dtype = getattr(model_runner, "dtype", None) or getattr(pool, "dtype", None)
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"attention_backend='flashinfer' runs float16/bfloat16 models only (FlashInfer has no "
                             f"float32 kernels); this model runs in {dtype}: pass --dtype bfloat16 or use "
                             f"attention_backend='triton'")
        self.dtype = dtype
        kv_dtype = getattr(pool, "cache_dtype", None) or kv_cache_dtype(getattr(server_args, "kv_cache_dtype", None),
                                                                         dtype)
        if kv_dtype != dtype and kv_dtype not in FP8_DTYPES:
            raise ValueError(f"attention_backend='flashinfer' reads KV caches in the model dtype {dtype} or fp8 "
                             f"(e4m3, e5m2), got {kv_dtype}")
        self.kv_dtype = kv_dtype
        # an fp8 cache's values times the layer's (k_scale, v_scale) are the stored K and V: FlashInfer folds k_scale
        # into the softmax scale and multiplies the output by v_scale (host floats, fixed once calibrated, so the
        # CUDA graphs captured after calibration hold them)
        self.kv_is_fp8 = kv_dtype in FP8_DTYPES

        # head counts come from the layers themselves (already divided by TP); only the dims are checked here
        self.head_dim = int(getattr(mc, "head_dim", None) or mc.hidden_size // int(mc.num_attention_heads))
        self.v_head_dim = int(getattr(mc, "v_head_dim", None) or self.head_dim)
        _check_dims(self.head_dim, self.v_head_dim, "this model")

        self.device = torch.device(getattr(model_runner, "device", "cuda"))
        if self.device.type != "cuda":
            raise ValueError(f"attention_backend='flashinfer' needs a CUDA device, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        # FlashInfer's own default would turn PDL on for Hopper whatever --disable-pdl says
        self.enable_pdl = pdl.enabled(model_runner.device) if enable_pdl is None else enable_pdl

        with torch.inference_mode(False):
            # FlashInfer asks for a zeroed buffer before its first use
            self.workspace = torch.zeros(int(workspace_bytes), dtype=torch.uint8, device=self.device)
        self._variants: dict[_Variant, None] = {}  # insertion-ordered set
        self._decode_wrappers: dict[_Variant, BatchDecodeWithPagedKVCacheWrapper] = {}
        self._prefill_wrappers: dict[_Variant, BatchPrefillWithPagedKVCacheWrapper] = {}
        self._graph_wrappers: dict[int, dict[_Variant, BatchDecodeWithPagedKVCacheWrapper]] = {}
        self._plan_events: dict[int, torch.cuda.Event] = {}
        self._ones_cpu = torch.ones(1, dtype=torch.int32)
        self._graph_max_bs = 0
        self._graph_indptr: Optional[torch.Tensor] = None
        self._graph_indices: Optional[torch.Tensor] = None
        self._graph_last_page_len: Optional[torch.Tensor] = None
        self._graph_window: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # W -> (indptr, indices) buffers
        self._hybrid_pool = hasattr(pool, "window_slots")  # window layers' KV in window slots

        model = getattr(model_runner, "model", None)
        if isinstance(model, torch.nn.Module):
            from braid.runtime.layers.radix_attention import RadixAttention

            for m in model.modules():
                if isinstance(m, RadixAttention):
                    self._register(_variant_of(m), getattr(m, "v_head_dim", None) or m.head_dim)

    # ------------------------------------------------------------------ variants and wrappers

    def _register(self, variant: _Variant, v_head_dim: int) -> None:
        if variant in self._variants:
            return
        _check_dims(variant.head_dim, int(v_head_dim), "a layer")
        if variant.num_kv_heads < 1 or variant.num_heads % variant.num_kv_heads:
            raise ValueError(f"attention_backend='flashinfer': {variant.num_heads} query heads are not a multiple "
                             f"of {variant.num_kv_heads} KV heads")
        self._variants[variant] = None

    def _decode_wrapper(self, variant: _Variant, graph_bs: Optional[int]) -> BatchDecodeWithPagedKVCacheWrapper:
        tensor_cores = variant.group >= TENSOR_CORE_DECODE_MIN_GROUP
        if graph_bs is None:
            w = self._decode_wrappers.get(variant)
            if w is None:
                with torch.inference_mode(False):
                    w = BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=tensor_cores,
                                                           backend="fa2")
                self._decode_wrappers[variant] = w
            return w
        per_bs = self._graph_wrappers.setdefault(graph_bs, {})
        w = per_bs.get(variant)
        if w is None:
            with torch.inference_mode(False):
                indptr, indices = (self._graph_window_buffers(variant.window) if variant.window
                                   else (self._graph_indptr, self._graph_indices))
                w = BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
                    paged_kv_indptr_buffer=indptr[:graph_bs + 1], paged_kv_indices_buffer=indices,
                    paged_kv_last_page_len_buffer=self._graph_last_page_len[:graph_bs], backend="fa2")
            per_bs[variant] = w
        return w

    def _prefill_wrapper(self, variant: _Variant) -> BatchPrefillWithPagedKVCacheWrapper:
        w = self._prefill_wrappers.get(variant)
        if w is None:
            with torch.inference_mode(False):
                w = BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
            self._prefill_wrappers[variant] = w
        return w

    def _plan(self, md: FlashInferMetadata, variant: _Variant) -> None:
        if md.mode == "decode":
            w = self._decode_wrapper(variant, md.graph_bs)
        else:
            w = self._prefill_wrapper(variant)
        done = self._plan_events.get(id(w))
        if done is not None:
            done.synchronize()  # the previous plan's pinned-buffer copy has run (see the module docstring)
        common = dict(window_left=variant.window_left, logits_soft_cap=variant.logit_cap, sm_scale=variant.sm_scale,
                      q_data_type=self.dtype, kv_data_type=self.kv_dtype, non_blocking=True)
        # a window layer's plan covers only the keys its window can see: FlashInfer's kernels mask keys outside
        # window_left but still load them; trimmed lists make them skip the rest (and never read released KV)
        kv_indptr_cpu, kv_indices = (self._window_kv(md, variant.window) if variant.window
                                     else (md.kv_indptr_cpu, md.kv_indices))
        if md.mode == "decode":
            w.plan(kv_indptr_cpu, kv_indices, md.last_page_len_cpu, variant.num_heads, variant.num_kv_heads,
                   variant.head_dim, 1, **common)
        else:
            w.plan(md.qo_indptr_cpu, kv_indptr_cpu, kv_indices, md.last_page_len_cpu, variant.num_heads,
                   variant.num_kv_heads, variant.head_dim, 1, head_dim_vo=variant.head_dim, causal=True, **common)
        if done is None:
            done = self._plan_events[id(w)] = torch.cuda.Event()
        done.record()
        md.wrappers[variant] = w

    def _plan_all(self, md: FlashInferMetadata, variants) -> None:
        for variant in variants:
            self._plan(md, variant)

    # ------------------------------------------------------------------ metadata

    def _last_page_len(self, bs: int) -> torch.Tensor:
        if self._ones_cpu.numel() < bs:
            self._ones_cpu = torch.ones(max(bs, 2 * self._ones_cpu.numel()), dtype=torch.int32)
        return self._ones_cpu[:bs]

    def _kv_metadata(self, fb: "ForwardBatch", mode: str, graph_bs: Optional[int] = None) -> FlashInferMetadata:
        bs = fb.batch_size
        seq_lens = fb.seq_lens_cpu if fb.seq_lens_cpu is not None else fb.seq_lens.tolist()
        if len(seq_lens) != bs:
            raise ValueError(f"FlashInferAttnBackend: {len(seq_lens)} seq_lens_cpu for a batch of {bs}")
        kv_indptr_cpu = _indptr([int(n) for n in seq_lens])
        total = int(kv_indptr_cpu[-1])
        req_to_token = fb.req_to_token_pool.req_to_token
        if graph_bs is None:
            kv_indptr = kv_indptr_cpu.to(self.device, non_blocking=True)
            kv_indices = torch.empty(max(total, 1), dtype=torch.int32, device=self.device)
        else:
            self._ensure_graph_buffers(req_to_token)
            if bs != graph_bs:
                raise ValueError(f"FlashInferAttnBackend: a batch of {bs} for the CUDA graph of batch size {graph_bs}")
            if bs > self._graph_max_bs:
                raise ValueError(f"batch {bs} exceeds the CUDA-graph capacity {self._graph_max_bs}")
            if total > self._graph_indices.numel():
                raise ValueError(f"{total} KV tokens exceed the CUDA-graph index buffer "
                                 f"({self._graph_indices.numel()})")
            kv_indptr = self._graph_indptr[:bs + 1]
            kv_indptr.copy_(kv_indptr_cpu, non_blocking=True)
            kv_indices = self._graph_indices
        build_kv_indices(req_to_token, fb.req_pool_indices, kv_indptr, kv_indices, bs)
        return FlashInferMetadata(mode=mode, batch_size=bs, kv_indptr_cpu=kv_indptr_cpu, kv_indices=kv_indices,
                                  last_page_len_cpu=self._last_page_len(bs), graph_bs=graph_bs, source=fb)

    def _window_kv(self, md: FlashInferMetadata, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv_indptr_cpu, kv_indices) of the keys window-W layers see in this batch, built once per batch."""
        if window in md.window_kv:
            return md.window_kv[window]
        fb, bs = md.source, md.batch_size
        seq_lens = [int(n) for n in (fb.seq_lens_cpu if fb.seq_lens_cpu is not None else fb.seq_lens.tolist())]
        starts, lens = window_kv_spans(seq_lens, md.qo_lens or [1] * bs, window)
        indptr_cpu = _indptr(lens)
        total = int(indptr_cpu[-1])
        if md.graph_bs is None:
            indptr = indptr_cpu.to(self.device, non_blocking=True)
            indices = torch.empty(max(total, 1), dtype=torch.int32, device=self.device)
        else:
            indptr, indices = self._graph_window_buffers(window)
            indptr = indptr[:bs + 1]
            indptr.copy_(indptr_cpu, non_blocking=True)
        build_kv_indices(fb.req_to_token_pool.req_to_token, fb.req_pool_indices, indptr, indices, bs,
                         kv_starts=torch.tensor(starts, dtype=torch.int32).to(self.device, non_blocking=True))
        if self._hybrid_pool and total:
            # window layers' KV lives in window slots: a gather on the device
            indices[:total] = fb.kv_pool.window_slots(indices[:total])
        md.window_kv[window] = (indptr_cpu, indices)
        return md.window_kv[window]

    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        if fb.batch_size == 0 or not (fb.forward_mode.is_decode() or fb.forward_mode.is_extend()):
            fb.attn_metadata = FlashInferMetadata(mode="idle")
            return
        if fb.forward_mode.is_decode():
            md = self._kv_metadata(fb, "decode")
        else:
            md = self._kv_metadata(fb, "extend")
            ext = fb.extend_seq_lens_cpu if fb.extend_seq_lens_cpu is not None else fb.extend_seq_lens.tolist()
            md.qo_lens = [int(n) for n in ext]
            md.qo_indptr_cpu = _indptr(md.qo_lens)
        self._plan_all(md, list(self._variants))
        fb.attn_metadata = md
        if self._hybrid_pool and fb.out_cache_loc is not None:  # the new tokens' window slots, once for all layers
            fb.kv_pool.translate_batch_slots(fb.out_cache_loc)

    def _metadata(self, fb: "ForwardBatch", mode: str) -> FlashInferMetadata:
        md = fb.attn_metadata
        if not isinstance(md, FlashInferMetadata) or md.mode != mode:
            raise RuntimeError("FlashInferAttnBackend: call init_forward_metadata(forward_batch) before the layers run")
        return md

    def _wrapper(self, md: FlashInferMetadata, layer):
        variant = _variant_of(layer)
        w = md.wrappers.get(variant)
        if w is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"FlashInferAttnBackend: layer {layer.layer_id} ({variant}) was not planned before "
                                   f"the CUDA-graph capture; run the model once before capturing")
            self._register(variant, getattr(layer, "v_head_dim", None) or variant.head_dim)
            self._plan(md, variant)
            w = md.wrappers[variant]
        return w

    # ------------------------------------------------------------------ forward

    @staticmethod
    def _paged_kv(pool, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        # [S, Hkv, D] -> [S, page_size 1, Hkv, D] (NHD)
        k = pool.get_key_buffer(layer_id)
        v = pool.get_value_buffer(layer_id)
        return k.view(k.shape[0], 1, k.shape[1], k.shape[2]), v.view(v.shape[0], 1, v.shape[1], v.shape[2])

    def _attend(self, md, q, k, v, layer, fb, save_kv_cache) -> torch.Tensor:
        h, h_kv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        dv = getattr(layer, "v_head_dim", None) or d
        pool = fb.kv_pool
        if save_kv_cache:
            pool.set_kv(layer.layer_id, fb.out_cache_loc, k.reshape(-1, h_kv, d), v.reshape(-1, h_kv, dv))
        w = self._wrapper(md, layer)
        scales = {}
        if self.kv_is_fp8:
            k_scale, v_scale = pool.kv_scales(layer.layer_id)
            scales = dict(k_scale=k_scale, v_scale=v_scale)
        o = w.run(q.reshape(-1, h, d), self._paged_kv(pool, layer.layer_id), enable_pdl=self.enable_pdl, **scales)
        return o.view(-1, h * dv)

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True) -> torch.Tensor:
        # the new tokens' K/V go to the pool first; the paged prefill then reads prefix and new tokens alike
        return self._attend(self._metadata(fb, "extend"), q, k, v, layer, fb, save_kv_cache)

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True) -> torch.Tensor:
        return self._attend(self._metadata(fb, "decode"), q, k, v, layer, fb, save_kv_cache)

    # ------------------------------------------------------------------ CUDA graphs (decode)

    def init_cuda_graph_state(self, max_bs: int) -> None:
        self._graph_max_bs = int(max_bs)
        self._graph_indptr = self._graph_indices = self._graph_last_page_len = None
        self._graph_window = {}
        self._graph_window_loc = None  # [max_bs] int64: a hybrid pool's window slots of the new tokens
        self._graph_wrappers.clear()  # they point into the buffers allocated at the next capture

    def _ensure_graph_buffers(self, req_to_token: torch.Tensor) -> None:
        if self._graph_max_bs < 1:
            raise RuntimeError("FlashInferAttnBackend: call init_cuda_graph_state(max_bs) first")
        need = self._graph_max_bs * req_to_token.shape[1]
        if self._graph_indices is not None:
            if self._graph_indices.numel() < need:
                raise ValueError("FlashInferAttnBackend: req_to_token grew after the CUDA graphs were captured")
            return
        with torch.inference_mode(False):
            self._graph_indptr = torch.zeros(self._graph_max_bs + 1, dtype=torch.int32, device=self.device)
            # every captured request may reach the full context
            self._graph_indices = torch.zeros(need, dtype=torch.int32, device=self.device)
            self._graph_last_page_len = torch.ones(self._graph_max_bs, dtype=torch.int32, device=self.device)
        for variant in self._variants:
            if variant.window:
                self._graph_window_buffers(variant.window)

    def _graph_window_buffers(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Static (indptr [max_bs + 1], indices [max_bs * W]) of window-W decode wrappers under CUDA graphs."""
        buffers = self._graph_window.get(window)
        if buffers is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"FlashInferAttnBackend: window {window} was not planned before the CUDA-graph "
                                   f"capture; run the model once before capturing")
            with torch.inference_mode(False):
                buffers = self._graph_window[window] = (
                    torch.zeros(self._graph_max_bs + 1, dtype=torch.int32, device=self.device),
                    torch.zeros(self._graph_max_bs * window, dtype=torch.int32, device=self.device))
        return buffers

    def _graph_new_window_slots(self, fb: "ForwardBatch") -> None:
        """Hybrid pool: the new tokens' window slots into a static buffer the captured layers read."""
        if not self._hybrid_pool:
            return
        if self._graph_window_loc is None:
            with torch.inference_mode(False):
                self._graph_window_loc = torch.zeros(self._graph_max_bs, dtype=torch.int64, device=self.device)
        fb.kv_pool.translate_batch_slots(fb.out_cache_loc, out=self._graph_window_loc)

    def init_forward_metadata_capture(self, bs: int, fb: "ForwardBatch") -> None:
        md = self._kv_metadata(fb, "decode", graph_bs=bs)
        self._plan_all(md, list(self._variants))
        fb.attn_metadata = md
        self._graph_new_window_slots(fb)

    def init_forward_metadata_replay(self, bs: int, fb: "ForwardBatch") -> None:
        md = self._kv_metadata(fb, "decode", graph_bs=bs)
        # the variants this size was captured with (layers first seen in its warm-up included)
        self._plan_all(md, list(self._graph_wrappers.get(bs) or self._variants))
        fb.attn_metadata = md
        self._graph_new_window_slots(fb)
