"""vLLM's placement of prompt_logprobs (chat: the response's; completions: each choice's, for its own prompt) and of
continuous usage stats (every chunk counts its choice's tokens so far; a chat choice's role chunk counts none), on
the real SmolLM2 server through the official openai client."""

import openai
import pytest
from real_server import start_server
from server_helpers import API_KEY, SERVER_FLAGS

CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


@pytest.fixture(scope="module")
def server():
    """Its own server: this module runs last in the folder, where the shared one may already be closed."""
    srv = start_server(SERVER_FLAGS, API_KEY, "braid-usage-")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def openai_client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
MSGS = [{"role": "user", "content": "Count to ten."}]


def test_chat_role_chunks_count_no_completion_tokens(openai_client):
    chunks = list(openai_client.chat.completions.create(
        model="default", messages=MSGS, max_tokens=4, temperature=1.0, n=2, seed=4, stream=True,
        stream_options=CONTINUOUS, extra_body={"min_tokens": 4}))
    assert all(c.usage is not None for c in chunks)
    prompt = chunks[-1].usage.prompt_tokens
    per_choice: dict[int, list[int]] = {0: [], 1: []}
    for c in chunks[:-1]:
        (choice,) = c.choices
        if choice.delta.role == "assistant":
            assert per_choice[choice.index] == []  # the first chunk of its choice
            assert (c.usage.completion_tokens, c.usage.total_tokens) == (0, prompt)
        per_choice[choice.index].append(c.usage.completion_tokens)
        assert c.usage.prompt_tokens == prompt
        assert c.usage.total_tokens == prompt + c.usage.completion_tokens
    for counts in per_choice.values():
        assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 4
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8  # both choices


def test_completion_chunks_count_their_own_choice(openai_client):
    chunks = list(openai_client.completions.create(
        model="default", prompt="One, two,", max_tokens=3, temperature=1.0, n=2, seed=4, stream=True,
        stream_options=CONTINUOUS, extra_body={"min_tokens": 3}))
    per_choice: dict[int, list[int]] = {0: [], 1: []}
    for c in chunks[:-1]:
        per_choice[c.choices[0].index].append(c.usage.completion_tokens)
    for counts in per_choice.values():
        assert counts[0] >= 1 and counts == sorted(counts) and counts[-1] == 3
    assert chunks[-1].usage.completion_tokens == 6


def _check_entries(entries, ids, server):
    assert entries[0] is None and len(entries) == len(ids)
    for tid, entry in zip(ids[1:], entries[1:]):
        mine = entry[str(tid)]
        text = server.post("/detokenize", {"tokens": [tid]}).json()["text"]
        assert mine["decoded_token"] == text and mine["logprob"] <= 0
        assert set(mine) == {"logprob", "rank", "decoded_token"}


def test_prompt_logprobs_sit_where_vllm_puts_them(server, openai_client):
    prompts = ["The sky is", "A much longer prompt about the colour of the sea is"]
    r = openai_client.completions.create(model="default", prompt=prompts, max_tokens=1, n=2,
                                         extra_body={"prompt_logprobs": 1}).model_dump()
    assert "prompt_logprobs" not in r or r["prompt_logprobs"] is None
    assert len(r["choices"]) == 4
    for c in r["choices"]:
        ids = server.post("/tokenize", {"prompt": prompts[c["index"] // 2]}).json()["tokens"]
        _check_entries(c["prompt_logprobs"], ids, server)
    chat = openai_client.chat.completions.create(model="default", messages=MSGS, max_tokens=1, n=2,
                                                 extra_body={"prompt_logprobs": 0}).model_dump()
    assert all("prompt_logprobs" not in c or c["prompt_logprobs"] is None for c in chat["choices"])
    ids = server.post("/tokenize", {"messages": MSGS}).json()["tokens"]
    _check_entries(chat["prompt_logprobs"], ids, server)
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])  # k = 0: the prompt's token alone
