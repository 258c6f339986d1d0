"""Request validation on the session server (SmolLM2): keys nested in messages, content parts and response_format,
malformed content parts, /generate's logprob options without return_logprob, `user`'s type, unsupported parameters
sent as null, and `rid` on /v1 as on /generate. Every 400 is an OpenAI error object naming the parameter at fault,
and a value that asks for nothing is served."""

import json

import openai
import pytest

from braid.runtime.multimodal.media import MediaError, MediaLimits, load_image

MSG = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**kw) -> dict:
    return {"messages": MSG, "max_tokens": 2, "temperature": 0, **kw}


def error_of(server, path: str, body: dict) -> dict:
    r = server.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    return err


def served(server, path: str, body: dict) -> dict:
    r = server.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def part(**kw) -> list:
    return [{"role": "user", "content": [kw]}]


# ---- 1: unknown keys inside nested objects ----------------------------------------------------------------------

NESTED_UNKNOWN = [
    ("json_schema with json_object", chat(response_format={"type": "json_object", "json_schema": {
        "name": "x", "schema": SCHEMA}}), "response_format.json_schema", "json_schema"),
    ("response_format key", chat(response_format={"type": "json_object", "foo": 1}), "response_format.foo", "foo"),
    ("json_schema key", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA, "foo": 1}}), "response_format.json_schema.foo", "foo"),
    ("message key", chat(messages=[{"role": "user", "content": "hi", "foo": 1}]), "messages.0.foo", "foo"),
    ("content part key", chat(messages=part(type="text", text="hi", foo=2)), "messages.0.content.0.foo", "foo"),
    ("image_url key", chat(messages=part(type="image_url", image_url={"url": "data:,", "foo": 3})),
     "messages.0.content.0.image_url.foo", "foo"),
    ("refusal given", chat(messages=[{"role": "assistant", "content": "x", "refusal": "no"}, *MSG]),
     "messages.0.refusal", "refusal"),
    ("function_call in a message", chat(messages=[
        {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}, *MSG]),
     "messages.0.function_call", "function_call"),
]


@pytest.mark.parametrize("body,param,key", [c[1:] for c in NESTED_UNKNOWN], ids=[c[0] for c in NESTED_UNKNOWN])
def test_unknown_or_unrendered_nested_keys_are_400s_naming_them(server, body, param, key):
    err = error_of(server, "/v1/chat/completions", body)
    assert err["param"] == param and key in err["message"], err
    served(server, "/v1/chat/completions", chat())


def test_keys_openai_defines_are_served(openai_client):
    # what openai's ChatCompletionMessage.model_dump() sends back as history: the unrendered keys all null
    history = [{"role": "user", "content": "Say yes."},
               {"role": "assistant", "content": "yes", "refusal": None, "audio": None, "function_call": None,
                "tool_calls": None, "name": None, "annotations": None},
               {"role": "user", "content": [{"type": "text", "text": "Give JSON."}]}]
    r = openai_client.chat.completions.create(
        model="default", messages=history, max_tokens=12, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "obj", "schema": SCHEMA, "strict": True,
                                                               "description": "one integer"}})
    assert isinstance(json.loads(r.choices[0].message.content)["a"], int)


# ---- 2: malformed content parts say what is wrong ---------------------------------------------------------------

MALFORMED_PARTS = [
    ("image_url as a string", {"type": "image_url", "image_url": "data:image/png;base64,AAAA"},
     "messages.0.content.0.image_url", "content part 'image_url' needs an object as 'image_url', got a string"),
    ("image_url null", {"type": "image_url", "image_url": None},
     "messages.0.content.0.image_url", "content part 'image_url' needs an object as 'image_url', got null"),
    ("image_url without url", {"type": "image_url", "image_url": {"detail": "low"}},
     "messages.0.content.0.image_url.url", "image_url.url must be a string"),
    ("text as a number", {"type": "text", "text": 123},
     "messages.0.content.0.text", "content part 'text' needs a string 'text', got a number"),
    ("video with frames and url", {"type": "video_url", "video_url": {"frames": ["a"], "url": "b"}},
     "messages.0.content.0.video_url", "exactly one of frames"),
    ("unknown part type", {"type": "file", "file": {}}, "messages.0.content.0.type", "'file' is not supported"),
    ("part type a list", {"type": ["text"], "text": "hi"}, "messages.0.content.0.type", "is not supported"),
]


@pytest.mark.parametrize("content,param,says", [c[1:] for c in MALFORMED_PARTS], ids=[c[0] for c in MALFORMED_PARTS])
def test_malformed_content_part_names_its_shape(server, content, param, says):
    err = error_of(server, "/v1/chat/completions", chat(messages=[{"role": "user", "content": [content]}]))
    assert err["param"] == param and says in err["message"], err
    assert "unsupported content part" not in err["message"]


RAW_PNG_BASE64 = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA"
RAW_JPEG_BASE64 = "/9j/4AAQSkZJRgABAQAAAQABAAD/2wBDAAgGBgcGBQgHBwcJCQgKDBQNDAsLDBkSEw8UHRofHh0aHBwg"  # starts with "/"


@pytest.mark.parametrize("source", ["", "   ", RAW_PNG_BASE64, RAW_JPEG_BASE64, "hello"])
def test_media_that_is_no_url_or_path_says_how_to_send_an_image(source):
    with pytest.raises(MediaError) as ei:
        load_image(source, MediaLimits())
    message = str(ei.value)
    assert "data:image/png;base64," in message and "--allowed-local-media-path" not in message, message
    if len(source) > 60:
        assert "raw base64" in message


@pytest.mark.parametrize("source", ["/srv/cat.png", "./cat.png", "../up/cat.png", "file:///srv/cat.png", "cat.jpg",
                                    "images/cat"])
def test_media_that_looks_like_a_path_says_local_files_are_disabled(source):
    with pytest.raises(MediaError) as ei:
        load_image(source, MediaLimits())
    assert "local media files are disabled on this server (--allowed-local-media-path)" in str(ei.value)


# ---- 3: /generate's logprob options need return_logprob ---------------------------------------------------------

@pytest.mark.parametrize("options,param", [
    ({"top_logprobs_num": 3}, "top_logprobs_num"),
    ({"logprob_start_len": 0}, "logprob_start_len"),
    ({"return_text_in_logprobs": True}, "return_text_in_logprobs"),
    ({"return_logprob": False, "top_logprobs_num": 2}, "top_logprobs_num"),
    ({"return_logprob": True, "return_text_in_logprobs": "false"}, "return_text_in_logprobs"),
    ({"return_logprob": "true"}, "return_logprob"),
])
def test_generate_logprob_options_without_return_logprob_are_400s(server, options, param):
    err = error_of(server, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1}, **options})
    assert err["param"] == param, err
    if param != "return_logprob" and "return_logprob" not in options:
        assert "needs return_logprob" in err["message"]


def test_generate_logprob_options_that_ask_for_nothing_or_come_with_return_logprob_are_served(server):
    out = served(server, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1}, "top_logprobs_num": 0,
                                       "logprob_start_len": -1, "return_text_in_logprobs": False, "stream": None})
    assert "output_token_logprobs" not in out["meta_info"]
    out = served(server, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "return_logprob": True,
                                       "top_logprobs_num": 2, "logprob_start_len": None,
                                       "return_text_in_logprobs": False})
    lp = out["meta_info"]["output_token_logprobs"]
    assert len(lp) == out["meta_info"]["completion_tokens"] and all(len(entry) == 2 for entry in lp)  # no text


# ---- 4 and 5: `user`'s type; unsupported parameters as null -----------------------------------------------------

@pytest.mark.parametrize("user", [5, {}, ["me"], True])
def test_user_must_be_a_string(server, user):
    err = error_of(server, "/v1/chat/completions", chat(user=user))
    assert err["param"] == "user" and "must be a string" in err["message"]
    served(server, "/v1/completions", {"prompt": "x", "max_tokens": 1, "user": None})
    served(server, "/v1/chat/completions", chat(user="someone"))


ASK_FOR_NOTHING = {"metadata": None, "functions": None, "function_call": None, "audio": None, "prediction": None,
                   "service_tier": None, "reasoning_effort": None, "web_search_options": None, "chat_template": None,
                   "documents": None, "request_id": None, "guided_grammar": None, "modalities": None,
                   "logits_processors": None, "mm_processor_kwargs": None}
ASK_FOR_NOTHING_TOO = {"metadata": {}, "functions": [], "function_call": "none", "service_tier": "auto",
                       "modalities": ["text"], "documents": [], "logits_processors": [], "mm_processor_kwargs": {}}


def test_unsupported_parameters_that_ask_for_nothing_are_served(openai_client):
    for extra in (ASK_FOR_NOTHING, ASK_FOR_NOTHING_TOO):
        r = openai_client.chat.completions.create(model="default", messages=MSG, max_tokens=1, extra_body=extra)
        assert r.choices[0].finish_reason in ("stop", "length")
    r = openai_client.completions.create(model="default", prompt="x", max_tokens=1, extra_body={"suffix": None,
                                                                                                "metadata": None})
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("extra", [{"metadata": {"k": "v"}}, {"functions": [{"name": "f"}]}, {"service_tier": "flex"},
                                   {"modalities": ["text", "audio"]}, {"use_beam_search": 0}, {"prediction": {}}])
def test_unsupported_parameters_that_ask_for_something_are_400s(openai_client, extra):
    with pytest.raises(openai.BadRequestError) as ei:
        openai_client.chat.completions.create(model="default", messages=MSG, max_tokens=1, extra_body=extra)
    err = ei.value.body if "param" in ei.value.body else ei.value.body["error"]
    assert err["param"] == next(iter(extra)) and err["code"] == "unsupported_parameter", err


# ---- 6: rid on /v1 as on /generate ------------------------------------------------------------------------------

@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": ["a", "b"], "rid": "batchrid"}),
    ("/v1/completions", {"prompt": "a", "rid": ""}),
    ("/v1/completions", {"prompt": ["a", "b"], "rid": ["same", "same"]}),
    ("/v1/completions", {"prompt": ["a", "b"], "rid": ["only-one"]}),
    ("/v1/chat/completions", {"messages": MSG, "rid": ""}),
    ("/generate", {"text": ["a", "b"], "rid": "batchrid"}),
    ("/generate", {"text": "a", "rid": ""}),
])
def test_rid_that_names_no_single_request_is_a_400(server, path, body):
    err = error_of(server, path, {**body, **({"sampling_params": {"max_new_tokens": 1}} if path == "/generate"
                                              else {"max_tokens": 1})})
    assert err["param"] == "rid", err


def test_batch_completion_takes_one_rid_per_prompt_as_generate_does(server):
    out = served(server, "/v1/completions", {"prompt": ["a", "b"], "rid": ["cmp-first", "cmp-second"], "n": 2,
                                             "max_tokens": 1})
    assert out["id"] == "cmpl-cmp-first" and len(out["choices"]) == 4
    one = served(server, "/v1/completions", {"prompt": "a", "rid": "cmp-single", "max_tokens": 1})
    assert one["id"] == "cmpl-cmp-single"
    native = served(server, "/generate", {"text": ["a", "b"], "rid": ["gen-first", "gen-second"],
                                          "sampling_params": {"max_new_tokens": 1}})
    assert [r["meta_info"]["id"] for r in native] == ["gen-first", "gen-second"]
