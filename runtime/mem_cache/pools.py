"""Memory pools: request slots -> token slots (ReqToTokenPool) and token slots -> KV storage (KVPool).

Page size 1: one KV slot holds one token of one request. Slot 0 of every KV buffer is never handed out;
padded batches (CUDA graphs) write their dummy tokens there. The KV pool is the only writer of KV.
"""

from __future__ import annotations

import functools
import logging
import math
from abc import ABC, abstractmethod
from typing import Optional, Sequence, Union

import torch

import braid.runtime.dtypes as dtypes

__all__ = [
    "ReqToTokenPool",
    "KVPool",
    "MHAKVPool",
    "MLAKVPool",
]

DeviceLike = Union[str, torch.device]
ScaleLike = Union[float, Sequence[float]]  # one value for every layer, or one per layer

_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max
# --calculate-kv-scales: the largest |k| (|v|) of a layer's first stored batch is stored as this e4m3 value, an
# eighth of the format's range, so later tokens have 8x that room before they saturate. SmolLM2 (CPU, against fp32
# KV; mean |delta logprob| of the reference tokens): 64 chat prompts x 64 tokens, scale 1.0 0.0568, range / 2 0.0576,
# range / 8 0.0546; the parity texts 0.0676 / 0.0557 / 0.0624 (benchmarks/fp8_accuracy.py, test_fp8_smollm2.py)
KV_SCALE_CALIBRATION_TARGET = _E4M3_MAX / 8

logger = logging.getLogger(__name__)


def _outside_inference_mode(fn):
    """Pool tensors are updated in place both inside and outside torch.inference_mode; tensors created
    inside it could not be updated outside, so they are always created as normal tensors."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.inference_mode(False):
            return fn(*args, **kwargs)

    return wrapper


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


class ReqToTokenPool:
    """A table with one row per running request; row entries are the request's KV slot indices."""

    @_outside_inference_mode
    def __init__(self, size: int, max_context_len: int, device: DeviceLike):
        _check_positive(size=size, max_context_len=max_context_len)
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        # req_to_token: [size, max_context_len] int32
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=self.device)
        self._free_rows: list[int] = []
        self._is_free = [True] * size
        self.clear()

    def alloc(self) -> Optional[int]:
        if not self._free_rows:
            return None
        idx = self._free_rows.pop()
        self._is_free[idx] = False
        return idx

    def free(self, idx: int) -> None:
        if not 0 <= idx < self.size:
            raise ValueError(f"request slot {idx} is out of range [0, {self.size})")
        if self._is_free[idx]:
            raise ValueError(f"request slot {idx} is already free")
        self._is_free[idx] = True
        self._free_rows.append(idx)

    def available_size(self) -> int:
        return len(self._free_rows)

    def clear(self) -> None:
        # Reversed so that alloc() hands out rows 0, 1, 2, ... first.
        self._free_rows = list(range(self.size - 1, -1, -1))
        self._is_free = [True] * self.size


class KVPool(ABC):
    """Token-slot addressed KV storage for all layers, and the only writer of it: `set_kv` and
    `rotate_and_set_kv` are the code paths that write the buffers; readers get them from get_key_buffer /
    get_value_buffer and must not write through them.

    fp8 caches: e5m2 holds values as they are; e4m3 holds value / scale with a (k_scale, v_scale) per layer
    (default 1.0, see set_kv_scales), quantized inside set_kv; readers multiply by kv_scales(layer_id).

    The free list is an int64 ring buffer on the pool's device: alloc copies n entries off its front,
    free writes the freed ones after its back. Both cost O(n) and no host synchronization.
    """

    @_outside_inference_mode
    def __init__(self, size: int, dtype: torch.dtype, layer_num: int, device: DeviceLike,
                 kv_cache_dtype: Union[str, torch.dtype, None] = None,
                 k_scale: ScaleLike = 1.0, v_scale: ScaleLike = 1.0):
        _check_positive(size=size, layer_num=layer_num)
        if dtype not in dtypes.COMPUTE_DTYPES:
            raise ValueError(f"dtype must be one of {dtypes.COMPUTE_DTYPES}, got {dtype}")
        self.size = size
        self.dtype = dtype  # what attention computes in; the cache itself holds cache_dtype
        self.layer_num = layer_num
        self.device = torch.device(device)
        self.cache_dtype = dtypes.kv_cache_dtype(kv_cache_dtype, dtype)
        self.is_fp8 = self.cache_dtype in dtypes.FP8_DTYPES
        # index_put on fp8 tensors is not implemented on every device: keep fp8 bytes as uint8.
        self.store_dtype = torch.uint8 if self.is_fp8 else self.cache_dtype
        self._k_scales = [1.0] * layer_num
        self._v_scales = [1.0] * layer_num
        self._uncalibrated_layers: set[int] = set()  # calibrate_kv_scales_on_next_store
        for layer_id, (ks, vs) in enumerate(zip(_per_layer("k_scale", k_scale, layer_num),
                                                _per_layer("v_scale", v_scale, layer_num))):
            self.set_kv_scales(layer_id, ks, vs)
        # Free slots live in a ring: _ring[_head : _head + _num_free] (mod size), set up by clear().
        self._ring: torch.Tensor
        self._head = 0
        self._num_free = 0
        self.clear()

    # ---- slot allocation ----
    def alloc(self, n: int) -> Optional[torch.Tensor]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > self._num_free:
            return None
        start, end = self._head, self._head + n
        if end <= self.size:
            # A copy: this part of the ring is overwritten by later frees.
            out = self._ring[start:end].clone()
        else:
            out = torch.cat((self._ring[start:], self._ring[: end - self.size]))
        self._head = end % self.size
        self._num_free -= n
        return out

    def free(self, indices: torch.Tensor) -> None:
        if not isinstance(indices, torch.Tensor):
            indices = torch.as_tensor(indices, dtype=torch.int64)
        k = indices.numel()
        if k == 0:
            return
        if self._num_free + k > self.size:
            raise RuntimeError(f"freeing {k} KV slots with {self._num_free} of {self.size} already free (double free?)")
        indices = indices.reshape(-1).to(device=self.device, dtype=torch.int64)
        tail = (self._head + self._num_free) % self.size
        first = min(k, self.size - tail)
        self._ring[tail: tail + first] = indices[:first]
        if first < k:
            self._ring[: k - first] = indices[first:]
        self._num_free += k

    def available_size(self) -> int:
        return self._num_free

    @property
    def free_slots(self) -> torch.Tensor:
        """A copy of the free slot indices, next to be handed out first (for checks and debugging)."""
        end = self._head + self._num_free
        if end <= self.size:
            return self._ring[self._head:end].clone()
        return torch.cat((self._ring[self._head:], self._ring[: end - self.size]))

    @_outside_inference_mode
    def clear(self) -> None:
        self._ring = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)
        self._head = 0
        self._num_free = self.size

    # ---- fp8 scales ----
    def kv_scales(self, layer_id: int) -> tuple[float, float]:
        """(k_scale, v_scale) of a layer: what its buffers hold times these is the stored value."""
        return self._k_scales[layer_id], self._v_scales[layer_id]

    def set_kv_scales(self, layer_id: int, k_scale: float, v_scale: float) -> None:
        """Scales for an fp8 e4m3 cache (other caches keep 1.0). Set them before any KV of the layer is stored
        and before CUDA graphs are captured: the attention kernels take them as launch arguments."""
        if not 0 <= layer_id < self.layer_num:
            raise ValueError(f"layer {layer_id} is out of range [0, {self.layer_num})")
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
                raise ValueError(f"{name} must be a positive finite number, got {scale!r}")
            if scale != 1.0 and self.cache_dtype != torch.float8_e4m3fn:
                raise ValueError(f"KV scales apply to an fp8_e4m3 cache only; this pool stores {self.cache_dtype} "
                                 f"(got {name}={scale} for layer {layer_id})")
        self._k_scales[layer_id] = float(k_scale)
        self._v_scales[layer_id] = float(v_scale)

    def calibrate_kv_scales_on_next_store(self) -> None:
        """--calculate-kv-scales: at each layer's next store, its (k_scale, v_scale) become the largest |k| and |v|
        stored then over KV_SCALE_CALIBRATION_TARGET (replacing the checkpoint's or 1.0). An fp8_e4m3 cache only;
        CUDA graphs must be captured after (the kernels take the scales as launch arguments)."""
        if self.cache_dtype != torch.float8_e4m3fn:
            raise ValueError(f"calculate_kv_scales needs an fp8_e4m3 KV cache; this pool stores {self.cache_dtype}")
        self._uncalibrated_layers = set(range(self.layer_num))

    @property
    def calibrating_kv_scales(self) -> bool:
        """Whether some layer still waits for its first store to set its scales."""
        return bool(self._uncalibrated_layers)

    def _calibrate(self, layer_id: int, k: torch.Tensor, v: Optional[torch.Tensor], one_scale: bool = False) -> None:
        """The scales of a layer that waits for calibration, from the K and V it is about to store (one device sync
        per layer, once). one_scale: a single scale for both (an MLA latent, whose value is a view of its key)."""
        if layer_id not in self._uncalibrated_layers or k.numel() == 0:
            return
        k_max = k.detach().abs().amax().float().item()
        v_max = v.detach().abs().amax().float().item() if v is not None and v.numel() else k_max
        if one_scale:
            k_max = v_max = max(k_max, v_max)
        scales = [m / KV_SCALE_CALIBRATION_TARGET if math.isfinite(m) and m > 0 else 1.0 for m in (k_max, v_max)]
        if not all(math.isfinite(m) for m in (k_max, v_max)):
            logger.warning("layer %d's first KV holds non-finite values: its KV scales stay 1.0", layer_id)
        self.set_kv_scales(layer_id, *scales)
        self._uncalibrated_layers.discard(layer_id)
        if not self._uncalibrated_layers:
            logger.info("KV scales calibrated from the first batch (--calculate-kv-scales): k_scale %.3g..%.3g, "
                        "v_scale %.3g..%.3g over %d layers", min(self._k_scales), max(self._k_scales),
                        min(self._v_scales), max(self._v_scales), self.layer_num)

    def _quantized(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """x in the dtype the buffers store: cast, or for fp8 scaled (e4m3), saturated and viewed as bytes."""
        if not self.is_fp8:
            return x.to(self.store_dtype)
        if self.cache_dtype == torch.float8_e4m3fn:
            x = x.float()
            if scale != 1.0:
                x = x / scale
            # e4m3fn has no infinity: out-of-range values would become NaN on some devices
            x = x.clamp(-_E4M3_MAX, _E4M3_MAX)
        return x.to(self.cache_dtype).view(torch.uint8)

    # ---- storage ----
    @abstractmethod
    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """[size + 1, heads, dim] in cache_dtype (usually == dtype); read-only for everyone but the pool.

        For an fp8 cache, the fp8 view: upcast it and multiply by kv_scales(layer_id)[0]."""

    @abstractmethod
    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """[size + 1, heads, v_dim] in cache_dtype (usually == dtype); read-only for everyone but the pool.

        For an fp8 cache, the fp8 view: upcast it and multiply by kv_scales(layer_id)[1]."""

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    @abstractmethod
    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: Optional[torch.Tensor]) -> None:
        """Write the KV of len(loc) tokens at slots `loc` (cast, or quantized for an fp8 cache)."""

    def rotate_and_set_kv(self, layer_id: int, loc: torch.Tensor, positions: torch.Tensor, q: torch.Tensor,
                          k: torch.Tensor, v: torch.Tensor, rotary) -> torch.Tensor:
        """positions: [T]; q: [T, H*D], k: [T, Hkv*D], v: [T, Hkv*Dv], q and k not rotated yet -> q rotated.

        Applies `rotary` (a RotaryEmbedding) to q and k and stores the rotated k and v at slots `loc`. Afterwards
        k may or may not hold its rotation (it may be rotated in place): read the keys from the pool."""
        q, k = rotary(positions, q, k)
        self.set_kv(layer_id, loc, k, v)
        return q

    def rotary_store_target(self, layer_id: int, loc: torch.Tensor):
        """Where a kernel that rotates a decode step's keys itself (the batch-1 qkv GEMV's epilogue) may write them:
        (K cache [S, Hkv, D], V cache [S, Hkv, Dv], slots [T] there), or None when rotate_and_set_kv must do it."""
        return None

    @abstractmethod
    def mem_usage_bytes(self) -> int:
        """Bytes held by the KV buffers."""


def _per_layer(name: str, value: ScaleLike, layer_num: int) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * layer_num
    values = list(value)
    if len(values) != layer_num:
        raise ValueError(f"{name} needs one value per layer ({layer_num}), got {len(values)}")
    return values


def _token_rows(x: torch.Tensor, name: str, tokens: int, heads: int, dim: int) -> torch.Tensor:
    """[T, heads * dim] or [T, heads, dim] -> a [T, heads, dim] view (a copy only when no view exists)."""
    if x.numel() != tokens * heads * dim or x.shape[0] != tokens:
        raise ValueError(f"{name} must be [{tokens}, {heads} * {dim}] or [{tokens}, {heads}, {dim}] for "
                         f"{tokens} slots, got {tuple(x.shape)}")
    return x.reshape(tokens, heads, dim)


def _check_loc(loc: torch.Tensor) -> int:
    if loc.dim() != 1:
        raise ValueError(f"loc must be a 1-D tensor of slot indices, got shape {tuple(loc.shape)}")
    return loc.shape[0]


def _triton_kernels_run_on(device: torch.device) -> bool:
    # compiled Triton kernels need CUDA (tests run them on CPU under the interpreter by patching this)
    return device.type == "cuda"


def _view_as_cache(buffers: list[torch.Tensor], pool: KVPool) -> list[torch.Tensor]:
    return [b.view(pool.cache_dtype) for b in buffers] if pool.is_fp8 else buffers


class MHAKVPool(KVPool):
    """Separate K and V per layer: [size + 1, head_num, head_dim] and [size + 1, head_num, v_head_dim].

    The store has one route on CUDA and one fallback. On CUDA one Triton launch writes a layer's K and V
    (quantizing into an fp8 cache); with a cache in the model dtype rotate_and_set_kv rotates q and stores the
    rotated k and v in one launch, and the batch-1 qkv GEMV does that in its epilogue (rotary_store_target). The
    fallback, where a kernel does not apply (CPU; an fp8 cache's rotary), is rotary, then indexed copies.
    """

    @_outside_inference_mode
    def __init__(self, size: int, dtype: torch.dtype, head_num: int, head_dim: int, layer_num: int,
                 device: DeviceLike, v_head_dim: Optional[int] = None,
                 kv_cache_dtype: Union[str, torch.dtype, None] = None,
                 k_scale: ScaleLike = 1.0, v_scale: ScaleLike = 1.0):
        super().__init__(size, dtype, layer_num, device, kv_cache_dtype, k_scale, v_scale)
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        _check_positive(head_num=head_num, head_dim=head_dim, v_head_dim=v_head_dim)
        self.head_num = head_num
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim
        # Triton kernels need CUDA; the store kernel quantizes into an fp8 cache like _quantized, the rotary + store
        # kernel copies rows as they are (an fp8 cache rotates, then stores in that kernel)
        kernels_usable = _triton_kernels_run_on(self.device)
        self._store_in_one_launch = kernels_usable
        self._rotate_and_store_in_one_launch = kernels_usable and not self.is_fp8
        self._k_buffers = [torch.zeros((size + 1, head_num, head_dim), dtype=self.store_dtype, device=self.device)
                           for _ in range(layer_num)]
        self._v_buffers = [torch.zeros((size + 1, head_num, v_head_dim), dtype=self.store_dtype, device=self.device)
                           for _ in range(layer_num)]
        self._k_views = _view_as_cache(self._k_buffers, self)
        self._v_views = _view_as_cache(self._v_buffers, self)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self._k_views[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self._v_views[layer_id]

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: Optional[torch.Tensor]) -> None:
        """k: [T, head_num * head_dim] or [T, head_num, head_dim] (rows may be strided); v likewise with v_head_dim."""
        if v is None:
            raise ValueError("MHAKVPool.set_kv needs v")
        tokens = _check_loc(loc)
        if self._uncalibrated_layers:
            self._calibrate(layer_id, k, v)
        if self._store_in_one_launch:
            from braid.runtime.layers import kv_store_kernels

            if kv_store_kernels.store_kv(self._k_views[layer_id], self._v_views[layer_id], loc, k, v,
                                         *self.kv_scales(layer_id)):
                return
        k = _token_rows(k, "k", tokens, self.head_num, self.head_dim)
        v = _token_rows(v, "v", tokens, self.head_num, self.v_head_dim)
        k_scale, v_scale = self.kv_scales(layer_id)
        self._k_buffers[layer_id][loc] = self._quantized(k, k_scale)
        self._v_buffers[layer_id][loc] = self._quantized(v, v_scale)

    def rotate_and_set_kv(self, layer_id: int, loc: torch.Tensor, positions: torch.Tensor, q: torch.Tensor,
                          k: torch.Tensor, v: torch.Tensor, rotary) -> torch.Tensor:
        if (self._rotate_and_store_in_one_launch and rotary.cos_sin_cache is not None
                and rotary.head_dim == self.head_dim):
            from braid.runtime.layers import rotary_kernels

            # q is rotated in place; k stays as it was, its rotation goes to the cache
            if rotary_kernels.apply_rotary_and_store_kv(
                    positions, q, k, v, rotary.cos_sin_cache, rotary.head_dim, rotary.rotary_dim,
                    rotary.is_neox_style, self._k_buffers[layer_id], self._v_buffers[layer_id], loc):
                return q
        return super().rotate_and_set_kv(layer_id, loc, positions, q, k, v, rotary)

    def rotary_store_target(self, layer_id: int, loc: torch.Tensor):
        # (no fp8 cache gets here, so neither does one still calibrating its scales)
        if self._rotate_and_store_in_one_launch:
            return self._k_buffers[layer_id], self._v_buffers[layer_id], loc
        return None

    def mem_usage_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._k_buffers + self._v_buffers)


class MLAKVPool(KVPool):
    """One compressed latent per token and layer: [size + 1, 1, kv_lora_rank + qk_rope_head_dim], the latent
    (kv_lora_rank channels) then the rotated rope part of the key.

    The key is the whole row, the value its first kv_lora_rank channels (a view, no copy); so an fp8 e4m3 cache
    has one scale per layer (kv_scale), used for both.

    On CUDA with a cache in the model dtype, store_latent_and_build_query (absorbed MLA decode) is one Triton
    launch; elsewhere the norm, rotary, set_kv and concatenations run one by one, with the same results.
    """

    @_outside_inference_mode
    def __init__(self, size: int, dtype: torch.dtype, kv_lora_rank: int, qk_rope_head_dim: int, layer_num: int,
                 device: DeviceLike, kv_cache_dtype: Union[str, torch.dtype, None] = None,
                 kv_scale: ScaleLike = 1.0):
        _check_positive(kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim)
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        super().__init__(size, dtype, layer_num, device, kv_cache_dtype, kv_scale, kv_scale)
        self._decode_store_in_one_launch = not self.is_fp8 and _triton_kernels_run_on(self.device)
        self.head_num = 1
        self.head_dim = kv_lora_rank + qk_rope_head_dim
        self.v_head_dim = kv_lora_rank
        self._kv_buffers = [torch.zeros((size + 1, 1, self.head_dim), dtype=self.store_dtype, device=self.device)
                            for _ in range(layer_num)]
        self._kv_views = _view_as_cache(self._kv_buffers, self)

    def set_kv_scales(self, layer_id: int, k_scale: float, v_scale: float) -> None:
        if k_scale != v_scale:
            raise ValueError(f"an MLA cache's value is a view of its key: one scale per layer, got k_scale={k_scale}, "
                             f"v_scale={v_scale}")
        super().set_kv_scales(layer_id, k_scale, v_scale)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self._kv_views[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self._kv_views[layer_id][..., : self.kv_lora_rank]

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: Optional[torch.Tensor] = None) -> None:
        """k: the key rows [T, (1,) kv_lora_rank + qk_rope_head_dim], or only their rope part
        [T, (1,) qk_rope_head_dim]; v: the latent [T, (1,) kv_lora_rank] (the value), or None when k is whole.

        The row written is v's latent (k's own latent channels when v is None) then k's rope part."""
        tokens = _check_loc(loc)
        if self._uncalibrated_layers:
            self._calibrate(layer_id, k, v, one_scale=True)
        buffer = self._kv_buffers[layer_id]
        scale = self.kv_scales(layer_id)[0]
        if v is None:
            buffer[loc] = self._quantized(_token_rows(k, "k", tokens, 1, self.head_dim), scale)
            return
        latent = _token_rows(v, "v", tokens, 1, self.kv_lora_rank)
        width = k.numel() // max(tokens, 1)
        if width not in (self.head_dim, self.qk_rope_head_dim):
            raise ValueError(f"k must be the key rows [{tokens}, {self.head_dim}] or their rope part "
                             f"[{tokens}, {self.qk_rope_head_dim}], got {tuple(k.shape)}")
        rope = _token_rows(k, "k", tokens, 1, width)[..., width - self.qk_rope_head_dim:]
        buffer[loc, :, : self.kv_lora_rank] = self._quantized(latent, scale)
        buffer[loc, :, self.kv_lora_rank:] = self._quantized(rope, scale)

    def store_latent_and_build_query(self, layer_id: int, loc: torch.Tensor, positions: torch.Tensor,
                                     latent: torch.Tensor, k_pe: torch.Tensor, latent_norm, rotary,
                                     q_nope: torch.Tensor, w_kc: torch.Tensor, q_pe: torch.Tensor,
                                     w_kc_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Absorbed MLA decode. latent: [T, R] before latent_norm (an RMSNorm); k_pe: [T, P] and q_pe: [T, H, P]
        before `rotary` (a RotaryEmbedding over P dims); q_nope: [T, H, nope]; w_kc: [H, nope, R] (e4m3 with
        w_kc_scale [H, nope] fp32 for an FP8 checkpoint).

        Stores each token's row [latent_norm(latent) ; rotary(k_pe)] at slots `loc` and returns the query rows
        [T, H, R + P] = [q_nope @ w_kc ; rotary(q_pe)] per head."""
        if (self._decode_store_in_one_launch and rotary.cos_sin_cache is not None
                and not latent_norm.add_unit_offset and latent.dtype == self.store_dtype):
            from braid.runtime.layers import mla_kernels

            return mla_kernels.mla_decode_prepare(
                positions, loc, rotary.cos_sin_cache, rotary.is_neox_style, latent, k_pe, latent_norm.weight,
                latent_norm.eps, q_nope, w_kc, q_pe, self._kv_buffers[layer_id], w_kc_scale)
        from braid.runtime.layers.mla_kernels import dequantized_head_weight

        tokens, heads = q_pe.shape[0], q_pe.shape[1]
        w_kc = dequantized_head_weight(w_kc, w_kc_scale, q_nope.dtype)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_kc)  # [H, T, R]
        latent = latent_norm(latent)
        q_pe, k_pe = rotary(positions, q_pe, k_pe)
        self.set_kv(layer_id, loc, k_pe, latent)
        return torch.cat([q_latent.transpose(0, 1), q_pe.view(tokens, heads, -1)], dim=-1)

    def mem_usage_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._kv_buffers)
