"""EAGLE speculation through a real server process and the official openai client, on the tiny successor target and
the head built to predict it (tests/helpers/eagle_tiny.py): the greedy completion is the non-speculative Engine's, token
for token, with drafts accepted (spec_accept_length in meta_info, the counters in /get_server_info), for chain and
tree drafts."""

import openai
import pytest

from braid.runtime import Engine
from eagle_tiny import write_successor_head, write_successor_target
from real_server import start_server

API_KEY = "eagle-key"
PROMPT = "The quick brown fox"
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle-server")
    return write_successor_target(root / "succ"), write_successor_head(root / "head")


@pytest.fixture(scope="module")
def plain_ids(ckpt):
    """The greedy completion without speculation (in-process, before the server starts: one model at a time)."""
    with Engine(model_path=ckpt[0], max_total_tokens=1024, log_level="warning") as engine:
        return engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": MAX_TOKENS})["output_ids"]


@pytest.fixture(scope="module")
def server(ckpt, plain_ids):
    srv = start_server(["--model-path", ckpt[0], "--max-total-tokens", "1024", "--api-key", API_KEY,
                        "--log-level", "warning", "--speculative-algorithm", "EAGLE",
                        "--speculative-draft-model-path", ckpt[1], "--speculative-num-steps", "4"], API_KEY,
                       "braid-eagle-")
    yield srv
    srv.stop()


def test_greedy_completion_is_the_plain_one_with_drafts_accepted(server, plain_ids):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    native = server.post("/generate", json={"text": PROMPT, "sampling_params": {"temperature": 0,
                                                                                "max_new_tokens": MAX_TOKENS}})
    assert native.status_code == 200, native.text
    assert native.json()["output_ids"] == plain_ids
    assert native.json()["meta_info"]["spec_accept_length"] > 1.5
    assert out.usage.completion_tokens == len(plain_ids)
    assert out.choices[0].text == native.json()["text"]
    info = server.get("/get_server_info").json()
    assert (info["speculative_algorithm"], info["speculative_num_steps"], info["speculative_eagle_topk"],
            info["speculative_num_draft_tokens"]) == ("EAGLE", 4, 1, 5)
    assert info["spec_accept_length_mean"] > 1.5
    assert info["kv_used_tokens"] == 0


def test_tree_drafts_through_a_server_give_the_plain_completion(server, ckpt, plain_ids):
    """--speculative-eagle-topk 2 (a tree of 5 draft nodes a step): the openai client's greedy completion is the plain
    one, drafts are accepted, the flags show in /get_server_info and the pool is free after."""
    tree = start_server(["--model-path", ckpt[0], "--max-total-tokens", "1024", "--api-key", API_KEY,
                         "--log-level", "warning", "--speculative-algorithm", "EAGLE",
                         "--speculative-draft-model-path", ckpt[1], "--speculative-num-steps", "3",
                         "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6"], API_KEY,
                        "braid-eagle-tree-")
    try:
        client = openai.OpenAI(base_url=tree.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        out = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                        temperature=0)
        native = tree.post("/generate", json={"text": PROMPT, "sampling_params": {"temperature": 0,
                                                                                  "max_new_tokens": MAX_TOKENS}})
        assert native.status_code == 200, native.text
        assert native.json()["output_ids"] == plain_ids
        assert out.choices[0].text == native.json()["text"]
        info = tree.get("/get_server_info").json()
        assert (info["speculative_eagle_topk"], info["speculative_num_draft_tokens"]) == (2, 6)
        assert info["spec_accept_length_mean"] > 1.5
        assert info["kv_used_tokens"] == 0
    finally:
        tree.stop()
