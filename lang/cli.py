"""The `braid` console script: `braid serve ...` and `braid bench serving|one-batch|offline|constrained|grammar ...`."""

from __future__ import annotations

import sys
from typing import Optional, Sequence

_USAGE = """usage: braid serve [MODEL] [server args]    (same flags as python -m braid.launch_server)
       braid bench serving [args]          (python -m braid.bench_serving)
       braid bench one-batch [args]        (python -m braid.bench_one_batch)
       braid bench offline [args]          (python -m braid.bench_offline_throughput)
       braid bench constrained [args]      (constrained-decoding overhead)
       braid bench grammar [args]          (python -m braid.bench_grammar)"""


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


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "serve":
        from braid.runtime.launch import main as serve

        return serve(rest, prog="braid serve") or 0
    if command == "bench" and rest:
        return _bench(rest[0], rest[1:])
    print(f"braid: unknown command '{' '.join(args[:2])}'\n{_USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
