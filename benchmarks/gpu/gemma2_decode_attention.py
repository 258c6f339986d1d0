"""Gemma-2-9B decode attention alone on the GPU: one global layer (8,192 keys) and one window layer (the last 4,096 of
8,192) at head_dim 256, 16 query / 8 KV heads, soft-cap 50, bf16 KV, batch 1 and 8; the Triton split-KV kernel
(both stages, PDL as in the runtime) over a sweep of split counts and stage-1 launch configs, and FlashInfer's
decode when it imports. Each figure is one call's time inside a CUDA graph of `--layers` calls cycling over as many
distinct KV buffers (so L2 holds none of them, as in a real step where the weights stream in between), and the KV
bytes it must read over that time in TB/s.

  python3 benchmarks/gpu/gemma2_decode_attention.py [--batch-sizes 1 8] [--splits 8 16 32 64] [--out rows.jsonl]
  python3 benchmarks/gpu/gemma2_decode_attention.py --table rows.jsonl       (the summary of earlier runs)

Last: per (batch, layer kind) the runtime's current choice, the best of the sweep, and what the best would save per
decode step over Gemma-2-9B's 21 global + 21 window layers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from sweep_rows import H200_COPY_BYTES_PER_S as BANDWIDTH  # benchmarks/gpu, this script's folder
HEADS, KV_HEADS, HEAD_DIM, CAP = 16, 8, 256, 50.0
# stage-1 (BLOCK_N, num_warps, num_stages[, ROWS_AHEAD]); None: the runtime's own choice
# (decode_attention._decode_launch_configs)
BEFORE_SPLITS = 16  # the runtime's split count for every batch size before decode_kv_splits
CONFIGS = [None, (64, 4, 2), (64, 4, 3), (64, 8, 2), (32, 4, 2), (32, 4, 3), (32, 4, 4), (32, 8, 3),
           (16, 4, 4), (128, 8, 2), (32, 4, 4, True)]


def config_label(config) -> str:
    """A CONFIGS entry's name in the result rows."""
    if config is None:
        return "runtime"
    return "BLOCK_N=%d warps=%d stages=%d" % config[:3] + (" rows ahead" if config[3:] == (True,) else "")


def decode_options(config) -> dict:
    """A CONFIGS entry as decode_attention_fwd's launch_config argument."""
    launch = None if config is None else dict(BLOCK_N=config[0], num_warps=config[1], num_stages=config[2],
                                              ROWS_AHEAD=config[3:] == (True,))
    return {"launch_config": launch}


def kv_buffers(layers: int, bs: int, context: int, device):
    """`layers` K/V buffers [bs * context + 1, Hkv, D] and req_to_token [bs, context] over contiguous slots."""
    slots = bs * context + 1
    ks = [torch.randn(slots, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16) for _ in range(layers)]
    vs = [torch.randn(slots, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16) for _ in range(layers)]
    req_to_token = (torch.arange(bs * context, device=device, dtype=torch.int32) + 1).view(bs, context)
    return ks, vs, req_to_token


def time_graph(calls, reps: int) -> float:
    """Seconds per call of `calls` (a list of closures) captured in one CUDA graph, median of `reps` replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:  # warm-up: compiles
            c()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(calls))
    return sorted(times)[len(times) // 2]


def triton_calls(ks, vs, req_to_token, bs, context, window, splits, config):
    from braid.runtime.layers.attention.triton_ops import decode_attention_fwd

    device = ks[0].device
    q = torch.randn(bs, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    o = torch.empty_like(q)
    scratch = torch.empty(bs, HEADS, splits, HEAD_DIM + 1, device=device, dtype=torch.float32)
    rows = torch.arange(bs, device=device)
    seq_lens = torch.full((bs,), context, device=device, dtype=torch.int32)
    options = decode_options(config)
    return [lambda k=k, v=v: decode_attention_fwd(q, k, v, o, req_to_token, rows, seq_lens, scratch, splits,
                                                  HEAD_DIM ** -0.5, CAP, window, **options)
            for k, v in zip(ks, vs)], (q, o)


def flashinfer_calls(ks, vs, req_to_token, bs, context, window):
    """FlashInfer's paged decode (page size 1) over the same buffers, wrapped for CUDA graphs as the runtime's
    flashinfer backend does: a window layer's list holds only the keys its window sees."""
    import flashinfer

    from braid.runtime.layers.attention.flashinfer_backend import TENSOR_CORE_DECODE_MIN_GROUP

    device = ks[0].device
    visible = min(context, window) if window > 0 else context
    indices = req_to_token[:, context - visible:].reshape(-1).contiguous()
    indptr = torch.arange(bs + 1, device=device, dtype=torch.int32) * visible
    last = torch.ones(bs, device=device, dtype=torch.int32)
    workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, use_tensor_cores=HEADS // KV_HEADS >= TENSOR_CORE_DECODE_MIN_GROUP,
        paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last,
        backend="fa2")
    wrapper.plan(indptr.cpu(), indices, last.cpu(), HEADS, KV_HEADS, HEAD_DIM, 1,
                 window_left=window - 1 if window > 0 else -1, logits_soft_cap=CAP, sm_scale=HEAD_DIM ** -0.5,
                 q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    q = torch.randn(bs, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    return [lambda k=k, v=v: wrapper.run(q, (k.unsqueeze(1), v.unsqueeze(1))) for k, v in zip(ks, vs)], q


def time_triton(base, ks, vs, req_to_token, args, window, splits, config, record) -> None:
    row = {**base, "impl": "triton", "splits": splits, "config": config_label(config)}
    try:
        calls, _ = triton_calls(ks, vs, req_to_token, base["batch_size"], args.context, window, splits, config)
        sec = time_graph(calls, args.reps)
    except Exception as e:  # noqa: BLE001 - a config that does not fit (shared memory) is a row too
        record({**row, "error": f"{type(e).__name__}: {e}"[:120]})
        return
    record({**row, "us": sec * 1e6, "tb_s": base["kv_bytes"] / sec / 1e12})


def time_flashinfer(base, ks, vs, req_to_token, args, window, record) -> None:
    try:
        calls, _ = flashinfer_calls(ks, vs, req_to_token, base["batch_size"], args.context, window)
        sec = time_graph(calls, args.reps)
    except Exception as e:  # noqa: BLE001 - FlashInfer absent or failing: the Triton rows stand alone
        print(f"SKIP flashinfer bs={base['batch_size']} {base['layer']}: {type(e).__name__}: {e}"[:200], flush=True)
        return
    record({**base, "impl": "flashinfer", "splits": 0, "config": "decode wrapper", "us": sec * 1e6,
            "tb_s": base["kv_bytes"] / sec / 1e12})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--splits", type=int, nargs="+", default=[8, 16, 24, 32, 48, 64])
    p.add_argument("--layers", type=int, default=6, help="distinct KV buffers per graph (L2 misses like a real step)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=400, help="stop sweeping after this long (the table still prints)")
    p.add_argument("--impls", nargs="+", default=["triton", "flashinfer"], choices=["triton", "flashinfer"])
    p.add_argument("--out", default=None, help="append JSON lines here")
    p.add_argument("--table", default=None, help="print the summary of this JSON-lines file and exit")
    args = p.parse_args()
    if args.table:
        with open(args.table) as f:
            return summarize([json.loads(line) for line in f if line.strip()])
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    backend = runtime_backend(device)
    print(f"{torch.cuda.get_device_name(device)}, {sms} SMs; the runtime's split counts: "
          + ", ".join(f"bs={bs}: {backend.decode_kv_splits(bs)}" for bs in args.batch_sizes), flush=True)
    t0 = time.time()
    rows = []

    def record(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")

    for impl in args.impls:  # FlashInfer last: its first plan JIT-compiles for minutes
        for bs in args.batch_sizes:
            ks, vs, req_to_token = kv_buffers(args.layers, bs, args.context, device)
            for kind, window in (("global", -1), ("window", args.window)):
                keys = min(args.context, args.window) if window > 0 else args.context
                base = {"batch_size": bs, "layer": kind, "keys": keys,
                        "kv_bytes": bs * keys * KV_HEADS * HEAD_DIM * 2 * 2,
                        "runtime_splits": backend.decode_kv_splits(bs)}
                if impl == "flashinfer":
                    time_flashinfer(base, ks, vs, req_to_token, args, window, record)
                    continue
                for splits in sorted(set(args.splits) | {base["runtime_splits"], BEFORE_SPLITS}):
                    for config in CONFIGS:
                        if time.time() - t0 > args.budget_s:
                            break
                        time_triton(base, ks, vs, req_to_token, args, window, splits, config, record)
            del ks, vs
            torch.cuda.empty_cache()
    return summarize(rows)


def runtime_backend(device):
    """A TritonAttnBackend of Gemma-2-9B's heads: its decode_kv_splits(bs) is the runtime's split count."""
    from types import SimpleNamespace

    from braid.runtime.layers.attention.triton_backend import TritonAttnBackend

    config = SimpleNamespace(num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM)
    return TritonAttnBackend(SimpleNamespace(device=device, model_config=config))


def summarize(rows: list[dict]) -> int:
    ok = [r for r in rows if "us" in r]
    if not ok:
        print("FAIL: no decode attention timing")
        return 1
    print(f"\n{'bs':>3} {'layer':>6} {'keys':>5}  {'before (splits %d)' % BEFORE_SPLITS:>26}  {'runtime':>36}  "
          f"{'best Triton':>48}  {'flashinfer':>16}")
    saving_us = {}
    for bs in sorted({r["batch_size"] for r in ok}):
        for kind in ("global", "window"):
            mine = [r for r in ok if r["batch_size"] == bs and r["layer"] == kind and r["impl"] == "triton"]
            if not mine:
                continue
            runtime_splits = mine[0]["runtime_splits"]
            current = [r for r in mine if r["splits"] == runtime_splits and r["config"] == "runtime"]
            before = [r for r in mine if r["splits"] == BEFORE_SPLITS and r["config"] == "runtime"]
            best = min(mine, key=lambda r: r["us"])
            fi = [r for r in ok if r["batch_size"] == bs and r["layer"] == kind and r["impl"] == "flashinfer"]
            cur = current[0] if current else None
            print(f"{bs:>3} {kind:>6} {mine[0]['keys']:>5}  "
                  + (f"{before[0]['us']:8.1f} us {before[0]['tb_s']:5.2f} TB/s" if before else f"{'-':>26}") + "  "
                  + (f"{cur['us']:8.1f} us {cur['tb_s']:5.2f} TB/s splits {runtime_splits:>2}" if cur
                     else f"{'-':>36}") + "  "
                  + f"{best['us']:8.1f} us {best['tb_s']:5.2f} TB/s splits {best['splits']:>2} {best['config']:>24}"
                  + "  " + (f"{fi[0]['us']:6.1f} us {fi[0]['tb_s']:4.2f}" if fi else "-"))
            if cur:
                saving_us[(bs, kind)] = (cur["us"] - best["us"]) * 21  # Gemma-2-9B: 21 layers of each kind
    for bs in sorted({b for b, _ in saving_us}):
        total = sum(v for (b, _), v in saving_us.items() if b == bs)
        print(f"bs={bs}: the best sweep choices would save {total:.0f} us per decode step (21 global + 21 window "
              "layers)")
    # per split count, the runtime's config: how the step's attention time moves with splits alone
    for bs in sorted({r["batch_size"] for r in ok}):
        per = {}
        for r in ok:
            if r["batch_size"] == bs and r["impl"] == "triton" and r["config"] == "runtime":
                per.setdefault(r["splits"], 0.0)
                per[r["splits"]] += 21 * r["us"]
        if per:
            print(f"bs={bs}, runtime config, 21 global + 21 window layers by split count: "
                  + ", ".join(f"{s}: {us:.0f} us" for s, us in sorted(per.items())))
    recommend(ok)
    print("PASS decode attention timed (Triton" + (", FlashInfer" if any(r["impl"] == "flashinfer" for r in ok)
                                                  else "; FlashInfer not importable") + ")")
    return 0


def recommend(ok: list[dict]) -> None:
    """What to change in the runtime: per batch size the (splits, config) pair with the least time over Gemma-2-9B's
    21 global + 21 window layers, beside the runtime's; a change is worth it from 3% of that attention time."""
    for bs in sorted({r["batch_size"] for r in ok}):
        pairs = {}
        for r in ok:
            if r["batch_size"] == bs and r["impl"] == "triton":
                pairs.setdefault((r["splits"], r["config"]), {})[r["layer"]] = r["us"]
        totals = {pair: 21 * (t["global"] + t["window"]) for pair, t in pairs.items() if len(t) == 2}
        runtime_splits = next(r["runtime_splits"] for r in ok if r["batch_size"] == bs)
        now = totals.get((runtime_splits, "runtime"))
        before = totals.get((BEFORE_SPLITS, "runtime"))
        if not totals or now is None:
            continue
        if before is not None:
            print(f"bs={bs}: attention per step (21 global + 21 window layers) {before:.0f} us with {BEFORE_SPLITS} "
                  f"splits (before), {now:.0f} us with the runtime's {runtime_splits}")
        (splits, config), best = min(totals.items(), key=lambda kv: kv[1])
        if best < 0.97 * now:
            where = ("the split rule (triton_backend.decode_kv_splits)" if config == "runtime"
                     else "the split count (triton_backend.py) and the head_dim <= 256 launch configs "
                          "(decode_attention._decode_launch_configs)")
            print(f"RECOMMEND bs={bs}: splits {splits} with {config}: {best:.0f} us of attention per step against "
                  f"{now:.0f} us now ({now - best:.0f} us less); change {where}")
        else:
            print(f"KEEP bs={bs}: the runtime's splits {runtime_splits} ({now:.0f} us of attention per step) are within "
                  f"3% of the sweep's best ({best:.0f} us, splits {splits} {config})")
        # a split count per layer kind (window layers read half the keys at 8K): the best of each kind on its own
        own = {}
        for kind in ("global", "window"):
            timed = {pair[0]: t[kind] for pair, t in pairs.items() if pair[1] == "runtime" and kind in t}
            if timed:
                own[kind] = min(timed.items(), key=lambda kv: kv[1])
        if len(own) == 2:
            per_kind = 21 * (own["global"][1] + own["window"][1])
            print(f"bs={bs}: splits per layer kind (global {own['global'][0]}, window {own['window'][0]}, runtime "
                  f"config): {per_kind:.0f} us of attention per step against {now:.0f} us now")


if __name__ == "__main__":
    sys.exit(main())
