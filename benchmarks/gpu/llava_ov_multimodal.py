"""LLaVA-OneVision-Qwen2-7B-shaped dummy bf16 (benchmarks/configs/llava-onevision-qwen2-7b.json) on one GPU: braid's
in-process Engine against HF transformers' LlavaOnevisionForConditionalGeneration `generate`, same shapes, same
pixels, in one call. One JSON line per measurement.

  workload multi-image: N prompts, each 2 random 640x480 images (730 tokens each) + ~32 text tokens, 128 new tokens
  workload video:       N prompts, each one video of 16 frames (16 * 196 + 1 tokens) + ~32 text tokens, 128 new
braid gets all N prompts at once (continuous batching; media preprocessing from JPEG data URLs included in its
time); HF generate gets a static batch of --hf-batch prompts with the pixels already prepared (its preprocessing is
not timed). Both report output tokens/s. Vision tower: the tower + projector + packing for one request's media
(2 images, or the 16 frames), timed alone on the device, and its share of one request's latency run alone.

  python3 benchmarks/gpu/llava_ov_multimodal.py --workload images --num-prompts 200 --hf-batch 16 --out X.jsonl
  python3 benchmarks/gpu/llava_ov_multimodal.py --table X.jsonl
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import numpy as np
import torch

CONFIG = "benchmarks/configs/llava-onevision-qwen2-7b.json"


def emit(out, record: dict) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def make_requests(workload: str, num: int, rng) -> list[dict]:
    from braid.runtime.bench.datasets import random_image_data_url

    words = "describe what you see in detail and say which parts differ from one another please " * 3
    reqs = []
    for _ in range(num):
        if workload == "images":
            images = [random_image_data_url(rng, 640, 480) for _ in range(2)]
            reqs.append({"prompt": "<image>\n<image>\n" + words, "image_data": images, "video_data": None})
        else:
            frames = [random_image_data_url(rng, 640, 480) for _ in range(16)]
            reqs.append({"prompt": "<video>\n" + words, "image_data": None, "video_data": [frames]})
    return reqs


def run_braid(args, reqs) -> tuple[dict, object]:
    from braid.runtime import Engine

    engine = Engine(model_path="llava-ov-7b-dummy", load_format="dummy", model_config=args.config, dtype=args.dtype,
                    tokenizer_path=args.tokenizer, log_level="warning", max_running_requests=args.max_running,
                    mem_fraction_static=0.60, device=args.device)
    sp = {"temperature": 0, "max_new_tokens": args.output_len, "ignore_eos": True}
    warm = engine.generate(reqs[0]["prompt"], sp, image_data=reqs[0]["image_data"], video_data=reqs[0]["video_data"])
    prompt_tokens = warm["meta_info"]["prompt_tokens"]
    engine.flush_cache()
    # one request alone: its latency, for the vision tower's share
    t0 = time.perf_counter()
    engine.generate(reqs[1]["prompt"], sp, image_data=reqs[1]["image_data"], video_data=reqs[1]["video_data"])
    single_s = time.perf_counter() - t0
    engine.flush_cache()
    t0 = time.perf_counter()
    outs = engine.generate([r["prompt"] for r in reqs], sp, image_data=[r["image_data"] for r in reqs],
                           video_data=[r["video_data"] for r in reqs])
    wall = time.perf_counter() - t0
    out_tokens = sum(len(o["output_ids"]) for o in outs)
    ok = all(len(o["output_ids"]) == args.output_len for o in outs)
    return {"impl": "braid", "workload": args.workload, "prompts": len(reqs), "prompt_tokens": prompt_tokens,
            "output_tokens": out_tokens, "wall_s": wall, "out_tok_s": out_tokens / wall, "single_request_s": single_s,
            "all_full_length": ok}, engine


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def tower_time(args, engine, req, repeats: int = 10) -> dict:
    """The vision tower + projector + packing for one request's media, alone on the device."""
    model = engine.scheduler.runner.model
    preparer = engine.served_model().multimodal
    _, mm = preparer.prepare(engine.tokenizer, req["prompt"], req["image_data"], req["video_data"], True)
    items = mm.items
    with torch.inference_mode():
        model.encode(items)
        _sync(args.device)
        t0 = time.perf_counter()
        for _ in range(repeats):
            model.encode(items)
        _sync(args.device)
    per_request = (time.perf_counter() - t0) / repeats
    return {"tower_s_per_request": per_request, "tower_items": len(items),
            "tower_tiles": sum(it.pixel_values.shape[0] for it in items)}


def hf_inputs(args, engine, reqs) -> dict:
    """The first --hf-batch requests as HF inputs: the same input ids (media token ids at the placeholders) and the
    same pixels braid's processor made."""
    preparer = engine.served_model().multimodal
    ids, pixels, sizes, videos = [], [], [], []
    for r in reqs[:args.hf_batch]:
        input_ids, mm = preparer.prepare(engine.tokenizer, r["prompt"], r["image_data"], r["video_data"], True)
        ids.append(mm.model_ids(input_ids, 0))
        for it in mm.items:
            if it.modality == "image":
                pixels.append(it.pixel_values)
                sizes.append(list(it.image_size))
            else:
                videos.append(it.pixel_values)
    if len({len(x) for x in ids}) != 1:
        raise SystemExit("FAIL the HF batch needs prompts of equal length")
    kw = {"input_ids": torch.tensor(ids)}
    if pixels:
        kw.update(pixel_values=torch.stack(pixels), image_sizes=torch.tensor(sizes),
                  batch_num_images=torch.tensor([len(pixels) // len(ids)] * len(ids)))
    if videos:
        kw["pixel_values_videos"] = torch.stack(videos)
    return kw


def run_hf(args, kw: dict) -> dict:
    """HF generate on a static batch (sdpa attention, bf16, random weights of the same shapes)."""
    import transformers

    raw = json.load(open(args.config))
    cfg = transformers.AutoConfig.for_model(**raw)
    dtype = getattr(torch, args.dtype)
    with torch.device(args.device):
        torch.manual_seed(0)
        model = transformers.LlavaOnevisionForConditionalGeneration._from_config(cfg, dtype=dtype,
                                                                                 attn_implementation="sdpa")
    model.eval()
    kw = {k: (v.to(args.device, dtype) if v.is_floating_point() else v.to(args.device)) for k, v in kw.items()}
    batch, prompt_len = kw["input_ids"].shape
    with torch.inference_mode():
        model.generate(**kw, max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
        _sync(args.device)
        t0 = time.perf_counter()
        out = model.generate(**kw, max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False,
                             pad_token_id=0)
        _sync(args.device)
    wall = time.perf_counter() - t0
    new = (out.shape[1] - prompt_len) * batch
    return {"impl": "hf", "workload": args.workload, "prompts": batch, "prompt_tokens": prompt_len,
            "output_tokens": new, "wall_s": wall, "out_tok_s": new / wall}


def table(path: str) -> None:
    rows = [json.loads(line) for line in open(path) if line.startswith("{")]
    print(f"{'workload':<9} {'impl':<6} {'prompts':>7} {'prompt tok':>10} {'out tok':>8} {'wall s':>8} {'out tok/s':>10}")
    for r in rows:
        if "impl" in r:
            print(f"{r['workload']:<9} {r['impl']:<6} {r['prompts']:>7} {r['prompt_tokens']:>10} {r['output_tokens']:>8} "
                  f"{r['wall_s']:>8.2f} {r['out_tok_s']:>10.1f}")
    for w in ("images", "video"):
        b = [r for r in rows if r.get("workload") == w and r.get("impl") == "braid"]
        h = [r for r in rows if r.get("workload") == w and r.get("impl") == "hf"]
        t = [r for r in rows if r.get("workload") == w and "tower_s_per_request" in r]
        if t and b:
            per_item = t[0]["tower_s_per_request"] / max(t[0]["tower_items"], 1)
            share = t[0]["tower_s_per_request"] / b[0]["single_request_s"]
            print(f"{w}: vision tower {t[0]['tower_s_per_request'] * 1e3:.1f} ms per request "
                  f"({t[0]['tower_tiles']} tiles; {per_item * 1e3:.1f} ms per {'image' if w == 'images' else 'video'}), "
                  f"{share * 100:.1f}% of one request alone ({b[0]['single_request_s']:.2f} s)")
        if b and h:
            ratio = b[0]["out_tok_s"] / h[0]["out_tok_s"]
            print(f"{'PASS' if ratio >= 5 else 'FAIL'} {w}: braid {ratio:.2f}x HF generate output tok/s (target >= 5x)")
        elif b or h:
            print(f"FAIL {w}: missing the {'HF' if b else 'braid'} measurement (see the run log)")
        if b and not b[0]["all_full_length"]:
            print(f"FAIL {w}: some braid requests ended before {b[0]['output_tokens'] // b[0]['prompts']} tokens")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", choices=["images", "video"], default="images")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--hf-batch", type=int, default=16)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-running", type=int, default=256)
    p.add_argument("--tokenizer", default=".gpu/tok")
    p.add_argument("--config", default=CONFIG, help="model shapes (a CPU smoke run takes a tiny config.json)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default=None)
    p.add_argument("--table", default=None)
    args = p.parse_args()
    if args.table:
        table(args.table)
        return
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    reqs = make_requests(args.workload, args.num_prompts, rng)
    print(f"made {len(reqs)} {args.workload} requests in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    result, engine = run_braid(args, reqs)
    emit(args.out, result)
    emit(args.out, {"workload": args.workload, **tower_time(args, engine, reqs[0])})
    kw = hf_inputs(args, engine, reqs)
    engine.shutdown()
    del engine
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    emit(args.out, run_hf(args, kw))

if __name__ == "__main__":
    main()
