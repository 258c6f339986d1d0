"""docs/benchmarks.md names every file in benchmarks/, and neither it nor docs/benchmark_history.md points at a
repository file that does not exist (paths in backticks or in markdown links)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS_MD = REPO / "docs" / "benchmarks.md"
HISTORY_MD = REPO / "docs" / "benchmark_history.md"

# Repository paths the docs may point at: a token starting with one of these folders.
PATH = re.compile(r"(?<![\w.$/<>-])((?:benchmarks|docs|runtime|tests|lang|backends|examples)/[\w./-]*)")
# Paths the history names although they were deleted on purpose (the text there says so).
DELETED = {
    "tests/kernels/test_small_batch_rotary_store.py",  # went with small_batch_rotary_store (H100 session 23)
}


def benchmark_files() -> list[str]:
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "benchmarks").rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and not p.name.startswith("."))


def referenced_paths(doc: Path) -> set[str]:
    """Repository paths in the doc's backtick spans and link targets (placeholders such as `<script>` skipped)."""
    text = doc.read_text()
    spans = re.findall(r"`([^`\n]+)`", text)
    paths = {m.group(1).rstrip(".,;:") for s in spans for m in PATH.finditer(s)}
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        target = target.split("#", 1)[0]
        if not target or "://" in target:
            continue
        resolved = (doc.parent / target).resolve()
        paths.add(str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else target)
    return paths


def test_every_benchmark_file_is_listed():
    text = BENCHMARKS_MD.read_text()
    missing = [f for f in benchmark_files() if f not in text]
    assert not missing, f"files under benchmarks/ not named in docs/benchmarks.md ('Scripts'): {missing}"


def test_docs_point_at_existing_files():
    missing = sorted(f"{doc.name}: {p}" for doc in (BENCHMARKS_MD, HISTORY_MD)
                     for p in referenced_paths(doc) if p not in DELETED and not (REPO / p).exists())
    assert not missing, f"paths in the benchmark docs that do not exist: {missing}"
