"""Peak memory of a command and every process it starts (the test suite starts servers and engines in
subprocesses): the sum of the resident set sizes of the whole process tree, sampled every --interval-s seconds.

    python benchmarks/peak_rss.py -- python -m pytest tests -q

Prints the command's own output, then its exit status, wall time, the peak summed RSS and the peak summed PSS
(proportional set size: a page shared by k processes counts 1/k in each, so the sum is the memory the tree really
holds; RSS counts the shared torch libraries once per process) with the time each was reached, and the largest
processes at the PSS peak; exits with the command's status.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        tree.setdefault(int(fields[1]), []).append(int(entry))  # fields[1]: the parent's pid
    return tree


def _tree_pids(root: int) -> list[int]:
    tree, out, stack = _children(), [], [root]
    while stack:
        pid = stack.pop()
        out.append(pid)
        stack.extend(tree.get(pid, ()))
    return out


def _rss_pss_bytes(pid: int) -> tuple[int, int]:
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss, pss


def _cmdline(pid: int, width: int = 110) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:width]
    except OSError:
        return "?"


def tree_memory(root: int) -> tuple[int, int, list[tuple[int, int]]]:
    """(summed RSS, summed PSS, [(PSS, pid)] of every process in the tree)."""
    rss_total = pss_total = 0
    per_process = []
    for pid in _tree_pids(root):
        rss, pss = _rss_pss_bytes(pid)
        rss_total += rss
        pss_total += pss
        per_process.append((pss, pid))
    return rss_total, pss_total, per_process


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval-s", type=float, default=0.5)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    start = time.monotonic()
    proc = subprocess.Popen(command)
    peak_rss = peak_pss = 0
    rss_at = pss_at = 0.0
    top: list[str] = []
    while proc.poll() is None:
        rss, pss, per_process = tree_memory(proc.pid)
        now = time.monotonic() - start
        if rss > peak_rss:
            peak_rss, rss_at = rss, now
        if pss > peak_pss:
            peak_pss, pss_at = pss, now
            top = [f"  {p / 2**30:6.2f} GiB  {pid:>7}  {_cmdline(pid)}" for p, pid in sorted(per_process)[-6:][::-1]]
        time.sleep(args.interval_s)
    wall = time.monotonic() - start
    print(f"peak_rss: exit {proc.returncode}, wall {wall:.0f} s, peak summed RSS of the process tree "
          f"{peak_rss / 2**30:.2f} GiB at {rss_at:.0f} s, peak summed PSS {peak_pss / 2**30:.2f} GiB at {pss_at:.0f} s; "
          f"the largest processes then (PSS):", flush=True)
    print("\n".join(top), flush=True)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
