"""LinearMethod: every matmul of Linear, LMHead and norm_linear_act goes through the layer's method, a method
owns its weight storage (the seam fp8 uses), and the registry refuses what is not built."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from braid.runtime.layers.activation import SiluAndMul
from braid.runtime.layers.embedding import LMHead
from braid.runtime.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear, norm_linear_act
from braid.runtime.layers.norm import RMSNorm
from braid.runtime.layers.quantization import DenseLinearMethod, LinearMethod, get_linear_method


class RecordingLinearMethod(DenseLinearMethod):
    def __init__(self):
        self.calls: list[tuple[nn.Module, type]] = []

    def apply(self, layer, x, bias=None, act=None):
        self.calls.append((layer, type(act)))
        return super().apply(layer, x, bias, act)


class TinyBlock(nn.Module):
    """One decoder layer's matmuls without attention, built from the public layer API."""

    def __init__(self, hidden: int, inter: int, vocab: int, method: LinearMethod):
        super().__init__()
        self.input_norm = RMSNorm(hidden, 1e-6)
        self.post_norm = RMSNorm(hidden, 1e-6)
        self.qkv = ColumnParallelLinear(hidden, [hidden, hidden // 2, hidden // 2], bias=True, linear_method=method)
        self.o = RowParallelLinear(2 * hidden, hidden, bias=True, linear_method=method)
        self.gate_up = ColumnParallelLinear(hidden, [inter, inter], linear_method=method)
        self.down = RowParallelLinear(inter, hidden, linear_method=method)
        self.act = SiluAndMul()
        self.lm_head = LMHead(vocab, hidden, logit_softcap=30.0, linear_method=method)

    def forward(self, x):
        qkv, residual = norm_linear_act(self.qkv, x, self.input_norm, None)
        h = self.o(qkv)
        h, residual = norm_linear_act(self.gate_up, h, self.post_norm, residual, self.act)
        h = self.down(h) + residual
        return self.lm_head(h)

    def reference(self, x):
        qkv = F.linear(self.input_norm.forward_native(x), self.qkv.weight, self.qkv.bias)
        h = F.linear(qkv, self.o.weight) + self.o.bias
        h, residual = self.post_norm.forward_native(h, x)
        h = self.act.forward_native(F.linear(h, self.gate_up.weight))
        h = F.linear(h, self.down.weight) + residual
        return torch.tanh(F.linear(h, self.lm_head.weight) / 30.0) * 30.0


def _fill(model: nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(torch.randn(p.shape, generator=gen) * 0.1, requires_grad=False))


def test_every_matmul_goes_through_the_layers_method():
    method = RecordingLinearMethod()
    model = TinyBlock(32, 48, 100, method)
    _fill(model)
    for m in (model.qkv, model.o, model.gate_up, model.down, model.lm_head):
        m.prepack_weights()
    x = torch.randn(5, 32)
    with torch.inference_mode():
        out = model(x)
    torch.testing.assert_close(out, model.reference(x), rtol=1e-4, atol=1e-4)
    # one call per layer; the act reaches the method so it can fuse it (the dense GEMV fuses SiLU-and-mul)
    assert method.calls == [(model.qkv, type(None)), (model.o, type(None)), (model.gate_up, SiluAndMul),
                            (model.down, type(None)), (model.lm_head, type(None))]


def test_layers_default_to_the_dense_method_and_keep_their_api():
    col = ColumnParallelLinear(16, [8, 4, 4], bias=True)
    assert isinstance(col.linear_method, DenseLinearMethod)
    assert col.output_sizes == [8, 4, 4] and col.weight.shape == (16, 16) and col.bias.shape == (16,)
    assert col.load_shard(col.weight, torch.arange(4 * 16.).view(4, 16), 1).shape == (4, 16)
    row = RowParallelLinear(16, 8)
    assert row.weight.shape == (8, 16) and row.bias is None
    head = LMHead(50, 16)
    assert isinstance(head.linear_method, DenseLinearMethod) and head.weight.shape == (50, 16)
    with pytest.raises(ValueError, match="add up"):
        Linear(16, 10, output_sizes=[4, 4])


class Int8PerChannelMethod(LinearMethod):
    """A toy quantized method: what an fp8 method does, with int8 values stored as float and a per-row scale."""

    name = "toy-int8"

    def create_weights(self, layer, in_features, output_sizes):
        layer.weight = nn.Parameter(torch.empty(sum(output_sizes), in_features), requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.ones(sum(output_sizes), 1), requires_grad=False)

    def process_weights_after_loading(self, layer):
        scale = layer.weight.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
        layer.weight = nn.Parameter(torch.round(layer.weight / scale), requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)

    def apply(self, layer, x, bias=None, act=None):
        y = F.linear(x, layer.weight * layer.weight_scale, bias)
        return y if act is None else act(y)


def test_a_quantized_method_owns_its_weight_storage():
    lin = Linear(64, 32, bias=True, linear_method=Int8PerChannelMethod())
    _fill(lin)
    dense_weight = lin.weight.clone()
    lin.prepack_weights()
    assert lin.weight.abs().max() <= 127 and lin.weight_scale.shape == (32, 1)
    x = torch.randn(3, 64)
    torch.testing.assert_close(lin(x), F.linear(x, dense_weight, lin.bias), rtol=0.05, atol=0.05)


def test_registry_refuses_what_is_not_built():
    assert isinstance(get_linear_method(None), DenseLinearMethod)
    assert isinstance(get_linear_method("dense"), DenseLinearMethod)
    with pytest.raises(ValueError, match="'awq' is not supported; available: dense, fp8"):
        get_linear_method("awq")


TINY_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5)


def test_a_loaded_model_runs_every_linear_layer_through_its_method(monkeypatch):
    """An Engine on a tiny dummy Llama: every layer that got a LinearMethod at build time multiplies through it
    (prefill and decode), the tied LM head included."""
    from braid.runtime import Engine

    created, applied = [], set()
    real_create, real_apply = DenseLinearMethod.create_weights, DenseLinearMethod.apply

    def create(self, layer, in_features, output_sizes):
        created.append(layer)
        real_create(self, layer, in_features, output_sizes)

    def apply(self, layer, x, bias=None, act=None):
        applied.add(id(layer))
        return real_apply(self, layer, x, bias, act)

    monkeypatch.setattr(DenseLinearMethod, "create_weights", create)
    monkeypatch.setattr(DenseLinearMethod, "apply", apply)
    with Engine(model_path="tiny-llama", load_format="dummy", model_config=json.dumps(TINY_LLAMA),
                tokenizer_path="smollm2", max_total_tokens=256, disable_cuda_graph=True, log_level="warning") as engine:
        out = engine.generate(input_ids=[[1, 2, 3, 4]], sampling_params={"temperature": 0, "max_new_tokens": 3,
                                                                          "ignore_eos": True})
    assert len(out[0]["output_ids"]) == 3
    kinds = sorted({type(layer).__name__ for layer in created})
    assert kinds == ["ColumnParallelLinear", "LMHead", "RowParallelLinear"]
    assert len(created) == 2 * 4 + 1 and {id(layer) for layer in created} == applied
