"""Engine behaviour on the real SmolLM2: sampling controls, stops, n>1, prefix reuse, abort, streaming."""

import threading

import pytest

from braid.runtime import Engine
from braid.runtime.sampling_params import SamplingParamsError

SHARED = ("You are a careful assistant. Answer briefly and precisely. The following are facts about the solar system. "
          "The Sun is a star. Mercury is the closest planet to the Sun. Venus is the hottest planet. Earth has one moon. "
          "Mars is red. Jupiter is the largest planet. Saturn has rings. ") * 3


@pytest.fixture(scope="module")
def engine():
    with Engine(model_path="smollm2", log_level="warning", max_total_tokens=8192) as e:
        yield e
        e.flush_cache()
        stats = e.get_stats()
        assert stats["kv_free_tokens"] == stats["kv_total_tokens"]


def _greedy(n):
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


def test_prefix_reuse_computes_shared_part_once(engine):
    engine.flush_cache()
    tok = engine.tokenizer
    questions = ["Which planet is red?", "Which planet has rings?", "What is the Sun?", "Which is the largest?"]
    before = engine.get_stats()
    first = engine.generate(SHARED + questions[0], _greedy(4))
    rest = engine.generate([SHARED + q for q in questions[1:]], _greedy(4))
    after = engine.get_stats()
    shared_len = len(tok.encode(SHARED))
    assert first["meta_info"]["cached_tokens"] == 0
    for r in rest:
        assert r["meta_info"]["cached_tokens"] >= shared_len - 2
    prompt_tokens = sum(len(tok.encode(SHARED + q)) for q in questions)
    computed = after["num_computed_prompt_tokens_total"] - before["num_computed_prompt_tokens_total"]
    # the shared part ran through the model once; each later prompt only computed its own question
    assert computed <= prompt_tokens - 3 * (shared_len - 2)
    assert computed >= prompt_tokens - 3 * shared_len - 3
    assert after["kv_used_tokens"] == 0

    # submitted together: the scheduler defers the ones that would recompute a prefix already in the batch
    engine.flush_cache()
    other = SHARED.replace("Sun", "Moon")
    before = engine.get_stats()
    together = engine.generate([other + q for q in questions], _greedy(4))
    after = engine.get_stats()
    computed = after["num_computed_prompt_tokens_total"] - before["num_computed_prompt_tokens_total"]
    other_len = len(tok.encode(other))
    assert computed <= sum(len(tok.encode(other + q)) for q in questions) - 3 * (other_len - 2)
    assert sum(r["meta_info"]["cached_tokens"] for r in together) >= 3 * (other_len - 2)


def test_seed_reproducible_and_top_k1_is_greedy(engine):
    sp = {"temperature": 1.0, "max_new_tokens": 12, "seed": 1234, "ignore_eos": True}
    a = engine.generate("Tell me a story about a dragon.", sp)
    b = engine.generate(["Tell me a story about a dragon.", "Something else entirely"], [sp, {**sp, "seed": 7}])[0]
    assert a["output_ids"] == b["output_ids"]
    c = engine.generate("Tell me a story about a dragon.", {**sp, "seed": 999})
    assert c["output_ids"] != a["output_ids"]
    g = engine.generate("Tell me a story about a dragon.", _greedy(12))
    k1 = engine.generate("Tell me a story about a dragon.", {"temperature": 1.5, "top_k": 1, "max_new_tokens": 12, "ignore_eos": True})
    assert g["output_ids"] == k1["output_ids"]
    tiny_p = engine.generate("Tell me a story about a dragon.", {"temperature": 1.0, "top_p": 1e-6, "max_new_tokens": 12,
                                                                 "ignore_eos": True, "seed": 5})
    assert tiny_p["output_ids"] == g["output_ids"]
    minp = engine.generate("Tell me a story about a dragon.", {"temperature": 1.0, "min_p": 0.999, "max_new_tokens": 12,
                                                               "ignore_eos": True, "seed": 5})
    assert minp["output_ids"] == g["output_ids"]


def test_penalties_change_repetitive_output(engine):
    prompt = "1, 2, 1, 2, 1, 2, 1, 2,"
    base = engine.generate(prompt, _greedy(16))["output_ids"]
    rep = engine.generate(prompt, {**_greedy(16), "repetition_penalty": 1.8})["output_ids"]
    freq = engine.generate(prompt, {**_greedy(16), "frequency_penalty": 2.0})["output_ids"]
    assert rep != base and freq != base
    assert len(set(freq)) > len(set(base))


def test_stop_strings_tokens_and_lengths(engine):
    g = engine.generate("Count: 1, 2, 3, 4, 5, 6, 7, 8, 9,", _greedy(30))
    text = g["text"]
    assert " 12" in text
    s = engine.generate("Count: 1, 2, 3, 4, 5, 6, 7, 8, 9,", {**_greedy(30), "stop": [" 12"]})
    assert s["meta_info"]["finish_reason"] == {"type": "stop", "matched": " 12"}
    assert s["text"] == text[: text.index(" 12")]
    keep = engine.generate("Count: 1, 2, 3, 4, 5, 6, 7, 8, 9,", {**_greedy(30), "stop": [" 12"], "no_stop_trim": True})
    assert keep["text"] == text[: text.index(" 12") + 3]
    stop_tok = g["output_ids"][3]
    t = engine.generate("Count: 1, 2, 3, 4, 5, 6, 7, 8, 9,", {**_greedy(30), "stop_token_ids": [stop_tok]})
    assert t["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    assert t["output_ids"] == g["output_ids"][: g["output_ids"].index(stop_tok) + 1]
    assert t["text"] == engine.tokenizer.decode(t["output_ids"][:-1])  # the stop token's text is not output
    # min_new_tokens keeps EOS away; plain greedy chat stops at EOS early
    chat = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    short = engine.generate(chat, {"temperature": 0, "max_new_tokens": 64})
    assert short["meta_info"]["finish_reason"]["type"] == "stop"
    n_short = short["meta_info"]["completion_tokens"]
    longer = engine.generate(chat, {"temperature": 0, "max_new_tokens": 64, "min_new_tokens": n_short + 5})
    assert longer["meta_info"]["completion_tokens"] >= n_short + 5


def test_n_samples_share_prompt(engine):
    engine.flush_cache()
    before = engine.get_stats()
    prompt = SHARED + "Write one word:"
    res = engine.generate(prompt, {"temperature": 1.0, "max_new_tokens": 6, "n": 4, "seed": 3, "ignore_eos": True})
    assert len(res) == 4
    assert len({tuple(r["output_ids"]) for r in res}) > 1
    after = engine.get_stats()
    computed = after["num_computed_prompt_tokens_total"] - before["num_computed_prompt_tokens_total"]
    assert computed <= len(engine.tokenizer.encode(prompt)) + 4


def test_streaming_equals_non_streaming(engine):
    prompt = "Here is a list of fruits:"
    full = engine.generate(prompt, _greedy(20))
    chunks = list(engine.generate(prompt, _greedy(20), stream=True))
    assert len(chunks) >= 5
    assert "".join(c["delta"] for c in chunks) == full["text"]
    assert chunks[-1]["output_ids"] == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_abort_frees_kv(engine):
    stream = engine.generate("Write a very long essay about the history of mathematics.",
                             {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()  # closing the generator aborts the request
    for _ in range(100):
        if engine.get_stats()["num_running_reqs"] == 0:
            break
        threading.Event().wait(0.05)
    assert engine.get_stats()["num_running_reqs"] == 0
    assert engine.get_stats()["kv_used_tokens"] == 0


def test_bad_input_raises_clear_errors(engine):
    with pytest.raises(SamplingParamsError, match="temperature"):
        engine.generate("hi", {"temperature": -1})
    with pytest.raises(SamplingParamsError, match="top_p"):
        engine.generate("hi", {"top_p": 0})
    with pytest.raises(SamplingParamsError, match="unknown"):
        engine.generate("hi", {"nonsense": 1})
    with pytest.raises(ValueError, match="context"):
        engine.generate("hi " * 9000, {"max_new_tokens": 1})
    with pytest.raises(ValueError, match="vocabulary"):
        engine.generate(input_ids=[1, 2, 10**7], sampling_params={"max_new_tokens": 1})
    ok = engine.generate("hi", _greedy(2))
    assert ok["meta_info"]["completion_tokens"] == 2
    assert engine.get_stats()["kv_used_tokens"] == 0


def test_chat_template_and_its_content_format_as_the_server_takes_them(engine):
    """--chat-template reaches the in-process Engine (a named one here), and apply_chat_template renders content
    parts in the template's format: a string-format template gets the parts' text joined."""
    from braid.runtime.chat_format import NAMED_CHAT_TEMPLATES

    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]}]
    own = engine.get_model_info()
    assert own["chat_template_content_format"] == "string" and own["chat_template"] != NAMED_CHAT_TEMPLATES["chatml"]
    assert "Hi there" in engine.apply_chat_template(messages)
    with Engine(model_path="smollm2", chat_template="chatml", log_level="warning", max_total_tokens=1024) as chatml:
        info = chatml.get_model_info()
        assert info["chat_template"] == NAMED_CHAT_TEMPLATES["chatml"]
        assert chatml.apply_chat_template(messages) == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
        assert chatml.apply_chat_template(messages, add_generation_prompt=False).endswith("<|im_end|>\n")
