"""The speculative acceptance rule and the n-gram proposer, without a model.

Exactness of sampling: over many draws, every emitted token is distributed as the target's distribution at its
position (chi-square at the 0.1% level over a 6-token vocabulary), whatever the draft; greedy rows accept exactly
while the draft equals the argmax."""

import torch

from braid.runtime.layers.sampler import Sampler, SamplingBatchInfo
from braid.runtime.sampling_params import SamplingParams
from braid.runtime.speculative.acceptance import accept, target_probs
from braid.runtime.speculative.ngram import NgramProposer
from sampling_checks import CHI2_DF5_P001, chi_square

V = 6


def test_rejection_sampling_reproduces_the_target_distribution_at_every_position():
    torch.manual_seed(0)
    p = torch.tensor([[0.05, 0.40, 0.10, 0.25, 0.15, 0.05],   # after the last committed token
                      [0.30, 0.02, 0.28, 0.10, 0.00, 0.30],   # after draft token 1
                      [0.10, 0.10, 0.50, 0.10, 0.10, 0.10]])  # after draft tokens 1, 2
    draft = [3, 1]  # token 1 is unlikely at position 2: many rejections there
    N = 40000
    probs = p.repeat(N, 1)  # request i's rows 3i .. 3i + 2
    emitted = accept(probs, [3 * i for i in range(N)], [list(draft)] * N, [False] * N)
    assert all(1 <= len(e) <= 3 for e in emitted)
    first = [e[0] for e in emitted]
    assert chi_square(first, p[0]) < CHI2_DF5_P001
    # the token after an accepted draft token is distributed as the next row, rejected or not
    second = [e[1] for e in emitted if e[0] == draft[0]]
    assert chi_square(second, p[1]) < CHI2_DF5_P001
    third = [e[2] for e in emitted if e[:2] == draft]
    assert chi_square(third, p[2]) < CHI2_DF5_P001
    # acceptance happens as often as the target gives the draft token
    assert abs(len(second) / N - p[0, 3].item()) < 0.01
    # a token emitted at a rejection is never the rejected one... unless the target drew it, which the rule forbids:
    # a request that stopped after one token emitted something other than the draft
    assert all(e[0] != draft[0] for e in emitted if len(e) == 1)


def test_greedy_rows_accept_while_the_draft_equals_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.0, 0.0, 0.0],
                           [5.0, 0.0, 1.0, 0.0, 0.0, 0.0],
                           [0.0, 0.0, 0.0, 0.0, 9.0, 0.0]])
    info = SamplingBatchInfo.build([type("R", (), {"sampling_params": SamplingParams(temperature=0),
                                                   "return_logprob": False, "top_logprobs_num": 0,
                                                   "output_ids": [], "input_ids": [1]})()] * 3, V, torch.device("cpu"))
    probs = target_probs(logits, info)
    assert torch.equal(probs.argmax(-1), torch.tensor([1, 0, 4]))
    assert accept(probs, [0], [[1, 0]], [True]) == [[1, 0, 4]]  # all accepted, then the bonus token
    assert accept(probs, [0], [[1, 2]], [True]) == [[1, 0]]  # rejected at 2: the argmax there instead
    assert accept(probs, [0], [[5, 0]], [True]) == [[1]]
    assert accept(probs[:1], [0], [[]], [True]) == [[1]]  # no draft: one plain greedy token


def test_target_probs_applies_temperature_and_filters_and_renormalises():
    torch.manual_seed(1)
    logits = torch.randn(2, V)
    req = type("R", (), {"sampling_params": SamplingParams(temperature=0.7, top_k=3, top_p=0.9),
                         "return_logprob": False, "top_logprobs_num": 0, "output_ids": [], "input_ids": [1]})()
    info = SamplingBatchInfo.build([req, req], V, torch.device("cpu"))
    probs = target_probs(logits, info)
    expected = Sampler._filter(torch.softmax(logits / 0.7, dim=-1), info)
    expected = expected / expected.sum(-1, keepdim=True)
    assert torch.allclose(probs, expected, atol=1e-6)
    assert ((probs > 0).sum(-1) <= 3).all() and torch.allclose(probs.sum(-1), torch.ones(2))


def test_seeded_generators_give_the_same_tokens():
    p = torch.full((3, V), 1.0 / V)
    runs = [accept(p, [0], [[2, 2]], [False], [torch.Generator().manual_seed(7)]) for _ in range(2)]
    assert runs[0] == runs[1]
    varied = {tuple(accept(p, [0], [[2, 2]], [False], [torch.Generator().manual_seed(s)])[0]) for s in range(40)}
    assert len(varied) > 1


def test_ngram_proposer_prefers_long_latest_matches():
    prop = NgramProposer(min_match=2, max_match=4, max_draft=3)
    assert prop.propose([1, 2, 3, 4, 5, 1, 2], 3) == [3, 4, 5]
    # the latest occurrence with a whole draft after it wins
    assert prop.propose([1, 2, 7, 7, 7, 1, 2, 8, 9, 9, 1, 2], 3) == [8, 9, 9]
    # a longer suffix match beats a later shorter one: [5, 1, 2] occurred once, followed by 6
    assert prop.propose([5, 1, 2, 6, 6, 6, 1, 2, 3, 3, 3, 5, 1, 2], 3) == [6, 6, 6]
    assert prop.propose([1, 2, 3, 4, 5, 1, 2], 1) == [3]  # capped by the caller's room
    assert prop.propose([1, 2, 3, 4, 5, 6, 2], 3) == []  # one-token matches are below min_match
    assert prop.propose([1, 2, 3], 3) == []
    assert NgramProposer(1, 4, 2).propose([1, 2, 3, 4, 5, 6, 2], 3) == [3, 4]


def reference_propose(tokens: list[int], min_match: int, max_match: int, k: int) -> list[int]:
    """The proposer's rule written plainly: the longest suffix (max_match down to min_match) that occurred earlier
    with a token after it; of its occurrences the latest followed by k tokens, else the latest."""
    L = len(tokens)
    for n in range(min(max_match, L - 1), min_match - 1, -1):
        starts = [i for i in range(0, L - n) if tokens[i:i + n] == tokens[L - n:]]
        if starts:
            full = [i for i in starts if i + n + k <= L]
            start = (full or starts)[-1] + n
            return tokens[start:start + k]
    return []


def test_ngram_proposer_agrees_with_the_plain_rule_on_random_sequences():
    gen = torch.Generator().manual_seed(5)
    for trial in range(400):
        L = int(torch.randint(1, 60, (1,), generator=gen))
        tokens = torch.randint(0, 4 if trial % 2 else 12, (L,), generator=gen).tolist()
        lo = int(torch.randint(1, 4, (1,), generator=gen))
        hi = lo + int(torch.randint(0, 5, (1,), generator=gen))
        k = int(torch.randint(1, 6, (1,), generator=gen))
        assert NgramProposer(lo, hi, 8).propose(tokens, k) == reference_propose(tokens, lo, hi, k), (tokens, lo, hi, k)
