"""Greedy multi-turn conversations on a loaded server against the same conversations one at a time on a plain one.

Each conversation is a long first message (20-300 words) and 1-4 follow-ups, each turn sent with the whole history
so far (the radix cache's prefix reuse, and for window-trimmed models the cut-back of prefixes whose window KV was
released). Server A gets them CONCURRENCY at a time under its server args; server B one at a time (typically
without radix cache and window trimming). Both are started here (braid.Runtime) with --max-total-tokens and the
ServerArgs fields given as JSON, as bench_soak's --server-args. Prints how many turns produced the same greedy
tokens, the largest |logprob difference| where they did, and for the first differing turns the two top-2
candidates where they part (a near tie flipped by batch composition, or a real difference).

    python benchmarks/loaded_vs_sequential.py --model-path /path/to/tiny-gemma2 \
        --a-args '{"chunked_prefill_size": 64}' \
        --b-args '{"disable_window_kv_trimming": true, "disable_radix_cache": true}'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import aiohttp

from braid.backends.runtime import Runtime

WORDS = "sea sky rain cat dog tree road city light stone river cloud night sun wind fire".split()


def conversations(n: int, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        turns = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 300)))]
        turns += [" " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))) for _ in range(rng.randint(1, 4))]
        out.append(turns)
    return out


async def run(base: str, convs: list[list[str]], concurrency: int, max_new_tokens: int) -> tuple[dict, dict]:
    """(conversation, turn) -> (output token ids, their logprobs, top-2 per position); and the idle server info."""
    results: dict = {}
    queue: asyncio.Queue = asyncio.Queue()
    for item in enumerate(convs):
        queue.put_nowait(item)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def worker():
            while not queue.empty():
                i, turns = queue.get_nowait()
                text = ""
                for j, turn in enumerate(turns):
                    text += turn
                    body = {"text": text, "return_logprob": True, "top_logprobs_num": 2,
                            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}}
                    async with session.post(base + "/generate", json=body) as r:
                        reply = await r.json()
                    if r.status != 200:
                        raise RuntimeError(f"turn {j} of conversation {i}: HTTP {r.status}: {reply}")
                    meta = reply["meta_info"]
                    results[(i, j)] = ([t for _, t in meta["output_token_logprobs"]],
                                       [lp for lp, _ in meta["output_token_logprobs"]], meta["output_top_logprobs"])
                    text += reply["text"]

        await asyncio.gather(*[worker() for _ in range(concurrency)])
        async with session.get(base + "/get_server_info") as r:
            info = await r.json()
    return results, info


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--a-args", default="{}", help="server A's ServerArgs fields as JSON (loaded)")
    p.add_argument("--b-args", default='{"disable_radix_cache": true}',
                   help="server B's ServerArgs fields as JSON (one request at a time)")
    p.add_argument("--max-total-tokens", type=int, default=3072)
    p.add_argument("--conversations", type=int, default=60)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    convs = conversations(args.conversations, args.seed)
    outcome = {}
    for name, server_args, concurrency in (("A", args.a_args, args.concurrency), ("B", args.b_args, 1)):
        server_args = {"max_total_tokens": args.max_total_tokens, "log_level": "warning", **json.loads(server_args)}
        runtime = Runtime(model_path=args.model_path, **server_args)
        try:
            started = time.perf_counter()
            outcome[name] = asyncio.run(run(runtime.url, convs, concurrency, args.max_new_tokens))
            info = outcome[name][1]
            print(f"server {name} ({server_args}), {concurrency} at a time: {len(outcome[name][0])} turns in "
                  f"{time.perf_counter() - started:.0f} s; at idle KV used {info.get('kv_used_tokens')}"
                  + (f", window-layer KV used {info['window_kv_used_tokens']}" if "window_kv_used_tokens" in info
                     else "") + f", cache hit rate {info.get('cache_hit_rate', 0):.2f}, "
                  f"{info.get('num_retractions', 0)} retractions")
        finally:
            runtime.shutdown()
    a, b = outcome["A"][0], outcome["B"][0]
    same, differ, worst = 0, [], 0.0
    for key in sorted(a):
        tokens_a, lps_a, top_a = a[key]
        tokens_b, lps_b, top_b = b[key]
        if tokens_a == tokens_b:
            same += 1
            worst = max(worst, max(abs(x - y) for x, y in zip(lps_a, lps_b)))
        else:
            at = next(i for i, (x, y) in enumerate(zip(tokens_a, tokens_b)) if x != y)
            differ.append((key, at, [(round(lp, 4), t) for lp, t, *_ in top_a[at]],
                           [(round(lp, 4), t) for lp, t, *_ in top_b[at]]))
    for key, at, top_a, top_b in differ[:5]:
        print(f"conversation {key[0]} turn {key[1]}: tokens part at {at}; top-2 A {top_a}, B {top_b}")
    print(f"same greedy tokens: {same} of {len(a)} turns; largest |logprob difference| where the same: {worst:.3g}")
    idle_a = outcome["A"][1]
    free = idle_a.get("kv_used_tokens") == 0 and idle_a.get("window_kv_used_tokens", 0) == 0
    return 0 if not differ and free else 1


if __name__ == "__main__":
    sys.exit(main())
