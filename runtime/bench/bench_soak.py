"""Soak test with faults: `python -m braid.bench_soak --num-requests 5000 --concurrency 64`.

Sends a mix of well-behaved and abusive requests at a real server (started here unless --base-url is given)
and checks that every request ends, no request gets a 5xx, the KV pool is back to fully free at idle, and the
server's memory does not creep. The mix (weights in KINDS): plain and streamed completions, streamed chats,
n=3, regex and JSON-schema constrained requests, regexes pathological for an automaton (outlines-core hits its
compile timeout: a 400; llguidance matches them lazily: ok),
client disconnects mid-stream, aborts through /abort_request, prompts over --max-prompt-chars, 16 stop strings
of 1,000 characters, and malformed parameters. Each kind has the outcomes it may end in (EXPECTED); anything
else is reported as a failure. A final phase measures a plain request's latency while pathological regexes
and a 30 MB body are in flight, against its latency on an idle server.

Exit status 0 when the run meets the bar: no request that never ended, no 5xx, no unexpected outcome, KV used
0 at idle, RSS growth under --max-rss-growth (from after the warm-up to the end).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Optional

PROMPTS = ["Tell me about the sea.", "List three colors.", "What is 2 + 2?", "Write a haiku about rain.",
           "Explain gravity to a child.", "Name a famous painter.", "Describe a cat in one sentence.",
           "What is the capital of France?"]
PATHOLOGICAL_REGEX = "(a|b)*a(a|b){24}"  # its DFA has 2^25 states: the compile hits the grammar timeout

# kind -> weight in the mix
KINDS = {"plain": 20, "stream": 12, "chat_stream": 12, "n3": 6, "regex": 8, "json_schema": 5, "pathological": 2,
         "disconnect": 8, "abort": 6, "oversized": 3, "huge_stops": 6, "bad_param": 6, "too_many_stops": 2}
# kind -> outcomes that count as correct behaviour
EXPECTED = {"plain": {"ok"}, "stream": {"ok"}, "chat_stream": {"ok"}, "n3": {"ok"}, "regex": {"ok"},
            "json_schema": {"ok"}, "pathological": {"400", "ok"}, "disconnect": {"disconnected", "ok"},
            "abort": {"aborted", "ok"}, "oversized": {"400"}, "huge_stops": {"ok"}, "bad_param": {"400"},
            "too_many_stops": {"400"}}


@dataclass
class Result:
    kind: str
    outcome: str  # ok | aborted | disconnected | 4xx status | 5xx status | never_ended | error:<type>
    latency_s: float
    detail: str = ""


@dataclass
class Report:
    results: list[Result] = field(default_factory=list)
    rss_start: dict = field(default_factory=dict)
    rss_warm: dict = field(default_factory=dict)
    rss_end: dict = field(default_factory=dict)
    idle_info: dict = field(default_factory=dict)
    unloaded_latency_s: float = 0.0
    interference_latency_s: float = 0.0
    interference_outcomes: Counter = field(default_factory=Counter)


def rss_mb(pid: int) -> Optional[float]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def process_tree(pid: int) -> dict[str, int]:
    """{'server': pid, 'scheduler': its first child} where /proc says so."""
    out = {"server": pid}
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = f.read().split()
        if children:
            out["scheduler"] = int(children[0])
    except OSError:
        pass
    return out


def rss_of(pids: dict[str, int]) -> dict[str, float]:
    return {name: mb for name, pid in pids.items() if (mb := rss_mb(pid)) is not None}


class SoakClient:
    def __init__(self, session, base_url: str, max_prompt_chars: int, request_timeout_s: float, rng: random.Random,
                 max_tokens: int = 48):
        self.session = session
        self.max_tokens = max_tokens
        self.base = base_url.rstrip("/")
        self.max_prompt_chars = max_prompt_chars
        self.request_timeout_s = request_timeout_s
        self.rng = rng
        self.counter = 0

    async def run(self, kind: str) -> Result:
        start = time.perf_counter()
        try:
            outcome, detail = await asyncio.wait_for(getattr(self, "_" + kind)(), self.request_timeout_s)
        except asyncio.TimeoutError:
            outcome, detail = "never_ended", f"no end within {self.request_timeout_s:.0f}s"
        except Exception as e:  # a connection reset or a malformed response is a finding, not a crash
            outcome, detail = f"error:{type(e).__name__}", str(e)[:200]
        return Result(kind, outcome, time.perf_counter() - start, detail)

    # ---- helpers ----
    def _max_tokens(self) -> int:
        return self.rng.randint(min(8, self.max_tokens), self.max_tokens)

    def _prompt(self) -> str:
        return self.rng.choice(PROMPTS)

    async def _post(self, path: str, body) -> tuple[str, object]:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        async with self.session.post(self.base + path, data=data, headers={"Content-Type": "application/json"}) as r:
            text = await r.text()
            if r.status != 200:
                return str(r.status), text[:200]
            return "ok", json.loads(text)

    # ---- kinds ----
    async def _plain(self):
        status, body = await self._post("/v1/completions", {"model": "default", "prompt": self._prompt(),
                                                            "max_tokens": self._max_tokens(), "temperature": 0.7})
        return status, "" if status == "ok" else body

    async def _stream(self):
        return await self._sse("/v1/completions", {"model": "default", "prompt": self._prompt(), "stream": True,
                                                   "max_tokens": self._max_tokens(), "temperature": 0.7})

    async def _chat_stream(self):
        return await self._sse("/v1/chat/completions",
                               {"model": "default", "messages": [{"role": "user", "content": self._prompt()}],
                                "stream": True, "max_tokens": self._max_tokens(), "temperature": 0.7})

    async def _n3(self):
        status, body = await self._post("/v1/completions", {"model": "default", "prompt": self._prompt(), "n": 3,
                                                            "max_tokens": 16, "temperature": 1.0})
        if status == "ok" and len(body["choices"]) != 3:
            return "wrong_shape", f"{len(body['choices'])} choices"
        return status, "" if status == "ok" else body

    async def _regex(self):
        status, body = await self._post("/generate", {"text": "Phone number: ", "sampling_params": {
            "max_new_tokens": 16, "regex": r"[0-9]{3}-[0-9]{4}", "temperature": 1.0}})
        if status == "ok" and not re.fullmatch(r"[0-9]{3}-[0-9]{4}", body["text"]):
            return "constraint_violated", body["text"][:80]
        return status, "" if status == "ok" else body

    async def _json_schema(self):
        schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                   "age": {"type": "integer"}}, "required": ["name", "age"]}
        status, body = await self._post("/generate", {"text": "A person as JSON: ", "sampling_params": {
            "max_new_tokens": 48, "json_schema": json.dumps(schema), "temperature": 1.0}})
        return status, "" if status == "ok" else body

    async def _pathological(self):
        return await self._post("/generate", {"text": "x", "sampling_params": {
            "max_new_tokens": 8, "regex": PATHOLOGICAL_REGEX}})

    async def _disconnect(self):
        return await self._sse("/v1/completions", {"model": "default", "prompt": self._prompt(), "stream": True,
                                                   "max_tokens": 2 * self.max_tokens, "temperature": 0.7},
                               stop_after_chunks=self.rng.randint(1, 4))

    async def _abort(self):
        self.counter += 1
        rid = f"soak-abort-{os.getpid()}-{self.counter}-{self.rng.getrandbits(32)}"

        async def abort_at(chunks: int):
            if chunks == 2:
                await self._post("/abort_request", {"rid": rid})

        return await self._sse("/generate", {"text": self._prompt(), "rid": rid, "stream": True,
                                             "sampling_params": {"max_new_tokens": 2 * self.max_tokens, "temperature": 0.7}},
                               on_chunk=abort_at)

    async def _oversized(self):
        return await self._post("/v1/completions", {"model": "default", "prompt": "a" * (self.max_prompt_chars + 1),
                                                    "max_tokens": 4})

    async def _huge_stops(self):
        stops = ["".join(self.rng.choice("abcdefgh ") for _ in range(1000)) for _ in range(16)]
        status, body = await self._post("/v1/completions", {"model": "default", "prompt": self._prompt(),
                                                            "max_tokens": self._max_tokens(), "stop": stops, "temperature": 0.7})
        return status, "" if status == "ok" else body

    async def _too_many_stops(self):
        return await self._post("/v1/completions", {"model": "default", "prompt": "x", "max_tokens": 4,
                                                    "stop": [f"s{i}" for i in range(100)]})

    async def _bad_param(self):
        bad = self.rng.choice(['{"model": "default", "prompt": "x", "temperature": NaN}',
                               '{"model": "default", "prompt": "x", "max_tokens": -5}',
                               '{"model": "default", "prompt": "x", "top_p": 7}',
                               '{"model": "default", "prompt": "x", "seed": 99999999999999999999999}',
                               '{"model": "default", "prompt": '])
        return await self._post("/v1/completions", bad)

    async def _sse(self, path: str, body: dict, stop_after_chunks: Optional[int] = None, on_chunk=None):
        return await _read_sse(self.session, self.base + path, body, stop_after_chunks, on_chunk)


def _finish_reason(chunk: dict) -> Optional[str]:
    if "meta_info" in chunk:  # native /generate
        reason = chunk["meta_info"].get("finish_reason")
        return reason.get("type") if isinstance(reason, dict) else reason
    for choice in chunk.get("choices", []):
        if choice.get("finish_reason"):
            return choice["finish_reason"]
    return None


async def _read_sse(session, url: str, body: dict, stop_after_chunks: Optional[int], on_chunk) -> tuple[str, str]:
    """Reads an SSE stream to [DONE]: ok, aborted (finish_reason abort), or disconnected when closed on purpose."""
    async with session.post(url, json=body) as r:
        if r.status != 200:
            return str(r.status), (await r.text())[:200]
        chunks, finish = 0, None
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                return ("aborted" if finish == "abort" else "ok"), f"{chunks} chunks"
            chunk = json.loads(payload)
            if "error" in chunk:
                return "stream_error", str(chunk["error"])[:200]
            chunks += 1
            finish = _finish_reason(chunk) or finish
            if on_chunk is not None:
                await on_chunk(chunks)
            if stop_after_chunks is not None and chunks >= stop_after_chunks:
                r.close()
                return "disconnected", f"closed after {chunks} chunks"
        return "truncated_stream", f"{chunks} chunks, no [DONE]"


def plan(num_requests: int, rng: random.Random) -> list[str]:
    kinds, weights = zip(*KINDS.items())
    return rng.choices(kinds, weights=weights, k=num_requests)


async def run_requests(client: SoakClient, kinds: list[str], concurrency: int, desc: str,
                       disable_tqdm: bool) -> list[Result]:
    from tqdm.asyncio import tqdm

    queue: asyncio.Queue = asyncio.Queue()
    for kind in kinds:
        queue.put_nowait(kind)
    results: list[Result] = []
    bar = tqdm(total=len(kinds), desc=desc, disable=disable_tqdm)

    async def worker():
        while not queue.empty():
            results.append(await client.run(queue.get_nowait()))
            bar.update(1)

    await asyncio.gather(*[worker() for _ in range(min(concurrency, len(kinds)))])
    bar.close()
    return results


async def idle_info(session, base: str, timeout_s: float = 120.0) -> dict:
    """/get_server_info once nothing runs or waits (the last one read if that never happens; its error if the server
    cannot report, e.g. after its scheduler died)."""
    deadline = time.monotonic() + timeout_s
    while True:
        async with session.get(base + "/get_server_info") as r:
            info = await r.json()
        if r.status != 200 or "error" in info:
            return info
        if (info["num_server_requests"] == 0 and info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0) \
                or time.monotonic() > deadline:
            return info
        await asyncio.sleep(0.2)


async def interference(client: SoakClient, session, base: str, probes: int) -> tuple[float, float, Counter]:
    """(median plain latency idle, worst plain latency while 4 pathological regexes and a 30 MB body are in
    flight, outcomes of those abusive requests)."""
    idle = [(await client.run("plain")).latency_s for _ in range(probes)]
    outcomes: Counter = Counter()

    async def big_body():
        body = b'{"model": "default", "max_tokens": 4, "prompt": "' + b"a" * (30 << 20) + b'"}'
        try:
            async with session.post(base + "/v1/completions", data=body,
                                    headers={"Content-Type": "application/json"}) as r:
                outcomes[f"30MB body: {r.status}"] += 1
        except Exception as e:  # the server may close the connection once it has refused the body
            outcomes[f"30MB body: {type(e).__name__}"] += 1

    async def bad_regex(i: int):
        status, _ = await client._post("/generate", {"text": "x", "sampling_params": {
            "max_new_tokens": 8, "regex": PATHOLOGICAL_REGEX + "c" * i}})  # distinct: no compile cache hit
        outcomes[f"pathological regex: {status}"] += 1

    abuse = [asyncio.create_task(bad_regex(i)) for i in range(4)] + [asyncio.create_task(big_body())]
    await asyncio.sleep(0.2)
    loaded = []
    for _ in range(probes):
        loaded.append((await client.run("plain")).latency_s)
    await asyncio.gather(*abuse)
    return statistics.median(idle), max(loaded), outcomes


async def soak(args, base: str, pids: dict[str, int]) -> Report:
    import aiohttp

    rng = random.Random(args.seed)
    report = Report(rss_start=rss_of(pids))
    timeout = aiohttp.ClientTimeout(total=None)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with aiohttp.ClientSession(timeout=timeout, headers=headers,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        async with session.get(base + "/get_server_info") as r:
            server_info = await r.json()
        client = SoakClient(session, base, server_info["max_prompt_chars"], args.request_timeout_s, rng,
                            args.max_tokens)
        kinds = plan(args.num_requests, rng)
        warm = min(len(kinds), max(args.concurrency, len(kinds) // 10))
        report.results += await run_requests(client, kinds[:warm], args.concurrency, "warm-up", args.disable_tqdm)
        report.rss_warm = rss_of(pids)
        report.results += await run_requests(client, kinds[warm:], args.concurrency, "soak", args.disable_tqdm)
        report.idle_info = await idle_info(session, base)
        report.rss_end = rss_of(pids)
        if args.interference_probes:
            (report.unloaded_latency_s, report.interference_latency_s,
             report.interference_outcomes) = await interference(client, session, base, args.interference_probes)
    return report


def summarize(report: Report, max_rss_growth: float) -> tuple[list[str], bool]:
    lines = []
    by_kind: dict[str, Counter] = defaultdict(Counter)
    for r in report.results:
        by_kind[r.kind][r.outcome] += 1
    unexpected = [r for r in report.results if r.outcome not in EXPECTED[r.kind]]
    never = sum(r.outcome == "never_ended" for r in report.results)
    five_xx = sum(r.outcome.startswith("5") for r in report.results)
    lines.append(f"{'kind':<16}{'requests':>9}  outcomes")
    for kind in KINDS:
        if by_kind[kind]:
            outcomes = ", ".join(f"{o} {n}" for o, n in sorted(by_kind[kind].items()))
            lines.append(f"{kind:<16}{sum(by_kind[kind].values()):>9}  {outcomes}")
    plain = [r.latency_s for r in report.results if r.kind == "plain" and r.outcome == "ok"]
    if plain:
        lines.append(f"plain request latency: median {statistics.median(plain):.2f}s, worst {max(plain):.2f}s")
    for r in unexpected[:10]:
        lines.append(f"unexpected: {r.kind} -> {r.outcome} after {r.latency_s:.1f}s: {r.detail}")
    kv_used = report.idle_info.get("kv_used_tokens")
    idle = report.idle_info.get("num_running_reqs") == 0 and report.idle_info.get("num_waiting_reqs") == 0
    lines.append(f"requests {len(report.results)}, never ended {never}, 5xx {five_xx}, unexpected {len(unexpected)}, "
                 f"KV used at idle {kv_used} of {report.idle_info.get('kv_total_tokens')} tokens "
                 f"({report.idle_info.get('kv_cached_tokens')} cached, evictable)")
    window_used = report.idle_info.get("window_kv_used_tokens", 0)  # a hybrid pool's window-layer space
    if "window_kv_total_tokens" in report.idle_info:
        lines.append(f"window-layer KV used at idle {window_used} of {report.idle_info['window_kv_total_tokens']} "
                     f"tokens ({report.idle_info.get('window_kv_cached_tokens')} cached)")
    if "error" in report.idle_info:
        lines.append(f"the server could not report at idle: {report.idle_info['error']}")
    growth_ok = True
    for name in report.rss_end:
        start, warm, end = report.rss_start.get(name), report.rss_warm.get(name), report.rss_end[name]
        growth = (end - warm) / warm if warm else 0.0
        growth_ok &= growth < max_rss_growth
        lines.append(f"RSS {name}: start {start:.0f} MB, after warm-up {warm:.0f} MB, end {end:.0f} MB "
                     f"({growth * 100:+.1f}% since warm-up)")
    if report.interference_outcomes:
        lines.append(f"plain request idle {report.unloaded_latency_s:.2f}s; worst while pathological regexes and a "
                     f"30 MB body were in flight {report.interference_latency_s:.2f}s "
                     f"(+{report.interference_latency_s - report.unloaded_latency_s:.2f}s); abusive requests: "
                     + ", ".join(f"{k} x{v}" for k, v in sorted(report.interference_outcomes.items())))
    passed = never == 0 and five_xx == 0 and not unexpected and kv_used == 0 and window_used == 0 and idle and growth_ok
    lines.append("PASS" if passed else "FAIL")
    return lines, passed


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m braid.bench_soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None, help="a running server; without it one is started here")
    p.add_argument("--model-path", default="smollm2", help="model of the server started here")
    p.add_argument("--server-args", default='{"max_total_tokens": 16384, "grammar_timeout_s": 2}',
                   help="JSON of ServerArgs fields for the server started here")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-requests", type=int, default=5000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=48, help="most tokens a well-behaved request asks for")
    p.add_argument("--request-timeout-s", type=float, default=300.0,
                   help="a request with no end after this long counts as never ended")
    p.add_argument("--max-rss-growth", type=float, default=0.10, help="allowed RSS growth after the warm-up")
    p.add_argument("--interference-probes", type=int, default=5,
                   help="plain requests timed idle and under abuse at the end (0: skip that phase)")
    p.add_argument("--output-file", default=None, help="append the summary and per-kind counts as JSON lines")
    p.add_argument("--disable-tqdm", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    runtime = None
    if args.base_url is None:
        from braid.backends.runtime import Runtime

        runtime = Runtime(model_path=args.model_path, api_key=args.api_key, **json.loads(args.server_args))
        base, pids = runtime.url, process_tree(runtime._process.pid)
    else:
        base, pids = args.base_url.rstrip("/"), {}
    try:
        started = time.perf_counter()
        report = asyncio.run(soak(args, base, pids))
        elapsed = time.perf_counter() - started
    finally:
        if runtime is not None:
            runtime.shutdown()
    lines, passed = summarize(report, args.max_rss_growth)
    print(f"soak: {args.num_requests} requests at concurrency {args.concurrency} in {elapsed:.0f}s")
    print("\n".join(lines))
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps({"num_requests": args.num_requests, "concurrency": args.concurrency,
                                "elapsed_s": elapsed, "passed": passed, "summary": lines}) + "\n")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
