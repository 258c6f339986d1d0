"""Grammar engines on real-world JSON schemas: which schemas each engine compiles and judges right, whether it ever
accepts an invalid instance, how long compiles take and what a token mask costs.

    python -m braid.bench_grammar --corpus /path/to/jsonschemabench/maskbench/data --limit 300

The corpus is a folder of JSON files, each {"schema": ..., "tests": [{"valid": bool, "data": ...}, ...]} — the layout
of MaskBench (github.com/guidance-ai/jsonschemabench, folder maskbench/data; braid ships none of it). A file's group
is its sub-folder, else its name before "---" (MaskBench's "Github_hard---o1234.json"), else its name less a trailing
"_<n>". Schemas without instances are skipped. The sample is stratified: each group contributes in proportion to its
size (at least one), drawn with a fixed seed.

Each sampled schema is compiled by `GrammarBackend.compile("json", ...)`, as the server does, per engine and
tokenizer. Each instance is written as compact JSON (keys in the order the schema lists its properties, since the
engines fix that order; `--key-order instance` keeps the corpus' order), tokenized without special tokens and fed
token by token: before each token the state fills its bitmask row (timed: the per-token mask figures, over valid
instances), then accepts the token. A valid instance is judged right when every token is allowed and the state
accepts at the end; an invalid one when some token is refused or the end is not accepting. A schema is right when it
compiles and every instance is judged right; a refused compile is not right, but sound. Compile percentiles count
compiles that finished and timeouts (at the timeout), not refusals.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import random
import re
import subprocess
import sys
import time

from braid.runtime.constrained.schema_prepare import resolve_local_ref

ENGINES = ("outlines", "llguidance", "auto")
TOKENIZERS = ("smollm2", "gemma3-270m")


def group_of(path: str, root: str) -> str:
    rel = os.path.relpath(path, root)
    if os.sep in rel:
        return rel.split(os.sep)[0]
    name = os.path.basename(rel)
    if "---" in name:
        return name.split("---")[0]
    return re.sub(r"_\d+$", "", name[:-5] if name.endswith(".json") else name)


def load_corpus(root: str) -> dict[str, list[str]]:
    """group -> sorted paths of the corpus files that hold instances."""
    if not os.path.isdir(root):
        raise SystemExit(f"--corpus {root}: no such folder (see `python -m braid.bench_grammar --help`)")
    groups: dict[str, list[str]] = collections.defaultdict(list)
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name.endswith(".json"):
                path = os.path.join(dirpath, name)
                try:
                    with open(path) as f:
                        entry = json.load(f)
                except (OSError, ValueError):
                    continue
                if isinstance(entry, dict) and "schema" in entry and entry.get("tests"):
                    groups[group_of(path, root)].append(path)
    return {g: sorted(p) for g, p in sorted(groups.items())}


def stratified_sample(groups: dict[str, list[str]], limit: int | None, seed: int) -> list[str]:
    """About `limit` paths, each group in proportion to its size (largest remainders), at least one from each."""
    total = sum(len(p) for p in groups.values())
    rng = random.Random(seed)
    if limit is None or limit >= total:
        return [p for g in groups for p in groups[g]]
    quotas = {g: max(1, limit * len(p) / total) for g, p in groups.items()}
    counts = {g: min(len(groups[g]), int(q)) for g, q in quotas.items()}
    by_remainder = sorted(groups, key=lambda g: (quotas[g] - int(quotas[g])), reverse=True)
    for g in by_remainder:
        if sum(counts.values()) >= limit:
            break
        if counts[g] < len(groups[g]):
            counts[g] += 1
    out = []
    for g, paths in groups.items():
        out += rng.sample(paths, counts[g])
    return out


# -- instances in the engines' property order ---------------------------------------------------------------------

def _expand(schemas: list, root, depth: int = 0) -> list[dict]:
    """The subschemas that apply in place to one instance (the schema, its $ref targets, applicator branches), in
    the order their keys appear."""
    out = []
    for s in schemas:
        if not isinstance(s, dict) or depth > 12:
            continue
        out.append(s)
        for key, value in s.items():
            if key == "$ref" and isinstance(value, str):
                out += _expand([resolve_local_ref(root, value)], root, depth + 1)
            elif key in ("allOf", "anyOf", "oneOf") and isinstance(value, list):
                out += _expand(value, root, depth + 1)
            elif key in ("then", "else"):
                out += _expand([value], root, depth + 1)
            elif key in ("dependentSchemas", "dependencies") and isinstance(value, dict):
                out += _expand([v for v in value.values() if isinstance(v, dict)], root, depth + 1)
    return out


def order_keys(data, schemas: list, root):
    """`data` with object keys in the order the schema lists properties (listed first, then `required`, then the
    rest as they were), recursively. Key order never changes whether an instance is valid."""
    expanded = _expand(schemas, root)
    if isinstance(data, dict):
        listed: dict[str, list] = {}
        required: list[str] = []
        extra: list = []
        for s in expanded:
            props = s.get("properties")
            if isinstance(props, dict):
                for name, sub in props.items():
                    listed.setdefault(name, []).append(sub)
            if isinstance(s.get("required"), list):
                required += [r for r in s["required"] if isinstance(r, str)]
            if isinstance(s.get("additionalProperties"), dict):
                extra.append(s["additionalProperties"])
            if isinstance(s.get("patternProperties"), dict):
                extra += list(s["patternProperties"].values())
        order = [k for k in dict.fromkeys(list(listed) + required) if k in data]
        order += [k for k in data if k not in order]
        return {k: order_keys(data[k], listed.get(k, extra), root) for k in order}
    if isinstance(data, list):
        out = []
        for i, item in enumerate(data):
            subs = []
            for s in expanded:
                prefix = s.get("prefixItems", s.get("items") if isinstance(s.get("items"), list) else None)
                if isinstance(prefix, list) and i < len(prefix):
                    subs.append(prefix[i])
                elif isinstance(s.get("items"), dict):
                    subs.append(s["items"])
                elif isinstance(s.get("additionalItems"), dict):
                    subs.append(s["additionalItems"])
            out.append(order_keys(item, subs, root))
        return out
    return data


def instance_text(data, schema, key_order: str) -> str:
    if key_order == "schema":
        data = order_keys(data, [schema], schema)
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False)


# -- one engine on one tokenizer ----------------------------------------------------------------------------------

def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def judge(grammar, token_ids: list[int], bitmask, mask_times: list[float] | None) -> tuple[bool, int]:
    """(every token allowed and the end accepting, tokens where the mask and accept_token disagreed)."""
    from braid.runtime.constrained.grammar_errors import GrammarError

    state = grammar.new_state()
    disagreements = 0
    for token in token_ids:
        start = time.perf_counter()
        state.fill_bitmask(bitmask, 0)
        if mask_times is not None:
            mask_times.append(time.perf_counter() - start)
        in_mask = bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)
        try:
            state.accept_token(token)
        except GrammarError:
            disagreements += in_mask
            return False, disagreements
        disagreements += not in_mask
    return state.is_accepting(), disagreements


def run_engine(engine: str, tokenizer, vocab_size: int, entries: list[dict], *, timeout_s: float, key_order: str,
               json_strict: bool, desc: str, progress: bool = True) -> dict:
    from tqdm import tqdm

    from braid.runtime.constrained.bitmask import allocate_bitmask
    from braid.runtime.constrained.grammar_errors import GrammarError, GrammarTimeoutError
    from braid.runtime.constrained.grammar import GrammarBackend

    backend = GrammarBackend(tokenizer, vocab_size, engine=engine, timeout_s=timeout_s, json_strict=json_strict,
                             cache_size=max(1, len(entries)))
    bitmask = allocate_bitmask(1, vocab_size)
    compile_times, mask_times, rows = [], [], []
    try:
        for entry in tqdm(entries, desc=desc, disable=not progress, file=sys.stderr):
            row = {"name": entry["name"], "group": entry["group"], "compiled": False, "right": False,
                   "invalid_accepted": 0, "valid_refused": 0, "disagreements": 0, "error": None}
            start = time.perf_counter()
            try:
                grammar = backend.compile("json", json.dumps(entry["schema"]))
                compile_times.append(time.perf_counter() - start)
                row["compiled"] = True
            except GrammarTimeoutError as e:
                compile_times.append(timeout_s)
                row["error"] = f"timeout: {e}"
            except GrammarError as e:
                row["error"] = str(e)
            row["compile_s"] = time.perf_counter() - start
            if row["compiled"]:
                for valid, text in entry["instances"]:
                    ids = tokenizer.encode(text, add_special_tokens=False)
                    accepted, disagreements = judge(grammar, ids, bitmask, mask_times if valid else None)
                    row["disagreements"] += disagreements
                    if accepted and not valid:
                        row["invalid_accepted"] += 1
                    if valid and not accepted:
                        row["valid_refused"] += 1
                row["right"] = row["invalid_accepted"] == 0 and row["valid_refused"] == 0
            rows.append(row)
    finally:
        backend.shutdown()
    n = len(rows)
    right = sum(r["right"] for r in rows)
    return {
        "engine": engine, "schemas": n, "right": right, "right_pct": 100.0 * right / n if n else 0.0,
        "compiled": sum(r["compiled"] for r in rows),
        "invalid_accepted_schemas": sum(r["invalid_accepted"] > 0 for r in rows),
        "valid_refused_schemas": sum(r["valid_refused"] > 0 for r in rows),
        "timeouts": sum(bool(r["error"] and r["error"].startswith("timeout")) for r in rows),
        "mask_disagreements": sum(r["disagreements"] for r in rows),
        "compile_ms": {f"p{q}": _ms(_percentile(compile_times, q)) for q in (50, 90, 99)},
        "mask_us": {f"p{q}": _us(_percentile(mask_times, q)) for q in (50, 99)},
        "mask_calls": len(mask_times),
        "rows": rows,
    }


def _ms(v):
    return None if v is None else round(v * 1e3, 3)


def _us(v):
    return None if v is None else round(v * 1e6, 2)


def _vocab_size(tokenizer) -> int:
    return max(len(tokenizer), getattr(tokenizer, "vocab_size", 0) or 0)


def prepare_entries(paths: list[str], root: str, key_order: str) -> list[dict]:
    entries = []
    for path in paths:
        with open(path) as f:
            entry = json.load(f)
        schema = entry["schema"]
        instances = [(bool(t["valid"]), instance_text(t["data"], schema, key_order)) for t in entry["tests"]]
        entries.append({"name": os.path.relpath(path, root), "group": group_of(path, root), "schema": schema,
                        "instances": instances})
    return entries


def _git_commit() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def format_table(results: list[dict]) -> str:
    head = (f"{'tokenizer':<13}{'engine':<12}{'right':>13}{'inv.acc':>8}{'refused':>8}{'t/o':>5}"
            f"{'compile p50/p90/p99 ms':>26}{'mask p50/p99 us':>18}")
    lines = [head]
    for r in results:
        c, m = r["compile_ms"], r["mask_us"]
        comp = "/".join("-" if c[k] is None else f"{c[k]:.1f}" for k in ("p50", "p90", "p99"))
        mask = "/".join("-" if m[k] is None else f"{m[k]:.0f}" for k in ("p50", "p99"))
        right = f"{r['right']}/{r['schemas']} {r['right_pct']:.1f}%"
        lines.append(f"{r['tokenizer']:<13}{r['engine']:<12}{right:>13}{r['invalid_accepted_schemas']:>8}"
                     f"{r['schemas'] - r['compiled']:>8}{r['timeouts']:>5}{comp:>26}{mask:>18}")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m braid.bench_grammar", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", required=True, help="folder of {schema, tests} JSON files (MaskBench's data/)")
    p.add_argument("--limit", type=int, default=300, help="schemas in the stratified sample (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    p.add_argument("--tokenizers", nargs="+", default=list(TOKENIZERS),
                   help="embedded model names or tokenizer paths (load_tokenizer)")
    p.add_argument("--timeout-s", type=float, default=10.0, help="compile timeout, as the server's")
    p.add_argument("--key-order", choices=("schema", "instance"), default="schema")
    p.add_argument("--json-strict", action="store_true",
                   help="close object schemas silent on extra properties (the server's default); off, the "
                        "specification's reading, which the corpus' labels follow")
    p.add_argument("--output", help="write every schema's result here (JSON)")
    p.add_argument("--show-failures", type=int, default=0, help="print this many wrong schemas per run")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--generate", type=int, default=0,
                   help="then generate with the embedded SmolLM2 (the server's default engine and strict mode, "
                        "temperature 1) under the first N sampled schemas it compiles, and validate each output "
                        "that ended by its grammar under its schema (jsonschema)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="with --generate")
    return p.parse_args(argv)


def generate_and_validate(entries: list[dict], n: int, max_new_tokens: int) -> dict:
    """Sample outputs under real-world schemas: {schemas, ended, valid, truncated, invalid: [names]}."""
    import jsonschema

    from braid.runtime.constrained import GrammarBackend, GrammarError
    from braid.runtime.engine import Engine
    from braid.runtime.loader.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("smollm2")
    backend = GrammarBackend(tokenizer, _vocab_size(tokenizer))
    chosen = []
    try:
        for e in entries:
            if len(chosen) == n:
                break
            try:
                backend.compile("json", json.dumps(e["schema"]))
                chosen.append(e)
            except GrammarError:
                continue
    finally:
        backend.shutdown()
    with Engine(model_path="smollm2", log_level="warning", max_total_tokens=max(8192, 8 * max_new_tokens)) as engine:
        prompts = [f"Write one JSON document valid under this JSON schema.\nSchema: "
                   f"{json.dumps(e['schema'])[:1500]}\nJSON:" for e in chosen]
        params = [{"temperature": 1.0, "seed": i, "max_new_tokens": max_new_tokens,
                   "json_schema": json.dumps(e["schema"])} for i, e in enumerate(chosen)]
        outs = engine.generate(prompts, params)
    ended = valid = 0
    invalid = []
    for e, out in zip(chosen, outs):
        if out["meta_info"]["finish_reason"]["type"] != "stop":
            continue
        ended += 1
        validator = jsonschema.validators.validator_for(e["schema"])(e["schema"])
        try:
            ok = validator.is_valid(json.loads(out["text"]))
        except ValueError:
            ok = False
        valid += ok
        if not ok:
            invalid.append(e["name"])
    return {"schemas": len(chosen), "ended": ended, "valid": valid, "truncated": len(chosen) - ended,
            "invalid": invalid}


def main(argv=None) -> dict:
    args = parse_args(argv)
    from braid.runtime.loader.tokenizer import load_tokenizer

    groups = load_corpus(args.corpus)
    paths = stratified_sample(groups, args.limit or None, args.seed)
    entries = prepare_entries(paths, args.corpus, args.key_order)
    sampled = collections.Counter(e["group"] for e in entries)
    print(f"corpus {args.corpus}: {sum(len(p) for p in groups.values())} schemas with instances in {len(groups)} "
          f"groups; sample {len(entries)} (seed {args.seed}), {sum(len(e['instances']) for e in entries)} instances",
          file=sys.stderr)
    summary = {
        "command": "python -m braid.bench_grammar " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": _git_commit(),
        "sample": {"schemas": len(entries), "groups": dict(sorted(sampled.items())), "seed": args.seed,
                   "key_order": args.key_order, "json_strict": args.json_strict},
        "results": [],
    }
    results = summary["results"]
    for tok_name in args.tokenizers:
        tokenizer = load_tokenizer(tok_name)
        vocab_size = _vocab_size(tokenizer)
        for engine in args.engines:
            r = run_engine(engine, tokenizer, vocab_size, entries, timeout_s=args.timeout_s,
                           key_order=args.key_order, json_strict=args.json_strict, desc=f"{tok_name} {engine}",
                           progress=not args.no_progress)
            r["tokenizer"] = tok_name
            r["vocab_size"] = vocab_size
            results.append(r)
            if args.output:  # after each run, so a long run's finished parts are kept
                with open(args.output, "w") as f:
                    json.dump(summary, f, indent=1)
            for row in [x for x in r["rows"] if not x["right"]][:args.show_failures]:
                print(f"  {tok_name} {engine} {row['name']}: {row['error'] or ''} "
                      f"invalid accepted {row['invalid_accepted']} valid refused {row['valid_refused']}",
                      file=sys.stderr)
    print(f"\n{summary['command']}\n{summary['date']}  commit {summary['commit']}  "
          f"{len(entries)} schemas, key order {args.key_order}, json_strict {args.json_strict}")
    print(format_table(results))
    if args.generate:
        gen = summary["generation"] = generate_and_validate(entries, args.generate, args.max_new_tokens)
        print(f"SmolLM2 at temperature 1 under {gen['schemas']} compiled schemas: {gen['ended']} ended by the "
              f"grammar, {gen['valid']} of them valid under their schema (jsonschema); {gen['truncated']} cut at "
              f"--max-new-tokens {args.max_new_tokens}" + (f"; invalid: {gen['invalid']}" if gen["invalid"] else ""))
        if args.output:
            with open(args.output, "w") as f:
                json.dump(summary, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
