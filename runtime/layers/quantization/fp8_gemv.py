"""Decode matmuls on e4m3 weights with one fp32 scale per row: y[M, N] = act(x[M, K] @ (W * scale[:, None])^T) for
1..16 rows of x (decode batches), one Triton launch that streams W once, SiLU-and-mul fusable.

- `fp8_gemv`: at one row of x the fastest of the variants below for the shape (measured_tiles.FP8_GEMV_CONFIGS, else
  timed on first use), at 2..16 rows a tensor-core variant (measured_tiles.FP8_SMALL_BATCH_CONFIGS, else
  SMALL_BATCH_TC_CONFIG). At these sizes a decode step is a stream over the weights, which quantize_rows +
  torch._scaled_mm (fp8_quantize.py) streams slower than these kernels.
- `fp8_gemv_rotary_store`: the batch-1 GEMV of a decode step's qkv projection with rotary and the KV write as its
  epilogue (gemv.py's, on the "f16" products), where the pool lets a kernel write the cache.

At batch 1 a step streams the weights once, so the GEMV must keep up with HBM: on an H200 ~16 weight bytes per clock
per SM, i.e. 16 e4m3 values. Upcasting every value to fp32 (gemv.py's kernel with weight_scale: e4m3 -> f16x2 -> two
f32, one FFMA each, and a [BLOCK_N, BLOCK_K] fp32 accumulator) costs ~2.6 instructions per value and streams too slowly.
The variants (FP8_GEMV_VARIANTS):
  "f16"  e4m3 pairs -> f16x2 (one cvt per two values on sm_90), products and sums of GROUP products in packed fp16,
         each group sum added to an fp32 accumulator [BLOCK_N, BLOCK_K / GROUP]; ~1.6 instructions per value, ~60
         registers. x is scaled per group of GROUP columns to max |x| = 145 / GROUP so that no fp16 product or group
         sum can overflow (|e4m3| <= 448, 448 * 145 < 65504), and unscaled in fp32. One program per BLOCK_N rows.
  "tc"   tensor cores (small_batch_gemm.py's kernel, x's rows as the dot's columns): x rounded to e4m3 per BLOCK_K
         chunk (its own scale) in the kernel, fp8 x fp8 wgmma of a [BLOCK_N >= 64, BLOCK_K] weight tile, fp32
         accumulators; the weight goes global -> shared -> tensor core with no per-value instruction. BLOCK_N = 64
         leaves too few programs for N = 4096, so K is split over SPLIT_K programs that store their partial sums in an
         fp32 workspace; the last program of a row tile (told by an atomic counter) adds them in split order
         (deterministic), applies scales and activation, writes y and zeroes the counter for the next call.
  "tcq"  "tc" on x quantized to e4m3 per row by quantize_rows (one launch of its own, PDL) instead of per chunk inside
         the weight loop, whose max-reduction and divide per chunk sit between the weight loads and the dots; x's row
         scales are applied in the epilogue. Within tc's bound: a row's max |x| bounds every chunk's.
All keep PDL (the first weight chunk streams before the wait for x) and fuse SiLU-and-mul for a [gate; up] weight.

Error against the fp32 matmul of the dequantized weight with the unrounded x (Fp8GemvConfig.error_bound, checked by
tests/kernels/test_fp8_gemv_variants.py and by the tuner): |y - ref| <= C * sum_k |w_k x_k| + F * max|x| * sum_k |w_k|
(+ the output's own rounding), C the relative rounding of the path, F the absolute floor of values too small for the
format. "f16" rounds each product and partial group sum to fp16: C = (GROUP + 2) * 2**-11, F = GROUP * 2**-23 (a
product below fp16's normals is off by up to 2**-25 <= 2**-16 |w| in the group's scale, 145 / GROUP at the group's max
|x| <= max|x|; sums there are exact). "tc" / "tcq" round x to e4m3: C = 2**-4, F = 2**-10 / 448 (half of e4m3's
smallest subnormal at the chunk's scale).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from braid.runtime.layers import measured_tiles, pdl
from braid.runtime.layers.gemv import (fp8_supports, measured_table, rotary_store_args, rotary_store_pair,
                                       rotary_store_program, store_v_row)
from braid.runtime.layers.pdl import let_next_kernel_launch, wait_for_previous_kernel
from braid.runtime.layers.quantization.fp8_quantize import FP8_DTYPE, FP8_MAX, quantize_rows_triton
from braid.runtime.layers.small_batch_gemm import (MAX_ROWS as SMALL_BATCH_MAX_ROWS, TcTile,
                                                   launch_small_batch_tc)

logger = logging.getLogger(__name__)

__all__ = ["SMALL_BATCH_MAX_ROWS", "FP8_GEMV_VARIANTS", "TENSOR_CORE_VARIANTS", "Fp8GemvConfig", "fp8_gemv_candidates",
           "fp8_gemv", "fp8_gemv_rotary_store", "fp8_gemv_error_excess"]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

FP8_GEMV_VARIANTS = ("f16", "tc", "tcq")
TENSOR_CORE_VARIANTS = ("tc", "tcq")  # small_batch_gemm.py's kernel: x's rows as the dot's columns


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _f16_group_sums(w, xs, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """w: [BLOCK_N, BLOCK_K] e4m3; xs: [BLOCK_K] fp16 -> [BLOCK_N, BLOCK_K // GROUP] fp16 sums of GROUP products."""
    products = w.to(tl.float16) * xs[None, :]
    return tl.reduce(tl.reshape(products, [BLOCK_N, BLOCK_K // GROUP, GROUP]), 2, _add)


@triton.jit
def _f16_chunk(w, u, x, acc, acc_up, SILU_MUL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               GROUP: tl.constexpr):
    """One BLOCK_K chunk: x [BLOCK_K] fp32 scaled into fp16 per group of GROUP columns so that the group's |x| <= 145
    / GROUP (448 * 145 < 65504: no product or group sum overflows), products summed by groups in fp16, each group sum
    unscaled into acc [BLOCK_N, BLOCK_K // GROUP] fp32. A group's columns sit in one or two threads, so its max takes
    at most one shuffle; one scale for the chunk would take a reduction across warps (shuffles, a shared-memory round
    trip, a barrier) every chunk, which measured slower on an H100."""
    x_groups = tl.reshape(x, [BLOCK_K // GROUP, GROUP])
    group_max = tl.maximum(tl.max(tl.abs(x_groups), axis=1), 1e-30)  # [BLOCK_K // GROUP]
    x_scale = (145.0 / GROUP) / group_max
    unscale = (group_max * (GROUP / 145.0))[None, :]
    xs = tl.reshape(x_groups * x_scale[:, None], [BLOCK_K]).to(tl.float16)
    acc += _f16_group_sums(w, xs, BLOCK_N, BLOCK_K, GROUP).to(tl.float32) * unscale
    if SILU_MUL:
        acc_up += _f16_group_sums(u, xs, BLOCK_N, BLOCK_K, GROUP).to(tl.float32) * unscale
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
                  EVEN_K: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """rows, row_mask: [R] -> (x . W[rows], x . W[rows + pair_offset] when PAIRED), each [R] fp32 before the row
    scales. Waits for the previous kernel (PDL) after loading the first weight chunk. (Software-pipelining the weight
    loop through shared memory, tl.range with num_stages=3, measured slower on an H100.)"""
    R: tl.constexpr = rows.shape[0]
    # cols: 0..BLOCK_K-1 written as runs of 8, so that the compiler loads 8 weight bytes a thread, the columns of
    # one 16-byte load of x, and loads x in the products' layout (with 16-byte weight loads x went through shared
    # memory with barriers every chunk; without them the loop is barrier-free)
    cols = tl.arange(0, BLOCK_K) // 8 * 8 + tl.arange(0, BLOCK_K) % 8
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * w_row_stride
    pair_rows = w_rows + w_row_stride.to(tl.int64) * pair_offset
    # the first weight chunk: no kernel of the step writes W, so it streams before the wait for x
    w_mask = row_mask[:, None] if EVEN_K else row_mask[:, None] & (cols < K)[None, :]
    w = tl.load(w_rows + cols[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
    u = w
    if PAIRED:
        u = tl.load(pair_rows + cols[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
    wait_for_previous_kernel(USE_PDL)
    acc = tl.zeros((R, BLOCK_K // GROUP), dtype=tl.float32)
    acc_pair = tl.zeros((R, BLOCK_K // GROUP), dtype=tl.float32)
    x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    acc, acc_pair = _f16_chunk(w, u, x, acc, acc_pair, PAIRED, R, BLOCK_K, GROUP)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + cols
        w_mask = row_mask[:, None] if EVEN_K else row_mask[:, None] & (kk < K)[None, :]
        w = tl.load(w_rows + kk[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
        if PAIRED:
            u = tl.load(pair_rows + kk[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
        x = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        acc, acc_pair = _f16_chunk(w, u, x, acc, acc_pair, PAIRED, R, BLOCK_K, GROUP)
    return tl.sum(acc, axis=1), tl.sum(acc_pair, axis=1)


@triton.jit
def _fp8_gemv_rotary_store_kernel(x_ptr, w_ptr, w_scale_ptr, q_ptr, pos_ptr, cos_sin_ptr, cos_sin_stride, loc_ptr,
                                  k_cache_ptr, v_cache_ptr, k_cache_stride, v_cache_stride, K, w_row_stride,
                                  NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                                  V_WIDTH: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr,
                                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """gemv.py's qkv GEMV with rotary and the KV write as its epilogue, on an e4m3 weight with row scales (the "f16"
    products): the first programs each own BLOCK_N / 2 rows of a q or k head's first half and the rows HEAD_DIM / 2
    further, the rest BLOCK_N rows of v."""
    let_next_kernel_launch(USE_PDL)
    is_qk, head, pairs, v_cols, v_mask = rotary_store_program(tl.program_id(0), NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM,
                                                              V_WIDTH, BLOCK_N)
    if is_qk:
        rows = head * HEAD_DIM + pairs
        y1, y2 = _f16_row_sums(rows, rows >= 0, HEAD_DIM // 2, x_ptr, w_ptr, K, w_row_stride, True, EVEN_K, USE_PDL,
                               BLOCK_K, GROUP)
        y1 = y1 * tl.load(w_scale_ptr + rows)
        y2 = y2 * tl.load(w_scale_ptr + HEAD_DIM // 2 + rows)
        rotary_store_pair(y1, y2, head, pairs, q_ptr, pos_ptr, cos_sin_ptr, cos_sin_stride, loc_ptr, k_cache_ptr,
                          k_cache_stride, NUM_Q_HEADS, HEAD_DIM)
    else:
        v_rows = (NUM_Q_HEADS + NUM_KV_HEADS) * HEAD_DIM + v_cols
        y, _ = _f16_row_sums(v_rows, v_mask, 0, x_ptr, w_ptr, K, w_row_stride, False, EVEN_K, USE_PDL, BLOCK_K,
                             GROUP)
        y = y * tl.load(w_scale_ptr + v_rows, mask=v_mask, other=0.0)
        store_v_row(y, v_cols, v_mask, loc_ptr, v_cache_ptr, v_cache_stride, q_ptr.dtype.element_ty)


@triton.jit
def _fp8_gemv_f16_kernel(x_ptr, w_ptr, w_scale_ptr, y_ptr, N, K, w_row_stride, SILU_MUL: tl.constexpr,
                         EVEN_K: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP: tl.constexpr):
    # program pid: rows [pid * BLOCK_N, +BLOCK_N) (and the up rows N further with SILU_MUL), all of K
    let_next_kernel_launch(USE_PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    y, y_up = _f16_row_sums(rows, row_mask, N, x_ptr, w_ptr, K, w_row_stride, SILU_MUL, EVEN_K, USE_PDL, BLOCK_K,
                            GROUP)
    _scaled_activation_store(y, y_up, w_scale_ptr, y_ptr + rows, rows, row_mask, row_mask, N, SILU_MUL)


@dataclasses.dataclass(frozen=True)
class Fp8GemvConfig:
    """One launch of fp8_gemv: the variant (FP8_GEMV_VARIANTS) and its tile. group: products summed in fp16 per
    fp32 add ("f16"); split_k: programs per row tile along K ("tc", "tcq"; 0: enough for two per SM)."""
    variant: str
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group: int = 16
    split_k: int = 1

    def __post_init__(self):
        if self.variant not in FP8_GEMV_VARIANTS:
            raise ValueError(f"fp8 GEMV variant {self.variant!r}: one of {FP8_GEMV_VARIANTS}")
        if self.variant in TENSOR_CORE_VARIANTS:
            _ = self.tile  # small_batch_gemm.TcTile's checks (block_n >= 64 keeps the fp8 wgmma)
        if self.variant not in TENSOR_CORE_VARIANTS and (self.group < 1 or self.block_k % self.group):
            raise ValueError(f"group {self.group} must divide block_k {self.block_k}")

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
        return [Fp8GemvConfig("f16", 4, 32, 1, 1, group=8), Fp8GemvConfig("tc", 64, 32, 4, 1, split_k=0),
                Fp8GemvConfig("tcq", 64, 32, 4, 1, split_k=0)]
    # tiles of 8-16 KB per load and about 60 registers (f16), fp8 wgmma tiles of 16-32 KB per stage (tc);
    # benchmarks/gpu/fp8_gemv_variants.py sweeps wider and prints the measured winners per Llama-3-8B shape
    return [Fp8GemvConfig("f16", 4, 2048, 4, 3, group=16), Fp8GemvConfig("f16", 8, 1024, 4, 3, group=16),
            Fp8GemvConfig("f16", 4, 1024, 4, 4, group=8), Fp8GemvConfig("f16", 8, 2048, 8, 3, group=16),
            Fp8GemvConfig("tc", 64, 256, 4, 4, split_k=0), Fp8GemvConfig("tc", 64, 512, 4, 3, split_k=0),
            Fp8GemvConfig("tc", 128, 256, 4, 3, split_k=0), Fp8GemvConfig("tcq", 64, 256, 4, 4, split_k=0)]


def _configs(table: dict) -> dict:
    """A measured_tiles table of Fp8GemvConfig keywords -> the same table of Fp8GemvConfigs."""
    return {gpu: {shape: Fp8GemvConfig(**config) for shape, config in entries.items()}
            for gpu, entries in table.items()}


# one row of x: per GPU name and (weight rows, K, SiLU-and-mul fused), the measured fastest config; shapes not listed
# are tuned on first use (_tune's do_bench times one launch with L2 flushed, which picks slower tiles for most shapes
# than a decode step's chained graph does)
MEASURED_FP8_GEMV_CONFIGS = _configs(measured_tiles.FP8_GEMV_CONFIGS)
# 2..16 rows of x: the tensor-core config per GPU name and shape; shapes not listed take SMALL_BATCH_TC_CONFIG
MEASURED_FP8_SMALL_BATCH_CONFIGS = _configs(measured_tiles.FP8_SMALL_BATCH_CONFIGS)
SMALL_BATCH_TC_CONFIG = Fp8GemvConfig("tc", 64, 256, 4, 4, split_k=0)


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
        _fp8_gemv_f16_kernel[(triton.cdiv(n, config.block_n),)](
            x, weight, weight_scale, y, n, k, weight.stride(0), SILU_MUL=silu_mul, EVEN_K=k % config.block_k == 0,
            BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP=config.group, **launch)


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
    one, else the first candidate; or `config`) is no "f16" tile whose BLOCK_N / 2 rows divide a half head."""
    if not fp8_supports(x, weight, weight_scale):
        return None
    rows, k = weight.shape
    if config is None:
        config = (_tuned.get(_tuned_key(x, rows, k, False))
                  or measured_fp8_gemv_config(x.device, rows, k, False) or fp8_gemv_candidates()[0])
    half = epilogue.head_dim // 2
    if config.variant != "f16" or config.block_n % 2 or half % (config.block_n // 2):
        return None
    found = rotary_store_args(x, weight, epilogue)
    if found is None:
        return None
    q, args, shape, programs = found
    _fp8_gemv_rotary_store_kernel[(programs(config.block_n),)](
        args[0], weight, weight_scale, *args[2:], **shape, EVEN_K=k % config.block_k == 0, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, GROUP=config.group, num_warps=config.num_warps, num_stages=config.num_stages)
    return q


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *, silu_mul: bool = False,
             config: Optional[Fp8GemvConfig] = None) -> torch.Tensor:
    """x: [M, K] bf16/fp16, 1 <= M <= 16; weight: e4m3 [N, K] (or [2N, K] = [gate; up] with silu_mul), unit stride
    along K; weight_scale: fp32 [rows] -> y [M, N] = act(x @ (weight * weight_scale[:, None])^T) in x's dtype.

    config: one variant and tile (benchmarks; M > 1 takes "tc" or "tcq" only). By default, at M = 1 the
    MEASURED_FP8_GEMV_CONFIGS entry for this GPU and shape, else the fastest of fp8_gemv_candidates() timed on its
    first call (the CUDA-graph runner's warm-up passes make it before capture); at M > 1 the tensor-core config of
    MEASURED_FP8_SMALL_BATCH_CONFIGS, else SMALL_BATCH_TC_CONFIG. CUDA, or CPU tensors under TRITON_INTERPRET=1
    (there the first candidate, or config)."""
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
