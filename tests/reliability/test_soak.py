"""The soak benchmark's short version (CI): every request ends, no 5xx, each abusive request gets the answer
its kind calls for, the KV pool is fully free at idle; and a per-request deadline ends a long request."""

import copy

import pytest
import torch

from braid.runtime.bench import bench_soak
from conftest import API_KEY, start_server


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


def _tiny_family_folder(folder, family: str) -> str:
    """A random tiny Gemma-2 (window 16, so short requests cross it) or DeepSeek-V2 (MLA, MoE) written with
    save_pretrained, with SmolLM2's tokenizer: a BPE whose jump-forward re-encodings roll computed tokens back."""
    import transformers

    from braid.runtime.loader.tokenizer import load_tokenizer

    tok = copy.deepcopy(load_tokenizer("smollm2"))
    tok.save_pretrained(folder)
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, max_position_embeddings=4096,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=0)
    if family == "gemma2":
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
            **common))
    else:
        model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, moe_intermediate_size=32,
            n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32,
            q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, topk_method="greedy",
            n_group=1, topk_group=1, **common))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08)
    model.save_pretrained(folder, safe_serialization=True)
    return str(folder)


@pytest.mark.parametrize("family", ["gemma2", "deepseek_v2"])
def test_short_soak_on_the_wave_2_families(family, tmp_path, capsys):
    """The soak's mix on a window-trimmed Gemma-2 and an MLA + MoE DeepSeek-V2 with chunked prefill and the radix
    cache: each request ends as its kind calls for, both KV spaces are fully free at idle."""
    folder = _tiny_family_folder(tmp_path, family)
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
