"""Llama-family variants (Qwen3 included) on tiny random configs: braid loads HF's safetensors and matches HF's logits
and greedy tokens."""

import pytest
import torch

from braid.runtime import Engine
from byte_tokenizer import byte_tokenizer
from gguf_files import gguf_writer, write_hf_tensors

VARIANTS = {
    "llama3_rope_scaling": dict(model_type="llama", cls="LlamaForCausalLM", extra=dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}, rope_theta=500000.0)),
    "qwen2_yarn_rope_scaling": dict(model_type="qwen2", cls="Qwen2ForCausalLM", extra=dict(
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})),
    "qwen2_qkv_bias": dict(model_type="qwen2", cls="Qwen2ForCausalLM", extra=dict()),
    "mistral_sliding_window": dict(model_type="mistral", cls="MistralForCausalLM", extra=dict(sliding_window=16)),
    "smollm_tied": dict(model_type="llama", cls="LlamaForCausalLM", extra=dict(tie_word_embeddings=True)),
    # q/k RMSNorms per head, a head_dim other than hidden / heads
    "qwen3_qk_norm": dict(model_type="qwen3", cls="Qwen3ForCausalLM", extra=dict(head_dim=24)),
}


def _make_checkpoint(tmp_path, variant):
    import transformers

    spec = VARIANTS[variant]
    cfg_cls = transformers.AutoConfig.for_model(spec["model_type"]).__class__
    kwargs = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
    cfg = cfg_cls(**{**kwargs, **spec["extra"]})
    torch.manual_seed(0)
    model = getattr(transformers, spec["cls"])(cfg).eval()
    with torch.no_grad():  # larger weights than HF's init so the logits are far from uniform
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
            elif "bias" in str(p):
                p.normal_(0, 0.2)
        if spec["model_type"] == "qwen2":
            for layer in model.model.layers:
                layer.self_attn.q_proj.bias.normal_(0, 0.5)
                layer.self_attn.k_proj.bias.normal_(0, 0.5)
        if spec["model_type"] == "qwen3":
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1, 0.5)
                layer.self_attn.k_norm.weight.normal_(1, 0.5)
    model.save_pretrained(tmp_path, safe_serialization=True)
    byte_tokenizer().save_pretrained(tmp_path)  # the folder needs nothing from elsewhere (the GPU machine's tests)
    return model


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_matches_hf(tmp_path, variant):
    _greedy_and_prompt_logprobs_match_hf(tmp_path, variant, _make_checkpoint(tmp_path, variant), atol=2e-4)


def _greedy_and_prompt_logprobs_match_hf(path, variant, hf, atol, **engine_kw):
    """Three prompts, 12 greedy tokens: braid's tokens equal HF's, its prompt logprobs within atol (HF on hf's
    device). Returns the engine's CUDA-graph replay count (None without graphs)."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (5, 40, 23)]
    with Engine(model_path=str(path), log_level="warning", **engine_kw) as engine:
        res = engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
                              return_logprob=True, logprob_start_len=0)
        graphs = engine.scheduler.runner.cuda_graph_runner
    device = next(hf.parameters()).device
    for ids, r in zip(prompts, res):
        x = torch.tensor([ids], device=device)
        with torch.no_grad():
            ref = hf.generate(x, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
            logp = torch.log_softmax(hf(x).logits[0].float(), -1).cpu()
        assert r["output_ids"] == ref[0, len(ids):].tolist(), variant
        got = torch.tensor([lp for lp, _ in r["meta_info"]["input_token_logprobs"][1:]])
        want = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        assert torch.allclose(got, want, atol=atol), (variant, (got - want).abs().max())
    return None if graphs is None else graphs.num_replays


def test_qwen3_gguf_matches_hf(tmp_path, request):
    """A Qwen3 GGUF (llama.cpp's tensor names, q/k norms as attn_q_norm / attn_k_norm, no rope permutation, head_dim
    from key_length) loads into braid's model: its tensors equal the HF model's it was written from, and so do greedy
    tokens. (transformers' own GGUF reader is no reference here: it leaves head_dim at hidden / heads.)"""
    import gguf

    from braid.runtime.loader.gguf import gguf_config, iter_gguf_tensors

    hf = _make_checkpoint(tmp_path / "hf", "qwen3_qk_norm")
    cfg = hf.config
    path = str(tmp_path / "qwen3.gguf")
    write_hf_tensors(gguf_writer(path, "qwen3", cfg), gguf.MODEL_ARCH.QWEN3, hf)

    config = gguf_config(path)
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] == 24
    theirs = hf.state_dict()
    ours = dict(iter_gguf_tensors(path, config))
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, theirs[name], rtol=0, atol=0, msg=name)
    prompt = torch.randint(0, 49152, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    # greedy on random tiny weights meets near-ties: both sides' reductions split as with 2 threads, whatever an
    # earlier test left (an in-process tp-2 Engine leaves 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    with Engine(model_path=path, tokenizer_path=str(tmp_path / "hf"), log_level="warning") as engine:
        out = engine.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 12,
                                                                 "ignore_eos": True})
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    assert out["output_ids"] == ref[0, len(prompt):].tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["qwen3_qk_norm", "llama3_rope_scaling", "mistral_sliding_window"])
def test_gpu_variant_matches_hf(tmp_path, variant):
    """The GPU path (Triton kernels, fused q/k head norms and rotary, CUDA-graph decode) in fp32 against HF on the
    GPU: the prompt's logprobs and the greedy tokens."""
    hf = _make_checkpoint(tmp_path, variant).cuda()
    replays = _greedy_and_prompt_logprobs_match_hf(tmp_path, variant, hf, atol=2e-3, dtype="float32",
                                                   cuda_graph_max_bs=4)
    assert replays >= 11
