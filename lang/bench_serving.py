"""`python -m braid.bench_serving --backend braid --port ...`: online serving benchmark (see braid.runtime.bench.bench_serving)."""

import sys

from braid.runtime.bench.bench_serving import main, parse_args, run_benchmark

__all__ = ["main", "parse_args", "run_benchmark"]

if __name__ == "__main__":
    sys.exit(main())
