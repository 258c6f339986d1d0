"""Chat completions produce exactly what the in-process Engine produces for the same templated prompt."""

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
