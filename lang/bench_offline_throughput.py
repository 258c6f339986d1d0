"""`python -m braid.bench_offline_throughput`: Engine-level throughput (see braid.runtime.bench.bench_offline_throughput)."""

from braid.runtime.bench.bench_offline_throughput import main

if __name__ == "__main__":
    main()
