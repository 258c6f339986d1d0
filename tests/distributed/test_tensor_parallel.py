"""Tensor parallelism on the CPU with gloo, 2 ranks: greedy tokens at tp 2 equal tp 1 (fp32), in-process and through
the server; a rank that dies takes the server to an error state instead of a hang."""

import os
import signal
import threading
import time

import psutil
import pytest
import requests
import torch

from braid.runtime import Engine
from real_server import start_server

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
SMOLLM2_PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "1, 2, 3, 4,"]


def _greedy_ids(model_path: str, tp_size: int, prompts, **kw) -> list[list[int]]:
    kw = {"tokenizer_path": "smollm2", "max_total_tokens": 2048, "log_level": "warning", **kw}
    with Engine(model_path=model_path, tp_size=tp_size, **kw) as engine:
        key = "prompt" if isinstance(prompts[0], str) else "input_ids"
        return [r["output_ids"] for r in engine.generate(**{key: prompts}, sampling_params=GREEDY)]


def _save(model, path) -> str:
    with torch.no_grad():  # larger weights than HF's init: logits far from uniform
        for name, p in model.named_parameters():
            p.normal_(0, 0.5 if name.endswith("norm.weight") else 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def _prompt_ids(vocab: int, lengths=(5, 37)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def test_tiny_llama_with_one_kv_head_replicated_over_two_ranks_equals_one_rank(tmp_path):
    import transformers

    # vocab 1001: the last rank's vocab shard is padded; one KV head: both ranks keep it
    cfg = transformers.LlamaConfig(vocab_size=1001, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    path = _save(transformers.LlamaForCausalLM(cfg), tmp_path)
    prompts = _prompt_ids(1001)
    single = _greedy_ids(path, 1, prompts)
    assert _greedy_ids(path, 2, prompts) == single
    assert len(set(single[0])) > 1  # not a degenerate repetition that any model would produce


def _gemma_config(family: str):
    import transformers

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=16,
                  query_pre_attn_scalar=24)
    if family == "gemma2":
        return transformers.Gemma2Config(**common, attn_logit_softcapping=3.0, final_logit_softcapping=4.0)
    # Gemma-3: q/k head norms (replicated on every rank), the window layers' own rope
    return transformers.Gemma3TextConfig(**common, layer_types=["sliding_attention", "full_attention",
                                                                "sliding_attention"],
                                         rope_parameters={"full_attention": {"rope_type": "default",
                                                                             "rope_theta": 100000.0},
                                                          "sliding_attention": {"rope_type": "default",
                                                                                "rope_theta": 1000.0}})


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_tiny_gemma_over_two_ranks_equals_one_rank(tmp_path, family):
    import transformers

    torch.manual_seed(0)
    path = _save(transformers.AutoModelForCausalLM.from_config(_gemma_config(family)), tmp_path)
    prompts = _prompt_ids(512, (9, 40))  # past the 16-token window
    assert _greedy_ids(path, 2, prompts) == _greedy_ids(path, 1, prompts)


def test_tiny_qwen3_over_two_ranks_equals_one_rank(tmp_path):
    import transformers

    cfg = transformers.Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    path = _save(transformers.Qwen3ForCausalLM(cfg), tmp_path)
    prompts = _prompt_ids(512)
    single = _greedy_ids(path, 1, prompts)
    assert _greedy_ids(path, 2, prompts) == single and len(set(single[0])) > 1


PHONE = r"\(\d{3}\) \d{3}-\d{4}"


def _smollm2_outputs(tp_size: int) -> dict:
    """Greedy prompts, a regex-constrained request (the grammar gate), seeded n=2 sampling (rank 0's draws)."""
    with Engine(model_path="smollm2", tp_size=tp_size, max_total_tokens=2048, log_level="warning") as engine:
        with pytest.raises(ValueError, match="regex"):  # refused in the scheduler: on every rank, before any step
            engine.generate("Hi", {"max_new_tokens": 4, "regex": "(unclosed"})
        out = {"greedy": [r["output_ids"] for r in engine.generate(SMOLLM2_PROMPTS, GREEDY)]}
        out["regex"] = engine.generate("Call me at ", {"temperature": 0, "max_new_tokens": 20, "regex": PHONE})["text"]
        out["sampled"] = [r["output_ids"] for r in engine.generate(
            "Once upon a time", {"temperature": 1.0, "max_new_tokens": 8, "n": 2, "seed": 5, "ignore_eos": True})]
        out["kv_used"] = engine.get_stats()["kv_used_tokens"]
        ranks = engine._ranks
    if ranks is not None:  # closed: every follower left after rank 0's stop step
        out["follower_exit_codes"] = [proc.returncode for proc in ranks.followers]
    return out


@pytest.fixture(scope="module")
def smollm2_tp1():
    return _smollm2_outputs(1)


def test_smollm2_engine_tp2_equals_tp1(smollm2_tp1):
    import re

    tp2 = _smollm2_outputs(2)
    assert tp2.pop("follower_exit_codes") == [0]
    assert tp2 == smollm2_tp1
    assert re.fullmatch(PHONE, tp2["regex"]) and tp2["kv_used"] == 0
    assert tp2["sampled"][0] != tp2["sampled"][1]  # two seeds, two samples


def test_unsupported_family_and_uneven_split_are_refused(tmp_path):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=64)
    path = _save(transformers.LlamaForCausalLM(cfg), tmp_path)
    with pytest.raises(ValueError, match="3 attention heads do not split over tp_size=2"):
        Engine(model_path=path, tokenizer_path="smollm2", tp_size=2, max_total_tokens=256, log_level="error")
    with pytest.raises(ValueError, match="not supported yet"):
        Engine(model_path=path, tp_size=2, quantization="fp8")


def _rank_pids(server_pid: int) -> list[int]:
    children = psutil.Process(server_pid).children()
    return sorted(c.pid for c in children if "braid.runtime.processes.scheduler_process" in " ".join(c.cmdline()))


def test_smollm2_server_tp2_equals_tp1_and_a_dead_rank_fails_fast(smollm2_tp1):
    srv = start_server(["--model-path", "smollm2", "--tp-size", "2", "--max-total-tokens", "2048", "--api-key", "k",
                        "--log-stats-interval-s", "0"], "k", "braid-tp2-")
    try:
        got = [srv.post("/generate", {"text": p, "sampling_params": GREEDY}).json()["output_ids"]
               for p in SMOLLM2_PROMPTS]
        assert got == smollm2_tp1["greedy"]
        info = srv.get("/get_server_info").json()
        assert info["tp_size"] == 2 and info["kv_used_tokens"] == 0

        ranks = _rank_pids(srv.proc.pid)
        assert len(ranks) == 2
        result = {}

        def long_request():
            try:
                r = srv.post("/generate", {"text": "Once upon a time", "sampling_params": {
                    "temperature": 0, "max_new_tokens": 1500, "ignore_eos": True}}, timeout=60)
                result["status"] = r.status_code
            except requests.RequestException as e:  # the server went away before answering: an error too
                result["status"] = type(e).__name__
            result["at"] = time.monotonic()

        worker = threading.Thread(target=long_request)
        worker.start()
        time.sleep(1.5)  # the request is decoding
        killed_at = time.monotonic()
        os.kill(ranks[-1], signal.SIGKILL)  # a follower rank
        worker.join(30)
        assert not worker.is_alive() and result["at"] - killed_at < 10, result
        assert result["status"] != 200, result
        try:
            assert srv.get("/health", timeout=5).status_code == 503
        except requests.ConnectionError:
            pass  # already exited
        assert srv.proc.wait(20) != 0
    finally:
        srv.stop()


def test_one_rank_through_the_distributed_path_equals_the_plain_path(tmp_path):
    """--dist-init-addr at tp 1: a world of one, every collective and the leader's broadcasts run (on the H200 this
    is the NCCL path: benchmarks/gpu/tp1_distributed_path.sh)."""
    import transformers

    from braid.runtime.processes.tensor_parallel import free_loopback_addr

    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    path = _save(transformers.LlamaForCausalLM(cfg), tmp_path)
    prompts = _prompt_ids(300, (6, 20))
    assert _greedy_ids(path, 1, prompts, dist_init_addr=free_loopback_addr()) == _greedy_ids(path, 1, prompts)


@pytest.mark.parametrize("q_lora", [False, True])
def test_tiny_deepseek_v2_mla_and_moe_over_two_ranks_equal_one_rank(tmp_path, q_lora):
    """MLA heads split over the ranks (each caches the whole latent), MoE experts split inside (their intermediate
    dim), the shared experts and the dense MLP as column/row-parallel linears."""
    import transformers

    cfg = transformers.DeepseekV2Config(
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, kv_lora_rank=32, q_lora_rank=24 if q_lora else None, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=1.5, max_position_embeddings=256, tie_word_embeddings=False,
        topk_method="greedy")
    torch.manual_seed(0)
    path = _save(transformers.DeepseekV2ForCausalLM(cfg), tmp_path)
    prompts = _prompt_ids(300, (6, 30))
    assert _greedy_ids(path, 2, prompts) == _greedy_ids(path, 1, prompts)


def test_two_nodes_on_one_host_serve_what_one_rank_does(smollm2_tp1, tmp_path):
    """--nnodes 2: node 0 serves HTTP with rank 0, node 1 (--node-rank 1) runs rank 1 and exits 0 when node 0 stops."""
    import subprocess
    import sys

    from real_server import free_port

    common = ["--model-path", "smollm2", "--tp-size", "2", "--nnodes", "2", "--dist-init-addr",
              f"127.0.0.1:{free_port()}", "--max-total-tokens", "2048", "--log-level", "info"]
    node1_log = tmp_path / "node1.log"
    # one thread, like the test servers: both "nodes" share this host's 2 cores
    with open(node1_log, "wb") as log:
        node1 = subprocess.Popen([sys.executable, "-m", "braid.runtime.launch", *common, "--node-rank", "1"],
                                 stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        srv = start_server([*common, "--api-key", "k"], "k", "braid-node0-")
        try:
            got = srv.post("/generate", {"text": SMOLLM2_PROMPTS[0], "sampling_params": GREEDY}).json()["output_ids"]
            assert got == smollm2_tp1["greedy"][0]
            assert len(_rank_pids(srv.proc.pid)) == 1  # node 0 runs one of the two ranks
        finally:
            srv.stop()
        assert node1.wait(30) == 0, node1_log.read_text()[-3000:]
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def test_the_sharded_loader_reads_only_the_ranks_slices(tmp_path, monkeypatch):
    """Rank 1 of 2 reads half of each split tensor from the safetensors file (experts included), whole tensors for
    what every rank keeps."""
    import transformers

    from braid.runtime.config import ServerArgs
    from braid.runtime.distributed import parallel_state as ps
    from braid.runtime.loader import load_model_config
    from braid.runtime.model_executor.model_loader import iter_weights
    from braid.runtime.models.registry import get_model_class

    cfg = transformers.DeepseekV2Config(
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        max_position_embeddings=256, tie_word_embeddings=False, topk_method="greedy")
    path = _save(transformers.DeepseekV2ForCausalLM(cfg), tmp_path)
    monkeypatch.setattr(ps, "_TP_SIZE", 2)
    monkeypatch.setattr(ps, "_TP_RANK", 1)
    args = ServerArgs(model_path=path, tp_size=2)
    model_config = load_model_config(args)
    with torch.device("meta"):
        model = get_model_class(model_config.architecture)(model_config)
    weights, _ = iter_weights(model_config, args, model)
    shapes = {name: tuple(t.shape) for name, t in weights}
    layer = "model.layers.1."
    assert shapes[layer + "mlp.experts.3.gate_proj.weight"] == (16, 64)  # intermediate 32 over 2 ranks
    assert shapes[layer + "mlp.experts.3.down_proj.weight"] == (64, 16)
    assert shapes[layer + "self_attn.q_b_proj.weight"] == (2 * 24, 24)  # 2 of 4 heads
    assert shapes[layer + "self_attn.kv_a_proj_with_mqa.weight"] == (32 + 8, 64)  # the latent: whole
    assert shapes[layer + "self_attn.o_proj.weight"] == (64, 2 * 16)
    assert shapes["model.embed_tokens.weight"] == (150, 64) and shapes[layer + "mlp.gate.weight"] == (4, 64)
