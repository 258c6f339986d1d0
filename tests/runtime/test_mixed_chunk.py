"""--enable-mixed-chunk: running requests decode inside prefill passes, with the outputs of separate passes."""

import pytest
import torch

from braid.runtime.engine import Engine

PROMPTS = ["The capital of France is", "Write a short poem about the sea.\n" * 3, "def fibonacci(n):\n    ",
           "Q: What is 17 + 25?\nA:", "1, 2, 3, 4," * 6, "Name three colors:"]
PARAMS = [{"temperature": 0, "max_new_tokens": 16, "ignore_eos": True},
          {"temperature": 0, "max_new_tokens": 12, "stop": ["\n\n"]},
          {"temperature": 0.8, "top_p": 0.9, "seed": 7, "max_new_tokens": 10},
          {"temperature": 0, "max_new_tokens": 14, "min_new_tokens": 4},
          {"temperature": 0, "max_new_tokens": 9, "frequency_penalty": 0.5},
          {"temperature": 0, "max_new_tokens": 11, "regex": "(red|green|blue), (red|green|blue)"}]


def run(mixed: bool):
    # prompts are prefilled in 8-token chunks, so requests that finished their prefill decode beside later chunks
    with Engine(model_path="smollm2", log_level="warning", max_total_tokens=4096, chunked_prefill_size=8,
                enable_mixed_chunk=mixed) as engine:
        out = engine.generate(PROMPTS, PARAMS, return_logprob=True)
        stats = engine.get_stats()
    assert stats["kv_used_tokens"] == 0 and stats["num_running_reqs"] == 0
    return out, stats


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    torch.set_num_threads(1)


def test_mixed_decode_equals_separate_passes():
    plain, plain_stats = run(False)
    mixed, mixed_stats = run(True)
    assert plain_stats["num_decode_tokens_mixed"] == 0 and mixed_stats["num_decode_tokens_mixed"] >= 10
    assert mixed_stats["num_forward_decode"] < plain_stats["num_forward_decode"]
    for a, b in zip(plain, mixed):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"]
        lp_a = [lp for lp, _ in a["meta_info"]["output_token_logprobs"]]
        lp_b = [lp for lp, _ in b["meta_info"]["output_token_logprobs"]]
        assert lp_a == pytest.approx(lp_b, abs=1e-3)
