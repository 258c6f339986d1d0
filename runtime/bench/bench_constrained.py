"""Constrained-decoding overhead, measured in one run on one Engine:

  1. free generation vs regex-constrained generation at the same batch size (the cost of the token masks);
  2. JSON-schema generation with jump-forward on vs off (decode steps, sampled tokens, throughput).

    python -m braid.runtime.bench.bench_constrained --batch-size 32 --output-len 48
"""

from __future__ import annotations

import argparse
import json
import time

from braid.runtime.config import ServerArgs

# many fixed keys: most of the output is forced, which is where jump-forward pays
FIXED_KEYS_SCHEMA = {
    "type": "object",
    "properties": {k: {"type": "boolean"} for k in ("has_title", "has_author", "has_year", "has_publisher",
                                                    "has_isbn", "has_pages", "has_language", "has_edition")},
    "required": ["has_title", "has_author", "has_year", "has_publisher", "has_isbn", "has_pages", "has_language",
                 "has_edition"],
}
# a free-form digit regex: no forced text, so any difference to free generation is mask overhead
DIGITS_REGEX = r"[0-9 ,]{1,400}"


def _timed(engine, prompts, sp) -> tuple[float, list[dict], dict]:
    before = engine.get_stats()
    start = time.perf_counter()
    res = engine.generate(prompts, sp)
    elapsed = time.perf_counter() - start
    after = engine.get_stats()
    steps = (after["num_forward_decode"] + after["num_forward_extend"]) - (before["num_forward_decode"] + before["num_forward_extend"])
    return elapsed, res, {"forward_steps": steps}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="braid.runtime.bench.bench_constrained", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=48)
    args = parser.parse_args(argv)
    server_args = ServerArgs.from_cli_args(args)
    from braid.runtime.engine import Engine

    prompts = [f"List {i}: 1, 2, 3, 4," for i in range(args.batch_size)]
    rows = {}
    kw = {k: getattr(server_args, k) for k in ("max_total_tokens", "device", "dtype", "attention_backend")}
    kw["log_level"] = "warning"
    with Engine(model_path=server_args.model_path, **{k: v for k, v in kw.items() if v is not None}) as engine:
        base = {"temperature": 1.0, "max_new_tokens": args.output_len, "ignore_eos": True, "seed": 0}
        engine.generate(prompts[:2], {**base, "max_new_tokens": 2, "regex": DIGITS_REGEX})  # compile + warm-up
        for name, sp in (("free", base), ("regex", {**base, "regex": DIGITS_REGEX})):
            engine.flush_cache()
            t, res, extra = _timed(engine, prompts, sp)
            toks = sum(r["meta_info"]["completion_tokens"] for r in res)
            rows[name] = {"seconds": t, "tokens": toks, "tok_s": toks / t, **extra}
    json_prompts = [f"Book record {i} as JSON: " for i in range(args.batch_size)]
    for name, jump in (("json+jump_forward", True), ("json", False)):
        with Engine(model_path=server_args.model_path, enable_jump_forward=jump, disable_jump_forward=not jump,
                    **{k: v for k, v in kw.items() if v is not None}) as engine:
            sp = {"temperature": 1.0, "max_new_tokens": 256, "seed": 1, "json_schema": json.dumps(FIXED_KEYS_SCHEMA)}
            engine.generate(json_prompts[:1], sp)  # compile
            engine.flush_cache()
            t, res, extra = _timed(engine, json_prompts, sp)
            for r in res:
                json.loads(r["text"])
            toks = sum(r["meta_info"]["completion_tokens"] for r in res)
            sampled = sum(r["meta_info"]["completion_tokens_wo_jump_forward"] for r in res)
            chars = sum(len(r["text"]) for r in res)
            rows[name] = {"seconds": t, "tokens": toks, "sampled_tokens": sampled, "tok_s": toks / t,
                          "chars_s": chars / t, **extra}
    print(f"\n{'run':<20}{'seconds':>9}{'tokens':>8}{'sampled':>9}{'steps':>7}{'tok/s':>9}")
    for name, r in rows.items():
        print(f"{name:<20}{r['seconds']:>9.2f}{r['tokens']:>8}{r.get('sampled_tokens', r['tokens']):>9}"
              f"{r['forward_steps']:>7}{r['tok_s']:>9.1f}")
    ratios = {
        "regex_vs_free_throughput": rows["regex"]["tok_s"] / rows["free"]["tok_s"],
        "jump_forward_speedup_seconds": rows["json"]["seconds"] / rows["json+jump_forward"]["seconds"],
        "jump_forward_step_fraction": rows["json+jump_forward"]["forward_steps"] / rows["json"]["forward_steps"],
    }
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}")
    return {"rows": rows, "ratios": ratios}


if __name__ == "__main__":
    main()
