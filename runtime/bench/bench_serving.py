"""`python -m braid.bench_serving`: online serving benchmark against a running server.

Sends a dataset's prompts at a Poisson request rate (optionally capped by a concurrency limit) and measures
TTFT, TPOT, inter-token latency and end-to-end latency per request, plus request and token throughput.
Backends: braid/sglang use the native streaming `/generate`; openai/vllm use `/v1/completions` (the clients are in
serving_clients.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Optional, Sequence

import numpy as np

from braid.runtime.bench.datasets import BenchRequest, DatasetError, add_dataset_args, get_dataset
from braid.runtime.bench.results import append_jsonl
from braid.runtime.bench.serving_clients import NATIVE_BACKENDS, RequestFuncOutput, send_request

__all__ = ["RequestFuncOutput", "BenchmarkError", "build_parser", "parse_args", "run_benchmark", "main"]

BACKENDS = ("braid", "sglang", "openai", "vllm")
_TIMEOUT_S = 6 * 3600


class BenchmarkError(ValueError):
    """Bad benchmark arguments or an unreachable server."""


# ---------------------------------------------------------------------------------------------- driver
def _base_url(args) -> str:
    if args.base_url:
        return args.base_url.rstrip("/")
    return f"http://{args.host}:{args.port}"


def _api_url(args) -> str:
    return _base_url(args) + ("/generate" if args.backend in NATIVE_BACKENDS else "/v1/completions")


def _headers(args) -> dict:
    key = args.api_key
    if key is None and args.backend in ("openai", "vllm"):
        key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


async def _get_json(session, url: str):
    import aiohttp

    try:
        async with session.get(url) as resp:
            if resp.status != 200:
                raise BenchmarkError(f"GET {url} returned HTTP {resp.status}: {(await resp.text())[:300]}")
            return await resp.json()
    except aiohttp.ClientError as e:
        raise BenchmarkError(f"cannot reach the server at {url}: {e}") from None


async def _arrivals(n: int, rate: float, rng: np.random.Generator):
    """Yields 0..n-1, sleeping exponential gaps (a Poisson process of `rate` per second) between them."""
    for i in range(n):
        yield i
        if rate != float("inf") and i < n - 1:
            await asyncio.sleep(float(rng.exponential(1.0 / rate)))


async def _benchmark(args, requests: list[BenchRequest]) -> tuple[list[RequestFuncOutput], float]:
    import aiohttp
    from tqdm.asyncio import tqdm

    timeout = aiohttp.ClientTimeout(total=_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, headers=_headers(args),
                                     read_bufsize=1 << 20) as session:
        if args.backend not in NATIVE_BACKENDS and not args.model:
            models = await _get_json(session, _base_url(args) + "/v1/models")
            args.model = models["data"][0]["id"]
        api_url = _api_url(args)
        for i in range(args.warmup_requests):
            warm = BenchRequest(requests[0].prompt, requests[0].prompt_len, min(requests[0].output_len, 16))
            res = await send_request(session, args, api_url, warm, time.perf_counter())
            if not res.success:
                raise BenchmarkError(f"the warm-up request failed: {res.error}")
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = tqdm(total=len(requests), desc="requests", disable=args.disable_tqdm)

        async def one(req: BenchRequest) -> RequestFuncOutput:
            if sem is None:
                res = await send_request(session, args, api_url, req, t0)
            else:
                async with sem:
                    res = await send_request(session, args, api_url, req, t0)
            bar.update(1)
            return res

        rng = np.random.default_rng(args.seed)
        tasks = []
        t0 = time.perf_counter()
        async for i in _arrivals(len(requests), args.request_rate, rng):
            tasks.append(asyncio.create_task(one(requests[i])))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
    return list(outputs), duration


# ---------------------------------------------------------------------------------------------- metrics
def _stats(prefix: str, values_s: list[float]) -> dict:
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    if ms.size == 0:
        return {f"mean_{prefix}_ms": 0.0, f"median_{prefix}_ms": 0.0, f"p99_{prefix}_ms": 0.0, f"std_{prefix}_ms": 0.0}
    return {f"mean_{prefix}_ms": float(ms.mean()), f"median_{prefix}_ms": float(np.median(ms)),
            f"p99_{prefix}_ms": float(np.percentile(ms, 99)), f"std_{prefix}_ms": float(ms.std())}


def _count_output_tokens(outputs: list[RequestFuncOutput], tokenizer) -> None:
    for o in outputs:
        if o.success and not o.server_counted_output:
            if tokenizer is None:
                raise BenchmarkError("the server reported no completion token counts; pass --tokenizer to count them")
            o.output_len = len(tokenizer.encode(o.generated_text, add_special_tokens=False))


def compute_metrics(outputs: list[RequestFuncOutput], duration: float) -> dict:
    ok = [o for o in outputs if o.success]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_len for o in ok)
    # TPOT needs the first token's time: only streamed requests with more than one token chunk have it
    tpots = [(o.latency - o.ttft) / (o.output_len - 1) for o in ok if o.output_len > 1 and len(o.chunk_times) > 1]
    m = {
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "total_cached_tokens": sum(o.cached_tokens for o in ok),
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "input_throughput": total_in / duration if duration > 0 else 0.0,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
        "concurrency": sum(o.latency for o in ok) / duration if duration > 0 else 0.0,
    }
    m.update(_stats("ttft", [o.ttft for o in ok]))
    m.update(_stats("tpot", tpots))
    m.update(_stats("itl", [x for o in ok for x in o.itl]))
    m.update(_stats("e2e_latency", [o.latency for o in ok]))
    m["errors"] = [o.error for o in outputs if not o.success][:5]
    return m


def print_table(r: dict) -> None:
    rows = [
        ("Backend", r["backend"]), ("Dataset", r["dataset_name"]),
        ("Request rate (req/s)", r["request_rate"]), ("Max concurrency", r["max_concurrency"] or "-"),
        ("Successful requests", r["completed"]), ("Failed requests", r["failed"]),
        ("Benchmark duration (s)", f"{r['duration_s']:.2f}"),
        ("Total input tokens", r["total_input_tokens"]), ("Total output tokens", r["total_output_tokens"]),
        ("Cached prompt tokens", r["total_cached_tokens"]),
        ("Request throughput (req/s)", f"{r['request_throughput']:.2f}"),
        ("Input token throughput (tok/s)", f"{r['input_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{r['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{r['total_throughput']:.2f}"),
        ("Concurrency", f"{r['concurrency']:.2f}"),
    ]
    if r.get("spec_accept_length") is not None:
        rows.append(("Mean acceptance length", f"{r['spec_accept_length']:.2f}"))
    width, vwidth = 36, 24
    lines = ["", " Serving Benchmark Result ".center(width + vwidth, "=")]
    lines += [f"{k:<{width}}{str(v):>{vwidth}}" for k, v in rows]
    for title, key in (("Time to first token", "ttft"), ("Time per output token (excl. 1st)", "tpot"),
                       ("Inter-token latency", "itl"), ("End-to-end latency", "e2e_latency")):
        lines.append(f" {title} ".center(width + vwidth, "-"))
        for stat in ("mean", "median", "p99"):
            lines.append(f"{stat.capitalize() + ' (ms)':<{width}}{r[f'{stat}_{key}_ms']:>{vwidth}.2f}")
    lines.append("=" * (width + vwidth))
    if r["errors"]:
        lines.append("first errors: " + " | ".join(e.splitlines()[0] if e else "?" for e in r["errors"]))
    print("\n".join(lines))


def plot_results(path: str, outputs: list[RequestFuncOutput], duration: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [o for o in outputs if o.success]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, values, title in ((axes[0, 0], [o.ttft * 1000 for o in ok], "TTFT (ms)"),
                              (axes[0, 1], [x * 1000 for o in ok for x in o.itl], "Inter-token latency (ms)"),
                              (axes[1, 0], [o.latency * 1000 for o in ok], "End-to-end latency (ms)")):
        if values:
            ax.hist(values, bins=min(50, max(5, len(values) // 2)))
            ax.axvline(float(np.median(values)), color="k", linestyle="--", label="median")
            ax.axvline(float(np.percentile(values, 99)), color="r", linestyle=":", label="p99")
            ax.legend()
        ax.set_title(title)
        ax.set_ylabel("count")
    times = np.asarray([t for o in ok for t in o.chunk_times])
    tokens = np.asarray([n for o in ok for n in o.chunk_tokens])
    ax = axes[1, 1]
    if times.size:
        n_bins = max(1, min(100, int(np.ceil(duration / 0.5))))
        edges = np.linspace(0.0, max(duration, float(times.max())), n_bins + 1)
        per_bin, _ = np.histogram(times, bins=edges, weights=tokens)
        ax.plot((edges[:-1] + edges[1:]) / 2, per_bin / np.diff(edges))
    ax.set_title("Output throughput over time")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("tokens/s")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- entry
def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="braid.bench_serving", description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="braid", choices=BACKENDS)
    p.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:30000 (overrides --host/--port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--model", default=None, help="model name for openai/vllm (default: the server's first model)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer'; openai/vllm fall back to $OPENAI_API_KEY")
    p.add_argument("--tokenizer", default=None,
                   help="path or 'smollm2' (default: the server's --model-path, else --model); builds prompts")
    add_dataset_args(p)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson arrivals (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--disable-stream", action="store_true")
    p.add_argument("--disable-ignore-eos", action="store_true")
    p.add_argument("--extra-request-body", type=_json_object, default=None, metavar="JSON",
                   help="merged (recursively) into every request body")
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--output-file", default=None, help="append one JSON line of results")
    p.add_argument("--output-details", action="store_true", help="also write per-request lengths and latencies")
    p.add_argument("--plot", default=None, metavar="PATH", help="PNG of latency distributions and throughput over time")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _validate(args) -> None:
    if not args.request_rate > 0:
        raise BenchmarkError(f"--request-rate must be > 0, got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise BenchmarkError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.warmup_requests < 0:
        raise BenchmarkError("--warmup-requests must be >= 0")


def _resolve_tokenizer(args):
    from braid.runtime.loader.tokenizer import load_tokenizer

    name = args.tokenizer
    if name is None:
        name = _server_model_path(args) or args.model
    if name is None:
        raise BenchmarkError("cannot tell which tokenizer to use; pass --tokenizer (a path or 'smollm2')")
    try:
        return load_tokenizer(name)
    except (OSError, FileNotFoundError) as e:
        raise BenchmarkError(f"cannot load tokenizer {name!r}: {e}") from None


def _server_model_path(args) -> Optional[str]:
    import requests

    if args.backend not in NATIVE_BACKENDS:
        return None
    try:
        r = requests.get(_base_url(args) + "/get_model_info", headers=_headers(args), timeout=10)
        return r.json().get("model_path") if r.status_code == 200 else None
    except (requests.RequestException, ValueError):
        return None


_SPEC_COUNTERS = ("spec_num_drafts_total", "spec_num_accepted_tokens_total")


def _spec_counters(args) -> Optional[tuple[float, float]]:
    """A braid server's speculative-decoding totals (drafts verified, draft tokens accepted) from /get_server_info;
    None for another server or one that does not speculate."""
    import requests

    if args.backend not in NATIVE_BACKENDS:
        return None
    try:
        r = requests.get(_base_url(args) + "/get_server_info", headers=_headers(args), timeout=10)
        info = r.json() if r.status_code == 200 else {}
    except (requests.RequestException, ValueError):
        return None
    values = [info.get(key) for key in _SPEC_COUNTERS] if isinstance(info, dict) else [None]
    return tuple(values) if all(isinstance(v, (int, float)) for v in values) else None


def run_benchmark(args: argparse.Namespace) -> dict:
    """Runs the benchmark described by parsed args; prints the table and returns the results."""
    _validate(args)
    tokenizer = _resolve_tokenizer(args)
    requests_ = get_dataset(args, tokenizer)
    spec_before = _spec_counters(args)
    outputs, duration = asyncio.run(_benchmark(args, requests_))
    spec_after = _spec_counters(args) if spec_before is not None else None
    _count_output_tokens(outputs, tokenizer)
    result = {
        "backend": args.backend, "base_url": _base_url(args), "dataset_name": args.dataset_name,
        "num_prompts": len(requests_), "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
        "requested_output_tokens": sum(r.output_len for r in requests_),
        "ignore_eos": not args.disable_ignore_eos, "stream": not args.disable_stream,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "command": " ".join(sys.argv),
    }
    result.update(compute_metrics(outputs, duration))
    if spec_after is not None and spec_after[0] > spec_before[0]:
        # tokens a verified draft yields during this run: its accepted draft tokens plus the target's own
        result["spec_accept_length"] = 1.0 + (spec_after[1] - spec_before[1]) / (spec_after[0] - spec_before[0])
    details = {"input_lens": [o.prompt_len for o in outputs], "output_lens": [o.output_len for o in outputs],
               "ttfts": [o.ttft for o in outputs], "latencies": [o.latency for o in outputs],
               "itls": [o.itl for o in outputs], "success": [o.success for o in outputs]}
    print_table(result)
    if args.output_file:
        line = {**result, **details} if args.output_details else result
        append_jsonl(args.output_file, line)
    if args.plot:
        plot_results(args.plot, outputs, duration)
    result["details"] = details
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        result = run_benchmark(args)
    except (BenchmarkError, DatasetError) as e:
        print(f"bench_serving: {e}", file=sys.stderr)
        return 2
    return 0 if result["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
