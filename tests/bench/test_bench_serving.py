"""bench_serving and its datasets against a real SmolLM2 server: the client's counts must equal the server's."""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import requests

from braid.runtime.bench import bench_serving
from braid.runtime.bench.datasets import (DatasetError, TextSampler, sample_generated_shared_prefix, sample_random,
                                          sample_sharegpt, synthetic_sharegpt_conversations)

SERVER_START_TIMEOUT_S = 900  # the server may still be under construction: keep polling until it answers


@pytest.fixture(scope="session")
def tokenizer():
    from braid.runtime.loader.tokenizer import load_tokenizer

    return load_tokenizer("smollm2")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url():
    port = _free_port()
    log = tempfile.NamedTemporaryFile(prefix="braid-bench-server-", suffix=".log", delete=False)
    # one torch thread: the client, the HTTP server and the scheduler share 2 cores
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "braid.launch_server", "--model-path", "smollm2", "--port", str(port),
           "--max-total-tokens", "16384", "--log-level", "warning"]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + SERVER_START_TIMEOUT_S
    try:
        while True:
            if proc.poll() is not None:  # not runnable yet (being written): start it again and keep waiting
                if time.time() > deadline:
                    pytest.fail(f"server never started:\n{open(log.name, errors='replace').read()[-3000:]}")
                time.sleep(5)
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
                continue
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.time() > deadline:
                pytest.fail(f"server not healthy after {SERVER_START_TIMEOUT_S}s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        os.unlink(log.name)


def counters(url: str) -> dict:
    info = requests.get(url + "/get_server_info", timeout=30).json()
    return {k: info[k] for k in ("num_prompt_tokens_total", "num_generated_tokens_total", "num_cached_tokens_total")}


def delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before}


def bench_args(url: str, *extra: str):
    return bench_serving.parse_args(["--base-url", url, "--tokenizer", "smollm2", "--disable-tqdm",
                                     "--warmup-requests", "0", *extra])


# ---------------------------------------------------------------------------------------------- datasets
def test_random_dataset_has_exact_lengths_and_english_text(tokenizer):
    reqs = sample_random(tokenizer, 6, 40, 9, range_ratio=1.0, seed=3)
    assert [r.prompt_len for r in reqs] == [40] * 6
    assert all(len(tokenizer.encode(r.prompt)) == 40 for r in reqs)
    assert [r.output_len for r in reqs] == [9] * 6
    words = reqs[0].prompt.split()
    assert len(words) > 20 and all(w.strip(".,?").isalpha() for w in words)
    ranged = sample_random(tokenizer, 50, 40, 10, range_ratio=0.5, seed=3)
    assert all(20 <= r.prompt_len <= 40 and 5 <= r.output_len <= 10 for r in ranged)
    assert len({r.prompt_len for r in ranged}) > 5
    assert sample_random(tokenizer, 3, 30, 5, 0.5, seed=7) == sample_random(tokenizer, 3, 30, 5, 0.5, seed=7)
    with pytest.raises(DatasetError):
        sample_random(tokenizer, 0, 10, 10)
    with pytest.raises(DatasetError):
        sample_random(tokenizer, 2, 10, 10, range_ratio=1.5)


def test_text_sampler_hits_every_small_length(tokenizer):
    import numpy as np

    sampler = TextSampler(tokenizer, np.random.default_rng(0))
    assert all(sampler.count(sampler.text(n)) == n for n in range(1, 80))


def test_synthetic_sharegpt_is_sharegpt_shaped_with_lognormal_lengths(tokenizer, tmp_path):
    convs = synthetic_sharegpt_conversations(tokenizer, 300, seed=0)
    assert all([t["from"] for t in c["conversations"]] == ["human", "gpt"] for c in convs)
    reqs = sample_sharegpt(tokenizer, None, 300, seed=0)
    assert len(reqs) == 300
    prompt_lens = sorted(r.prompt_len for r in reqs)
    out_lens = sorted(r.output_len for r in reqs)
    # LogNormal(4.58, 1.0) and LogNormal(5.50, 0.8) after the ShareGPT filter: medians ~98 and ~245 tokens
    assert 70 < prompt_lens[150] < 130 and 180 < out_lens[150] < 310
    assert all(4 <= p <= 1024 for p in prompt_lens) and all(r.prompt_len + r.output_len <= 2048 for r in reqs)
    assert prompt_lens[-1] > 3 * prompt_lens[150]  # heavy right tail

    # the same records through a file give the same requests; malformed records are skipped
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs[:5] + [{"conversations": [{"from": "gpt", "value": "x"}]}, {"id": 1}]))
    from_file = sample_sharegpt(tokenizer, str(path), 10, seed=0, fixed_output_len=7)
    assert len(from_file) == 5 and all(r.output_len == 7 for r in from_file)
    assert {r.prompt for r in from_file} == {c["conversations"][0]["value"] for c in convs[:5]}
    with pytest.raises(DatasetError, match="not found"):
        sample_sharegpt(tokenizer, str(tmp_path / "missing.json"), 3)


def test_generated_shared_prefix_groups(tokenizer):
    reqs = sample_generated_shared_prefix(tokenizer, 3, 4, system_prompt_len=50, question_len=10, output_len=5, seed=1)
    assert len(reqs) == 12 and all(r.output_len == 5 for r in reqs)
    systems = {r.prompt.split("\n\n")[0] for r in reqs}
    assert len(systems) == 3
    assert all(len(tokenizer.encode(s)) == 50 for s in systems)
    assert all(r.prompt_len == len(tokenizer.encode(r.prompt)) for r in reqs)


# ---------------------------------------------------------------------------------------------- against the server
def test_native_stream_counts_match_server(server_url, tmp_path):
    out_file, plot = tmp_path / "res.jsonl", tmp_path / "plot.png"
    args = bench_args(server_url, "--backend", "braid", "--dataset-name", "random", "--num-prompts", "8",
                      "--random-input-len", "24", "--random-output-len", "8", "--random-range-ratio", "1",
                      "--output-file", str(out_file), "--plot", str(plot))
    before = counters(server_url)
    r = bench_serving.run_benchmark(args)
    d = delta(before, counters(server_url))
    assert r["completed"] == 8 and r["failed"] == 0
    assert r["total_input_tokens"] == d["num_prompt_tokens_total"] == 8 * 24
    assert r["total_output_tokens"] == d["num_generated_tokens_total"] == r["requested_output_tokens"] == 64
    assert r["total_cached_tokens"] == d["num_cached_tokens_total"]
    assert r["details"]["output_lens"] == [8] * 8
    assert 0 < r["median_ttft_ms"] <= r["median_e2e_latency_ms"] and r["mean_itl_ms"] > 0 and r["mean_tpot_ms"] > 0
    assert r["p99_e2e_latency_ms"] >= r["median_e2e_latency_ms"]
    assert r["output_throughput"] == pytest.approx(64 / r["duration_s"])
    assert all(len(itl) >= 1 for itl in r["details"]["itls"])
    line = json.loads(out_file.read_text().splitlines()[-1])
    assert line["completed"] == 8 and line["total_output_tokens"] == 64 and "itls" not in line
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_openai_sharegpt_with_concurrency_limit(server_url):
    args = bench_args(server_url, "--backend", "openai", "--dataset-name", "sharegpt", "--num-prompts", "4",
                      "--sharegpt-output-len", "6", "--max-concurrency", "2", "--seed", "5")
    before = counters(server_url)
    r = bench_serving.run_benchmark(args)
    d = delta(before, counters(server_url))
    assert r["completed"] == 4 and r["failed"] == 0
    assert r["total_input_tokens"] == d["num_prompt_tokens_total"] == sum(r["details"]["input_lens"])
    assert r["total_output_tokens"] == d["num_generated_tokens_total"] == 24
    assert r["concurrency"] <= 2.0 + 1e-6


def test_shared_prefix_nonstream_poisson_hits_the_cache(server_url):
    args = bench_args(server_url, "--backend", "sglang", "--dataset-name", "generated-shared-prefix",
                      "--gsp-num-groups", "2", "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "48",
                      "--gsp-question-len", "8", "--gsp-output-len", "4", "--disable-stream",
                      "--request-rate", "20", "--max-concurrency", "1")
    before = counters(server_url)
    r = bench_serving.run_benchmark(args)
    d = delta(before, counters(server_url))
    assert r["completed"] == 6 and r["num_prompts"] == 6
    assert r["total_input_tokens"] == d["num_prompt_tokens_total"]
    assert r["total_output_tokens"] == d["num_generated_tokens_total"] == 24
    # one at a time: the 2nd and 3rd prompt of each group reuse the 48-token system prompt
    assert r["total_cached_tokens"] == d["num_cached_tokens_total"] >= 4 * 40
    assert r["median_ttft_ms"] == pytest.approx(r["median_e2e_latency_ms"])  # no stream: first token == last


def test_failed_requests_are_counted_not_raised(server_url):
    args = bench_args(server_url, "--backend", "braid", "--dataset-name", "random", "--num-prompts", "3",
                      "--random-input-len", "8", "--random-output-len", "4",
                      "--extra-request-body", '{"sampling_params": {"temperature": -1}}')
    before = counters(server_url)
    r = bench_serving.run_benchmark(args)
    assert r["completed"] == 0 and r["failed"] == 3
    assert r["errors"] and "400" in r["errors"][0]
    assert delta(before, counters(server_url))["num_generated_tokens_total"] == 0


def test_cli_module_vllm_backend_with_warmup(server_url, tmp_path):
    out_file = tmp_path / "cli.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "braid.bench_serving", "--backend", "vllm", "--base-url", server_url,
                           "--tokenizer", "smollm2", "--dataset-name", "random", "--num-prompts", "2",
                           "--random-input-len", "8", "--random-output-len", "4", "--random-range-ratio", "1",
                           "--output-file", str(out_file), "--output-details", "--disable-tqdm"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Serving Benchmark Result" in proc.stdout and "Time to first token" in proc.stdout
    line = json.loads(out_file.read_text())
    assert line["completed"] == 2 and line["total_output_tokens"] == 8 and line["output_lens"] == [4, 4]


def test_bad_arguments_are_clear_errors(server_url):
    with pytest.raises(bench_serving.BenchmarkError, match="request-rate"):
        bench_serving.run_benchmark(bench_args(server_url, "--request-rate", "0"))
    with pytest.raises(bench_serving.BenchmarkError, match="max-concurrency"):
        bench_serving.run_benchmark(bench_args(server_url, "--max-concurrency", "0"))


def test_sse_payloads_split_across_reads():
    """The client reads SSE bytes as they arrive: an event split over reads, several in one read, CRLF line ends,
    comments, and nothing after [DONE]."""
    import asyncio
    from types import SimpleNamespace

    from braid.runtime.bench.serving_clients import _NATIVE_PROGRESS, _sse_payloads

    reads = [b'data: {"meta_info": {"completion_tokens": 1}, "te', b'xt": "a"}\n\n: keep-alive\n\ndata: {"meta',
             b'_info": {"completion_tokens": 2}}\r\n\r\ndata: [DONE]\n\ndata: {"late": 1}\n\n']

    async def iter_any():
        for r in reads:
            yield r

    async def collect():
        return [p async for p in _sse_payloads(SimpleNamespace(content=SimpleNamespace(iter_any=iter_any)))]

    payloads = asyncio.run(collect())
    assert [json.loads(p)["meta_info"]["completion_tokens"] for p in payloads] == [1, 2]
    # a chunk's cumulative text and ids are skipped; an error object is seen
    assert _NATIVE_PROGRESS.decode(b'{"text": "x", "output_ids": [1, 2], "meta_info": {"completion_tokens": 2}}'
                                   ).meta_info["completion_tokens"] == 2
    assert _NATIVE_PROGRESS.decode(b'{"error": {"message": "boom"}}').error == {"message": "boom"}
