"""The e4m3 format of the fp8 LinearMethod: where it runs, quantizing weights and activations to it, and the GEMM of
quantized operands (torch._scaled_mm). The batch-1 and small-batch GEMVs on e4m3 weights are fp8_gemv.py's.

Scales follow the checkpoints' convention: stored fp8 value * scale = real value. Weights carry one fp32 scale
per output row; activations one per token (dynamic, from the row's absolute maximum) or one for the tensor (a
checkpoint's static `input_scale`).

- `check_fp8_device`: fp8 needs compute capability 8.9+ on CUDA; on CPU the casts must exist.
- `quantize_weight_per_channel`: weight [N, K] -> (e4m3 [N, K], scale [N]), each row's max |w| at 448.
- `quantize_rows`: x [M, K] -> (fp8 [M, K], scale [M, 1]). One Triton launch on CUDA (one program per row:
  amax, scale, divide, saturate, cast), torch elsewhere; both divide in IEEE fp32, so they round alike.
- `scaled_mm`: torch._scaled_mm with row-wise scales (activation [M, 1], weight [1, N]; sm90 needs a bf16
  output for these), or tensor-wise when both sides have one scale (a static-activation checkpoint with
  per-tensor weights). torch._scaled_mm wants a row-major A, a column-major B (the [N, K] weight transposed, no
  copy), K and N multiples of 16 and fp32 scales.
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

__all__ = ["FP8_DTYPE", "FP8_MAX", "check_fp8_device", "quantize_weight_per_channel", "quantize_rows",
           "quantize_rows_triton", "quantize_rows_reference", "scaled_mm"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
_MIN_SCALE = 1e-12  # an all-zero row gets this scale instead of a division by zero
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_MIN_CUDA_CAPABILITY = (8, 9)


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
