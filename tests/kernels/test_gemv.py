"""The batch-1 Triton GEMV (plain, with SiLU-and-mul fused after it) vs the unfused layers (F.linear,
SiluAndMul.forward_native), and the switches that route matmuls to it and launch it with PDL.

Small shapes run compiled on a GPU when there is one, else under TRITON_INTERPRET=1 on CPU tensors; the
`gpu` cases use Llama-3-8B shapes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from braid.runtime.config import ServerArgs
from braid.runtime.layers import device_info, pdl
from braid.runtime.layers.activation import SiluAndMul
from braid.runtime.layers import gemv as gemv_module
from braid.runtime.layers.gemv import decode_gemv_applies, gemv
from braid.runtime.layers.kernel_switches import kernel_switches_applied

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


def rel_err(out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype, ref.dtype)
    assert torch.isfinite(out.float()).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def tensors(rows, k, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=gen).to(device=device, dtype=dtype)
    w = (torch.randn(rows, k, generator=gen) / k ** 0.5).to(device=device, dtype=dtype)
    return x, w


def reference(x, w, silu):
    """The unfused path in float64 from the same rounded inputs, rounded where the layers round."""
    y = F.linear(x.double(), w.double()).to(x.dtype)
    if silu:
        y = SiluAndMul().forward_native(y.double()).to(x.dtype)
    return y


@pytest.mark.parametrize("n,k", [(48, 64), (37, 200), (5, 1), (16, 576)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("silu", [False, True])
def test_gemv_matches_unfused_layers(n, k, dtype, silu):
    x, w = tensors(2 * n if silu else n, k, dtype, DEVICE, n * 1000 + k)
    got = gemv(x, w, silu_mul=silu)
    # bf16: the GEMV accumulates in fp32 where the reference is float64; the interpreter truncates to bf16 at
    # each rounding point where the GPU rounds to nearest
    assert rel_err(got, reference(x, w, silu)) < (1e-5 if dtype == torch.float32 else 1e-2 if HAS_CUDA else 4e-2)


def test_gemv_rejects_bad_shapes():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="x \\[1, K\\]"):
        gemv(x, torch.randn(4, 8))
    with pytest.raises(ValueError, match="2N"):
        gemv(x[:1], torch.randn(5, 8), silu_mul=True)


def test_decode_gemv_applies_only_to_batch1_half_cuda():
    w = torch.randn(4, 8, dtype=torch.bfloat16)
    assert not decode_gemv_applies(torch.randn(1, 8, dtype=torch.bfloat16), w)  # CPU tensors
    if HAS_CUDA:
        wc = w.cuda()
        assert decode_gemv_applies(torch.randn(1, 8, dtype=torch.bfloat16, device="cuda"), wc)
        assert not decode_gemv_applies(torch.randn(2, 8, dtype=torch.bfloat16, device="cuda"), wc)
        assert not decode_gemv_applies(torch.randn(1, 8, device="cuda"), wc.float())
        assert not decode_gemv_applies(torch.randn(1, 8, dtype=torch.bfloat16, device="cuda"), wc,
                                       torch.zeros(4, dtype=torch.bfloat16, device="cuda"))


@pytest.mark.gpu
def test_gpu_disable_decode_gemv_routes_batch1_to_cublas(monkeypatch):
    """ServerArgs.disable_decode_gemv through apply_kernel_switches: a batch-1 bf16 Linear stops calling the GEMV."""
    from braid.runtime.layers import gemv as gemv_module
    from braid.runtime.layers.linear import Linear

    calls = []
    real = gemv_module.gemv
    monkeypatch.setattr(gemv_module, "gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    lin = Linear(64, 32).to(device="cuda", dtype=torch.bfloat16)
    lin.weight.data.normal_()
    x = torch.randn(1, 64, device="cuda", dtype=torch.bfloat16)
    with kernel_switches_applied(ServerArgs()):
        on = lin(x)
    assert calls == [1]
    with kernel_switches_applied(ServerArgs(disable_decode_gemv=True)):
        assert not decode_gemv_applies(x, lin.weight)
        off = lin(x)
    assert calls == [1]
    torch.testing.assert_close(on, off, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,silu", [(6144, 4096, False), (4096, 4096, False), (14336, 4096, True),
                                      (4096, 14336, False), (128256, 4096, False)])
def test_gpu_gemv_llama3_8b_shapes(n, k, silu):
    x, w = tensors(2 * n if silu else n, k, torch.bfloat16, "cuda", n + k)
    assert rel_err(gemv(x, w, silu_mul=silu), reference(x, w, silu)) < 1e-2


@pytest.mark.gpu
def test_gpu_pdl_chain_in_cuda_graph_matches_without_pdl():
    """A decode-shaped chain (add+RMSNorm -> GEMV -> GEMV(SiLU) -> GEMV, repeated) where every kernel reads
    the one before's output: captured and replayed with programmatic dependent launch it must give the
    bit-identical result of the same kernels launched without it."""
    from braid.runtime.layers.norm_kernels import fused_add_rmsnorm

    gen = torch.Generator(device="cuda").manual_seed(0)
    k, inter = 4096, 14336
    layers = [((torch.randn(6144, k, device="cuda", generator=gen) / k ** 0.5).bfloat16(),
               (torch.randn(2 * inter, k, device="cuda", generator=gen) / k ** 0.5).bfloat16(),
               (torch.randn(k, inter, device="cuda", generator=gen) / inter ** 0.5).bfloat16()) for _ in range(4)]
    norm_w = torch.rand(k, device="cuda", generator=gen).bfloat16() + 0.5
    x0 = torch.randn(1, k, device="cuda", generator=gen).bfloat16()

    def chain(x):
        residual = torch.zeros_like(x)
        for qkv, gate_up, down in layers:
            h, residual = fused_add_rmsnorm(x, residual, norm_w, 1e-5)
            q = gemv(h, qkv)
            x = gemv(gemv(h + q[:, :k], gate_up, silu_mul=True), down)
        return x + residual

    with kernel_switches_applied(ServerArgs(disable_pdl=True)):
        want = chain(x0)
    with kernel_switches_applied(ServerArgs()):
        assert pdl.enabled(x0.device) == (torch.cuda.get_device_capability() >= (9, 0))
        static_x = x0.clone()
        chain(static_x)  # compile and autotune outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(static_x)
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want)


def test_pdl_launch_options_only_where_the_gpu_has_it():
    assert pdl.launch_options(torch.device("cpu")) == {"USE_PDL": False}
    with kernel_switches_applied(ServerArgs(disable_pdl=True)):
        assert not pdl.enabled(torch.device("cuda", 0))
    if HAS_CUDA:
        with kernel_switches_applied(ServerArgs()):
            hopper = torch.cuda.get_device_capability() >= (9, 0)
            assert pdl.enabled(torch.device("cuda")) == hopper
            assert pdl.launch_options(torch.device("cuda")) == (
                {"USE_PDL": True, "launch_pdl": True} if hopper else {"USE_PDL": False})


def test_kernel_switches_follow_server_args_and_restore():
    from braid.runtime.layers import cpu_gemm
    from braid.runtime.layers import gemv as gemv_module

    off = ServerArgs(disable_pdl=True, disable_decode_gemv=True, disable_cpu_prepack=True,
                     disable_cpu_malloc_tuning=True)
    with kernel_switches_applied(ServerArgs()):
        with kernel_switches_applied(off):
            assert not gemv_module.enabled() and not cpu_gemm.prepack_enabled()
            assert pdl.set_enabled(False) is False  # set_enabled returns the setting it replaces
        assert gemv_module.enabled() and pdl.set_enabled(True) is True


@pytest.mark.parametrize("device_name", list(gemv_module.MEASURED_CONFIGS))
def test_measured_configs_compute_their_shapes(device_name):
    """Every measured (device, shape) config gives the unfused layers' result at its K (rows cut to a few tiles on
    the CPU's interpreter; the whole shape compiled on a GPU)."""
    for (rows, k, activation), (bn, bk, warps, stages, *programs) in gemv_module.MEASURED_CONFIGS[device_name].items():
        assert activation in ("", "silu", "gelu") and bk & (bk - 1) == 0 and bn & (bn - 1) == 0
        if not HAS_CUDA:
            rows = 4 * bn if activation else 3 * bn
        x, w = tensors(rows, k, torch.bfloat16, DEVICE, rows + k)
        config = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, PROGRAMS=programs[0] if programs else 0)
        got = gemv(x, w, silu_mul=activation == "silu", gelu_tanh_mul=activation == "gelu", config=config)
        if activation == "gelu":
            gate, up = F.linear(x.double(), w.double()).to(x.dtype).chunk(2, dim=-1)
            ref = (F.gelu(gate.double(), approximate="tanh").to(x.dtype).double() * up.double()).to(x.dtype)
        else:
            ref = reference(x, w, activation == "silu")
        assert rel_err(got, ref) < (1e-2 if HAS_CUDA else 4e-2)


def test_measured_config_by_device_name_and_shape(monkeypatch):
    """A listed device and shape give the entry as gemv's config; another device, shape or activation, or a CPU
    tensor, nothing (gemv then autotunes)."""
    monkeypatch.setattr(gemv_module, "_INTERPRET", False)
    monkeypatch.setattr(device_info, "_NAMES", {0: "NVIDIA H200", 1: "NVIDIA A100-SXM4-80GB"})
    bn, bk, warps, stages = gemv_module.MEASURED_CONFIGS["NVIDIA H200"][(3584, 4096, "")]
    assert gemv_module.measured_config(torch.device("cuda", 0), 3584, 4096, "") == dict(
        BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    assert gemv_module.measured_config(torch.device("cuda", 0), 28672, 3584, "gelu")["BLOCK_K"] == 512
    assert gemv_module.measured_config(torch.device("cuda", 0), 28672, 3584, "silu") is None
    assert gemv_module.measured_config(torch.device("cuda", 1), 3584, 4096, "") is None
    assert gemv_module.measured_config(torch.device("cpu"), 3584, 4096, "") is None


def test_measured_table_reads_in_a_compiled_region_without_a_graph_break(monkeypatch):
    """torch.compile'd decode (--enable-torch-compile) calls the GEMV dispatch in the compiled region: the table
    lookup and the SM count (split-K grids) must trace as constants once device_info holds them (fullgraph raises on
    a graph break)."""
    monkeypatch.setattr(gemv_module, "_INTERPRET", False)
    monkeypatch.setattr(device_info, "_NAMES", {0: "NVIDIA H200"})
    monkeypatch.setattr(device_info, "_SM_COUNTS", {0: 132})
    tables = {"NVIDIA H200": {(8, 16, ""): (4, 16, 1, 1)}}

    def step(x):
        found = gemv_module.measured_table(tables, torch.device("cuda", 0)).get((8, 16, ""))
        return x * found[0] + device_info.sm_count(torch.device("cuda", 0))

    torch._dynamo.reset()
    assert torch.compile(step, fullgraph=True, backend="eager")(torch.ones(2)).tolist() == [136.0, 136.0]


@pytest.mark.parametrize("rows,k,programs,silu", [(40, 64, 3, False), (37, 200, 2, True), (64, 96, 16, False)])
def test_persistent_grid_takes_every_row_block(rows, k, programs, silu):
    """config PROGRAMS: that many programs take the BLOCK_N-row blocks in turn (fewer programs than blocks, a count
    that does not divide them, more programs than blocks): the same result as one program per block."""
    x, w = tensors(2 * rows if silu else rows, k, torch.float32, DEVICE, rows + k)
    base = dict(BLOCK_N=4, BLOCK_K=32, num_warps=1, num_stages=1)
    one_per_block = gemv(x, w, silu_mul=silu, config=base)
    persistent = gemv(x, w, silu_mul=silu, config={**base, "PROGRAMS": programs})
    torch.testing.assert_close(persistent, one_per_block, rtol=0, atol=0)
    assert rel_err(persistent, reference(x, w, silu)) < 1e-5


def test_measured_config_may_name_a_persistent_grid(monkeypatch):
    monkeypatch.setattr(gemv_module, "_INTERPRET", False)
    monkeypatch.setattr(device_info, "_NAMES", {0: "NVIDIA H200"})
    monkeypatch.setitem(gemv_module.MEASURED_CONFIGS, "NVIDIA H200", {(64, 32, ""): (4, 32, 1, 1, 264)})
    assert gemv_module.measured_config(torch.device("cuda", 0), 64, 32, "")["PROGRAMS"] == 264
