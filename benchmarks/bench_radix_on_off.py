"""Shared-prefix serving workload against two braid servers, radix cache on vs off, in one run.

    python benchmarks/bench_radix_on_off.py --gsp-num-groups 4 --gsp-prompts-per-group 16

Starts `python -m braid.launch_server` twice (the second with --disable-radix-cache), runs
`braid.bench_serving --dataset-name generated-shared-prefix` against each, prints both and the ratio.
"""

from __future__ import annotations

import argparse

import braid
from braid.runtime.bench import bench_serving
from braid.runtime.bench.results import append_jsonl


def run(disable_radix: bool, args) -> dict:
    server_args = dict(max_total_tokens=args.max_total_tokens, log_level="warning")
    if disable_radix:
        server_args["disable_radix_cache"] = True
    rt = braid.Runtime(model_path=args.model_path, **server_args)
    try:
        argv = ["--backend", "braid", "--base-url", rt.url, "--tokenizer", args.model_path,
                "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(args.gsp_num_groups),
                "--gsp-prompts-per-group", str(args.gsp_prompts_per_group),
                "--gsp-system-prompt-len", str(args.gsp_system_prompt_len),
                "--gsp-question-len", str(args.gsp_question_len), "--gsp-output-len", str(args.gsp_output_len),
                "--seed", "0", "--disable-tqdm"]
        result = bench_serving.run_benchmark(bench_serving.parse_args(argv))
        info = rt.endpoint.get_server_info()
        result["server_computed_prompt_tokens"] = info.get("num_computed_prompt_tokens_total")
        result["server_kv_used_after"] = info.get("kv_used_tokens")
        return result
    finally:
        rt.shutdown()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="smollm2")
    p.add_argument("--max-total-tokens", type=int, default=32768)
    p.add_argument("--gsp-num-groups", type=int, default=4)
    p.add_argument("--gsp-prompts-per-group", type=int, default=16)
    p.add_argument("--gsp-system-prompt-len", type=int, default=1024)
    p.add_argument("--gsp-question-len", type=int, default=32)
    p.add_argument("--gsp-output-len", type=int, default=16)
    p.add_argument("--output-file", default=None)
    args = p.parse_args(argv)
    on = run(False, args)
    off = run(True, args)
    keys = ("completed", "duration", "output_throughput", "input_throughput", "mean_ttft_ms", "server_computed_prompt_tokens")
    print(f"\n{'metric':<32}{'radix on':>14}{'radix off':>14}")
    for k in keys:
        a, b = on.get(k), off.get(k)
        fmt = (lambda v: f"{v:>14.2f}") if isinstance(a, float) else (lambda v: f"{v!s:>14}")
        print(f"{k:<32}{fmt(a)}{fmt(b)}")
    ratio = on["output_throughput"] / off["output_throughput"]
    print(f"radix on / off output throughput: {ratio:.2f}x")
    summary = {"radix_on": {k: on.get(k) for k in keys}, "radix_off": {k: off.get(k) for k in keys}, "ratio": ratio}
    if args.output_file:
        append_jsonl(args.output_file, summary)
    return summary


if __name__ == "__main__":
    main()
