"""Constrained against free generation on one server, in one run (native /generate):

  1. a burst of --num-schemas new JSON schemas from one client (max_tokens 1): how many are served, in what time;
  2. --num-requests requests at once, request i under schema i % num_schemas, then the same prompts unconstrained
     with each one's output length (max_new_tokens = that length, ignore_eos): output tokens per second of both,
     each phase from an empty prefix cache (both prefill the same prompts);
  3. the same at --tpot-batch requests at once, streamed: mean time per output token of both.

Every constrained output that ends by the grammar is checked against its schema (jsonschema).

    python benchmarks/grammar_serving.py --port 30000 --num-requests 512 --num-schemas 64

--in-process runs phase 2 without a server (in_process): the host's work per request on a CPU machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import aiohttp

WORDS = ("river", "engine", "market", "garden", "signal", "harbor", "ledger", "canyon", "orchard", "beacon", "quartz",
         "meadow", "tunnel", "lantern", "glacier", "summit", "archive", "compass", "falcon", "timber")
FIELDS = ("name", "city", "country", "title", "author", "year", "price", "rating", "tags", "owner", "status",
          "email", "count", "active", "color", "size", "weight", "code", "level", "notes")


def make_schema(i: int) -> dict:
    """A distinct extraction schema: 3-6 properties of varied kinds, some required, sometimes a nested object."""
    rng = random.Random(i)
    props = {}
    for name in rng.sample(FIELDS, rng.randint(3, 6)):
        kind = rng.choice(("string", "integer", "number", "boolean", "enum", "array", "object"))
        if kind == "string":
            props[name] = {"type": "string", "maxLength": rng.choice((8, 16, 24))}
        elif kind == "integer":
            props[name] = {"type": "integer", "minimum": 0, "maximum": rng.choice((100, 5000, 100000))}
        elif kind == "number":
            props[name] = {"type": "number"}
        elif kind == "boolean":
            props[name] = {"type": "boolean"}
        elif kind == "enum":
            props[name] = {"enum": rng.sample(WORDS, 3)}
        elif kind == "array":
            props[name] = {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3}
        else:
            props[name] = {"type": "object", "properties": {"id": {"type": "integer"},
                                                            "label": {"type": "string", "maxLength": 12}},
                           "required": ["id"]}
    required = [n for n in props if rng.random() < 0.7] or [next(iter(props))]
    return {"title": f"Record{i}", "type": "object", "properties": props, "required": required}


def make_prompt(i: int) -> str:
    rng = random.Random(10_000 + i)
    text = " ".join(rng.choice(WORDS) for _ in range(60))
    return f"Read the notes and answer with one JSON record.\nNotes #{i}: {text}\nJSON:"


async def generate(session, url: str, prompt: str, sp: dict, stream: bool = False) -> dict:
    body = {"text": prompt, "sampling_params": sp, "stream": stream}
    start = time.perf_counter()
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            return {"status": resp.status, "error": await resp.text(), "latency": time.perf_counter() - start}
        if not stream:
            out = await resp.json()
            out.update(status=200, latency=time.perf_counter() - start)
            return out
        first, last = None, None
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            first = first or time.perf_counter()
            last = json.loads(line[5:])
        last.update(status=200, latency=time.perf_counter() - start, ttft=first - start)
        return last


async def run_all(url: str, prompts: list[str], params: list[dict], stream: bool = False) -> tuple[float, list[dict]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        outs = await asyncio.gather(*(generate(session, url, p, sp, stream) for p, sp in zip(prompts, params)))
        return time.perf_counter() - start, outs


TIMING_KEYS = ("num_steps", "num_forward_decode", "num_decode_overlapped", "num_forward_extend", "extend_time_s_total",
               "extend_forward_time_s_total", "extend_device_wait_s_total", "extend_grammar_mask_time_s_total",
               "step_time_s_total", "forward_time_s_total", "device_wait_s_total", "send_time_s_total",
               "grammar_accept_time_s_total", "grammar_mask_time_s_total")


def server_timing(port: int) -> dict:
    """The scheduler's step counters and host-time totals (GET /get_server_info)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/get_server_info") as resp:
        info = json.load(resp)
    return {k: info.get(k, 0) for k in TIMING_KEYS}


def flush_prefix_cache(port: int) -> None:
    """Empty the server's prefix cache (GET /flush_cache; the server is idle between phases), so that each phase
    prefills its prompts itself rather than the second one reading the first one's KV."""
    import urllib.error
    import urllib.request

    for _ in range(50):  # the last responses can arrive a step before the scheduler is idle
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/flush_cache"):
                return
        except urllib.error.HTTPError as e:
            if e.code != 400:
                raise
            time.sleep(0.1)
    raise RuntimeError("/flush_cache kept answering 400: requests still running")


def timed_phase(port: int, url: str, prompts, params, stream: bool) -> tuple[float, list[dict], dict]:
    flush_prefix_cache(port)
    before = server_timing(port)
    seconds, outs = asyncio.run(run_all(url, prompts, params, stream))
    after = server_timing(port)
    return seconds, outs, {k: round(after[k] - before[k], 4) for k in TIMING_KEYS}


def tokens(outs: list[dict]) -> list[int]:
    return [o["meta_info"]["completion_tokens"] if o.get("status") == 200 else 0 for o in outs]


def mean_tpot_ms(outs: list[dict]) -> float:
    per = [(o["latency"] - o["ttft"]) / (n - 1) for o, n in zip(outs, tokens(outs)) if n > 1]
    return 1000 * statistics.mean(per) if per else float("nan")


def schema_valid(outs: list[dict], schemas: list[dict]) -> tuple[int, int]:
    """(outputs that ended by the grammar, of those the ones valid under their schema)."""
    import jsonschema

    ended = valid = 0
    for o, schema in zip(outs, schemas):
        if o.get("status") != 200 or o["meta_info"]["finish_reason"]["type"] != "stop":
            continue
        ended += 1
        try:
            jsonschema.validate(json.loads(o["text"]), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return ended, valid


# --in-process: a one-layer Llama with Llama-3-8B's logits width, so that the host's work per request stands out
TINY_LLAMA3_LOGITS = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                      "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                      "num_hidden_layers": 1, "vocab_size": 128256, "max_position_embeddings": 8192,
                      "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "bos_token_id": 128000, "eos_token_id": 128001}


def in_process(args) -> None:
    """--in-process: phase 2 alone (constrained, then free with the same lengths) on a Scheduler in this process
    (on a CPU machine: the synchronous step, jump-forward off as on CUDA), greedy, the grammars compiled first;
    prints each phase's host timing as the server's counters give it."""
    from braid.runtime.config import ServerArgs
    from braid.runtime.core import Req
    from braid.runtime.sampling_params import SamplingParams
    from braid.runtime.scheduler.scheduler import Scheduler, freeze_startup_objects

    n = args.num_requests
    sched = Scheduler(ServerArgs(model_path="llama3-8b-dummy", load_format="dummy", dtype="float32",
                                 model_config=json.dumps(TINY_LLAMA3_LOGITS), tokenizer_path=args.tokenizer_path,
                                 max_total_tokens=n * 400, max_running_requests=n, disable_jump_forward=True,
                                 log_level="warning"))
    freeze_startup_objects()
    schemas = [json.dumps(make_schema(i)) for i in range(args.num_schemas)]
    for spec in schemas:
        sched.intake.grammar_backend.compile("json", spec)
    prompts = [sched.tokenizer.encode(make_prompt(i)) for i in range(n)]

    def phase(name: str, params: list) -> tuple[dict, dict]:
        assert sched.flush_cache()
        before = sched.get_stats()
        for i, (ids, sp) in enumerate(zip(prompts, params)):
            sched.add_request(Req(rid=f"{name}{i}", input_ids=list(ids), sampling_params=sp))
        lens = {}
        while sched.has_work():
            lens.update((o.rid, o.completion_tokens) for o in sched.step() if o.finished)
        after = sched.get_stats()
        return {k: round(after.get(k, 0) - before.get(k, 0), 4) for k in TIMING_KEYS}, lens

    cons_host, lens = phase("c", [SamplingParams(max_new_tokens=args.max_tokens, temperature=0,
                                                 json_schema=schemas[i % len(schemas)]) for i in range(n)])
    free_host, _ = phase("f", [SamplingParams(max_new_tokens=max(1, lens[f"c{i}"]), temperature=0, ignore_eos=True)
                               for i in range(n)])
    sched.shutdown()
    print(f"{n} requests over {len(schemas)} schemas, {sum(lens.values())} tokens each phase")
    for name, h in (("constrained", cons_host), ("free", free_host)):
        print(f"host @{n} {name}: " + ", ".join(f"{k.replace('_time_s_total', '')}={v}" for k, v in h.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--num-requests", type=int, default=512)
    parser.add_argument("--num-schemas", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--tpot-batch", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--throughput-rounds", type=int, default=1,
                        help="run the N-at-once constrained / free pair this many times (the table: the last)")
    parser.add_argument("--output-file", default=None)
    parser.add_argument("--in-process", action="store_true",
                        help="no server: phase 2 on a scheduler in this process, a one-layer Llama with Llama-3's "
                             "logits width (in_process)")
    parser.add_argument("--tokenizer-path", default=".gpu/tok", help="--in-process: the tokenizer")
    args = parser.parse_args()
    if args.in_process:
        in_process(args)
        return
    url = f"http://127.0.0.1:{args.port}/generate"
    schemas = [make_schema(i) for i in range(args.num_schemas)]
    rows = {}

    # 1. a burst of new schemas from one client
    burst_s, outs = asyncio.run(run_all(url, [make_prompt(i) for i in range(len(schemas))],
                                        [{"max_new_tokens": 1, "json_schema": json.dumps(s)} for s in schemas]))
    served = sum(o.get("status") == 200 for o in outs)
    rows["burst"] = {"schemas": len(schemas), "served": served, "seconds": burst_s,
                     "statuses": sorted({o.get("status") for o in outs})}

    # 2. throughput, constrained then free with the same lengths
    n = args.num_requests
    prompts = [make_prompt(i) for i in range(n)]
    req_schemas = [schemas[i % len(schemas)] for i in range(n)]
    base = {"temperature": args.temperature, "max_new_tokens": args.max_tokens}
    runs = [("throughput", n)] * args.throughput_rounds + [("tpot", args.tpot_batch)]
    for run, (name, batch) in enumerate(runs, 1):
        stream = name == "tpot"
        cons_params = [{**base, "json_schema": json.dumps(s), "seed": i} for i, s in enumerate(req_schemas[:batch])]
        cons_s, cons, cons_host = timed_phase(args.port, url, prompts[:batch], cons_params, stream)
        lens = tokens(cons)
        free_params = [{**base, "max_new_tokens": max(1, m), "ignore_eos": True, "seed": i} for i, m in enumerate(lens)]
        free_s, free, free_host = timed_phase(args.port, url, prompts[:batch], free_params, stream)
        ended, valid = schema_valid(cons, req_schemas[:batch])
        row = {"requests": batch, "constrained_tokens": sum(lens), "free_tokens": sum(tokens(free)),
               "constrained_s": cons_s, "free_s": free_s, "constrained_tok_s": sum(lens) / cons_s,
               "free_tok_s": sum(tokens(free)) / free_s, "ended_by_grammar": ended, "schema_valid": valid,
               "errors": sum(o.get("status") != 200 for o in cons + free),
               "constrained_host": cons_host, "free_host": free_host}
        row["ratio"] = row["constrained_tok_s"] / row["free_tok_s"]
        if stream:
            row["constrained_tpot_ms"], row["free_tpot_ms"] = mean_tpot_ms(cons), mean_tpot_ms(free)
            row["tpot_overhead"] = row["constrained_tpot_ms"] / row["free_tpot_ms"] - 1
        else:  # every round's line: a cost the first constrained round pays alone shows as its lower ratio
            print(f"round {run} @{batch}: constrained {row['constrained_tok_s']:.0f}, free {row['free_tok_s']:.0f} "
                  f"output tok/s, {row['ratio']:.3f}; extend s constrained / free "
                  f"{cons_host.get('extend_time_s_total')} / {free_host.get('extend_time_s_total')}", flush=True)
            rows.setdefault("throughput_rounds", []).append(row)
        rows[name] = row  # the last round's

    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump(rows, f, indent=1)
    b, t, p = rows["burst"], rows["throughput"], rows["tpot"]
    print(f"burst of {b['schemas']} new schemas from one client: {b['served']} served in {b['seconds']:.2f} s "
          f"(statuses {b['statuses']})")
    print(f"{'':24}{'constrained':>14}{'free':>12}{'ratio':>8}")
    print(f"{'output tok/s @' + str(t['requests']):24}{t['constrained_tok_s']:14.0f}{t['free_tok_s']:12.0f}"
          f"{t['ratio']:8.3f}")
    print(f"{'output tok/s @' + str(p['requests']):24}{p['constrained_tok_s']:14.0f}{p['free_tok_s']:12.0f}"
          f"{p['ratio']:8.3f}")
    print(f"{'TPOT ms @' + str(p['requests']):24}{p['constrained_tpot_ms']:14.2f}{p['free_tpot_ms']:12.2f}"
          f"{1 + p['tpot_overhead']:8.3f}")
    for r in (t, p):
        for name in ("constrained", "free"):
            h = r[f"{name}_host"]
            print(f"host @{r['requests']} {name}: " + ", ".join(f"{k.replace('_time_s_total', '')}={v}"
                                                                for k, v in h.items()))
    print(f"tokens {t['constrained_tokens']} / {t['free_tokens']}; ended by the grammar {t['ended_by_grammar']}, "
          f"schema-valid {t['schema_valid']}; errors {t['errors'] + p['errors']}")


if __name__ == "__main__":
    main()
