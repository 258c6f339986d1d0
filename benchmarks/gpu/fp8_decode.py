"""FP8 on the Llama-3-8B-shaped dummy model (H200), the parts fp8_decode.sh does not get from bench_one_batch.

  python3 benchmarks/gpu/fp8_decode.py gemv OUT.jsonl      batch-1 GEMM floor per weight shape: bf16 GEMV, fp8 GEMV,
                                                           _scaled_mm (M = 1, row-wise) in CUDA graphs, as TB/s
  python3 benchmarks/gpu/fp8_decode.py kv OUT.jsonl fp8|bf16 [KV_DTYPE...]
                                                           decode step at 8K context, batch 8 and 64, with fp8 or bf16
                                                           weights, by KV cache dtype (default auto fp8_e5m2 fp8_e4m3)
  python3 benchmarks/gpu/fp8_decode.py attn OUT.jsonl      Triton decode attention alone (one layer, batch 64, 8K
                                                           context, 8B heads) by KV dtype and launch config, TB/s
  python3 benchmarks/gpu/fp8_decode.py summary DIR         the table of everything under DIR, PASS/FAIL lines

The KV runs skip the 8K-token prefill (batch 64 would be one 512K-token extend): every request's 8192 cached
tokens are written through the pool's set_kv (random values; a decode step's time does not depend on them), then
32 decode steps run through the CUDA-graph path and the median step is kept. At batch 8 the weights are a large
part of a step's bytes (15 GB bf16 or 8 GB fp8 against 8.6 GB of bf16 KV), so the KV speedup is bounded by
bytes(bf16 KV) / bytes(fp8 KV) per step, printed beside it as "ideal"; the >= 1.3x target is checked on the fp8-weight
runs.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time

CONFIG = "benchmarks/configs/llama3-8b.json"
HBM_BYTES_PER_S = 4.28e12  # measured copy bandwidth of the H200 (docs/benchmarks.md)
KV_STEPS = 32
KV_CONTEXT = 8192 - KV_STEPS  # cached tokens per request: the decoded ones stay within the 8192 rope positions
KV_BATCHES = (8, 64)
KV_DTYPES = ("auto", "fp8_e5m2", "fp8_e4m3")
TARGET_B1_FP8_TOK_S = 450.0
TARGET_KV_SPEEDUP = 1.3


def _append(path: str, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def _server_args(**kw):
    import torch

    from braid.runtime.config import ServerArgs

    base = dict(model_path="llama3-8b-dummy", load_format="dummy", model_config=CONFIG, log_level="warning",
                dtype="bfloat16" if torch.cuda.is_available() else "float32")
    return ServerArgs(**{**base, **kw})


def _timed(time_us, fn) -> float:
    """time_us(fn), or NaN (with the error printed) when the kernel fails, so one failure leaves the rest measured."""
    try:
        return time_us(fn)
    except Exception as e:  # noqa: BLE001 - reported, the run goes on
        print(f"FAIL timing: {e!r}"[:300], flush=True)
        return float("nan")


def gemv_floor(out_path: str) -> None:
    import torch

    from braid.runtime.layers.gemv import gemv
    from braid.runtime.layers.quantization.fp8_kernels import (quantize_rows, quantize_weight_per_channel, scaled_mm,
                                                               small_batch_gemm)
    from decode_b1 import graph_time_us  # benchmarks/gpu, this script's folder

    cfg = json.load(open(CONFIG))
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * cfg["head_dim"]
    shapes = {"qkv": (qkv, h), "o": (h, h), "gate_up": (2 * inter, h), "down": (h, inter)}
    for name, (n, k) in shapes.items():
        # all layers' weights of the shape, so that L2 does not hold them between calls
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(layers)]
        fp8 = [quantize_weight_per_channel(w) for w in dense]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        silu = name == "gate_up"
        row = {"shape": name, "n": n, "k": k, "layers": layers}
        bf16_bytes, fp8_bytes = layers * n * k * 2, layers * (n * k + n * 4)
        timed = lambda fn: _timed(graph_time_us, fn)  # noqa: E731
        row["bf16_gemv_us"] = timed(lambda: [gemv(x, w, silu_mul=silu) for w in dense])
        row["fp8_gemv_us"] = timed(lambda: [gemv(x, q, silu_mul=silu, weight_scale=s) for q, s in fp8])
        row["fp8_scaled_mm_us"] = timed(lambda: [scaled_mm(*quantize_rows(x), q, s, torch.bfloat16) for q, s in fp8])
        row["fp8_small_batch_us"] = timed(lambda: [small_batch_gemm(x, q, s, silu_mul=silu) for q, s in fp8])
        x8 = torch.randn(8, k, device="cuda", dtype=torch.bfloat16)
        row["m8_bf16_linear_us"] = timed(lambda: [torch.nn.functional.linear(x8, w) for w in dense])
        row["m8_fp8_small_batch_us"] = timed(lambda: [small_batch_gemm(x8, q, s, silu_mul=silu) for q, s in fp8])
        row["m8_fp8_scaled_mm_us"] = timed(lambda: [scaled_mm(*quantize_rows(x8), q, s, torch.bfloat16)
                                                    for q, s in fp8])
        row["bf16_gemv_tb_s"] = bf16_bytes / row["bf16_gemv_us"] / 1e6
        row["fp8_gemv_tb_s"] = fp8_bytes / row["fp8_gemv_us"] / 1e6
        row["fp8_scaled_mm_tb_s"] = fp8_bytes / row["fp8_scaled_mm_us"] / 1e6
        row["fp8_small_batch_tb_s"] = fp8_bytes / row["fp8_small_batch_us"] / 1e6
        _append(out_path, row)
        del dense, fp8
        torch.cuda.empty_cache()


ATTN_CONFIGS = [dict(BLOCK_N=bn, num_warps=w, num_stages=st)
                for bn, w, st in ((64, 2, 2), (128, 2, 2), (128, 4, 2), (64, 4, 2), (128, 8, 3), (256, 8, 2))]


def attention_sweep(out_path: str) -> None:
    """One layer's decode attention at batch 64 and 8K context, bf16 vs fp8 KV, for each launch config: which
    config an fp8 cache wants (the kernel picks by head dims only, tuned on bf16)."""
    import torch

    from braid.runtime.layers.attention.triton_ops import decode_attention as da
    from braid.runtime.layers.attention.triton_ops import extend_attention
    from decode_b1 import graph_time_us

    cfg = json.load(open(CONFIG))
    batch, heads, kv_heads, dim = 64, cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    tokens = batch * KV_CONTEXT
    gen = torch.Generator(device="cuda").manual_seed(0)
    table = torch.randperm(tokens, device="cuda", generator=gen).add_(1).to(torch.int32).view(batch, KV_CONTEXT)
    q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
    o = torch.empty_like(q)
    seq_lens = torch.full((batch,), KV_CONTEXT, dtype=torch.int32, device="cuda")
    req_idx = torch.arange(batch, device="cuda")
    original = da._decode_launch_configs
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        k = torch.randn(tokens + 1, kv_heads, dim, device="cuda", dtype=torch.bfloat16).to(kv_dtype)
        v = torch.randn(tokens + 1, kv_heads, dim, device="cuda", dtype=torch.bfloat16).to(kv_dtype)
        nbytes = 2 * tokens * kv_heads * dim * k.element_size()
        for splits in (8, 16):
            scratch = torch.empty(batch, heads, splits, dim + 1, device="cuda", dtype=torch.float32)
            for launch in ATTN_CONFIGS:
                da._decode_launch_configs = lambda *args, launch=launch, **kwargs: [launch]
                extend_attention._FITTING_CONFIG.clear()
                us = _timed(lambda fn: graph_time_us(fn, iters=20), lambda: da.decode_attention_fwd(
                    q, k, v, o, table, req_idx, seq_lens, scratch, splits, dim ** -0.5))
                _append(out_path, {"kv_dtype": str(kv_dtype).removeprefix("torch."), "num_kv_splits": splits,
                                   **launch, "us": us, "tb_s": nbytes / us / 1e6})
        del k, v
        torch.cuda.empty_cache()
    da._decode_launch_configs = original
    extend_attention._FITTING_CONFIG.clear()


def _fill_kv(runner, batch: int, context: int):
    """batch requests with `context` cached tokens each (random KV written through the pool) -> their rows."""
    import torch

    pool, table = runner.token_to_kv_pool, runner.req_to_token_pool
    rows = [table.alloc() for _ in range(batch)]
    loc = pool.alloc(batch * context)
    table.req_to_token[torch.tensor(rows, device=loc.device)] = torch.nn.functional.pad(
        loc.view(batch, context).to(torch.int32), (0, table.req_to_token.shape[1] - context))
    gen = torch.Generator(device=loc.device).manual_seed(0)
    chunk = 65536
    for layer in range(pool.layer_num):
        for start in range(0, loc.numel(), chunk):
            part = loc[start:start + chunk]
            k = torch.randn(part.numel(), pool.head_num, pool.head_dim, device=loc.device, dtype=torch.bfloat16,
                            generator=gen)
            pool.set_kv(layer, part, k, k)
    return rows, loc


def kv_decode(out_path: str, weights: str, kv_dtypes) -> None:
    import torch

    from braid.runtime.core import ForwardBatch, ForwardMode
    from braid.runtime.model_executor.model_runner import ModelRunner

    max_bs = max(KV_BATCHES)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of this code on a tiny config
    for kv_dtype in kv_dtypes:
        started = time.perf_counter()
        args = _server_args(kv_cache_dtype=kv_dtype, quantization="fp8" if weights == "fp8" else None,
                            cuda_graph_max_bs=max_bs,
                            max_running_requests=max_bs, max_total_tokens=max_bs * (KV_CONTEXT + KV_STEPS + 8) + 64)
        runner = ModelRunner(args)
        setup_s = time.perf_counter() - started
        for batch in KV_BATCHES:
            rows, loc = _fill_kv(runner, batch, KV_CONTEXT)
            req = torch.tensor(rows, dtype=torch.int64, device=device)
            ids = torch.randint(0, runner.vocab_size, (batch,), device=device)
            allocated = [loc]
            events = []
            with torch.no_grad():
                for step in range(KV_STEPS):
                    new = runner.token_to_kv_pool.alloc(batch)
                    allocated.append(new)
                    positions = torch.full((batch,), KV_CONTEXT + step, dtype=torch.int64, device=device)
                    runner.req_to_token_pool.req_to_token[req, positions] = new.to(torch.int32)
                    fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=batch, input_ids=ids,
                                      positions=positions, req_pool_indices=req,
                                      seq_lens=(positions + 1).to(torch.int32), out_cache_loc=new,
                                      seq_lens_cpu=[KV_CONTEXT + step + 1] * batch)
                    ids = runner.forward(fb).next_token_ids
                    if device == "cuda":
                        event = torch.cuda.Event(enable_timing=True)
                        event.record()
                        events.append(event)
                    else:
                        events.append(time.perf_counter())
            if device == "cuda":
                torch.cuda.synchronize()
                steps_ms = [a.elapsed_time(b) for a, b in zip(events, events[1:])]
            else:
                steps_ms = [(b - a) * 1e3 for a, b in zip(events, events[1:])]
            steps_ms = steps_ms[3:]  # the first steps warm up
            step_ms = statistics.median(steps_ms)
            graphs = runner.cuda_graph_runner.num_replays if runner.cuda_graph_runner is not None else 0
            _append(out_path, {"weights": weights, "kv_cache_dtype": kv_dtype, "batch_size": batch, "context": KV_CONTEXT,
                               "median_step_ms": step_ms, "decode_tok_s": batch / step_ms * 1e3,
                               "graph_replays": graphs, "kv_pool_gib": runner.token_to_kv_pool.mem_usage_bytes() / 2**30,
                               "setup_s": setup_s})
            runner.token_to_kv_pool.free(torch.cat(allocated))
            for r in rows:
                runner.req_to_token_pool.free(r)
        del runner
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


def _read(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path) if line.strip()]


def _step_bytes(fp8_weights: bool, context: float) -> float:
    """Bytes one batch-1 decode step reads: linear weights (fp8 + fp32 row scales, or bf16), the bf16 LM head and
    norms, and the KV of `context` tokens (bf16)."""
    cfg = json.load(open(CONFIG))
    h, inter, layers, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    kv_heads, head_dim = cfg["num_key_value_heads"], cfg["head_dim"]
    qkv = (cfg["num_attention_heads"] + 2 * kv_heads) * head_dim
    linear = layers * (qkv * h + h * h + 2 * inter * h + h * inter)
    rows = layers * (qkv + h + 2 * inter + h)
    weights = linear + rows * 4 if fp8_weights else linear * 2
    other = vocab * h * 2 + (2 * layers + 1) * h * 2
    kv = context * layers * kv_heads * head_dim * 2 * 2
    return weights + other + kv


def summary(folder: str) -> int:
    bf16 = {r["batch_size"]: r for r in _read(os.path.join(folder, "one_batch_bf16.jsonl"))}
    fp8 = {r["batch_size"]: r for r in _read(os.path.join(folder, "one_batch_fp8.jsonl"))}
    kv = _read(os.path.join(folder, "kv.jsonl"))
    gemv_rows = _read(os.path.join(folder, "gemv.jsonl"))
    attn_rows = [r for r in _read(os.path.join(folder, "attn.jsonl")) if r["us"] == r["us"]]  # NaN: failed
    if attn_rows:
        print(f"\ndecode attention alone, one layer, batch 64 x {KV_CONTEXT} tokens (best launch per KV dtype and "
              "split count; the kernel now uses BLOCK_N 64, 2 warps, 2 stages, 16 splits):")
        for dtype in dict.fromkeys(r["kv_dtype"] for r in attn_rows):
            for splits in sorted({r["num_kv_splits"] for r in attn_rows}):
                rows = [r for r in attn_rows if r["kv_dtype"] == dtype and r["num_kv_splits"] == splits]
                if not rows:
                    continue
                best = min(rows, key=lambda r: r["us"])
                now = next((r for r in rows if (r["BLOCK_N"], r["num_warps"], r["num_stages"]) == (64, 2, 2)), None)
                print(f"  {dtype:>14} splits {splits:>2}: best {best['us']:7.1f} us ({best['tb_s']:.2f} TB/s) with "
                      f"BLOCK_N {best['BLOCK_N']}, {best['num_warps']} warps, {best['num_stages']} stages; current "
                      f"config {now['us'] if now else float('nan'):7.1f} us")
    failures = 0
    if gemv_rows:
        print("\nbatch-1 GEMM floor, all 32 layers of a shape in one CUDA graph (TB/s of weight bytes):")
        print(f"{'shape':>8} {'bf16 gemv':>10} {'fp8 gemv':>10} {'fp8 small-batch':>16} {'fp8 _scaled_mm':>15} "
              f"{'fp8 gemv us':>12} {'bf16 gemv us':>13} | M=8 us: {'bf16 F.linear':>12} {'fp8 small-batch':>15} "
              f"{'fp8 _scaled_mm':>14}")
        for r in gemv_rows:
            print(f"{r['shape']:>8} {r['bf16_gemv_tb_s']:10.2f} {r['fp8_gemv_tb_s']:10.2f} "
                  f"{r.get('fp8_small_batch_tb_s', float('nan')):16.2f} "
                  f"{r['fp8_scaled_mm_tb_s']:15.2f} {r['fp8_gemv_us']:12.1f} {r['bf16_gemv_us']:13.1f} | "
                  f"{'':8}{r['m8_bf16_linear_us']:12.1f} {r['m8_fp8_small_batch_us']:15.1f} "
                  f"{r['m8_fp8_scaled_mm_us']:14.1f}")
    print("\nbench_one_batch, Llama-3-8B-shaped dummy, 128 in / 512 out, decode tok/s (median step):")
    print(f"{'batch':>6} {'bf16 tok/s':>11} {'fp8 tok/s':>10} {'fp8/bf16':>9} {'bf16 ms':>8} {'fp8 ms':>8} "
          f"{'prefill bf16/fp8 ms':>20}")
    for bs in sorted(set(bf16) | set(fp8)):
        a, b = bf16.get(bs), fp8.get(bs)
        ratio = b["decode_throughput"] / a["decode_throughput"] if a and b else float("nan")
        cell = lambda r, key, scale=1.0: f"{r[key] * scale:.1f}" if r else "-"  # noqa: E731
        prefill = f"{cell(a, 'prefill_latency_s', 1e3)}/{cell(b, 'prefill_latency_s', 1e3)}"
        print(f"{bs:>6} {cell(a, 'decode_throughput'):>11} {cell(b, 'decode_throughput'):>10} {ratio:9.2f} "
              f"{cell(a, 'median_decode_latency_s', 1e3):>8} {cell(b, 'median_decode_latency_s', 1e3):>8} {prefill:>20}")
    context = 128 + 512 / 2  # the mean context of the 512 decode steps
    for name, rows, is_fp8 in (("bf16", bf16, False), ("fp8", fp8, True)):
        if 1 not in rows:
            print(f"FAIL batch 1 {name}: no result")
            failures += 1
            continue
        gb = _step_bytes(is_fp8, context) / 1e9
        ceiling = HBM_BYTES_PER_S / (gb * 1e9)
        tok_s = rows[1]["decode_throughput"]
        print(f"batch 1 {name}: {tok_s:.1f} tok/s, {gb:.2f} GB read per step -> ceiling {ceiling:.0f} tok/s at "
              f"4.28 TB/s, {tok_s / ceiling:.1%} of it")
    if 1 in fp8:
        tok_s = fp8[1]["decode_throughput"]
        verdict = "PASS" if tok_s >= TARGET_B1_FP8_TOK_S else "FAIL"
        failures += verdict == "FAIL"
        print(f"{verdict} batch-1 fp8 decode {tok_s:.1f} tok/s (target >= {TARGET_B1_FP8_TOK_S:.0f})")
    if kv:
        print(f"\ndecode at {KV_CONTEXT} cached tokens per request, by weights and KV cache dtype:")
        print(f"{'weights':>8} {'batch':>6} {'kv dtype':>10} {'step ms':>8} {'tok/s':>8} {'x bf16 KV':>10} "
              f"{'ideal':>6} {'pool GiB':>9}")
        base = {(r["weights"], r["batch_size"]): r for r in kv if r["kv_cache_dtype"] == "auto"}
        for r in sorted(kv, key=lambda r: (r["weights"], r["batch_size"], r["kv_cache_dtype"])):
            ref = base.get((r["weights"], r["batch_size"]))
            speedup = ref["median_step_ms"] / r["median_step_ms"] if ref else float("nan")
            fp8_w = r["weights"] == "fp8"
            per_req_kv = _step_bytes(fp8_w, KV_CONTEXT) - _step_bytes(fp8_w, 0)
            bf16_kv_bytes = _step_bytes(fp8_w, 0) + r["batch_size"] * per_req_kv
            fp8_kv_bytes = _step_bytes(fp8_w, 0) + r["batch_size"] * per_req_kv / 2
            ideal = bf16_kv_bytes / fp8_kv_bytes if r["kv_cache_dtype"] != "auto" else 1.0
            print(f"{r['weights']:>8} {r['batch_size']:>6} {r['kv_cache_dtype']:>10} {r['median_step_ms']:8.2f} "
                  f"{r['decode_tok_s']:8.1f} {speedup:10.2f} {ideal:6.2f} {r['kv_pool_gib']:9.1f}")
            if r["kv_cache_dtype"] != "auto" and ref and fp8_w:
                verdict = "PASS" if speedup >= TARGET_KV_SPEEDUP else "FAIL"
                failures += verdict == "FAIL"
                print(f"{verdict} {r['kv_cache_dtype']} KV (fp8 weights) at batch {r['batch_size']}: {speedup:.2f}x "
                      f"bf16 KV (target >= {TARGET_KV_SPEEDUP}, ideal {ideal:.2f})")
    else:
        print("FAIL fp8 KV: no results")
        failures += 1
    return 1 if failures else 0


def main() -> int:
    what, target = sys.argv[1], sys.argv[2]
    if what == "gemv":
        gemv_floor(target)
    elif what == "kv":
        kv_decode(target, sys.argv[3], sys.argv[4:] or KV_DTYPES)
    elif what == "attn":
        attention_sweep(target)
    elif what == "summary":
        return summary(target)
    else:
        raise SystemExit(f"unknown command {what!r}: gemv, kv or summary")
    return 0


if __name__ == "__main__":
    sys.exit(main())
