"""LoRA adapters over two tensor-parallel ranks (gloo on CPU): each adapter's matrices are split as their base linear
is (a column-parallel linear's rows of B, a row-parallel one's columns of A), so a mixed batch of adapters and the
base model gives HF + peft's greedy tokens, as at tp 1; an adapter loaded and unloaded while serving reaches the
follower rank too (its slot fills and empties there in the same step), and the pool is free at the end."""

import torch

from braid.runtime import Engine
from lora_tiny import VOCAB, peft_greedy, write_all, write_third

NEW = 8
GREEDY = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}


def _prompts(seed: int, lengths) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def test_adapters_split_over_two_ranks_match_peft(tmp_path):
    paths = write_third(tmp_path, write_all(tmp_path))
    prompts = _prompts(3, (11, 19, 7, 15))
    names = ["sql", None, "router", "sql"]
    with Engine(model_path=paths["base"], tp_size=2, lora_paths=[f"sql={paths['sql']}", f"router={paths['router']}"],
                max_lora_rank=8, max_total_tokens=1024, log_level="warning") as engine:
        got = [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=names)]
        engine.load_lora_adapter("tagger", paths["tagger"])
        tagged = engine.generate(input_ids=prompts[1], sampling_params=GREEDY, lora_path="tagger")["output_ids"]
        engine.unload_lora_adapter("tagger")
        stats = engine.get_stats()
        ranks = engine._ranks
    assert stats["lora_registered_adapters"] == ["sql", "router"] and "tagger" not in stats["lora_slots"]
    assert stats["kv_used_tokens"] == 0
    assert [proc.returncode for proc in ranks.followers] == [0]  # the follower applied every change and left cleanly
    assert got == peft_greedy(paths["base"], {n: paths[n] for n in ("sql", "router")}, prompts, names, NEW)
    assert tagged == peft_greedy(paths["base"], {"tagger": paths["tagger"]}, prompts[1:2], ["tagger"], NEW)[0]
