"""The oneDNN-prepacked CPU linear path: used after prepack, numerically F.linear, clean fallbacks."""

import pytest
import torch
import torch.nn.functional as F

from braid.runtime.config import ServerArgs
from braid.runtime.layers import cpu_gemm
from braid.runtime.layers.embedding import LMHead
from braid.runtime.layers.kernel_switches import kernel_switches_applied
from braid.runtime.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear

pytestmark = pytest.mark.skipif(not cpu_gemm.prepack_available(), reason="torch build without oneDNN linear prepack")

MS = [1, 2, 3, 7, 17, 32, 33, 100, 257]


def _filled(module, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.weight = torch.nn.Parameter(torch.randn(module.weight.shape, generator=g) * 0.05, requires_grad=False)
        if bias:
            module.bias = torch.nn.Parameter(torch.randn(module.bias.shape, generator=g), requires_grad=False)
    return module


def _count_packed_calls(monkeypatch):
    calls = []
    real = cpu_gemm.PackedLinearWeight.__call__

    def spy(self, x, bias=None):
        calls.append(tuple(x.shape))
        return real(self, x, bias)

    monkeypatch.setattr(cpu_gemm.PackedLinearWeight, "__call__", spy)
    return calls


@pytest.mark.parametrize("in_f,out_f,bias", [(576, 960, False), (77, 131, True), (1536, 576, False)])
def test_packed_linear_is_used_and_matches_f_linear(monkeypatch, in_f, out_f, bias):
    lin = _filled(Linear(in_f, out_f, bias=bias), bias=bias)
    lin.prepack_weights()
    assert lin.cpu_packed_weight is not None
    calls = _count_packed_calls(monkeypatch)
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for m in MS:
            x = torch.randn(m, in_f, generator=g)
            got = lin(x)
            want = F.linear(x, lin.weight, lin.bias)
            ref = F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
            assert got.shape == want.shape == (m, out_f)
            # as close to the exact result as the BLAS path is (both are fp32 sums of in_f products)
            scale = 1.0 + ref.abs().max().item()
            assert (got.double() - ref).abs().max().item() <= 2e-6 * scale * max(1.0, in_f / 256)
            assert (got - want).abs().max().item() <= 2e-6 * scale * max(1.0, in_f / 256)
    assert len(calls) == len(MS)


def test_row_parallel_and_column_parallel_use_the_packed_path(monkeypatch):
    col = _filled(ColumnParallelLinear(64, [48, 16]))
    row = _filled(RowParallelLinear(64, 40, bias=True), bias=True)
    for m in (col, row):
        m.prepack_weights()
    calls = _count_packed_calls(monkeypatch)
    x = torch.randn(5, 64)
    with torch.inference_mode():
        torch.testing.assert_close(col(x), F.linear(x, col.weight), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(row(x), F.linear(x, row.weight) + row.bias, rtol=1e-5, atol=1e-5)
    assert len(calls) == 2


def test_lm_head_packed_with_tied_weight(monkeypatch):
    head = _filled(LMHead(1000, 64))
    head.prepack_weights()
    calls = _count_packed_calls(monkeypatch)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        out = head(x)
    torch.testing.assert_close(out, F.linear(x, head.weight), rtol=1e-5, atol=1e-5)
    assert out.dtype == torch.float32 and len(calls) == 1


def test_fallbacks(monkeypatch):
    lin = _filled(Linear(32, 16))
    lin.prepack_weights()
    calls = _count_packed_calls(monkeypatch)
    x = torch.randn(4, 32)
    # a weight replaced after packing: the stale packed copy is not used
    lin.weight = torch.nn.Parameter(torch.randn(16, 32), requires_grad=False)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight))
    # an input that needs autograd goes through F.linear
    lin.prepack_weights()
    xg = torch.randn(2, 32, requires_grad=True)
    lin(xg).sum().backward()
    assert xg.grad is not None
    assert calls == []
    # an empty batch
    assert lin(torch.randn(0, 32)).shape == (0, 16)
    # dtypes that are not packed, and a disabled switch
    half = _filled(Linear(32, 16)).to(torch.bfloat16)
    half.prepack_weights()
    assert half.cpu_packed_weight is None
    with kernel_switches_applied(ServerArgs(disable_cpu_prepack=True)):
        lin.prepack_weights()
    assert lin.cpu_packed_weight is None


def test_missing_ops_fall_back(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "_available", False)
    lin = _filled(Linear(32, 16))
    lin.prepack_weights()
    assert lin.cpu_packed_weight is None
    x = torch.randn(3, 32)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight))


def test_loaded_model_layers_are_prepacked():
    from braid.runtime.model_executor.model_runner import ModelRunner

    runner = ModelRunner(ServerArgs.from_kwargs(model_path="smollm2", load_format="dummy", max_total_tokens=256,
                                                log_level="warning"))
    model = runner.model
    packed = [m for m in model.modules() if m is not model and hasattr(m, "prepack_weights")]
    assert packed and all(m.cpu_packed_weight is not None for m in packed)
    assert model.lm_head.cpu_packed_weight.source is model.lm_head.weight


def test_disable_cpu_prepack_reaches_the_model_runner(monkeypatch):
    """ModelRunner applies its ServerArgs' kernel switches before loading: --disable-cpu-prepack leaves every
    layer on F.linear."""
    from braid.runtime.model_executor.model_runner import ModelRunner

    calls = _count_packed_calls(monkeypatch)
    args = ServerArgs.from_kwargs(model_path="smollm2", load_format="dummy", max_total_tokens=256,
                                  log_level="warning", disable_cpu_prepack=True)
    with kernel_switches_applied(ServerArgs()):  # prepack on before; the process's switches restored after
        runner = ModelRunner(args)
    model = runner.model
    layers = [m for m in model.modules() if m is not model and hasattr(m, "prepack_weights")]
    assert layers and all(m.cpu_packed_weight is None for m in layers)
    x = torch.randn(4, model.lm_head.weight.shape[1])
    with torch.inference_mode():
        torch.testing.assert_close(model.lm_head(x), F.linear(x, model.lm_head.weight))
    assert calls == []


def test_one_or_two_rows_take_the_blas_gemv(monkeypatch):
    """At M <= 2 (batch-1/2 decode) the BLAS GEMV beats oneDNN's packed call; from M = 3 the packed path runs."""
    lin = _filled(Linear(576, 960))
    lin.prepack_weights()
    onednn_rows = []
    real = cpu_gemm._onednn_linear

    def spy(x, packed, bias):
        onednn_rows.append(x.shape[0])
        return real(x, packed, bias)

    monkeypatch.setattr(cpu_gemm, "_onednn_linear", spy)
    with torch.inference_mode():
        for m in (1, 2, 3, 8):
            x = torch.randn(m, 576)
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight), rtol=1e-5, atol=1e-5)
    assert onednn_rows == [3, 8]
