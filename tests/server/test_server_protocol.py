"""Request validation and conversion to SamplingParams through the server's request preparation (a stand-in
tokenizer, no model, no server)."""

import asyncio
import json

import pytest

from braid.runtime.config import ServerArgs
from braid.runtime.sampling_params import SamplingParams
from braid.runtime.server.errors import APIError, from_exception
from braid.runtime.server.http_server import prepare_generate
from braid.runtime.server.openai_api import _param_names
from braid.runtime.request_io.prepare import ServedModel
from braid.runtime.server.generate_protocol import parse_generate
from braid.runtime.server.openai_protocol import (ChatCompletionRequest, CompletionRequest, chat_logprob_options,
                                                  completion_logprob_options, openai_sampling_overrides, parse_openai)
from braid.runtime.server.sse import sse_event
from braid.runtime.server.tokenizer_manager import TokenizerManager

MSGS = [{"role": "user", "content": "hi"}]
CONTEXT = 8192


class CharTokenizer:
    """One token per character (ids below 100)."""

    chat_template = None

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 100 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def manager(vocab_size: int = 100) -> TokenizerManager:
    tm = TokenizerManager(ServerArgs())
    tm.served_model = ServedModel("m", "m", CharTokenizer(), context_len=CONTEXT, vocab_size=vocab_size)
    return tm


def prepare(tm: TokenizerManager, *args, **kw):
    return asyncio.run(tm.prepare(*args, **kw))


def chat(**body):
    return parse_openai(ChatCompletionRequest, {"model": "m", "messages": MSGS, **body})


def chat_sp(**body) -> SamplingParams:
    req = chat(**body)
    return prepare(manager(), "hi", openai_sampling_overrides(req), param_names=_param_names(req, "messages"),
                             max_new_tokens_fills_context=True).sampling_params


def native(body: dict, vocab_size: int = 100):
    return asyncio.run(prepare_generate(manager(vocab_size), parse_generate(body)))


def status_param(fn):
    with pytest.raises(APIError) as ei:
        fn()
    return ei.value.status, ei.value.param


def test_chat_fields_map_to_sampling_params():
    sp = chat_sp(max_tokens=7, temperature=0.5, top_p=0.9, n=2, stop="END", seed=3, presence_penalty=0.1,
                 frequency_penalty=0.2, top_k=5, min_p=0.05, repetition_penalty=1.1, ignore_eos=True,
                 stop_token_ids=[1, 2], min_tokens=2)
    assert (sp.max_new_tokens, sp.min_new_tokens, sp.temperature, sp.top_p, sp.n) == (7, 2, 0.5, 0.9, 2)
    assert sp.stop == ["END"] and sp.seed == 3 and sp.top_k == 5 and sp.min_p == 0.05
    assert sp.repetition_penalty == 1.1 and sp.ignore_eos and sp.stop_token_ids == [1, 2]
    assert (sp.presence_penalty, sp.frequency_penalty) == (0.1, 0.2)


def test_max_completion_tokens_wins_over_max_tokens():
    assert chat_sp(max_tokens=5, max_completion_tokens=9).max_new_tokens == 9
    assert chat_sp().max_new_tokens == CONTEXT - 2  # no max_tokens: the rest of the context


def test_unset_fields_keep_defaults():
    sp = chat_sp(temperature=None)
    assert sp.temperature == SamplingParams().temperature


def test_response_format_json_schema_and_json_object():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    sp = chat_sp(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert json.loads(sp.json_schema) == schema
    assert json.loads(chat_sp(response_format={"type": "json_object"}).json_schema) == {"type": "object"}
    assert chat_sp(response_format={"type": "text"}).json_schema is None
    assert chat_sp(regex="[0-9]+").regex == "[0-9]+"
    assert json.loads(chat_sp(json_schema=schema).json_schema) == schema


@pytest.mark.parametrize("body,param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"n": 0}, "n"),
    ({"n": 1000}, "n"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_completion_tokens": "x"}, "max_completion_tokens"),
    ({"stop_token_ids": [100]}, "stop_token_ids"),
    ({"temperature": "hot"}, "temperature"),
    ({"regex": "a", "json_schema": {"type": "object"}}, "regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
])
def test_bad_sampling_values_name_the_parameter(body, param):
    assert status_param(lambda: chat_sp(**body)) == (400, param)


def test_schema_errors():
    assert status_param(lambda: parse_openai(ChatCompletionRequest, [1, 2]))[0] == 400
    assert status_param(lambda: parse_openai(ChatCompletionRequest, {"model": "m"})) == (400, "messages")
    assert status_param(lambda: parse_openai(ChatCompletionRequest, {"messages": []})) == (400, "messages")
    assert status_param(lambda: parse_openai(ChatCompletionRequest, {"messages": [{"content": "x"}]})) == (400, "messages.0.role")
    assert status_param(lambda: parse_openai(CompletionRequest, {"prompt": 3})) == (400, "prompt")


def test_logprob_limits():
    assert chat_logprob_options(chat(logprobs=True, top_logprobs=20)) == (True, 20)
    assert chat_logprob_options(chat()) == (False, 0)
    assert status_param(lambda: chat_logprob_options(chat(logprobs=True, top_logprobs=21))) == (400, "top_logprobs")
    assert status_param(lambda: chat_logprob_options(chat(top_logprobs=2))) == (400, "top_logprobs")
    comp = lambda **b: parse_openai(CompletionRequest, {"prompt": "x", **b})
    assert completion_logprob_options(comp(logprobs=0)) == (True, 0)
    assert completion_logprob_options(comp()) == (False, 0)
    assert status_param(lambda: completion_logprob_options(comp(logprobs=21))) == (400, "logprobs")


def test_unsupported_features_are_rejected():
    assert status_param(lambda: parse_openai(CompletionRequest, {"prompt": "x", "suffix": "y"})) == (400, "suffix")
    comp = parse_openai(CompletionRequest, {"prompt": "x", "best_of": 1, "n": 2})
    assert status_param(lambda: openai_sampling_overrides(comp)) == (400, "best_of")


def test_completion_default_max_tokens_is_openais():
    req = parse_openai(CompletionRequest, {"prompt": "x"})
    assert openai_sampling_overrides(req)["max_new_tokens"] == 16


def test_parse_generate_single_batch_and_ids():
    g = parse_generate({"text": "a", "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    assert g.prompts == ["a"] and not g.is_batch and g.sampling_params[0]["max_new_tokens"] == 3
    g = parse_generate({"text": ["a", "b"], "rid": ["r1", "r2"], "stream": True})
    assert g.is_batch and g.rids == ["r1", "r2"] and g.stream and len(g.sampling_params) == 2
    g = parse_generate({"input_ids": [[1, 2], [3]], "sampling_params": [{"n": 2}, {"n": 2}]})
    assert g.prompts == [[1, 2], [3]] and g.sampling_params[1]["n"] == 2
    g = parse_generate({"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3,
                        "image_data": "data:image/png;base64,AAAA"})
    assert g.prompts == [[5, 6]] and g.return_logprob and g.top_logprobs_num == 3
    assert g.image_data == ["data:image/png;base64,AAAA"] and not g.is_video
    assert parse_generate({"text": "a", "image_data": ["f1", "f2"], "modalities": ["video"]}).is_video


def test_prepare_generate_builds_requests():
    reqs = native({"text": ["ab", "cd"], "sampling_params": [{"max_new_tokens": 3}, {"n": 2}], "rid": ["x", "y"],
                   "return_logprob": True, "logprob_start_len": 1, "top_logprobs_num": 2})
    assert [r.rid for r in reqs] == ["x", "y"] and reqs[0].input_ids == [ord("a"), ord("b")]
    assert reqs[0].sampling_params.max_new_tokens == 3 and reqs[1].sampling_params.n == 2
    assert reqs[1].sampling_params.max_new_tokens == SamplingParams().max_new_tokens  # the native default stays
    assert (reqs[0].return_logprob, reqs[0].logprob_start_len, reqs[0].top_logprobs_num) == (True, 1, 2)


@pytest.mark.parametrize("body,param", [
    ({}, "text"),
    ({"text": "a", "input_ids": [1]}, "text"),
    ({"text": 5}, "text"),
    ({"input_ids": [1, 100]}, "input_ids"),
    ({"input_ids": []}, "input_ids"),
    ({"text": ""}, "text"),
    ({"text": "a", "sampling_params": {"bogus": 1}}, "bogus"),
    ({"text": "a", "sampling_params": {"max_new_tokens": -2}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"max_new_tokens": CONTEXT}}, "max_new_tokens"),
    ({"text": "a" * CONTEXT}, "text"),
    ({"text": "a", "sampling_params": {"stop_token_ids": [100]}}, "stop_token_ids"),
    ({"text": "a", "sampling_params": "x"}, "sampling_params"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
    ({"text": "a", "top_logprobs_num": 21}, "top_logprobs_num"),
    ({"text": "a", "logprob_start_len": -2}, "logprob_start_len"),
    ({"text": "ab", "return_logprob": True, "logprob_start_len": 2}, "logprob_start_len"),
    ({"text": "a", "stream": "yes"}, "stream"),
    ({"text": ["a", "b"], "rid": ["x", "x"]}, "rid"),
    ({"text": "a", "temperature": 0}, "temperature"),
    ({"text": "a", "modalities": ["smell"]}, "modalities"),
    ({"text": "a", "image_data": "data:image/png;base64,AAAA"}, "image_data"),
    ({"text": "a", "image_data": ["f1"], "modalities": ["video"]}, "image_data"),
])
def test_native_request_errors(body, param):
    # vocab_size 100: the stand-in tokenizer's ids are all below it (the prompt's ids are checked against it too)
    assert status_param(lambda: native(body, vocab_size=100)) == (400, param)


def test_over_context_is_context_length_exceeded_in_the_routes_names():
    with pytest.raises(APIError) as ei:
        native({"text": "a", "sampling_params": {"max_new_tokens": CONTEXT}})
    assert ei.value.code == "context_length_exceeded" and "max_new_tokens" in ei.value.message
    req = chat(max_tokens=CONTEXT)
    with pytest.raises(APIError) as ei:
        prepare(manager(), "hi", openai_sampling_overrides(req), param_names=_param_names(req, "messages"))
    assert (ei.value.param, ei.value.code) == ("max_tokens", "context_length_exceeded")
    assert "max_tokens" in ei.value.message and "max_new_tokens" not in ei.value.message


def test_media_for_a_text_only_model_is_a_400_naming_the_model():
    for kind in ("image_data", "video_data", "audio_data"):
        with pytest.raises(APIError) as ei:
            prepare(manager(), "hi", None, param_names=_param_names(chat(), "messages"), **{kind: ["u"]})
        assert ei.value.status == 400 and ei.value.param == "messages"
        assert "model m takes no " + kind.split("_")[0] + " input" in ei.value.message


def test_error_objects():
    err = APIError("nope", 404, param="model", code="model_not_found")
    assert err.to_dict() == {"error": {"message": "nope", "type": "not_found_error", "param": "model",
                                       "code": "model_not_found"}}
    from braid.runtime.sampling_params import SamplingParamsError

    mapped = from_exception(SamplingParamsError("top_p: bad", "top_p"))
    assert (mapped.status, mapped.param, mapped.type) == (400, "top_p", "invalid_request_error")
    assert from_exception(RuntimeError("boom")).status == 500


def test_sse_event_format():
    assert sse_event({"text": "é", "lp": float("-inf")}) == 'data: {"text":"é","lp":null}\n\n'.encode()
