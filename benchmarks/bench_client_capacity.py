"""How many stream chunks per second bench_serving's client can time, and what it adds to the latencies it measures.

A stand-in SSE server (a subprocess, so that it does not share the client's interpreter) streams native `/generate`
chunks shaped like braid's (cumulative text and output ids, meta_info) to STREAMS concurrent requests, one chunk per
INTERVAL seconds each, the bytes prepared in advance so the server costs little; the client is bench_serving's own
`send_request`. Printed: chunks/s received, the client's CPU share of one core, and its mean inter-token latency
against the server's INTERVAL (the excess is the client's lag).

    python benchmarks/bench_client_capacity.py --streams 500 3000 --tokens 300 --interval 0.04
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import time
import types


def serve(port: int, tokens: int, interval: float) -> None:
    from aiohttp import web

    rng = random.Random(0)
    ids, chunks = [], []
    for i in range(tokens):
        ids.append(rng.randrange(128000))
        chunk = {"text": "word " * len(ids), "output_ids": ids,
                 "meta_info": {"id": "x", "finish_reason": None if i < tokens - 1 else {"type": "length"},
                               "prompt_tokens": 145, "completion_tokens": len(ids), "cached_tokens": 0}, "index": 0}
        chunks.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")

    async def generate(request):
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in chunks:
            await resp.write(chunk)
            await asyncio.sleep(interval)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/generate", generate)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


async def drive(port: int, streams: int, tokens: int) -> dict:
    import aiohttp

    from braid.runtime.bench.datasets import BenchRequest
    from braid.runtime.bench.serving_clients import send_request

    args = types.SimpleNamespace(backend="braid", model="m", extra_request_body=None, disable_ignore_eos=False,
                                 disable_stream=False)
    url = f"http://127.0.0.1:{port}/generate"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=3600)) as session:
        t0, cpu0 = time.perf_counter(), time.process_time()
        outs = await asyncio.gather(*[send_request(session, args, url, BenchRequest("hi", 1, tokens), t0)
                                      for _ in range(streams)])
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    ok = [o for o in outs if o.success]
    gaps = [g for o in ok for g in o.itl]
    return {"streams": streams, "ok": len(ok), "chunks_per_s": sum(len(o.chunk_times) for o in ok) / wall,
            "client_cpu_share": cpu / wall, "mean_itl_ms": 1e3 * sum(gaps) / max(len(gaps), 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, nargs="+", default=[500, 3000])
    p.add_argument("--tokens", type=int, default=300)
    p.add_argument("--interval", type=float, default=0.04, help="seconds between one stream's chunks")
    p.add_argument("--serve-port", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve_port:
        serve(a.serve_port, a.tokens, a.interval)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, __file__, "--serve-port", str(port), "--tokens", str(a.tokens),
                               "--interval", str(a.interval)])
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        print(f"{'streams':>8}{'ok':>7}{'chunks/s':>10}{'client CPU':>12}{'mean ITL ms':>13}  (server interval "
              f"{a.interval * 1e3:.0f} ms, {a.tokens} tokens per stream)")
        for streams in a.streams:
            r = asyncio.run(drive(port, streams, a.tokens))
            print(f"{r['streams']:>8}{r['ok']:>7}{r['chunks_per_s']:>10.0f}{r['client_cpu_share']:>11.0%}"
                  f"{r['mean_itl_ms']:>13.1f}")
    finally:
        server.terminate()
        server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
