"""fp8 weights at small decode batches (1..16 rows of x) per Llama-3-8B shape (H200): the kernels a decode step can
run, each timed with all 32 layers' weights of the shape in one CUDA graph (so L2 holds none of them), in TB/s of
the weight bytes streamed.

  python3 benchmarks/gpu/fp8_small_batch_gemm.py [--rows 1 2 4 8 16] [--budget-s 240] [--out rows.jsonl]
  python3 benchmarks/gpu/fp8_small_batch_gemm.py --table rows.jsonl

Rows: `bf16` cuBLAS on bf16 weights (twice the bytes: the yardstick; at 1 row also braid's bf16 GEMV, `bf16-gemv`),
`fp8` what the fp8 Linear runs (fp8_gemv's default: at 1 row the measured or tuned GEMV, above it the tc tile of
measured_tiles.FP8_SMALL_BATCH_CONFIGS or SMALL_BATCH_TC_CONFIG), `tc` fp8_gemv's tensor-core variant over x's rows (x
rounded to e4m3 per row and chunk in the kernel; every tile below), `tcq` the same tiles on x quantized per row by
quantize_rows first (two launches), `scaled_mm` quantize_rows + torch._scaled_mm (two launches).
Each fp8 result is checked against the dequantized fp32 matmul within its error bound before it is timed. The table
gives per (shape, rows) the best of each, and per row count the step's 128 linear layers: bf16, fp8 as run,
_scaled_mm, the default tc tile and the best tensor-core configs (tc or tcq). (2026-12-05's published run also timed
the bf16-dot kernel the runtime used before; it was removed after losing at every shape but gate_up.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from sweep_rows import append_row, config_keywords, read_rows, time_or_nan  # benchmarks/gpu, this script's folder

CONFIG = "benchmarks/configs/llama3-8b.json"


def tc_configs():
    from braid.runtime.layers.quantization.fp8_gemv import SMALL_BATCH_TC_CONFIG, Fp8GemvConfig as C

    configs = [SMALL_BATCH_TC_CONFIG, C("tc", 64, 512, 4, 3, split_k=0), C("tc", 128, 256, 4, 3, split_k=0),
               C("tc", 64, 128, 4, 6, split_k=0), C("tc", 128, 128, 4, 4, split_k=0), C("tc", 64, 256, 8, 4, split_k=0),
               C("tc", 128, 256, 8, 3, split_k=0), C("tc", 64, 256, 4, 4, split_k=1), C("tc", 64, 256, 4, 4, split_k=2),
               C("tc", 128, 512, 8, 3, split_k=0), C("tc", 256, 128, 8, 4, split_k=0)]
    return list(dict.fromkeys(configs))


def sweep(args) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from braid.runtime.layers.gemv import gemv
    from braid.runtime.layers.quantization.fp8_gemv import Fp8GemvConfig, fp8_gemv, fp8_gemv_error_excess
    from braid.runtime.layers.quantization.fp8_quantize import quantize_rows, quantize_weight_per_channel, scaled_mm
    from decode_b1 import graph_time_us  # benchmarks/gpu, this script's folder

    started = time.time()
    cfg = json.load(open(CONFIG))
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * cfg["head_dim"]
    shapes = {"qkv": (qkv, h), "o": (h, h), "gate_up": (2 * inter, h), "down": (h, inter)}
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows_out = []

    def record(row):
        rows_out.append(row)
        append_row(args.out, row)

    def timed(fn):
        return time_or_nan(graph_time_us, fn) / layers

    cells = len(shapes) * len(args.rows)  # each (shape, rows) its share of the budget for the tc tiles
    for index, (name, (rows, k)) in enumerate(shapes.items()):
        silu = name == "gate_up"
        dense = [torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k ** -0.5
                 for _ in range(layers)]
        fp8 = [quantize_weight_per_channel(w) for w in dense]
        fp8_bytes = rows * k + rows * 4
        for m_index, m in enumerate(args.rows):
            deadline = started + args.budget_s * (index * len(args.rows) + m_index + 1) / cells
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            base = {"shape": name, "rows": rows, "k": k, "m": m, "layers": layers}
            us = timed(lambda: [F.linear(x, w) for w in dense])
            record({**base, "kernel": "bf16", "config": "cuBLAS", "us": us, "tb_s": rows * k * 2 / us / 1e6})
            if m == 1:
                us = timed(lambda: [gemv(x, w, silu_mul=silu) for w in dense])
                record({**base, "kernel": "bf16-gemv", "config": "braid", "us": us, "tb_s": rows * k * 2 / us / 1e6})

            def fp8_row(kernel, config, fn, bound):
                row = {**base, "kernel": kernel, "config": config}
                try:
                    y = fn(*fp8[0])
                    torch.cuda.synchronize()
                    if bound is not None:
                        excess, _ = fp8_gemv_error_excess(y, x, *fp8[0], silu, bound)
                        row["within_bound"] = excess <= 1.0
                        if not row["within_bound"]:
                            record({**row, "error": f"{excess:.3g} x its error bound"})
                            return
                    row["us"] = timed(lambda: [fn(q, s) for q, s in fp8])
                    row["tb_s"] = fp8_bytes / row["us"] / 1e6
                except Exception as e:  # noqa: BLE001 - a tile that does not fit is a row too
                    row["error"] = repr(e)[:200]
                record(row)

            fp8_row("fp8", "runtime", lambda q, s: fp8_gemv(x, q, s, silu_mul=silu), (2 ** -4, 2 ** -10 / 448))
            for config in [c for tile in tc_configs() for c in (tile, dataclasses.replace(tile, variant="tcq"))]:
                if time.time() > deadline:
                    print(f"sweep: time is up before {name} m={m} {config}", flush=True)
                    break
                fp8_row(config.variant, repr(config),
                        lambda q, s, c=config: fp8_gemv(x, q, s, silu_mul=silu, config=c), config.error_bound)

            def quantized_mm(q, s):
                x_q, x_scale = quantize_rows(x)
                y = scaled_mm(x_q, x_scale, q, s, x.dtype)
                return y if not silu else F.silu(y[:, : rows // 2]) * y[:, rows // 2:]

            fp8_row("scaled_mm", "row-wise", quantized_mm, Fp8GemvConfig("tc", 64, 256).error_bound)
        dense.clear()
        fp8.clear()
        torch.cuda.empty_cache()
    return rows_out


def table(rows: list[dict]) -> int:
    from braid.runtime.layers.quantization.fp8_gemv import TENSOR_CORE_VARIANTS

    ok = [r for r in rows if "us" in r and r["us"] == r["us"]]
    if not ok:
        print("FAIL: no timing")
        return 1
    bad = [r for r in rows if r.get("within_bound") is False or "error bound" in r.get("error", "")]
    print(f"{'PASS' if not bad else 'FAIL'} error bounds: {len(bad)} kernel rows outside their bound")
    kernels = ["bf16", "bf16-gemv", "fp8", "tc", "tcq", "scaled_mm"]
    print(f"\n{'shape':>8} {'m':>3} " + " ".join(f"{k:>16}" for k in kernels) + "  best tensor-core config   (TB/s of "
          "weight bytes, us per layer)")
    best_tc = {}
    for shape in dict.fromkeys(r["shape"] for r in ok):
        for m in sorted({r["m"] for r in ok if r["shape"] == shape}):
            cells = []
            for kernel in kernels:
                mine = [r for r in ok if r["shape"] == shape and r["m"] == m and r["kernel"] == kernel]
                best = min(mine, key=lambda r: r["us"], default=None)
                cells.append(f"{best['tb_s']:6.2f} ({best['us']:6.1f})" if best else f"{'-':>16}")
                if kernel in TENSOR_CORE_VARIANTS and best and best["us"] < best_tc.get((shape, m), {}).get("us", 1e30):
                    best_tc[(shape, m)] = best
            tile = best_tc.get((shape, m), {}).get("config", "-")
            print(f"{shape:>8} {m:>3} " + " ".join(f"{c:>16}" for c in cells) + f"  {tile}")
    for m in sorted({r["m"] for r in ok}):
        step = {}
        for kernel in ("bf16", "fp8", "scaled_mm"):
            per = [min((r["us"] for r in ok if r["shape"] == s and r["m"] == m and r["kernel"] == kernel),
                       default=float("nan")) for s in ("qkv", "o", "gate_up", "down")]
            step[kernel] = 32 * sum(per)
        runtime_tc = [next((r["us"] for r in ok if r["shape"] == s and r["m"] == m and r["kernel"] == "tc"
                            and r["config"] == repr(tc_configs()[0])), float("nan"))
                      for s in ("qkv", "o", "gate_up", "down")]
        best = [best_tc.get((s, m), {}).get("us", float("nan")) for s in ("qkv", "o", "gate_up", "down")]
        print(f"m={m:>2}: the step's linear layers (32 x qkv, o, gate_up, down): bf16 cuBLAS {step['bf16']:.0f} us, "
              f"fp8 as run {step['fp8']:.0f} us, scaled_mm "
              f"{step['scaled_mm']:.0f} us, tc default tile "
              f"{32 * sum(runtime_tc):.0f} us, best tensor-core configs {32 * sum(best):.0f} us")
    print("\nrows for runtime/layers/measured_tiles.py's FP8_SMALL_BATCH_CONFIGS (the best tc / tcq config at 8 rows, "
          "where it differs by shape):")
    for (shape, m), r in best_tc.items():
        if m == 8:
            print(f"    ({r['rows']}, {r['k']}, {shape == 'gate_up'}): {config_keywords(r['config'])},  # {shape}: "
                  f"{r['tb_s']:.2f} TB/s")
    return 1 if bad else 0


def main() -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--budget-s", type=float, default=240)
    p.add_argument("--out", default=None)
    p.add_argument("--table", default=None)
    args = p.parse_args()
    if args.table:
        return table(read_rows(args.table))
    return table(sweep(args))


if __name__ == "__main__":
    sys.exit(main())
