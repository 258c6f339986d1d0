"""The batched finish checks (scheduler/output.FinishTable) against the per-request checks they stand in for
(OutputProcessor.append_token) on random batches: EOS with ignore_eos and min_new_tokens, stop token ids (fewer and
more than a table row holds), max_new_tokens, the context length, and the requests that must keep the per-request
path (stop strings, grammars, logprobs). Also the overlap decisions the table makes for the decode chain."""

import copy
import random
from types import SimpleNamespace

import pytest
import torch

from braid.runtime.core import Req
from braid.runtime.sampling_params import SamplingParams
from braid.runtime.scheduler.output import FinishTable, OutputProcessor

EOS = {2, 7}
CONTEXT_LEN = 96
VOCAB = 40


class _Tokenizer:
    """One character per id: enough for the stop-string check."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + i % 26) for i in ids)


def _processor():
    args = SimpleNamespace(disable_jump_forward=True, enable_jump_forward=False, stream_interval=1)
    return OutputProcessor(args, _Tokenizer(), set(EOS), CONTEXT_LEN, VOCAB, prefix_cache=None, device=torch.device("cpu"))


def _random_req(rng: random.Random, slot: int) -> Req:
    kw = dict(max_new_tokens=rng.randint(1, 40), ignore_eos=rng.random() < 0.3,
              min_new_tokens=rng.choice([0, 0, 0, 3, 10]))
    if rng.random() < 0.4:
        kw["stop_token_ids"] = rng.sample(range(VOCAB), rng.choice([1, 2, 4, 6]))
    if rng.random() < 0.1:
        kw["stop"] = ["ab"]
    kw["min_new_tokens"] = min(kw["min_new_tokens"], kw["max_new_tokens"])
    req = Req(rid=f"r{slot}", input_ids=[1] * rng.randint(1, 70), sampling_params=SamplingParams(**kw),
              return_logprob=rng.random() < 0.1)
    out_len = rng.randint(0, min(kw["max_new_tokens"], CONTEXT_LEN - len(req.input_ids)) - 1)
    req.output_ids = [rng.randrange(VOCAB) for _ in range(out_len)]
    req.fill_ids = req.input_ids + req.output_ids
    req.req_pool_idx = slot
    return req


def _next_token(rng: random.Random, req: Req) -> int:
    pick = rng.random()
    if pick < 0.3:
        return rng.choice(sorted(EOS))
    if pick < 0.5 and req.sampling_params.stop_token_ids:
        return rng.choice(req.sampling_params.stop_token_ids)
    return rng.randrange(VOCAB)


@pytest.mark.parametrize("seed", range(6))
def test_candidates_are_exactly_the_finishing_plain_requests(seed):
    rng = random.Random(seed)
    table = FinishTable(64, EOS, CONTEXT_LEN)
    proc = _processor()
    reqs = [_random_req(rng, slot) for slot in rng.sample(range(64), 48)]
    for r in reqs:
        table.set(r)
    tokens = [_next_token(rng, r) for r in reqs]
    slots = torch.tensor([r.req_pool_idx for r in reqs])
    out_lens = torch.tensor([len(r.output_ids) + 1 for r in reqs])
    flagged = table.candidates(slots, torch.tensor(tokens), out_lens).tolist()
    finishes = [proc.append_token(copy.deepcopy(r), t, None) is not None for r, t in zip(reqs, tokens)]
    kinds = set()
    for r, t, flag, fin in zip(reqs, tokens, flagged, finishes):
        sp = r.sampling_params
        needs_python = bool(sp.stop or r.return_logprob or len(sp.stop_token_ids or ()) > table.STOP_IDS_PER_ROW)
        assert flag == (fin or needs_python), (r.rid, t, sp)
        if fin:
            kinds.add("eos" if t in EOS and not sp.ignore_eos else "stop_id" if t in (sp.stop_token_ids or ())
                      else "length")
    assert {"eos", "length"} <= kinds  # the random batch did exercise the finish kinds


def test_ignore_eos_min_new_tokens_and_context_length():
    table = FinishTable(8, EOS, CONTEXT_LEN)
    reqs = [Req(rid="a", input_ids=[1] * 5, sampling_params=SamplingParams(max_new_tokens=50, ignore_eos=True)),
            Req(rid="b", input_ids=[1] * 5, sampling_params=SamplingParams(max_new_tokens=50, min_new_tokens=4)),
            Req(rid="c", input_ids=[1] * (CONTEXT_LEN - 3), sampling_params=SamplingParams(max_new_tokens=50)),
            Req(rid="d", input_ids=[1] * 5, sampling_params=SamplingParams(max_new_tokens=50, stop_token_ids=[9]))]
    for slot, r in enumerate(reqs):
        r.req_pool_idx = slot
        table.set(r)
    slots = torch.arange(4)

    def flags(tokens, out_lens):
        return table.candidates(slots, torch.tensor(tokens), torch.tensor(out_lens)).tolist()

    assert flags([2, 2, 5, 5], [1, 3, 2, 1]) == [False, False, False, False]  # ignore_eos; EOS before min_new_tokens
    assert flags([2, 2, 5, 9], [1, 4, 3, 1]) == [False, True, True, True]  # min met; context full; stop id
    # the decode chain: a request at its length limit leaves the next step; min_new_tokens pending blocks overlap
    assert table.ends_by_length(slots, torch.tensor([50, 49, 3, 2])).tolist() == [True, False, True, False]
    assert not table.can_overlap(slots, torch.tensor([5, 3, 1, 1]))
    assert table.can_overlap(slots, torch.tensor([5, 4, 1, 1]))


def test_slot_reuse_takes_the_new_requests_limits():
    table = FinishTable(2, EOS, CONTEXT_LEN)
    first = Req(rid="a", input_ids=[1], sampling_params=SamplingParams(max_new_tokens=3, stop_token_ids=[11, 12]),
                return_logprob=True)
    first.req_pool_idx = 0
    table.set(first)
    second = Req(rid="b", input_ids=[1], sampling_params=SamplingParams(max_new_tokens=30))
    second.req_pool_idx = 0
    table.set(second)
    assert table.candidates(torch.tensor([0]), torch.tensor([11]), torch.tensor([3])).tolist() == [False]
    assert table.can_overlap(torch.tensor([0]), torch.tensor([1]))


@pytest.mark.parametrize("seed", range(3))
def test_decode_reservation_equals_the_per_request_sum(seed):
    rng = random.Random(seed)
    table = FinishTable(128, EOS, 8192)
    reqs = []
    for slot in range(rng.randint(1, 120)):
        max_new = rng.randint(1, 3000)
        r = Req(rid=str(slot), input_ids=[1], sampling_params=SamplingParams(max_new_tokens=max_new))
        r.req_pool_idx, r.output_ids = slot, [0] * rng.randint(0, max_new)
        table.set(r)
        reqs.append(r)
    for ratio in (0.7, 0.1, 0.699, 1.0, rng.random()):
        want = sum(int((r.sampling_params.max_new_tokens - len(r.output_ids)) * ratio) for r in reqs)
        got = table.reserved_tokens(torch.tensor([r.req_pool_idx for r in reqs]),
                                    torch.tensor([len(r.output_ids) for r in reqs], dtype=torch.float64), ratio)
        assert got == want
