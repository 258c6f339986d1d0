"""bf16 weights at small decode batches (2..16 rows of x) per Gemma-2-9B and Llama-3-8B shape (H200): cuBLAS (with the
gated activation as its own kernel, as the runtime ran it) against braid's tensor-core kernel (small_batch_gemm.py,
activation fused) over its candidate tiles, each timed with all of the model's layers of a shape in one CUDA graph
(so L2 holds none of them), in TB/s of the weight bytes streamed.

  python3 benchmarks/gpu/small_batch_gemm.py [--models gemma2-9b llama3-8b] [--rows 2 4 8 16] [--budget-s 150]
                                             [--out rows.jsonl] [--step gemma2-9b:8:8000 llama3-8b:8:128]
  python3 benchmarks/gpu/small_batch_gemm.py --table rows.jsonl
  ... --write-table: then write the winning rows into runtime/layers/measured_tiles.py (SMALL_BATCH_TILES)

Every tile's result is checked against cuBLAS's (relative error < 1e-2) before it is timed. The table gives per
(model, shape, rows) cuBLAS, the default tile, the best tile; per (model, rows) the step's linear layers each way; and
the SMALL_BATCH_TILES rows (the shapes whose best tile at 8 rows beats cuBLAS by more than 2% from 2 rows up to some
count >= 8: the dense Linear routes only those shapes, up to that count, here).

--step MODEL:BATCH:CONTEXT (dummy weights of benchmarks/configs/MODEL.json, bf16, CUDA graphs): then the decode step of
that batch at that prompt length, built and timed twice in this process, once with MEASURED_TILES as committed and once
with these rows in it, and the ratio: what pasting them would change end to end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from sweep_rows import append_row, read_rows, time_or_nan  # benchmarks/gpu, this script's folder


def model_shapes(name: str) -> tuple[int, dict]:
    """-> (layers, {shape: (weight rows, K, fused activation)}) of benchmarks/configs/<name>.json."""
    cfg = json.load(open(f"benchmarks/configs/{name}.json"))
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    act = "gelu" if "gelu" in (cfg.get("hidden_activation") or cfg.get("hidden_act", "")) else "silu"
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * d
    return cfg["num_hidden_layers"], {"qkv": (qkv, h, ""), "o": (h, cfg["num_attention_heads"] * d, ""),
                                      "gate_up": (2 * inter, h, act), "down": (h, inter, "")}


def sweep(args) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from braid.runtime.layers.activation import GeluAndMul, SiluAndMul
    from braid.runtime.layers.small_batch_gemm import CANDIDATE_TILES, small_batch_gemm
    from decode_b1 import graph_time_us  # benchmarks/gpu, this script's folder

    started = time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = []

    def record(row):
        out.append(row)
        append_row(args.out, row)

    plan = [(model, *model_shapes(model)) for model in args.models]
    cells = sum(len(shapes) for _, _, shapes in plan) * len(args.rows)
    cell = 0
    for model, layers, shapes in plan:
        for name, (rows, k, act) in shapes.items():
            weights = [torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k ** -0.5
                       for _ in range(layers)]
            unfused_act = {"silu": SiluAndMul(), "gelu": GeluAndMul("tanh"), "": None}[act]
            for m in args.rows:
                cell += 1
                deadline = started + args.budget_s * cell / cells
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
                base = {"card": torch.cuda.get_device_name(), "model": model, "shape": name, "rows": rows, "k": k, "act": act, "m": m, "layers": layers}

                def cublas(w):
                    y = F.linear(x, w)
                    return y if unfused_act is None else unfused_act(y)

                us = time_or_nan(graph_time_us, lambda: [cublas(w) for w in weights]) / layers
                record({**base, "kernel": "cuBLAS", "tile": "-", "us": us, "tb_s": rows * k * 2 / us / 1e6})
                want = cublas(weights[0]).float()
                for tile in CANDIDATE_TILES:
                    if time.time() > deadline:
                        print(f"sweep: time is up before {model} {name} m={m} {tile}", flush=True)
                        break
                    row = {**base, "kernel": "tc", "tile": repr(tile), "tile_args": dataclasses.astuple(tile)}
                    try:
                        got = small_batch_gemm(x, weights[0], activation=act, tile=tile).float()
                        err = ((got - want).norm() / want.norm()).item()
                        if not err < 1e-2:
                            record({**row, "error": f"relative error {err:.3g} against cuBLAS"})
                            continue
                        row["us"] = time_or_nan(graph_time_us, lambda t=tile: [
                            small_batch_gemm(x, w, activation=act, tile=t) for w in weights]) / layers
                        row["tb_s"] = rows * k * 2 / row["us"] / 1e6
                    except Exception as e:  # noqa: BLE001 - a tile that does not fit is a row too
                        row["error"] = repr(e)[:200]
                    record(row)
            weights.clear()
            torch.cuda.empty_cache()
    return out


def winning_tiles(rows: list[dict]) -> dict:
    """{(weight rows, K, act): (TcTile, up to rows)} of the shapes whose best tile at 8 rows beats cuBLAS by more than
    2% at 8 rows and at every smaller measured row count; `up to rows`: the largest measured count up to which it
    does (cuBLAS keeps the larger batches)."""
    from braid.runtime.layers.small_batch_gemm import TcTile

    ok = [r for r in rows if "us" in r and r["us"] == r["us"]]
    found = {}
    for key in dict.fromkeys((r["rows"], r["k"], r["act"]) for r in ok if r["m"] == 8):
        mine = [r for r in ok if (r["rows"], r["k"], r["act"]) == key]
        best_at_8 = min((r for r in mine if r["kernel"] == "tc" and r["m"] == 8), key=lambda r: r["us"], default=None)
        if best_at_8 is None:
            continue
        up_to = 0
        for m in sorted({r["m"] for r in mine}):
            cublas = next((r for r in mine if r["kernel"] == "cuBLAS" and r["m"] == m), None)
            tc = next((r for r in mine if r["tile"] == best_at_8["tile"] and r["m"] == m), None)
            if not (cublas and tc and tc["us"] < 0.98 * cublas["us"]):
                break
            up_to = m
        if up_to >= 8:
            found[key] = (TcTile(*best_at_8["tile_args"]), up_to)
    return found


def step_with_and_without(spec: str, winners: dict) -> None:
    """MODEL:BATCH:CONTEXT -> the decode step timed with MEASURED_TILES as committed, then with `winners` added for
    this GPU (decode_step_ab.py: both builds in this process)."""
    import torch

    from braid.runtime.layers import small_batch_gemm as module
    from decode_step_ab import run_ab  # benchmarks/gpu, this script's folder

    model, bs, context = spec.split(":")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    table = {**module.MEASURED_TILES, gpu: {**module.MEASURED_TILES.get(gpu, {}), **winners}}
    print(f"{model}: {len(winners)} shapes routed to the kernel in the changed build", flush=True)
    run_ab(model, [int(bs)], int(context), [(module.__name__, "MEASURED_TILES", table)])


def tile_keywords(tile) -> str:
    """A TcTile as the keywords runtime/layers/measured_tiles.py holds for it: dict(block_n=64, ...)."""
    return "dict(" + ", ".join(f"{name}={value!r}" for name, value in dataclasses.asdict(tile).items()) + ")"


def write_table(winners: dict, card: str) -> None:
    """Rewrite SMALL_BATCH_TILES in runtime/layers/measured_tiles.py with `winners` as `card`'s entry (the other GPUs'
    entries kept), and small_batch_gemm.MEASURED_TILES with it, so that what runs next in this checkout routes them."""
    import ast

    from braid.runtime.layers import measured_tiles
    from braid.runtime.layers import small_batch_gemm as module

    path = measured_tiles.__file__
    source = open(path).read()
    node = next(n for n in ast.parse(source).body
                if isinstance(n, (ast.Assign, ast.AnnAssign))
                and "SMALL_BATCH_TILES" in [getattr(t, "id", "") for t in (n.targets if isinstance(n, ast.Assign)
                                                                            else [n.target])])
    tables = {**module.MEASURED_TILES, card: winners}
    body = "".join(f"    {json.dumps(gpu)}: {{\n"
                   + "".join(f"        ({n}, {k}, {json.dumps(act)}): ({tile_keywords(tile)}, {up_to}),\n"
                             for (n, k, act), (tile, up_to) in sorted(entries.items())) + "    },\n"
                   for gpu, entries in tables.items() if entries)
    lines = source.splitlines(keepends=True)
    lines[node.lineno - 1:node.end_lineno] = [f"SMALL_BATCH_TILES = {{\n{body}}}\n" if body
                                              else "SMALL_BATCH_TILES: dict = {}\n"]
    open(path, "w").write("".join(lines))
    module.MEASURED_TILES = tables
    print(f"wrote {len(winners)} SMALL_BATCH_TILES entries for {card!r} into {path}", flush=True)


def table(rows: list[dict]) -> int:
    from braid.runtime.layers.small_batch_gemm import DEFAULT_TILE

    ok = [r for r in rows if r.get("us") == r.get("us") and "us" in r]
    if not ok:
        print("FAIL: no timing")
        return 1
    bad = [r for r in rows if "relative error" in r.get("error", "")]
    print(f"{'PASS' if not bad else 'FAIL'} results: {len(bad)} tiles off cuBLAS's result by 1e-2 or more")
    print(f"\n{'model':>10} {'shape':>8} {'m':>3} {'cuBLAS':>16} {'default tile':>16} {'best tile':>16}  best tile"
          "   (TB/s of weight bytes, us per layer)")
    best = {}
    for model in dict.fromkeys(r["model"] for r in ok):
        for shape in dict.fromkeys(r["shape"] for r in ok if r["model"] == model):
            for m in sorted({r["m"] for r in ok if r["model"] == model and r["shape"] == shape}):
                mine = [r for r in ok if (r["model"], r["shape"], r["m"]) == (model, shape, m)]
                cublas = next((r for r in mine if r["kernel"] == "cuBLAS"), None)
                default = next((r for r in mine if r["tile"] == repr(DEFAULT_TILE)), None)
                tc = min((r for r in mine if r["kernel"] == "tc"), key=lambda r: r["us"], default=None)
                best[(model, shape, m)] = (cublas, default, tc)
                cells = [f"{r['tb_s']:6.2f} ({r['us']:6.1f})" if r else f"{'-':>16}" for r in (cublas, default, tc)]
                print(f"{model:>10} {shape:>8} {m:>3} " + " ".join(f"{c:>16}" for c in cells)
                      + f"  {tc['tile'] if tc else '-'}")
    for model in dict.fromkeys(r["model"] for r in ok):
        layers = next(r["layers"] for r in ok if r["model"] == model)
        for m in sorted({r["m"] for r in ok if r["model"] == model}):
            sums = []
            for which in range(3):
                per = [best[key][which]["us"] if best[key][which] else float("nan")
                       for key in best if key[0] == model and key[2] == m]
                sums.append(layers * sum(per))
            print(f"{model} m={m:>2}: the step's linear layers ({layers} x qkv, o, gate_up, down): cuBLAS "
                  f"{sums[0]:.0f} us, default tile {sums[1]:.0f} us ({sums[0] / sums[1]:.2f}x), best tiles {sums[2]:.0f} us "
                  f"({sums[0] / sums[2]:.2f}x)")
    print("\nrows for runtime/layers/measured_tiles.py's SMALL_BATCH_TILES (the best tile at 8 rows where it beats "
          "cuBLAS by more than 2% from 2 rows up to the last count given):")
    print(f"    {ok[0].get('card', '?')!r}: {{")
    for (rows_, k, act), (tile, up_to) in winning_tiles(rows).items():
        print(f"        ({rows_}, {k}, {act!r}): ({tile_keywords(tile)}, {up_to}),")
    print("    },")
    return 1 if bad else 0


def main() -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["gemma2-9b", "llama3-8b"])
    p.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--budget-s", type=float, default=150)
    p.add_argument("--out", default=None)
    p.add_argument("--table", default=None)
    p.add_argument("--step", nargs="*", default=[], metavar="MODEL:BATCH:CONTEXT")
    p.add_argument("--write-table", action="store_true",
                   help="then write the winning rows into runtime/layers/measured_tiles.py's SMALL_BATCH_TILES")
    args = p.parse_args()
    if args.table:
        return table(read_rows(args.table))
    rows = sweep(args)
    status = table(rows)
    winners = winning_tiles(rows)
    for spec in args.step:
        step_with_and_without(spec, winners)
    if args.write_table and rows:
        write_table(winners, rows[0]["card"])
    return status


if __name__ == "__main__":
    sys.exit(main())
