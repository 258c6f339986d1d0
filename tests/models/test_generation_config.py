"""generation_config.json's eos_token_id ends generation beside config.json's (a chat checkpoint's end-of-turn token,
e.g. Gemma-2-it's [1, 107]), as HF generate, vLLM and SGLang stop on it."""

import json

import torch

from braid.runtime import Engine
from braid.runtime.loader.model_config import ModelConfig
from byte_tokenizer import byte_tokenizer

GREEDY = {"temperature": 0, "max_new_tokens": 8}


def _tiny_llama(path):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    byte_tokenizer().save_pretrained(path)


def _generate(path, prompt):
    with Engine(model_path=str(path), max_total_tokens=1024, log_level="warning") as engine:
        return engine.generate(input_ids=prompt, sampling_params=GREEDY)


def test_generation_config_eos_ends_generation(tmp_path):
    _tiny_llama(tmp_path)
    prompt = [5, 17, 33, 80, 121]
    free = _generate(tmp_path, prompt)["output_ids"]
    assert len(free) == 8 and 1 not in free
    turn_end = free[2]
    assert turn_end not in free[:2]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, turn_end]}))
    out = _generate(tmp_path, prompt)
    assert out["output_ids"] == free[:3]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_eos_ids_merge_config_and_generation_config():
    raw = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
           "num_attention_heads": 4, "vocab_size": 300, "eos_token_id": 1}
    assert ModelConfig.from_hf(raw).eos_token_ids == (1,)
    assert ModelConfig.from_hf(raw, generation_config={"eos_token_id": [1, 107]}).eos_token_ids == (1, 107)
    assert ModelConfig.from_hf({**raw, "eos_token_id": [7, 1]},
                               generation_config={"eos_token_id": 9}).eos_token_ids == (7, 1, 9)
