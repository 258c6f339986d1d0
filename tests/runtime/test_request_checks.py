"""One check of a request against the model and the pool (runtime/request_checks.py), run by request preparation
(server process / Engine) and by the scheduler's intake: the same request is refused on either side with the same
message, parameter and code."""

from __future__ import annotations

import pytest

from braid.runtime.core import Req, RequestError
from braid.runtime.request_checks import RequestLimits
from braid.runtime.sampling_params import SamplingParams, SamplingParamsError
from braid.runtime.scheduler.intake import RequestIntake
from braid.runtime.request_io.prepare import ServedModel, prepare_request

VOCAB, CONTEXT, KV = 100, 64, 48


class DigitTokenizer:
    """One token per character (ids below 100)."""

    chat_template = None

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 100 for c in text]


def _intake() -> RequestIntake:
    intake = RequestIntake.__new__(RequestIntake)  # the limits and counters only: no grammar backend is started
    intake.vocab_size, intake.context_len, intake.kv_pool_size = VOCAB, CONTEXT, KV
    intake.num_requests, intake.share_prefill, intake.grammar_queue, intake.pending_children = 0, False, [], {}
    return intake


def _refusal(fn) -> tuple:
    with pytest.raises((RequestError, SamplingParamsError)) as ei:
        fn()
    return str(ei.value), ei.value.param, getattr(ei.value, "code", None)


CASES = {  # name: (prompt ids, sampling params, logprob_start_len, top_logprobs_num, param at fault)
    "empty": ([], {"max_new_tokens": 4}, -1, 0, "prompt"),
    "outside the vocabulary": ([1, VOCAB], {"max_new_tokens": 4}, -1, 0, "prompt"),
    "prompt fills the context": (list(range(CONTEXT)), {"max_new_tokens": 4}, -1, 0, "prompt"),
    "past the context": ([1] * 10, {"max_new_tokens": CONTEXT - 5}, -1, 0, "max_new_tokens"),
    "past the KV pool": ([1] * 10, {"max_new_tokens": KV}, -1, 0, "max_new_tokens"),
    "bad sampling field": ([1, 2], {"temperature": -1, "max_new_tokens": 4}, -1, 0, "temperature"),
    "top_logprobs_num over 20": ([1, 2], {"max_new_tokens": 4}, -1, 21, "top_logprobs_num"),
    "logprob_start_len past the prompt": ([1, 2], {"max_new_tokens": 4}, 2, 0, "logprob_start_len"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_prepare_and_intake_refuse_alike(name):
    ids, sp, start, top, param = CASES[name]
    model = ServedModel(model_path="m", name="m", tokenizer=DigitTokenizer(), context_len=CONTEXT, vocab_size=VOCAB,
                        kv_total_tokens=KV)
    prepared = _refusal(lambda: prepare_request(model, ids, dict(sp), rid="r", return_logprob=True,
                                                logprob_start_len=start, top_logprobs_num=top))
    req = Req(rid="r", input_ids=ids, sampling_params=SamplingParams(**sp), return_logprob=True,
              logprob_start_len=start, top_logprobs_num=top)
    admitted = _refusal(lambda: _intake().add(req))
    assert prepared == admitted and prepared[1] == param, (prepared, admitted)


def test_context_refusals_carry_the_openai_code_on_both_sides():
    ids = [1] * 10
    model = ServedModel(model_path="m", name="m", tokenizer=DigitTokenizer(), context_len=CONTEXT, vocab_size=VOCAB)
    msg, param, code = _refusal(lambda: prepare_request(model, ids, {"max_new_tokens": CONTEXT}, rid="r"))
    assert code == "context_length_exceeded" and "model's context of 64 tokens" in msg
    req = Req(rid="r", input_ids=ids, sampling_params=SamplingParams(max_new_tokens=KV))
    msg, param, code = _refusal(lambda: _intake().add(req))
    assert code == "context_length_exceeded" and "KV cache of 48 tokens" in msg


def test_a_server_that_does_not_know_the_pool_leaves_that_check_to_the_scheduler():
    model = ServedModel(model_path="m", name="m", tokenizer=DigitTokenizer(), context_len=CONTEXT, vocab_size=VOCAB)
    assert model.limits == RequestLimits(VOCAB, CONTEXT, None)
    req = prepare_request(model, [1] * 10, {"max_new_tokens": KV}, rid="r")  # past KV, within the context
    assert len(req.input_ids) + req.sampling_params.max_new_tokens > KV
    with pytest.raises(RequestError, match="KV cache"):
        _intake().add(req)


def test_a_request_that_fits_passes_both():
    model = ServedModel(model_path="m", name="m", tokenizer=DigitTokenizer(), context_len=CONTEXT, vocab_size=VOCAB,
                        kv_total_tokens=KV)
    req = prepare_request(model, "12", {"max_new_tokens": KV - 2}, rid="r", return_logprob=True, logprob_start_len=1,
                          top_logprobs_num=20)
    assert _intake().add(req) == [req]
