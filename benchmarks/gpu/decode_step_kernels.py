"""Where one decode step's GPU time goes: per-kernel time and launch count of a decode step, beside the step's
wall time in a CUDA graph.

Builds the model as bench_one_batch does (takes its flags: --model-path, --load-format dummy --model-config,
--dtype, --batch-size B, --input-len, ...), measures the graph step (median of --output-len - 1 steps), then runs
the same batch with CUDA graphs off under torch.profiler and divides each kernel's device time by the decode steps
profiled. "kernel sum" below the graph step time means gaps between kernels (launch latency inside the graph);
above it, the profiler's eager kernels ran slower than the graph's.
  python3 benchmarks/gpu/decode_step_kernels.py --load-format dummy --model-config benchmarks/configs/deepseek-v2-lite.json \
      --model-path dsv2-lite-dummy --dtype bfloat16 --batch-size 1 --input-len 128 --output-len 64 [--top 30]
"""
import collections
import sys

import torch

from braid.runtime.bench.bench_one_batch import (StaticBatchRunner, build_parser, latency_test, random_prompts,
                                                 server_args_for)
from braid.runtime.model_executor.model_runner import ModelRunner


def main() -> int:
    parser = build_parser()
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--profile-steps", type=int, default=16)
    args = parser.parse_args()
    server_args = server_args_for(args)
    bs, in_len, out_len = args.batch_size[0], args.input_len[0], args.output_len[0]
    runner = ModelRunner(server_args)
    sb = StaticBatchRunner(runner)
    sb.run(random_prompts(runner.vocab_size, bs, in_len, 1), 4)
    result, _ = latency_test(sb, bs, in_len, out_len)
    step_ms = result["median_decode_latency_s"] * 1e3
    print(f"graph={runner.cuda_graph_runner is not None} bs={bs} in={in_len}: decode step {step_ms:.3f} ms "
          f"({result['decode_throughput']:.1f} tok/s)")

    del sb
    runner.cuda_graph_runner = None  # same weights and pools, launched eagerly
    sb = StaticBatchRunner(runner)
    prompts = random_prompts(runner.vocab_size, bs, in_len, 2)
    sb.run(prompts, 3)
    steps = args.profile_steps
    on_cuda = runner.device.type == "cuda"
    activity = torch.profiler.ProfilerActivity.CUDA if on_cuda else torch.profiler.ProfilerActivity.CPU
    kind = torch.autograd.DeviceType.CUDA if on_cuda else torch.autograd.DeviceType.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        sb.run(prompts, 1)  # the prefill alone, subtracted below
    prefill = collections.Counter()
    prefill_n = collections.Counter()
    for e in prof.events():
        if e.device_type == kind:
            prefill[e.name] += (e.device_time_total if on_cuda else e.self_cpu_time_total)
            prefill_n[e.name] += 1
    with torch.profiler.profile(activities=[activity]) as prof:
        sb.run(prompts, steps + 1)
    total = collections.Counter()
    count = collections.Counter()
    for e in prof.events():
        if e.device_type == kind:
            total[e.name] += (e.device_time_total if on_cuda else e.self_cpu_time_total)
            count[e.name] += 1
    per_step = {k: (total[k] - prefill[k]) / steps for k in total}
    n_step = {k: (count[k] - prefill_n[k]) / steps for k in count}
    rows = sorted(per_step.items(), key=lambda kv: -kv[1])
    kernel_sum = sum(v for v in per_step.values() if v > 0)
    launches = sum(v for v in n_step.values() if v > 0)
    print(f"eager profile, {steps} decode steps: kernel sum {kernel_sum / 1e3:.3f} ms/step, {launches:.0f} "
          f"kernels/step; graph step {step_ms:.3f} ms -> gaps {step_ms - kernel_sum / 1e3:+.3f} ms "
          f"({(step_ms * 1e3 - kernel_sum) / max(launches, 1):.2f} us per kernel)")
    print(f"{'us/step':>9} {'n/step':>7} {'us each':>8}  kernel")
    for name, us in rows[:args.top]:
        n = max(n_step[name], 1e-9)
        print(f"{us:9.1f} {n_step[name]:7.1f} {us / n:8.2f}  {name[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
