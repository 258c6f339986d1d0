"""HybridKVPool: full KV for global-attention layers, trimmed KV for sliding-window layers (Gemma-2 and the like).

A model whose layers mix global attention and a sliding window W (a query at position p sees keys (p - W, p])
needs the window layers' KV of a token only while some query can still see it. The hybrid pool keeps two slot
spaces:

* full slots, 1..size: the token slot space the rest of the runtime knows (req_to_token rows, radix tree values,
  out_cache_loc). The global layers' buffers are indexed by them, as in MHAKVPool.
* window slots, 1..window_size: the window layers' buffers are indexed by these. `full_to_window[s]` ([size + 1]
  int32 on the pool's device) maps a full slot to its window slot, -1 once the window KV of that token was
  released; full slot 0 (the dummy slot padded batches write to) maps to window slot 0.

Every full slot allocated gets a window slot at once, so a forward pass writes and reads both as before. Readers
of window layers translate full slots with a gather on the device (`window_slots`, `window_rows`); a released
slot reads window slot 0, which attention never weighs: all backends skip or mask keys outside the window.

Releasing: after each forward pass the prefix cache (mem_cache/base.py `trim_window_kv`) releases the window slots
of each request's tokens at positions below kv_committed_len - (W - 1) - margin that only this request uses
(its own slots, and radix-tree nodes it alone has locked), in steps of RELEASE_STEP positions while it runs. Tokens shared with other running requests keep their
window KV until the last of them trims it. A finished request keeps the window KV of its last W - 1 tokens in the
cache. So a request of L tokens holds full KV for L tokens and window KV for at most W - 1 (+ one step's tokens)
(+ RELEASE_STEP) once it runs alone on its prefix. The radix cache's reuse rule for a prefix whose window KV was released is in
radix_cache.py.

Counts stay exact on the host without device syncs: which tokens hold window KV is a function of positions the
host tracks (per request `Req.window_kv_from`, per tree node `TreeNode.window_from`). Only `free()` of slots whose
window state the caller does not know (the chunk cache, truncation, resets) counts them on the device (one sync).
"""

from __future__ import annotations

import weakref
from typing import Optional, Sequence, Union

import torch

from braid.runtime.constrained.jump_forward import MAX_WINDOW as JUMP_FORWARD_MAX_ROLLBACK
from braid.runtime.mem_cache.pools import DeviceLike, KVPool, MHAKVPool, ScaleLike, _outside_inference_mode

__all__ = ["HybridKVPool", "window_layer_split", "JUMP_FORWARD_MARGIN", "RELEASE_STEP"]

# extra positions kept for requests whose grammar may roll tokens back: jump-forward re-encodes at most this many
# emitted tokens with the forced text
JUMP_FORWARD_MARGIN = JUMP_FORWARD_MAX_ROLLBACK
# a running request releases window KV once this many positions have left its window (one batched release per
# 16 decode steps instead of one per step); finishing releases down to the window exactly
RELEASE_STEP = 16


def window_layer_split(layer_windows: Sequence[Optional[int]]) -> Optional[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(full layer ids, window layer ids) when the layers mix global attention and sliding windows, else None."""
    window = tuple(i for i, w in enumerate(layer_windows) if w is not None and w > 0)
    full = tuple(i for i in range(len(layer_windows)) if i not in window)
    if not window or not full:
        return None
    return full, window


class HybridKVPool(KVPool):
    """KVPool over two slot spaces (see the module docstring). alloc/free/available_size are the full space's;
    window_available_size, release_window and transfer_window manage the window space."""

    @_outside_inference_mode
    def __init__(self, size: int, window_size: int, dtype: torch.dtype, head_num: int, head_dim: int,
                 layer_windows: Sequence[Optional[int]], device: DeviceLike, v_head_dim: Optional[int] = None,
                 kv_cache_dtype: Union[str, torch.dtype, None] = None, k_scale: ScaleLike = 1.0,
                 v_scale: ScaleLike = 1.0):
        split = window_layer_split(layer_windows)
        if split is None:
            raise ValueError("HybridKVPool needs both sliding-window and global-attention layers; got windows "
                             f"{list(layer_windows)}")
        if not isinstance(window_size, int) or window_size < 1:
            raise ValueError(f"window_size must be a positive integer, got {window_size!r}")
        self.full_layers, self.window_layers = split
        self.window = max(int(layer_windows[i]) for i in self.window_layers)
        self.window_size = window_size
        self._where = {}  # layer id -> (sub-pool, its layer index there)
        common = dict(v_head_dim=v_head_dim, kv_cache_dtype=kv_cache_dtype)
        self.full_pool = MHAKVPool(size, dtype, head_num, head_dim, len(self.full_layers), device, **common)
        self.window_pool = MHAKVPool(window_size, dtype, head_num, head_dim, len(self.window_layers), device, **common)
        for local, layer_id in enumerate(self.full_layers):
            self._where[layer_id] = (self.full_pool, local)
        for local, layer_id in enumerate(self.window_layers):
            self._where[layer_id] = (self.window_pool, local)
        self.head_num, self.head_dim, self.v_head_dim = head_num, head_dim, self.full_pool.v_head_dim
        # full slot -> window slot: [size + 1] int32, -1 = released (set up by clear())
        self.full_to_window: Optional[torch.Tensor] = None
        self._batch_window_loc = None  # (weakref to loc, versions, its window slots): see translate_batch_slots
        super().__init__(size, dtype, len(layer_windows), device, kv_cache_dtype, k_scale, v_scale)

    # ---- layers ----
    def is_window_layer(self, layer_id: int) -> bool:
        return self._where[layer_id][0] is self.window_pool

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """Window layers: [window_size + 1, heads, dim], indexed by window slots (translate with window_slots)."""
        pool, local = self._where[layer_id]
        return pool.get_key_buffer(local)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        pool, local = self._where[layer_id]
        return pool.get_value_buffer(local)

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: Optional[torch.Tensor]) -> None:
        """loc: full slots (translated here for window layers)."""
        if self._uncalibrated_layers:
            self._calibrate(layer_id, k, v)
        pool, local = self._where[layer_id]
        pool.set_kv(local, self._translated(pool, loc), k, v)

    def rotate_and_set_kv(self, layer_id: int, loc: torch.Tensor, positions: torch.Tensor, q: torch.Tensor,
                          k: torch.Tensor, v: torch.Tensor, rotary) -> torch.Tensor:
        if self._uncalibrated_layers:  # rotary, then set_kv above, which calibrates from the rotated keys
            return KVPool.rotate_and_set_kv(self, layer_id, loc, positions, q, k, v, rotary)
        pool, local = self._where[layer_id]
        return pool.rotate_and_set_kv(local, self._translated(pool, loc), positions, q, k, v, rotary)

    def rotary_store_target(self, layer_id: int, loc: torch.Tensor):
        pool, local = self._where[layer_id]
        return pool.rotary_store_target(local, self._translated(pool, loc))

    def _translated(self, pool: KVPool, loc: torch.Tensor) -> torch.Tensor:
        if pool is self.full_pool:
            return loc
        memo = self._batch_window_loc
        if memo is not None and memo[0]() is loc and memo[1] == self._versions(loc):
            return memo[2]
        # tokens written in a pass were just allocated: they all hold a window slot
        return self.full_to_window.index_select(0, loc.reshape(-1).long()).long()

    def _versions(self, loc: torch.Tensor) -> tuple:
        try:
            return loc._version, self.full_to_window._version
        except RuntimeError:  # an inference-mode tensor keeps no version counter
            return None, self.full_to_window._version

    def translate_batch_slots(self, loc: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Window slots [T] int64 of a pass's new tokens (its out_cache_loc), translated once per pass by the
        attention backend: the window layers' set_kv / rotate_and_set_kv then reuse them while they are given this
        same `loc` tensor, unchanged, instead of one gather per layer. out: a static [>= T] int64 buffer (CUDA
        graphs: refilled before each replay; the captured layers read it)."""
        window = self.full_to_window.index_select(0, loc.reshape(-1).long())
        if out is None:
            window = window.long()
        else:
            out[:window.shape[0]].copy_(window)
            window = out[:window.shape[0]]
        self._batch_window_loc = (weakref.ref(loc), self._versions(loc), window)
        return window

    def set_kv_scales(self, layer_id: int, k_scale: float, v_scale: float) -> None:
        super().set_kv_scales(layer_id, k_scale, v_scale)
        pool, local = self._where[layer_id]
        pool.set_kv_scales(local, k_scale, v_scale)

    def mem_usage_bytes(self) -> int:
        return self.full_pool.mem_usage_bytes() + self.window_pool.mem_usage_bytes()

    # ---- translation for readers ----
    def window_slots(self, full_slots: torch.Tensor) -> torch.Tensor:
        """Window slots of full slots (any shape, same dtype); released ones read the dummy slot 0."""
        flat = self.full_to_window.index_select(0, full_slots.reshape(-1).long()).clamp_min_(0)
        return flat.view(full_slots.shape).to(full_slots.dtype)

    def window_rows(self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, width: int,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[B, width] int32: the requests' req_to_token rows translated to window slots (a gather on the device).
        Kernels index it with rows 0..B-1 instead of req_pool_indices. `out`: a [>= B, >= width] buffer to fill
        (CUDA graphs), whose [:B, :width] is returned."""
        rows = req_to_token.index_select(0, req_pool_indices.long())[:, :width]
        translated = self.full_to_window.index_select(0, rows.reshape(-1).long()).clamp_min_(0).view(rows.shape)
        if out is None:
            return translated
        out[:rows.shape[0], :width].copy_(translated)
        return out[:rows.shape[0], :width]

    # ---- slots ----
    def alloc(self, n: int) -> Optional[torch.Tensor]:
        """n full slots, each with a fresh window slot; None when either space has fewer than n free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > self.window_pool.available_size() or n > self.available_size():
            return None
        full = super().alloc(n)
        window = self.window_pool.alloc(n)
        if n:
            self.full_to_window[full] = window.to(torch.int32)
        return full

    def free(self, indices: torch.Tensor, window_released: bool = False) -> None:
        """Free full slots and the window slots those still hold. window_released: the caller released them all
        already (no device sync); otherwise they are found on the device (one sync on CUDA)."""
        if not isinstance(indices, torch.Tensor):
            indices = torch.as_tensor(indices, dtype=torch.int64)
        indices = indices.reshape(-1).to(device=self.device, dtype=torch.int64)
        if indices.numel() == 0:
            return
        if not window_released:
            window = self.full_to_window.index_select(0, indices)
            self.window_pool.free(window[window >= 0])
            self.full_to_window[indices] = -1
        super().free(indices)

    def release_window(self, full_slots: torch.Tensor) -> None:
        """Give back the window slots of these full slots, every one of which holds one (no device sync)."""
        full_slots = full_slots.reshape(-1).to(device=self.device, dtype=torch.int64)
        if full_slots.numel() == 0:
            return
        self.window_pool.free(self.full_to_window.index_select(0, full_slots))
        self.full_to_window[full_slots] = -1

    def transfer_window(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move the window slots of full slots `src` (all holding one) to full slots `dst` (holding none): the
        same tokens' KV, kept under the slots that stay."""
        src = src.reshape(-1).to(device=self.device, dtype=torch.int64)
        dst = dst.reshape(-1).to(device=self.device, dtype=torch.int64)
        if src.numel() != dst.numel():
            raise ValueError(f"transfer_window: {src.numel()} sources, {dst.numel()} destinations")
        if src.numel():
            self.full_to_window[dst] = self.full_to_window.index_select(0, src)
            self.full_to_window[src] = -1

    def window_available_size(self) -> int:
        return self.window_pool.available_size()

    def window_keep(self, req) -> int:
        """Positions before a request's next query whose window KV it still needs."""
        return self.window - 1 + (JUMP_FORWARD_MARGIN if getattr(req, "grammar", None) is not None else 0)

    @_outside_inference_mode
    def clear(self) -> None:
        super().clear()
        self.window_pool.clear()
        if getattr(self, "full_to_window", None) is None:
            self.full_to_window = torch.empty((self.size + 1,), dtype=torch.int32, device=self.device)
        # in place: CUDA graphs captured the map's address
        self.full_to_window.fill_(-1)
        self.full_to_window[0] = 0
