"""Adapters loaded and unloaded while serving, and paged through fewer device slots than there are adapters, in the
in-process Engine against HF + peft: a dynamically loaded adapter gives peft's greedy tokens; with
--max-loaded-loras 2 three adapters in an interleaved mix still do (least recently used eviction); with
--max-loras-per-batch 1 no pass mixes two adapters and every request still completes correctly; an unload frees
the adapter's slot and cached prefixes (a later adapter of the same name never reuses them); bad loads are refused
with what is wrong, and the engine keeps serving."""

import pytest
import torch

from braid.runtime import Engine
from braid.runtime.lora.adapter import LoraError
from lora_tiny import VOCAB, peft_greedy, write_all, write_misfit, write_third

NEW = 8
GREEDY = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_paging")
    return write_third(root, write_all(root))


@pytest.fixture(autouse=True)
def two_threads(request):
    # greedy on random tiny weights meets near-ties: both sides' reductions split as with 2 threads
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    request.addfinalizer(lambda: torch.set_num_threads(threads))


def _prompts(seed: int, lengths) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def _adapters(paths, *names):
    return {n: paths[n] for n in names}


def _assert_idle(stats: dict) -> None:
    assert stats["kv_used_tokens"] == 0 and stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0
    assert stats["kv_free_tokens"] + stats["kv_cached_tokens"] == stats["kv_total_tokens"]


def test_dynamic_load_matches_peft_then_unload(paths):
    prompts = _prompts(1, (9, 21, 14, 17))
    names = ["sql", "router", None, "sql"]
    with Engine(model_path=paths["base"], enable_lora=True, max_lora_rank=8, log_level="warning") as engine:
        with pytest.raises(ValueError, match="unknown LoRA adapter 'sql'"):
            engine.generate(input_ids=prompts[0], sampling_params=GREEDY, lora_path="sql")
        engine.load_lora_adapter("sql", paths["sql"])
        engine.load_lora_adapter("router", paths["router"])
        got = [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=names)]
        stats = engine.get_stats()
        assert stats["lora_registered_adapters"] == ["sql", "router"]
        assert sorted(n for n in stats["lora_slots"] if n) == ["router", "sql"]

        engine.unload_lora_adapter("sql")
        with pytest.raises(ValueError, match="unknown LoRA adapter 'sql'"):
            engine.generate(input_ids=prompts[0], sampling_params=GREEDY, lora_path="sql")
        with pytest.raises(LoraError, match="unknown LoRA adapter 'sql'") as err:
            engine.unload_lora_adapter("sql")
        assert err.value.code == "lora_not_found"
        stats = engine.get_stats()
        assert "sql" not in stats["lora_slots"] and stats["lora_registered_adapters"] == ["router"]
        _assert_idle(stats)

        # "sql" again, now holding router's weights: prompts[0]'s prefix cached under the old "sql" is not reused
        engine.load_lora_adapter("sql", paths["router"])
        again = engine.generate(input_ids=prompts[0], sampling_params=GREEDY, lora_path="sql")
        as_router = engine.generate(input_ids=prompts[0], sampling_params=GREEDY, lora_path="router")
    assert again["meta_info"]["cached_tokens"] == 0
    assert again["output_ids"] == as_router["output_ids"]
    want = peft_greedy(paths["base"], _adapters(paths, "sql", "router"), prompts, names, NEW)
    assert got == want
    assert again["output_ids"] == peft_greedy(paths["base"], _adapters(paths, "router"), prompts[:1], ["router"],
                                              NEW)[0]


def test_three_adapters_through_two_slots_match_peft(paths):
    """--max-loaded-loras 2: three adapters served in an interleaved mix, in one submission and one at a time;
    every answer is peft's for its adapter, and adapters were evicted and loaded again on the way."""
    names = ["sql", "tagger", "router", None, "sql", "tagger", "router", "router", "sql"]
    prompts = _prompts(2, (11, 7, 19, 13, 16, 9, 22, 8, 12))
    with Engine(model_path=paths["base"], lora_paths=[f"{n}={paths[n]}" for n in ("sql", "router", "tagger")],
                max_loras_per_batch=2, max_loaded_loras=2, log_level="warning") as engine:
        mixed = [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=GREEDY,
                                                          lora_path=names)]
        one_by_one = [engine.generate(input_ids=p, sampling_params=GREEDY, lora_path=n)["output_ids"]
                      for p, n in zip(prompts, names)]
        stats = engine.get_stats()
    want = peft_greedy(paths["base"], _adapters(paths, "sql", "router", "tagger"), prompts, names, NEW)
    assert mixed == want
    assert one_by_one == want
    assert stats["lora_num_slots"] == 2 and len(stats["lora_slots"]) == 2
    assert stats["lora_slot_evictions_total"] >= 4  # one at a time, each adapter change after the first two evicts
    _assert_idle(stats)


def test_one_adapter_per_batch(paths):
    """--max-loras-per-batch 1: requests on two adapters (and the base model) submitted together all complete with
    peft's tokens, and no forward pass mixes two adapters."""
    names = ["sql", "router", "sql", None, "router", "sql"]
    prompts = _prompts(3, (10, 15, 8, 12, 18, 9))
    with Engine(model_path=paths["base"], lora_paths=[f"{n}={paths[n]}" for n in ("sql", "router")],
                max_loras_per_batch=1, log_level="warning") as engine:
        manager = engine.scheduler.runner.lora_manager
        passes = []
        prepare = manager.prepare

        def recording(fb):
            passes.append({n for n in (fb.lora_paths or ()) if n is not None})
            return prepare(fb)

        manager.prepare = recording
        got = [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=names)]
        _assert_idle(engine.get_stats())
    assert max(len(p) for p in passes) == 1
    assert got == peft_greedy(paths["base"], _adapters(paths, "sql", "router"), prompts, names, NEW)


def test_bad_loads_are_refused_and_the_engine_keeps_serving(paths, tmp_path):
    misfit = str(tmp_path / "misfit")
    write_misfit(paths["sql"], misfit)
    with Engine(model_path=paths["base"], enable_lora=True, max_lora_rank=4,
                lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], log_level="warning") as engine:
        cases = [("router", paths["router"], "rank 8 exceeds --max-lora-rank 4", "lora_invalid"),
                 ("m", misfit, r"lora_A \(4, 32\) / lora_B \(\d+, 4\) do not fit the base linear", "lora_invalid"),
                 ("gone", str(tmp_path / "nowhere"), "no such folder", "lora_invalid"),
                 ("t", paths["tagger"], "target module 'down_proj' is not in --lora-target-modules", "lora_invalid"),
                 ("a:b", paths["sql"], "without ':'", "lora_invalid")]
        for name, path, message, code in cases:
            with pytest.raises(LoraError, match=message) as err:
                engine.load_lora_adapter(name, path)
            assert err.value.code == code
        engine.load_lora_adapter("sql", paths["sql"])
        with pytest.raises(LoraError, match="'sql' is already loaded") as err:
            engine.load_lora_adapter("sql", paths["sql"])
        assert err.value.code == "lora_exists"
        out = engine.generate(input_ids=[1, 2, 3], sampling_params=GREEDY, lora_path="sql")
        assert len(out["output_ids"]) == NEW
        assert engine.get_stats()["lora_registered_adapters"] == ["sql"]
    # without --lora-target-modules the start adapters' targets carry buffers, and only they
    with Engine(model_path=paths["base"], lora_paths=[f"sql={paths['sql']}"], log_level="warning") as engine:
        with pytest.raises(LoraError, match="target module 'down_proj' has no adapter buffers"):
            engine.load_lora_adapter("tagger", paths["tagger"])
        assert len(engine.generate(input_ids=[4, 5], sampling_params=GREEDY, lora_path="sql")["output_ids"]) == NEW
