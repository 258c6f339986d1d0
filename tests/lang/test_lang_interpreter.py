import io
import json
import re

import pytest
from PIL import Image as PILImage

import braid
from braid import ir
from braid.backends.base import CAP_GEN, CAP_FORK
from braid.chat_template import CHATML, LLAMA3
from braid.interpreter import _DISPATCH, StreamExecutor

from lang_scripted_backend import ScriptedBackend


def test_every_node_type_has_exactly_one_visit_method():
    assert set(_DISPATCH) == set(ir.NODE_TYPES)
    visit_methods = [n for n in vars(StreamExecutor) if n.startswith("visit_")]
    assert len(visit_methods) == len(ir.NODE_TYPES)


def test_text_and_gen_append_and_set_variables(backend):
    @braid.function
    def prog(s, topic):
        s += "Topic: " + topic + "\n"
        s += "Answer: " + braid.gen("answer", max_tokens=5)

    state = prog.run(topic="cats", backend=backend)
    prompt_len = len("Topic: cats\nAnswer: ")
    assert state["answer"] == f"out{prompt_len}"[:5]
    assert state.text() == "Topic: cats\nAnswer: " + state["answer"]
    meta = state.get_meta_info("answer")
    assert meta["finish_reason"]["type"] == "stop" and meta["prompt_tokens"] == prompt_len
    (kind, prompt, (sp, _)), = backend.calls_of("generate")
    assert prompt.text == "Topic: cats\nAnswer: " and sp.max_new_tokens == 5


def test_gen_without_name_appends_text_only(backend):
    @braid.function
    def prog(s):
        s += "x" + braid.gen(max_tokens=3)

    state = prog.run(backend=backend)
    assert state.text() == "xout"[:4]
    assert state.variables() == {}


def test_stop_string_cuts_generation():
    backend = ScriptedBackend(lambda p, sp: "first line\nsecond line")

    @braid.function
    def prog(s):
        s += braid.gen("line", stop="\n")

    assert prog.run(backend=backend)["line"] == "first line"


def test_roles_render_with_chatml_and_build_messages(backend):
    @braid.function
    def chat(s):
        s += braid.system("be brief")
        s += braid.user("hi")
        s += braid.assistant(braid.gen("reply", max_tokens=20))
        with s.user():
            s += "more"
        s += braid.assistant_begin() + "ok" + braid.assistant_end()

    state = chat.run(backend=backend)
    reply = state["reply"]
    assert state.text() == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                            f"<|im_start|>assistant\n{reply}<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n"
                            "<|im_start|>assistant\nok<|im_end|>\n")
    assert state.messages() == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": reply}, {"role": "user", "content": "more"},
        {"role": "assistant", "content": "ok"},
    ]
    prompt = backend.calls_of("generate")[0][1]
    assert prompt.open_role == "assistant" and prompt.open_role_text == ""
    assert [m["role"] for m in prompt.messages] == ["system", "user"]
    assert not prompt.loose_text


def test_llama3_template_from_backend():
    backend = ScriptedBackend(template=LLAMA3)

    @braid.function
    def chat(s):
        s += braid.user("hi")

    assert chat.run(backend=backend).text() == "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"


def test_nested_and_mismatched_roles_raise(backend):
    @braid.function
    def nested(s):
        s += braid.user_begin()
        s += braid.assistant("x")

    with pytest.raises(braid.ProgramError, match="inside the open user"):
        nested.run(backend=backend)

    @braid.function
    def mismatched(s):
        s += braid.user_end()

    with pytest.raises(braid.ProgramError, match="does not match"):
        mismatched.run(backend=backend)


def test_select_appends_choice_and_records_meta(backend):
    @braid.function
    def prog(s):
        s += "The color of grass is green. Color: "
        s += braid.select("color", ["red", "green", "blue"])

    state = prog.run(backend=backend)
    assert state["color"] == "green"
    assert state.text().endswith("Color: green")
    meta = state.get_meta_info("color")
    assert meta["choices_method"] == "token_length_normalized" and len(meta["scores"]) == 3


def test_gen_with_choices_is_a_select(backend):
    @braid.function
    def prog(s):
        s += "pick b: " + braid.gen("x", choices=["a", "b"])

    assert prog.run(backend=backend)["x"] == "b"
    assert backend.calls_of("select") and not backend.calls_of("generate")


def test_select_validates_choices():
    with pytest.raises(braid.ProgramError):
        braid.select("x", [])
    with pytest.raises(braid.ProgramError):
        braid.select("x", ["a", 1])
    with pytest.raises(braid.ProgramError):
        braid.select("x", ["a"], choices_method="nope")


def _png_bytes(color):
    buf = io.BytesIO()
    PILImage.new("RGB", (4, 4), color).save(buf, format="PNG")
    return buf.getvalue()


def test_several_images_in_order(backend, tmp_path):
    path = tmp_path / "red.png"
    path.write_bytes(_png_bytes("red"))
    pil = PILImage.new("RGB", (2, 2), "blue")

    @braid.function
    def prog(s):
        with s.user():
            s += braid.image(str(path))
            s += braid.image(pil)
            s += braid.image(_png_bytes("green"))
            s += "What colors?"
        s += braid.assistant(braid.gen("a"))

    state = prog.run(backend=backend)
    prompt = backend.calls_of("generate")[0][1]
    assert len(prompt.images) == 3 and all(u.startswith("data:image/png;base64,") for u in prompt.images)
    assert prompt.text.count(CHATML.image_token) == 3
    content = state.messages()[0]["content"]
    assert [p["type"] for p in content] == ["image_url", "image_url", "image_url", "text"]
    assert content[3]["text"] == "What colors?"
    assert len({p["image_url"]["url"] for p in content[:3]}) == 3


def test_image_errors():
    with pytest.raises(braid.ProgramError, match="not found"):
        braid.image("/no/such/file.png")
    with pytest.raises(braid.ProgramError):
        braid.image(b"not an image")


def test_video_frames_from_animated_gif(backend, tmp_path):
    frames = [PILImage.new("RGB", (4, 4), (i * 20, 0, 0)) for i in range(10)]
    path = tmp_path / "clip.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=40)

    @braid.function
    def prog(s):
        s += braid.user(braid.video(str(path), num_frames=4) + "what happens?")
        s += braid.assistant(braid.gen("a"))

    prog.run(backend=backend)
    prompt = backend.calls_of("generate")[0][1]
    # one video of 4 frames (one video token in the text), not 4 images
    assert prompt.images == () and len(prompt.videos) == 1 and len(prompt.videos[0]) == 4
    assert prompt.text.count("<video>") == 1


def test_unsupported_capability_fails_clearly():
    backend = ScriptedBackend(capabilities=frozenset({CAP_GEN, CAP_FORK}))

    @braid.function
    def prog(s):
        s += braid.select("x", ["a", "b"])

    with pytest.raises(braid.UnsupportedFeatureError, match="does not support 'select'"):
        prog.run(backend=backend)

    @braid.function
    def prog2(s):
        s += braid.gen("x", regex=r"\d+")

    with pytest.raises(braid.UnsupportedFeatureError, match="'regex'"):
        prog2.run(backend=backend)

    @braid.function
    def prog3(s):
        s += braid.image(_png_bytes("red"))

    with pytest.raises(braid.UnsupportedFeatureError, match="'image'"):
        prog3.run(backend=backend)


def test_backend_error_reaches_caller_and_stops_program():
    def responder(prompt, sp):
        raise RuntimeError("model exploded")

    backend = ScriptedBackend(responder)

    @braid.function
    def prog(s):
        s += braid.gen("a")
        s += braid.gen("b")

    with pytest.raises(RuntimeError, match="model exploded"):
        prog.run(backend=backend)
    assert len(backend.calls_of("generate")) == 1


def test_error_in_program_body_reaches_caller(backend):
    @braid.function
    def prog(s):
        s += "x"
        raise KeyError("bad")

    with pytest.raises(KeyError):
        prog.run(backend=backend)


def test_reading_a_variable_mid_program(backend):
    @braid.function
    def prog(s):
        s += "a: " + braid.gen("a", max_tokens=4)
        first = s["a"]
        s += " b: " + braid.gen("b", max_tokens=30) + " a was " + first

    state = prog.run(backend=backend)
    assert state.text().endswith(" a was " + state["a"])


def test_unknown_variable_raises(backend):
    @braid.function
    def prog(s):
        s += "x"

    state = prog.run(backend=backend)
    with pytest.raises(braid.ProgramError, match="not set"):
        state["nope"]


def test_var_scope_and_set_var(backend):
    @braid.function
    def prog(s):
        with s.var_scope("block"):
            s += "inside " + braid.gen("g", max_tokens=3)
        s += " outside"
        s["manual"] = 42

    state = prog.run(backend=backend)
    assert state["block"] == "inside " + state["g"]
    assert state["manual"] == 42


def test_appending_other_types_is_an_error(backend):
    @braid.function
    def prog(s):
        s += 3

    with pytest.raises(braid.ProgramError, match="only str"):
        prog.run(backend=backend)


def test_composition_calls_subprogram_on_same_state(backend):
    @braid.function
    def greet(s, name):
        s += "Hello " + name + ". "

    @braid.function
    def prog(s):
        greet(s, "Ann")
        greet(s, name="Bob")
        s += braid.gen("rest", max_tokens=3)

    assert prog.run(backend=backend).text().startswith("Hello Ann. Hello Bob. ")


def test_dtype_gens_convert_values(backend):
    @braid.function
    def prog(s):
        s += braid.gen_int("n") + " " + braid.gen("f", dtype=float) + " " + braid.gen("b", dtype=bool)
        s += " " + braid.gen_string("w")

    state = prog.run(backend=backend)
    assert isinstance(state["n"], int) and isinstance(state["f"], float) and isinstance(state["b"], bool)
    assert isinstance(state["w"], str)
    regexes = [call[2][0].regex for call in backend.calls_of("generate")]
    assert all(regexes)
    texts = re.findall(r"\S+", state.text())
    assert re.fullmatch(regexes[0], texts[0]) and re.fullmatch(regexes[3], texts[3])


def test_json_schema_from_pydantic_dict_and_string(backend):
    from pydantic import BaseModel

    class Item(BaseModel):
        name: str
        count: int

    @braid.function
    def prog(s):
        s += braid.gen("a", json_schema=Item)
        s += braid.gen("b", json_schema={"type": "object", "properties": {"x": {"type": "integer"}}})
        s += braid.gen("c", json_schema='{"type": "object", "properties": {"y": {"type": "boolean"}}}')

    state = prog.run(backend=backend)
    Item.model_validate_json(state["a"])
    assert isinstance(json.loads(state["b"])["x"], int) and json.loads(state["c"])["y"] is True
    schemas = [json.loads(call[2][0].json_schema) for call in backend.calls_of("generate")]
    assert schemas[0] == Item.model_json_schema()
    assert schemas[1]["properties"]["x"] == {"type": "integer"}


def test_regex_passes_through(backend):
    @braid.function
    def prog(s):
        s += braid.gen("phone", regex=r"\d{3}-\d{4}")

    state = prog.run(backend=backend)
    assert re.fullmatch(r"\d{3}-\d{4}", state["phone"])
    assert backend.calls_of("generate")[0][2][0].regex == r"\d{3}-\d{4}"


def test_gen_argument_errors():
    with pytest.raises(braid.ProgramError):
        braid.gen("x", dtype=int, regex="a")
    with pytest.raises(braid.ProgramError):
        braid.gen("x", dtype=list)
    with pytest.raises(braid.ProgramError, match="unknown sampling"):
        braid.gen("x", max_token=3)
    with pytest.raises(braid.ProgramError, match="temperature"):
        braid.gen("x", temperature=-1)
    with pytest.raises(braid.ProgramError):
        braid.gen("x", regex="a", json_schema={"type": "object"})


def test_no_backend_is_a_clear_error():
    @braid.function
    def prog(s):
        s += "x"

    with pytest.raises(braid.NoBackendError, match="set_default_backend"):
        prog.run()


def test_default_backend_and_flush_cache(backend):
    braid.set_default_backend(backend)

    @braid.function
    def prog(s):
        s += braid.gen("x", max_tokens=2)

    assert prog.run()["x"] == "ou"
    braid.flush_cache()
    assert backend.calls_of("flush_cache")


def test_default_system_prompt_is_inserted_once():
    template = braid.ChatTemplate("sys-default", dict(CHATML.role_markers), default_system_prompt="SYS")
    backend = ScriptedBackend(template=template)

    @braid.function
    def prog(s):
        s += braid.user("a")
        s += braid.user("b")

    state = prog.run(backend=backend)
    assert state.messages() == [{"role": "system", "content": "SYS"}, {"role": "user", "content": "a"},
                                {"role": "user", "content": "b"}]
    assert template.render_messages(state.messages()[1:]) == state.text()
