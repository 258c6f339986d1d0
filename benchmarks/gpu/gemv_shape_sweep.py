"""The batch-1 GEMV per weight shape of a model config: cuBLAS, the runtime's pick (measured_tiles.GEMV_CONFIGS or autotuned)
and a config sweep, with PDL.

For each projection of a decoder layer (qkv, o, gate_up with the model's gated activation fused, down) and the LM
head, every layer's weight of that shape (random bf16) is multiplied by one x in one CUDA graph, as in a decode
step; weight bytes / time = TB/s. The sweep gives each shape a share of the time budget, largest shapes first, then
times its three fastest configs again on persistent grids (1, 2, 4, 8 programs per SM), and prints the best config
beside the runtime's pick, then the step's GEMV floor both ways and rows for runtime/layers/measured_tiles.py's
GEMV_CONFIGS.
Run on the device: python3 benchmarks/gpu/gemv_shape_sweep.py --model-config benchmarks/configs/gemma2-9b.json
    [--budget-s 240] [--jsonl PATH] [--shapes o,qkv]
"""
import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as torch_F

from braid.runtime.layers.gemv import gemv
from decode_b1 import graph_time_us  # benchmarks/gpu, this script's folder

from sweep_rows import H200_COPY_BYTES_PER_S  # benchmarks/gpu, this script's folder

COPY_TB_S = H200_COPY_BYTES_PER_S / 1e12


def shapes_of(cfg: dict) -> list[tuple[str, int, int, int, str]]:
    """-> (name, rows N, columns K, count, activation) per weight shape of one decode step."""
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or hidden // heads
    act = "gelu" if "gelu" in str(cfg.get("hidden_activation") or cfg.get("hidden_act")) else "silu"
    return [("gate_up", 2 * inter, hidden, layers, act), ("down", hidden, inter, layers, ""),
            ("qkv", (heads + 2 * kv_heads) * head_dim, hidden, layers, ""), ("o", hidden, heads * head_dim, layers, ""),
            ("lm_head", cfg["vocab_size"], hidden, 1, "")]


def sweep_configs():
    out = []
    # the likelier winners first (the Llama-3-8B sweep's region), since a shape's time share may end the sweep
    for bk, bn, stages, warps in itertools.product((1024, 2048, 512, 4096), (4, 8, 2, 16), (3, 1, 4), (4, 8)):
        if 1024 <= bn * bk <= 16384:
            out.append(dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-config", required=True)
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--jsonl")
    ap.add_argument("--shapes", help="comma-separated names to time (default all): gate_up,down,qkv,o,lm_head")
    a = ap.parse_args()
    cfg = json.load(open(a.model_config))
    torch.manual_seed(0)
    shapes = [s for s in shapes_of(cfg) if not a.shapes or s[0] in a.shapes.split(",")]
    total_bytes = sum(n * k * 2 * count for _, n, k, count, _ in shapes)
    print(f"{a.model_config}: {total_bytes / 1e9:.2f} GB of GEMV weights per step; "
          f"floor at {COPY_TB_S} TB/s {total_bytes / COPY_TB_S / 1e6:.1f} us", flush=True)
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    started, auto_total, best_total, rows = time.time(), 0.0, 0.0, []
    for index, (name, n, k, count, act) in enumerate(shapes):
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(count)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        kw = dict(silu_mul=act == "silu", gelu_tanh_mul=act == "gelu") if name == "gate_up" else {}
        nbytes = n * k * 2 * count
        cub = graph_time_us(lambda: [torch_F.linear(x, w) for w in ws], iters=20)
        auto = graph_time_us(lambda: [gemv(x, w, **kw) for w in ws], iters=20)
        # this shape's share of what is left, by bytes
        left_bytes = sum(nn * kk * 2 * c for _, nn, kk, c, _ in shapes[index:])
        deadline = time.time() + max(10.0, (a.budget_s - (time.time() - started)) * nbytes / left_bytes)
        results = []
        for conf in sweep_configs():
            if time.time() > deadline:
                break
            try:
                us = graph_time_us(lambda: [gemv(x, w, config=conf, **kw) for w in ws], iters=10, reps=3)
            except Exception as e:  # noqa: BLE001 - a config that does not compile or fit: skip it
                print(f"  {name} {conf} failed: {type(e).__name__}", flush=True)
                continue
            results.append((us, conf))
        results.sort(key=lambda r: r[0])
        # the three fastest again on persistent grids of 1, 2, 4 and 8 programs per SM (gemv's PROGRAMS)
        for us, conf in results[:3]:
            for per_sm in (1, 2, 4, 8):
                persistent = {**conf, "PROGRAMS": per_sm * sm_count}
                try:
                    us = graph_time_us(lambda: [gemv(x, w, config=persistent, **kw) for w in ws], iters=10, reps=3)
                except Exception as e:  # noqa: BLE001
                    print(f"  {name} {persistent} failed: {type(e).__name__}", flush=True)
                    continue
                results.append((us, persistent))
        results.sort(key=lambda r: r[0])
        best_us, best_conf = results[0] if results else (float("inf"), None)
        auto_total += auto
        best_total += min(auto, best_us)
        tested = len(results)
        print(f"{name:8s} [{n}, {k}] x{count}: cuBLAS {nbytes / cub / 1e6:5.2f} TB/s, runtime {nbytes / auto / 1e6:5.2f} "
              f"({auto:8.1f} us), sweep best {nbytes / best_us / 1e6:5.2f} ({best_us:8.1f} us) {best_conf} "
              f"[{tested} configs]", flush=True)
        for us, conf in results[1:4]:
            print(f"           next: {nbytes / us / 1e6:5.2f} TB/s {conf}")
        row = dict(shape=name, n=n, k=k, count=count, cublas_us=cub, auto_us=auto, best_us=best_us, best=best_conf,
                   top=[dict(us=us, **conf) for us, conf in results[:6]], configs_tested=tested)
        rows.append(row)
        if a.jsonl:
            with open(a.jsonl, "a") as f:
                f.write(json.dumps(row) + "\n")
        del ws
        torch.cuda.empty_cache()
    print(f"\nGEMV floor of one step: runtime {auto_total:.1f} us ({total_bytes / auto_total / 1e6:.2f} TB/s), "
          f"best per shape {best_total:.1f} us ({total_bytes / best_total / 1e6:.2f} TB/s): "
          f"{auto_total - best_total:.1f} us to gain ({time.time() - started:.0f} s)")
    print("rows for measured_tiles.GEMV_CONFIGS (bn, bk, warps, stages), where the sweep beats the runtime by > 2%:")
    for row in rows:
        if row["best"] and row["best_us"] < row["auto_us"] * 0.98:
            b = row["best"]
            programs = f", {b['PROGRAMS']}" if "PROGRAMS" in b else ""
            print(f"  ({b['BLOCK_N']}, {b['BLOCK_K']}, {b['num_warps']}, {b['num_stages']}{programs}),  # {row['shape']} "
                  f"[{row['n']}, {row['k']}]: {row['auto_us']:.1f} -> {row['best_us']:.1f} us")


if __name__ == "__main__":
    main()
