"""The reference attention backend: plain PyTorch over the gathered paged KV. Runs on CPU and GPU."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from braid.runtime.layers.attention.base import AttentionBackend


def _scores_to_probs(scores: torch.Tensor, mask: torch.Tensor, logit_cap: float) -> torch.Tensor:
    if logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1)


class TorchAttnBackend(AttentionBackend):
    supports_tree_mask = True

    def __init__(self, model_runner=None):
        self.model_runner = model_runner

    def _save(self, layer, fb, k, v, save_kv_cache):
        if save_kv_cache:
            fb.kv_pool.set_kv(layer.layer_id, fb.out_cache_loc, k, v)

    def _kv(self, layer, fb, slots: torch.Tensor, dtype, translated: bool = False):
        # slots: [...] -> k, v: [..., Hkv, D]; index_select is several times faster than advanced indexing on CPU
        pool = fb.kv_pool
        if not translated and _is_window_layer(pool, layer):
            slots = pool.window_slots(slots)
        flat = slots.reshape(-1)
        k = pool.get_key_buffer(layer.layer_id).index_select(0, flat)
        v = pool.get_value_buffer(layer.layer_id).index_select(0, flat)
        return _dequantized(pool, layer.layer_id, k.view(*slots.shape, *k.shape[1:]),
                            v.view(*slots.shape, *v.shape[1:]), dtype)

    def _decode_kv(self, layer, fb, meta: "_DecodeMetadata", dtype):
        """(k, v [B, L, Hkv, D], mask [B, 1, 1, L]): a window layer's L <= W keys are each sequence's last ones
        (gathered); otherwise views of the pool when the batch is one sequence in consecutive slots, else a
        gather."""
        if 0 < layer.sliding_window < meta.max_len:
            slots, mask = meta.window(layer.sliding_window)
            return (*self._kv(layer, fb, slots, dtype), mask)
        pool = fb.kv_pool
        mask = meta.mask()
        if _is_window_layer(pool, layer):
            return (*self._kv(layer, fb, meta.window_slots(pool), dtype, translated=True), mask)
        if meta.first_slot is None:
            return (*self._kv(layer, fb, meta.slots, dtype), mask)
        k = pool.get_key_buffer(layer.layer_id).narrow(0, meta.first_slot, meta.max_len).unsqueeze(0)
        v = pool.get_value_buffer(layer.layer_id).narrow(0, meta.first_slot, meta.max_len).unsqueeze(0)
        return (*_dequantized(pool, layer.layer_id, k, v, dtype), mask)

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True):
        self._save(layer, fb, k, v, save_kv_cache)
        H, D, Dv, Hkv = layer.num_heads, layer.head_dim, layer.v_head_dim, layer.num_kv_heads
        group = H // Hkv
        T = q.shape[0]
        out = q.new_empty(T, H * Dv)
        qh = q.view(T, H, D)
        req_to_token = fb.req_to_token_pool.req_to_token
        tree = fb.tree_mask is not None
        if tree and layer.sliding_window > 0:
            raise ValueError("a tree-masked extend pass cannot run a sliding-window layer (its rows' positions are "
                             "their depths)")
        start = tree_start = 0
        for i in range(fb.batch_size):
            n = fb.extend_seq_lens_cpu[i]
            prefix = fb.extend_prefix_lens_cpu[i]
            total = prefix + n
            # a window layer reads keys from the first query's window on (p - W, p] (skipped, not masked)
            kv_start = max(0, prefix - layer.sliding_window + 1) if layer.sliding_window > 0 else 0
            slots = req_to_token[fb.req_pool_indices[i], kv_start:total].long()
            kk, vv = self._kv(layer, fb, slots, q.dtype)  # [total - kv_start, Hkv, D]
            # on CPU, SDPA gets 4-D inputs: with 3-D ones it falls back to its math path (6x slower at 1k tokens);
            # without a cached prefix or a window that cuts in, the mask is plain causal and is_causal cheaper.
            # On GPU the math path stays: this backend is the reference the fused kernels are checked against
            fused = q.device.type == "cpu" and layer.logit_cap <= 0
            causal = fused and prefix == 0 and (layer.sliding_window <= 0 or layer.sliding_window >= n) and not tree
            mask = None
            if tree:
                # the whole prefix, then the request's [n, n] ancestor mask over the new tokens
                own = fb.tree_mask[tree_start:tree_start + n * n].view(n, n)
                mask = torch.cat([own.new_ones(n, prefix), own], dim=1)  # [n, total]
                tree_start += n * n
            elif not causal:
                q_pos = torch.arange(prefix, total, device=q.device).unsqueeze(1)
                k_pos = torch.arange(kv_start, total, device=q.device).unsqueeze(0)
                mask = k_pos <= q_pos  # [n, total - kv_start]
                if layer.sliding_window > 0:
                    mask &= k_pos > q_pos - layer.sliding_window
            if layer.logit_cap <= 0:
                qi, ki, vi = (t.transpose(0, 1) for t in (qh[start:start + n], kk, vv))  # [H(kv), len, D]
                if fused:
                    qi, ki, vi = qi[None], ki[None], vi[None]
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, is_causal=causal,
                                                   scale=layer.scaling, enable_gqa=group > 1)
                o = o[0] if fused else o  # [H, n, Dv]
                out[start:start + n] = o.transpose(0, 1).reshape(n, H * Dv)
                start += n
                continue
            qi = qh[start:start + n].float().transpose(0, 1)  # [H, n, D]
            kk = kk.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, total, D]
            vv = vv.float().repeat_interleave(group, dim=1).transpose(0, 1)
            scores = torch.matmul(qi, kk.transpose(1, 2)) * layer.scaling  # [H, n, total - kv_start]
            probs = _scores_to_probs(scores, mask, layer.logit_cap)
            out[start:start + n] = torch.matmul(probs, vv).transpose(0, 1).reshape(n, H * Dv).to(q.dtype)
            start += n
        return out

    # ---- decode ----
    def init_forward_metadata(self, fb) -> None:
        # decode: the KV slot table and key positions are the same for every layer; build them once per batch
        fb.attn_metadata = _DecodeMetadata(fb) if fb.forward_mode.is_decode() else None

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True):
        self._save(layer, fb, k, v, save_kv_cache)
        H, D, Dv, Hkv = layer.num_heads, layer.head_dim, layer.v_head_dim, layer.num_kv_heads
        group = H // Hkv
        B = q.shape[0]
        meta = fb.attn_metadata
        if not isinstance(meta, _DecodeMetadata) or meta.batch_size != B:
            meta = fb.attn_metadata = _DecodeMetadata(fb)
        if layer.logit_cap <= 0:
            kk, vv, mask = self._decode_kv(layer, fb, meta, q.dtype)  # [B, L, Hkv, D] x 2, [B, 1, 1, L]
            # one sequence that attends to all of its L keys needs no mask (CPU only, so that on GPU the reference
            # keeps the kernel choice the fused backends were checked against)
            if B == 1 and q.device.type == "cpu" and bool(mask.all()):
                mask = None
            out = F.scaled_dot_product_attention(q.view(B, H, 1, D), kk.transpose(1, 2), vv.transpose(1, 2),
                                                 attn_mask=mask, scale=layer.scaling, enable_gqa=group > 1)
            return out.reshape(B, H * Dv)
        kk, vv, mask = self._decode_kv(layer, fb, meta, torch.float32)  # [B, L, Hkv, D] x 2, [B, 1, 1, L]
        qh = q.view(B, Hkv, group, D).float()
        scores = torch.einsum("bhgd,blhd->bhgl", qh, kk) * layer.scaling
        probs = _scores_to_probs(scores, mask, layer.logit_cap)
        out = torch.einsum("bhgl,blhd->bhgd", probs, vv)
        return out.reshape(B, H * Dv).to(q.dtype)


def _is_window_layer(pool, layer) -> bool:
    """A layer whose KV a hybrid pool keeps in window slots (mem_cache/window_pool.py): reads translate slots."""
    return hasattr(pool, "is_window_layer") and pool.is_window_layer(layer.layer_id)


def _dequantized(pool, layer_id: int, k: torch.Tensor, v: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool values as attention consumes them: in `dtype`, fp8 e4m3 caches scaled back by the layer's scales."""
    k, v = k.to(dtype), v.to(dtype)
    k_scale, v_scale = pool.kv_scales(layer_id)
    if k_scale != 1.0:
        k = k * k_scale
    if v_scale != 1.0:
        v = v * v_scale
    return k, v


class _DecodeMetadata:
    """Per decode batch: KV slots [B, L] (L = longest sequence) and their valid-key mask; per sliding window W < L,
    the slots of each sequence's last W keys and their mask."""

    def __init__(self, fb):
        B = fb.batch_size
        self.batch_size = B
        self.max_len = max(fb.seq_lens_cpu)
        # entries past each seq_len are masked out
        self.slots = fb.req_to_token_pool.req_to_token[fb.req_pool_indices, :self.max_len].long()
        self._k_pos = torch.arange(self.max_len, device=self.slots.device).view(1, 1, 1, self.max_len)
        self._seq = fb.seq_lens.view(B, 1, 1, 1).to(self._k_pos.dtype)
        self._mask: Optional[torch.Tensor] = None
        self._windows: dict = {}
        self._window_slots: Optional[torch.Tensor] = None
        # a lone sequence whose slots are one consecutive run (the ring allocator hands them out in order) is
        # read through views of the pool instead of gathered per layer; checked on CPU only (no device sync)
        self.first_slot: Optional[int] = None
        if B == 1 and self.slots.device.type == "cpu" and self.max_len > 0:
            run = self.slots[0]
            first = int(run[0])
            if int(run[-1]) - first == self.max_len - 1 and bool((run[1:] - run[:-1] == 1).all()):
                self.first_slot = first

    def window_slots(self, pool) -> torch.Tensor:
        """slots translated to a hybrid pool's window slots, [B, L] (once per batch)."""
        if self._window_slots is None:
            self._window_slots = pool.window_slots(self.slots)
        return self._window_slots

    def mask(self) -> torch.Tensor:
        """[B, 1, 1, L] bool, True where the key is attended."""
        if self._mask is None:
            self._mask = self._k_pos < self._seq
        return self._mask

    def window(self, sliding_window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots [B, W] of positions seq - W .. seq - 1 (from 0 for shorter sequences), mask [B, 1, 1, W]) for
        W < L: a window layer reads these keys only."""
        got = self._windows.get(sliding_window)
        if got is None:
            seq = self._seq.view(-1, 1)
            pos = (seq - sliding_window).clamp(min=0) + self._k_pos.view(1, -1)[:, :sliding_window]  # [B, W]
            valid = pos < seq
            slots = self.slots.gather(1, pos.clamp(max=self.max_len - 1))
            got = self._windows[sliding_window] = (slots, valid.view(self.batch_size, 1, 1, sliding_window))
        return got
