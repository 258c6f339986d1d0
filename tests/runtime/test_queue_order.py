"""SGLang v0.3's dfs-weight and random waiting-queue orders, through PrefillPlanner over a real RadixCache."""

import time
from types import SimpleNamespace

import torch

from braid.runtime.core import Req
from braid.runtime.mem_cache.pools import MHAKVPool, ReqToTokenPool
from braid.runtime.mem_cache.radix_cache import RadixCache
from braid.runtime.sampling_params import SamplingParams
from braid.runtime.scheduler.prefill import LPM_MAX_WAIT_S, PrefillPlanner
from braid.runtime.scheduler.queue_order import dfs_weight_order


def radix_cache_holding(*keys: list[int]) -> RadixCache:
    cache = RadixCache(ReqToTokenPool(4, 64, "cpu"),
                       MHAKVPool(256, torch.float32, head_num=1, head_dim=2, layer_num=1, device="cpu"))
    for key in keys:
        value = cache.kv_pool.alloc(len(key))
        prefix_len, _, _ = cache.insert(key, value)
        cache.kv_pool.free(value[:prefix_len])
    return cache


def planner(cache, policy: str, seed: int = 0) -> PrefillPlanner:
    args = SimpleNamespace(chunked_prefill_size=4096, max_prefill_tokens=16384, schedule_policy=policy,
                           max_running_requests=256, random_seed=seed)
    return PrefillPlanner(args, cache, req_to_token_pool=None, device=torch.device("cpu"))


def req(rid: str, ids: list[int], age_s: float = 0.0) -> Req:
    r = Req(rid=rid, input_ids=ids, sampling_params=SamplingParams())
    r.created_time = time.time() - age_s
    return r


SHARED, OTHER = [1, 2, 3, 4], [5, 6, 7, 8]


def waiting_queue(root_age_s: float = 0.0) -> list[Req]:
    # the tree: root -> SHARED -> {10, 11 | 20, 21}, root -> OTHER
    return [req("other", OTHER + [99]), req("shared-10", SHARED + [10, 11, 50]),
            req("shared-20a", SHARED + [20, 21, 51]), req("shared-20b", SHARED + [20, 21, 52]),
            req("uncached", [9, 9, 9], age_s=root_age_s)]


def test_dfs_weight_takes_the_heaviest_subtree_first_and_a_nodes_own_requests_after_its_subtrees():
    cache = radix_cache_holding(SHARED + [10, 11], SHARED + [20, 21], OTHER)
    ordered, matched = planner(cache, "dfs-weight")._order(waiting_queue())
    assert matched
    # SHARED holds 3 waiting requests (2 under 20-21, 1 under 10-11), OTHER 1, the root 1 of its own
    assert [r.rid for r in ordered] == ["shared-20a", "shared-20b", "shared-10", "other", "uncached"]
    lpm, _ = planner(cache, "lpm")._order(waiting_queue())
    assert [r.rid for r in lpm] == ["shared-10", "shared-20a", "shared-20b", "other", "uncached"]


def test_dfs_weight_lets_a_request_that_waited_too_long_go_first():
    cache = radix_cache_holding(SHARED + [10, 11], SHARED + [20, 21], OTHER)
    ordered, _ = planner(cache, "dfs-weight")._order(waiting_queue(root_age_s=LPM_MAX_WAIT_S + 1))
    assert [r.rid for r in ordered] == ["uncached", "shared-20a", "shared-20b", "shared-10", "other"]


def test_dfs_weight_over_an_empty_tree_keeps_arrival_order():
    cache = radix_cache_holding()
    queue = waiting_queue()
    for r in queue:
        r.last_node = cache.root_node
    assert dfs_weight_order(queue, cache.root_node) == queue


def test_random_is_a_seeded_permutation_that_every_rank_draws_alike():
    cache = radix_cache_holding()
    queue = [req(str(i), [i, i]) for i in range(8)]
    rank0, rank1, other_seed = planner(cache, "random", 7), planner(cache, "random", 7), planner(cache, "random", 8)
    draws = [rank0._order(queue)[0] for _ in range(4)]
    assert draws == [rank1._order(queue)[0] for _ in range(4)]
    assert all(sorted(d, key=lambda r: int(r.rid)) == queue for d in draws)
    assert any(d != queue for d in draws) and len({tuple(r.rid for r in d) for d in draws}) > 1
    assert draws != [other_seed._order(queue)[0] for _ in range(4)]
    assert queue == sorted(queue, key=lambda r: int(r.rid))  # the scheduler's list is not shuffled in place


def test_an_engine_serves_a_shared_prefix_batch_alike_under_dfs_weight_and_random():
    """Both orders reach every request of a batch whose prompts share prefixes, with the same greedy texts."""
    from braid.runtime import Engine

    system = "You are a careful assistant. Answer in one short sentence. "
    prompts = [system + q for q in ("What is the capital of France?", "What is the capital of Spain?",
                                    "Name a color.")] + ["Count to five:", system + "Name a fruit."]
    texts = {}
    for policy in ("dfs-weight", "random"):
        with Engine(model_path="smollm2", max_total_tokens=1024, schedule_policy=policy, log_level="warning") as engine:
            out = engine.generate(prompts, {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert [o["meta_info"]["completion_tokens"] for o in out] == [6] * len(prompts)
        texts[policy] = [o["text"] for o in out]
    assert texts["dfs-weight"] == texts["random"]
