"""Small decode batches (2..16 rows of x) against a weight streamed once, on tensor cores:

    y[M, N] = act(x[M, K] @ W[N(, +N), K]^T),  2 <= M <= 16, act: none, SiLU-and-mul or GELU-tanh-and-mul

At these batch sizes a decode step is still a stream over the weights, but cuBLAS streams some shapes well below the
rate the batch-1 GEMV reaches (docs/benchmark_history.md). The fp8
Linear runs every 2..16-row matmul here; the dense Linear only the shapes and row counts of MEASURED_TILES (measured
faster than cuBLAS on that GPU: measured_tiles.SMALL_BATCH_TILES).
Program (pid_n, pid_k) owns BLOCK_N rows of W (and the up rows N further with a gated act) over the pid_k-th of SPLIT_K
ranges of K, and dots each [BLOCK_N, BLOCK_K] weight tile with x's rows as the columns of a [BLOCK_K, 16] operand
(one wgmma: BLOCK_N >= 64). With SPLIT_K > 1 the programs of a row tile store their sums in a workspace and the last
to arrive (an atomic counter) adds them in split order, so every call gives the same result, and runs the epilogue.
With PDL the first weight tile streams before the wait for x, as in the batch-1 GEMV (gemv.py).

Weights: bf16/fp16 with x in the same dtype, or e4m3 with one fp32 scale per row (FP8_W: each row of x rounded to
e4m3 with its own scale per BLOCK_K chunk, an fp8 dot; or X_PREQUANT: x e4m3 already, its row scales applied in the
epilogue; the fp8 LinearMethod through quantization/fp8_gemv.fp8_gemv).
Gated outputs round gate and up (and GELU's result) to the output dtype where the unfused path rounds them.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from braid.runtime.layers import gemv, measured_tiles, pdl
from braid.runtime.layers.device_info import sm_count
from braid.runtime.layers.activation_kernels import gelu_tanh
from braid.runtime.layers.pdl import let_next_kernel_launch, wait_for_previous_kernel

__all__ = ["MAX_ROWS", "TcTile", "DEFAULT_TILE", "CANDIDATE_TILES", "MEASURED_TILES", "measured_tile",
           "small_batch_gemm", "small_batch_gemm_applies", "launch_small_batch_tc"]

MAX_ROWS = 16  # x's rows: the columns of the [BLOCK_K, 16] tensor-core operand
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_HALF_DTYPES = (torch.bfloat16, torch.float16)
ACTIVATIONS = {"": 0, "silu": 1, "gelu": 2}  # the kernel's ACT


@dataclasses.dataclass(frozen=True)
class TcTile:
    """One launch: BLOCK_N weight rows (>= 64: smaller tiles leave wgmma for mma.sync with per-value conversions),
    BLOCK_K columns per step, warps, pipeline stages; split_k programs per row tile along K (0: the power of two that
    gives every SM two programs)."""
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 0

    def __post_init__(self):
        if self.block_n < 64 or self.block_k < 32 or self.split_k < 0:
            raise ValueError(f"a small-batch tile needs block_n >= 64, block_k >= 32, split_k >= 0; got {self}")


# Shared memory per stage: BLOCK_N x BLOCK_K weights + BLOCK_K x 16 of x, 2 bytes each for bf16 (half for e4m3); the
# split rule (split_k) counts on two programs per SM, which this default fits (2 x 80 KB of the H200's 227 KB)
DEFAULT_TILE = TcTile(64, 128, 4, 4)
# what benchmarks/gpu/small_batch_gemm.py sweeps per shape (DEFAULT_TILE first): 60-160 KB per program, 1-3 per SM
CANDIDATE_TILES = (DEFAULT_TILE, TcTile(64, 256, 4, 2), TcTile(64, 256, 4, 3), TcTile(128, 128, 4, 3),
                   TcTile(128, 64, 4, 4), TcTile(64, 64, 4, 6), TcTile(256, 64, 8, 3), TcTile(128, 256, 8, 2),
                   TcTile(64, 512, 4, 2), TcTile(64, 128, 4, 4, split_k=1))
_INTERPRET_TILE = TcTile(64, 32, 4, 1)
# bf16/fp16 weights: per GPU name, {(weight rows, K, act): (tile, up to rows)}, measured_tiles.SMALL_BATCH_TILES as
# tiles: the dense Linear routes 2..up-to rows of these shapes here, larger batches and every other shape to cuBLAS
MEASURED_TILES: dict = {gpu: {shape: (TcTile(**tile), up_to_rows) for shape, (tile, up_to_rows) in entries.items()}
                        for gpu, entries in measured_tiles.SMALL_BATCH_TILES.items()}


@triton.jit
def _x_tile(x_ptr, x_row_stride, x_rows, row_mask, kk, k_mask, FP8_W: tl.constexpr, X_PREQUANT: tl.constexpr):
    """x[x_rows, kk] (masked to 0) as the dot's [BLOCK_K, 16] operand, column m = row m of x; FP8_W: each row rounded
    to e4m3 with its own scale for the chunk (max |x| at 448), unless x is e4m3 already (X_PREQUANT: its row scales
    are applied in the epilogue) -> (operand, the chunk's scales [16])."""
    x = tl.load(x_ptr + x_rows[None, :] * x_row_stride + kk[:, None], mask=k_mask[:, None] & row_mask[None, :],
                other=0.0)
    scale = tl.full([16], 1.0, tl.float32)
    if FP8_W and not X_PREQUANT:
        xf = x.to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(xf), axis=0), 1e-30) / 448.0
        x = (xf / scale[None, :]).to(tl.float8e4nv)
    return x, scale


@triton.jit
def _tile_dot(w, x, x_scale, FP8_W: tl.constexpr, X_PREQUANT: tl.constexpr, DOT_F32: tl.constexpr):
    if DOT_F32:  # Triton's interpreter dots bf16 operands as their raw bits: it gets fp32 copies
        w = w.to(tl.float32)
        x = x.to(tl.float32)
    y = tl.dot(w, x, out_dtype=tl.float32)  # [BLOCK_N, 16]
    if FP8_W and not X_PREQUANT:
        y = y * x_scale[None, :]
    return y


@triton.jit
def _epilogue(y, y_up, w_scale_ptr, x_scale_ptr, x_rows, x_row_mask, out_ptrs, rows, row_mask, out_mask, N,
              ACT: tl.constexpr, FP8_W: tl.constexpr, X_PREQUANT: tl.constexpr):
    """y, y_up [BLOCK_N, 16]: fp32 sums -> (times the weight rows' scales: FP8_W; x's row scales: X_PREQUANT) the
    activation, stored where out_mask."""
    out_dtype = out_ptrs.dtype.element_ty
    if FP8_W:
        y = y * tl.load(w_scale_ptr + rows, mask=row_mask, other=0.0)[:, None]
        if ACT != 0:
            y_up = y_up * tl.load(w_scale_ptr + N + rows, mask=row_mask, other=0.0)[:, None]
    if X_PREQUANT:
        x_scale = tl.load(x_scale_ptr + x_rows, mask=x_row_mask, other=0.0)[None, :]
        y = y * x_scale
        y_up = y_up * x_scale
    if ACT != 0:
        gate = y.to(out_dtype).to(tl.float32)
        up = y_up.to(out_dtype).to(tl.float32)
        if ACT == 2:
            y = gelu_tanh(gate).to(out_dtype).to(tl.float32) * up
        else:
            y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptrs, y.to(out_dtype), mask=out_mask)


@triton.jit
def _small_batch_tc_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, y_ptr, partial_ptr, count_ptr, M, N, K,
                           x_row_stride, w_row_stride, ACT: tl.constexpr, FP8_W: tl.constexpr,
                           X_PREQUANT: tl.constexpr, DOT_F32: tl.constexpr, USE_PDL: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    # partial_ptr: [SPLIT_K, 16, N (2N gated)] fp32, each program's sums; count_ptr: [cdiv(N, BLOCK_N)] int32, zero
    # between calls (the last program of a row tile resets its counter)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    let_next_kernel_launch(USE_PDL)
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    cols = tl.arange(0, BLOCK_K)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    x_rows = tl.arange(0, 16)
    x_row_mask = x_rows < M
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * w_row_stride + (k_start + cols)[None, :]
    up_offset = N.to(tl.int64) * w_row_stride
    # the first weight tile streams before the wait for x (PDL; no kernel of the step writes W)
    kk = k_start + cols
    k_mask = kk < k_end
    w = tl.load(w_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0, eviction_policy="evict_first")
    u = w
    if ACT != 0:
        u = tl.load(w_ptrs + up_offset, mask=row_mask[:, None] & k_mask[None, :], other=0.0,
                    eviction_policy="evict_first")
    wait_for_previous_kernel(USE_PDL)
    x, x_scale = _x_tile(x_ptr, x_row_stride, x_rows, x_row_mask, kk, k_mask, FP8_W, X_PREQUANT)
    acc = _tile_dot(w, x, x_scale, FP8_W, X_PREQUANT, DOT_F32)  # [BLOCK_N, 16]: column m for x's row m
    acc_up = acc
    if ACT != 0:
        acc_up = _tile_dot(u, x, x_scale, FP8_W, X_PREQUANT, DOT_F32)
    for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
        w_ptrs += BLOCK_K
        kk = k0 + cols
        k_mask = kk < k_end
        x, x_scale = _x_tile(x_ptr, x_row_stride, x_rows, x_row_mask, kk, k_mask, FP8_W, X_PREQUANT)
        w = tl.load(w_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0, eviction_policy="evict_first")
        acc += _tile_dot(w, x, x_scale, FP8_W, X_PREQUANT, DOT_F32)
        if ACT != 0:
            u = tl.load(w_ptrs + up_offset, mask=row_mask[:, None] & k_mask[None, :], other=0.0,
                        eviction_policy="evict_first")
            acc_up += _tile_dot(u, x, x_scale, FP8_W, X_PREQUANT, DOT_F32)
    out_mask = row_mask[:, None] & x_row_mask[None, :]
    out_ptrs = y_ptr + x_rows[None, :] * N + rows[:, None]  # y [M, N]
    if SPLIT_K == 1:
        _epilogue(acc, acc_up, w_scale_ptr, x_scale_ptr, x_rows, x_row_mask, out_ptrs, rows, row_mask, out_mask, N,
                  ACT, FP8_W, X_PREQUANT)
    else:
        split_stride = 2 * N if ACT != 0 else N
        tile = partial_ptr + x_rows[None, :] * split_stride + rows[:, None]  # split 0's [BLOCK_N, 16] sums
        tl.store(tile + pid_k * 16 * split_stride, acc, mask=out_mask)
        if ACT != 0:
            tl.store(tile + pid_k * 16 * split_stride + N, acc_up, mask=out_mask)
        # every thread's stores precede one thread's release of the counter (as CUTLASS's semaphores do)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            # the last of the row tile: the sums in split order, read from L2 where the others' stores are; then the
            # counter back to zero
            acc = tl.zeros_like(acc)
            acc_up = tl.zeros_like(acc_up)
            for split in tl.static_range(SPLIT_K):
                acc += tl.load(tile + split * 16 * split_stride, mask=out_mask, other=0.0, cache_modifier=".cg")
                if ACT != 0:
                    acc_up += tl.load(tile + split * 16 * split_stride + N, mask=out_mask, other=0.0,
                                      cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + pid_n, 0)
            _epilogue(acc, acc_up, w_scale_ptr, x_scale_ptr, x_rows, x_row_mask, out_ptrs, rows, row_mask, out_mask,
                      N, ACT, FP8_W, X_PREQUANT)


def split_k(tile: TcTile, n: int, k: int, device: torch.device) -> int:
    """tile.split_k, or for 0 the power of two that gives every SM two programs (at most one chunk each)."""
    if tile.split_k:
        return tile.split_k
    programs = 2 * (sm_count(device) if device.type == "cuda" else 4)
    split = 1
    while split * triton.cdiv(n, tile.block_n) < programs and split * 2 <= triton.cdiv(k, tile.block_k):
        split *= 2
    return split


_workspaces: dict = {}  # (device, splits, rows, tiles) -> (fp32 [splits * 16 * rows], int32 [tiles] zero between calls)


def _workspace(device: torch.device, splits: int, rows: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    # kept forever: a CUDA graph that captured a launch holds its pointers
    key = (str(device), splits, rows, tiles)
    if key not in _workspaces:
        _workspaces[key] = (torch.empty(splits * 16 * rows, dtype=torch.float32, device=device),
                            torch.zeros(tiles, dtype=torch.int32, device=device))
    return _workspaces[key]


def launch_small_batch_tc(tile: TcTile, x: torch.Tensor, weight: torch.Tensor, weight_scale: Optional[torch.Tensor],
                          y: torch.Tensor, n: int, k: int, activation: str,
                          x_scale: Optional[torch.Tensor] = None) -> None:
    """y [M, n] = act(x [M, k] @ weight^T) with no checks (the callers check); weight_scale: an e4m3 weight's fp32
    row scales (x rounded to e4m3 per chunk in the kernel), else None; x_scale: with an e4m3 weight, x is e4m3 already
    (quantize_rows) and these are its fp32 row scales [M]."""
    split = split_k(tile, n, k, x.device)
    tiles = triton.cdiv(n, tile.block_n)
    partial, count = _workspace(x.device, split, weight.shape[0], tiles) if split > 1 else (y, y)
    _small_batch_tc_kernel[(tiles, split)](
        x, y if x_scale is None else x_scale, weight, weight if weight_scale is None else weight_scale, y, partial,
        count, x.shape[0], n, k, x.stride(0), weight.stride(0), ACT=ACTIVATIONS[activation],
        FP8_W=weight_scale is not None, X_PREQUANT=x_scale is not None, DOT_F32=_INTERPRET and weight_scale is None,
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, SPLIT_K=split, num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        **pdl.launch_options(x.device))


def measured_tile(device: torch.device, rows: int, k: int, activation: str, x_rows: int) -> Optional[TcTile]:
    """The MEASURED_TILES tile for this CUDA device's name and shape when it was measured faster than cuBLAS at
    x_rows rows of x, or None."""
    found = gemv.measured_table(MEASURED_TILES, device).get((rows, k, activation))
    if found is None:
        return None
    tile, up_to_rows = found
    return tile if 2 <= x_rows <= up_to_rows else None


def small_batch_gemm_applies(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                             activation: str = "") -> bool:
    """Whether the runtime routes this matmul here: 2..16 rows of bf16/fp16 x on CUDA, a weight of x's dtype with unit
    stride along K, no bias, the decode GEMVs on (gemv.enabled(): ServerArgs.disable_decode_gemv), and a tile measured
    faster than cuBLAS for this GPU, shape and number of rows (MEASURED_TILES)."""
    return (gemv.enabled() and bias is None and x.is_cuda and x.dim() == 2 and 2 <= x.shape[0] <= MAX_ROWS
            and x.dtype in _HALF_DTYPES and weight.dim() == 2 and weight.dtype == x.dtype
            and x.shape[1] == weight.shape[1] and weight.stride(1) == 1 and x.device == weight.device
            and measured_tile(x.device, weight.shape[0], weight.shape[1], activation, x.shape[0]) is not None)


def small_batch_gemm(x: torch.Tensor, weight: torch.Tensor, *, activation: str = "",
                     tile: Optional[TcTile] = None) -> torch.Tensor:
    """x: [M, K], 1 <= M <= 16, bf16/fp16; weight: [N, K] of x's dtype ([2N, K] = [gate; up] with activation "silu"
    or "gelu") -> y [M, N] = act(x @ W^T). tile: a launch (benchmarks); by default the MEASURED_TILES entry for this
    GPU and shape, else DEFAULT_TILE. CUDA, or CPU tensors under TRITON_INTERPRET=1."""
    rows, k = weight.shape
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r}: one of {sorted(ACTIVATIONS)}")
    if not (x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.shape[1] == k and x.dtype in _HALF_DTYPES
            and weight.dtype == x.dtype and weight.stride(1) == 1 and x.device == weight.device
            and not (activation and rows % 2)):
        raise ValueError(f"small_batch_gemm needs x [1..{MAX_ROWS}, K] bf16/fp16 and a weight [N, K] ([2N, K] gated) "
                         f"of its dtype and device; got {tuple(x.shape)} {x.dtype}, {tuple(weight.shape)} "
                         f"{weight.dtype}, activation {activation!r}")
    x = x.contiguous()
    n = rows // 2 if activation else rows
    if tile is None:
        tile = _INTERPRET_TILE if _INTERPRET else measured_tile(x.device, rows, k, activation, x.shape[0]) or DEFAULT_TILE
    y = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    launch_small_batch_tc(tile, x, weight, None, y, n, k, activation)
    return y
