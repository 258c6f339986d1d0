"""Chat templates that iterate over content parts get them, on a real server of a tiny random LLaVA-OneVision checkpoint
with its own tokenizer and chat template: prompt token ids equal to HF's LlavaOnevisionProcessor after its
apply_chat_template, and greedy text equal to HF's generate, through /v1/chat/completions (the official openai client)
and through a DSL program on RuntimeEndpoint, LocalEngine and OpenAI; for a template that renders parts in place with a newline after each
image, and for the published OneVision-HF template (all images, then videos, then the text)."""

import base64
import io
from types import SimpleNamespace

import pytest
import torch
from real_server import start_server

from llava_tiny import make_tiny_llava_with_processor, test_image

API_KEY = "parts-key"
NEW_TOKENS = 6

IN_PLACE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
            "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
            "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>\n"
            "{% elif part['type'] == 'video' %}<video>\n{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# llava-hf/llava-onevision-qwen2-*-ov-hf's chat_template.json
MEDIA_FIRST = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + ' '}}{# Render all images first #}"
               "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>' }}"
               "{% endfor %}{# Render all video then #}"
               "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}{{ '<video>' }}"
               "{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}"
               "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
               "{{ '\n' + content['text'] }}{% endfor %}{% else %}"
               "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{% generation %}"
               "{{ '\n' + content['text'] }}{% endgeneration %}{% endfor %}{% endif %}{{'<|im_end|>'}}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module", params=["in_place", "media_first"])
def llava(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"llava_ov_{request.param}")
    template = {"in_place": IN_PLACE, "media_first": MEDIA_FIRST}[request.param]
    hf, processor = make_tiny_llava_with_processor(folder, template)
    srv = start_server(["--model-path", str(folder), "--max-total-tokens", "4096", "--api-key", API_KEY,
                       "--log-level", "warning", "--chunked-prefill-size", "-1"], API_KEY, "braid-parts-server-")
    yield SimpleNamespace(hf=hf, processor=processor, srv=srv, name=request.param, folder=str(folder))
    srv.stop()


@pytest.fixture(scope="module")
def local_engine(llava):
    import braid

    backend = braid.LocalEngine(llava.folder, max_total_tokens=4096, chunked_prefill_size=-1, log_level="warning")
    yield backend
    backend.shutdown()


def _data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# each case: the conversation as [(role, [part, ...])], a part a str (text), ("image", PIL) or ("video", [PIL, ...])
def _cases():
    frames = [test_image(48, 64, seed=10 + i) for i in range(4)]
    return {
        "one_image": [("user", [("image", test_image(70, 150, seed=1)), "What is shown?"])],
        "two_interleaved_images": [("user", ["First", ("image", test_image(90, 60, seed=2)), "then",
                                             ("image", test_image(60, 60, seed=3)), "which differs?"])],
        "video": [("user", [("video", frames), "What happens in the clip?"])],
        "image_then_text_turn": [("user", [("image", test_image(120, 50, seed=4)), "Describe it."]),
                                 ("assistant", ["It is a gradient."]), ("user", ["What color is it?"])],
    }


CASES = list(_cases())


def _hf_messages(conversation):
    return [{"role": role, "content": [{"type": "text", "text": p} if isinstance(p, str) else {"type": p[0]}
                                       for p in parts]} for role, parts in conversation]


def _openai_messages(conversation):
    def part(p):
        if isinstance(p, str):
            return {"type": "text", "text": p}
        if p[0] == "image":
            return {"type": "image_url", "image_url": {"url": _data_url(p[1])}}
        return {"type": "video_url", "video_url": {"frames": [_data_url(f) for f in p[1]]}}

    return [{"role": role, "content": [part(p) for p in parts]} for role, parts in conversation]


def _hf_reference(llava, conversation):
    """(prompt ids, greedy text) from HF: the processor's chat template, its placeholder expansion, generate."""
    media = [p for _, parts in conversation for p in parts if not isinstance(p, str)]
    images = [p[1] for p in media if p[0] == "image"]
    videos = [p[1] for p in media if p[0] == "video"]
    text = llava.processor.apply_chat_template(_hf_messages(conversation), add_generation_prompt=True, tokenize=False)
    # images nested per prompt, as apply_chat_template(tokenize=True) passes them (one prompt, several images)
    inputs = llava.processor(text=[text], images=[images] if images else None, videos=videos or None,
                             return_tensors="pt")
    with torch.no_grad():
        out = llava.hf.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                pad_token_id=0)
    ids = inputs["input_ids"][0].tolist()
    return ids, llava.processor.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


@pytest.mark.parametrize("case", CASES)
def test_chat_completions_match_hf(llava, case):
    import openai

    conversation = _cases()[case]
    want_ids, want_text = _hf_reference(llava, conversation)
    client = openai.OpenAI(base_url=llava.srv.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
    chat = client.chat.completions.create(model="default", messages=_openai_messages(conversation), temperature=0,
                                          max_tokens=NEW_TOKENS, extra_body={"prompt_logprobs": 0, "ignore_eos": True})
    # prompt_logprobs: None for the first token, then {its id: ...}
    ids = [int(next(iter(entry))) for entry in chat.model_extra["prompt_logprobs"][1:]]
    assert chat.usage.prompt_tokens == len(want_ids)
    assert ids == want_ids[1:]
    assert chat.choices[0].message.content == want_text


def _dsl_program(logprobs=True):
    import braid

    extra = {"return_logprob": True, "logprob_start_len": 0} if logprobs else {}

    def content(parts):
        node = None
        for p in parts:
            item = p if isinstance(p, str) else braid.image(p[1]) if p[0] == "image" else braid.video(p[1], len(p[1]))
            node = item if node is None else node + item
        return node

    @braid.function
    def conversation_program(s, conversation):
        for role, parts in conversation:
            s += getattr(braid, role)(content(parts))
        s += braid.assistant(braid.gen("answer", max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, **extra))

    return conversation_program


@pytest.mark.parametrize("case", CASES)
def test_dsl_program_matches_hf(llava, case):
    import braid

    conversation = _cases()[case]
    want_ids, want_text = _hf_reference(llava, conversation)
    backend = braid.RuntimeEndpoint(llava.srv.base_url, api_key=API_KEY)
    state = _dsl_program().run(conversation, backend=backend)
    meta = state.get_meta_info("answer")
    assert [t for _, t, *_ in meta["input_token_logprobs"]] == want_ids
    assert state["answer"] == want_text


@pytest.mark.parametrize("case", CASES)
def test_dsl_program_on_the_in_process_engine_matches_hf(llava, local_engine, case):
    """braid.LocalEngine renders the role blocks with the model's template through Engine.apply_chat_template, as
    RuntimeEndpoint does through the server: HF's prompt ids and greedy text."""
    conversation = _cases()[case]
    want_ids, want_text = _hf_reference(llava, conversation)
    assert local_engine.get_model_info()["chat_template_content_format"] == "openai"
    state = _dsl_program().run(conversation, backend=local_engine)
    meta = state.get_meta_info("answer")
    assert [t for _, t, *_ in meta["input_token_logprobs"]] == want_ids
    assert state["answer"] == want_text


@pytest.mark.parametrize("case", CASES)
def test_dsl_program_on_openai_backend_matches_hf(llava, case):
    """braid.OpenAI sends the role blocks as image_url / video_url content parts to /v1/chat/completions: the
    prompt the server builds has HF's length and the greedy text is HF's."""
    import braid

    conversation = _cases()[case]
    want_ids, want_text = _hf_reference(llava, conversation)
    backend = braid.OpenAI("default", base_url=llava.srv.base_url + "/v1", api_key=API_KEY, is_chat_model=True)
    state = _dsl_program(logprobs=False).run(conversation, backend=backend)
    assert state.get_meta_info("answer")["prompt_tokens"] == len(want_ids)
    assert state["answer"] == want_text


def test_placeholder_count_and_render_route(llava):
    """The pixels go where the template's placeholders are, so their count must match the media parts: a literal
    <image> in a text part beside one image part is a 400 naming both counts. /apply_chat_template renders what the
    chat route would and refuses malformed messages; /get_server_info shows the flag."""
    png = _data_url(test_image(20, 20, seed=0))
    r = llava.srv.post("/v1/chat/completions", json={"model": "default", "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "an <image> tag:"},
                                     {"type": "image_url", "image_url": {"url": png}}]}]})
    assert r.status_code == 400, r.text
    assert "rendered 2 <image> placeholder(s) for 1 image part(s)" in r.json()["error"]["message"]
    assert llava.srv.get("/get_server_info").json()["kv_used_tokens"] == 0
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image"}]}]
    r = llava.srv.post("/apply_chat_template", json={"messages": messages})
    assert r.status_code == 200 and r.json()["content_format"] == "openai"
    assert r.json()["text"] == llava.processor.apply_chat_template(messages, add_generation_prompt=True,
                                                                   tokenize=False)
    for bad in ([{"role": "user", "content": [{"type": "image_url"}]}], [{"role": "user"}, 3], [],
                [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": 5}]):
        r = llava.srv.post("/apply_chat_template", json={"messages": bad})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages"), (bad, r.text)
    info = llava.srv.get("/get_server_info").json()
    assert info["chat_template_content_format"] == "auto"
    assert llava.srv.get("/get_model_info").json()["chat_template_content_format"] == "openai"
