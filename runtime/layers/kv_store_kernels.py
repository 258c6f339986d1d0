"""The KV store Triton kernel: a layer's K and V rows written to their cache slots in one launch (the KV pool's
fused store; only the pool calls it). Into an fp8 cache it quantizes as the pool's indexed path does: fp32, divided
by the layer's scale (IEEE-rounded), saturated to +-448 for e4m3, cast. Runs on CPU tensors under TRITON_INTERPRET=1
for the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from braid.runtime.dtypes import FP8_DTYPES
from braid.runtime.layers.kernel_inputs import token_rows_stride

__all__ = ["store_kv"]


@triton.jit
def _as_cached(row, scale, fp8_max, QUANTIZE: tl.constexpr, SCALED: tl.constexpr, SATURATE: tl.constexpr):
    if QUANTIZE:
        row = row.to(tl.float32)
        if SCALED:
            row = tl.math.div_rn(row, scale)
        if SATURATE:  # e4m3fn has no infinity
            row = tl.minimum(tl.maximum(row, -fp8_max), fp8_max)
    return row


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, loc_ptr, k_cache_ptr, v_cache_ptr, k_row_stride, v_row_stride,
                     k_cache_row_stride, v_cache_row_stride, k_scale, v_scale, fp8_max,
                     K_WIDTH: tl.constexpr, V_WIDTH: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                     QUANTIZE: tl.constexpr, K_SCALED: tl.constexpr, V_SCALED: tl.constexpr,
                     SATURATE: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K_WIDTH
    row_k = tl.load(k_ptr + t.to(tl.int64) * k_row_stride + offs_k, mask=mask_k)
    row_k = _as_cached(row_k, k_scale, fp8_max, QUANTIZE, K_SCALED, SATURATE)
    tl.store(k_cache_ptr + slot * k_cache_row_stride + offs_k, row_k.to(k_cache_ptr.dtype.element_ty), mask=mask_k)
    offs_v = tl.arange(0, BLOCK_V)
    mask_v = offs_v < V_WIDTH
    row_v = tl.load(v_ptr + t.to(tl.int64) * v_row_stride + offs_v, mask=mask_v)
    row_v = _as_cached(row_v, v_scale, fp8_max, QUANTIZE, V_SCALED, SATURATE)
    tl.store(v_cache_ptr + slot * v_cache_row_stride + offs_v, row_v.to(v_cache_ptr.dtype.element_ty), mask=mask_v)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> bool:
    """k_cache: [S, Hkv, D], v_cache: [S, Hkv, Dv] contiguous; loc: [T] slots; k: [T, Hkv*D] or [T, Hkv, D]
    (rows may be strided, e.g. slices of a fused qkv output), v likewise.

    Writes k[t] to k_cache[loc[t]] and v[t] to v_cache[loc[t]] in one launch: as they are into a cache of their
    dtype, quantized (k / k_scale, v / v_scale; saturated for e4m3) into an fp8 cache (the pool's fp8 views).
    Returns False (writing nothing) when the layouts or dtypes do not allow it, so the caller can fall back to
    indexed assignment."""
    tokens = loc.numel()
    k_width, v_width = k_cache[0].numel(), v_cache[0].numel()
    k_rows, v_rows = token_rows_stride(k, tokens, k_width), token_rows_stride(v, tokens, v_width)
    quantize = k_cache.dtype in FP8_DTYPES
    if quantize:
        dtypes_fit = (v_cache.dtype == k_cache.dtype and k.is_floating_point() and v.is_floating_point()
                      and k.dtype not in FP8_DTYPES and v.dtype not in FP8_DTYPES)
    else:
        dtypes_fit = k.dtype == k_cache.dtype and v.dtype == v_cache.dtype
    if (k_rows is None or v_rows is None or not dtypes_fit or not k_cache.is_contiguous()
            or not v_cache.is_contiguous() or loc.dim() != 1):
        return False
    if tokens:
        _store_kv_kernel[(tokens,)](
            k, v, loc, k_cache, v_cache, k_rows, v_rows, k_width, v_width, float(k_scale), float(v_scale),
            torch.finfo(torch.float8_e4m3fn).max,
            K_WIDTH=k_width, V_WIDTH=v_width, BLOCK_K=triton.next_power_of_2(k_width),
            BLOCK_V=triton.next_power_of_2(v_width), QUANTIZE=quantize, K_SCALED=quantize and k_scale != 1.0,
            V_SCALED=quantize and v_scale != 1.0, SATURATE=k_cache.dtype == torch.float8_e4m3fn, num_warps=4)
    return True
