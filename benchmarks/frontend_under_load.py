"""The HTTP server process as the bottleneck (issue 14, server side): a real server on a one-layer dummy Llama (so
the scheduler's steps are cheap), 512 requests decoding at once, every one streaming, and
`python -m braid.bench_serving` sending synthetic ShareGPT prompts all at once. Reports output tok/s and the CPU
seconds of the HTTP server process and of its scheduler per second of the run; with --py-spy-s, samples the HTTP
server process with py-spy and prints where its time goes (inclusive and self shares of the top functions).

    flock /tmp/braid-heavy.lock python benchmarks/frontend_under_load.py --backend braid openai [--tree REF ...]

--tree: `.` (this checkout, the default), a folder holding a checkout's files, or a git ref, whose files are extracted under /tmp/braid-trees and imported
instead of the installed braid (the bench_serving client is always this checkout's, so only the servers differ).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_step_overhead import TINY_LLAMA  # noqa: E402
from serving_host_proxy import _free_port, _server_info, _start_server, _stop  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLK_TCK = os.sysconf("SC_CLK_TCK")
TOKENIZER_DIR = "/tmp/braid-frontend-tokenizer"


def build_tokenizer() -> str:
    """A byte-level BPE of TINY_LLAMA's 512 ids (eos 2) trained on bench_serving's word list, so prompts tokenize
    into the model's vocabulary and every output id decodes to text. (SmolLM2's 49k vocabulary would make the lm_head
    and the sampler, not the front end, the cost of a step.)"""
    import string

    import numpy as np
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from braid.runtime.bench.datasets import _WORDS

    rng = np.random.default_rng(0)
    weights = 1.0 / (np.arange(len(_WORDS)) + 2.7)

    def sentences(n: int):
        yield string.printable.strip()
        for _ in range(n):
            words = [_WORDS[i] for i in rng.choice(len(_WORDS), size=12, p=weights / weights.sum())]
            yield " ".join([words[0].capitalize(), *words[1:]]) + rng.choice([".", ",", "?"])

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_LLAMA["vocab_size"], special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    tok.train_from_iterator(sentences(5000), trainer)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", bos_token="<s>",
                                         unk_token="<unk>").save_pretrained(TOKENIZER_DIR)
    (Path(TOKENIZER_DIR) / "tiny_llama.json").write_text(json.dumps(TINY_LLAMA))
    return TOKENIZER_DIR


def import_dir(tree: str) -> str:
    """A folder from which `import braid` loads TREE (pyproject's package-dir mapping, as links)."""
    if tree == ".":
        src = REPO
    elif os.path.isdir(tree):
        src = os.path.abspath(tree)
    else:
        src = os.path.join("/tmp/braid-trees", tree.replace("/", "_"))
        if not os.path.isdir(src):
            os.makedirs(src)
            archive = subprocess.run(["git", "-C", REPO, "archive", tree], check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", src], input=archive, check=True)
    pkg = os.path.join("/tmp/braid-import", "worktree" if tree == "." else src.replace("/", "_"))
    subprocess.run(["rm", "-rf", pkg], check=True)
    os.makedirs(os.path.join(pkg, "braid"))
    for entry in os.listdir(os.path.join(src, "lang")):
        os.symlink(os.path.join(src, "lang", entry), os.path.join(pkg, "braid", entry))
    os.symlink(os.path.join(src, "runtime"), os.path.join(pkg, "braid", "runtime"))
    os.symlink(os.path.join(src, "backends"), os.path.join(pkg, "braid", "backends"))
    return pkg


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def start_server(tree: str, port: int, log_path: str) -> subprocess.Popen:
    os.environ["PYTHONPATH"] = import_dir(tree)  # the server's environment (bench_serving's is set apart)
    try:
        return _start_server(port, Path(TOKENIZER_DIR) / "tiny_llama.json", Path(TOKENIZER_DIR), 512, 600_000, [],
                             Path(log_path))
    finally:
        del os.environ["PYTHONPATH"]


def profile_table(raw_path: str, top: int) -> list[str]:
    incl, self_, total = collections.Counter(), collections.Counter(), 0
    with open(raw_path) as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            if not stack:
                continue
            frames = [fr.split(" (")[0] + " " + fr.rsplit("/", 1)[-1].rstrip(")") for fr in stack.split(";")]
            total += int(n)
            for fr in set(frames):
                incl[fr] += int(n)
            self_[frames[-1]] += int(n)
    lines = [f"{total} samples; inclusive% self%"]
    for fr, n in incl.most_common(top):
        lines.append(f"{100 * n / total:6.1f} {100 * self_[fr] / total:6.1f}  {fr[:130]}")
    lines.append("-- top self")
    for fr, n in self_.most_common(top // 2):
        lines.append(f"{100 * incl[fr] / total:6.1f} {100 * n / total:6.1f}  {fr[:130]}")
    return lines


def run_one(tree: str, backend: str, args) -> dict:
    port = _free_port()
    log = tempfile.NamedTemporaryFile(prefix="frontend_under_load_", suffix=".log", delete=False)
    proc = start_server(tree, port, log.name)
    try:
        sched = children(proc.pid)
        cmd = [sys.executable, "-m", "braid.bench_serving", "--backend", backend, "--port", str(port),
               "--tokenizer", TOKENIZER_DIR, "--num-prompts", str(args.num_prompts), "--seed", "7", "--disable-tqdm",
               "--output-file", log.name + ".jsonl", *(args.dataset or ["--dataset-name", "sharegpt"])]
        server0, sched0 = cpu_seconds(proc.pid), sum(cpu_seconds(p) for p in sched)
        t0 = time.perf_counter()
        bench = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        spy = None
        if args.py_spy_s:
            time.sleep(args.py_spy_after_s)
            raw = f"{log.name}.{backend}.spy.txt"
            spy = subprocess.Popen(["py-spy", "record", "-r", "100", "-d", str(args.py_spy_s), "-f", "raw", "-o", raw,
                                    "-p", str(proc.pid if args.py_spy_process == "server" else sched[0]),
                                    "--nonblocking"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        bench_out, _ = bench.communicate(timeout=args.timeout_s)
        wall = time.perf_counter() - t0
        server_cpu = cpu_seconds(proc.pid) - server0
        sched_cpu = sum(cpu_seconds(p) for p in sched) - sched0
        if spy is not None:
            spy.wait()
        if not os.path.exists(log.name + ".jsonl"):
            raise RuntimeError(f"bench_serving wrote no result:\n{bench_out[-3000:]}")
        with open(log.name + ".jsonl") as f:
            res = json.loads(f.readlines()[-1])
        info = _server_info(port)
        row = {"tree": tree, "backend": backend, "completed": res["completed"], "failed": args.num_prompts - res["completed"],
               "duration_s": res["duration_s"], "output_tok_s": res["output_throughput"],
               "mean_tpot_ms": res["mean_tpot_ms"], "mean_ttft_ms": res["mean_ttft_ms"],
               "server_cpu_share": server_cpu / wall, "scheduler_cpu_share": sched_cpu / wall,
               "server_cpu_s_per_1k_tok": 1000 * server_cpu / max(res["total_output_tokens"], 1),
               "running_after": info.get("num_running_reqs"), "kv_used_after": info.get("kv_used_tokens")}
        if spy is not None:
            row["profile"] = profile_table(raw, args.top)
        if res["completed"] < args.num_prompts:
            row["bench_tail"] = bench_out[-2000:]
        return row
    finally:
        _stop(proc)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", nargs="+", default=["."])
    p.add_argument("--backend", nargs="+", default=["braid"], choices=["braid", "openai"])
    p.add_argument("--num-prompts", type=int, default=2000)
    p.add_argument("--dataset", nargs=argparse.REMAINDER, default=None,
                   help="bench_serving dataset flags, last on the line (default: --dataset-name sharegpt)")
    p.add_argument("--py-spy-s", type=int, default=0, help="seconds of py-spy on the HTTP server process (0: none)")
    p.add_argument("--py-spy-after-s", type=float, default=15.0, help="start py-spy this long into the run")
    p.add_argument("--py-spy-process", default="server", choices=["server", "scheduler"])
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--timeout-s", type=float, default=900.0)
    args = p.parse_args()
    build_tokenizer()
    rows = [run_one(tree, backend, args) for backend in args.backend for tree in args.tree]
    for row in rows:
        for line in row.pop("profile", []):
            print(line)
        print(json.dumps(row))
    print(f"{'tree':>12} {'backend':>7} {'done':>5} {'out tok/s':>9} {'TPOT ms':>8} {'server CPU':>10} "
          f"{'sched CPU':>9} {'srv s/1k tok':>12} {'KV after':>8}")
    for r in rows:
        print(f"{r['tree']:>12} {r['backend']:>7} {r['completed']:>5} {r['output_tok_s']:>9.0f} {r['mean_tpot_ms']:>8.1f} "
              f"{r['server_cpu_share']:>10.2f} {r['scheduler_cpu_share']:>9.2f} {r['server_cpu_s_per_1k_tok']:>12.3f} "
              f"{r['kv_used_after']!s:>8}")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
