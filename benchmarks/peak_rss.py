"""Peak memory of a command and every process it starts (the test suite starts servers and engines in
subprocesses): the sum of the resident set sizes of the whole process tree, sampled every --interval-s seconds.

    python benchmarks/peak_rss.py -- python -m pytest tests -q

Prints the command's own output, then its exit status, wall time and the peak summed RSS with the time it was
reached; exits with the command's status.
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


def tree_rss_bytes(root: int) -> int:
    tree, total, stack = _children(), 0, [root]
    page = os.sysconf("SC_PAGE_SIZE")
    while stack:
        pid = stack.pop()
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * page
        except OSError:
            pass
        stack.extend(tree.get(pid, ()))
    return total


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
    peak, peak_at = 0, 0.0
    while proc.poll() is None:
        rss = tree_rss_bytes(proc.pid)
        if rss > peak:
            peak, peak_at = rss, time.monotonic() - start
        time.sleep(args.interval_s)
    wall = time.monotonic() - start
    print(f"peak_rss: exit {proc.returncode}, wall {wall:.0f} s, peak summed RSS of the process tree "
          f"{peak / 2**30:.2f} GiB at {peak_at:.0f} s", flush=True)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
