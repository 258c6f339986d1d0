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
