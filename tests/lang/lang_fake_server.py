"""A tiny deterministic stand-in for braid's server (native API + the /v1 routes the OpenAI backend
uses), for testing the HTTP backends' wire format without a model.

Characters are tokens (id = ord). The logprob of character i (i >= 1) is -(1 + ord(c) % 7) / 10; the
first has none. Unconstrained generations answer "fake reply"; regex / json_schema ones a matching
example. Every request body is recorded in `FakeServer.requests` as (path, body).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lang_examples import example_for_regex, instance_for_schema  # noqa: E402

from braid.runtime.sampling_params import SamplingParams, SamplingParamsError  # noqa: E402

REPLY = "fake reply"


def char_logprob(text: str, i: int):
    return None if i == 0 else -(1 + ord(text[i]) % 7) / 10


def _output(sp: dict, default: str = REPLY) -> str:
    if sp.get("regex"):
        return example_for_regex(sp["regex"])
    if sp.get("json_schema"):
        return json.dumps(instance_for_schema(sp["json_schema"]))
    text = default
    for stop in ([sp["stop"]] if isinstance(sp.get("stop"), str) else sp.get("stop") or []):
        if stop in text:
            text = text[:text.index(stop)]
    return text[:sp.get("max_new_tokens", 128)]


class FakeServer:
    def __init__(self, chat_template=None, model_path="fake-model", api_key=None, multimodal=False):
        self.requests: list[tuple[str, dict]] = []
        self.multimodal = multimodal
        self.chat_template = chat_template
        self.model_path = model_path
        self.api_key = api_key
        self.flushes = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, status, payload):
                data = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self):
                if server.api_key and self.headers.get("Authorization") != f"Bearer {server.api_key}":
                    self._send(401, {"error": {"message": "bad api key", "type": "auth", "param": None, "code": 401}})
                    return False
                return True

            def do_GET(self):
                if self.path == "/health":
                    return self._send(200, "ok")
                if not self._authorized():
                    return
                if self.path == "/get_model_info":
                    return self._send(200, {"model_path": server.model_path, "context_length": 2048,
                                            "vocab_size": 256, "chat_template": server.chat_template,
                                            "is_multimodal": server.multimodal})
                if self.path == "/get_server_info":
                    return self._send(200, {"num_running_reqs": 0, "num_waiting_reqs": 0})
                if self.path == "/get_server_args":
                    return self._send(200, {"model_path": server.model_path, "max_total_tokens": 4096})
                self._send(404, {"error": {"message": "no route", "type": "not_found"}})

            def do_POST(self):
                if not self._authorized():
                    return
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                with server._lock:
                    server.requests.append((self.path, body))
                routes = {"/generate": server.generate, "/flush_cache": server.flush,
                          "/v1/chat/completions": server.chat, "/v1/completions": server.completions}
                if self.path not in routes:
                    return self._send(404, {"error": {"message": "no route", "type": "not_found"}})
                try:
                    result = routes[self.path](body)
                except SamplingParamsError as e:
                    return self._send(400, {"error": {"message": str(e), "type": "invalid_request_error",
                                                      "param": e.param, "code": 400}})
                if isinstance(result, list) and body.get("stream"):
                    return self._stream(result)
                self._send(200, result)

            def _stream(self, events):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                for event in events:
                    self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                    self.wfile.flush()
                    time.sleep(0.001)
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                self.close_connection = True

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def start(self) -> "FakeServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def bodies(self, path: str) -> list[dict]:
        with self._lock:
            return [b for p, b in self.requests if p == path]

    # ---- native API ---------------------------------------------------------------------------------
    def _one(self, text: str, body: dict) -> dict:
        sp = body.get("sampling_params") or {}
        SamplingParams.from_dict(sp).verify()
        out = _output(sp)
        meta = {"id": "r", "prompt_tokens": len(text), "completion_tokens": len(out), "cached_tokens": 0,
                "finish_reason": {"type": "stop" if len(out) < sp.get("max_new_tokens", 128) else "length",
                                  "matched": None}}
        if body.get("return_logprob"):
            start = body.get("logprob_start_len", -1)
            meta["input_token_logprobs"] = ([] if start < 0 else
                                            [[char_logprob(text, i), ord(text[i])] for i in range(start, len(text))])
            meta["output_token_logprobs"] = [[-0.5, ord(c)] for c in out]
        return {"text": out, "output_ids": [ord(c) for c in out], "meta_info": meta}

    def generate(self, body: dict):
        text = body["text"]
        if isinstance(text, list):
            return [self._one(t, body) for t in text]
        result = self._one(text, body)
        if not body.get("stream"):
            return result
        out = result["text"]
        return [{**result, "text": out[:i]} for i in range(2, len(out), 2)] + [result]

    def flush(self, body: dict):
        self.flushes += 1
        return "ok"

    # ---- OpenAI-compatible routes ---------------------------------------------------------------------
    def _openai_sp(self, body: dict) -> dict:
        sp = {"max_new_tokens": body.get("max_tokens", 128), "stop": body.get("stop"), "regex": body.get("regex")}
        rf = body.get("response_format") or {}
        if body.get("json_schema"):
            sp["json_schema"] = body["json_schema"]
        elif rf.get("type") == "json_schema":
            sp["json_schema"] = json.dumps(rf["json_schema"]["schema"])
        return sp

    def chat(self, body: dict):
        content = _output(self._openai_sp(body), default="chat reply")
        usage = {"prompt_tokens": 5, "completion_tokens": len(content), "total_tokens": 5 + len(content)}
        if body.get("stream"):
            pieces = [content[i:i + 3] for i in range(0, len(content), 3)]
            return [{"id": "c", "object": "chat.completion.chunk", "created": 0, "model": body["model"],
                     "choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}]} for p in pieces] + [
                {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": body["model"],
                 "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
        return {"id": "c", "object": "chat.completion", "created": 0, "model": body["model"], "usage": usage,
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": content}}]}

    def completions(self, body: dict):
        prompt = body["prompt"]
        if body.get("echo"):
            text = prompt
            logprobs = {"tokens": list(text), "token_logprobs": [char_logprob(text, i) for i in range(len(text))],
                        "text_offset": list(range(len(text))), "top_logprobs": None}
            return {"id": "e", "object": "text_completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": "length"}]}
        out = _output(self._openai_sp(body), default="completion reply")
        if body.get("stream"):
            return [{"id": "s", "object": "text_completion", "created": 0, "model": body["model"],
                     "choices": [{"index": 0, "text": out[i:i + 3], "finish_reason": None, "logprobs": None}]}
                    for i in range(0, len(out), 3)]
        return {"id": "g", "object": "text_completion", "created": 0, "model": body["model"],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(out), "total_tokens": 0},
                "choices": [{"index": 0, "text": out, "logprobs": None, "finish_reason": "stop"}]}


if __name__ == "__main__":
    # stand-in for `python -m braid.launch_server ... --port N`: serve on N until killed
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    fake = FakeServer()
    fake.httpd.server_close()
    fake.httpd = ThreadingHTTPServer(("127.0.0.1", port), fake.httpd.RequestHandlerClass)
    print(f"fake server on {port} args={args}", flush=True)
    fake.httpd.serve_forever()
