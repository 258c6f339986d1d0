"""Waiting-queue order: lpm sorts by cached prefix, a request that waited too long goes first, long queues are fcfs."""

import time
from types import SimpleNamespace

import torch

from braid.runtime.core import Req
from braid.runtime.sampling_params import SamplingParams
from braid.runtime.scheduler.prefill import LPM_MAX_QUEUE, LPM_MAX_WAIT_S, PrefillPlanner


class PrefixTable:
    """A prefix cache that knows, per first token, how many tokens of a key it holds; counts the matches asked."""

    disabled = False

    def __init__(self, cached: dict[int, int]):
        self.cached = cached
        self.matches = 0

    def match_prefix(self, key, namespace=None):
        self.matches += 1
        n = min(self.cached.get(key[0], 0), len(key)) if key else 0
        return torch.zeros(n, dtype=torch.int64), None


def planner(tree, policy="lpm"):
    args = SimpleNamespace(chunked_prefill_size=4096, max_prefill_tokens=16384, schedule_policy=policy,
                           max_running_requests=256)
    return PrefillPlanner(args, tree, req_to_token_pool=None, device=torch.device("cpu"))


def req(first_token: int, age_s: float = 0.0) -> Req:
    r = Req(rid=str(first_token), input_ids=[first_token] + [7] * 63, sampling_params=SamplingParams())
    r.created_time = time.time() - age_s
    return r


def test_lpm_puts_the_longest_cached_prefix_first():
    tree = PrefixTable({1: 0, 2: 40, 3: 20})
    ordered, matched = planner(tree)._order([req(1), req(2), req(3)])
    assert matched and [r.rid for r in ordered] == ["2", "3", "1"]


def test_a_request_waiting_too_long_goes_ahead_of_longer_prefixes():
    tree = PrefixTable({1: 0, 2: 40, 3: 20})
    ordered, _ = planner(tree)._order([req(1, age_s=LPM_MAX_WAIT_S + 1), req(2), req(3)])
    assert [r.rid for r in ordered] == ["1", "2", "3"]


def test_a_long_queue_is_fcfs_and_matched_lazily():
    tree = PrefixTable({2: 40})
    waiting = [req(1)] + [req(2) for _ in range(LPM_MAX_QUEUE)]
    ordered, matched = planner(tree)._order(waiting)
    assert not matched and ordered[0] is waiting[0] and tree.matches == 0
