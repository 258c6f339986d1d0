"""Chat completions produce exactly what the in-process Engine produces for the same templated prompt; the Engine
refuses what the server refuses."""

import pytest

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of Italy?"}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Which color is the sky?"},
     {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "And grass?"}],
]


@pytest.fixture(scope="module")
def engine(server):  # after the server, so both load side by side only when the server is already up
    from braid.runtime.engine import Engine

    eng = Engine(model_path="smollm2", max_total_tokens=4096, log_level="warning")
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_chat_equals_engine_on_templated_prompt(engine, openai_client, model_name, conv):
    messages = CONVERSATIONS[conv]
    prompt = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ref = engine.generate(prompt, {"max_new_tokens": 12, "temperature": 0})
    got = openai_client.chat.completions.create(model=model_name, messages=messages, max_tokens=12, temperature=0)
    assert got.choices[0].message.content == ref["text"]
    assert got.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]
    assert got.usage.completion_tokens == ref["meta_info"]["completion_tokens"]
    assert got.choices[0].finish_reason == ref["meta_info"]["finish_reason"]["type"]


def test_engine_refuses_images_for_a_text_only_model(engine):
    import braid
    from braid.backends.local import LocalEngine

    with pytest.raises(ValueError, match="model smollm2 takes no image input"):
        engine.generate("Describe the picture.", {"max_new_tokens": 2}, image_data="data:image/png;base64,AAAA")
    info = engine.get_model_info()
    assert info["is_multimodal"] is False and info["context_length"] == engine.served_model().context_len

    local = LocalEngine("smollm2")
    local._engine = engine  # the one already loaded

    @braid.function
    def describe(s):
        s += braid.user(braid.image("data:image/png;base64,AAAA") + "What is it?")
        s += braid.assistant(braid.gen("answer", max_tokens=2))

    with pytest.raises(braid.UnsupportedFeatureError, match="the served model smollm2 takes no image input"):
        describe.run(backend=local)
