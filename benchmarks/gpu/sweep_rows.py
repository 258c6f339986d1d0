"""What the GPU sweep scripts here share: result rows as JSON lines (printed, and appended to a file when one is
given), read back for their tables, and timings that survive a failing kernel."""

from __future__ import annotations

import json
import os
from typing import Callable, Optional


def append_row(path: Optional[str], row: dict) -> None:
    print(json.dumps(row), flush=True)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def read_rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def time_or_nan(time_us: Callable, fn) -> float:
    """time_us(fn), or NaN (with the error printed) when the kernel fails, so one failure leaves the rest measured."""
    try:
        return time_us(fn)
    except Exception as e:  # noqa: BLE001 - reported, the run goes on
        print(f"FAIL timing: {e!r}"[:300], flush=True)
        return float("nan")


def config_keywords(config_repr: str) -> str:
    """An Fp8GemvConfig's repr as the keywords runtime/layers/measured_tiles.py holds for it:
    "Fp8GemvConfig(variant='f16', block_n=4, ...)" -> "dict(variant='f16', block_n=4, ...)"."""
    return config_repr.replace("Fp8GemvConfig(", "dict(", 1)


H200_COPY_BYTES_PER_S = 4.28e12  # the H200's device-to-device copy rate (KINDS.md; docs/benchmarks.md)


def copy_bandwidth(gib: float = 2.0, repeats: int = 10) -> float:
    """Bytes/s of a device-to-device copy on this process's GPU, counting bytes read and written: the measure the
    H200's 4.28 TB/s ceiling was taken with, so that a run on another card states its fraction of that card's own."""
    import torch

    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * gib * 2**30 / sorted(times)[len(times) // 2]
