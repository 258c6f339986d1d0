"""A CPU proxy for the host side of GPU serving (issue 14): a real server whose model costs almost nothing (a one-layer
dummy Llama, hidden 64, vocab 512, a byte-level tokenizer), so the scheduler process's own work per step is what
limits throughput, as it does beside an H200. For each --max-running-requests value: start the server, send
`bench_serving` ShareGPT lengths (all at once), sample the scheduler process with py-spy for a while mid-run, and print
the serving figures, the scheduler's steps per second in that window, and where the scheduler's samples went.

    flock /tmp/braid-heavy.lock python benchmarks/serving_host_proxy.py --max-running-requests 256 512
    ... --server-flags "--disable-overlap-schedule"       (extra launch_server flags for every server)

Run under the heavy-job lock: a server, 2000 streaming clients and py-spy fill both cores for about a minute each.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests" / "helpers"))
from byte_tokenizer import byte_tokenizer  # noqa: E402
from host_step_overhead import TINY_LLAMA  # noqa: E402

SAMPLE_HZ = 100
# where a scheduler sample is: the innermost of these functions on its stack decides
PHASES = [
    ("model forward", {"ModelRunner.forward"}),
    ("wait for the device", {"ForwardOutput.host_tensors", "ForwardOutput.host"}),
    ("encode/send outputs", {"SchedulerLoop.send_outputs", "SchedulerLoop.send", "output_from_req_output"}),
    ("receive/decode messages", {"SchedulerLoop._drain", "SchedulerLoop.handle"}),
    ("report (make_output)", {"OutputProcessor.make_output", "Scheduler.emit"}),
    ("finish + radix insert", {"Scheduler.finish"}),
    ("commit tokens + finish checks", {"Scheduler._commit", "OutputProcessor.commit", "FinishTable.candidates"}),
    ("sampling batch info", {"SamplingBatchInfo.build", "SamplingBatchInfo.filter", "OutputProcessor.vocab_mask"}),
    ("admission + prefix match", {"Scheduler._admit", "PrefillPlanner.plan"}),
    ("extend batch build", {"PrefillPlanner.build_batch", "Scheduler._run_extend"}),
    ("decode batch build + chain", {"DecodeRunner.forward", "DecodeRunner.chain", "DecodeRunner.can_overlap",
                                    "DecodeRunner.launch", "Scheduler._run_decode", "Scheduler._chain_decode"}),
    ("retraction", {"DecodeRunner.retract"}),
    ("release aborted / grammars", {"Scheduler._release_aborted", "Scheduler._poll_grammars"}),
    ("loop, stats log", {"ServingStatsLog.maybe_log", "SchedulerLoop.receive", "run_scheduler_loop", "Scheduler.step",
                         "Scheduler._step"}),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prepare(workdir: Path) -> tuple[Path, Path]:
    tok_dir = workdir / "tok"
    byte_tokenizer().save_pretrained(tok_dir)
    config = workdir / "tiny_llama.json"
    config.write_text(json.dumps(TINY_LLAMA))
    return config, tok_dir


def _start_server(port: int, config: Path, tok_dir: Path, max_running: int, max_total_tokens: int, extra: list[str],
                  log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "braid.launch_server", "--port", str(port), "--model-path", "tiny-llama-dummy",
           "--load-format", "dummy", "--model-config", str(config), "--tokenizer-path", str(tok_dir),
           "--max-total-tokens", str(max_total_tokens), "--max-running-requests", str(max_running),
           "--log-level", "warning", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited during start-up:\n{log_path.read_text()[-3000:]}")
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except requests.ConnectionError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit("server did not become healthy in 300 s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _server_info(port: int) -> dict:
    return requests.get(f"http://127.0.0.1:{port}/get_server_info", timeout=30).json()


def _scheduler_pid(server_pid: int) -> int:
    """The launcher's busiest child is the scheduler process."""
    out = subprocess.run(["ps", "-o", "pid=,pcpu=", "--ppid", str(server_pid), "--sort=-pcpu"], capture_output=True,
                         text=True).stdout.split()
    return int(out[0])


def summarize_profile(raw_path: Path) -> tuple[int, dict[str, float], list[tuple[str, float, float]]]:
    """(samples, share per phase, top functions as (name, inclusive share, self share)) of a py-spy raw file."""
    phases: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    self_: collections.Counter = collections.Counter()
    total = 0
    for line in raw_path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        n = int(n)
        total += n
        frames = [f.split(" (")[0] for f in stack.split(";")]
        for f in set(frames):
            incl[f] += n
        self_[frames[-1]] += n
        phase = "other"
        for f in reversed(frames):
            hit = next((p for p, keys in PHASES if f in keys), None)
            if hit is not None:
                phase = hit
                break
        if "run_scheduler_loop" not in frames:
            phase = "idle / start-up / other threads"
        phases[phase] += n
    shares = {p: n / total for p, n in phases.most_common()} if total else {}
    top = [(f, incl[f] / total, self_[f] / total) for f, _ in incl.most_common(30)] if total else []
    return total, shares, top


def run_one(max_running: int, args, config: Path, tok_dir: Path, workdir: Path) -> dict:
    port = _free_port()
    tag = f"mrr{max_running}"
    proc = _start_server(port, config, tok_dir, max_running, args.max_total_tokens, shlex.split(args.server_flags),
                         workdir / f"server_{tag}.log")
    try:
        out_file = workdir / f"bench_{tag}.jsonl"
        bench = subprocess.Popen(
            [sys.executable, "-m", "braid.bench_serving", "--backend", "braid", "--port", str(port), "--tokenizer",
             str(tok_dir), "--num-prompts", str(args.num_prompts), "--seed", str(args.seed), "--disable-tqdm",
             "--output-file", str(out_file), *shlex.split(args.bench_flags)],
            stdout=open(workdir / f"bench_{tag}.log", "w"), stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        deadline = time.time() + 300  # the client builds its prompts first: wait for the load to arrive
        while _server_info(port).get("num_running_reqs", 0) == 0 and time.time() < deadline and bench.poll() is None:
            time.sleep(0.5)
        time.sleep(args.profile_after_s)
        before, t0 = _server_info(port), time.time()
        raw = workdir / f"scheduler_{tag}.txt"
        if args.profile_s > 0 and shutil.which("py-spy"):
            subprocess.run(["py-spy", "record", "-r", str(SAMPLE_HZ), "-d", str(args.profile_s), "-f", "raw", "-o", str(raw),
                            "-p", str(_scheduler_pid(proc.pid)), "--nonblocking"], capture_output=True)
        else:
            time.sleep(max(args.profile_s, 10))
        after, t1 = _server_info(port), time.time()
        bench.wait(args.timeout_s)
        end = _server_info(port)
    finally:
        _stop(proc)
    lines = out_file.read_text().splitlines() if out_file.exists() else []
    result = json.loads(lines[-1]) if lines else {}
    window = t1 - t0

    def delta(key):
        return after[key] - before[key] if key in after and key in before else None

    decode_steps, extend_steps = delta("num_forward_decode"), delta("num_forward_extend")
    steps = decode_steps + extend_steps
    tokens = delta("num_generated_tokens_total")
    row = {"max_running_requests": max_running, "completed": result.get("completed"),
           "output_throughput": result.get("output_throughput"), "mean_tpot_ms": result.get("mean_tpot_ms"),
           "window_s": window, "decode_steps": decode_steps, "extend_steps": extend_steps,
           "overlapped_steps": delta("num_decode_overlapped"), "steps_per_s": steps / window,
           "ms_per_step": 1e3 * window / max(steps, 1), "window_tokens_per_s": tokens / window,
           "mean_batch": tokens / max(decode_steps, 1), "end_running": end.get("num_running_reqs"),
           "end_kv_used": end.get("kv_used_tokens")}
    if delta("num_steps") is not None:  # the scheduler's own clocks (HostTiming), per forward pass
        host_s = delta("step_time_s_total") - delta("forward_time_s_total") - delta("device_wait_s_total")
        row.update(host_ms_per_step=1e3 * host_s / max(steps, 1),
                   forward_ms_per_step=1e3 * delta("forward_time_s_total") / max(steps, 1),
                   send_ms_per_step=1e3 * (delta("send_time_s_total") or 0.0) / max(steps, 1))
    if raw.exists():
        row["samples"], row["phases"], row["top"] = summarize_profile(raw)
        # the same from the samples (for trees without the clocks): the loop outside the model's forward pass, in
        # sampled seconds (SAMPLE_HZ a second) per pass, so that idle time in the window counts nowhere
        outside = sum(share for phase, share in row["phases"].items()
                      if phase not in ("model forward", "wait for the device", "idle / start-up / other threads"))
        row["profile_ms_per_pass"] = 1e3 * row["samples"] / SAMPLE_HZ / max(steps, 1)
        row["profile_host_ms_per_step"] = row["profile_ms_per_pass"] * outside
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-running-requests", type=int, nargs="+", default=[256, 512])
    p.add_argument("--num-prompts", type=int, default=2000)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--max-total-tokens", type=int, default=600_000)
    p.add_argument("--server-flags", default="", help="extra launch_server flags, one string")
    p.add_argument("--bench-flags", default="--dataset-name sharegpt", help="bench_serving's dataset flags, one string")
    p.add_argument("--profile-after-s", type=float, default=15.0, help="seconds into the run before sampling")
    p.add_argument("--profile-s", type=int, default=20, help="py-spy seconds (0: no profile, a 10 s window)")
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--keep-dir", default=None, help="write logs and profiles here instead of a temporary folder")
    p.add_argument("--json", action="store_true", help="print each row as one JSON line too")
    args = p.parse_args()
    workdir = Path(args.keep_dir or tempfile.mkdtemp(prefix="braid_proxy_"))
    workdir.mkdir(parents=True, exist_ok=True)
    config, tok_dir = _prepare(workdir)
    rows = [run_one(m, args, config, tok_dir, workdir) for m in args.max_running_requests]
    for row in rows:
        print(f"\n=== max_running_requests {row['max_running_requests']} {args.server_flags}: scheduler profile "
              f"({row.get('samples', 0)} samples)")
        for phase, share in row.get("phases", {}).items():
            print(f"  {100 * share:5.1f}%  {phase}")
        print("  top functions (inclusive / self):")
        for f, inc, slf in row.get("top", [])[:25]:
            print(f"  {100 * inc:5.1f}% {100 * slf:5.1f}%  {f[:100]}")
    print("\nper forward pass in the sampled window: ms/step = wall / passes; host = the scheduler's step outside the "
          "model's forward and device waits (its own clocks), send = building, encoding and sending the output batch; py-spy host = the same from the "
          "samples")
    print(f"{'max run':>8}{'done':>6}{'out tok/s':>11}{'TPOT ms':>9}{'decode':>8}{'extend':>8}{'ms/step':>9}"
          f"{'batch':>7}{'fwd ms':>8}{'host ms':>9}{'send ms':>9}{'py-spy host':>13}{'end run':>8}{'end kv':>8}")

    def f(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    for r in rows:
        print(f"{r['max_running_requests']:>8}{r['completed'] or 0:>6}{f(r['output_throughput'], '.1f'):>11}"
              f"{f(r['mean_tpot_ms'], '.2f'):>9}{r['decode_steps']:>8}{r['extend_steps']:>8}{r['ms_per_step']:>9.2f}"
              f"{r['mean_batch']:>7.1f}{f(r.get('forward_ms_per_step'), '.2f'):>8}"
              f"{f(r.get('host_ms_per_step'), '.3f'):>9}{f(r.get('send_ms_per_step'), '.3f'):>9}"
              f"{f(r.get('profile_host_ms_per_step'), '.3f'):>13}{r['end_running']!s:>8}{r['end_kv_used']!s:>8}")
        if args.json:
            print(json.dumps({k: v for k, v in r.items() if k != "top"}))
    print(f"(logs and profiles in {workdir})")


if __name__ == "__main__":
    main()
