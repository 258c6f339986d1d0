"""Images under load on a running multimodal server: every request ends, no 5xx, bad media a 400, KV free at idle.

A mix at CONCURRENCY of OpenAI chats with 1-3 images (PNG and JPEG, 20-190 px a side), streamed chats, streams the
client drops after two chunks, streams aborted through /abort_request, n = 2, the same image twice (prefix reuse of
image tokens), native /generate with images and with a regex, and chats whose image is broken (bad base64, a local
file or loopback URL the server must refuse, an image over --max-image-pixels: each a 400).

    python -m braid.launch_server --model-path <llava-ov folder> --max-total-tokens 1536 --max-image-pixels 40000 &
    python benchmarks/multimodal_soak.py --base-url http://127.0.0.1:30000 --num-requests 500
(tests/helpers/llava_tiny.py writes a tiny random LLaVA-OneVision: `python -c "import sys; sys.path.insert(0, 'tests/helpers');
from llava_tiny import make_tiny_llava; make_tiny_llava('/tmp/llava-tiny')"`, served with --tokenizer-path smollm2.)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import random
import sys
from collections import Counter
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
from llava_tiny import test_image  # noqa: E402  (the multimodal tests' images: gradients plus noise)

KINDS = ("chat", "stream", "disconnect", "abort", "bad_media", "n2", "regex", "generate", "repeat")
EXPECTED = {kind: 200 for kind in KINDS} | {"bad_media": 400}


def _data_url(img, fmt: str) -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buf.getvalue()).decode()}"


async def soak(base: str, num_requests: int, concurrency: int, seed: int, api_key: str | None = None
               ) -> tuple[Counter, dict]:
    rng = random.Random(seed)
    images = [_data_url(test_image(rng.randint(20, 190), rng.randint(20, 190), i), "PNG" if i % 2 else "JPEG")
              for i in range(12)]
    bad = ["data:image/png;base64,AAAA", "data:image/png;base64,%%%", "file:///etc/passwd",
           "http://127.0.0.1:1/x.png", _data_url(test_image(400, 400, 5), "PNG")]
    outcomes: Counter = Counter()
    plan = [(i, rng.choice(KINDS), [rng.choice(images) for _ in range(rng.randint(1, 3))]) for i in range(num_requests)]
    queue: asyncio.Queue = asyncio.Queue()
    for item in plan:
        queue.put_nowait(item)

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300), headers=headers) as session:
        async def one(i: int, kind: str, urls: list[str]) -> str:
            if kind == "repeat":
                urls = [images[0], images[0]]
            content = [{"type": "text", "text": "Look: "}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
            if kind == "bad_media":
                content[1]["image_url"]["url"] = bad[i % len(bad)]
            chat = {"model": "default", "messages": [{"role": "user", "content": content}], "temperature": 0.7,
                    "max_tokens": 4 + i % 37, "n": 2 if kind == "n2" else 1}
            if kind in ("regex", "generate"):
                body = {"text": "<image>" * len(urls) + " describe", "image_data": urls,
                        "sampling_params": {"max_new_tokens": 16, "temperature": 1.0}}
                if kind == "regex":
                    body["sampling_params"]["regex"] = r"[0-9]{3}-[0-9]{4}"
                async with session.post(base + "/generate", json=body) as r:
                    await r.read()
                    return str(r.status)
            if kind in ("stream", "disconnect", "abort"):
                chat["stream"] = True
                if kind == "abort":
                    chat.update(max_tokens=400, rid=f"mm-abort-{i}")
                async with session.post(base + "/v1/chat/completions", json=chat) as r:
                    chunks = 0
                    async for _ in r.content:
                        chunks += 1
                        if kind == "abort" and chunks == 1:
                            async with session.post(base + "/abort_request", json={"rid": f"mm-abort-{i}"}) as a:
                                await a.read()
                        if kind == "disconnect" and chunks > 2:
                            break
                    return str(r.status)
            async with session.post(base + "/v1/chat/completions", json=chat) as r:
                await r.read()
                return str(r.status)

        async def worker():
            while not queue.empty():
                i, kind, urls = queue.get_nowait()
                try:
                    outcome = await one(i, kind, urls)
                except asyncio.TimeoutError:
                    outcome = "never_ended"
                except Exception as e:  # noqa: BLE001 - a reset connection is a finding, not a crash of the soak
                    outcome = f"error:{type(e).__name__}"
                outcomes[(kind, outcome)] += 1

        await asyncio.gather(*[worker() for _ in range(concurrency)])
        for _ in range(300):
            async with session.get(base + "/get_server_info") as r:
                info = await r.json()
            if r.status != 200 or "error" in info or (info["num_server_requests"] == 0 and info["num_running_reqs"] == 0
                                                      and info["num_waiting_reqs"] == 0):
                break
            await asyncio.sleep(0.2)
    return outcomes, info


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", required=True)
    p.add_argument("--num-requests", type=int, default=500)
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    args = p.parse_args(argv)
    outcomes, info = asyncio.run(soak(args.base_url.rstrip("/"), args.num_requests, args.concurrency, args.seed,
                                      args.api_key))
    unexpected = 0
    for (kind, outcome), n in sorted(outcomes.items()):
        ok = outcome == str(EXPECTED[kind])
        unexpected += 0 if ok else n
        print(f"{kind:<12}{outcome:>16}{n:>6}{'' if ok else '  UNEXPECTED'}")
    kv_used = info.get("kv_used_tokens")
    print(f"requests {sum(outcomes.values())}, unexpected {unexpected}, KV used at idle {kv_used} of "
          f"{info.get('kv_total_tokens')} tokens" + (f"; server: {info['error']}" if "error" in info else ""))
    passed = unexpected == 0 and kv_used == 0
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
