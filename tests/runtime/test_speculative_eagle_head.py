"""EAGLE and EAGLE-3 draft heads loaded from checkpoints written in their published layouts (tiny random configs):
the head's logits and hidden output equal a reference built from HF transformers' Llama modules with the same
weights; the loader refuses a checkpoint that does not fit the target, naming what."""

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaRMSNorm,
                                                      LlamaRotaryEmbedding)

from braid.runtime.speculative.eagle_head import load_eagle_head

H, V, DRAFT_V, T = 32, 96, 40, 7
CONFIG = dict(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
              rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=128)


def rand(*shape, gen):
    return torch.randn(*shape, generator=gen) * 0.2


def llama_layer_tensors(prefix: str, gen, attn_in: int, input_norm: bool) -> dict:
    hd = H // 4
    t = {f"{prefix}self_attn.q_proj.weight": rand(4 * hd, attn_in, gen=gen),
         f"{prefix}self_attn.k_proj.weight": rand(2 * hd, attn_in, gen=gen),
         f"{prefix}self_attn.v_proj.weight": rand(2 * hd, attn_in, gen=gen),
         f"{prefix}self_attn.o_proj.weight": rand(H, 4 * hd, gen=gen),
         f"{prefix}mlp.gate_proj.weight": rand(64, H, gen=gen), f"{prefix}mlp.up_proj.weight": rand(64, H, gen=gen),
         f"{prefix}mlp.down_proj.weight": rand(H, 64, gen=gen),
         f"{prefix}post_attention_layernorm.weight": 1 + rand(H, gen=gen)}
    if input_norm:
        t[f"{prefix}input_layernorm.weight"] = 1 + rand(H, gen=gen)
    return t


def write_checkpoint(folder, config: dict, tensors: dict) -> str:
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return str(folder)


@pytest.fixture
def target():
    gen = torch.Generator().manual_seed(0)
    embed = nn.Embedding(V, H)
    embed.weight.data = rand(V, H, gen=gen)
    lm_head = nn.Linear(H, V, bias=False)
    lm_head.weight.data = rand(V, H, gen=gen)
    return embed, lm_head


def hf_config() -> LlamaConfig:
    cfg = LlamaConfig(**CONFIG, num_hidden_layers=1)
    cfg._attn_implementation = "sdpa"  # causal without a mask
    return cfg


def load_linear(module: nn.Linear, weight: torch.Tensor) -> None:
    module.weight.data = weight.clone()


def test_eagle_head_matches_hf_llama_layers(tmp_path, target):
    embed, lm_head = target
    gen = torch.Generator().manual_seed(1)
    tensors = {"fc.weight": rand(H, 2 * H, gen=gen), "fc.bias": rand(H, gen=gen)}
    tensors.update(llama_layer_tensors("layers.0.", gen, H, input_norm=False))
    tensors.update(llama_layer_tensors("layers.1.", gen, H, input_norm=True))
    path = write_checkpoint(tmp_path / "eagle", {**CONFIG, "architectures": ["LlamaForCausalLM"],
                                                 "num_hidden_layers": 2}, tensors)
    head = load_eagle_head(path, embed, lm_head, target_hidden_size=H, target_vocab_size=V)
    assert head.c.kind == "EAGLE" and head.c.num_layers == 2 and head.c.fc_bias

    ids = torch.randint(0, V, (T,), generator=gen)
    feats = torch.randn(T, H, generator=gen)
    positions = torch.arange(T)
    logits, hidden = head(ids, feats, positions)

    cfg = hf_config()
    layers = []
    for i in range(2):
        layer = LlamaDecoderLayer(cfg, i)
        layer.load_state_dict({k[len(f"layers.{i}."):]: v for k, v in tensors.items() if k.startswith(f"layers.{i}.")},
                              strict=False)
        if i == 0:
            layer.input_layernorm = nn.Identity()  # EAGLE's first layer has none
        else:
            layer.input_layernorm.weight.data = tensors["layers.1.input_layernorm.weight"].clone()
        layers.append(layer)
    x = (torch.cat([embed(ids), feats], -1) @ tensors["fc.weight"].T + tensors["fc.bias"]).unsqueeze(0)
    rope = LlamaRotaryEmbedding(cfg)(x, positions.view(1, -1))
    with torch.no_grad():
        for layer in layers:
            x = layer(x, position_ids=positions.view(1, -1), position_embeddings=rope)
        ref_logits = lm_head(x[0])
    assert torch.allclose(hidden, x[0], atol=1e-5)
    assert torch.allclose(logits, ref_logits, atol=1e-5)
    # causal: a later token does not change an earlier position's output
    changed = ids.clone()
    changed[-1] = (changed[-1] + 1) % V
    assert torch.allclose(head(changed, feats, positions)[0][:-1], logits[:-1], atol=1e-6)


def eagle3_tensors(gen) -> dict:
    tensors = {"fc.weight": rand(H, 3 * H, gen=gen), "midlayer.hidden_norm.weight": 1 + rand(H, gen=gen),
               "norm.weight": 1 + rand(H, gen=gen), "lm_head.weight": rand(DRAFT_V, H, gen=gen),
               # draft id d -> target id d + d2t[d] = 2d: every other target token
               "d2t": torch.arange(DRAFT_V, dtype=torch.int64),
               "t2d": torch.zeros(V, dtype=torch.bool)}
    tensors.update(llama_layer_tensors("midlayer.", gen, 2 * H, input_norm=True))
    return tensors


def test_eagle3_head_matches_hf_llama_modules(tmp_path, target):
    embed, lm_head = target
    gen = torch.Generator().manual_seed(2)
    tensors = eagle3_tensors(gen)
    path = write_checkpoint(tmp_path / "eagle3", {**CONFIG, "architectures": ["LlamaForCausalLMEagle3"],
                                                  "num_hidden_layers": 1, "draft_vocab_size": DRAFT_V},
                            {("model." + k if k.startswith("midlayer") else k): v for k, v in tensors.items()})
    head = load_eagle_head(path, embed, None, target_hidden_size=H, target_vocab_size=V)
    assert head.c.kind == "EAGLE3" and head.c.draft_vocab_size == DRAFT_V and not head.c.fc_bias

    ids = torch.randint(0, V, (T,), generator=gen)
    feats3 = torch.randn(T, 3 * H, generator=gen)
    positions = torch.arange(T)
    logits, hidden = head(ids, feats3, positions)

    cfg = hf_config()
    norms = {}
    for name in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        norms[name] = LlamaRMSNorm(H, eps=CONFIG["rms_norm_eps"])
        norms[name].weight.data = tensors[name + ".weight"].clone()
    attn = LlamaAttention(cfg, 0)
    for p in ("q", "k", "v", "o"):
        proj = getattr(attn, f"{p}_proj")
        weight = tensors[f"midlayer.self_attn.{p}_proj.weight"]
        setattr(attn, f"{p}_proj", nn.Linear(weight.shape[1], weight.shape[0], bias=False))
        load_linear(getattr(attn, f"{p}_proj"), weight)
        del proj
    mlp = LlamaMLP(cfg)
    mlp.load_state_dict({k[len("midlayer.mlp."):]: v for k, v in tensors.items() if k.startswith("midlayer.mlp.")})
    with torch.no_grad():
        fused = feats3 @ tensors["fc.weight"].T
        x = torch.cat([norms["midlayer.input_layernorm"](embed(ids)), norms["midlayer.hidden_norm"](fused)], -1)
        x = x.unsqueeze(0)
        rope = LlamaRotaryEmbedding(cfg)(x, positions.view(1, -1))
        h = attn(x, position_embeddings=rope, attention_mask=None)[0][0] + fused
        out = mlp(norms["midlayer.post_attention_layernorm"](h)) + h
        draft_logits = norms["norm"](out) @ tensors["lm_head.weight"].T
    assert torch.allclose(hidden, out, atol=1e-5)
    mapped = tensors["d2t"] + torch.arange(DRAFT_V)
    assert torch.allclose(logits[:, mapped], draft_logits, atol=1e-5)
    others = torch.ones(V, dtype=torch.bool)
    others[mapped] = False
    assert torch.isinf(logits[:, others]).all()  # tokens outside the draft vocabulary are never drafted
    # a later draft step feeds the head's own hidden output instead of the target's three layers
    logits2, _ = head(ids, hidden, positions)
    assert logits2.shape == (T, V)


def test_loader_refuses_what_does_not_fit(tmp_path, target):
    embed, lm_head = target
    gen = torch.Generator().manual_seed(3)
    cfg = {**CONFIG, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": DRAFT_V}
    tensors = eagle3_tensors(gen)
    missing = {k: v for k, v in tensors.items() if k != "midlayer.hidden_norm.weight"}
    with pytest.raises(ValueError, match=r"lacks \['midlayer.hidden_norm.weight'\]"):
        load_eagle_head(write_checkpoint(tmp_path / "a", cfg, missing), embed, None, H, V)
    with pytest.raises(ValueError, match=r"unexpected \['extra.weight'\]"):
        load_eagle_head(write_checkpoint(tmp_path / "b", cfg, {**tensors, "extra.weight": torch.zeros(2)}),
                        embed, None, H, V)
    with pytest.raises(ValueError, match="takes 96 features; a EAGLE3 head over a target of hidden size 48"):
        load_eagle_head(write_checkpoint(tmp_path / "c", cfg, tensors), embed, None, 48, V)
    with pytest.raises(ValueError, match="vocab_size 96 is not the target's 100"):
        load_eagle_head(write_checkpoint(tmp_path / "d", cfg, tensors), embed, None, H, 100)
    wrong = {**tensors, "midlayer.mlp.up_proj.weight": torch.zeros(65, H)}
    with pytest.raises(ValueError, match=r"midlayer.mlp.up_proj.weight has shape \(65, 32\)"):
        load_eagle_head(write_checkpoint(tmp_path / "e", cfg, wrong), embed, None, H, V)
    with pytest.raises(ValueError, match="no fc.weight"):
        load_eagle_head(write_checkpoint(tmp_path / "f", cfg, {"norm.weight": torch.ones(H)}), embed, None, H, V)
    (tmp_path / "g").mkdir()
    with pytest.raises(ValueError, match="no \\*.safetensors files"):
        load_eagle_head(str(tmp_path / "g"), embed, None, H, V)
