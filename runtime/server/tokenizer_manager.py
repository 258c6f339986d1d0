"""The server process's side of the runtime: tokenizer, scheduler-process handle, per-request state.

`TokenizerManager.submit()` sends one request to the scheduler and returns a `RequestHandle`; the
HTTP handler iterates `handle.updates()` (new text per choice, detokenized incrementally) and calls
`release(handle)` when it is done, which aborts the request in the scheduler if it has not finished
(a client that went away frees its KV).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

import zmq
import zmq.asyncio

from braid.runtime.sampling_params import SamplingParams
from braid.runtime.server import messages as M
from braid.runtime.server import scheduler_process
from braid.runtime.server.errors import APIError, bad_request, internal, unavailable
from braid.runtime.server.metrics import ServerMetrics

logger = logging.getLogger("braid.server")

_ABORTED = {"type": "abort", "matched": None}


class SchedulerStartError(RuntimeError):
    pass


@dataclass
class ChoiceState:
    """Everything received so far for one choice (one of the n outputs of a request)."""

    index: int
    detokenizer: Any
    output_ids: list[int] = field(default_factory=list)
    text: str = ""  # text emitted so far (stop strings trimmed, no partial characters)
    output_token_logprobs: list = field(default_factory=list)  # [(logprob, id)]
    output_top_logprobs: list = field(default_factory=list)  # [[(logprob, id), ...] | None]
    input_token_logprobs: Optional[list] = None
    input_top_logprobs: Optional[list] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens_wo_jump_forward: int = 0
    finish_reason: Optional[dict] = None
    finished: bool = False

    def meta_info(self, rid: str) -> dict:
        return {
            "id": rid,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens_wo_jump_forward": self.completion_tokens_wo_jump_forward,
            "finish_reason": self.finish_reason,
        }


@dataclass
class ChoiceUpdate:
    """One step of one choice: `delta` is the new text; the `new_*` lists are this step's logprobs."""

    choice: ChoiceState
    delta: str
    text: str  # cumulative text at this step (the choice object keeps changing after)
    output_ids: list[int]  # cumulative output ids at this step
    new_token_logprobs: list
    new_top_logprobs: list
    finished: bool

    @property
    def index(self) -> int:
        return self.choice.index


class RequestHandle:
    def __init__(self, manager: "TokenizerManager", rid: str, prompt_ids: list[int], sampling_params: SamplingParams,
                 return_logprob: bool, top_logprobs_num: int, stream: bool):
        self.manager = manager
        self.stream = stream
        self.rid = rid
        self.prompt_ids = prompt_ids
        self.sampling_params = sampling_params
        self.return_logprob = return_logprob
        self.top_logprobs_num = top_logprobs_num
        self.n = sampling_params.n
        self.queue: asyncio.Queue = asyncio.Queue()
        self.choices: dict[int, ChoiceState] = {}
        self.created = time.time()
        self._arrival = time.perf_counter()
        self._last_token_time: Optional[float] = None
        self.num_finished = 0
        self.released = False

    @property
    def finished(self) -> bool:
        return self.num_finished >= self.n

    def choice(self, index: int) -> ChoiceState:
        c = self.choices.get(index)
        if c is None:
            c = ChoiceState(index, self.manager.new_detokenizer(self.sampling_params), prompt_tokens=len(self.prompt_ids))
            self.choices[index] = c
        return c

    def ordered_choices(self) -> list[ChoiceState]:
        return [self.choice(i) for i in range(self.n)]

    async def updates(self) -> AsyncIterator[ChoiceUpdate]:
        """Yields until every choice finished; raises APIError if the scheduler rejected the request."""
        while not self.finished:
            item = await self.queue.get()
            if isinstance(item, APIError):
                self.num_finished = self.n
                raise item
            if isinstance(item, _LocalAbort):
                for c in self.ordered_choices():
                    if not c.finished:
                        yield self._apply(self._abort_output(c, item.message))
                continue
            error = _grammar_failure(item, self.sampling_params)
            if error is not None:
                self.num_finished = self.n
                raise error
            update = self._apply(item)
            if update is not None:
                yield update

    def _apply(self, out: M.Output) -> Optional[ChoiceUpdate]:
        c = self.choice(out.index)
        if c.finished:
            return None
        now = time.perf_counter()
        metrics = self.manager.metrics
        if out.new_token_ids and self.stream:  # non-streamed requests report all tokens at once: no latencies
            if self._last_token_time is None:
                metrics.observe_first_token(now - self._arrival)
            else:
                metrics.observe_tokens(now - self._last_token_time, len(out.new_token_ids))
            self._last_token_time = now
        offset = out.output_ids_offset
        del c.output_ids[offset:]
        c.output_ids.extend(out.new_token_ids)
        new_lp = [tuple(x) for x in out.output_token_logprobs or []]
        new_top = [[tuple(y) for y in x] if x is not None else None for x in out.output_top_logprobs or []]
        if self.return_logprob:
            # logprobs only ever append (jump-forward tokens were not sampled and carry none)
            c.output_token_logprobs.extend(new_lp)
            c.output_top_logprobs.extend(new_top)
            if out.input_token_logprobs is not None:
                c.input_token_logprobs = [tuple(x) for x in out.input_token_logprobs]
            if out.input_top_logprobs is not None:
                c.input_top_logprobs = [[tuple(y) for y in x] if x is not None else None for x in out.input_top_logprobs]
        c.prompt_tokens = out.prompt_tokens or c.prompt_tokens
        c.completion_tokens = out.completion_tokens
        c.cached_tokens = out.cached_tokens
        c.completion_tokens_wo_jump_forward = out.completion_tokens_wo_jump_forward
        new_ids, detok_reason = list(out.new_token_ids), out.finish_reason
        matched = (out.finish_reason or {}).get("matched")
        if out.finished and isinstance(matched, int) and new_ids and new_ids[-1] == matched:
            # the stop token is no part of the text: never show it to the detokenizer
            new_ids, detok_reason = new_ids[:-1], {**out.finish_reason, "matched": None}
        delta = c.detokenizer.update(offset, new_ids)
        if out.finished:
            c.finish_reason = out.finish_reason or _ABORTED
            delta += c.detokenizer.finish(detok_reason)
            c.finished = True
            self.num_finished += 1
            if self.finished:
                metrics.observe_finished(time.perf_counter() - self._arrival, aborted=c.finish_reason.get("type") == "abort")
        c.text += delta
        return ChoiceUpdate(c, delta, c.text, list(c.output_ids), new_lp if self.return_logprob else [],
                            new_top if self.return_logprob else [], c.finished)

    def abort_locally(self, message: Optional[str] = None) -> None:
        """Finish every unfinished choice with finish_reason abort (later scheduler outputs are dropped)."""
        self.queue.put_nowait(_LocalAbort(message))

    def _abort_output(self, c: ChoiceState, message: Optional[str]) -> M.Output:
        reason = dict(_ABORTED)
        if message:
            reason["message"] = message
        return M.Output(rid=self.rid, index=c.index, output_ids_offset=len(c.output_ids), finished=True,
                        finish_reason=reason, prompt_tokens=c.prompt_tokens, completion_tokens=c.completion_tokens,
                        cached_tokens=c.cached_tokens,
                        completion_tokens_wo_jump_forward=c.completion_tokens_wo_jump_forward)


def _grammar_failure(out: M.Output, sp: SamplingParams) -> Optional[APIError]:
    """A request the scheduler aborted because its regex/schema could not be compiled: the client's error."""
    reason = out.finish_reason if out.finished else None
    if not reason or reason.get("type") != "abort" or not str(reason.get("message", "")).startswith("grammar error"):
        return None
    return bad_request(reason["message"], param="regex" if sp.regex is not None else "json_schema")


@dataclass
class _LocalAbort:
    message: Optional[str] = None


class TokenizerManager:
    def __init__(self, server_args):
        self.server_args = server_args
        self.tokenizer = None
        self.context_len = 0
        self.vocab_size = 0
        self.model_info: dict = {}
        self.metrics = ServerMetrics(server_args.model_name)
        self.handles: dict[str, RequestHandle] = {}
        self.proc = None
        self.dead: Optional[str] = None  # why the scheduler is gone, once it is
        self.dead_event = asyncio.Event()
        self.draining = False
        self._ctx: Optional[zmq.asyncio.Context] = None
        self._send = None
        self._recv = None
        self._ipc_dir: Optional[str] = None
        self._req_ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []
        self._detokenizer_cls = None
        self._idle = asyncio.Event()
        self._idle.set()

    # ---- start / stop -------------------------------------------------------------------------
    async def start(self, timeout_s: float = 900.0) -> None:
        from braid.runtime.loader.tokenizer import get_tokenizer
        from braid.runtime.server.detokenizer import IncrementalDetokenizer

        self._detokenizer_cls = IncrementalDetokenizer
        self._ipc_dir = tempfile.mkdtemp(prefix="braid-ipc-")
        to_addr = f"ipc://{os.path.join(self._ipc_dir, 'to_scheduler')}"
        from_addr = f"ipc://{os.path.join(self._ipc_dir, 'from_scheduler')}"
        self._ctx = zmq.asyncio.Context(1)
        self._send = self._ctx.socket(zmq.PUSH)
        self._send.setsockopt(zmq.LINGER, 0)
        self._send.setsockopt(zmq.SNDHWM, 0)  # never block on a busy scheduler; sends fail only with no peer
        self._send.bind(to_addr)
        self._recv = self._ctx.socket(zmq.PULL)
        self._recv.setsockopt(zmq.LINGER, 0)
        self._recv.bind(from_addr)
        self.proc = scheduler_process.spawn(self.server_args, to_addr, from_addr)
        tokenizer_task = asyncio.ensure_future(asyncio.to_thread(get_tokenizer, self.server_args))
        try:
            ready = await self._wait_ready(timeout_s)
            self.tokenizer = await tokenizer_task
        except BaseException:
            tokenizer_task.cancel()
            await self.close()
            raise
        self.context_len = ready.context_len
        self.vocab_size = ready.vocab_size
        self.model_info = dict(ready.model_info)
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._watch_process())]

    async def _wait_ready(self, timeout_s: float) -> M.Ready:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if await self._recv.poll(500):
                msg = M.decode_from_scheduler(await self._recv.recv())
                if isinstance(msg, M.Ready):
                    return msg
                if isinstance(msg, M.Fatal):
                    raise SchedulerStartError(f"scheduler failed to start:\n{msg.message}")
            elif self.proc.poll() is not None:
                raise SchedulerStartError(f"scheduler process exited with code {self.proc.returncode} before it was ready")
        raise SchedulerStartError(f"scheduler not ready after {timeout_s:.0f}s")

    async def shutdown(self, timeout_s: float) -> None:
        """Refuse new requests, let in-flight ones finish for up to `timeout_s`, abort the rest, stop the scheduler."""
        self.draining = True
        if self.handles:
            logger.info("draining %d in-flight request(s) (up to %.0fs)", len(self.handles), timeout_s)
            try:
                await asyncio.wait_for(self._idle.wait(), timeout_s)
            except asyncio.TimeoutError:
                logger.warning("aborting %d request(s) still running after %.0fs", len(self.handles), timeout_s)
                for handle in list(self.handles.values()):
                    await self._send_quietly(M.AbortReq(handle.rid))
                    handle.abort_locally("server shutting down")
                # give the handlers a moment to write their final chunks
                try:
                    await asyncio.wait_for(self._idle.wait(), 2.0)
                except asyncio.TimeoutError:
                    pass
        await self.close()

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        self._tasks = []
        if self.proc is not None and self.proc.poll() is None:
            try:
                await self._send.send(M.encode(M.ShutdownReq()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            for _ in range(50):
                if self.proc.poll() is not None:
                    break
                await asyncio.sleep(0.1)
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    await asyncio.to_thread(self.proc.wait, 5)
                except Exception:
                    self.proc.kill()
        for sock in (self._send, self._recv):
            if sock is not None:
                sock.close(0)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._ipc_dir:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None

    # ---- tokenization ---------------------------------------------------------------------------
    def new_detokenizer(self, sampling_params: SamplingParams):
        return self._detokenizer_cls(self.tokenizer, sampling_params)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def apply_chat_template(self, messages: list[dict]) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template; use /v1/completions", param="messages")
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja errors from a template that rejects the conversation
            raise bad_request(f"chat template failed on these messages: {e}", param="messages") from None

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def max_new_tokens_default(self, prompt_len: int) -> int:
        """What a request without max_tokens may generate: the rest of the context (and of the KV pool)."""
        room = self.context_len
        kv_total = self.model_info.get("kv_total_tokens")
        if isinstance(kv_total, int):
            room = min(room, kv_total)
        return max(room - prompt_len, 0)

    def check_length(self, prompt_len: int, max_new_tokens: int, prompt_param: str, max_param: str) -> None:
        if prompt_len >= self.context_len:
            raise bad_request(f"The prompt is {prompt_len} tokens, the model's context is {self.context_len} tokens",
                              param=prompt_param, code="context_length_exceeded")
        if prompt_len + max_new_tokens > self.context_len:
            raise bad_request(f"The prompt ({prompt_len} tokens) plus {max_param} ({max_new_tokens}) exceeds the "
                              f"model's context of {self.context_len} tokens", param=max_param,
                              code="context_length_exceeded")

    # ---- requests ---------------------------------------------------------------------------------
    def check_accepting(self) -> None:
        if self.dead:
            raise unavailable(f"the scheduler is not running: {self.dead}")
        if self.draining:
            raise unavailable("the server is shutting down")

    async def submit(self, input_ids: list[int], sampling_params: SamplingParams, *, rid: Optional[str] = None,
                     return_logprob: bool = False, logprob_start_len: int = -1, top_logprobs_num: int = 0,
                     stream: bool = False, image_data: Any = None) -> RequestHandle:
        self.check_accepting()
        rid = rid or uuid.uuid4().hex
        if rid in self.handles:
            raise bad_request(f"a request with rid {rid!r} is already running", param="rid")
        if return_logprob and logprob_start_len >= len(input_ids):
            raise bad_request(f"logprob_start_len must be < the prompt length ({len(input_ids)})", param="logprob_start_len")
        handle = RequestHandle(self, rid, input_ids, sampling_params, return_logprob, top_logprobs_num, stream)
        self.handles[rid] = handle
        self._idle.clear()
        try:
            await self._send_msg(M.GenerateReq(rid=rid, input_ids=input_ids, sampling_params=sampling_params.to_dict(),
                                               return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                                               top_logprobs_num=top_logprobs_num, stream=stream, image_data=image_data))
        except APIError:
            self.handles.pop(rid, None)
            if not self.handles:
                self._idle.set()
            raise
        return handle

    async def release(self, handle: RequestHandle) -> None:
        """Forget a request; abort it in the scheduler when some choice has not finished."""
        if handle.released:
            return
        handle.released = True
        if self.handles.get(handle.rid) is handle:
            del self.handles[handle.rid]
        if not handle.finished:
            self.metrics.requests_aborted.inc()
            if not self.dead:
                await self._send_quietly(M.AbortReq(handle.rid))
        if not self.handles:
            self._idle.set()

    async def abort(self, rid: str) -> bool:
        handle = self.handles.get(rid)
        if handle is None:
            return False
        await self._send_msg(M.AbortReq(rid))
        handle.abort_locally()
        return True

    async def flush_cache(self) -> bool:
        return (await self._call(lambda rid: M.FlushCacheReq(rid))).ok

    async def get_stats(self) -> dict:
        return (await self._call(lambda rid: M.GetStatsReq(rid))).stats

    async def _call(self, make, timeout_s: float = 30.0):
        if self.dead:
            raise unavailable(f"the scheduler is not running: {self.dead}")
        req_id = next(self._req_ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[req_id] = fut
        try:
            await self._send_msg(make(req_id))
            return await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            raise internal("the scheduler did not answer in time") from None
        finally:
            self._pending.pop(req_id, None)

    async def _send_quietly(self, msg) -> None:
        """For clean-up paths: a scheduler that is gone has nothing left to abort."""
        try:
            await self._send_msg(msg)
        except APIError:
            pass

    async def _send_msg(self, msg) -> None:
        try:
            # NOBLOCK: a PUSH socket with no connected peer would wait forever
            await self._send.send(M.encode(msg), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise unavailable("the scheduler process is not connected") from None

    # ---- receiving --------------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        while True:
            data = await self._recv.recv(copy=False)
            try:
                msg = M.decode_from_scheduler(data.bytes)
            except Exception:
                logger.exception("undecodable message from the scheduler")
                continue
            if isinstance(msg, M.OutputBatch):
                for out in msg.outputs:
                    handle = self.handles.get(out.rid)
                    if handle is not None:
                        handle.queue.put_nowait(out)
            elif isinstance(msg, M.ReqError):
                handle = self.handles.get(msg.rid)
                if handle is not None:
                    err = bad_request(msg.message, param=msg.param) if msg.user_error else internal(msg.message)
                    handle.queue.put_nowait(err)
            elif isinstance(msg, (M.FlushCacheResult, M.Stats)):
                fut = self._pending.get(msg.req_id)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, M.Fatal):
                self._on_dead(f"scheduler crashed: {msg.message.strip().splitlines()[-1]}")
                logger.error("scheduler crashed:\n%s", msg.message)

    async def _watch_process(self) -> None:
        while self.proc.poll() is None:
            await asyncio.sleep(1.0)
        if not self.draining:
            self._on_dead(f"scheduler process exited with code {self.proc.returncode}")

    def _on_dead(self, reason: str) -> None:
        if self.dead:
            return
        self.dead = reason
        self.dead_event.set()
        logger.error(reason)
        for handle in list(self.handles.values()):
            handle.queue.put_nowait(internal(reason))
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(unavailable(reason))


async def merge_updates(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, ChoiceUpdate]]:
    """Updates of several requests as they arrive, tagged with the handle's position in `handles`."""
    if len(handles) == 1:
        async for update in handles[0].updates():
            yield 0, update
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, handle: RequestHandle) -> None:
        try:
            async for update in handle.updates():
                queue.put_nowait((i, update))
        except APIError as e:
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, APIError):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
