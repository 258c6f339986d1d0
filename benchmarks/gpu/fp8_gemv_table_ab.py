"""Batch-1 fp8 decode of the Llama-3-8B-shaped dummy (bench_one_batch, 128 in / 512 out) with this card's own fp8
GEMV choice (its entry of runtime/layers/measured_tiles.py's FP8_GEMV_CONFIGS, else the first-call tuning) against the configs measured on another
card (default the H200's), each in its own process: whether a measured table carries over between Hopper cards.

  python3 benchmarks/gpu/fp8_gemv_table_ab.py [--from-card "NVIDIA H200"] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

BENCH = ["--load-format", "dummy", "--model-config", "benchmarks/configs/llama3-8b.json", "--model-path",
         "llama3-8b-dummy", "--dtype", "bfloat16", "--quantization", "fp8", "--batch-size", "1", "--input-len", "128",
         "--output-len", "512", "--cuda-graph-max-bs", "1", "--log-level", "warning"]


def run_one(from_card: str, result: str) -> int:
    import torch

    from braid.runtime.bench.bench_one_batch import main
    from braid.runtime.layers.quantization import fp8_gemv

    if from_card:
        own = torch.cuda.get_device_name()
        fp8_gemv.MEASURED_FP8_GEMV_CONFIGS[own] = fp8_gemv.MEASURED_FP8_GEMV_CONFIGS[from_card]
    return main(BENCH + ["--result-filename", result])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--from-card", default="NVIDIA H200")
    p.add_argument("--out", default=".")
    p.add_argument("--run", nargs=2, metavar=("FROM_CARD", "RESULT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.run:
        return run_one(*args.run)
    tok_s = {}
    for label, card in (("own", ""), ("from", args.from_card)):
        result = os.path.join(args.out, f"fp8_b1_{label}.jsonl")
        if os.path.exists(result):
            os.remove(result)
        subprocess.run([sys.executable, __file__, "--run", card, result], check=False)
        with open(result) as f:
            tok_s[label] = json.loads(f.readline())["decode_throughput"]
    print(f"batch-1 fp8 decode: own choice {tok_s['own']:.1f} tok/s, {args.from_card}'s table "
          f"{tok_s['from']:.1f} tok/s: {tok_s['from'] / tok_s['own']:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
