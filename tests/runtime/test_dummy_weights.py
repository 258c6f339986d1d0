"""load_format='dummy': one seed is one model in every dtype (bf16's weights are fp32's rounded), so that
benchmarks comparing dtypes on random weights measure rounding rather than two different models."""

import json

import torch

from braid.runtime.config import ServerArgs
from braid.runtime.model_executor.model_runner import ModelRunner

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "vocab_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "eos_token_id": 2}


def dummy_weights(dtype: str, seed: int = 0) -> dict:
    args = ServerArgs(model_path="smollm2", load_format="dummy", model_config=json.dumps(TINY_LLAMA), dtype=dtype,
                      random_seed=seed, max_total_tokens=256, log_level="warning")
    return {name: p.detach().clone() for name, p in ModelRunner(args).model.named_parameters()}


def test_the_same_random_model_in_every_dtype():
    fp32, bf16 = dummy_weights("float32"), dummy_weights("bfloat16")
    assert fp32.keys() == bf16.keys() and len(fp32) > 10
    for name, w in fp32.items():
        assert bf16[name].dtype == torch.bfloat16
        assert torch.equal(bf16[name], w.to(torch.bfloat16)), name
        if "norm" in name:
            assert (w == 1).all(), name
        else:
            assert w.abs().max() <= 0.02 and w.std() > 0.005, name
    # another seed, another model
    other = dummy_weights("float32", seed=1)
    assert not torch.equal(other["model.embed_tokens.weight"], fp32["model.embed_tokens.weight"])
