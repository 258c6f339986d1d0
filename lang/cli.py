"""The `braid` console script: `braid serve ...`, `braid trace ...` and
`braid bench serving|one-batch|offline|constrained|grammar ...`."""

from __future__ import annotations

import sys
from typing import Optional, Sequence

_USAGE = """usage: braid serve [MODEL] [server args]    (same flags as python -m braid.launch_server)
       braid bench serving [args]          (python -m braid.bench_serving)
       braid bench one-batch [args]        (python -m braid.bench_one_batch)
       braid bench offline [args]          (python -m braid.bench_offline_throughput)
       braid bench constrained [args]      (constrained-decoding overhead)
       braid bench grammar [args]          (python -m braid.bench_grammar)
       braid trace TRACE.json -o PAGE.html (draw a saved run trace as one self-contained web page)
       braid trace SCRIPT.py [script args] -o PAGE.html [--json TRACE.json]
                                           (run a Python script with every program run traced, then draw them)"""


def _bench(name: str, argv: list[str]) -> int:
    if name == "serving":
        from braid.runtime.bench.bench_serving import main
    elif name == "one-batch":
        from braid.runtime.bench.bench_one_batch import main
    elif name == "offline":
        from braid.runtime.bench.bench_offline_throughput import main
    elif name == "constrained":
        from braid.runtime.bench.bench_constrained import main
    elif name == "grammar":
        from braid.runtime.bench.bench_grammar import main
    else:
        print(f"braid bench: unknown benchmark '{name}'\n{_USAGE}", file=sys.stderr)
        return 2
    result = main(argv)
    return result if isinstance(result, int) else 0


def _trace(argv: list[str]) -> int:
    import runpy

    from braid.errors import ProgramError
    from braid.global_config import global_config
    from braid.run_trace import RunTrace, collected_trace

    out, json_out, rest = None, None, []
    it = iter(argv)
    for arg in it:
        if arg in ("-o", "--output", "--json"):
            value = next(it, None)
            if value is None:
                print(f"braid trace: {arg} needs a path\n{_USAGE}", file=sys.stderr)
                return 2
            if arg == "--json":
                json_out = value
            else:
                out = value
        else:
            rest.append(arg)
    if not rest or out is None:
        print(f"braid trace: give a trace (.json) or a script (.py), and -o PAGE.html\n{_USAGE}", file=sys.stderr)
        return 2
    source = rest[0]
    try:
        if source.endswith(".py"):
            global_config.trace = True
            saved_argv = sys.argv
            sys.argv = [source, *rest[1:]]
            try:
                runpy.run_path(source, run_name="__main__")
            finally:
                sys.argv = saved_argv
            trace = collected_trace(clear=True)
        elif len(rest) == 1:
            trace = RunTrace.load(source)
        else:
            print(f"braid trace: a .json trace takes no further arguments\n{_USAGE}", file=sys.stderr)
            return 2
    except (OSError, ProgramError) as e:
        print(f"braid trace: {e}", file=sys.stderr)
        return 1
    if json_out is not None:
        trace.save(json_out)
    trace.save_html(out)
    s = trace["summary"]
    print(f"braid trace: {s['calls']} calls, {s['wall_s']:.2f} s -> {out}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "serve":
        from braid.runtime.launch import main as serve

        return serve(rest, prog="braid serve") or 0
    if command == "trace":
        return _trace(rest)
    if command == "bench" and rest:
        return _bench(rest[0], rest[1:])
    print(f"braid: unknown command '{' '.join(args[:2])}'\n{_USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
