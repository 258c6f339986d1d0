"""`python -m braid.bench_soak`: soak test with faults against a real server (see braid.runtime.bench.bench_soak)."""

import sys

from braid.runtime.bench.bench_soak import main, parse_args

__all__ = ["main", "parse_args"]

if __name__ == "__main__":
    sys.exit(main())
