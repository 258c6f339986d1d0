"""EAGLE and EAGLE3 speculation in-process on tiny checkpoints (CPU, real parts: a Llama target written by
transformers' save_pretrained, draft heads in their published layouts, tests/helpers/eagle_tiny.py).

- A random target and random heads: greedy output over 20 requests (JSON schema, regex, a stop string, penalties,
  min_new_tokens, short limits; batched and alone, the radix cache sharing prompts) is token for token the output
  without speculation, for EAGLE and EAGLE3.
- A target whose next token is easy to predict and a head built to predict it: drafts are accepted (mean acceptance
  length well over 1, with rejections mid-draft) and the output is still the plain one, also with chunked prefill
  and mixed-in decode rows.
- Sampled requests, seeded requests and streams aborted mid-way leave the KV pool fully free.
"""

import pytest

from eagle_engine_cases import (STOP_CASE, assert_pool_free, assert_same, check_sampled_load_and_aborted_streams,
                                run, run_succ)


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
def test_random_head_greedy_output_is_the_plain_output(eagle_ckpt, eagle_plain, algo):
    stop, plain_out = eagle_plain
    spec_out, stats = run(eagle_ckpt["random"], stop, speculative_algorithm=algo,
                          speculative_draft_model_path=eagle_ckpt[algo.lower()], speculative_num_steps=3)
    assert_same(plain_out, spec_out)
    assert plain_out[STOP_CASE]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert spec_out[5]["meta_info"]["completion_tokens"] == 1
    assert spec_out[1]["text"].startswith('{"name":')
    assert stats["spec_num_verify_forward"] > 0 and stats["spec_num_draft_tokens_total"] > 0
    assert stats["spec_num_drafts_total"] > 0
    assert "spec_accept_length" in spec_out[0]["meta_info"]
    assert_pool_free(stats)


def test_a_head_that_predicts_the_target_is_accepted_and_the_output_stays_the_plain_one(eagle_ckpt):
    plain_out, _ = run_succ(eagle_ckpt["succ"])
    assert plain_out[0]["text"].startswith("vwxyz abc")  # the target follows its successor map
    assert plain_out[1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": "pqr"}
    flags = dict(speculative_algorithm="EAGLE", speculative_draft_model_path=eagle_ckpt["succ_head"],
                 speculative_num_steps=4)
    for extra in ({}, dict(chunked_prefill_size=16, enable_mixed_chunk=True)):
        spec_out, stats = run_succ(eagle_ckpt["succ"], **flags, **extra)
        assert_same(plain_out, spec_out)
        # tokens a verified draft yields: well over 1, and under the 5 of all-accepted drafts (rejections mid-draft)
        assert 2.0 < stats["spec_accept_length_mean"] < 5.0, stats
        assert spec_out[0]["meta_info"]["spec_accept_length"] > 1.5
        assert stats["spec_num_verify_forward"] < sum(len(o["output_ids"]) for o in spec_out) / len(spec_out)
        assert_pool_free(stats)


def test_sampled_load_and_aborted_streams_leave_the_kv_pool_free(eagle_ckpt):
    check_sampled_load_and_aborted_streams(eagle_ckpt, speculative_num_steps=4)
