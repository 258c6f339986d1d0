"""NGRAM speculation through a real server process and the official openai client: the greedy completion is the
non-speculative Engine's, token for token; /get_server_info shows the resolved switches and the acceptance counters,
/metrics the vLLM-named counters; a concurrent sampled load with streams dropped mid-way leaves the KV pool fully
free; a switch combination braid cannot run stops the launch with the flag named."""

import subprocess
import sys
import threading
import time

import openai
import pytest
import requests

from braid.runtime import Engine
from real_server import start_server

API_KEY = "spec-key"
TEXT = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
        "All that glitters is not gold.")
PROMPT = f"Repeat this text exactly, twice:\n{TEXT}\n"
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def plain_ids():
    """The greedy completion without speculation (in-process, before the server starts: one model at a time)."""
    with Engine("smollm2", max_total_tokens=1024) as engine:
        return engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": MAX_TOKENS})["output_ids"]


@pytest.fixture(scope="module")
def server(plain_ids):
    srv = start_server(["--max-total-tokens", "4096", "--api-key", API_KEY, "--log-level", "warning",
                        "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "6"], API_KEY,
                       "braid-spec-")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_greedy_completion_is_the_plain_one(server, client, plain_ids):
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                    logprobs=1)
    native = server.post("/generate", json={"text": PROMPT, "sampling_params": {"temperature": 0,
                                                                                "max_new_tokens": MAX_TOKENS}})
    assert native.status_code == 200, native.text
    assert native.json()["output_ids"] == plain_ids
    assert native.json()["meta_info"]["spec_accept_length"] > 1.0  # this request's own tokens per verified draft
    assert out.usage.completion_tokens == len(plain_ids)
    assert out.choices[0].text == native.json()["text"]
    assert len(out.choices[0].logprobs.tokens) == len(plain_ids)


def test_server_info_shows_the_switches_and_the_acceptance(server, client):
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=24, temperature=0)
    assert chat.choices[0].message.content
    info = server.get("/get_server_info").json()
    assert info["speculative_algorithm"] == "NGRAM"
    assert (info["speculative_num_draft_tokens"], info["speculative_num_steps"], info["speculative_eagle_topk"]) == \
        (6, 5, 1)
    assert info["speculative_ngram_min_match_window_size"] == 2
    assert info["spec_num_drafts_total"] > 0
    assert 0 < info["spec_num_accepted_tokens_total"] <= info["spec_num_draft_tokens_total"]
    assert info["spec_accept_length_mean"] > 1.0
    metrics = server.get("/metrics").text
    assert "braid:spec_decode_num_accepted_tokens_total" in metrics
    assert "braid:spec_decode_num_draft_tokens_total" in metrics


def test_sampled_load_with_dropped_streams_leaves_the_kv_pool_free(server, client):
    model = client.models.list().data[0].id
    errors = []

    def complete(i: int):
        try:
            if i % 4 == 3:  # a stream the client drops after a few chunks: the server aborts it
                with requests.post(server.base_url + "/v1/completions", headers=server.headers, stream=True,
                                   timeout=120, json={"model": model, "prompt": f"{i}: {PROMPT}", "max_tokens": 200,
                                                      "temperature": 0.8, "stream": True}) as r:
                    for n, _ in enumerate(r.iter_lines()):
                        if n >= 6:
                            break
                return
            out = client.completions.create(model=model, prompt=f"{i}: {PROMPT}", max_tokens=12 + i,
                                            temperature=0.8, top_p=0.95, seed=i if i % 2 else None)
            assert out.usage.completion_tokens <= 12 + i
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=complete, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    deadline = time.time() + 60
    while True:  # the dropped streams' aborts reach the scheduler shortly after the clients leave
        info = server.get("/get_server_info").json()
        if info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0 and info["kv_used_tokens"] == 0:
            break
        assert time.time() < deadline, f"requests still running or KV still held: {info}"
        time.sleep(0.2)
    assert info["num_requests_total"] >= 12
    assert info["kv_free_tokens"] + info["kv_cached_tokens"] == info["kv_total_tokens"]


def test_a_combination_braid_cannot_run_stops_the_launch():
    proc = subprocess.run([sys.executable, "-m", "braid.runtime.launch", "--speculative-algorithm", "NGRAM",
                           "--speculative-eagle-topk", "4"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "--speculative-eagle-topk > 1 (tree drafts) is not supported with NGRAM" in proc.stderr


def test_bench_serving_prints_the_runs_mean_acceptance_length(server, capsys):
    from braid.runtime.bench import bench_serving

    args = bench_serving.parse_args(["--base-url", server.base_url, "--api-key", API_KEY, "--tokenizer", "smollm2",
                                     "--disable-tqdm", "--warmup-requests", "0", "--backend", "braid",
                                     "--dataset-name", "random", "--num-prompts", "4", "--random-input-len", "48",
                                     "--random-output-len", "32", "--random-range-ratio", "1"])
    before = server.get("/get_server_info").json()
    result = bench_serving.run_benchmark(args)
    after = server.get("/get_server_info").json()
    drafts = after["spec_num_drafts_total"] - before["spec_num_drafts_total"]
    accepted = after["spec_num_accepted_tokens_total"] - before["spec_num_accepted_tokens_total"]
    assert result["completed"] == 4 and drafts > 0
    assert result["spec_accept_length"] == pytest.approx(1.0 + accepted / drafts)
    assert f"{result['spec_accept_length']:.2f}" in capsys.readouterr().out.split("Mean acceptance length", 1)[1]
