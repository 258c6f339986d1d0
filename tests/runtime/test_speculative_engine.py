"""NGRAM speculation on SmolLM2 (real weights, CPU), in-process: greedy output is token for token the output without
speculation (prompts where prompt lookup hits: copying, code, lists; with stop strings, regex and JSON-schema
constraints, penalties, min_new_tokens and short length limits), logprobs of accepted tokens as without it, drafts
are accepted and counted, and the KV pool is fully free after a sampled load."""

import json

import pytest

from braid.runtime import Engine

TEXT = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
        "All that glitters is not gold.")
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
SCHEMA = json.dumps({"type": "object", "properties": {"quote": {"type": "string"}, "words": {"type": "integer"}},
                     "required": ["quote", "words"]})

CASES = [
    (f"Repeat this text exactly, twice:\n{TEXT}\n", {"max_new_tokens": 48}),
    (CODE, {"max_new_tokens": 32}),
    ("Monday, Tuesday, Wednesday, Monday, Tuesday, Wednesday, Monday,", {"max_new_tokens": 16}),
    (f"Repeat: {TEXT}\n{TEXT}\n", {"max_new_tokens": 48, "stop": ["single"]}),
    (f"Repeat: {TEXT}\n{TEXT}\n", {"max_new_tokens": 3}),
    (f"Repeat: {TEXT}\n{TEXT}\n", {"max_new_tokens": 32, "regex": "(fox|dog)( (fox|dog|jumps)){3,12}"}),
    (f"Quote the first sentence as JSON.\n{TEXT}\n", {"max_new_tokens": 32, "json_schema": SCHEMA}),
    (f"Repeat: {TEXT}\n{TEXT}\n", {"max_new_tokens": 24, "frequency_penalty": 0.5}),
    (f"Repeat: {TEXT}\n{TEXT}\n", {"max_new_tokens": 24, "min_new_tokens": 12, "stop_token_ids": [13]}),
]
ALONE = 2  # the first cases also run one at a time (batch-1 verify passes)


def run_cases(**server_args) -> tuple[list[dict], dict]:
    """Every case in one batch (requests with and without drafts share verify passes), then the first ALONE alone."""
    with Engine("smollm2", max_total_tokens=4096, **server_args) as engine:
        batched = engine.generate([p for p, _ in CASES], [{"temperature": 0, **s} for _, s in CASES],
                                  return_logprob=True, top_logprobs_num=2)
        alone = [engine.generate(p, {"temperature": 0, **s}) for p, s in CASES[:ALONE]]
        return batched + alone, engine.get_stats()


@pytest.fixture(scope="module")
def runs():
    plain, _ = run_cases()
    spec, stats = run_cases(speculative_algorithm="NGRAM")
    return plain, spec, stats


def test_greedy_output_is_token_for_token_the_plain_output(runs):
    plain, spec, _ = runs
    for i, (a, b) in enumerate(zip(plain, spec)):
        case = CASES[i if i < len(CASES) else i - len(CASES)]
        assert b["output_ids"] == a["output_ids"], (case, a["text"], b["text"])
        assert b["meta_info"]["finish_reason"] == a["meta_info"]["finish_reason"], case
        assert b["meta_info"]["completion_tokens"] == a["meta_info"]["completion_tokens"], case
    # the copying prompt's own acceptance; the plain engine reports none
    assert spec[-ALONE]["meta_info"]["spec_accept_length"] > 1.5
    assert "spec_accept_length" not in plain[-ALONE]["meta_info"]
    assert spec[3]["meta_info"]["finish_reason"] == {"type": "stop", "matched": "single"}
    assert spec[4]["meta_info"]["completion_tokens"] == 3
    assert spec[6]["text"].startswith('{"quote":')


def test_logprobs_of_accepted_tokens_are_the_plain_logprobs(runs):
    plain, spec, _ = runs
    for a, b in zip(plain[:len(CASES)], spec[:len(CASES)]):
        la, lb = a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]
        assert len(la) == len(lb) > 0
        for ea, eb in zip(la, lb):  # (logprob, token id)
            assert ea[1] == eb[1] and eb[0] == pytest.approx(ea[0], abs=2e-3)
        for ta, tb in zip(a["meta_info"]["output_top_logprobs"], b["meta_info"]["output_top_logprobs"]):
            assert [t[1] for t in ta] == [t[1] for t in tb]


def test_drafts_are_accepted_and_counted(runs):
    _, _, stats = runs
    assert stats["spec_num_verify_forward"] > 0
    assert 0 < stats["spec_num_accepted_tokens_total"] <= stats["spec_num_draft_tokens_total"]
    assert stats["spec_num_drafts_total"] > 0
    assert stats["spec_accept_length_mean"] > 1.5  # copying prompts: well over one token per draft
    assert stats["kv_used_tokens"] == 0
    assert stats["kv_free_tokens"] + stats["kv_cached_tokens"] == stats["kv_total_tokens"]


def test_sampled_load_leaves_the_kv_pool_free():
    prompts = [f"Repeat {i}: {TEXT}\n{TEXT}\n" for i in range(16)]
    params = [{"temperature": 0.9, "top_p": 0.95, "max_new_tokens": 8 + 4 * (i % 5), **({"seed": i} if i % 3 == 0
                                                                                          else {})}
              for i in range(16)]
    with Engine("smollm2", max_total_tokens=2048, speculative_algorithm="NGRAM",
                speculative_num_draft_tokens=7) as engine:
        first = engine.generate(prompts, params)
        again = engine.generate(prompts, params)
        stats = engine.get_stats()
    for i, (a, b) in enumerate(zip(first, again)):
        assert a["meta_info"]["completion_tokens"] == params[i]["max_new_tokens"] or \
            a["meta_info"]["finish_reason"]["type"] == "stop"
        if "seed" in params[i]:  # a seeded request draws the same tokens again
            assert a["output_ids"] == b["output_ids"]
    assert stats["spec_num_accepted_tokens_total"] > 0
    assert stats["kv_used_tokens"] == 0 and stats["num_running_reqs"] == 0
    assert stats["kv_free_tokens"] + stats["kv_cached_tokens"] == stats["kv_total_tokens"]


def test_steps_past_the_batch_size_limit_decode_without_drafts(runs):
    """--speculative-disable-by-batch-size 2: the batch of every case decodes plainly (same greedy tokens) until at
    most two requests run; the cases alone speculate."""
    plain, _, _ = runs
    limited, stats = run_cases(speculative_algorithm="NGRAM", speculative_disable_by_batch_size=2)
    assert [r["output_ids"] for r in limited] == [r["output_ids"] for r in plain]
    assert stats["spec_num_steps_disabled_by_batch_size"] > 0
    assert stats["spec_num_verify_forward"] > 0  # the requests alone (and the batch's last two) still speculate
    assert limited[-ALONE]["meta_info"]["spec_accept_length"] > 1.5
    assert stats["kv_used_tokens"] == 0


def test_steps_past_the_batch_size_limit_overlap_and_the_rest_do_not(runs):
    """With the overlap schedule on (the CUDA default; on CPU the same bookkeeping runs synchronously), the steps
    past --speculative-disable-by-batch-size chain as plain decode does, and a batch under the limit still
    speculates; greedy tokens as without speculation. (Logprobs, penalties and min_new_tokens keep a step from
    overlapping, so those cases stay out.)"""
    plain, _, _ = runs
    picked = [i for i, (_, s) in enumerate(CASES) if not ({"frequency_penalty", "min_new_tokens"} & s.keys())]

    def overlapped(**server_args) -> tuple[list[dict], dict]:
        with Engine("smollm2", max_total_tokens=4096, speculative_algorithm="NGRAM", **server_args) as engine:
            engine.scheduler.decode.overlap = True
            out = engine.generate([CASES[i][0] for i in picked], [{"temperature": 0, **CASES[i][1]} for i in picked])
            out.append(engine.generate(CASES[0][0], {"temperature": 0, **CASES[0][1]}))
            return out, engine.get_stats()

    limited, stats = overlapped(speculative_disable_by_batch_size=2)
    assert [r["output_ids"] for r in limited] == [plain[i]["output_ids"] for i in picked] + [plain[0]["output_ids"]]
    assert stats["num_decode_overlapped"] > 0
    assert limited[-1]["meta_info"]["spec_accept_length"] > 1.5  # alone: under the limit, it speculates
    assert stats["kv_used_tokens"] == 0
    # without the limit no step overlaps: every one may carry drafts
    _, unlimited = overlapped()
    assert unlimited["num_decode_overlapped"] == 0 and unlimited["spec_num_verify_forward"] > 0


# eight short copying prompts of 48 new tokens each: more KV than a 400-token pool holds once they all decode
RETRACT = [f"Count on: {i}, {i + 1}, {i + 2}, {i + 3}, {i + 1}, {i + 2}," for i in range(0, 80, 10)]


@pytest.mark.parametrize("extra", [dict(max_total_tokens=400), dict(chunked_prefill_size=16)],
                         ids=["retraction", "chunked_prefill"])
def test_greedy_output_survives_retraction_chunking_and_n(extra):
    """Speculation beside a pool too small for the batch (requests retracted and resumed, their drafts' KV given
    back) and beside chunked prefill; n = 2 greedy samples of one prompt are both the plain output."""
    sp = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
    with Engine("smollm2", max_total_tokens=4096) as engine:
        plain = [r["output_ids"] for r in engine.generate(RETRACT, sp)]
    with Engine("smollm2", speculative_algorithm="NGRAM", **{"max_total_tokens": 4096, **extra}) as engine:
        out = [r["output_ids"] for r in engine.generate(RETRACT, sp)]
        pair = [r["output_ids"] for r in engine.generate(RETRACT[0], {**sp, "n": 2})]
        stats = engine.get_stats()
    assert out == plain
    assert pair == [plain[0]] * 2
    assert stats["spec_num_accepted_tokens_total"] > 0
    if "max_total_tokens" in extra:
        assert stats["num_retractions"] > 0, "the small pool should have forced a retraction"
    assert stats["kv_used_tokens"] == 0 and stats["num_running_reqs"] == 0
