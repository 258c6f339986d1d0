"""Engine-level offline throughput, optionally beside HF transformers `generate` on the same prompts.

    python -m braid.bench_offline_throughput --num-prompts 32 --output-len 64 --compare-hf --repeats 3

With --repeats N each system runs the whole workload N times (braid's prefix cache flushed before each run); the
table reports each system's best and median run and the ratio of the bests, which damps a noisy shared machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time

from braid.runtime.bench.results import append_jsonl
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


def _timed_runs(fn, repeats: int) -> tuple[list[float], object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return times, result


def _summary(system: str, times: list[float], out_tokens: int) -> dict:
    best, median = min(times), sorted(times)[len(times) // 2]
    return {"system": system, "seconds": best, "median_seconds": median, "all_seconds": times,
            "output_tokens": out_tokens, "output_tok_s": out_tokens / best, "median_output_tok_s": out_tokens / median}


def run_braid(server_args: ServerArgs, prompts: list[str], output_len: int, repeats: int = 1) -> dict:
    from braid.runtime.engine import Engine

    kwargs = {k: v for k, v in dataclasses.asdict(server_args).items() if k != "model_path"}
    with Engine(model_path=server_args.model_path, **kwargs) as engine:
        sp = {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}
        engine.generate(prompts[:2], {**sp, "max_new_tokens": 2})  # warm-up

        def once():
            engine.flush_cache()
            return engine.generate(prompts, sp)

        times, results = _timed_runs(once, repeats)
        stats = engine.get_stats()
    out_tokens = sum(r["meta_info"]["completion_tokens"] for r in results)
    row = {**_summary("braid", times, out_tokens), "input_tokens": sum(r["meta_info"]["prompt_tokens"] for r in results),
           "kv_used_after": stats["kv_used_tokens"]}
    if server_args.speculative_algorithm is not None:  # over the engine's life: warm-up and every repeat
        row["spec_accept_length"] = stats["spec_accept_length_mean"]
    return row


def run_hf(server_args: ServerArgs, prompts: list[str], output_len: int, batch_size: int, repeats: int = 1) -> dict:
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
    def generate(batch: list[str], new_tokens: int) -> int:
        enc = tok(batch, return_tensors="pt", padding=True)
        gen = model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id)
        return (gen.shape[1] - enc["input_ids"].shape[1]) * gen.shape[0]

    def once() -> int:
        return sum(generate(prompts[i:i + batch_size], output_len) for i in range(0, len(prompts), batch_size))

    with torch.no_grad():
        generate(prompts[:2], 2)  # warm-up, as braid's
        times, out_tokens = _timed_runs(once, repeats)
    return _summary("hf-transformers", times, out_tokens)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="braid.bench_offline_throughput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare-hf", action="store_true", help="also run HF transformers generate on the same prompts")
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per system; the best is compared")
    parser.add_argument("--result-file", default=None, help="append the results as one JSON line")
    args = parser.parse_args(argv)
    server_args = ServerArgs.from_cli_args(args)
    if server_args.log_level == "info":
        server_args = server_args.replace(log_level="warning")
    prompts = make_prompts(args.num_prompts, args.seed)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    rows = [run_braid(server_args, prompts, args.output_len, args.repeats)]
    if args.compare_hf:
        rows.append(run_hf(server_args, prompts, args.output_len, args.hf_batch_size, args.repeats))
    print(f"\n{'system':<18}{'prompts':>8}{'out tokens':>12}{'best s':>10}{'out tok/s':>12}{'median s':>10}"
          f"{'median tok/s':>14}")
    for r in rows:
        print(f"{r['system']:<18}{args.num_prompts:>8}{r['output_tokens']:>12}{r['seconds']:>10.2f}"
              f"{r['output_tok_s']:>12.1f}{r['median_seconds']:>10.2f}{r['median_output_tok_s']:>14.1f}")
    if "spec_accept_length" in rows[0]:
        print(f"mean acceptance length ({server_args.speculative_algorithm}): {rows[0]['spec_accept_length']:.2f} "
              "tokens a verified draft")
    result = {"rows": rows, "num_prompts": args.num_prompts, "output_len": args.output_len, "repeats": args.repeats}
    if args.compare_hf:
        result["ratio_vs_hf"] = rows[0]["output_tok_s"] / rows[1]["output_tok_s"]
        result["median_ratio_vs_hf"] = rows[0]["median_output_tok_s"] / rows[1]["median_output_tok_s"]
        print(f"braid / HF output throughput: {result['ratio_vs_hf']:.2f}x best-of-{args.repeats}, "
              f"{result['median_ratio_vs_hf']:.2f}x median")
    if args.result_file:
        append_jsonl(args.result_file, result)
    return result


if __name__ == "__main__":
    main()
