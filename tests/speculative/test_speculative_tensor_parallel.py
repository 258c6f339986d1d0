"""Speculative decoding over two tensor-parallel ranks (gloo on CPU): EAGLE chains and trees on the tiny random target
and NGRAM on SmolLM2 give token for token what one rank gives without speculation, verify drafts, and leave the KV
pool free. Rank 0's drafts and acceptance results stand on every rank (verify.py `_from_rank_zero`), so the ranks
build the same verify passes and their collectives line up."""

import json
import os
import subprocess
import sys

import pytest
from eagle_engine_cases import (assert_pool_free, assert_same, check_sampled_load_and_aborted_streams, plain_outputs,
                                run, write_checkpoints)

from braid.runtime import Engine
from braid.runtime.processes.tensor_parallel import free_loopback_addr


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoints(tmp_path_factory.mktemp("eagle_tp"))


@pytest.mark.parametrize("spec", [dict(speculative_algorithm="EAGLE", speculative_eagle_topk=1),
                                  dict(speculative_algorithm="EAGLE", speculative_eagle_topk=2,
                                       speculative_num_steps=3, speculative_num_draft_tokens=6)],
                         ids=["chain", "tree"])
def test_eagle_over_two_ranks_equals_one_rank_without_speculation(ckpt, spec):
    stop, plain = plain_outputs(ckpt)
    out, stats = run(ckpt["random"], stop, tp_size=2, speculative_draft_model_path=ckpt["eagle"], **spec)
    assert_same(plain, out)
    assert stats["spec_num_verify_forward"] > 0 and stats["spec_num_drafts_total"] > 0
    assert_pool_free(stats)


def test_eagle_sampled_load_with_aborts_over_two_ranks(ckpt):
    """Sampled acceptance (unseeded draws too, which differ between the ranks' generators) beside aborted streams:
    every request ends, seeded ones draw alike twice, and the pool is free: the ranks committed the same tokens."""
    check_sampled_load_and_aborted_streams(ckpt, tp_size=2)


TEXT = "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step."
PROMPTS = [f"Repeat this text exactly, twice:\n{TEXT}\n", "Monday, Tuesday, Wednesday, Monday, Tuesday,",
           f"Repeat: {TEXT}\n{TEXT}\n"]
PARAMS = [{"temperature": 0, "max_new_tokens": 40}, {"temperature": 0, "max_new_tokens": 16},
          {"temperature": 0, "max_new_tokens": 32, "stop": ["single"]}]


def test_ngram_on_smollm2_over_two_ranks_equals_one_rank_without_speculation():
    with Engine("smollm2", max_total_tokens=2048, log_level="warning") as engine:
        plain = engine.generate(PROMPTS, PARAMS)
    with Engine("smollm2", max_total_tokens=2048, log_level="warning", tp_size=2,
                speculative_algorithm="NGRAM") as engine:
        spec = engine.generate(PROMPTS, PARAMS)
        stats = engine.get_stats()
    assert [r["output_ids"] for r in spec] == [r["output_ids"] for r in plain]
    assert stats["spec_num_accepted_tokens_total"] > 0
    assert_pool_free(stats)


RANK_PROGRAM = """
import json, sys, torch
from braid.runtime.distributed import parallel_state as ps
from braid.runtime.speculative.verify import _from_rank_zero
rank, addr = int(sys.argv[1]), sys.argv[2]
ps.init_tensor_parallel(2, rank, addr, torch.device("cpu"))
mine = [[[7, 8 + rank], [0, 1]], [[rank] * (3 + rank)]]  # the ranks' own drafts / acceptance differ
print(json.dumps(_from_rank_zero(mine)))
ps.leave_tensor_parallel()
"""


def test_rank_zeros_drafts_and_acceptance_stand_on_every_rank():
    """What two ranks each pass to `_from_rank_zero` differs; both get rank 0's, as a verify pass needs."""
    addr = free_loopback_addr()
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_PROGRAM, str(rank), addr], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"}) for rank in (0, 1)]
    outs = [proc.communicate(timeout=120) for proc in ranks]
    assert [proc.returncode for proc in ranks] == [0, 0], [err.decode()[-1500:] for _, err in outs]
    assert [json.loads(out.decode().strip().splitlines()[-1]) for out, _ in outs] == [[[[7, 8], [0, 1]], [[0] * 3]]] * 2
