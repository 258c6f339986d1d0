"""The soak benchmark's short version (CI): every request ends, no 5xx, each abusive request gets the answer
its kind calls for, the KV pool is fully free at idle; and a per-request deadline ends a long request."""

import pytest

from braid.runtime.bench import bench_soak
from reliability_servers import API_KEY, start_server
from tiny_families import write_tiny_family


def test_short_soak_every_request_ends_no_5xx_kv_free_at_idle(capsys):
    srv = start_server("--grammar-timeout-s", "1", "--max-prompt-chars", "20000")
    try:
        code = bench_soak.main(["--base-url", srv.base_url, "--api-key", API_KEY, "--num-requests", "120",
                                "--concurrency", "16", "--max-tokens", "12", "--request-timeout-s", "120",
                                "--interference-probes", "2", "--disable-tqdm", "--seed", "3"])
    finally:
        srv.stop()
    out = capsys.readouterr().out
    print(out)
    assert "never ended 0, 5xx 0, unexpected 0, KV used at idle 0 of" in out
    for kind in ("plain", "disconnect", "abort", "pathological", "oversized", "bad_param"):
        assert f"\n{kind} " in out, f"the mix had no {kind} request"
    assert code == 0 and out.rstrip().endswith("PASS")


@pytest.mark.parametrize("family", ["gemma2", "deepseek_v2"])
def test_short_soak_on_the_wave_2_families(family, tmp_path, capsys):
    """The soak's mix on a window-trimmed Gemma-2 and an MLA + MoE DeepSeek-V2 with chunked prefill and the radix
    cache: each request ends as its kind calls for, both KV spaces are fully free at idle."""
    folder = write_tiny_family(tmp_path, family)
    srv = start_server("--model-path", folder, "--max-total-tokens", "2048", "--chunked-prefill-size", "32",
                       "--grammar-timeout-s", "1")
    try:
        code = bench_soak.main(["--base-url", srv.base_url, "--api-key", API_KEY, "--num-requests", "200",
                                "--concurrency", "16", "--max-tokens", "32", "--request-timeout-s", "120",
                                "--interference-probes", "0", "--disable-tqdm", "--seed", "2",
                                "--max-rss-growth", "1.0"])  # RSS: warm-up growth dominates 200 requests
    finally:
        srv.stop()
    out = capsys.readouterr().out
    print(out)
    assert "never ended 0, 5xx 0, unexpected 0, KV used at idle 0 of 2048" in out
    if family == "gemma2":
        assert "window-layer KV used at idle 0 of" in out
    assert code == 0 and out.rstrip().endswith("PASS")


def test_request_past_its_deadline_ends_with_abort_and_keeps_its_text():
    srv = start_server("--request-timeout-s", "2")
    try:
        resp = srv.post("/generate", {"text": "Count to one thousand: 1, 2, 3,",
                                      "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}})
        stream = srv.post("/v1/completions", {"model": "default", "prompt": "Count: 1, 2,", "max_tokens": 4000,
                                              "stream": True}, stream=True)
        lines = [line for line in stream.iter_lines() if line]
        info = srv.idle_stats()
        assert srv.get("/health").status_code == 200
    finally:
        srv.stop()
    assert resp.status_code == 200, resp.text
    meta = resp.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and "deadline of 2s" in meta["finish_reason"]["message"]
    assert 0 < meta["completion_tokens"] < 4000 and resp.json()["text"]
    assert lines[-1] == b"data: [DONE]" and b'"finish_reason":"abort"' in lines[-2].replace(b" ", b"")
    assert info["kv_used_tokens"] == 0 and info["num_running_reqs"] == 0
