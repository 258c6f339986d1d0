"""LoRA adapters in the Engine against HF + peft: one batch mixing base-model rows and rows on two adapters (different
ranks and targets, rslora on one, q/k/v and gate/up landing in braid's fused projections) gives peft's greedy tokens
and prompt logprobs for each; the radix cache keeps each adapter's prefixes apart; bad adapters are refused."""

import json
import os

import pytest
import torch

from braid.runtime import Engine
from braid.runtime.config import ServerArgs
from lora_tiny import ADAPTERS, VOCAB, peft_model, write_adapter, write_all

GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return write_all(tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="module")
def qwen2_paths(tmp_path_factory):
    return write_all(tmp_path_factory.mktemp("lora_qwen2"), "qwen2")


@pytest.fixture(autouse=True)
def two_threads(request):
    # greedy on random tiny weights meets near-ties: both sides' reductions split as with 2 threads
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    request.addfinalizer(lambda: torch.set_num_threads(threads))


def _engine(paths, **kw):
    return Engine(model_path=paths["base"], lora_paths=[f"{n}={paths[n]}" for n in ADAPTERS], log_level="warning",
                  **kw)


def _peft_reference(paths, prompts, adapters):
    """(greedy tokens, prompt logprobs [len - 1]) per prompt from transformers + peft, adapter None = base."""
    model = peft_model(paths["base"], {name: paths[name] for name in ADAPTERS})
    out = []
    for ids, adapter in zip(prompts, adapters):
        x = torch.tensor([ids])
        mask = torch.ones_like(x)  # generate would otherwise take token 0 in the prompt for padding
        with torch.no_grad():
            if adapter is None:
                with model.disable_adapter():
                    gen = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                         eos_token_id=None, pad_token_id=0)
                    logits = model(input_ids=x).logits[0]
            else:
                model.set_adapter(adapter)
                gen = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)
                logits = model(input_ids=x).logits[0]
        logp = torch.log_softmax(logits.float(), -1)
        out.append((gen[0, len(ids):].tolist(), logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]))
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_mixed_batch_matches_peft(family, request):
    paths = request.getfixturevalue("paths" if family == "llama" else "qwen2_paths")
    gen = torch.Generator().manual_seed(3)
    lengths = (7, 30, 19, 12, 25, 9)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    adapters = [None, "sql", "router", "router", None, "sql"]
    with _engine(paths) as engine:
        res = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0,
                              lora_path=adapters)
        # the same prompt under each adapter: the adapters change the output (so the comparison above can fail)
        same = engine.generate(input_ids=[prompts[1]] * 3, sampling_params=GREEDY, lora_path=[None, "sql", "router"])
    refs = _peft_reference(paths, prompts, adapters)
    for i, (r, (want_ids, want_lp)) in enumerate(zip(res, refs)):
        assert r["output_ids"] == want_ids, (i, adapters[i])
        got = torch.tensor([lp for lp, _ in r["meta_info"]["input_token_logprobs"][1:]])
        assert torch.allclose(got, want_lp, atol=2e-4), (i, adapters[i], (got - want_lp).abs().max())
    outs = [tuple(s["output_ids"]) for s in same]
    assert len(set(outs)) == 3, outs
    assert outs[1] == tuple(res[1]["output_ids"])  # prompt 1 under sql, beside other adapters or alone


def test_radix_cache_keeps_adapters_apart(paths):
    """A prompt computed under one adapter is not reused under another or the base model (cached_tokens 0), is
    reused under the same one, and every answer equals the uncached one."""
    prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    with _engine(paths) as engine:
        first = {a: engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path=a)
                 for a in (None, "sql", "router")}
        again = {a: engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path=a)
                 for a in ("router", "sql", None)}
    for a in (None, "sql", "router"):
        # the first run of each finds nothing of the others' (base went first, so sql and router miss it)
        assert first[a]["meta_info"]["cached_tokens"] == 0, a
        assert again[a]["meta_info"]["cached_tokens"] >= len(prompt) - 1, a
        assert again[a]["output_ids"] == first[a]["output_ids"], a
    assert first["sql"]["output_ids"] != first[None]["output_ids"]


def test_unknown_adapter_is_refused(paths):
    with _engine(paths) as engine:
        with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
            engine.generate(input_ids=[1, 2, 3], sampling_params=GREEDY, lora_path="nope")
        # the engine keeps serving
        assert len(engine.generate(input_ids=[1, 2, 3], sampling_params=GREEDY, lora_path="sql")["output_ids"]) == 10


def _edit_config(folder, **fields):
    cfg_file = os.path.join(folder, "adapter_config.json")
    with open(cfg_file) as f:
        cfg = json.load(f)
    cfg.update(fields)
    with open(cfg_file, "w") as f:
        json.dump(cfg, f)


def test_bad_adapters_are_refused(paths, tmp_path):
    from braid.runtime.lora.adapter import load_adapter

    def copy(name):
        import shutil
        dst = tmp_path / f"{name}-{len(os.listdir(tmp_path))}"
        shutil.copytree(paths[name], dst)
        return str(dst)

    with pytest.raises(ValueError, match="rank 8 exceeds --max-lora-rank 4"):
        load_adapter("router", paths["router"], max_rank=4)
    with pytest.raises(ValueError, match=r"target module '(gate|up|down)_proj' is not in --lora-target-modules"):
        load_adapter("router", paths["router"], allowed_targets=frozenset({"v_proj", "q_proj"}))
    dora = copy("sql")
    _edit_config(dora, use_dora=True)
    with pytest.raises(ValueError, match="DoRA"):
        load_adapter("d", dora)
    fifo = copy("sql")
    _edit_config(fifo, fan_in_fan_out=True)
    with pytest.raises(ValueError, match="fan_in_fan_out"):
        load_adapter("f", fifo)
    pickled = copy("sql")
    os.rename(os.path.join(pickled, "adapter_model.safetensors"), os.path.join(pickled, "adapter_model.bin"))
    with pytest.raises(ValueError, match="pickle"):
        load_adapter("p", pickled)
    head = str(tmp_path / "lm_head")
    write_adapter(paths["base"], head, 9, r=2, lora_alpha=4, target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="target module 'lm_head'"):
        load_adapter("h", head)
    # refused at start, naming the flag
    with pytest.raises(ValueError, match="--max-loaded-loras 2 is below --max-loras-per-batch 3"):
        ServerArgs(model_path=paths["base"], lora_paths=[f"a{i}={paths['sql']}" for i in range(3)],
                   max_loras_per_batch=3, max_loaded_loras=2)
    # more adapters than device slots is fine: they are paged in on demand
    assert ServerArgs(model_path=paths["base"], lora_paths=[f"a{i}={paths['sql']}" for i in range(3)],
                      max_loras_per_batch=1, max_loaded_loras=2).max_loaded_loras == 2
    assert ServerArgs(model_path=paths["base"], enable_lora=True, max_loras_per_batch=3).max_loaded_loras == 3
    with pytest.raises(ValueError, match="--lora-target-modules"):
        ServerArgs(lora_target_modules=["embed_tokens"])
    with pytest.raises(ValueError, match="--max-lora-rank"):
        Engine(model_path=paths["base"], lora_paths=[f"router={paths['router']}"], max_lora_rank=4,
               log_level="warning")


def test_n_chunked_and_mixed_batches_keep_the_adapter(paths):
    """n > 1 (the fan-out and its shared prefill), prompts prefilled in chunks, and decode rows riding in those
    chunks' passes (--enable-mixed-chunk) all run on their request's adapter."""
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (45, 38, 41)]
    adapters = ["router", None, "sql"]
    with _engine(paths) as engine:
        want = [engine.generate(input_ids=p, sampling_params=GREEDY, lora_path=a)["output_ids"]
                for p, a in zip(prompts, adapters)]
        fanned = engine.generate(input_ids=prompts[0], sampling_params={**GREEDY, "n": 2}, lora_path="router")
    assert [r["output_ids"] for r in fanned] == [want[0], want[0]]
    with _engine(paths, chunked_prefill_size=16, enable_mixed_chunk=True) as engine:
        got = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=adapters)
        mixed = engine.scheduler.stats["num_decode_tokens_mixed"]
    assert [r["output_ids"] for r in got] == want
    assert mixed > 0  # some decode rows did share a pass with another request's chunk


def test_only_targeted_linears_carry_adapters(paths):
    """With only the attention adapter, the MLP's linears carry no LoRA (and pay nothing for it)."""
    with Engine(model_path=paths["base"], lora_paths=[f"sql={paths['sql']}"], log_level="warning") as engine:
        manager = engine.scheduler.runner.lora_manager
        model = engine.scheduler.runner.model
        assert sorted(manager.layers) == [f"model.layers.{i}.self_attn.{p}" for i in (0, 1)
                                          for p in ("o_proj", "qkv_proj")]
        assert all(layer.mlp.gate_up_proj.lora is None and layer.mlp.down_proj.lora is None
                   for layer in model.model.layers)
        # one row per device slot (--max-loaded-loras, by default --max-loras-per-batch 8), rank 4 per q/k/v slice
        assert manager.layers["model.layers.0.self_attn.qkv_proj"].a.shape == (8, 3 * 4, 64)


@pytest.mark.gpu
def test_cuda_graphs_serve_adapters_as_the_eager_engine(paths):
    """On CUDA at the defaults (decode and extend CUDA graphs, the batch-1 GEMV, the BGMV / SGMV kernels): a batch
    mixing the base model and two adapters, then each request alone at batch 1, gives the greedy tokens of the same
    engine without graphs, and the graphed prefill gives peft's prompt logprobs; the graphs served the passes."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (7, 30, 19, 12)]
    adapters = [None, "sql", "router", "sql"]
    runs = {}
    for graphs in (True, False):
        with _engine(paths, device="cuda", dtype="float32", max_total_tokens=4096,
                     disable_cuda_graph=not graphs) as engine:
            batch = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True,
                                    logprob_start_len=0, lora_path=adapters)
            alone = [engine.generate(input_ids=p, sampling_params=GREEDY, lora_path=a)
                     for p, a in zip(prompts, adapters)]
            if graphs:
                base_replays = engine.scheduler.runner.cuda_graph_runner.num_base_replays
            runs[graphs] = (batch, [r["output_ids"] for r in batch + alone], engine.scheduler.get_stats())
    (batch, tokens, stats), (_, eager_tokens, eager_stats) = runs[True], runs[False]
    # the base request alone replayed the graphs without delta ops; the others the graphs with them
    assert GREEDY["max_new_tokens"] - 1 <= base_replays < stats["num_forward_decode_graphed"]
    assert stats["num_forward_decode_graphed"] > 0 and stats["num_forward_extend_graphed"] > 0
    assert eager_stats["num_forward_decode_graphed"] == 0
    assert tokens == eager_tokens
    assert tokens[1] != tokens[2] or tokens[0] != tokens[1]  # the adapters change the output
    for r, (_, want_lp), name in zip(batch, _peft_reference(paths, prompts, adapters), adapters):
        got = torch.tensor([lp for lp, _ in r["meta_info"]["input_token_logprobs"][1:]])
        assert torch.allclose(got, want_lp, atol=2e-3), (name, (got - want_lp).abs().max())
