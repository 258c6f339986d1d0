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
- `fp8_gemv`: 1..16 rows of x (decode batches) against an e4m3 weight with row scales, one Triton launch that streams
  W once, SiLU-and-mul fusable: at one row the GEMV variants below (x kept in 16 bits), at 2..16 the "tc" variant
  (x rounded to e4m3 per row and chunk, fp8 tensor-core dots: small_batch_gemm.py's kernel, shared with bf16
  weights), or "tcq" (x quantized per row by quantize_rows first, the same kernel on e4m3 x: two launches, no
  rounding work in the weight loop; the H100 runs it: MEASURED_FP8_SMALL_BATCH_CONFIGS). At these sizes a decode step
  is a stream over the weights; quantize + torch._scaled_mm measured 1.1-2.2 TB/s there against the tc kernel's
  1.4-2.5 (H200).
- `fp8_gemv_rotary_store`: the batch-1 GEMV of a decode step's qkv projection with rotary and the KV write as its
  epilogue (gemv.py's, on the "f16" products), where the pool lets a kernel write the cache.
- `check_fp8_device`: fp8 needs compute capability 8.9+ on CUDA; on CPU the casts must exist.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from braid.runtime.layers import pdl
from braid.runtime.layers.gemv import (fp8_supports, measured_table, rotary_store_args, rotary_store_pair,
                                       rotary_store_program, store_v_row)
from braid.runtime.layers.pdl import let_next_kernel_launch, wait_for_previous_kernel
from braid.runtime.layers.small_batch_gemm import (MAX_ROWS as SMALL_BATCH_MAX_ROWS, TcTile,
                                                   launch_small_batch_tc)

logger = logging.getLogger(__name__)

__all__ = ["FP8_DTYPE", "FP8_MAX", "SMALL_BATCH_MAX_ROWS", "check_fp8_device", "quantize_weight_per_channel",
           "quantize_rows", "quantize_rows_triton", "quantize_rows_reference", "scaled_mm",
           "FP8_GEMV_VARIANTS", "TENSOR_CORE_VARIANTS", "Fp8GemvConfig", "fp8_gemv_candidates", "fp8_gemv",
           "fp8_gemv_rotary_store", "fp8_gemv_error_excess"]

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


# ---- batch-1 GEMV on e4m3 weights: y[1, N] = act(x[1, K] @ (W * scale[:, None])^T)
#
# At batch 1 a step streams the weights once, so the GEMV must keep up with HBM: on an H200 ~16 weight bytes per
# clock per SM, i.e. 16 e4m3 values. gemv.py's kernel upcast every value to fp32 (e4m3 -> f16x2 -> two f32, one
# FFMA each: ~2.6 instructions per value, and a [BLOCK_N, BLOCK_K] fp32 accumulator of up to 198 registers) and
# streamed 2.0-2.8 TB/s. The variants here, autotuned together per shape (fp8_gemv):
#   "f16"    e4m3 pairs -> f16x2 (one cvt per two values on sm_90), products and sums of GROUP products in packed
#            fp16, each group sum added to an fp32 accumulator [BLOCK_N, BLOCK_K / GROUP]; ~1.6 instructions per
#            value, ~60 registers. x is scaled per group of GROUP columns to max |x| = 145 / GROUP so that no fp16
#            product or group sum can overflow (|e4m3| <= 448, 448 * 145 < 65504), and unscaled in fp32.
#   "f16bit" the same with e4m3 -> fp16 by bit moves (no conversion unit: byte permute, and, shift, or), which
#            yields value * 2**-8, folded into x's group scales.
#   "tc"     tensor cores: x rounded to e4m3 per BLOCK_K chunk (its own scale) in the kernel, fp8 x fp8 wgmma of a
#            [BLOCK_N >= 64, BLOCK_K] weight tile against x broadcast to [BLOCK_K, 16], fp32 accumulators; the
#            weight goes global -> shared -> tensor core with no per-value instruction. BLOCK_N = 64 leaves too few
#            programs for N = 4096, so K is split over SPLIT_K programs that store their partial sums in an fp32
#            workspace; the last program of a row tile (told by an atomic counter) adds them in split order
#            (deterministic), applies scales and activation, writes y and zeroes the counter for the next call.
#   "tcq"    "tc" on x quantized to e4m3 per row by quantize_rows (one launch of its own, PDL) instead of per chunk
#            inside the weight loop, whose max-reduction and divide per chunk sit between the weight loads and the
#            dots; x's row scales are applied in the epilogue. Within tc's bound: a row's max |x| bounds every chunk's.
# Error against the fp32 matmul of the dequantized weight with the unrounded x (Fp8GemvConfig.error_bound, checked
# by tests/kernels/test_fp8_gemv_variants.py and by the autotuner): |y - ref| <= C * sum_k |w_k x_k| + F * max|x| *
# sum_k |w_k| (+ the output's own rounding), C the relative rounding of the path, F the absolute floor of values too
# small for the format: "f16"/"f16bit" round each product and partial group sum to fp16, C = (GROUP + 2) * 2**-11,
# F = GROUP * 2**-23 (a product below fp16's normals is off by up to 2**-25 <= 2**-16 |w| in the group's scale,
# 145 / GROUP at the group's max |x| <= max|x|; sums there are exact); "tc" rounds x to e4m3, C = 2**-4,
# F = 2**-10 / 448 (half of e4m3's smallest subnormal at the chunk's scale). All keep PDL (the first weight chunk
# streams before the wait for x) and fuse SiLU-and-mul for a [gate; up] weight.

FP8_GEMV_VARIANTS = ("f16", "f16bit", "tc", "tcq")
TENSOR_CORE_VARIANTS = ("tc", "tcq")  # small_batch_gemm.py's kernel: x's rows as the dot's columns


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _e4m3_bits_to_f16(w, ASM: tl.constexpr):
    """w: uint8 e4m3 bits -> fp16 = value / 256 (sign to bit 15, exponent and mantissa one bit under fp16's; e4m3
    subnormals land on fp16 subnormals). ASM: four bytes per inline PTX block (2 byte permutes, then and / shift /
    or per f16x2); the interpreter runs the same bit moves as Triton integer ops."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 lo, hi, t;
            prmt.b32 lo, $2, 0, 0x1404;
            prmt.b32 hi, $2, 0, 0x3424;
            and.b32 t, lo, 0x7F007F00;
            shr.b32 t, t, 1;
            and.b32 lo, lo, 0x80008000;
            or.b32 $0, lo, t;
            and.b32 t, hi, 0x7F007F00;
            shr.b32 t, t, 1;
            and.b32 hi, hi, 0x80008000;
            or.b32 $1, hi, t;
            }""",
            constraints="=r,=r,r", args=[w], dtype=tl.float16, is_pure=True, pack=4)
    b = w.to(tl.uint16)
    return (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True)


@triton.jit
def _f16_group_sums(w, xs, BIT_DEQUANT: tl.constexpr, ASM: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """w: [BLOCK_N, BLOCK_K] e4m3; xs: [BLOCK_K] fp16 -> [BLOCK_N, BLOCK_K // GROUP] fp16 sums of GROUP products."""
    if BIT_DEQUANT:
        wf = _e4m3_bits_to_f16(w.to(tl.uint8, bitcast=True), ASM)
    else:
        wf = w.to(tl.float16)
    products = wf * xs[None, :]
    return tl.reduce(tl.reshape(products, [BLOCK_N, BLOCK_K // GROUP, GROUP]), 2, _add)


@triton.jit
def _f16_chunk(w, u, x, acc, acc_up, SILU_MUL: tl.constexpr, BIT_DEQUANT: tl.constexpr, ASM: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """One BLOCK_K chunk: x [BLOCK_K] fp32 scaled into fp16 per group of GROUP columns so that the group's |x| <= 145
    / GROUP (448 * 145 < 65504: no product or group sum overflows), products summed by groups in fp16, each group sum
    unscaled into acc [BLOCK_N, BLOCK_K // GROUP] fp32. A group's columns sit in one or two threads, so its max takes
    at most one shuffle; one scale for the chunk took a reduction across warps (shuffles, a shared-memory round trip,
    a barrier) every chunk: the Llama-3-8B fp8 batch-1 step was 1.026x slower with it on an H100."""
    x_groups = tl.reshape(x, [BLOCK_K // GROUP, GROUP])
    group_max = tl.maximum(tl.max(tl.abs(x_groups), axis=1), 1e-30)  # [BLOCK_K // GROUP]
    x_scale = (145.0 / GROUP) / group_max
    unscale = (group_max * (GROUP / 145.0))[None, :]
    if BIT_DEQUANT:
        x_scale = x_scale * 256.0
    xs = tl.reshape(x_groups * x_scale[:, None], [BLOCK_K]).to(tl.float16)
    acc += _f16_group_sums(w, xs, BIT_DEQUANT, ASM, BLOCK_N, BLOCK_K, GROUP).to(tl.float32) * unscale
    if SILU_MUL:
        acc_up += _f16_group_sums(u, xs, BIT_DEQUANT, ASM, BLOCK_N, BLOCK_K, GROUP).to(tl.float32) * unscale
    return acc, acc_up


@triton.jit
def _scaled_activation_store(y, y_up, w_scale_ptr, out_ptrs, rows, row_mask, out_mask, N, SILU_MUL: tl.constexpr):
    """y, y_up: fp32 sums of the unscaled weight rows `rows` [BLOCK_N] -> times the row scales, SiLU-and-mul (gate and
    up rounded to the output dtype where the unfused path rounds them), stored at out_ptrs where out_mask."""
    y = y * tl.load(w_scale_ptr + rows, mask=row_mask, other=0.0)
    out_dtype = out_ptrs.dtype.element_ty
    if SILU_MUL:
        scale_up = tl.load(w_scale_ptr + N + rows, mask=row_mask, other=0.0)
        gate = y.to(out_dtype).to(tl.float32)
        up = (y_up * scale_up).to(out_dtype)
        y = gate / (1.0 + tl.exp(-gate)) * up.to(tl.float32)
    tl.store(out_ptrs, y.to(out_dtype), mask=out_mask)


@triton.jit
def _f16_row_sums(rows, row_mask, pair_offset, x_ptr, w_ptr, K, w_row_stride, PAIRED: tl.constexpr,
                  EVEN_K: tl.constexpr, USE_PDL: tl.constexpr, WAIT: tl.constexpr, BIT_DEQUANT: tl.constexpr,
                  ASM: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """rows, row_mask: [R] -> (x . W[rows], x . W[rows + pair_offset] when PAIRED), each [R] fp32 before the row
    scales. WAIT: the program's first call, which waits for the previous kernel (PDL) after loading its first chunk.
    (Software-pipelining the weight loop through shared memory, tl.range with num_stages=3, made the batch-1 step
    1.08x slower on an H100.)"""
    R: tl.constexpr = rows.shape[0]
    # cols: 0..BLOCK_K-1 written as runs of 8, so that the compiler loads 8 weight bytes a thread, the columns of
    # one 16-byte load of x, and loads x in the products' layout. With 16-byte weight loads x went through shared
    # memory with barriers every chunk; without them the H100's batch-1 step was 1.006x (the loop is barrier-free)
    cols = tl.arange(0, BLOCK_K) // 8 * 8 + tl.arange(0, BLOCK_K) % 8
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * w_row_stride
    pair_rows = w_rows + w_row_stride.to(tl.int64) * pair_offset
    # the first weight chunk: no kernel of the step writes W, so it streams before the wait for x
    w_mask = row_mask[:, None] if EVEN_K else row_mask[:, None] & (cols < K)[None, :]
    w = tl.load(w_rows + cols[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
    u = w
    if PAIRED:
        u = tl.load(pair_rows + cols[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
    if WAIT:
        wait_for_previous_kernel(USE_PDL)
    acc = tl.zeros((R, BLOCK_K // GROUP), dtype=tl.float32)
    acc_pair = tl.zeros((R, BLOCK_K // GROUP), dtype=tl.float32)
    x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    acc, acc_pair = _f16_chunk(w, u, x, acc, acc_pair, PAIRED, BIT_DEQUANT, ASM, R, BLOCK_K, GROUP)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + cols
        w_mask = row_mask[:, None] if EVEN_K else row_mask[:, None] & (kk < K)[None, :]
        w = tl.load(w_rows + kk[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
        if PAIRED:
            u = tl.load(pair_rows + kk[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
        x = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        acc, acc_pair = _f16_chunk(w, u, x, acc, acc_pair, PAIRED, BIT_DEQUANT, ASM, R, BLOCK_K, GROUP)
    return tl.sum(acc, axis=1), tl.sum(acc_pair, axis=1)


@triton.jit
def _fp8_gemv_f16_rows(block, x_ptr, w_ptr, w_scale_ptr, y_ptr, N, K, w_row_stride, SILU_MUL: tl.constexpr,
                       EVEN_K: tl.constexpr, USE_PDL: tl.constexpr, WAIT: tl.constexpr, BIT_DEQUANT: tl.constexpr,
                       ASM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    # rows [block * BLOCK_N, +BLOCK_N) (and the up rows N further with SILU_MUL), all of K
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    y, y_up = _f16_row_sums(rows, row_mask, N, x_ptr, w_ptr, K, w_row_stride, SILU_MUL, EVEN_K, USE_PDL, WAIT,
                            BIT_DEQUANT, ASM, BLOCK_K, GROUP)
    _scaled_activation_store(y, y_up, w_scale_ptr, y_ptr + rows, rows, row_mask, row_mask, N, SILU_MUL)


@triton.jit
def _fp8_gemv_rotary_store_kernel(x_ptr, w_ptr, w_scale_ptr, q_ptr, pos_ptr, cos_sin_ptr, cos_sin_stride, loc_ptr,
                                  k_cache_ptr, v_cache_ptr, k_cache_stride, v_cache_stride, K, w_row_stride,
                                  NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                                  V_WIDTH: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr,
                                  BIT_DEQUANT: tl.constexpr, ASM: tl.constexpr, BLOCK_N: tl.constexpr,
                                  BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """gemv.py's qkv GEMV with rotary and the KV write as its epilogue, on an e4m3 weight with row scales (the "f16"
    / "f16bit" products): the first programs each own BLOCK_N / 2 rows of a q or k head's first half and the rows
    HEAD_DIM / 2 further, the rest BLOCK_N rows of v."""
    let_next_kernel_launch(USE_PDL)
    is_qk, head, pairs, v_cols, v_mask = rotary_store_program(tl.program_id(0), NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM,
                                                              V_WIDTH, BLOCK_N)
    if is_qk:
        rows = head * HEAD_DIM + pairs
        y1, y2 = _f16_row_sums(rows, rows >= 0, HEAD_DIM // 2, x_ptr, w_ptr, K, w_row_stride, True, EVEN_K, USE_PDL,
                               True, BIT_DEQUANT, ASM, BLOCK_K, GROUP)
        y1 = y1 * tl.load(w_scale_ptr + rows)
        y2 = y2 * tl.load(w_scale_ptr + HEAD_DIM // 2 + rows)
        rotary_store_pair(y1, y2, head, pairs, q_ptr, pos_ptr, cos_sin_ptr, cos_sin_stride, loc_ptr, k_cache_ptr,
                          k_cache_stride, NUM_Q_HEADS, HEAD_DIM)
    else:
        v_rows = (NUM_Q_HEADS + NUM_KV_HEADS) * HEAD_DIM + v_cols
        y, _ = _f16_row_sums(v_rows, v_mask, 0, x_ptr, w_ptr, K, w_row_stride, False, EVEN_K, USE_PDL, True,
                             BIT_DEQUANT, ASM, BLOCK_K, GROUP)
        y = y * tl.load(w_scale_ptr + v_rows, mask=v_mask, other=0.0)
        store_v_row(y, v_cols, v_mask, loc_ptr, v_cache_ptr, v_cache_stride, q_ptr.dtype.element_ty)


@triton.jit
def _fp8_gemv_f16_kernel(x_ptr, w_ptr, w_scale_ptr, y_ptr, N, K, w_row_stride, num_programs, SILU_MUL: tl.constexpr,
                         EVEN_K: tl.constexpr, USE_PDL: tl.constexpr, BIT_DEQUANT: tl.constexpr, ASM: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                         PERSISTENT: tl.constexpr):
    # program: the row block pid; PERSISTENT: then every num_programs-th block after it (a grid of num_programs)
    pid = tl.program_id(0)
    let_next_kernel_launch(USE_PDL)
    _fp8_gemv_f16_rows(pid, x_ptr, w_ptr, w_scale_ptr, y_ptr, N, K, w_row_stride, SILU_MUL, EVEN_K, USE_PDL, True,
                       BIT_DEQUANT, ASM, BLOCK_N, BLOCK_K, GROUP)
    if PERSISTENT:
        for block in range(pid + num_programs, tl.cdiv(N, BLOCK_N), num_programs):
            _fp8_gemv_f16_rows(block, x_ptr, w_ptr, w_scale_ptr, y_ptr, N, K, w_row_stride, SILU_MUL, EVEN_K,
                               USE_PDL, False, BIT_DEQUANT, ASM, BLOCK_N, BLOCK_K, GROUP)


@dataclasses.dataclass(frozen=True)
class Fp8GemvConfig:
    """One launch of fp8_gemv: the variant (FP8_GEMV_VARIANTS) and its tile. group: products summed in fp16 per
    fp32 add ("f16", "f16bit"); split_k: programs per row tile along K ("tc", "tcq"; 0: enough for two per SM);
    programs: a persistent grid ("f16", "f16bit"; 0: one program per row block)."""
    variant: str
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group: int = 16
    split_k: int = 1
    programs: int = 0  # "f16" / "f16bit": a persistent grid of this many programs (0: one per row block)

    def __post_init__(self):
        if self.variant not in FP8_GEMV_VARIANTS:
            raise ValueError(f"fp8 GEMV variant {self.variant!r}: one of {FP8_GEMV_VARIANTS}")
        if self.variant in TENSOR_CORE_VARIANTS:
            _ = self.tile  # small_batch_gemm.TcTile's checks (block_n >= 64 keeps the fp8 wgmma)
        if self.variant not in TENSOR_CORE_VARIANTS and (self.group < 1 or self.block_k % self.group):
            raise ValueError(f"group {self.group} must divide block_k {self.block_k}")
        if self.programs < 0 or (self.programs and self.variant in TENSOR_CORE_VARIANTS):
            raise ValueError(f"programs (a persistent grid) is for the f16 variants and >= 0, got {self.programs} "
                             f"for {self.variant}")

    @property
    def tile(self) -> TcTile:
        """The tensor-core variants' launch in small_batch_gemm.py's terms."""
        return TcTile(self.block_n, self.block_k, self.num_warps, self.num_stages, self.split_k)

    @property
    def error_bound(self) -> tuple[float, float]:
        """(C, F) of the variant's bound |y - ref| <= C * sum_k |w_k x_k| + F * max|x| * sum_k |w_k| (before the
        output's rounding): fp16 products and group sums (2**-11 each, GROUP + 2 of them at most on a path; fp16
        subnormals), or x rounded to e4m3 (2**-4; below e4m3's subnormals at the chunk's scale)."""
        if self.variant in TENSOR_CORE_VARIANTS:
            return 2 ** -4, 2 ** -10 / FP8_MAX
        return (self.group + 2) * 2 ** -11, self.group * 2 ** -23


def fp8_gemv_error_excess(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                          silu_mul: bool, error_bound: tuple[float, float], out_rounding: float = 2 ** -8
                          ) -> tuple[float, float]:
    """x [M, K], y [M, N] -> (max over outputs of |y - ref| / bound (<= 1: within), max |y - ref|), ref = act(x @ (weight *
    weight_scale[:, None])^T) unrounded (float64 on CPU, fp32 in 2048-row blocks on CUDA), bound = C * sum_k
    |w_k x_k| + F * max|x| * sum_k |w_k| + out_rounding * |ref| for error_bound = (C, F) (Fp8GemvConfig.error_bound),
    carried through silu(gate) * up with |silu'| <= 1.1. NaN or inf in y: (inf, inf)."""
    relative, floor = error_bound
    dtype = torch.float32 if x.is_cuda else torch.float64
    xf = x.to(dtype)  # [M, K]: each row its own bound (its own max |x|)
    ref, bound = [], []
    for start in range(0, weight.shape[0], 2048):
        w = weight[start:start + 2048].to(dtype) * weight_scale[start:start + 2048].to(dtype)[:, None]
        ref.append(xf @ w.t())
        bound.append((relative * xf.abs() + floor * xf.abs().amax(dim=1, keepdim=True)) @ w.abs().t())
    ref = torch.cat(ref, dim=1)
    bound = torch.cat(bound, dim=1) + out_rounding * ref.abs()
    if silu_mul:
        gate, up = ref.chunk(2, dim=1)
        gate_err, up_err = bound.chunk(2, dim=1)
        silu = torch.nn.functional.silu(gate)
        ref = silu * up
        bound = 1.1 * gate_err * (up.abs() + up_err) + (silu.abs() + 1.1 * gate_err) * up_err + out_rounding * ref.abs()
    err = (y.to(dtype) - ref).abs()
    if not torch.isfinite(err).all():
        return float("inf"), float("inf")
    return (err / (bound + 1e-30)).max().item(), err.max().item()


def fp8_gemv_candidates() -> list[Fp8GemvConfig]:
    """What fp8_gemv times per shape on first use (CUDA): the first is its choice when it cannot time (under CUDA
    graph capture). The interpreter gets one small tile per variant."""
    if _INTERPRET:
        return [Fp8GemvConfig("f16", 4, 32, 1, 1, group=8), Fp8GemvConfig("f16bit", 4, 32, 1, 1, group=8),
                Fp8GemvConfig("tc", 64, 32, 4, 1, split_k=0), Fp8GemvConfig("tcq", 64, 32, 4, 1, split_k=0)]
    # tiles of 8-16 KB per load and about 60 registers (f16), fp8 wgmma tiles of 16-32 KB per stage (tc);
    # benchmarks/gpu/fp8_gemv_variants.py sweeps wider and prints the measured winners per Llama-3-8B shape
    return [Fp8GemvConfig("f16", 4, 2048, 4, 3, group=16), Fp8GemvConfig("f16", 8, 1024, 4, 3, group=16),
            Fp8GemvConfig("f16", 4, 1024, 4, 4, group=8), Fp8GemvConfig("f16", 8, 2048, 8, 3, group=16),
            Fp8GemvConfig("f16bit", 4, 2048, 4, 3, group=16),
            Fp8GemvConfig("f16bit", 8, 1024, 4, 3, group=16), Fp8GemvConfig("tc", 64, 256, 4, 4, split_k=0),
            Fp8GemvConfig("tc", 64, 512, 4, 3, split_k=0), Fp8GemvConfig("tc", 128, 256, 4, 3, split_k=0),
            Fp8GemvConfig("tcq", 64, 256, 4, 4, split_k=0)]


# The fastest variant and tile per (weight rows, K, SiLU-and-mul fused) on an H200, from
# benchmarks/gpu/fp8_gemv_variants.py (all 32 layers' weights of a Llama-3-8B shape chained in one CUDA graph with
# PDL, as in a decode step; every config there within its error bound). _tune's do_bench times one launch with L2
# flushed, which picks slower tiles for most of these shapes than the chained graph does. Shapes not listed are
# tuned.
MEASURED_FP8_GEMV_CONFIGS = {
    "NVIDIA H200": {
        (6144, 4096, False): Fp8GemvConfig("f16", 4, 2048, 4, 3, group=16),  # qkv
        (4096, 4096, False): Fp8GemvConfig("f16", 8, 2048, 8, 3, group=16),  # o
        (28672, 4096, True): Fp8GemvConfig("f16", 4, 2048, 4, 3, group=16),  # gate_up + SiLU-and-mul
        (4096, 14336, False): Fp8GemvConfig("f16", 8, 2048, 8, 3, group=16),  # down
    },
}
# on an H100 the H200's configs: in the batch-1 decode step they beat both the first-call tuning and the H100 sweep's
# own winners (benchmarks/gpu/fp8_gemv_table_ab.py; docs/benchmark_history.md)
MEASURED_FP8_GEMV_CONFIGS["NVIDIA H100 80GB HBM3"] = MEASURED_FP8_GEMV_CONFIGS["NVIDIA H200"]


# 2..16 rows of x (small decode batches): the "tc" variant with x's rows as the tensor-core operand's columns, a tile
# per (weight rows, K, SiLU-and-mul fused) from benchmarks/gpu/fp8_small_batch_gemm.py (all 32 layers of a Llama-3-8B
# shape in one CUDA graph); shapes the sweep did not reach keep the default tile (docs/benchmark_history.md)
SMALL_BATCH_TC_CONFIG = Fp8GemvConfig("tc", 64, 256, 4, 4, split_k=0)
MEASURED_FP8_SMALL_BATCH_CONFIGS = {
    "NVIDIA H200": {
        (6144, 4096, False): Fp8GemvConfig("tc", 64, 128, 4, 6, split_k=0),  # qkv
        (4096, 4096, False): Fp8GemvConfig("tc", 64, 128, 4, 6, split_k=0),  # o
        (4096, 14336, False): Fp8GemvConfig("tc", 128, 128, 4, 4, split_k=0),  # down
    },
    # "tcq" (x quantized per row by quantize_rows first: the kernel's loop then holds no reduction), 64 x 256 tiles:
    # the fastest Llama-3-8B fp8 batch-8 decode step of benchmarks/gpu/decode_step_ab.py's A/Bs on the H100
    "NVIDIA H100 80GB HBM3": {
        (6144, 4096, False): Fp8GemvConfig("tcq", 64, 256, 4, 4, split_k=0),  # qkv
        (4096, 4096, False): Fp8GemvConfig("tcq", 64, 256, 4, 4, split_k=0),  # o
        (4096, 14336, False): Fp8GemvConfig("tcq", 64, 256, 4, 4, split_k=0),  # down
        (28672, 4096, True): Fp8GemvConfig("tcq", 64, 256, 4, 4, split_k=0),  # gate_up + SiLU-and-mul
    },
}


def measured_fp8_gemv_config(device: torch.device, rows: int, k: int, silu_mul: bool) -> Optional[Fp8GemvConfig]:
    """The MEASURED_FP8_GEMV_CONFIGS entry for this CUDA device's name and a [rows, K] weight, or None."""
    return measured_table(MEASURED_FP8_GEMV_CONFIGS, device).get((rows, k, bool(silu_mul)))


def _launch_fp8_gemv(config: Fp8GemvConfig, x, weight, weight_scale, y, n, k, silu_mul) -> None:
    launch = dict(num_warps=config.num_warps, num_stages=config.num_stages, **pdl.launch_options(x.device))
    if config.variant in TENSOR_CORE_VARIANTS:
        x_scale = None
        if config.variant == "tcq":  # x rounded to e4m3 per row first, its scales applied in the epilogue
            x, x_scale = quantize_rows_triton(x)
        launch_small_batch_tc(config.tile, x, weight, weight_scale, y, n, k, "silu" if silu_mul else "",
                              x_scale=x_scale)
    else:
        blocks = triton.cdiv(n, config.block_n)
        programs = min(blocks, config.programs or blocks)
        _fp8_gemv_f16_kernel[(programs,)](
            x, weight, weight_scale, y, n, k, weight.stride(0), programs, SILU_MUL=silu_mul,
            EVEN_K=k % config.block_k == 0, BIT_DEQUANT=config.variant == "f16bit", ASM=not _INTERPRET,
            BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP=config.group, PERSISTENT=programs < blocks,
            **launch)


_tuned: dict = {}  # _tuned_key(...) -> the fastest Fp8GemvConfig


def _tuned_key(x: torch.Tensor, n: int, k: int, silu_mul: bool) -> tuple:
    """_tuned's key of a batch-1 GEMV of x against a weight of n output rows (gate rows with silu_mul) and K = k."""
    return str(x.device), n, k, silu_mul, x.dtype, pdl.enabled(x.device)


def _tune(key, candidates, run, excess) -> Fp8GemvConfig:
    """The fastest candidate by triton.testing.do_bench (one launch each, L2 flushed between), remembered per key.
    Skipped: candidates that fail to compile or launch (too much shared memory) and any whose result is outside
    its error bound (excess(config) > 1: a miscompiled or wrong kernel must not win by being fast)."""
    from triton.testing import do_bench

    timings = {}
    for config in candidates:
        try:
            run(config)
            off = excess(config)
            if off > 1.0:
                logger.warning("fp8 GEMV %s: %s is %.3g x outside its error bound, not used", key, config, off)
                continue
            timings[config] = do_bench(lambda: run(config), warmup=5, rep=20)
        except Exception as e:  # noqa: BLE001 - a config the device cannot run is not a candidate
            logger.debug("fp8 GEMV config %s failed: %r", config, e)
    if not timings:
        raise RuntimeError(f"no fp8 GEMV config runs within its error bound for {key}")
    best = min(timings, key=timings.get)
    logger.info("fp8 GEMV %s: %s (%.1f us)", key, best, timings[best] * 1e3)
    _tuned[key] = best
    return best


def fp8_gemv_rotary_store(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, epilogue,
                          config: Optional[Fp8GemvConfig] = None) -> Optional[torch.Tensor]:
    """gemv.gemv_rotary_store on an e4m3 weight with fp32 row scales: x [1, K] bf16/fp16 -> q [1, H*D], rotated, with
    the rotated k and v written to epilogue.target()'s cache, in one launch. None (nothing done) where it does not
    apply (gemv.fp8_supports, gemv.rotary_store_args), or where this shape's batch-1 config (the measured or tuned
    one, else the first candidate; or `config`) is no "f16" / "f16bit" tile whose BLOCK_N / 2 rows divide a half
    head."""
    if not fp8_supports(x, weight, weight_scale):
        return None
    rows, k = weight.shape
    if config is None:
        config = (_tuned.get(_tuned_key(x, rows, k, False))
                  or measured_fp8_gemv_config(x.device, rows, k, False) or fp8_gemv_candidates()[0])
    half = epilogue.head_dim // 2
    if config.variant not in ("f16", "f16bit") or config.block_n % 2 or half % (config.block_n // 2):
        return None
    found = rotary_store_args(x, weight, epilogue)
    if found is None:
        return None
    q, args, shape, programs = found
    _fp8_gemv_rotary_store_kernel[(programs(config.block_n),)](
        args[0], weight, weight_scale, *args[2:], **shape, EVEN_K=k % config.block_k == 0,
        BIT_DEQUANT=config.variant == "f16bit", ASM=not _INTERPRET, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP=config.group, num_warps=config.num_warps, num_stages=config.num_stages)
    return q


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *, silu_mul: bool = False,
             config: Optional[Fp8GemvConfig] = None) -> torch.Tensor:
    """x: [M, K] bf16/fp16, 1 <= M <= 16; weight: e4m3 [N, K] (or [2N, K] = [gate; up] with silu_mul), unit stride
    along K; weight_scale: fp32 [rows] -> y [M, N] = act(x @ (weight * weight_scale[:, None])^T) in x's dtype.

    config: one variant and tile (benchmarks; M > 1 takes "tc" or "tcq" only). By default, at M = 1 the fastest of
    fp8_gemv_candidates() for this shape, timed on its first call (the CUDA-graph runner's warm-up passes make it
    before capture); at M > 1 the tensor-core config of MEASURED_FP8_SMALL_BATCH_CONFIGS, else SMALL_BATCH_TC_CONFIG.
    CUDA, or CPU tensors under TRITON_INTERPRET=1 (there the first candidate, or config)."""
    rows, k = weight.shape
    m = x.shape[0] if x.dim() == 2 else 0
    if not (x.dim() == 2 and 1 <= m <= SMALL_BATCH_MAX_ROWS and x.shape[1] == k
            and x.dtype in (torch.bfloat16, torch.float16) and x.stride(1) == 1
            and weight.dtype == FP8_DTYPE and weight.stride(1) == 1 and weight_scale.dtype == torch.float32
            and weight_scale.is_contiguous() and weight_scale.numel() == rows and not (silu_mul and rows % 2)
            and x.device == weight.device == weight_scale.device):
        raise ValueError(f"fp8_gemv needs x [1..{SMALL_BATCH_MAX_ROWS}, K] bf16/fp16, an e4m3 weight [N, K] ([2N, K] "
                         f"with silu_mul) and an fp32 scale per row; got {tuple(x.shape)} {x.dtype}, "
                         f"{tuple(weight.shape)} {weight.dtype}, {tuple(weight_scale.shape)} {weight_scale.dtype}")
    if m > 1 and config is not None and config.variant not in TENSOR_CORE_VARIANTS:
        raise ValueError(f"fp8_gemv of {m} rows of x takes the 'tc' or 'tcq' variant only, got {config}")
    n = rows // 2 if silu_mul else rows
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    silu_mul = bool(silu_mul)
    if config is None and m > 1:
        config = (measured_table(MEASURED_FP8_SMALL_BATCH_CONFIGS, x.device).get((rows, k, silu_mul))
                  or SMALL_BATCH_TC_CONFIG)
    if config is None:
        key = _tuned_key(x, n, k, silu_mul)
        config = _tuned.get(key)
        if config is None:
            config = measured_fp8_gemv_config(x.device, rows, k, silu_mul)
        if config is None:
            candidates = fp8_gemv_candidates()
            if _INTERPRET or x.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
                config = candidates[0]
            else:
                # timed and checked on a probe x of its own: the first call's x may be a warm-up's placeholder
                probe = torch.randn(1, k, generator=torch.Generator(x.device).manual_seed(0), device=x.device,
                                    dtype=x.dtype)
                config = _tune(key, candidates,
                               lambda c: _launch_fp8_gemv(c, probe, weight, weight_scale, y, n, k, silu_mul),
                               lambda c: fp8_gemv_error_excess(y, probe, weight, weight_scale, silu_mul,
                                                               c.error_bound)[0])
    _launch_fp8_gemv(config, x, weight, weight_scale, y, n, k, silu_mul)
    return y
