"""The batch-1 fp8 GEMV variants (fp8_gemv.fp8_gemv: "f16", "tc", "tcq") per Llama-3-8B decode shape (H200).

  python3 benchmarks/gpu/fp8_gemv_variants.py sweep OUT.jsonl [SECONDS]   every variant x config per shape:
        max error against the dequantized fp32 matmul (and its ratio to the variant's bound; PASS/FAIL), the time of
        all 32 layers' weights of the shape in one CUDA graph (50 replays x 5, median), TB/s of weight bytes; beside
        them the old fp32-upcast GEMV and the bf16 GEMV; then what fp8_gemv picks by itself (its
        MEASURED_FP8_GEMV_CONFIGS entry, from runtime/layers/measured_tiles.py, else its tuning). Each shape gets a
        quarter of SECONDS (default 200) to start configs in.
  python3 benchmarks/gpu/fp8_gemv_variants.py summary DIR                 the table: per shape the best config of
        each variant, the winner, the projected batch-1 step and tok/s, bench_one_batch's figure (DIR/one_batch.jsonl)
        with PASS/FAIL against 450 tok/s, and the winners as rows to paste into fp8_gemv_candidates and into
        measured_tiles.FP8_GEMV_CONFIGS.

Error bounds (per output row, Fp8GemvConfig.error_bound): C * sum|w x| + F * max|x| * sum|w| + 2**-8 |y| (the bf16
output), f16 C = (GROUP + 2) * 2**-11, F = GROUP * 2**-23; tc / tcq (x rounded to e4m3 per chunk / row)
C = 2**-4, F = 2**-10 / 448.

Earlier runs (docs/benchmark_history.md) also swept an "f16bit" variant (e4m3 -> fp16 by bit moves) and f16 on
persistent grids; no measured table chose either, and both were removed from the runtime.
"""

from __future__ import annotations

import json
import os
import sys
import time

from sweep_rows import (H200_COPY_BYTES_PER_S, append_row, config_keywords, read_rows,  # benchmarks/gpu, this folder
                        time_or_nan)

CONFIG = "benchmarks/configs/llama3-8b.json"
TARGET_B1_FP8_TOK_S = 450.0
LM_HEAD_BYTES = 128256 * 4096 * 2


def sweep_configs():
    from braid.runtime.layers.quantization.fp8_gemv import Fp8GemvConfig as C

    # the runtime candidates first (fp8_gemv_candidates), then their neighbours
    configs = [C("f16", 4, 2048, 4, 3, group=16), C("f16", 8, 1024, 4, 3, group=16), C("f16", 4, 1024, 4, 4, group=8),
               C("f16", 8, 2048, 8, 3, group=16), C("tc", 64, 256, 4, 4, split_k=0),
               C("tc", 64, 512, 4, 3, split_k=0), C("tc", 128, 256, 4, 3, split_k=0),
               C("tcq", 64, 256, 4, 4, split_k=0), C("tcq", 64, 512, 4, 3, split_k=0),
               C("tcq", 128, 256, 4, 3, split_k=0), C("tcq", 64, 128, 4, 6, split_k=0),
               C("f16", 2, 4096, 4, 2, group=16), C("f16", 16, 512, 4, 4, group=16),
               C("f16", 8, 1024, 4, 4, group=8), C("f16", 4, 4096, 8, 2, group=16), C("f16", 4, 2048, 4, 3, group=32),
               C("tc", 64, 256, 4, 4, split_k=2), C("tc", 64, 256, 4, 4, split_k=8), C("tc", 64, 128, 4, 6, split_k=0),
               C("tc", 128, 128, 4, 4, split_k=0), C("tc", 64, 256, 8, 4, split_k=0),
               C("tc", 128, 256, 8, 3, split_k=0)]
    return configs


def sweep(out_path: str, seconds: float) -> None:
    import torch

    from braid.runtime.layers import gemv as gemv_module
    from braid.runtime.layers.quantization import fp8_gemv as fp8_gemv_module
    from braid.runtime.layers.quantization.fp8_gemv import fp8_gemv, fp8_gemv_error_excess
    from braid.runtime.layers.quantization.fp8_quantize import quantize_weight_per_channel
    from braid.runtime.layers.small_batch_gemm import split_k
    from decode_b1 import graph_time_us  # benchmarks/gpu, this script's folder

    started = time.time()
    cfg = json.load(open(CONFIG))
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * cfg["head_dim"]
    shapes = {"qkv": (qkv, h), "o": (h, h), "gate_up": (2 * inter, h), "down": (h, inter)}
    configs = sweep_configs()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for index, (name, (rows, k)) in enumerate(shapes.items()):
        deadline = started + seconds * (index + 1) / len(shapes)  # each shape its share (the first configs first)
        silu = name == "gate_up"
        n = rows // 2 if silu else rows
        fp8 = []
        for _ in range(layers):  # all layers' weights of the shape, so that L2 does not hold them between calls
            dense = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k ** -0.5
            fp8.append(quantize_weight_per_channel(dense))
        dense = None
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        nbytes = layers * (rows * k + rows * 4)
        base = {"shape": name, "n": n, "k": k, "rows": rows, "layers": layers}

        def timed(fn):
            return time_or_nan(graph_time_us, fn) / layers

        old = dict(BLOCK_N=4, BLOCK_K=4096, num_warps=4, num_stages=1)
        us = timed(lambda: [gemv_module.gemv(x, q, silu_mul=silu, weight_scale=s, config=old) for q, s in fp8])
        append_row(out_path, {**base, "variant": "old-fp32", "config": str(old), "us": us,
                           "tb_s": nbytes / layers / us / 1e6})
        def run_config(config) -> dict:
            row = {**base, "variant": config.variant, "config": repr(config)}
            try:
                y = fp8_gemv(x, *fp8[0], silu_mul=silu, config=config)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - a config the device cannot run (shared memory) is skipped
                append_row(out_path, {**row, "error": repr(e)[:200]})
                return row
            row["err_over_bound"], row["max_abs_err"] = fp8_gemv_error_excess(y, x, *fp8[0], silu,
                                                                              config.error_bound)
            row["within_bound"] = row["err_over_bound"] <= 1.0
            if config.variant in fp8_gemv_module.TENSOR_CORE_VARIANTS:
                row["split_k"] = split_k(config.tile, n, k, x.device)
            row["us"] = timed(lambda: [fp8_gemv(x, q, s, silu_mul=silu, config=config) for q, s in fp8])
            row["tb_s"] = nbytes / layers / row["us"] / 1e6
            append_row(out_path, row)
            return row

        for config in configs:
            if time.time() > deadline:
                print(f"sweep: time is up before {name} {config}", flush=True)
                break
            run_config(config)
        # what fp8_gemv picks by itself (MEASURED_FP8_GEMV_CONFIGS, else its tuning), timed the same way
        fp8_gemv(x, *fp8[0], silu_mul=silu)
        picked = (fp8_gemv_module.measured_fp8_gemv_config(x.device, rows, k, silu)
                  or next((c for key, c in fp8_gemv_module._tuned.items() if key[1:4] == (n, k, silu)), "not tuned"))
        us = timed(lambda: [fp8_gemv(x, q, s, silu_mul=silu) for q, s in fp8])
        append_row(out_path, {**base, "variant": "autotuned", "config": repr(picked), "us": us,
                           "tb_s": nbytes / layers / us / 1e6})
        fp8.clear()
        if time.time() < deadline:  # the bf16 GEMV on the same shape: the copy-rate yardstick
            dense = [torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(layers)]
            us = timed(lambda: [gemv_module.gemv(x, w, silu_mul=silu) for w in dense])
            append_row(out_path, {**base, "variant": "bf16-gemv", "config": "autotuned", "us": us,
                               "tb_s": layers * rows * k * 2 / layers / us / 1e6})
            dense.clear()
        torch.cuda.empty_cache()


def summary(folder: str) -> int:
    rows = read_rows(os.path.join(folder, "sweep.jsonl"))
    failures = 0
    bad = [r for r in rows if r.get("within_bound") is False]
    for r in bad:
        print(f"FAIL error bound: {r['shape']} {r['config']}: max |err| {r['max_abs_err']:.3g}, "
              f"{r['err_over_bound']:.2f}x the bound")
    failures += len(bad)
    checked = [r for r in rows if "within_bound" in r]
    if checked:
        print(f"PASS error bound: {len(checked) - len(bad)} of {len(checked)} variant configs within their bound")
    shapes = []
    for r in rows:
        if r["shape"] not in shapes:
            shapes.append(r["shape"])
    winners = {}
    print("\nbatch-1 fp8 GEMV per Llama-3-8B shape, all 32 layers in one CUDA graph: TB/s of weight bytes (us/layer)")
    variants = ["old-fp32", "f16", "tc", "tcq", "autotuned", "bf16-gemv"]
    print(f"{'shape':>8} " + " ".join(f"{v:>16}" for v in variants) + "  best config")
    step_us = 0.0
    for shape in shapes:
        cells = []
        for v in variants:
            timed = [r for r in rows if r["shape"] == shape and r["variant"] == v and r.get("tb_s") == r.get("tb_s")
                     and "tb_s" in r and r.get("within_bound", True)]
            best = max(timed, key=lambda r: r["tb_s"], default=None)
            cells.append(f"{best['tb_s']:7.2f} ({best['us']:6.1f})" if best else f"{'-':>16}")
            if best and v in ("f16", "tc", "tcq"):
                if shape not in winners or best["tb_s"] > winners[shape]["tb_s"]:
                    winners[shape] = best
        win = winners.get(shape)
        if win:
            step_us += 32 * win["us"]
        print(f"{shape:>8} " + " ".join(f"{c:>16}" for c in cells) + f"  {win['config'] if win else '-'}")
    if len(winners) == 4:
        step_us += LM_HEAD_BYTES / 4.2e12 * 1e6 + 32 * 11.0  # the LM head at the bf16 GEMV's rate; ~11 us/layer else
        print(f"projected batch-1 step from the winners: {step_us / 1e3:.2f} ms -> {1e6 / step_us:.0f} tok/s "
              f"(linear layers at the winners' rate, LM head at 4.2 TB/s, ~11 us per layer for attention and norms: "
              f"the bf16 step's 3.92 ms less its 3.57 ms of weights)")
    print("\nrows to paste into fp8_gemv.fp8_gemv_candidates (the measured winner per shape first):")
    for shape, r in winners.items():
        extra = f"  # split_k {r['split_k']} here" if "split_k" in r else ""
        print(f"    {r['config']},  # {shape}: {r['tb_s']:.2f} TB/s{extra}")
    print("\nrows for runtime/layers/measured_tiles.py's FP8_GEMV_CONFIGS (this card's entry):")
    for shape, r in winners.items():
        print(f"        ({r['rows']}, {r['k']}, {shape == 'gate_up'}): {config_keywords(r['config'])},  # {shape}")
    one_batch = read_rows(os.path.join(folder, "one_batch.jsonl"))
    b1 = [r for r in one_batch if r.get("batch_size") == 1]
    if not b1:
        print("FAIL bench_one_batch fp8 batch 1: no result")
        return failures + 1
    tok_s = b1[-1]["decode_throughput"]
    step_gb = (7.0e9 + LM_HEAD_BYTES) / 1e9
    verdict = "PASS" if tok_s >= TARGET_B1_FP8_TOK_S else "FAIL"
    print(f"{verdict} bench_one_batch --quantization fp8, batch 1, 128 in / 512 out: {tok_s:.1f} tok/s (target "
          f">= {TARGET_B1_FP8_TOK_S:.0f}; ceiling ~{H200_COPY_BYTES_PER_S / (step_gb * 1e9):.0f} at 4.28 TB/s for "
          f"{step_gb:.2f} GB of weights per step; median step {b1[-1].get('median_decode_latency_s', 0) * 1e3:.2f} ms)")
    return failures + (verdict == "FAIL")


def main() -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    mode = sys.argv[1]
    if mode == "sweep":
        sweep(sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else 200.0)
        return 0
    if mode == "summary":
        return 1 if summary(sys.argv[2]) else 0
    raise SystemExit(__doc__)


if __name__ == "__main__":
    sys.exit(main())
