"""Memory pools: request slots -> token slots (ReqToTokenPool) and token slots -> KV storage (KVPool).

Page size 1: one KV slot holds one token of one request. Slot 0 of every KV buffer is never handed out;
padded batches (CUDA graphs) write their dummy tokens there.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from typing import Optional, Union

import torch

__all__ = [
    "ReqToTokenPool",
    "KVPool",
    "MHAKVPool",
    "MLAKVPool",
    "resolve_kv_cache_dtype",
    "mha_kv_bytes_per_token",
    "mla_kv_bytes_per_token",
    "kv_cache_bytes_per_token",
    "max_tokens_for_budget",
]

DeviceLike = Union[str, torch.device]

_FP8_DTYPES = (torch.float8_e5m2, torch.float8_e4m3fn)
_KV_CACHE_DTYPE_NAMES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e5m2": torch.float8_e5m2,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e4m3fn": torch.float8_e4m3fn,
}
_COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def resolve_kv_cache_dtype(kv_cache_dtype: Union[str, torch.dtype, None], dtype: torch.dtype) -> torch.dtype:
    """The dtype KV values are kept in: `dtype` for None/"auto", else the named (possibly fp8) dtype."""
    if kv_cache_dtype is None or kv_cache_dtype == "auto":
        return dtype
    if isinstance(kv_cache_dtype, torch.dtype):
        resolved = kv_cache_dtype
    elif isinstance(kv_cache_dtype, str) and kv_cache_dtype in _KV_CACHE_DTYPE_NAMES:
        resolved = _KV_CACHE_DTYPE_NAMES[kv_cache_dtype]
    else:
        raise ValueError(
            f"unsupported kv_cache_dtype {kv_cache_dtype!r}; expected 'auto' or one of {sorted(_KV_CACHE_DTYPE_NAMES)}"
        )
    if resolved not in _COMPUTE_DTYPES and resolved not in _FP8_DTYPES:
        raise ValueError(f"unsupported kv_cache_dtype {resolved}")
    return resolved


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
    """Token-slot addressed KV storage for all layers.

    The free list is an int64 ring buffer on the pool's device: alloc copies n entries off its front,
    free writes the freed ones after its back. Both cost O(n) and no host synchronization.
    """

    @_outside_inference_mode
    def __init__(self, size: int, dtype: torch.dtype, layer_num: int, device: DeviceLike,
                 kv_cache_dtype: Union[str, torch.dtype, None] = None,
                 k_scale: float = 1.0, v_scale: float = 1.0):
        _check_positive(size=size, layer_num=layer_num)
        if dtype not in _COMPUTE_DTYPES:
            raise ValueError(f"dtype must be one of {_COMPUTE_DTYPES}, got {dtype}")
        self.size = size
        self.dtype = dtype  # what attention computes in; the cache itself holds cache_dtype
        self.layer_num = layer_num
        self.device = torch.device(device)
        self.cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype)
        self.is_fp8 = self.cache_dtype in _FP8_DTYPES
        # index_put on fp8 tensors is not implemented on every device: keep fp8 bytes as uint8.
        self.store_dtype = torch.uint8 if self.is_fp8 else self.cache_dtype
        self.k_scale = float(k_scale)
        self.v_scale = float(v_scale)
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

    # ---- storage ----
    def _to_store(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        if self.is_fp8:
            if scale != 1.0:
                x = x / scale
            return x.to(self.cache_dtype).view(torch.uint8)
        return x.to(self.store_dtype)

    @abstractmethod
    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """[size + 1, heads, dim] in cache_dtype (usually == dtype).

        For an fp8 cache, the fp8 view: upcast it and multiply by k_scale."""

    @abstractmethod
    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """[size + 1, heads, v_dim] in cache_dtype (usually == dtype).

        For an fp8 cache, the fp8 view: upcast it and multiply by v_scale."""

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    @abstractmethod
    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor,
                      cache_v: Optional[torch.Tensor]) -> None:
        """Write the KV of len(loc) tokens at slots `loc`."""

    @abstractmethod
    def mem_usage_bytes(self) -> int:
        """Bytes held by the KV buffers."""

    def direct_write_buffers(self, layer_id: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(k_buffer, v_buffer) of a layer when a fused kernel may write KV rows into them itself (a CUDA
        cache stored in the model dtype), else None: then writes must go through set_kv_buffer."""
        return None


# one Triton launch for a layer's K and V writes on CUDA (two indexed copies otherwise); a switch for A/B timing
FUSED_KV_STORE = True


def _view_as_cache(buffers: list[torch.Tensor], pool: KVPool) -> list[torch.Tensor]:
    return [b.view(pool.cache_dtype) for b in buffers] if pool.is_fp8 else buffers


class MHAKVPool(KVPool):
    """Separate K and V per layer.

    k_buffer[l]: [size + 1, head_num, head_dim], v_buffer[l]: [size + 1, head_num, v_head_dim]
    """

    @_outside_inference_mode
    def __init__(self, size: int, dtype: torch.dtype, head_num: int, head_dim: int, layer_num: int,
                 device: DeviceLike, v_head_dim: Optional[int] = None,
                 kv_cache_dtype: Union[str, torch.dtype, None] = None,
                 k_scale: float = 1.0, v_scale: float = 1.0):
        super().__init__(size, dtype, layer_num, device, kv_cache_dtype, k_scale, v_scale)
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        _check_positive(head_num=head_num, head_dim=head_dim, v_head_dim=v_head_dim)
        self.head_num = head_num
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim
        self.k_buffer = [torch.zeros((size + 1, head_num, head_dim), dtype=self.store_dtype, device=self.device)
                         for _ in range(layer_num)]
        self.v_buffer = [torch.zeros((size + 1, head_num, v_head_dim), dtype=self.store_dtype, device=self.device)
                         for _ in range(layer_num)]
        self._k_views = _view_as_cache(self.k_buffer, self)
        self._v_views = _view_as_cache(self.v_buffer, self)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self._k_views[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self._v_views[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor,
                      cache_v: Optional[torch.Tensor]) -> None:
        if cache_v is None:
            raise ValueError("MHAKVPool.set_kv_buffer needs cache_v")
        # cache_k: [T, head_num, head_dim] or [T, head_num * head_dim]; same for cache_v with v_head_dim
        if self.device.type == "cuda" and not self.is_fp8 and FUSED_KV_STORE:
            from braid.runtime.layers import triton_fused

            if triton_fused.store_kv(self.k_buffer[layer_id], self.v_buffer[layer_id], loc, cache_k, cache_v):
                return
        cache_k = cache_k.reshape(-1, self.head_num, self.head_dim)
        cache_v = cache_v.reshape(-1, self.head_num, self.v_head_dim)
        self.k_buffer[layer_id][loc] = self._to_store(cache_k, self.k_scale)
        self.v_buffer[layer_id][loc] = self._to_store(cache_v, self.v_scale)

    def mem_usage_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.k_buffer + self.v_buffer)

    def direct_write_buffers(self, layer_id: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        if self.device.type == "cuda" and not self.is_fp8 and FUSED_KV_STORE:
            return self.k_buffer[layer_id], self.v_buffer[layer_id]
        return None


class MLAKVPool(KVPool):
    """One compressed latent per token and layer: kv_buffer[l]: [size + 1, 1, kv_lora_rank + qk_rope_head_dim].

    The key is the whole latent, the value its first kv_lora_rank channels (a view, no copy).
    """

    @_outside_inference_mode
    def __init__(self, size: int, dtype: torch.dtype, kv_lora_rank: int, qk_rope_head_dim: int, layer_num: int,
                 device: DeviceLike, kv_cache_dtype: Union[str, torch.dtype, None] = None,
                 k_scale: float = 1.0, v_scale: float = 1.0):
        super().__init__(size, dtype, layer_num, device, kv_cache_dtype, k_scale, v_scale)
        _check_positive(kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim)
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.head_num = 1
        self.head_dim = kv_lora_rank + qk_rope_head_dim
        self.v_head_dim = kv_lora_rank
        self.kv_buffer = [torch.zeros((size + 1, 1, self.head_dim), dtype=self.store_dtype, device=self.device)
                          for _ in range(layer_num)]
        self._kv_views = _view_as_cache(self.kv_buffer, self)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self._kv_views[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self._kv_views[layer_id][..., : self.kv_lora_rank]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor,
                      cache_v: Optional[torch.Tensor] = None) -> None:
        # cache_k: [T, 1, kv_lora_rank + qk_rope_head_dim] (or [T, kv_lora_rank + qk_rope_head_dim]), the whole
        # latent; the value is part of it, so cache_v is ignored.
        cache_k = cache_k.reshape(-1, 1, self.head_dim)
        self.kv_buffer[layer_id][loc] = self._to_store(cache_k, self.k_scale)

    def mem_usage_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.kv_buffer)


# ---- sizing the pool from a memory budget ----
def _cache_itemsize(dtype: Union[str, torch.dtype]) -> int:
    # Strings name the KV cache dtype ("bfloat16", "fp8_e5m2", ...); "auto" has no size on its own.
    if isinstance(dtype, str):
        if dtype == "auto":
            raise ValueError("resolve 'auto' to the model dtype before sizing the KV cache")
        dtype = resolve_kv_cache_dtype(dtype, torch.float32)
    return dtype.itemsize


def mha_kv_bytes_per_token(head_num: int, head_dim: int, layer_num: int, dtype: Union[str, torch.dtype],
                           v_head_dim: Optional[int] = None) -> int:
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    return head_num * (head_dim + v_head_dim) * layer_num * _cache_itemsize(dtype)


def mla_kv_bytes_per_token(kv_lora_rank: int, qk_rope_head_dim: int, layer_num: int,
                           dtype: Union[str, torch.dtype]) -> int:
    return (kv_lora_rank + qk_rope_head_dim) * layer_num * _cache_itemsize(dtype)


def kv_cache_bytes_per_token(layer_num: int, dtype: Union[str, torch.dtype], *, head_num: Optional[int] = None,
                             head_dim: Optional[int] = None, v_head_dim: Optional[int] = None,
                             kv_lora_rank: Optional[int] = None, qk_rope_head_dim: Optional[int] = None) -> int:
    """Bytes of KV one token takes over all layers: MLA when kv_lora_rank is given, else MHA (per-rank heads)."""
    if kv_lora_rank is not None:
        if qk_rope_head_dim is None:
            raise ValueError("MLA sizing needs qk_rope_head_dim")
        return mla_kv_bytes_per_token(kv_lora_rank, qk_rope_head_dim, layer_num, dtype)
    if head_num is None or head_dim is None:
        raise ValueError("MHA sizing needs head_num and head_dim")
    return mha_kv_bytes_per_token(head_num, head_dim, layer_num, dtype, v_head_dim)


def max_tokens_for_budget(budget_bytes: int, bytes_per_token: int) -> int:
    """Usable pool size for a byte budget; the +1 dummy slot is paid for out of the budget too."""
    if bytes_per_token <= 0:
        raise ValueError("bytes_per_token must be positive")
    return max(int(budget_bytes // bytes_per_token) - 1, 0)
