"""Many LoRA adapters on one Llama-3-8B-shaped dummy bf16 model, in braid's Engine at its defaults (CUDA graphs, the
batch-1 GEMV, the SGMV kernels), against the same engine serving the base model alone, in one process:

- batch-1 decode, ms per output token: the base engine; the LoRA engine on a base-model request; the LoRA engine
  on an adapter request;
- throughput of a batch of --num-requests requests at once (--input-len in, --output-len out, ignore_eos), each on
  one of --num-adapters adapters (round robin) in the LoRA engine, the same prompts on the base model in the base
  engine; every adapter gets a device slot (--max-loaded-loras = --max-loras-per-batch = --num-adapters), so no
  request waits on admission;
- with --serving-adapters A1 A2 ...: --serving-requests ShareGPT-shaped requests at once (synthetic, the lengths of
  bench_serving's ShareGPT set, seed 7; output lengths kept, ignore_eos), spread round robin over A adapters, in a
  LoRA engine at the default --max-loras-per-batch and --max-loaded-loras (adapters paged into the slots on demand),
  against the same requests on the base engine; the prefix cache is flushed before each run.

Adapters are PEFT folders of rank --rank on all seven projections (q/k/v/o, gate/up/down), written with random
weights (one weights file, hard-linked into every folder: the kernels read each slot separately whatever the values);
each registered adapter is read into host memory (about 84 MB at rank 16 on the Llama-3-8B shapes). The card's copy
rate is printed first.

  python3 benchmarks/gpu/lora_serving.py --tokenizer-path .gpu/tok [--num-adapters 64] [--rank 16]
      [--serving-adapters 8 64 512 --serving-requests 1000 [--serving-only]]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from sweep_rows import copy_bandwidth  # benchmarks/gpu, this script's folder

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "llama3-8b.json")
PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapters(folder: str, count: int, rank: int, config: dict) -> list[str]:
    """count PEFT adapter folders under folder, sharing one random weights file -> their paths."""
    import torch
    from safetensors.torch import save_file

    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}  # (in, out)
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for block, names in PROJECTIONS.items():
            for name in names:
                d_in, d_out = shapes[name]
                prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, d_in, generator=gen) / d_in ** 0.5).bfloat16()
                tensors[f"{prefix}.lora_B.weight"] = (torch.randn(d_out, rank, generator=gen) * 0.01).bfloat16()
    weights = os.path.join(folder, "adapter_model.safetensors")
    save_file(tensors, weights)
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
                      "target_modules": [n for names in PROJECTIONS.values() for n in names],
                      "task_type": "CAUSAL_LM"}
    paths = []
    for i in range(count):
        path = os.path.join(folder, f"adapter{i}")
        os.makedirs(path)
        os.link(weights, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(adapter_config, f)
        paths.append(path)
    return paths


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, 30000, (count, length), generator=gen).tolist()


def decode_ms(engine, lora_path, input_len: int, output_len: int, seed: int) -> float:
    """ms per output token at batch 1: a generate of output_len tokens less one of 1 token (the prefill), over
    output_len - 1 (each on a prompt of its own, so the radix cache serves neither)."""
    def timed(new_tokens: int, prompt_seed: int) -> float:
        ids = prompts(1, input_len, prompt_seed)[0]
        start = time.perf_counter()
        engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": new_tokens,
                                                        "ignore_eos": True}, lora_path=lora_path)
        return time.perf_counter() - start

    timed(8, seed + 100)  # warm-up on this adapter
    whole = min(timed(output_len, seed + i) for i in range(2))
    first = min(timed(1, seed + 10 + i) for i in range(2))
    return (whole - first) / (output_len - 1) * 1e3


def throughput(engine, names, input_len: int, output_len: int, seed: int) -> float:
    """Output tokens per second of len(names) requests at once, request i on names[i]."""
    batch = prompts(len(names), input_len, seed)
    params = {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}
    start = time.perf_counter()
    out = engine.generate(input_ids=batch, sampling_params=params, lora_path=list(names))
    elapsed = time.perf_counter() - start
    tokens = sum(len(r["output_ids"]) for r in out)
    assert tokens == len(names) * output_len, tokens
    return tokens / elapsed


def sharegpt_requests(tokenizer_path: str, count: int) -> list[tuple[str, int]]:
    """count (prompt text, output length) pairs of bench_serving's synthetic ShareGPT set (seed 7)."""
    from transformers import AutoTokenizer

    from braid.runtime.bench.datasets import sample_sharegpt

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    return [(r.prompt, r.output_len) for r in sample_sharegpt(tokenizer, None, count, seed=7)]


def serving(engine, requests: list[tuple[str, int]], names: list) -> float:
    """Output tokens per second of every request at once, request i on names[i] (None: the base model), from an
    empty prefix cache."""
    if not engine.flush_cache():
        raise RuntimeError("the engine did not flush its prefix cache (requests still running)")
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for _, n in requests]
    start = time.perf_counter()
    out = engine.generate([p for p, _ in requests], params, lora_path=list(names))
    elapsed = time.perf_counter() - start
    tokens = sum(len(r["output_ids"]) for r in out)
    assert tokens == sum(n for _, n in requests), tokens
    return tokens / elapsed


def serving_rows(args, common: dict, paths: list[str], names: list[str]) -> dict:
    """The ShareGPT-shaped runs: the base engine, then one LoRA engine at its default slots over each adapter count."""
    from braid.runtime import Engine

    requests = sharegpt_requests(args.tokenizer_path, args.serving_requests)
    count = max(args.serving_adapters)
    common = {**common, "max_running_requests": None}
    rows = {}
    warm = requests[:16]
    with Engine(**common) as engine:
        serving(engine, warm, [None] * len(warm))  # warm-up
        rows["serving base"] = serving(engine, requests, [None] * len(requests))
        print(f"serving base: {rows['serving base']:.0f} output tok/s", flush=True)
    lora = dict(lora_paths=[f"{n}={p}" for n, p in zip(names[:count], paths[:count])], max_lora_rank=args.rank)
    with Engine(**common, **lora) as engine:
        serving(engine, warm, [names[i % count] for i in range(len(warm))])
        for adapters in args.serving_adapters:
            got = rows[f"serving over {adapters} adapters"] = serving(
                engine, requests, [names[i % adapters] for i in range(len(requests))])
            print(f"serving over {adapters} adapters: {got:.0f} output tok/s, {got / rows['serving base']:.3f}x the "
                  f"base engine", flush=True)  # row by row: a run cut short keeps what it measured
        stats = engine.scheduler.get_stats()
        print(f"serving: {stats.get('lora_slot_loads_total')} adapter loads into "
              f"{stats.get('lora_num_slots')} slots; KV used {stats['kv_used_tokens']}", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer-path", required=True)
    p.add_argument("--model-config", default=CONFIG, help="an HF config.json of the shapes (dummy weights)")
    p.add_argument("--num-adapters", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--decode-output-len", type=int, default=128)
    p.add_argument("--max-total-tokens", type=int, default=120000)
    p.add_argument("--serving-adapters", type=int, nargs="*", default=[],
                   help="adapter counts of the ShareGPT-shaped runs (none: skip them)")
    p.add_argument("--serving-requests", type=int, default=1000)
    p.add_argument("--serving-only", action="store_true", help="only the ShareGPT-shaped runs")
    p.add_argument("--out", default=None, help="a JSON file for the figures")
    args = p.parse_args(argv)
    import torch

    from braid.runtime import Engine

    if torch.cuda.is_available():
        print(f"{torch.cuda.get_device_name()}: copy rate {copy_bandwidth() / 1e12:.2f} TB/s", flush=True)
    with open(args.model_config) as f:
        config = json.load(f)
    folder = tempfile.mkdtemp(prefix="lora_serving_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    paths = write_adapters(folder, max([args.num_adapters, *args.serving_adapters]), args.rank, config)
    names = [f"adapter{i}" for i in range(len(paths))]
    common = dict(model_path="llama3-8b-dummy", load_format="dummy", model_config=args.model_config,
                  tokenizer_path=args.tokenizer_path, dtype="bfloat16", max_total_tokens=args.max_total_tokens,
                  max_running_requests=args.num_requests, log_level="warning")
    lora = dict(lora_paths=[f"{n}={p}" for n, p in zip(names[:args.num_adapters], paths[:args.num_adapters])],
                max_loras_per_batch=args.num_adapters,
                max_loaded_loras=args.num_adapters, max_lora_rank=args.rank)
    rows = {}
    for label, extra in (("base", {}), ("lora", lora)) if not args.serving_only else ():
        start = time.perf_counter()
        with Engine(**common, **extra) as engine:
            print(f"{label} engine up in {time.perf_counter() - start:.0f} s", flush=True)
            rows[f"{label} engine, base request, b1 ms/token"] = decode_ms(
                engine, None, args.input_len, args.decode_output_len, seed=1)
            if label == "lora":
                rows["lora engine, adapter request, b1 ms/token"] = decode_ms(
                    engine, names[0], args.input_len, args.decode_output_len, seed=1)
            request_names = ([None] * args.num_requests if label == "base" else
                             [names[i % args.num_adapters] for i in range(args.num_requests)])
            throughput(engine, request_names[:16], args.input_len, 8, seed=5)  # warm-up
            rows[f"{label} engine, {args.num_requests} at once, output tok/s"] = throughput(
                engine, request_names, args.input_len, args.output_len, seed=7)
            stats = engine.scheduler.get_stats()
            print(f"{label}: decode passes graphed {stats['num_forward_decode_graphed']} of "
                  f"{stats['num_forward_decode']}; running {stats.get('num_running_reqs')}, KV used "
                  f"{stats['kv_used_tokens']} (cached {stats['kv_cached_tokens']})", flush=True)
    if args.serving_adapters:
        rows.update(serving_rows(args, common, paths, names))
    if args.serving_only:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(args=vars(args), rows=rows), f, indent=1)
        return 0
    base_b1, lora_b1 = rows["base engine, base request, b1 ms/token"], rows["lora engine, adapter request, b1 ms/token"]
    base_tp = rows[f"base engine, {args.num_requests} at once, output tok/s"]
    lora_tp = rows[f"lora engine, {args.num_requests} at once, output tok/s"]
    print(f"\n{args.num_adapters} adapters of rank {args.rank} on q/k/v/o/gate/up/down, "
          f"{args.input_len} in / {args.output_len} out")
    for key, value in rows.items():
        print(f"  {key:<48} {value:10.3f}")
    print(f"batch 1: adapter request {base_b1 / lora_b1:.3f}x the base engine's token rate "
          f"({lora_b1:.3f} vs {base_b1:.3f} ms)")
    print(f"{args.num_requests} at once over {args.num_adapters} adapters: {lora_tp / base_tp:.3f}x the base engine "
          f"({lora_tp:.0f} vs {base_tp:.0f} output tok/s)")
    for adapters in args.serving_adapters:
        got, base = rows[f"serving over {adapters} adapters"], rows["serving base"]
        print(f"{args.serving_requests} ShareGPT-shaped at once over {adapters} adapters (default slots): "
              f"{got / base:.3f}x the base engine ({got:.0f} vs {base:.0f} output tok/s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
