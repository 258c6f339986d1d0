"""tp 1 through the distributed (NCCL) code path vs the plain path on one GPU, Llama-3-8B-shaped dummy weights (bf16):
greedy tokens must be identical (a world of one changes no value), and the decode speed of each path is measured
(the cost of the per-layer NCCL calls and the leader's per-step broadcast).

    python3 benchmarks/gpu/tp1_distributed_path.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
import time

import torch

from braid.runtime import Engine
from braid.runtime.processes.tensor_parallel import free_loopback_addr

MODEL = dict(model_path="llama3-8b-dummy", load_format="dummy", model_config="benchmarks/configs/llama3-8b.json",
             tokenizer_path=".gpu/tok", dtype="bfloat16", max_total_tokens=65536, cuda_graph_max_bs=32,
             log_level="warning")
CONFIGS = [("plain, CUDA graphs", {}), ("distributed, CUDA graphs", {"dist": True}),
           ("plain, eager", {"disable_cuda_graph": True}), ("distributed, eager", {"dist": True, "disable_cuda_graph": True})]


def greedy(engine, prompts, new_tokens):
    sp = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    out = engine.generate(input_ids=prompts, sampling_params=sp)
    return [r["output_ids"] for r in out], time.perf_counter() - started


def main(out_dir: str) -> int:
    gen = torch.Generator().manual_seed(0)
    check_prompts = [torch.randint(0, 128000, (n,), generator=gen).tolist() for n in (7, 64, 300, 31)]
    batch1 = [torch.randint(0, 128000, (128,), generator=gen).tolist()]
    batch32 = [torch.randint(0, 128000, (128,), generator=gen).tolist() for _ in range(32)]
    rows, reference, failed = [], {}, False
    for name, cfg in CONFIGS:
        kw = {k: v for k, v in cfg.items() if k != "dist"}
        if cfg.get("dist"):
            kw["dist_init_addr"] = free_loopback_addr()
        try:
            with Engine(**MODEL, **kw) as engine:
                distributed = type(engine.scheduler).__name__ == "LeaderScheduler"
                ids, _ = greedy(engine, check_prompts, 48)
                greedy(engine, batch1, 16)  # warm-up
                _, t1 = greedy(engine, batch1, 256)
                _, t32 = greedy(engine, batch32, 128)
        except Exception as e:  # noqa: BLE001 - reported as a FAIL line
            print(f"FAIL {name}: {type(e).__name__}: {e}")
            failed = True
            continue
        graphs = "graphs" if "disable_cuda_graph" not in kw else "eager"
        same = reference.setdefault(graphs, ids) == ids
        failed |= not same or distributed != bool(cfg.get("dist"))
        rows.append(dict(config=name, distributed_path=distributed, greedy_equal_to_plain=same,
                         batch1_tok_s=round(256 / t1, 1), batch32_tok_s=round(32 * 128 / t32, 1)))
        print(f"{'PASS' if same else 'FAIL'} {name}: greedy tokens {'equal to' if same else 'DIFFER from'} the plain "
              f"path ({graphs}); distributed path in use: {distributed}")
    with open(f"{out_dir}/tp1_distributed_path.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"\n{'config':28} {'distributed':>11} {'greedy ==':>9} {'b1 tok/s':>9} {'b32 tok/s':>10}")
    for r in rows:
        print(f"{r['config']:28} {str(r['distributed_path']):>11} {str(r['greedy_equal_to_plain']):>9} "
              f"{r['batch1_tok_s']:>9} {r['batch32_tok_s']:>10}")
    print("PASS tp1 distributed path" if not failed and len(rows) == len(CONFIGS) else "FAIL tp1 distributed path")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
