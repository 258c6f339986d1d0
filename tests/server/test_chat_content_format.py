"""Text models and --chat-template-content-format: a template that iterates over content parts gets them (text parts
kept apart, for the template to join), a string-only template gets one text as before; detection from the Jinja tree;
SmolLM2's, Gemma's and Qwen's templates render content parts exactly as the text joined. Real SmolLM2 servers."""

import pytest
from real_server import start_server

from braid.runtime.chat_format import detect_content_format, in_content_format, resolve_content_format

API_KEY = "format-key"
# takes either shape and says which it got
EITHER = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}[S]{{ m['content'] }}"
          "{% else %}{% for p in m['content'] %}[P]{{ p['text'] }}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen2.5-Instruct's template, its tool branches cut to their loops (over tools and tool_calls, not content)
QWEN25 = ("{%- if tools %}{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}{%- else %}"
          "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
          "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a "
          "helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}{%- for message in messages %}"
          "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
          "(message.role == 'assistant' and not message.tool_calls) %}{{- '<|im_start|>' + message.role + '\\n' + "
          "message.content + '<|im_end|>' + '\\n' }}{%- elif message.role == 'assistant' %}"
          "{%- for tool_call in message.tool_calls %}{{- tool_call.function.name }}{%- endfor %}{%- endif %}"
          "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
PARTS = [{"type": "text", "text": "Name a color"}, {"type": "text", "text": " of the sky."}]


def test_detection_from_the_jinja_tree():
    from braid.runtime.loader.tokenizer import load_tokenizer
    from braid.runtime.chat_format import NAMED_CHAT_TEMPLATES

    strings = [load_tokenizer("smollm2").chat_template, QWEN25, *NAMED_CHAT_TEMPLATES.values(),
               "{% for m in messages %}{{ m['content'] | trim }}{% endfor %}", "{% for x in"]
    assert [detect_content_format(t) for t in strings] == ["string"] * len(strings)
    loops = ["{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}",
             "{% for m in messages %}{% for p in m.content | selectattr('type', 'equalto', 'text') %}{% endfor %}"
             "{% endfor %}",
             "{% set rest = messages[1:] %}{% for m in rest %}{% for p in m['content'][1:] %}{% endfor %}{% endfor %}",
             "{% for m in messages %}{% set c = m.content %}{% for p in c %}{% endfor %}{% endfor %}",
             "{% set last = messages[-1] %}{% for p in last['content'] %}{% endfor %}", EITHER]
    assert [detect_content_format(t) for t in loops] == ["openai"] * len(loops)
    assert resolve_content_format("string", EITHER) == "string"
    assert resolve_content_format("openai", QWEN25) == "openai"
    assert resolve_content_format("auto", None) == "string"


def test_string_templates_render_parts_as_the_joined_text():
    """SmolLM2's, Gemma's (gemma-it) and Qwen's templates are string-format: parts reach them as the text joined,
    so the prompt is the one the same text as a string gives."""
    from braid.runtime.loader.tokenizer import load_tokenizer
    from braid.runtime.chat_format import NAMED_CHAT_TEMPLATES

    tokenizer = load_tokenizer("smollm2")
    for template in (tokenizer.chat_template, NAMED_CHAT_TEMPLATES["gemma-it"], NAMED_CHAT_TEMPLATES["qwen"], QWEN25):
        fmt = detect_content_format(template)
        parts = in_content_format([{"role": "user", "content": PARTS}], fmt)
        joined = [{"role": "user", "content": "Name a color of the sky."}]
        assert tokenizer.apply_chat_template(parts, chat_template=template, tokenize=False) == \
            tokenizer.apply_chat_template(joined, chat_template=template, tokenize=False)
    with pytest.raises(ValueError, match="not one of string, openai"):
        in_content_format([], "auto")


@pytest.fixture(scope="module", params=["either_auto", "either_string", "smollm2_own"])
def text_server(request, tmp_path_factory):
    flags = ["--model-path", "smollm2", "--max-total-tokens", "2048", "--api-key", API_KEY, "--log-level", "warning"]
    if request.param != "smollm2_own":
        path = tmp_path_factory.mktemp("template") / "either.jinja"
        path.write_text(EITHER)
        flags += ["--chat-template", str(path)]
    if request.param == "either_string":
        flags += ["--chat-template-content-format", "string"]
    srv = start_server(flags, API_KEY, "braid-format-server-")
    srv.param = request.param
    yield srv
    srv.stop()


def test_chat_prompt_is_the_templates_rendering_of_the_parts(text_server):
    import openai

    from braid.runtime.loader.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("smollm2")
    want = {"either_auto": "<|im_start|>user\n[P]Name a color[P] of the sky.<|im_end|>\n<|im_start|>assistant\n",
            "either_string": "<|im_start|>user\n[S]Name a color of the sky.<|im_end|>\n<|im_start|>assistant\n",
            "smollm2_own": tokenizer.apply_chat_template([{"role": "user", "content": "Name a color of the sky."}],
                                                         add_generation_prompt=True, tokenize=False)}[text_server.param]
    info = text_server.get("/get_server_info").json()
    assert info["chat_template_content_format"] == ("string" if text_server.param == "either_string" else "auto")
    assert text_server.get("/get_model_info").json()["chat_template_content_format"] == \
        ("openai" if text_server.param == "either_auto" else "string")
    client = openai.OpenAI(base_url=text_server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    chat = client.chat.completions.create(model="default", messages=[{"role": "user", "content": PARTS}],
                                          temperature=0, max_tokens=8)
    native = text_server.post("/generate", json={"text": want, "sampling_params": {"temperature": 0,
                                                                                   "max_new_tokens": 8}}).json()
    assert chat.usage.prompt_tokens == native["meta_info"]["prompt_tokens"] == len(tokenizer.encode(want))
    assert chat.choices[0].message.content == native["text"]
    if text_server.param == "smollm2_own":  # a string template: parts and the joined string are one prompt
        as_string = client.chat.completions.create(model="default", temperature=0, max_tokens=8, messages=[
            {"role": "user", "content": "Name a color of the sky."}])
        assert as_string.choices[0].message.content == chat.choices[0].message.content
        assert as_string.usage.prompt_tokens == chat.usage.prompt_tokens


def test_bad_flag_value_is_refused():
    from braid.runtime.config import ServerArgs

    with pytest.raises(ValueError, match="chat_template_content_format 'parts' is not one of auto, string, openai"):
        ServerArgs.from_kwargs(model_path="smollm2", chat_template_content_format="parts")
