"""`python -m braid.bench_serving`: online serving benchmark against a running server.

Sends a dataset's prompts at a Poisson request rate (optionally capped by a concurrency limit) and measures
TTFT, TPOT, inter-token latency and end-to-end latency per request, plus request and token throughput.
Backends: braid/sglang use the native streaming `/generate`; openai/vllm use `/v1/completions`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from braid.runtime.bench.datasets import BenchRequest, DatasetError, add_dataset_args, get_dataset
from braid.runtime.bench.results import append_jsonl

__all__ = ["RequestFuncOutput", "BenchmarkError", "build_parser", "parse_args", "run_benchmark", "main"]

BACKENDS = ("braid", "sglang", "openai", "vllm")
NATIVE_BACKENDS = ("braid", "sglang")
_TIMEOUT_S = 6 * 3600


class BenchmarkError(ValueError):
    """Bad benchmark arguments or an unreachable server."""


@dataclass
class RequestFuncOutput:
    success: bool = False
    generated_text: str = ""
    prompt_len: int = 0  # server-reported when available, else the dataset's count
    output_len: int = 0  # server-reported when available, else counted with the tokenizer
    cached_tokens: int = 0
    ttft: float = 0.0  # s
    latency: float = 0.0  # s, request sent -> last byte
    itl: list[float] = field(default_factory=list)  # s, gaps between successive chunks that carried tokens
    start_time: float = 0.0  # s since the benchmark started
    chunk_times: list[float] = field(default_factory=list)  # s since the benchmark started, one per token chunk
    chunk_tokens: list[int] = field(default_factory=list)  # tokens each chunk carried
    server_counted_output: bool = False
    error: str = ""


# ---------------------------------------------------------------------------------------------- requests
def _deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def build_request_body(args, req: BenchRequest) -> dict:
    stream = not args.disable_stream
    ignore_eos = not args.disable_ignore_eos
    if args.backend in NATIVE_BACKENDS:
        body = {"text": req.prompt, "stream": stream,
                "sampling_params": {"max_new_tokens": req.output_len, "temperature": 0.0, "ignore_eos": ignore_eos}}
    else:
        body = {"model": args.model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0,
                "stream": stream, "ignore_eos": ignore_eos}
        if stream:
            body["stream_options"] = {"include_usage": True}
    return _deep_merge(body, args.extra_request_body or {})


def _sse_payloads(line: bytes) -> Optional[str]:
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    return line[5:].strip().decode("utf-8", errors="replace")


async def _sse_events(resp, out: "RequestFuncOutput"):
    """The JSON objects of an SSE response up to `data: [DONE]`; an error object ends it with out.error set."""
    async for line in resp.content:
        payload = _sse_payloads(line)
        if payload is None:
            continue
        if payload == "[DONE]":
            return
        data = json.loads(payload)
        if (msg := _error_message(data)) is not None:
            out.error = msg
            return
        yield data


class _Recorder:
    """Timestamps of token-carrying chunks for one request."""

    def __init__(self, out: RequestFuncOutput, t_bench0: float, t_sent: float):
        self.out, self.t_bench0, self.t_sent = out, t_bench0, t_sent
        self.last: Optional[float] = None

    def chunk(self, n_tokens: int) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.out.ttft = now - self.t_sent
        else:
            self.out.itl.append(now - self.last)
        self.last = now
        self.out.chunk_times.append(now - self.t_bench0)
        self.out.chunk_tokens.append(n_tokens)


def _error_message(obj) -> Optional[str]:
    if isinstance(obj, dict) and "error" in obj:
        err = obj["error"]
        return err.get("message", str(err)) if isinstance(err, dict) else str(err)
    return None


async def _native_request(session, url: str, body: dict, out: RequestFuncOutput, rec: _Recorder) -> None:
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            out.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
            return
        if not body.get("stream"):
            data = await resp.json()
            data = data[0] if isinstance(data, list) else data
            rec.chunk(int(data.get("meta_info", {}).get("completion_tokens", 0)))
            _native_final(out, data)
            return
        seen_tokens, final = 0, None
        async for data in _sse_events(resp, out):
            meta = data.get("meta_info", {})
            completion = int(meta.get("completion_tokens", seen_tokens + 1))
            if completion > seen_tokens or data.get("text"):
                rec.chunk(max(completion - seen_tokens, 0))
                seen_tokens = max(seen_tokens, completion)
            final = data
        if out.error:
            return
        if final is None:
            out.error = "the stream ended without a chunk"
            return
        _native_final(out, final)


def _native_final(out: RequestFuncOutput, data: dict) -> None:
    meta = data.get("meta_info", {})
    out.generated_text = data.get("text", "")
    if "prompt_tokens" in meta:
        out.prompt_len = int(meta["prompt_tokens"])
    if "completion_tokens" in meta:
        out.output_len = int(meta["completion_tokens"])
        out.server_counted_output = True
    out.cached_tokens = int(meta.get("cached_tokens", 0) or 0)
    out.success = True


async def _openai_request(session, url: str, body: dict, out: RequestFuncOutput, rec: _Recorder) -> None:
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            out.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
            return
        if not body.get("stream"):
            data = await resp.json()
            usage = data.get("usage") or {}
            rec.chunk(int(usage.get("completion_tokens", 0)))
            out.generated_text = "".join(c.get("text", "") for c in data.get("choices", []))
            _openai_usage(out, usage)
            out.success = True
            return
        pieces = []
        async for data in _sse_events(resp, out):
            choices = data.get("choices") or []
            if choices and (text := choices[0].get("text")):
                pieces.append(text)
                rec.chunk(1)  # one token per chunk; the usage chunk corrects the total
            if data.get("usage"):
                _openai_usage(out, data["usage"])
        if out.error:
            return
        out.generated_text = "".join(pieces)
        out.success = True


def _openai_usage(out: RequestFuncOutput, usage: dict) -> None:
    if "prompt_tokens" in usage:
        out.prompt_len = int(usage["prompt_tokens"])
    if "completion_tokens" in usage:
        out.output_len = int(usage["completion_tokens"])
        out.server_counted_output = True
    details = usage.get("prompt_tokens_details") or {}
    out.cached_tokens = int(details.get("cached_tokens", 0) or 0)


async def send_request(session, args, api_url: str, req: BenchRequest, t_bench0: float) -> RequestFuncOutput:
    import aiohttp

    out = RequestFuncOutput(prompt_len=req.prompt_len)
    body = build_request_body(args, req)
    t_sent = time.perf_counter()
    out.start_time = t_sent - t_bench0
    rec = _Recorder(out, t_bench0, t_sent)
    fn = _native_request if args.backend in NATIVE_BACKENDS else _openai_request
    try:
        await fn(session, api_url, body, out, rec)
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, ValueError) as e:
        out.success, out.error = False, f"{type(e).__name__}: {e}"
    except Exception:  # keep the benchmark going; the error is reported per request
        out.success, out.error = False, traceback.format_exc(limit=3)
    out.latency = time.perf_counter() - t_sent
    if out.success and (not body.get("stream") or not out.chunk_times):
        out.ttft = out.latency  # without a stream the first token arrives with the last
    return out


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


def run_benchmark(args: argparse.Namespace) -> dict:
    """Runs the benchmark described by parsed args; prints the table and returns the results."""
    _validate(args)
    tokenizer = _resolve_tokenizer(args)
    requests_ = get_dataset(args, tokenizer)
    outputs, duration = asyncio.run(_benchmark(args, requests_))
    _count_output_tokens(outputs, tokenizer)
    result = {
        "backend": args.backend, "base_url": _base_url(args), "dataset_name": args.dataset_name,
        "num_prompts": len(requests_), "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
        "requested_output_tokens": sum(r.output_len for r in requests_),
        "ignore_eos": not args.disable_ignore_eos, "stream": not args.disable_stream,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "command": " ".join(sys.argv),
    }
    result.update(compute_metrics(outputs, duration))
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
