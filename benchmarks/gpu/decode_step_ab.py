"""A dummy model's decode step built and timed twice in one process: with the runtime's constants as committed, then
with some of them set (the A/B that decides a measured constant or table before it is committed). Each build
captures its own CUDA graphs, so a constant read at capture time (a kernel route, a split rule) takes effect.

  python3 benchmarks/gpu/decode_step_ab.py --model gemma2-9b --batch-sizes 1 8 --context 8000 \
      --server-arg disable_decode_gemv=True

--set MODULE:NAME=VALUE (a Python literal, or an expression over MODULE's names such as
`{"NVIDIA H200": {(3584, 4096, ""): (TcTile(64, 128), 8)}}`; repeatable: all in one build, one build each with
--separately, or builds of the groups that --next separates) and --server-arg NAME=VALUE (a ServerArgs field for the
changed build, e.g. disable_decode_gemv=True). Prints
per batch size the step as committed and as changed (ms, tok/s, and for non-MLA models the share of the weights + KV
ceiling at 4.28 TB/s, as gemma2_8k_decode.py counts it), and their ratio.
"""

from __future__ import annotations

import argparse
import ast
import gc
import importlib
import os
import sys
from typing import Optional

import torch

from sweep_rows import H200_COPY_BYTES_PER_S as BANDWIDTH  # benchmarks/gpu, this script's folder


def parse_setting(text: str) -> tuple[str, str, object]:
    """'package.module:NAME=literal' -> (module, name, value); a value that is no literal stays its text, evaluated in
    the module's namespace when the setting is applied (module_value)."""
    target, _, literal = text.partition("=")
    module, _, name = target.partition(":")
    if not (module and name and literal):
        raise ValueError(f"--set takes MODULE:NAME=VALUE, got {text!r}")
    try:
        return module, name, ast.literal_eval(literal)
    except (ValueError, SyntaxError):
        return module, name, _Expression(literal)


class _Expression(str):
    """A --set value to evaluate over its module's names."""


def module_value(module, value):
    return eval(value, vars(module)) if isinstance(value, _Expression) else value


def parse_server_arg(text: str) -> tuple[str, object]:
    """'field=literal' -> (ServerArgs field, value)."""
    name, _, literal = text.partition("=")
    if not (name and literal):
        raise ValueError(f"--server-arg takes NAME=VALUE, got {text!r}")
    return name, ast.literal_eval(literal)


def timed_steps(model: str, batch_sizes: list[int], context: int, steps: int, backend: Optional[str] = None,
                server_args: Optional[dict] = None) -> dict:
    """{batch size: (decode step s, ceiling fraction or None)} of benchmarks/configs/<model>.json, dummy bf16."""
    from braid.runtime.bench.bench_one_batch import StaticBatchRunner, latency_test
    from braid.runtime.config import ServerArgs
    from braid.runtime.model_executor.model_runner import ModelRunner
    from gemma2_8k_decode import step_bytes  # benchmarks/gpu, this script's folder

    runner = ModelRunner(ServerArgs(
        model_path=f"{model}-dummy", load_format="dummy", model_config=f"benchmarks/configs/{model}.json",
        dtype="bfloat16", max_total_tokens=2 * max(batch_sizes) * (context + steps + 8) + 1024,
        max_running_requests=max(16, max(batch_sizes)), cuda_graph_max_bs=max(batch_sizes), log_level="warning",
        **({"attention_backend": backend} if backend else {}), **(server_args or {})))
    try:
        runner_batch = StaticBatchRunner(runner)
        mla = getattr(runner.model_config, "attention_arch", None) == "mla"
        out = {}
        for bs in batch_sizes:
            runner_batch.run([[5] * 32] * bs, 4)  # warm-up
            result, _ = latency_test(runner_batch, bs, context, steps + 1)
            step = result["median_decode_latency_s"]
            fraction = None
            if not mla:
                b = step_bytes(runner, bs, context + steps // 2)
                fraction = (b["weight_bytes"] + b["kv_bytes"]) / BANDWIDTH / step
            out[bs] = (step, fraction)
        return out
    finally:
        runner = runner_batch = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_ab(model: str, batch_sizes: list[int], context: int, settings: list[tuple], steps: int = 48,
           separately: bool = False, backend: Optional[str] = None, common: Optional[dict] = None) -> dict:
    """Times the steps as committed, then with `settings` applied (all together, each on its own with `separately`,
    or by group; restored after): (module, name, value) constants and ("ServerArgs", field, value) fields, each
    optionally after its group number as (group, module, name, value); prints each build against the committed one
    and the ratio. common: ServerArgs fields of every build, the committed one included."""
    common = common or {}
    committed = timed_steps(model, batch_sizes, context, steps, backend, dict(common))
    results = {"committed": committed}
    groups: dict = {}
    for s in settings:
        groups.setdefault(s[0] if len(s) == 4 else 0, []).append(s[-3:])
    for variant in ([[s[-3:]] for s in settings] if separately else list(groups.values())):
        fields = {name: value for module_name, name, value in variant if module_name == "ServerArgs"}
        variant = [s for s in variant if s[0] != "ServerArgs"]
        saved = []
        try:
            for module_name, name, value in variant:
                module = importlib.import_module(module_name)
                if not hasattr(module, name):
                    raise AttributeError(f"{module_name} has no {name}")
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, module_value(module, value))
            changed = timed_steps(model, batch_sizes, context, steps, backend, {**common, **fields})
        finally:
            for module, name, value in reversed(saved):
                setattr(module, name, value)
        what = ", ".join(f"{name}={str(value)[:70]}" for _, name, value in variant + [("", *f) for f in fields.items()])
        results[what] = changed
        for bs in batch_sizes:
            (before, f_before), (after, f_after) = committed[bs], changed[bs]
            share = (lambda f: f", {100 * f:.1f}% of the ceiling" if f is not None else "")
            print(f"{model} batch {bs}, {context} in: decode step committed {before * 1e3:.3f} ms ({bs / before:.1f} "
                  f"tok/s{share(f_before)}), with {what} changed {after * 1e3:.3f} ms ({bs / after:.1f} tok/s"
                  f"{share(f_after)}): {before / after:.3f}x", flush=True)
    return results


class _InGroup(argparse.Action):
    """Appends (group, module, name, value) for a --set or a --server-arg (module "ServerArgs")."""

    def __call__(self, parser, namespace, value, option_string=None):
        setting = value if len(value) == 3 else ("ServerArgs", *value)
        namespace.settings = namespace.settings + [(namespace.group, *setting)]


class _NextGroup(argparse.Action):
    def __call__(self, parser, namespace, value, option_string=None):
        namespace.group += 1


def main() -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma2-9b", help="benchmarks/configs/<model>.json")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, default=8000)
    p.add_argument("--decode-steps", type=int, default=48)
    p.add_argument("--set", dest="settings", action=_InGroup, default=[], type=parse_setting,
                   metavar="MODULE:NAME=VALUE")
    p.add_argument("--server-arg", dest="settings", action=_InGroup, type=parse_server_arg,
                   metavar="NAME=VALUE", help="a ServerArgs field set in the changed build")
    p.add_argument("--common-server-arg", dest="common", action="append", default=[], type=parse_server_arg,
                   metavar="NAME=VALUE", help="a ServerArgs field of every build (e.g. kv_cache_dtype='fp8_e4m3')")
    p.add_argument("--next", dest="group", action=_NextGroup, nargs=0, default=0,
                   help="the settings after it make the next build")
    p.add_argument("--separately", action="store_true",
                   help="one build per --set / --server-arg instead of one with all of them")
    p.add_argument("--attention-backend", default=None, choices=["triton", "flashinfer"],
                   help="the runtime's default (Triton on a GPU) unless given")
    args = p.parse_args()
    settings = args.settings
    if not settings:
        p.error("nothing to change: give --set MODULE:NAME=VALUE or --server-arg NAME=VALUE")
    run_ab(args.model, args.batch_sizes, args.context, settings, args.decode_steps, args.separately,
           args.attention_backend, dict(args.common))
    return 0


if __name__ == "__main__":
    sys.exit(main())
