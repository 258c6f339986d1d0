"""logit_bias and allowed_token_ids in the sampler: [B, V] tensors built only for batches that use them, kept
through `filter`, combined with the per-step vocab mask; on CPU and (gpu-marked) on CUDA."""

import pytest
import torch

from braid.runtime.layers.sampler import Sampler, SamplingBatchInfo, apply_penalties
from braid.runtime.sampling_params import SamplingParams

VOCAB = 50


class _Req:
    def __init__(self, **sp):
        self.sampling_params = SamplingParams.from_dict(sp)
        self.sampling_params.verify(VOCAB)
        self.return_logprob, self.top_logprobs_num = False, 0
        self.input_ids, self.output_ids = [1, 2], []


def _devices():
    return ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", _devices())
def test_bias_and_allowed_ids_shape_sampling(device):
    dev = torch.device(device)
    reqs = [_Req(temperature=1.0, logit_bias={"7": 100, "3": -100}), _Req(temperature=1.0, allowed_token_ids=[4, 9]),
            _Req(temperature=0.0), _Req(temperature=0.0, logit_bias={"11": 5.0})]
    info = SamplingBatchInfo.build(reqs, VOCAB, dev)
    assert info.logit_bias.shape == (4, VOCAB) and info.allowed_tokens.shape == (4, VOCAB)
    logits = torch.randn(4, VOCAB, device=dev)
    logits[3, 11] = logits[3].max() - 1.0  # +5 makes it the argmax
    for _ in range(20):
        ids = Sampler()(apply_penalties(logits, info), info).tolist()
        assert ids[0] == 7 and ids[1] in (4, 9) and ids[2] == int(logits[2].argmax()) and ids[3] == 11
    kept = info.filter([1, 2], torch.tensor([1, 2], device=dev))
    assert kept.allowed_tokens[0].nonzero().view(-1).tolist() == [4, 9] and kept.allowed_tokens[1].all()
    assert kept.logit_bias.abs().sum() == 0
    # a min_new_tokens ban leaving a row nothing keeps allowed_token_ids
    info.vocab_mask = torch.ones(4, VOCAB, dtype=torch.bool, device=dev)
    info.vocab_mask[1, [4, 9]] = False
    assert Sampler()(apply_penalties(logits, info), info).tolist()[1] in (4, 9)


def test_batches_without_them_build_no_tensors():
    info = SamplingBatchInfo.build([_Req(temperature=1.0), _Req(temperature=0.0)], VOCAB, torch.device("cpu"))
    assert info.logit_bias is None and info.allowed_tokens is None


@pytest.mark.parametrize("sp,param", [({"logit_bias": {"50": 1}}, "logit_bias"),
                                      ({"logit_bias": {"1": -100.5}}, "logit_bias"),
                                      ({"logit_bias": {"1": True}}, "logit_bias"),
                                      ({"allowed_token_ids": [50]}, "allowed_token_ids"),
                                      ({"allowed_token_ids": [1], "json_schema": {"type": "object"}},
                                       "allowed_token_ids")])
def test_out_of_range_values_name_the_field(sp, param):
    from braid.runtime.sampling_params import SamplingParamsError

    with pytest.raises(SamplingParamsError) as ei:
        SamplingParams.from_dict(sp).verify(VOCAB)
    assert ei.value.param == param
