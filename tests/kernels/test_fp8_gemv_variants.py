"""The batch-1 fp8 GEMV variants (fp8_gemv.fp8_gemv: "f16", "tc", "tcq") against the fp32 matmul of the dequantized
weight with the unrounded x, within each variant's stated bound:

    |y - ref| <= C * sum_k |w_k x_k| + F * max|x| * sum_k |w_k| + the output's rounding,
    "f16" (fp16 products and group sums): C = (GROUP + 2) * 2**-11, F = GROUP * 2**-23;
    "tc" / "tcq" (x rounded to e4m3 per chunk / per row): C = 2**-4, F = 2**-10 / 448.

Small Llama-shaped cases (row counts and K not multiples of the tiles, SiLU-and-mul fused) run under
TRITON_INTERPRET=1 on CPU tensors (tests/kernels/conftest.py), compiled on a GPU; the `gpu` cases take the
Llama-3-8B shapes with each runtime candidate config, every e4m3 value through the f16 variant's dequantization and
CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch

from braid.runtime.layers.quantization import fp8_gemv as fp8_gemv_module
from braid.runtime.layers.quantization.fp8_gemv import (FP8_GEMV_VARIANTS, TENSOR_CORE_VARIANTS, Fp8GemvConfig,
                                                        fp8_gemv, fp8_gemv_candidates, fp8_gemv_error_excess)
from braid.runtime.layers.quantization.fp8_quantize import quantize_rows_triton, quantize_weight_per_channel

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
HAS_FP8_GPU = HAS_CUDA and torch.cuda.get_device_capability() >= (9, 0)
# the interpreter rounds fp32 -> bf16 toward zero (up to one bf16 step) and fp32 -> e4m3 up to one e4m3 step off
OUT_ROUNDING = 2 ** -8 if HAS_CUDA else 2 ** -7
TC_INTERPRETER_SLACK = 1 if HAS_CUDA else 2
LLAMA3_8B_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def error_bound(config: Fp8GemvConfig) -> tuple[float, float]:
    """The variant's (C, F); the tensor-core variants' doubled under the interpreter (its e4m3 rounding may be a step
    off)."""
    slack = TC_INTERPRETER_SLACK if config.variant in TENSOR_CORE_VARIANTS else 1
    return tuple(slack * term for term in config.error_bound)


def first_config(variant: str, **changes) -> Fp8GemvConfig:
    """The variant's first runtime candidate (under the interpreter: its small tile), with changes."""
    config = next(c for c in fp8_gemv_candidates() if c.variant == variant)
    return Fp8GemvConfig(**{**config.__dict__, **changes})


def make_case(rows, k, seed, x_scale=1.0, m=1):
    if HAS_CUDA and not HAS_FP8_GPU:
        pytest.skip("the fp8 GEMV variants need sm90 on CUDA (fp8 wgmma, e4m3x2 -> f16x2)")
    gen = torch.Generator(DEVICE).manual_seed(seed)  # made where they are used: the 8B shapes are big for a CPU
    x = (torch.randn(m, k, generator=gen, device=DEVICE) * x_scale).to(torch.bfloat16)
    w_q, w_scale = quantize_weight_per_channel(torch.randn(rows, k, generator=gen, device=DEVICE) * k ** -0.5)
    return x, w_q, w_scale


def check(y, x, w_q, w_scale, silu_mul, bound):
    """y within the worst-case bound (C, F) (+ the output's rounding) of the dequantized product, per output; and,
    as the bound is loose for random signs, a relative RMS error near the typical one (a 5% slip fails it)."""
    assert y.shape == (x.shape[0], w_q.shape[0] // 2 if silu_mul else w_q.shape[0])
    excess, _ = fp8_gemv_error_excess(y, x, w_q, w_scale, silu_mul, bound, out_rounding=OUT_ROUNDING)
    assert excess <= 1.0, excess
    ref = x.double() @ (w_q.double() * w_scale.double()[:, None]).t()
    if silu_mul:
        gate, up = ref.chunk(2, dim=-1)
        ref = torch.nn.functional.silu(gate) * up
    rms = (((y.double() - ref).norm(dim=1) / ref.norm(dim=1)) ** 2).mean().sqrt().item()  # rows weigh alike
    # e4m3 x: 2**-4 per value at most, ~2.4% RMS on y (the interpreter's rounding up to ~7%); silu(gate) * up
    # carries both factors' errors and silu's elasticity (up to ~1.3), ~3.8% measured on the H200; fp16 products:
    # ~2**-11 each, below the bf16 output's rounding
    e4m3_rms = (0.05 if silu_mul else 0.035) if HAS_CUDA else 0.1
    assert rms < (e4m3_rms if bound[0] >= 2 ** -4 else 0.01), rms


@pytest.mark.parametrize("variant", TENSOR_CORE_VARIANTS)
@pytest.mark.parametrize("m,rows,k,silu_mul", [(2, 96, 128, False), (5, 70, 200, False), (16, 2 * 40, 160, True)])
def test_tc_variant_takes_up_to_16_rows_of_x(variant, m, rows, k, silu_mul):
    """Small decode batches: x's rows are the tensor-core operand's columns, each row with its own e4m3 scales (per
    chunk in the kernel, or per row first: tcq); every row within the bound, and each row's result equals that row
    alone through the batch-1 kernel (the other rows change nothing, split-K partials included)."""
    x, w_q, w_scale = make_case(rows, k, seed=rows + k + m, m=m)
    x[1] *= 300.0  # rows of very different magnitudes: one shared scale would flush the small rows to zero
    config = first_config(variant)
    y = fp8_gemv(x, w_q, w_scale, silu_mul=silu_mul, config=config)
    assert y.dtype == torch.bfloat16
    check(y, x, w_q, w_scale, silu_mul, error_bound(config))
    for i in range(m):
        torch.testing.assert_close(y[i:i + 1], fp8_gemv(x[i:i + 1], w_q, w_scale, silu_mul=silu_mul, config=config),
                                   rtol=0, atol=0)
    assert fp8_gemv(x, w_q, w_scale, silu_mul=silu_mul).shape == y.shape  # the small-batch default tile


def test_more_than_one_row_takes_the_tc_variant_only():
    x, w_q, w_scale = make_case(96, 128, seed=3, m=4)
    with pytest.raises(ValueError, match="'tc' or 'tcq' variant only"):
        fp8_gemv(x, w_q, w_scale, config=first_config("f16"))
    x17, _, _ = make_case(96, 128, seed=3, m=17)
    with pytest.raises(ValueError, match="fp8_gemv needs"):
        fp8_gemv(x17, w_q, w_scale)


@pytest.mark.parametrize("variant", FP8_GEMV_VARIANTS)
@pytest.mark.parametrize("rows,k,silu_mul", [(96, 128, False), (70, 200, False), (2 * 40, 160, True)])
def test_fp8_gemv_variant_within_bound(variant, rows, k, silu_mul):
    # rows: qkv-like (96), not a multiple of the tc tile (70), gate_up halves of 40; K = 200 is no multiple of 32
    x, w_q, w_scale = make_case(rows, k, seed=rows + k)
    config = first_config(variant)
    y = fp8_gemv(x, w_q, w_scale, silu_mul=silu_mul, config=config)
    assert y.dtype == torch.bfloat16 and y.shape == (1, rows // 2 if silu_mul else rows)
    check(y, x, w_q, w_scale, silu_mul, error_bound(config))


def test_fp8_gemv_f16_scales_x_per_group():
    """x far outside fp16's range in some columns (products would overflow fp16 unscaled), tiny in others, and one
    outlier among ordinary values (products of a shared scale fall below fp16's normals: the floor F): each group
    of GROUP columns gets its own scale, so all stay within the bound."""
    x, w_q, w_scale = make_case(24, 96, seed=3)
    x[0, :32] *= 3e4
    x[0, 40] = 5e4
    x[0, 64:] *= 1e-6
    check(fp8_gemv(x, w_q, w_scale, config=first_config("f16")), x, w_q, w_scale, False,
          error_bound(first_config("f16")))


@pytest.mark.parametrize("variant", TENSOR_CORE_VARIANTS)
def test_fp8_gemv_tc_split_k_resets_its_counters(variant):
    """Split over K, the last program of each row tile sums the partials and resets its counter: a second call
    (another x) gives its own answer; an empty split (more splits than chunks) adds 0."""
    x, w_q, w_scale = make_case(70, 96, seed=5)
    x2 = x.flip(-1).contiguous()
    for split in (2, 4):
        config = first_config(variant, split_k=split)
        check(fp8_gemv(x, w_q, w_scale, config=config), x, w_q, w_scale, False, error_bound(config))
        check(fp8_gemv(x2, w_q, w_scale, config=config), x2, w_q, w_scale, False, error_bound(config))


@pytest.mark.parametrize("m,silu_mul", [(1, False), (4, False), (3, True)])
def test_tcq_is_the_product_of_x_quantized_per_row(m, silu_mul):
    """tcq = quantize_rows' e4m3 x and row scales (one launch), then the tensor-core kernel on them: its answer is that
    quantized x times the dequantized weight up to fp32 sums and the bf16 output's rounding, the row scales applied
    (rows 300x apart, a chunk of each row 1000x the rest)."""
    x, w_q, w_scale = make_case(2 * 48 if silu_mul else 96, 256, seed=11 + m, m=m)
    x[:, :32] *= 1000.0
    if m > 1:
        x[1] *= 300.0
    y = fp8_gemv(x, w_q, w_scale, silu_mul=silu_mul, config=first_config("tcq"))
    x_q, x_scale = quantize_rows_triton(x)
    ref = (x_q.double() * x_scale.double()) @ (w_q.double() * w_scale.double()[:, None]).t()
    if silu_mul:
        gate, up = ref.chunk(2, dim=-1)
        ref = torch.nn.functional.silu(gate.to(torch.bfloat16).double()) * up.to(torch.bfloat16).double()
    scale = ref.abs().amax(dim=1, keepdim=True)
    assert ((y.double() - ref).abs() / scale).max().item() < 2 ** -6


def test_fp8_gemv_refuses_bad_inputs():
    x, w_q, w_scale = make_case(16, 64, seed=1)
    with pytest.raises(ValueError, match="fp8_gemv needs"):
        fp8_gemv(x.repeat(1, 2)[:, ::2], w_q, w_scale)  # K not of unit stride
    with pytest.raises(ValueError, match="fp8_gemv needs"):
        fp8_gemv(x, w_q, w_scale[:8])
    with pytest.raises(ValueError, match="fp8_gemv needs"):
        fp8_gemv(x, w_q[:15], w_scale[:15], silu_mul=True)
    with pytest.raises(ValueError, match="variant"):
        Fp8GemvConfig("fp64", 4, 64)
    with pytest.raises(ValueError, match="block_n >= 64"):
        Fp8GemvConfig("tc", 16, 64)
    with pytest.raises(ValueError, match="group"):
        Fp8GemvConfig("f16", 4, 64, group=24)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs a CUDA GPU of sm90 (fp8 wgmma, e4m3x2 -> f16x2)")
@pytest.mark.parametrize("name", list(LLAMA3_8B_SHAPES))
def test_gpu_fp8_gemv_candidates_llama3_8b_shapes(name):
    rows, k = LLAMA3_8B_SHAPES[name]
    silu_mul = name == "gate_up"
    from triton.runtime.errors import OutOfResources

    x, w_q, w_scale = make_case(rows, k, seed=7)
    ran = set()
    for config in fp8_gemv_candidates():
        try:
            y = fp8_gemv(x, w_q, w_scale, silu_mul=silu_mul, config=config)
        except OutOfResources:  # over this GPU's shared memory: the autotuner skips it too
            continue
        check(y, x, w_q, w_scale, silu_mul, error_bound(config))
        ran.add(config.variant)
    assert ran == {c.variant for c in fp8_gemv_candidates()}, f"some variant ran no tile: {ran}"
    # the autotuned default is one of them
    check(fp8_gemv(x, w_q, w_scale, silu_mul=silu_mul), x, w_q, w_scale, silu_mul, error_bound(Fp8GemvConfig("tc", 64, 256)))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs a CUDA GPU of sm90")
def test_gpu_fp8_gemv_dequantizes_every_e4m3_value():
    """Each of the 254 non-NaN e4m3 bit patterns alone in its row, x all ones: y is that value within fp16 products
    and the bf16 output (2**-7), where a wrong conversion (the cvt of f16) is off by at least an e4m3 step (2**-3) or
    a power of two."""
    codes = torch.arange(256, dtype=torch.int32, device="cuda")
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)  # 0x7F / 0xFF are NaN in e4m3fn
    rows, k = codes.numel(), 256
    w_q = torch.zeros(rows, k, dtype=torch.uint8, device="cuda")
    w_q[torch.arange(rows, device="cuda"), torch.arange(rows, device="cuda")] = codes
    w_q = w_q.view(torch.float8_e4m3fn)
    x = torch.ones(1, k, dtype=torch.bfloat16, device="cuda")
    expected = codes.view(torch.float8_e4m3fn).float()
    y = fp8_gemv(x, w_q, torch.ones(rows, device="cuda"), config=Fp8GemvConfig("f16", 4, 256, group=16))
    torch.testing.assert_close(y.float()[0], expected, rtol=2 ** -7, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs a CUDA GPU of sm90")
@pytest.mark.parametrize("variant", FP8_GEMV_VARIANTS)
def test_gpu_fp8_gemv_in_a_cuda_graph(variant):
    """Replays with x changed in place give the eager answers, bit for bit (tc's split-K sums are added in split
    order, its counters left at zero each time)."""
    x, w_q, w_scale = make_case(4096, 4096, seed=9)
    config = next(c for c in fp8_gemv_candidates() if c.variant == variant)
    fp8_gemv(x, w_q, w_scale, config=config)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_gemv(x, w_q, w_scale, config=config)
    for seed in (1, 2, 3):
        x.copy_(torch.randn(1, 4096, generator=torch.Generator().manual_seed(seed)).to(x))
        graph.replay()
        torch.testing.assert_close(y, fp8_gemv(x, w_q, w_scale, config=config), rtol=0, atol=0)


def test_fp8_gemv_tuner_takes_the_fastest_within_its_bound(monkeypatch):
    """The autotuner's choice: candidates that raise (no shared memory for them) or land outside their error bound
    are dropped however fast; the fastest of the rest wins and is remembered per key."""
    import triton.testing

    wrong, broken, slow, fast = (Fp8GemvConfig("f16", 4, 64), Fp8GemvConfig("f16", 8, 64),
                                 Fp8GemvConfig("tc", 64, 64), Fp8GemvConfig("f16", 4, 128))
    times = {wrong: 1.0, slow: 9.0, fast: 3.0}
    current = []

    def run(config):
        if config is broken:
            raise RuntimeError("out of shared memory")
        current[:] = [config]

    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), times[current[0]])[1])
    key = ("test", 1, 2, False)
    chosen = fp8_gemv_module._tune(key, [wrong, broken, slow, fast], run, lambda c: 5.0 if c is wrong else 0.5)
    assert chosen is fast and fp8_gemv_module._tuned.pop(key) is fast
    with pytest.raises(RuntimeError, match="no fp8 GEMV config"):
        fp8_gemv_module._tune(key, [wrong, broken], run, lambda c: 5.0)



def distinct_tables(tables: dict) -> list[str]:
    """The device names of `tables`, the first of each distinct table only (a card may take another's rows)."""
    names, seen = [], []
    for name, table in tables.items():
        if table not in seen:
            names.append(name)
            seen.append(table)
    return names


@pytest.mark.parametrize("device_name", distinct_tables(fp8_gemv_module.MEASURED_FP8_GEMV_CONFIGS))
def test_measured_fp8_gemv_configs_are_valid_tiles_within_their_bound(device_name):
    """Every measured (device, shape) entry is one of fp8_gemv's configs and, run at its Llama-3-8B shape (under the
    interpreter rows cut to a few tiles and K to two chunks), within its error bound."""
    for (rows, k, silu_mul), config in fp8_gemv_module.MEASURED_FP8_GEMV_CONFIGS[device_name].items():
        assert isinstance(config, Fp8GemvConfig) and (rows, k) in LLAMA3_8B_SHAPES.values()
        if not HAS_CUDA:
            rows = 4 * config.block_n if silu_mul else 3 * config.block_n
            k = min(k, 2 * config.block_k)
        elif not HAS_FP8_GPU:
            continue
        x, w_q, w_scale = make_case(rows, k, seed=rows + k)
        check(fp8_gemv(x, w_q, w_scale, silu_mul=silu_mul, config=config), x, w_q, w_scale, silu_mul,
              error_bound(config))


def test_measured_fp8_gemv_config_by_device_name_and_shape(monkeypatch):
    """A listed device and shape give the entry; another device, shape or a CPU tensor nothing (fp8_gemv then tunes)."""
    from braid.runtime.layers import device_info
    from braid.runtime.layers import gemv as gemv_module

    monkeypatch.setattr(gemv_module, "_INTERPRET", False)
    names = {0: "NVIDIA H200", 1: "NVIDIA A100-SXM4-80GB", 2: "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(device_info, "_NAMES", names)
    h200 = fp8_gemv_module.MEASURED_FP8_GEMV_CONFIGS["NVIDIA H200"]
    measured = fp8_gemv_module.measured_fp8_gemv_config
    assert measured(torch.device("cuda", 0), 4096, 14336, False) == h200[(4096, 14336, False)]
    assert measured(torch.device("cuda", 0), 28672, 4096, True) == h200[(28672, 4096, True)]
    assert measured(torch.device("cuda", 0), 28672, 4096, False) is None
    assert measured(torch.device("cuda", 1), 4096, 14336, False) is None
    # the H100 runs the H200's rows (measured faster end to end there than its own sweep's or its tuning's)
    assert measured(torch.device("cuda", 2), 6144, 4096, False) == h200[(6144, 4096, False)]
    assert measured(torch.device("cpu"), 4096, 14336, False) is None
