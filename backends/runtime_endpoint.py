"""RuntimeEndpoint: a braid server reached over HTTP (native API).

Sync calls use `requests` (one Session, its connection pool shared by every program thread);
streaming and the async methods use `aiohttp`. A request the server sheds (HTTP 429 or 503) is retried up to
`max_retries` times, waiting as its Retry-After says (braid.backends.retry); a stream only before its body is read.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from typing import Any, AsyncIterator, Iterator, Optional, Union

from braid.backends.base import GenOutput, LogprobRequest, Prompt
from braid.backends.native import NativeApiBackend
from braid.backends.retry import DEFAULT_MAX_RETRIES, RETRY_STATUSES, RetryPolicy
from braid.chat_template import ChatTemplate
from braid.errors import BackendError, BackendRequestError
from braid.runtime.sampling_params import SamplingParams

DEFAULT_TIMEOUT_S = 600.0
_POOL_SIZE = 128  # keep-alive connections: run_batch runs up to 64 programs, fork branches more


class RuntimeEndpoint(NativeApiBackend):
    def __init__(self, base_url: str, api_key: Optional[str] = None, timeout: float = DEFAULT_TIMEOUT_S,
                 chat_template: Union[None, str, ChatTemplate] = None, max_retries: int = DEFAULT_MAX_RETRIES):
        super().__init__(chat_template)
        self.retry_policy = RetryPolicy(max_retries=max_retries)
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self._session_lock = threading.Lock()
        self._requests_session = None
        self._model_info: Optional[dict] = None

    def __repr__(self) -> str:
        return f"RuntimeEndpoint({self.base_url!r})"

    # ---- sync transport -------------------------------------------------------------------------
    def _headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _session(self):
        if self._requests_session is None:
            with self._session_lock:
                if self._requests_session is None:
                    import requests
                    from requests.adapters import HTTPAdapter

                    session = requests.Session()
                    adapter = HTTPAdapter(pool_connections=1, pool_maxsize=_POOL_SIZE)
                    session.mount("http://", adapter)
                    session.mount("https://", adapter)
                    self._requests_session = session
        return self._requests_session

    def shutdown(self) -> None:
        session, self._requests_session = self._requests_session, None
        if session is not None:
            session.close()

    def _retry_delay(self, status: int, headers: Any, text: str, retries_done: int, url: str) -> Optional[float]:
        """Seconds to wait before sending a shed request again; None: not to be retried."""
        if status not in RETRY_STATUSES:
            return None
        message, _ = _error_fields(_payload(text) or {"error": {"message": text[:200]}}, status)
        return self.retry_policy.retry_delay(status, headers.get("Retry-After"), retries_done, url, message)

    def _request(self, method: str, path: str, body: Optional[dict] = None, timeout: Optional[float] = None,
                 retry: bool = True) -> Any:
        import requests

        url = self.base_url + path
        for retries_done in itertools.count():
            try:
                resp = self._session().request(method, url, json=body, headers=self._headers(),
                                               timeout=timeout or self.timeout)
            except requests.RequestException as e:
                raise BackendError(f"cannot reach braid server at {url}: {e}") from None
            delay = self._retry_delay(resp.status_code, resp.headers, resp.text, retries_done, url) if retry else None
            if delay is None:
                return _decode(resp.status_code, resp.text, url, retries_done + 1)
            time.sleep(delay)

    def _generate(self, body: dict) -> Any:
        return self._request("POST", "/generate", body)

    def _generate_stream(self, body: dict) -> Iterator[dict]:
        return _drive(self._astream("/generate", body))

    # ---- async transport ------------------------------------------------------------------------
    def _client_timeout(self):
        import aiohttp

        return aiohttp.ClientTimeout(total=self.timeout)

    async def _post_until_accepted(self, session: Any, url: str, body: dict) -> tuple[Any, int]:
        """POST `body`, again after each shed answer while retry_policy allows; the last response (its body not
        yet read unless it was an error) and the number of requests sent."""
        for retries_done in itertools.count():
            resp = await session.post(url, json=body, headers=self._headers())
            if resp.status not in RETRY_STATUSES:
                return resp, retries_done + 1
            text = await resp.text()
            delay = self._retry_delay(resp.status, resp.headers, text, retries_done, url)
            if delay is None:
                return resp, retries_done + 1
            await asyncio.sleep(delay)

    async def _apost(self, path: str, body: dict) -> Any:
        import aiohttp

        url = self.base_url + path
        try:
            async with aiohttp.ClientSession(timeout=self._client_timeout()) as session:
                resp, attempts = await self._post_until_accepted(session, url, body)
                async with resp:
                    return _decode(resp.status, await resp.text(), url, attempts)
        except aiohttp.ClientError as e:
            raise BackendError(f"cannot reach braid server at {url}: {e}") from None

    async def _astream(self, path: str, body: dict) -> AsyncIterator[dict]:
        """Each `data: {...}` object of an SSE response, until `data: [DONE]`."""
        import aiohttp

        url = self.base_url + path
        try:
            async with aiohttp.ClientSession(timeout=self._client_timeout()) as session:
                resp, attempts = await self._post_until_accepted(session, url, body)
                async with resp:
                    if resp.status >= 400:
                        _decode(resp.status, await resp.text(), url, attempts)
                    buffer = b""
                    async for piece in resp.content.iter_any():
                        buffer += piece
                        *lines, buffer = buffer.split(b"\n")
                        for line in lines:
                            obj = _sse_object(line)
                            if obj is _DONE:
                                return
                            if obj is not None:
                                yield obj
                    obj = _sse_object(buffer)
                    if obj is not None and obj is not _DONE:
                        yield obj
        except aiohttp.ClientError as e:
            raise BackendError(f"cannot reach braid server at {url}: {e}") from None

    async def agenerate(self, prompt: Prompt, sampling_params: SamplingParams,
                        logprobs: LogprobRequest = LogprobRequest()) -> GenOutput:
        from braid.backends.native import _one

        out = _one(await self._apost("/generate", self.request_body(prompt, sampling_params, logprobs)))
        self.token_usage.add_meta(out.get("meta_info"))
        return GenOutput(out.get("text", ""), out.get("meta_info", {}))

    async def agenerate_stream(self, prompt: Prompt, sampling_params: SamplingParams,
                               logprobs: LogprobRequest = LogprobRequest()) -> AsyncIterator[tuple[str, Optional[dict]]]:
        """Async twin of generate_stream: (delta, None) pieces, then ("", meta_info)."""
        sent, meta = "", {}
        async for chunk in self._astream("/generate", self.request_body(prompt, sampling_params, logprobs, stream=True)):
            text = chunk.get("text", "")
            delta = text[len(sent):] if text.startswith(sent) else text
            sent = text if text.startswith(sent) else sent + text
            meta = chunk.get("meta_info", meta)
            if delta:
                yield delta, None
        self.token_usage.add_meta(meta)
        yield "", meta

    # ---- server routes --------------------------------------------------------------------------
    def get_model_info(self) -> dict:
        if self._model_info is None:
            self._model_info = self._request("GET", "/get_model_info")
        return self._model_info

    def _apply_chat_template(self, messages: list[dict]) -> str:
        return self._request("POST", "/apply_chat_template", {"messages": messages})["text"]

    def get_server_info(self) -> dict:
        return self._request("GET", "/get_server_info")

    def get_server_args(self) -> dict:
        """The server's ServerArgs as JSON (GET /get_server_args)."""
        return self._request("GET", "/get_server_args")

    def health(self, timeout: float = 5.0) -> bool:
        try:
            self._request("GET", "/health", timeout=timeout, retry=False)  # a probe: its caller polls
            return True
        except (BackendError, BackendRequestError):
            return False

    def flush_cache(self) -> None:
        self._request("POST", "/flush_cache")


_DONE = object()


def _sse_object(line: bytes) -> Any:
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    if data == b"[DONE]":
        return _DONE
    try:
        obj = json.loads(data)
    except ValueError:
        raise BackendError(f"malformed server-sent event: {data[:200]!r}") from None
    if isinstance(obj, dict) and "error" in obj:
        _raise_error(obj, 400 if obj.get("error", {}).get("type") == "invalid_request_error" else 500, "stream")
    return obj


def _error_fields(payload: Any, status: int) -> tuple[str, Optional[str]]:
    """An error answer's (message, param)."""
    message, param = f"HTTP {status}", None
    if isinstance(payload, dict):
        err = payload.get("error", payload)
        if isinstance(err, dict):
            message = err.get("message") or message
            param = err.get("param")
        elif isinstance(err, str):
            message = err
    return message, param


def _raise_error(payload: Any, status: int, url: str, attempts: int = 1) -> None:
    message, param = _error_fields(payload, status)
    if attempts > 1:
        message = f"{message} (gave up after {attempts} attempts)"
    if 400 <= status < 500:
        raise BackendRequestError(f"server rejected the request ({status}): {message}", status, param)
    raise BackendError(f"server error ({status}) at {url}: {message}")


def _payload(text: str) -> Any:
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


def _decode(status: int, text: str, url: str, attempts: int = 1) -> Any:
    """The response's JSON (its text when not JSON); an error status raised as braid's error. `attempts`: how many
    requests the answer took (an error after retries says so)."""
    payload = _payload(text)
    if status >= 400:
        _raise_error(payload if payload is not None else {"error": {"message": text[:500]}}, status, url, attempts)
    return text if payload is None else payload  # non-JSON answers (e.g. /health) come back as text


def _drive(agen: AsyncIterator[Any]) -> Iterator[Any]:
    """Iterate an async generator from synchronous code on a private event loop."""
    loop = asyncio.new_event_loop()
    try:
        while True:
            try:
                yield loop.run_until_complete(agen.__anext__())
            except StopAsyncIteration:
                return
    finally:
        loop.run_until_complete(agen.aclose())
        loop.close()
