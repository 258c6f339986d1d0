"""Tool calling on /v1/chat/completions: tool definitions and validation, rendering into the prompt (the template's
own or braid's <tool_call> format), parsing (whole and streamed), and on a real SmolLM2 server tool_choice
"required" and named giving schema-valid calls for every one of 50 samples at temperature 1.0."""

import json

import jsonschema
import openai
import pytest
from real_server import start_server

from braid.runtime.server.errors import APIError
from braid.runtime.server.openai_protocol import ChatMessage
from braid.runtime.server.tools import (ToolStream, history_for_template, parse_auto, parse_constrained, plan_tools,
                                        template_knows_tools)

API_KEY = "tools-key"
FLAGS = ["--max-total-tokens", "4096", "--api-key", API_KEY, "--log-level", "warning"]

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 16},
                                           "limit": {"enum": [1, 5, 10]}},
          "required": ["query"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": SEARCH}}]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


def status_param(fn):
    with pytest.raises(APIError) as ei:
        fn()
    return ei.value.status, ei.value.param


# ---- without a server ------------------------------------------------------------------------------------


def test_tool_definitions_and_choice_are_validated():
    assert plan_tools(None, None, None) is None
    assert plan_tools(TOOLS, None, None).choice == "auto"
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "search"}}, False)
    assert named.choice == "named" and named.named == "search" and named.constrained and not named.parallel
    assert named.call_schema()["properties"]["name"] == {"const": "search"}
    assert len(plan_tools(TOOLS, "required", None).call_schema()["anyOf"]) == 2
    assert status_param(lambda: plan_tools(None, "required", None)) == (400, "tool_choice")
    assert status_param(lambda: plan_tools(TOOLS, {"type": "function", "function": {"name": "nope"}}, None)) == (
        400, "tool_choice")
    assert status_param(lambda: plan_tools(TOOLS, "sometimes", None)) == (400, "tool_choice")
    assert status_param(lambda: plan_tools([{"type": "code"}], None, None)) == (400, "tools.0")
    bad_name = [{"type": "function", "function": {"name": "has space"}}]
    assert status_param(lambda: plan_tools(bad_name, None, None)) == (400, "tools.0.function.name")
    assert status_param(lambda: plan_tools(TOOLS + TOOLS[:1], None, None)) == (400, "tools")
    extra_key = [{"type": "function", "function": {**TOOLS[0]["function"], "examples": []}}]
    assert status_param(lambda: plan_tools(extra_key, None, None)) == (400, "tools.0")
    assert status_param(lambda: plan_tools([{**TOOLS[0], "cache": True}], None, None)) == (400, "tools.0")
    strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
    assert status_param(lambda: plan_tools(strict, "auto", None)) == (400, "tools.0.function.strict")
    assert plan_tools(strict, "required", None).constrained  # held to the schema: strict is what it does


def test_parsing_whole_outputs():
    plan = plan_tools(TOOLS, "auto", None)
    text = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' \
           '</tool_call>'
    content, calls = parse_auto(text, plan)
    assert content == "Let me check." and len(calls) == 1
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert parse_auto("no calls here", plan) == ("no calls here", [])
    broken = '<tool_call>{"name": "get_weather", "arguments": </tool_call>'
    assert parse_auto(broken, plan) == (broken, [])  # a block that does not parse stays text
    two = text + '<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>'
    assert len(parse_auto(two, plan)[1]) == 2
    assert len(parse_auto(two, plan_tools(TOOLS, "auto", False))[1]) == 1  # parallel_tool_calls=false
    call = parse_constrained('{"name":"search","arguments":{"query":"cats"}}')
    assert call["function"] == {"name": "search", "arguments": '{"query":"cats"}'}  # as written
    assert parse_constrained('{"name":"search","argu') is None


def _assemble(deltas: list) -> tuple[str, list]:
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for c in d.get("tool_calls", []):
            slot = calls.setdefault(c["index"], {"name": "", "arguments": ""})
            if "id" in c:
                slot["id"] = c["id"]
            slot["name"] += c.get("function", {}).get("name", "")
            slot["arguments"] += c.get("function", {}).get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_pieces_assemble_to_the_whole(step):
    constrained = ToolStream(plan_tools(TOOLS, "required", None))
    text = '{"name":"get_weather","arguments":{"city":"Rome","unit":"celsius"}}'
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    deltas = [d for j, p in enumerate(pieces) for d in constrained.feed(p, j == len(pieces) - 1)]
    content, calls = _assemble(deltas)
    assert content == "" and len(calls) == 1 and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Rome", "unit": "celsius"} and calls[0]["id"]
    auto = ToolStream(plan_tools(TOOLS, "auto", None))
    text = 'Sure. <tool_call>{"name": "search", "arguments": {"query": "q"}}</tool_call> <tool_c'
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    deltas = [d for j, p in enumerate(pieces) for d in auto.feed(p, j == len(pieces) - 1)]
    content, calls = _assemble(deltas)
    assert content == "Sure.  <tool_c"  # the unfinished marker is text once the output ends
    assert [c["name"] for c in calls] == ["search"] and json.loads(calls[0]["arguments"]) == {"query": "q"}


def test_history_is_rendered_in_braids_format_or_given_to_the_template():
    raw = [ChatMessage(role="user", content="Weather?"),
           ChatMessage(role="assistant", content=None, tool_calls=[{"id": "call_1", "type": "function", "function": {
               "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]),
           ChatMessage(role="tool", content="-3 C", tool_call_id="call_1")]
    messages = [{"role": m.role, "content": m.content or ""} for m in raw]
    plan = plan_tools(TOOLS, "auto", None)
    fallback = history_for_template(messages, raw, plan, native_tools=False)
    assert fallback[0]["role"] == "system" and "get_weather" in fallback[0]["content"] and "<tool_call>" in fallback[0]["content"]
    assert fallback[2]["content"] == '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": ' \
                                     '"celsius"}}</tool_call>'
    assert fallback[3] == {"role": "user", "content": "<tool_response>\n-3 C\n</tool_response>"}
    native = history_for_template(messages, raw, plan, native_tools=True)
    assert len(native) == 3 and native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo",
                                                                                        "unit": "celsius"}
    assert native[2]["tool_call_id"] == "call_1"
    assert not template_knows_tools("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert template_knows_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert history_for_template(messages, raw, plan_tools(TOOLS, "none", None), False)[0]["role"] == "user"
    # a template without a system role (Gemma's): the instructions open the first user turn, the turns alternate
    no_system = history_for_template(messages, raw, plan, native_tools=False, system_role=False)
    assert [m["role"] for m in no_system] == ["user", "assistant", "user"]
    assert no_system[0]["content"] == fallback[0]["content"] + "\n\nWeather?"


TOOLS_TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
                  "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% for c in m.tool_calls or [] %}"
                  "<call {{ c.function.name }} {{ c.function.arguments.city }}>{% endfor %}{% endfor %}"
                  "{% if add_generation_prompt %}[assistant]{% endif %}")


def test_a_template_that_reads_tools_renders_them_and_the_history():
    import asyncio

    from braid.runtime.config import ServerArgs
    from braid.runtime.loader.tokenizer import get_tokenizer
    from braid.runtime.chat_format import with_chat_template
    from braid.runtime.server.tokenizer_manager import TokenizerManager

    tm = TokenizerManager(ServerArgs())
    tm.tokenizer = with_chat_template(get_tokenizer(ServerArgs()), TOOLS_TEMPLATE)
    assert template_knows_tools(tm.tokenizer.chat_template)
    raw = [ChatMessage(role="user", content="Weather?"),
           ChatMessage(role="assistant", content=None, tool_calls=[{"id": "c1", "type": "function", "function": {
               "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]),
           ChatMessage(role="tool", content="-3 C", tool_call_id="c1")]
    messages = history_for_template([{"role": m.role, "content": m.content or ""} for m in raw], raw,
                                    plan_tools(TOOLS, "auto", None), native_tools=True)
    text = asyncio.run(tm.apply_chat_template(messages, tools=TOOLS))
    assert text == ("<tools>get_weather;search;</tools>[user]Weather?[assistant]<call get_weather Oslo>[tool]-3 C"
                    "[assistant]")
    assert asyncio.run(tm.apply_chat_template(messages[:1], add_generation_prompt=False)) == "[user]Weather?"


# ---- a real server -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    srv = start_server(FLAGS, API_KEY, "braid-tools-")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def _check_call(call, expected_name=None):
    assert call.type == "function" and call.id.startswith("call_")
    if expected_name is not None:
        assert call.function.name == expected_name
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("tool_choice,name", [("required", None),
                                              ({"type": "function", "function": {"name": "search"}}, "search")])
def test_constrained_choice_gives_schema_valid_calls_at_temperature_1(client, tool_choice, name):
    samples = []
    for seed in (1, 2):  # 2 requests x 25 samples, decoded together
        r = client.chat.completions.create(model="default", messages=MSGS, tools=TOOLS, tool_choice=tool_choice,
                                           temperature=1.0, n=25, seed=seed, max_tokens=60)
        samples += r.choices
    assert len(samples) == 50
    for c in samples:
        assert c.finish_reason == "tool_calls" and c.message.content is None, c.message
        assert len(c.message.tool_calls) == 1
        _check_call(c.message.tool_calls[0], name)


def test_constrained_call_streams_as_deltas(client):
    stream = client.chat.completions.create(model="default", messages=MSGS, tools=TOOLS, tool_choice="required",
                                            temperature=0, max_tokens=60, stream=True)
    chunks = list(stream)
    deltas = [c.choices[0].delta.model_dump(exclude_none=True) for c in chunks if c.choices]
    content, calls = _assemble(deltas)
    assert content == "" and len(calls) == 1 and sum("tool_calls" in d for d in deltas) >= 2  # name, then arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    whole = client.chat.completions.create(model="default", messages=MSGS, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=60).choices[0].message.tool_calls[0]
    assert calls[0]["name"] == whole.function.name and calls[0]["arguments"] == whole.function.arguments


AUTO_CALL = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "unit": "celsius"\}\}</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_calls_the_model_writes(client, stream):
    # a regex makes SmolLM2 write a call in the format braid's tool prompt asks for
    r = client.chat.completions.create(model="default", messages=MSGS, tools=TOOLS, temperature=1.0, max_tokens=60,
                                       stream=stream, extra_body={"regex": AUTO_CALL})
    if stream:
        chunks = list(r)
        content, calls = _assemble([c.choices[0].delta.model_dump(exclude_none=True) for c in chunks if c.choices])
        assert content == "" and len(calls) == 1 and calls[0]["name"] == "get_weather"
        assert json.loads(calls[0]["arguments"])["city"] in ("Paris", "Rome")
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    else:
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        _check_call(c.message.tool_calls[0], "get_weather")


def test_tools_are_rendered_and_none_leaves_them_out(client):
    def prompt_tokens(**kw):
        return client.chat.completions.create(model="default", messages=kw.pop("messages", MSGS), max_tokens=1,
                                              temperature=0, **kw).usage.prompt_tokens

    plain = prompt_tokens()
    assert prompt_tokens(tools=TOOLS) > plain + 40  # the tool descriptions are in the prompt
    assert prompt_tokens(tools=TOOLS, tool_choice="none") == plain
    history = MSGS + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    assert prompt_tokens(tools=TOOLS, messages=history) > prompt_tokens(tools=TOOLS) + 20
    r = client.chat.completions.create(model="default", messages=MSGS, tools=TOOLS, max_tokens=3, temperature=0)
    assert r.choices[0].message.tool_calls in (None, []) or r.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("kw,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": 3}}]}, "tools.0.function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "extra_body": {"guided_regex": "a"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {
        "type": "object", "properties": {"a": {"type": "blob"}}}}}], "tool_choice": "required"}, "tools"),
])
def test_bad_tool_requests_are_400s_and_the_server_keeps_serving(client, kw, param):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model="default", messages=MSGS, max_tokens=2, **kw)
    assert ei.value.body["param"] == param if "param" in ei.value.body else ei.value.body["error"]["param"] == param
    ok = client.chat.completions.create(model="default", messages=MSGS, max_tokens=1, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")
