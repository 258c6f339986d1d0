"""Engine-level offline throughput, optionally beside HF transformers `generate` on the same prompts.

    python -m braid.bench_offline_throughput --num-prompts 32 --output-len 64 --compare-hf
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time

from braid.runtime.config import ServerArgs

_TOPICS = ["the ocean", "a robot", "ancient Rome", "a small bakery", "the moon landing", "a lost cat", "quantum physics",
           "a mountain village", "the first computer", "a rainy afternoon", "jazz music", "a chess champion"]


def make_prompts(num_prompts: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    prompts = []
    for i in range(num_prompts):
        topic = rng.choice(_TOPICS)
        filler = " ".join(rng.choice(_TOPICS) for _ in range(rng.randint(0, 12)))
        prompts.append(f"Write a short story about {topic}. Keywords: {filler}.\nStory {i}:")
    return prompts


def run_braid(server_args: ServerArgs, prompts: list[str], output_len: int) -> dict:
    from braid.runtime.engine import Engine

    kwargs = {k: v for k, v in dataclasses.asdict(server_args).items() if k != "model_path"}
    with Engine(model_path=server_args.model_path, **kwargs) as engine:
        sp = {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}
        engine.generate(prompts[:2], {**sp, "max_new_tokens": 2})  # warm-up
        engine.flush_cache()
        start = time.perf_counter()
        results = engine.generate(prompts, sp)
        elapsed = time.perf_counter() - start
        stats = engine.get_stats()
    out_tokens = sum(r["meta_info"]["completion_tokens"] for r in results)
    in_tokens = sum(r["meta_info"]["prompt_tokens"] for r in results)
    return {"system": "braid", "seconds": elapsed, "output_tokens": out_tokens, "input_tokens": in_tokens,
            "output_tok_s": out_tokens / elapsed, "kv_used_after": stats["kv_used_tokens"]}


def run_hf(server_args: ServerArgs, prompts: list[str], output_len: int, batch_size: int) -> dict:
    import os

    import torch
    import transformers

    from braid.runtime.loader.model_path import is_gguf, resolve_model_path
    from braid.runtime.loader.tokenizer import load_tokenizer

    path = resolve_model_path(server_args.model_path)
    kw = {"gguf_file": os.path.basename(path)} if is_gguf(path) else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path) if is_gguf(path) else path,
                                                              torch_dtype=torch.float32, **kw).eval()
    tok = load_tokenizer(server_args.model_path)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    out_tokens = 0
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(prompts), batch_size):
            enc = tok(prompts[i:i + batch_size], return_tensors="pt", padding=True)
            gen = model.generate(**enc, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
            out_tokens += (gen.shape[1] - enc["input_ids"].shape[1]) * gen.shape[0]
    elapsed = time.perf_counter() - start
    return {"system": "hf-transformers", "seconds": elapsed, "output_tokens": out_tokens, "output_tok_s": out_tokens / elapsed}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="braid.bench_offline_throughput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare-hf", action="store_true", help="also run HF transformers generate on the same prompts")
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--result-file", default=None, help="append the results as one JSON line")
    args = parser.parse_args(argv)
    server_args = ServerArgs.from_cli_args(args)
    if server_args.log_level == "info":
        server_args = server_args.replace(log_level="warning")
    prompts = make_prompts(args.num_prompts, args.seed)
    rows = [run_braid(server_args, prompts, args.output_len)]
    if args.compare_hf:
        rows.append(run_hf(server_args, prompts, args.output_len, args.hf_batch_size))
    print(f"\n{'system':<18}{'prompts':>8}{'out tokens':>12}{'seconds':>10}{'out tok/s':>12}")
    for r in rows:
        print(f"{r['system']:<18}{args.num_prompts:>8}{r['output_tokens']:>12}{r['seconds']:>10.2f}{r['output_tok_s']:>12.1f}")
    result = {"rows": rows, "num_prompts": args.num_prompts, "output_len": args.output_len}
    if args.compare_hf:
        result["ratio_vs_hf"] = rows[0]["output_tok_s"] / rows[1]["output_tok_s"]
        print(f"braid / HF output throughput: {result['ratio_vs_hf']:.2f}x")
    if args.result_file:
        with open(args.result_file, "a") as f:
            f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()
