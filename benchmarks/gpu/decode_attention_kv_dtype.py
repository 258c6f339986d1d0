"""Llama-3-8B decode attention alone on the GPU by KV-cache dtype (bf16, fp8_e4m3, fp8_e5m2): 32 query / 8 KV heads,
head_dim 128, 8,160 keys per request, batch 8 and 64 (issue 19's FP8-KV figure), the Triton split-KV kernel (both
stages, PDL as in the runtime) over split counts x stage-1 launch configs. Each figure is one layer's time inside a
CUDA graph cycling over `--layers` distinct KV buffers (L2 holds none), and the KV bytes it must read in TB/s.

  python3 benchmarks/gpu/decode_attention_kv_dtype.py [--batch-sizes 8 64] [--budget-s 200] [--out rows.jsonl]
  python3 benchmarks/gpu/decode_attention_kv_dtype.py --table rows.jsonl

Last: per (batch, dtype) the runtime's choice and the sweep's best, the fp8 / bf16 speed-up of each (ideal 2.0x:
half the bytes), and what to change in decode_attention._decode_launch_configs when the best differs by >= 3%.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from gemma2_decode_attention import config_label, decode_options, time_graph  # benchmarks/gpu, this folder
from sweep_rows import append_row, read_rows

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# stage-1 (BLOCK_N, num_warps, num_stages[, ROWS_AHEAD]); None: the runtime's own choice; UNSTAGED: the runtime's
# launch with fp8 V tiles upcast after their shared-memory staging (the kernel before _upcast_before_staging; fp8
# caches only)
UNSTAGED = "runtime, fp8 V upcast after staging"
CONFIGS = [None, UNSTAGED, (64, 2, 2), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 4, 2), (128, 8, 2), (32, 4, 4),
           (128, 4, 3), (64, 2, 4, True), (32, 2, 3, True)]


def runtime_splits(bs: int) -> int:
    from types import SimpleNamespace

    from braid.runtime.layers.attention.triton_backend import TritonAttnBackend

    config = SimpleNamespace(num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM)
    return TritonAttnBackend(SimpleNamespace(device=torch.device("cuda"), model_config=config)).decode_kv_splits(bs)


def calls(ks, vs, req_to_token, bs, context, splits, config):
    from braid.runtime.layers.attention.triton_ops import decode_attention_fwd

    q = torch.randn(bs, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    o = torch.empty_like(q)
    scratch = torch.empty(bs, HEADS, splits, HEAD_DIM + 1, device="cuda", dtype=torch.float32)
    rows = torch.arange(bs, device="cuda")
    seq_lens = torch.full((bs,), context, device="cuda", dtype=torch.int32)
    options = {"launch_config": {"STAGE_V": False}} if config == UNSTAGED else decode_options(config)
    scale = 1.0 if ks[0].dtype == torch.bfloat16 else 0.5  # fp8 caches: stored x / scale, as the pool writes them
    return [lambda k=k, v=v: decode_attention_fwd(q, k, v, o, req_to_token, rows, seq_lens, scratch, splits,
                                                  HEAD_DIM ** -0.5, k_scale=scale, v_scale=scale, **options)
            for k, v in zip(ks, vs)]


def sweep(args) -> list[dict]:
    started = time.time()
    out = []

    def record(row):
        out.append(row)
        append_row(args.out, row)

    cells = len(args.batch_sizes) * len(DTYPES)  # each (batch, dtype) its share of the budget
    for bs_index, bs in enumerate(args.batch_sizes):
        req_to_token = (torch.arange(bs * args.context, device="cuda", dtype=torch.int32) + 1).view(bs, args.context)
        mine = runtime_splits(bs)
        split_counts = [mine] + sorted({mine // 2, mine * 2} - {0, mine})  # the runtime's first
        for dtype_index, (name, dtype) in enumerate(DTYPES.items()):
            deadline = started + args.budget_s * (bs_index * len(DTYPES) + dtype_index + 1) / cells
            ks = [torch.randn(bs * args.context + 1, KV_HEADS, HEAD_DIM, device="cuda").to(dtype)
                  for _ in range(args.layers)]
            vs = [torch.randn(bs * args.context + 1, KV_HEADS, HEAD_DIM, device="cuda").to(dtype)
                  for _ in range(args.layers)]
            kv_bytes = 2 * bs * args.context * KV_HEADS * HEAD_DIM * ks[0].element_size()
            base = {"batch_size": bs, "kv_dtype": name, "context": args.context, "kv_bytes": kv_bytes,
                    "runtime_splits": mine}
            for splits in split_counts:
                for config in CONFIGS:
                    if time.time() > deadline:
                        break
                    if config == UNSTAGED and name == "bf16":
                        continue
                    row = {**base, "splits": splits, "config": UNSTAGED if config == UNSTAGED else config_label(config)}
                    try:
                        sec = time_graph(calls(ks, vs, req_to_token, bs, args.context, splits, config), args.reps)
                    except Exception as e:  # noqa: BLE001 - a config that does not fit is a row too
                        record({**row, "error": f"{type(e).__name__}: {e}"[:160]})
                        continue
                    record({**row, "us": sec * 1e6, "tb_s": kv_bytes / sec / 1e12})
            del ks, vs
            torch.cuda.empty_cache()
    return out


def table(rows: list[dict]) -> int:
    ok = [r for r in rows if "us" in r]
    if not ok:
        print("FAIL: no decode attention timing")
        return 1
    print(f"\n{'bs':>3} {'kv':>9}  {'runtime':>30}  {'best':>58}")
    now, best = {}, {}
    for bs in sorted({r["batch_size"] for r in ok}):
        for name in DTYPES:
            mine = [r for r in ok if r["batch_size"] == bs and r["kv_dtype"] == name]
            if not mine:
                continue
            cur = next((r for r in mine if r["splits"] == r["runtime_splits"] and r["config"] == "runtime"), None)
            top = min(mine, key=lambda r: r["us"])
            now[bs, name], best[bs, name] = cur, top
            print(f"{bs:>3} {name:>9}  " + (f"{cur['us']:7.1f} us {cur['tb_s']:4.2f} TB/s splits {cur['splits']:>2}"
                                           if cur else f"{'-':>30}")
                  + f"  {top['us']:7.1f} us {top['tb_s']:4.2f} TB/s splits {top['splits']:>2} {top['config']:>24}")
    for bs in sorted({b for b, _ in best}):
        for name in ("fp8_e4m3", "fp8_e5m2"):
            if (bs, name) in best and (bs, "bf16") in best:
                a, b = now.get((bs, "bf16")), now.get((bs, name))
                ratio_now = f"{a['us'] / b['us']:.2f}x" if a and b else "-"
                print(f"bs={bs} {name} vs bf16 KV, attention alone: runtime {ratio_now}, each at its best "
                      f"{best[bs, 'bf16']['us'] / best[bs, name]['us']:.2f}x (ideal 2.0x)")
            cur = now.get((bs, name))
            old = next((r for r in ok if r["batch_size"] == bs and r["kv_dtype"] == name and r["config"] == UNSTAGED
                        and r["splits"] == r["runtime_splits"]), None)
            if cur and old:
                print(f"bs={bs} {name}: V upcast before staging {cur['us']:.1f} us vs after {old['us']:.1f} us: "
                      f"{old['us'] / cur['us']:.2f}x")
            top = best.get((bs, name))
            if cur and top and top["us"] < 0.97 * cur["us"]:
                print(f"RECOMMEND bs={bs} {name}: splits {top['splits']} {top['config']} ({top['us']:.1f} us vs "
                      f"{cur['us']:.1f} us now)")
    return 0


def main() -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 64])
    p.add_argument("--context", type=int, default=8160)
    p.add_argument("--layers", type=int, default=4, help="distinct KV buffers per graph (L2 misses like a real step)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--budget-s", type=float, default=200)
    p.add_argument("--out", default=None)
    p.add_argument("--table", default=None)
    args = p.parse_args()
    if args.table:
        return table(read_rows(args.table))
    return table(sweep(args))


if __name__ == "__main__":
    sys.exit(main())
