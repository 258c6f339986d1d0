"""The per-backend HTTP clients of bench_serving: one request sent, its stream timed, its token counts read.

braid/sglang speak the native streaming `/generate`; openai/vllm speak `/v1/completions`. Each request's outcome,
errors included, lands in a RequestFuncOutput; nothing here raises for a failed request.
"""

from __future__ import annotations

import asyncio
import json
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Optional

import msgspec

from braid.runtime.bench.datasets import BenchRequest

__all__ = ["RequestFuncOutput", "NATIVE_BACKENDS", "build_request_body", "send_request"]

NATIVE_BACKENDS = ("braid", "sglang")


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
        if req.image_data:
            body["image_data"] = req.image_data
        if req.video_data:
            body["video_data"] = req.video_data
    else:
        if req.image_data or req.video_data:
            raise ValueError("the multimodal dataset needs a native backend (/generate with image_data/video_data)")
        body = {"model": args.model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0,
                "stream": stream, "ignore_eos": ignore_eos}
        if stream:
            body["stream_options"] = {"include_usage": True}
    return _deep_merge(body, args.extra_request_body or {})


async def _sse_payloads(resp):
    """The `data:` payloads (bytes) of an SSE response up to `data: [DONE]`, read as the bytes arrive (one read may
    hold several events or part of one)."""
    pending = b""
    async for data in resp.content.iter_any():
        lines = (pending + data).split(b"\n")
        pending = lines.pop()
        for line in lines:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return
            yield payload
    line = pending.strip()
    if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
        yield line[5:].strip()


async def _sse_events(resp, out: "RequestFuncOutput"):
    """The JSON objects of an SSE response up to `data: [DONE]`; an error object ends it with out.error set."""
    async for payload in _sse_payloads(resp):
        data = json.loads(payload)
        if (msg := _error_message(data)) is not None:
            out.error = msg
            return
        yield data


class _NativeProgress(msgspec.Struct):
    """What the client reads from a native stream's every chunk: its token count (or an error). The cumulative text
    and ids it carries are skipped, not built: at thousands of streams the client's parsing would otherwise add to
    the latencies it measures; the last chunk is read whole."""

    meta_info: dict = {}
    error: Any = None


_NATIVE_PROGRESS = msgspec.json.Decoder(_NativeProgress)


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
        async for payload in _sse_payloads(resp):
            progress = _NATIVE_PROGRESS.decode(payload)
            if progress.error is not None:
                out.error = _error_message({"error": progress.error})
                return
            completion = int(progress.meta_info.get("completion_tokens", seen_tokens + 1))
            if completion > seen_tokens:
                rec.chunk(completion - seen_tokens)
                seen_tokens = completion
            final = payload
        if final is None:
            out.error = "the stream ended without a chunk"
            return
        _native_final(out, json.loads(final))


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
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, msgspec.DecodeError, ValueError) as e:
        out.success, out.error = False, f"{type(e).__name__}: {e}"
    except Exception:  # keep the benchmark going; the error is reported per request
        out.success, out.error = False, traceback.format_exc(limit=3)
    out.latency = time.perf_counter() - t_sent
    if out.success and (not body.get("stream") or not out.chunk_times):
        out.ttft = out.latency  # without a stream the first token arrives with the last
    return out
