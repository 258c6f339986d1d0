"""Greedy output of braid's Engine equals HF transformers token for token on SmolLM2."""

import pytest

from braid.runtime import Engine


CONFIGS = {
    "radix": dict(),
    "no_radix": dict(disable_radix_cache=True),
    "chunked_prefill_16": dict(chunked_prefill_size=16),
    # the 8 prompts (211 tokens) + 8 x 48 new tokens need 595 KV slots: 400 forces a retraction
    "retraction": dict(max_total_tokens=400),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_parity_with_hf(name, hf_greedy, smollm2_tok, parity_prompts, new_tokens):
    with Engine(model_path="smollm2", **{"max_total_tokens": 2048, **CONFIGS[name]}) as engine:
        sp = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
        results = engine.generate(parity_prompts, sp)
        for prompt, res, ref in zip(parity_prompts, results, hf_greedy):
            assert res["output_ids"] == ref, f"[{name}] mismatch for {prompt[:40]!r}"
            assert res["meta_info"]["completion_tokens"] == new_tokens
            assert res["meta_info"]["finish_reason"]["type"] == "length"
            assert res["text"] == smollm2_tok.decode(ref, skip_special_tokens=True)
        stats = engine.get_stats()
        if name == "retraction":
            assert stats["num_retractions"] > 0, "the small KV pool should have forced a retraction"
        if name == "chunked_prefill_16":
            assert stats["num_forward_extend"] > len(parity_prompts)
        assert stats["kv_used_tokens"] == 0
        assert stats["num_running_reqs"] == 0
        engine.flush_cache()
        stats = engine.get_stats()
        assert stats["kv_free_tokens"] == stats["kv_total_tokens"]
