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


def test_seeded_generators_are_independent_of_batch_mates():
    logits = torch.randn(1, V)
    a = _req(temperature=1.0, seed=42)
    a.generator = torch.Generator().manual_seed(42)
    first = [Sampler()(logits, SamplingBatchInfo.build([a], V, torch.device("cpu"))).item() for _ in range(20)]
    b, c = _req(temperature=1.0, seed=42), _req(temperature=1.0)
    b.generator = torch.Generator().manual_seed(42)
    both = logits.repeat(2, 1)
    second = [Sampler()(both, SamplingBatchInfo.build([b, c], V, torch.device("cpu")))[0].item() for _ in range(20)]
    assert first == second


def test_token_logprobs_are_log_softmax():
    logits = torch.randn(4, V)
    ids = torch.tensor([1, 2, 3, 4])
    lp, vals, top = token_logprobs(logits, ids, top_k=3)
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(lp, ref[torch.arange(4), ids])
    assert torch.equal(top, ref.topk(3).indices)
