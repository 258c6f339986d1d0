"""Sampler and penalty math on synthetic logits (no model)."""

import torch

from braid.runtime.core import Req
from braid.runtime.layers.logits import token_logprobs
from braid.runtime.layers.sampler import Sampler, SamplingBatchInfo, apply_penalties
from braid.runtime.sampling_params import SamplingParams

V = 10


def _req(output_ids=(), input_ids=(0,), **sp):
    r = Req(rid="r", input_ids=list(input_ids), sampling_params=SamplingParams(**sp))
    r.output_ids = list(output_ids)
    return r


def test_frequency_and_presence_penalties():
    reqs = [_req([3, 3, 5], frequency_penalty=0.5), _req([3, 3, 5], presence_penalty=0.7), _req([3])]
    info = SamplingBatchInfo.build(reqs, V, torch.device("cpu"))
    logits = torch.zeros(3, V)
    out = apply_penalties(logits, info)
    assert out[0, 3].item() == -1.0 and out[0, 5].item() == -0.5 and out[0, 0].item() == 0.0
    assert abs(out[1, 3].item() + 0.7) < 1e-6 and abs(out[1, 5].item() + 0.7) < 1e-6 and out[1, 4].item() == 0.0
    assert torch.all(out[2] == 0)


def test_repetition_penalty_divides_positive_multiplies_negative():
    reqs = [_req([2], input_ids=[1], repetition_penalty=2.0)]
    info = SamplingBatchInfo.build(reqs, V, torch.device("cpu"))
    logits = torch.tensor([[1.0, 4.0, -3.0, 1.0] + [0.0] * 6])
    out = apply_penalties(logits, info)
    assert out[0, 1].item() == 2.0 and out[0, 2].item() == -6.0 and out[0, 0].item() == 1.0


def test_top_k_top_p_min_p_restrict_support():
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1] + [1e-9] * 6])).repeat(3, 1)
    reqs = [_req(top_k=2), _req(top_p=0.6), _req(min_p=0.6)]
    info = SamplingBatchInfo.build(reqs, V, torch.device("cpu"))
    seen = [set(), set(), set()]
    for _ in range(300):
        ids = Sampler()(logits, info)
        for i, t in enumerate(ids.tolist()):
            seen[i].add(t)
    assert seen[0] == {0, 1}
    assert seen[1] == {0, 1}  # 0.4 + 0.3 covers 0.6
    assert seen[2] == {0, 1}  # >= 0.6 * 0.4


def test_a_seeded_draw_depends_on_its_seed_and_step_not_on_batch_mates():
    """A seeded row's token is a function of (seed, tokens sampled so far, its logits): the same alone or beside
    other rows, the next draw of the same info differs (the step advances), another seed differs."""
    torch.manual_seed(0)
    logits = torch.randn(1, 4000)

    def draws(reqs, n=12):
        info = SamplingBatchInfo.build(reqs, 4000, torch.device("cpu"))
        rows = logits.repeat(len(reqs), 1)
        return [Sampler()(rows, info).tolist() for _ in range(n)]

    alone = [d[0] for d in draws([_req(temperature=1.0, seed=42)])]
    beside = [d[1] for d in draws([_req(temperature=1.0), _req(temperature=1.0, seed=42), _req(temperature=0.5, seed=7)])]
    assert alone == beside
    assert len(set(alone)) > 6  # successive steps draw afresh
    other = [d[0] for d in draws([_req(temperature=1.0, seed=43)])]
    assert other != alone
    later = draws([_req(output_ids=[1, 2, 3], temperature=1.0, seed=42)], n=3)
    assert [d[0] for d in later] == alone[3:6]  # a request rebuilt after 3 tokens continues the same sequence


def test_race_draws_follow_the_softmax_with_temperature_and_filters():
    """Frequencies over many unseeded draws match softmax(logits / T) (and the top-k support)."""
    torch.manual_seed(1)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0] + [-30.0] * 6])
    n = 4000
    reqs = [_req(temperature=0.7)] * n
    info = SamplingBatchInfo.build(reqs, V, torch.device("cpu"))
    ids = Sampler()(logits.repeat(n, 1), info)
    freq = torch.bincount(ids, minlength=V).float() / n
    expect = torch.softmax(logits[0] / 0.7, -1)
    assert (freq - expect).abs().max().item() < 0.03
    info = SamplingBatchInfo.build([_req(temperature=1.0, top_k=2)] * n, V, torch.device("cpu"))
    ids = Sampler()(logits.repeat(n, 1), info)
    freq = torch.bincount(ids, minlength=V).float() / n
    assert set(ids.tolist()) == {0, 1} and abs(freq[0].item() - 1 / (1 + torch.e ** -1)) < 0.03


def test_token_logprobs_are_log_softmax():
    logits = torch.randn(4, V)
    ids = torch.tensor([1, 2, 3, 4])
    lp, vals, top = token_logprobs(logits, ids, top_k=3)
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(lp, ref[torch.arange(4), ids])
    assert torch.equal(top, ref.topk(3).indices)
