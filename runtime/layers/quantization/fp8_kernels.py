"""FP8 (e4m3) building blocks of the fp8 LinearMethod: weight quantization, activation quantization, the GEMM.

Scales follow the checkpoints' convention: stored fp8 value * scale = real value. Weights carry one fp32 scale
per output row; activations one per token (dynamic, from the row's absolute maximum) or one for the tensor (a
checkpoint's static `input_scale`).

- `quantize_rows`: x [M, K] -> (fp8 [M, K], scale [M, 1]). One Triton launch on CUDA (one program per row:
  amax, scale, divide, saturate, cast), torch elsewhere; both divide in IEEE fp32, so they round alike.
- `scaled_mm`: torch._scaled_mm with row-wise scales (activation [M, 1], weight [1, N]; sm90 needs a bf16
  output for these), or tensor-wise when both sides have one scale (a static-activation checkpoint with
  per-tensor weights). torch._scaled_mm wants a row-major A, a column-major B (the [N, K] weight transposed, no
  copy), K and N multiples of 16 and fp32 scales.
- `small_batch_gemm`: 2..16 rows of x against an e4m3 weight with row scales, weight-only (x stays bf16): one
  Triton launch that streams W once (tensor-core dots of a 16-row x tile with W tiles upcast to bf16), SiLU-and-mul
  fusable like the GEMV. At these sizes a decode step is a stream over the weights, as at batch 1; torch._scaled_mm
  was measured no faster than bf16 there (DESIGN.md) and needs x quantized first.
- `check_fp8_device`: fp8 needs compute capability 8.9+ on CUDA; on CPU the casts must exist.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from braid.runtime.layers import pdl
from braid.runtime.layers.pdl import let_next_kernel_launch, wait_for_previous_kernel

__all__ = ["FP8_DTYPE", "FP8_MAX", "SMALL_BATCH_MAX_ROWS", "check_fp8_device", "quantize_weight_per_channel",
           "quantize_rows", "quantize_rows_triton", "quantize_rows_reference", "scaled_mm", "small_batch_gemm"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
_MIN_SCALE = 1e-12  # an all-zero row gets this scale instead of a division by zero
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_MIN_CUDA_CAPABILITY = (8, 9)
SMALL_BATCH_MAX_ROWS = 16  # small_batch_gemm's x tile: one tensor-core row block


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def check_fp8_device(device: torch.device) -> None:
    """Raise a clear ValueError where fp8 weights cannot run: a CUDA GPU below sm89 (no fp8 tensor cores), a torch
    without torch._scaled_mm, or a device type braid has no fp8 path for."""
    device = torch.device(device)
    if device.type == "cuda":
        if torch.version.hip is not None:
            raise ValueError("--quantization fp8 is built for NVIDIA GPUs (e4m3fn); this is a ROCm device")
        index = device.index if device.index is not None else torch.cuda.current_device()
        capability = _cuda_capability(index)
        if capability < _MIN_CUDA_CAPABILITY:
            raise ValueError(f"--quantization fp8 needs an NVIDIA GPU of compute capability 8.9 or newer (Ada, "
                             f"Hopper); {torch.cuda.get_device_name(index)} is {capability[0]}.{capability[1]}")
        if not hasattr(torch, "_scaled_mm"):
            raise ValueError(f"--quantization fp8 needs torch._scaled_mm, which torch {torch.__version__} lacks")
        return
    if device.type == "cpu":
        try:
            torch.ones(2).to(FP8_DTYPE).float()
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"--quantization fp8: torch {torch.__version__} cannot cast to float8_e4m3fn on CPU "
                             f"({e})") from None
        return
    raise ValueError(f"--quantization fp8 runs on CUDA (sm89+) and CPU, not on {device.type}")


def quantize_weight_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (any float dtype) -> (e4m3 [N, K], fp32 scale [N]) with each row's max |w| at 448."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp_min(_MIN_SCALE)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_rows_reference(x: torch.Tensor, static_scale: Optional[torch.Tensor] = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scale [M, 1]): per row (dynamic), or one static scale broadcast to [M, 1]."""
    xf = x.float()
    if static_scale is None:
        scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(_MIN_SCALE)
    else:
        scale = static_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, static_scale_ptr, K, x_row_stride, fp8_max, min_scale,
                          STATIC: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    let_next_kernel_launch(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    cols = tl.arange(0, BLOCK_K)
    mask = cols < K
    x = tl.load(x_ptr + row.to(tl.int64) * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    # IEEE-rounded divisions (Triton's `/` is approximate on GPUs): the same scales and fp8 values as torch
    if STATIC:
        scale = tl.load(static_scale_ptr).to(tl.float32)
    else:
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=0), fp8_max), min_scale)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -fp8_max), fp8_max)
    tl.store(q_ptr + row.to(tl.int64) * K + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_rows(x: torch.Tensor, static_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K] contiguous, fp32 scale [M, 1]): dynamic per-token scales, or the checkpoint's
    static per-tensor `static_scale` (a one-element fp32 tensor) for every row. The Triton kernel on CUDA, torch
    elsewhere."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows takes x [M, K], got {tuple(x.shape)}")
    if not x.is_cuda or x.stride(1) != 1:
        return quantize_rows_reference(x, static_scale)
    return quantize_rows_triton(x, static_scale)


def quantize_rows_triton(x: torch.Tensor, static_scale: Optional[torch.Tensor] = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows in one Triton launch (CUDA, or CPU tensors under TRITON_INTERPRET=1); x: [M, K], unit stride
    along K."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    block = triton.next_power_of_2(k)
    _quantize_rows_kernel[(m,)](x, q, scale, static_scale if static_scale is not None else scale, k, x.stride(0),
                                FP8_MAX, _MIN_SCALE, STATIC=static_scale is not None, BLOCK_K=block,
                                num_warps=max(1, min(16, block // 512)) if not _INTERPRET else 1,
                                **pdl.launch_options(x.device))
    return q, scale


def scaled_mm(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
              out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None, tensorwise: bool = False) -> torch.Tensor:
    """(x_q * x_scale) @ (weight * weight_scale[:, None])^T (+ bias) in out_dtype.

    x_q: e4m3 [M, K] row-major; x_scale: fp32 [M, 1]; weight: e4m3 [N, K] row-major; weight_scale: fp32 [N].
    tensorwise: every x_scale entry is one value and every weight_scale entry another (then one scale a side,
    the fastest form on sm90 at small M)."""
    if tensorwise:
        scale_a, scale_b = x_scale.reshape(-1)[:1].reshape(()), weight_scale[:1].reshape(())
    else:
        scale_a, scale_b = x_scale, weight_scale.view(1, -1)
    y = torch._scaled_mm(x_q, weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    return y if bias is None else y + bias


def _small_batch_configs():
    if _INTERPRET:
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 32}, num_warps=1)]
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
            for bn, bk, w, st in ((16, 256, 4, 4), (16, 512, 4, 3), (32, 256, 4, 4), (64, 256, 4, 3))]


@triton.autotune(configs=_small_batch_configs(), key=["N", "K", "SILU_MUL", "USE_PDL"])
@triton.jit
def _small_batch_gemm_kernel(x_ptr, w_ptr, w_scale_ptr, y_ptr, M, N, K, x_row_stride, w_row_stride,
                             SILU_MUL: tl.constexpr, USE_PDL: tl.constexpr, DOT_DTYPE: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # program: rows [pid * BLOCK_N, +BLOCK_N) of W (and, with SILU_MUL, the up rows N further) for all M rows of x
    pid = tl.program_id(0)
    let_next_kernel_launch(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * x_row_stride + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * w_row_stride + offs_k[:, None]  # [BLOCK_K, BLOCK_N] = W^T tile
    up_offset = N.to(tl.int64) * w_row_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + offs_k < K
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(DOT_DTYPE)
        w_mask = k_mask[:, None] & n_mask[None, :]
        w = tl.load(w_ptrs, mask=w_mask, other=0.0, eviction_policy="evict_first")
        acc = tl.dot(x, w.to(DOT_DTYPE), acc)
        if SILU_MUL:
            u = tl.load(w_ptrs + up_offset, mask=w_mask, other=0.0, eviction_policy="evict_first")
            acc_up = tl.dot(x, u.to(DOT_DTYPE), acc_up)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y = acc * tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if SILU_MUL:  # rounded to the output dtype where the unfused path rounds, like the GEMV
        up = acc_up * tl.load(w_scale_ptr + N + offs_n, mask=n_mask, other=0.0)[None, :]
        gate = y.to(y_ptr.dtype.element_ty).to(tl.float32)
        up = up.to(y_ptr.dtype.element_ty).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * up
    out_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(out_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def small_batch_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *,
                     silu_mul: bool = False) -> torch.Tensor:
    """x: [M, K] bf16/fp16 with 1 <= M <= 16 (unit stride along K); weight: e4m3 [N, K] (or [2N, K] = [gate; up]
    with silu_mul); weight_scale: fp32 [rows] -> y [M, N] = act(x @ (weight * weight_scale[:, None])^T) in x's
    dtype. CUDA, or CPU tensors under TRITON_INTERPRET=1."""
    m, k = x.shape
    rows = weight.shape[0]
    if not (1 <= m <= SMALL_BATCH_MAX_ROWS and weight.dtype == FP8_DTYPE and weight.shape[1] == k
            and weight.stride(1) == 1 and x.stride(1) == 1 and weight_scale.numel() == rows
            and weight_scale.dtype == torch.float32 and weight_scale.is_contiguous()
            and x.dtype in (torch.bfloat16, torch.float16) and not (silu_mul and rows % 2)):
        raise ValueError(f"small_batch_gemm needs x [1..{SMALL_BATCH_MAX_ROWS}, K] bf16/fp16, an e4m3 weight [N, K] "
                         f"and an fp32 scale per row; got {tuple(x.shape)} {x.dtype}, {tuple(weight.shape)} "
                         f"{weight.dtype}, {tuple(weight_scale.shape)} {weight_scale.dtype}")
    n = rows // 2 if silu_mul else rows
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _small_batch_gemm_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](
        x, weight, weight_scale, y, m, n, k, x.stride(0), weight.stride(0), SILU_MUL=bool(silu_mul),
        # the interpreter's dots are wrong on bf16 operands: fp32 there (the products are exact in both)
        DOT_DTYPE=tl.float32 if _INTERPRET else (tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16),
        BLOCK_M=SMALL_BATCH_MAX_ROWS, **pdl.launch_options(x.device))
    return y
