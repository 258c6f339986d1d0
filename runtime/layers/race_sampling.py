"""Sampling a whole batch in one pass over the vocabulary, each row's draw a pure function of its scores and a key.

The exponential race: with u_j uniform on (0, 1), argmax_j (x_j - log(-log u_j)) is distributed as softmax(x)
(the Gumbel-max trick), so a row is drawn from its logits without a softmax, a cumulative sum or a search. The
uniforms come from a 32-bit hash of (token id, the row's key [k0, k1]), not from a generator's state: a seeded
request keyed by (seed, how many tokens it has sampled) draws the same token whatever its batch mates are, and the
batch needs no per-row generator calls. Unseeded rows take fresh keys from torch's RNG each step.

On CUDA, two Triton kernels (each BLOCK-wide chunk of a row: its best score and index; then the row's first best
chunk); elsewhere the same hash in torch, row blocks at a time. Both give the same tokens.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from braid.runtime.layers.argmax_kernels import row_argmax_of_chunks_kernel

__all__ = ["race_draw", "race_draw_kernels", "seeded_keys", "random_keys"]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1
_FMIX_1, _FMIX_2 = 0x85EBCA6B, 0xC2B2AE35
_TORCH_ROW_ELEMENTS = 1 << 24  # elements per row block of the torch path (its int64 temporaries)


@triton.jit
def _fmix32(h):
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def _chunk_race_kernel(x_ptr, x_row_stride, scale_ptr, keys_ptr, max_ptr, idx_ptr, V, num_chunks,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row.to(tl.int64) * x_row_stride + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    k0 = tl.load(keys_ptr + 2 * row).to(tl.uint32)
    k1 = tl.load(keys_ptr + 2 * row + 1).to(tl.uint32)
    h = _fmix32((offs.to(tl.uint32) * 0x9E3779B1) ^ k0)
    h = _fmix32(h ^ k1)
    u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # 23 bits: in (0, 1) exactly in fp32
    score = x * tl.load(scale_ptr + row) - tl.log(-tl.log(u))
    best, at = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(max_ptr + row * num_chunks + chunk, best)
    tl.store(idx_ptr + row * num_chunks + chunk, chunk * BLOCK + at)


def _fmix32_torch(h: torch.Tensor) -> torch.Tensor:
    """h: int64 holding values in [0, 2**32); products wrap in int64 and the low 32 bits are kept."""
    h = h ^ (h >> 16)
    h = (h * _FMIX_1) & _M32
    h = h ^ (h >> 13)
    h = (h * _FMIX_2) & _M32
    return h ^ (h >> 16)


def _uniforms_torch(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys [R, 2] int64 (32-bit halves) -> [R, V] fp32 uniforms, as the kernel computes them."""
    cols = torch.arange(vocab, dtype=torch.int64, device=keys.device).view(1, -1)
    h = _fmix32_torch(((cols * _GOLDEN) & _M32) ^ keys[:, :1])
    h = _fmix32_torch(h ^ keys[:, 1:])
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)


def race_draw(x: torch.Tensor, scale: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """x [B, V] log-domain scores (logits, or log-probabilities; -inf = never drawn), scale [B] fp32 (each row's
    1 / temperature), keys [B, 2] int64 with 32-bit halves -> int64 [B]: row b drawn from softmax(x[b] * scale[b]).
    The kernels for CUDA tensors, torch otherwise."""
    scale = scale.reshape(x.shape[0]).to(torch.float32)
    if x.is_cuda:
        return race_draw_kernels(x, scale, keys)
    rows, vocab = x.shape
    step = max(1, _TORCH_ROW_ELEMENTS // max(vocab, 1))
    parts = []
    for start in range(0, rows, step):
        u = _uniforms_torch(keys[start:start + step], vocab)
        score = x[start:start + step].to(torch.float32) * scale[start:start + step, None] - torch.log(-torch.log(u))
        parts.append(score.argmax(dim=-1))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=x.device)


def race_draw_kernels(x: torch.Tensor, scale: torch.Tensor, keys: torch.Tensor, block: int = 4096) -> torch.Tensor:
    """race_draw's two kernels (CPU tensors under TRITON_INTERPRET=1); scale [B] fp32."""
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    num_chunks = triton.cdiv(vocab, block)
    maxima = torch.empty((rows, num_chunks), dtype=torch.float32, device=x.device)
    indices = torch.empty((rows, num_chunks), dtype=torch.int32, device=x.device)
    _chunk_race_kernel[(rows, num_chunks)](x, x.stride(0), scale.contiguous(), keys.contiguous(), maxima, indices,
                                           vocab, num_chunks, BLOCK=block, num_warps=1 if _INTERPRET else 8)
    row_argmax_of_chunks_kernel[(rows,)](maxima, indices, out, num_chunks,
                                         BLOCK_C=max(2, triton.next_power_of_2(num_chunks)), num_warps=1)
    return out


def seeded_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """seeds [B] int64 (any signed 64-bit value), steps [B] int64 (tokens the row has sampled so far) -> keys [B, 2]:
    distinct (seed, step) pairs give distinct keys for steps below 2**32."""
    lo = seeds & _M32
    hi = (seeds >> 32) & _M32
    return torch.stack((lo, hi ^ _fmix32_torch(steps & _M32)), dim=1)


def random_keys(rows: int, device: torch.device) -> torch.Tensor:
    """[rows, 2] int64 keys from torch's RNG (the device's default generator)."""
    return torch.randint(0, 1 << 32, (rows, 2), dtype=torch.int64, device=device)
