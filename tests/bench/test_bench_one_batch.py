"""bench_one_batch on SmolLM2 in-process: static-batch decoding is greedy-correct, frees its KV, reports sane numbers."""

import json
import subprocess
import sys

import pytest

from braid.runtime.bench import bench_one_batch as bob
from braid.runtime.config import ServerArgs

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 512, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": False}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    # two spinning intra-op threads on a loaded 2-core machine run ~10x slower than one
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def static_batch():
    from braid.runtime.model_executor.model_runner import ModelRunner

    runner = ModelRunner(ServerArgs(model_path="smollm2", max_total_tokens=1024, log_level="warning"))
    return bob.StaticBatchRunner(runner)


@pytest.fixture(scope="module")
def tokenizer():
    from braid.runtime.loader.tokenizer import load_tokenizer

    return load_tokenizer("smollm2")


def assert_pools_free(sb):
    assert sb.kv_pool.available_size() == sb.kv_pool.size
    assert sb.req_pool.available_size() == sb.req_pool.size


def test_batched_greedy_decode_equals_full_recompute(static_batch, tokenizer):
    texts = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived",
             "1, 2, 3, 4,", "def fibonacci(n):"]
    prompts = [tokenizer.encode(t) for t in texts]
    assert len({len(p) for p in prompts}) > 1  # ragged batch
    run = static_batch.run(prompts, 6)
    assert_pools_free(static_batch)
    assert len(run.decode_latencies_s) == 5 and run.prefill_latency_s > 0
    assert "Paris" in tokenizer.decode(run.output_ids[0])
    # each decoded token must be what a fresh prefill of prompt + previous outputs picks (no KV reuse at all)
    for i, (prompt, out) in enumerate(zip(prompts, run.output_ids)):
        for k in range(1, 6):
            ref = static_batch.run([prompt + out[:k]], 1).output_ids[0][0]
            assert ref == out[k], f"prompt {i}, token {k}"
    assert_pools_free(static_batch)


def test_batch_sizes_1_and_4_report_consistent_figures(tmp_path):
    result_file = tmp_path / "one_batch.jsonl"
    args = bob.parse_args(["--model-path", "smollm2", "--batch-size", "1", "4", "--input-len", "12",
                           "--output-len", "5", "--result-filename", str(result_file), "--correctness-test",
                           "--log-level", "warning"])
    res = bob.run_benchmark(args)
    runs = res["runs"]
    assert [(r["batch_size"], r["input_len"], r["output_len"]) for r in runs] == [(1, 12, 5), (4, 12, 5)]
    for r in runs:
        assert r["prefill_throughput"] == pytest.approx(r["batch_size"] * 12 / r["prefill_latency_s"])
        assert r["decode_throughput"] == pytest.approx(r["batch_size"] / r["median_decode_latency_s"])
        assert r["total_latency_s"] >= r["prefill_latency_s"] + 3 * r["median_decode_latency_s"] * 0.999
        assert r["overall_throughput"] == pytest.approx(r["batch_size"] * 17 / r["total_latency_s"])
        assert r["device"] == "cpu" and r["model_path"] == "smollm2"
    assert res["kv_free_after"] == res["kv_size"] and res["req_slots_free_after"] == res["req_slots"]
    assert res["kv_size"] >= 4 * 17  # sized for the largest batch when --max-total-tokens is not given
    assert [c["prompt"] for c in res["correctness"]] == bob.CORRECTNESS_PROMPTS
    assert "Paris" in res["correctness"][0]["output"]
    lines = [json.loads(x) for x in result_file.read_text().splitlines()]
    assert [x["batch_size"] for x in lines] == [1, 4]
    assert lines[1]["median_decode_latency_s"] == runs[1]["median_decode_latency_s"]


def test_batches_that_do_not_fit_are_clear_errors(static_batch):
    with pytest.raises(bob.BenchOneBatchError, match="max-total-tokens"):
        static_batch.run([[1] * 300] * 4, 10)  # 1236 KV slots > 1024
    with pytest.raises(bob.BenchOneBatchError, match="context"):
        static_batch.run([[1] * 8], static_batch.runner.context_len)
    with pytest.raises(bob.BenchOneBatchError):
        static_batch.run([[1, 2], []], 2)
    assert_pools_free(static_batch)


def test_compare_hf_on_a_tiny_dummy_config(tmp_path):
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(TINY_LLAMA))
    args = bob.parse_args(["--load-format", "dummy", "--model-config", str(cfg), "--batch-size", "2",
                           "--input-len", "16", "--output-len", "4", "--compare-hf", "--log-level", "warning"])
    (r,) = bob.run_benchmark(args)["runs"]
    for key in ("hf_prefill_latency_s", "hf_median_decode_latency_s", "hf_total_latency_s"):
        assert r[key] > 0
    assert r["total_throughput_ratio_vs_hf"] == pytest.approx(r["hf_total_latency_s"] / r["total_latency_s"])
    assert r["decode_throughput_ratio_vs_hf"] > 0


def test_cli_entry_point_and_flag_validation():
    proc = subprocess.run([sys.executable, "-m", "braid.bench_one_batch", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0
    for flag in ("--batch-size", "--input-len", "--output-len", "--model-path", "--load-format", "--compare-hf",
                 "--correctness-test", "--result-filename", "--disable-cuda-graph", "--attention-backend"):
        assert flag in proc.stdout
    with pytest.raises(bob.BenchOneBatchError, match="batch-size"):
        bob.server_args_for(bob.parse_args(["--batch-size", "0"]))
    # flags the static batches would not act on are refused, not ignored
    for flags in (["--speculative-algorithm", "NGRAM"], ["--speculative-config", '{"method": "ngram"}'],
                  ["--enable-lora", "--max-lora-rank", "8"]):
        with pytest.raises(bob.BenchOneBatchError, match="without the scheduler"):
            bob.server_args_for(bob.parse_args(["--model-path", "smollm2", *flags]))
