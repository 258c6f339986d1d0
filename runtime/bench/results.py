"""Benchmark results on disk: one JSON object per line, appended, so runs of one benchmark collect in one file."""

from __future__ import annotations

import json


def append_jsonl(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record, default=str) + "\n")
