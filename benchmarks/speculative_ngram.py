"""NGRAM speculation on the embedded SmolLM2 (CPU, batch 1, greedy): wall time per output token with speculation off
and on, in the same process, and the mean acceptance length, on tasks whose output copies the prompt (an edit of a
paragraph, a JSON extraction under a schema) and one whose output does not (free text).

    python benchmarks/speculative_ngram.py [--draft-tokens 5] [--max-new-tokens 96] [--rounds 2] [--dtype auto]

On CUDA (benchmarks/gpu/speculative_ngram.sh) the plain decode steps run in CUDA graphs with the overlap schedule,
the verify passes as extend passes (the extend graphs) without overlap.
"""

from __future__ import annotations

import argparse
import json
import time

from braid.runtime import Engine

PARAGRAPH = ("Paris is the capital and most populous city of France. With an estimated population of 2,102,650 "
             "residents in January 2023 in an area of more than 105 km2, Paris is the fourth-most populous city in "
             "the European Union and the 30th most densely populated city in the world in 2022.")
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                                           "population": {"type": "string"}, "summary": {"type": "string"}},
          "required": ["city", "country", "population", "summary"]}
TASKS = {
    "edit": (f"Rewrite the paragraph below word for word, but write 'Lutetia' instead of 'Paris'.\n\n{PARAGRAPH}\n\n"
             "Rewritten paragraph:\n", {}),
    "json": (f"Extract the city, its country, its population and a one-sentence summary copied from the passage as "
             f"JSON.\n\n{PARAGRAPH}\n\nJSON:\n", {"json_schema": json.dumps(SCHEMA)}),
    "free": ("Write a short story about a lighthouse keeper who finds a message in a bottle.\n", {}),
}


def run(model: str, draft_tokens, max_new_tokens: int, rounds: int, dtype: str) -> dict:
    kw = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": draft_tokens} if draft_tokens else {}
    out = {}
    # batch 1: decode graphs up to 8 rows, extend graphs up to 64 tokens (the verify passes) keep CUDA start-up short
    with Engine(model, max_total_tokens=4096, dtype=dtype, cuda_graph_max_bs=8, cuda_graph_max_extend_tokens=64,
                **kw) as engine:
        engine.generate("warm-up", {"max_new_tokens": 4})
        for name, (prompt, extra) in TASKS.items():
            before = engine.get_stats()
            best, ids = None, None
            for _ in range(rounds):
                start = time.perf_counter()
                res = engine.generate(prompt, {"temperature": 0, "max_new_tokens": max_new_tokens, **extra})
                elapsed = time.perf_counter() - start
                best = elapsed if best is None else min(best, elapsed)
                ids = res["output_ids"]
            after = engine.get_stats()
            drafts = after.get("spec_num_drafts_total", 0) - before.get("spec_num_drafts_total", 0)
            accepted = after.get("spec_num_accepted_tokens_total", 0) - before.get("spec_num_accepted_tokens_total", 0)
            out[name] = {"seconds": best, "tokens": len(ids), "ids": ids,
                         "accept_length": 1 + accepted / drafts if drafts else None}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft-tokens", type=int, default=5, help="--speculative-num-draft-tokens")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2, help="runs of each task; the fastest counts")
    ap.add_argument("--dtype", default="auto", help="--dtype of both engines")
    ap.add_argument("--model-path", default="smollm2", help="SmolLM2 (or another model with its chat-free prompts)")
    args = ap.parse_args()
    off = run(args.model_path, None, args.max_new_tokens, args.rounds, args.dtype)
    on = run(args.model_path, args.draft_tokens, args.max_new_tokens, args.rounds, args.dtype)
    print(f"{'task':6} {'tokens':>6} {'off ms/tok':>10} {'on ms/tok':>9} {'speedup':>7} {'accept len':>10} same")
    for name in TASKS:
        a, b = off[name], on[name]
        print(f"{name:6} {b['tokens']:6d} {1000 * a['seconds'] / a['tokens']:10.1f} "
              f"{1000 * b['seconds'] / b['tokens']:9.1f} {a['seconds'] / b['seconds']:7.2f} "
              f"{b['accept_length'] or 0:10.2f} {a['ids'] == b['ids']}")


if __name__ == "__main__":
    main()
