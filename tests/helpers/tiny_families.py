"""Tiny random checkpoints of the wave-2 text families with SmolLM2's tokenizer, written with save_pretrained: Gemma-2
(window 16 on alternate layers, so short requests cross it), Gemma-3 (window 16 on five of six layers) and
DeepSeek-V2 (MLA, MoE with a dense first layer). SmolLM2's BPE makes jump-forward's re-encodings roll computed
tokens back. Shared by the reliability tests and the CPU soak figures in docs/benchmarks.md:

    python tests/helpers/tiny_families.py gemma2 /tmp/tiny-gemma2
"""

import copy
import sys

import torch

FAMILIES = ("gemma2", "gemma3", "deepseek_v2")


def write_tiny_family(folder, family: str) -> str:
    import transformers

    from braid.runtime.loader.tokenizer import load_tokenizer

    tok = copy.deepcopy(load_tokenizer("smollm2"))  # the cached one is shared with every Engine in this process
    tok.save_pretrained(folder)
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, max_position_embeddings=4096,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=0)
    gemma = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16, **common)
    if family == "gemma2":
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(num_hidden_layers=4, **gemma))
    elif family == "gemma3":
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(num_hidden_layers=6, **gemma))
    elif family == "deepseek_v2":
        model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, moe_intermediate_size=32,
            n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32,
            q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, topk_method="greedy",
            n_group=1, topk_group=1, **common))
    else:
        raise ValueError(f"family {family!r}: one of {FAMILIES}")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08)
    model.save_pretrained(folder, safe_serialization=True)
    return str(folder)


if __name__ == "__main__":
    print(write_tiny_family(sys.argv[2], sys.argv[1]))
