"""`python -m braid.bench_one_batch --model-path ... --batch-size 1 8 32`: static-batch latency (see braid.runtime.bench.bench_one_batch)."""

import sys

from braid.runtime.bench.bench_one_batch import main, parse_args, run_benchmark

__all__ = ["main", "parse_args", "run_benchmark"]

if __name__ == "__main__":
    sys.exit(main())
