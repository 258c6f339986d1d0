"""`python -m braid.bench_grammar --corpus PATH`: grammar engines on real-world JSON schemas (see
braid.runtime.bench.bench_grammar)."""

from braid.runtime.bench.bench_grammar import main, parse_args, run_engine

__all__ = ["main", "parse_args", "run_engine"]

if __name__ == "__main__":
    main()
