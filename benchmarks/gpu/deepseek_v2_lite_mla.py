"""One attention form of DeepSeek-V2-Lite-shaped dummy bf16 weights: the KV pool the default memory budget buys, then
bench_one_batch's runs (one prefill + output_len - 1 decode steps, greedy) per batch size.

Takes every bench_one_batch / ServerArgs flag (pass --disable-mla for the expanded MHA baseline). Unlike
bench_one_batch, --max-total-tokens is left to the default sizing (--mem-fraction-static), so the pool capacity
printed is what a server would get. Appends JSON lines to --result-filename as it goes (a run cut short by a
timeout keeps what it finished): one {"kind": "setup", "attention_arch", "kv_pool_tokens", "kv_bytes_per_token",
"startup_s", ...}, then per run {"kind": "run", "attention_arch", bench_one_batch's fields, "graph_replays",
"output_ids" (batch 1 only)}.
  python3 benchmarks/gpu/deepseek_v2_lite_mla.py --load-format dummy --model-config benchmarks/configs/deepseek-v2-lite.json \
      --model-path dsv2-lite-dummy --dtype bfloat16 --batch-size 1 8 --input-len 128 --output-len 512 [--disable-mla]
"""
import dataclasses
import json
import sys
import time

import torch

from braid.runtime.bench.bench_one_batch import StaticBatchRunner, latency_test, parse_args, print_table, random_prompts
from braid.runtime.config import ServerArgs
from braid.runtime.model_executor.model_runner import ModelRunner


def main() -> int:
    args = parse_args()
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerArgs)}
    kw["max_running_requests"] = max(kw["max_running_requests"] or 0, max(args.batch_size))
    server_args = ServerArgs(**kw)
    started = time.perf_counter()
    runner = ModelRunner(server_args)
    startup = time.perf_counter() - started
    pool = runner.kv_pool
    form = "expanded (--disable-mla)" if server_args.disable_mla else "mla (absorbed, latent cache)"
    out = {"kind": "setup", "form": form, "attention_arch": runner.model_config.attention_arch,
           "kv_cache_dtype": str(pool.cache_dtype).removeprefix("torch."), "kv_pool_tokens": runner.max_total_tokens,
           "kv_bytes_per_token": pool.mem_usage_bytes() // (pool.size + 1), "kv_pool_gib": pool.mem_usage_bytes() / 2**30,
           "startup_s": startup, "device": str(runner.device), "backend": runner.attn_backend_name,
           "cuda_graph": runner.cuda_graph_runner is not None}
    if runner.device.type == "cuda":
        out["card"] = torch.cuda.get_device_name(runner.device)
    record(args.result_filename, out)
    print(f"{form}: KV pool {out['kv_pool_tokens']} tokens x {out['kv_bytes_per_token']} B "
          f"({out['kv_pool_gib']:.1f} GiB), start-up {startup:.1f} s", flush=True)
    sb = StaticBatchRunner(runner)
    graphs = runner.cuda_graph_runner
    runs = []
    for bs in args.batch_size:
        for in_len in args.input_len:
            sb.run(random_prompts(runner.vocab_size, bs, in_len, args.seed + 1), 4)  # warm-up (kernel compiles)
            for out_len in args.output_len:
                result, run = latency_test(sb, bs, in_len, out_len, args.seed)
                runs.append(result)
                record(args.result_filename, {
                    "kind": "run", "attention_arch": out["attention_arch"], "kv_cache_dtype": out["kv_cache_dtype"],
                    **result,
                    "graph_replays": graphs.num_replays if graphs is not None else 0,
                    **({"output_ids": run.output_ids[0]} if bs == 1 else {})})
                print(f"  bs {bs}: decode {result['median_decode_latency_s'] * 1e3:.2f} ms/step, "
                      f"{result['decode_throughput']:.1f} tok/s", flush=True)
            if pool.available_size() != pool.size:
                raise RuntimeError("KV slots leaked by a benchmark run")
    print_table(runs)
    return 0


def record(filename, obj: dict) -> None:
    if filename:
        with open(filename, "a") as f:
            f.write(json.dumps(obj) + "\n")


if __name__ == "__main__":
    sys.exit(main())
