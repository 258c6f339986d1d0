"""EAGLE and EAGLE3 tree drafts (--speculative-eagle-topk > 1) in-process on tiny checkpoints (CPU; the cases and
checkpoints of test_speculative_eagle_engine.py, tests/helpers/eagle_engine_cases.py).

- Random target and heads, topk 2 and 4 at depth 3 with 6 and 8 verified tokens: greedy output over 20 requests
  (JSON schema, regex, a stop string, penalties, min_new_tokens, short limits; batched and alone) is token for
  token the output without speculation, and the KV pool is fully free after.
- The successor target and its head: trees accept at least as many tokens a draft as the chain of the same depth
  (not a law: a tree's best N - 1 nodes need not hold the chain's deep nodes, but what a head that predicts well gives),
  the accepted path often runs through a node that is not its parent's first child (its KV slots moved in
  req_to_token), and the output is still the plain one, also with chunked prefill and mixed-in decode rows.
- Every position's KV after the accepted paths' slots moved is the KV the plain run wrote there.
- Logprobs of the emitted tokens are the plain ones (read at the rows of the nodes they came from).
- Sampled and seeded requests with trees, beside aborted streams: seeded ones repeat, the KV pool ends free.
- What cannot run tree drafts is refused at start-up: an attention backend without a tree mask (FlashInfer), a
  model with sliding-window layers.
"""

from types import SimpleNamespace

import pytest
import torch

from braid.runtime import Engine
from braid.runtime.speculative import verify
from braid.runtime.speculative.verify import check_tree_verify
from byte_tokenizer import byte_tokenizer
from eagle_engine_cases import (STOP_CASE, SUCC_PROMPTS, assert_pool_free, assert_same,
                                check_sampled_load_and_aborted_streams, run, run_succ)

TREES = [(2, 6), (4, 8)]  # (--speculative-eagle-topk, --speculative-num-draft-tokens) at --speculative-num-steps 3


@pytest.fixture
def moved_paths(monkeypatch):
    """Counts the verify passes' accepted paths whose KV slots had to move (a path through a later sibling)."""
    moved = []
    original = verify.SpeculativeDecoder._move_path_kv

    def counting(self, req, start, n, path):
        moved.append(path)
        return original(self, req, start, n, path)

    monkeypatch.setattr(verify.SpeculativeDecoder, "_move_path_kv", counting)
    return moved


def tree_flags(algo: str, topk: int, tokens: int, head: str) -> dict:
    return dict(speculative_algorithm=algo, speculative_draft_model_path=head, speculative_num_steps=3,
                speculative_eagle_topk=topk, speculative_num_draft_tokens=tokens)


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
@pytest.mark.parametrize("topk, tokens", TREES)
def test_random_head_tree_greedy_output_is_the_plain_output(eagle_ckpt, eagle_plain, algo, topk, tokens):
    stop, plain_out = eagle_plain
    spec_out, stats = run(eagle_ckpt["random"], stop, **tree_flags(algo, topk, tokens, eagle_ckpt[algo.lower()]))
    assert_same(plain_out, spec_out)
    assert plain_out[STOP_CASE]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert spec_out[1]["text"].startswith('{"name":')
    # trees were verified: up to tokens - 1 nodes a draft, more than a chain of depth 3 holds
    assert stats["spec_num_drafts_total"] > 0
    assert 3 < stats["spec_num_draft_tokens_total"] / stats["spec_num_drafts_total"] <= tokens - 1
    assert_pool_free(stats)


def test_trees_accept_at_least_what_the_chain_does_and_keep_the_plain_output(eagle_ckpt, moved_paths):
    plain_out, _ = run_succ(eagle_ckpt["succ"])
    chain_out, chain = run_succ(eagle_ckpt["succ"], **tree_flags("EAGLE", 1, 4, eagle_ckpt["succ_head"]))
    assert_same(plain_out, chain_out)
    assert not moved_paths  # a chain's path is its first rows
    lengths = {}
    for topk, tokens in TREES:
        for extra in ({}, dict(chunked_prefill_size=16, enable_mixed_chunk=True)) if topk == 2 else ({},):
            flags = tree_flags("EAGLE", topk, tokens, eagle_ckpt["succ_head"])
            spec_out, stats = run_succ(eagle_ckpt["succ"], **flags, **extra)
            assert_same(plain_out, spec_out)
            assert_pool_free(stats)
            if not extra:
                lengths[topk] = stats["spec_accept_length_mean"]
    assert lengths[2] >= chain["spec_accept_length_mean"] and lengths[4] >= chain["spec_accept_length_mean"]
    assert 2.0 < chain["spec_accept_length_mean"] < lengths[4] <= 4.0, (chain, lengths)
    # some accepted paths went through a later sibling (their KV slots moved), some deeper than one token
    assert moved_paths and any(len(path) > 2 for path in moved_paths)


def test_tree_logprobs_are_the_plain_logprobs(eagle_ckpt, moved_paths):
    """Each emitted token's logprobs come from the row of the node it was accepted or drawn under."""
    prompts, params = SUCC_PROMPTS[:5], {"temperature": 0, "max_new_tokens": 24}
    outs = []
    for flags in ({}, tree_flags("EAGLE", 4, 8, eagle_ckpt["succ_head"])):
        with Engine(model_path=eagle_ckpt["succ"], log_level="warning", max_total_tokens=1024, **flags) as engine:
            outs.append(engine.generate(prompts, params, return_logprob=True, top_logprobs_num=3))
    assert moved_paths
    for a, b in zip(*outs):
        la, lb = a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]
        assert len(la) == len(lb) == len(a["output_ids"]) > 0
        for ea, eb in zip(la, lb):  # (logprob, token id)
            assert ea[1] == eb[1] and eb[0] == pytest.approx(ea[0], abs=2e-3)
        for ta, tb in zip(a["meta_info"]["output_top_logprobs"], b["meta_info"]["output_top_logprobs"]):
            assert [t[1] for t in ta] == [t[1] for t in tb]


def cached_kv(engine, ids: list[int]) -> torch.Tensor:
    """The K and V every layer holds for the longest cached prefix of `ids` (the radix cache keeps a finished
    request's KV): [2, layers, n, Hkv, D]."""
    slots, _ = engine.scheduler.prefix_cache.match_prefix(ids)
    pool = engine.scheduler.kv_pool
    layers = range(engine.scheduler.runner.model_config.num_layers)
    return torch.stack([torch.stack([pool.get_key_buffer(i)[slots] for i in layers]),
                        torch.stack([pool.get_value_buffer(i)[slots] for i in layers])])


def test_the_kv_of_accepted_paths_is_the_plain_kv(eagle_ckpt, moved_paths):
    """After trees whose accepted paths ran through later siblings (their slots moved in req_to_token), every
    position's KV, in every layer, is what the run without speculation wrote there."""
    tok = byte_tokenizer()
    ids = [tok(p)["input_ids"] for p in SUCC_PROMPTS[:5]]
    params = {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}
    kv = []
    for flags in ({}, tree_flags("EAGLE", 4, 8, eagle_ckpt["succ_head"])):
        with Engine(model_path=eagle_ckpt["succ"], log_level="warning", max_total_tokens=1024, **flags) as engine:
            outs = engine.generate(input_ids=ids, sampling_params=params)
            kv.append([cached_kv(engine, i + o["output_ids"]) for i, o in zip(ids, outs)])
    assert moved_paths
    for plain, spec in zip(*kv):
        assert plain.shape == spec.shape and plain.shape[2] >= 30
        torch.testing.assert_close(spec, plain, atol=1e-4, rtol=1e-4)


def test_sampled_trees_and_aborted_streams_leave_the_kv_pool_free(eagle_ckpt):
    check_sampled_load_and_aborted_streams(eagle_ckpt, speculative_num_steps=3, speculative_eagle_topk=4,
                                           speculative_num_draft_tokens=8)


def runner_stub(backend_name: str, tree_mask: bool, windows=(None, None)) -> SimpleNamespace:
    return SimpleNamespace(attn_backend=SimpleNamespace(supports_tree_mask=tree_mask), attn_backend_name=backend_name,
                           model_config=SimpleNamespace(layers=[SimpleNamespace(sliding_window=w) for w in windows]))


def test_what_cannot_verify_trees_is_refused_at_start():
    check_tree_verify(runner_stub("triton", True), 2)
    with pytest.raises(ValueError, match="the flashinfer attention backend does not have yet: use --attention-backend "
                                         "triton"):
        check_tree_verify(runner_stub("flashinfer", False), 2)
    with pytest.raises(ValueError, match="sliding-window layers"):
        check_tree_verify(runner_stub("torch", True, windows=(4096, None)), 4)
