"""The server process's side of the runtime: the scheduler process's client, the tokenizer, the served model.

`await TokenizerManager.prepare()` turns a route's input into a `Req` (`prepare.prepare_request` on a
tokenizer thread, so a big prompt never stalls the event loop; errors as HTTP 400s, 429 past
--max-queued-requests); `submit(req)` sends it to the scheduler and returns a `RequestHandle`
(runtime/server/request_handle.py); `release(handle)` aborts it in the scheduler if it has not finished
(a client that went away frees its KV).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import itertools
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from typing import Any, Mapping, Optional, Union

import zmq
import zmq.asyncio

from braid.runtime.core import Req
from braid.runtime.sampling_params import SamplingParams, SamplingParamsError
from braid.runtime.ipc import messages as M
from braid.runtime.processes import scheduler_process
from braid.runtime.chat_format import content_text, render_chat_template, resolve_content_format, with_chat_template
from braid.runtime.server.errors import APIError, bad_request, for_kind, internal, too_many_requests, unavailable
from braid.runtime.server.metrics import ServerMetrics
from braid.runtime.request_io.prepare import RequestError, ServedModel, prepare_request
from braid.runtime.server.request_handle import DEADLINE_GRACE_S, RequestHandle

logger = logging.getLogger("braid.server")

SHUTDOWN_ABORT_MESSAGE = "the server is shutting down; the text is what was generated before"
LORA_LOAD_TIMEOUT_S = 600.0  # reading a large adapter folder on a slow disk
ABORT_GRACE_S = DEADLINE_GRACE_S  # how long /abort_request waits for the scheduler's abort output


class SchedulerStartError(RuntimeError):
    pass


def last_line(traceback_text: str) -> str:
    """A traceback's last line: the exception and its message."""
    lines = [line for line in traceback_text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else traceback_text


class TokenizerManager:
    def __init__(self, server_args):
        self.server_args = server_args
        self.tokenizer = None
        self.context_len = 0
        self.vocab_size = 0
        self.model_info: dict = {}
        self.served_model: Optional[ServedModel] = None
        # the LoRA adapters requests may name, {name: folder}: --lora-paths, then /load_lora_adapter and
        # /unload_lora_adapter (an adapter being unloaded is gone from here at once)
        self.lora_adapters: dict[str, str] = dict(server_args.lora_adapters) if server_args.enable_lora else {}
        self.lora_unloading: set[str] = set()
        self.chat_content_format = "string"  # how the chat template takes content (runtime/chat_format.py)
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
        self._idle = asyncio.Event()
        self._idle.set()
        self._preparing = 0  # prepare() calls under way: they count against --max-queued-requests too
        threads = server_args.tokenizer_threads or min(4, os.cpu_count() or 1)
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="braid-tokenize")
        # one thread decodes the scheduler's messages and applies each step's outputs to the requests' choices
        # (detokenization, stop strings) in arrival order, one task per step for all requests: none of that runs
        # on the event loop, which only writes the results
        self._detokenize_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="braid-detokenize")
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    # ---- start / stop -------------------------------------------------------------------------
    async def start(self, timeout_s: float = 900.0) -> None:
        from braid.runtime.loader.gguf import release_gguf_readers
        from braid.runtime.loader.tokenizer import get_tokenizer

        self._loop = asyncio.get_running_loop()
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
            self.tokenizer = with_chat_template(await tokenizer_task, self.server_args.chat_template)
            self.chat_content_format = resolve_content_format(self.server_args.chat_template_content_format,
                                                              getattr(self.tokenizer, "chat_template", None))
            logger.info("chat template content format: %s (--chat-template-content-format %s)",
                        self.chat_content_format, self.server_args.chat_template_content_format)
            release_gguf_readers()  # a GGUF's tokenizer conversion is on disk now
        except BaseException:
            tokenizer_task.cancel()
            await self.close()
            raise
        self.context_len = ready.context_len
        self.vocab_size = ready.vocab_size
        self.model_info = dict(ready.model_info)
        self.served_model = ServedModel.from_model_info(self.server_args.model_path, self.server_args.model_name,
                                                        self.tokenizer, self.context_len, self.vocab_size,
                                                        self.model_info)
        self.served_model = dataclasses.replace(self.served_model, lora_names=tuple(self.lora_adapters))
        if self.served_model.is_multimodal:
            from braid.runtime.multimodal.prompt import MultimodalPreparer

            self.served_model = dataclasses.replace(self.served_model,
                                                    multimodal=MultimodalPreparer.for_server(self.server_args))
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._watch_process())]

    async def _wait_ready(self, timeout_s: float) -> M.Ready:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if await self._recv.poll(500):
                msg = M.decode_from_scheduler(await self._recv.recv())
                if isinstance(msg, M.Ready):
                    return msg
                if isinstance(msg, M.Fatal):
                    logger.debug("scheduler start-up failed:\n%s", msg.message)
                    raise SchedulerStartError(f"scheduler failed to start: {last_line(msg.message)}")
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
                # the scheduler's abort output carries the tokens generated so far (a non-streamed request has
                # received none yet); a local abort only finishes what the scheduler did not answer for in time
                for handle in list(self.handles.values()):
                    handle.abort_message = SHUTDOWN_ABORT_MESSAGE
                    await self._send_quietly(M.AbortReq(handle.rid))
                if not await self._wait_idle(2.0):
                    for handle in list(self.handles.values()):
                        handle.abort_locally(SHUTDOWN_ABORT_MESSAGE)
                    await self._wait_idle(2.0)  # the handlers write their final chunks
        await self.close()

    async def _wait_idle(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    async def close(self) -> None:
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self._detokenize_pool.shutdown(wait=False, cancel_futures=True)
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

    # ---- tokenization and request preparation -----------------------------------------------------
    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        limit = self.server_args.max_prompt_chars
        if num_chars > limit:
            what = "the messages' text is" if param == "messages" else "the prompt is"
            raise bad_request(f"{what} {num_chars} characters; this server accepts at most {limit} "
                              "(--max-prompt-chars)", param=param, code="prompt_too_long")

    async def apply_chat_template(self, messages: list[dict], tools: Optional[list[dict]] = None,
                                  add_generation_prompt: bool = True, continue_final_message: bool = False,
                                  template_kwargs: Optional[dict] = None) -> str:
        """The prompt text of a conversation (content: text, or template parts as chat_content.template_messages
        makes them; the template gets them in this server's content format); `tools` goes to templates that render
        tool definitions, `template_kwargs` are further template variables (vLLM's chat_template_kwargs)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template; start the server with --chat-template, or use "
                              "/v1/completions", param="messages")
        tool_chars = len(json.dumps(tools)) if tools else 0
        self.check_prompt_chars(sum(len(content_text(m.get("content"))) for m in messages) + tool_chars, "messages")
        extra = dict(template_kwargs or {})
        if tools:
            extra["tools"] = tools
        if continue_final_message:
            extra["continue_final_message"] = True
        apply = functools.partial(render_chat_template, self.tokenizer, messages, self.chat_content_format,
                                  add_generation_prompt, **extra)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, apply)
        except Exception as e:  # jinja errors from a template that rejects the conversation
            raise bad_request(f"chat template failed on these messages: {e}", param="messages") from None

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        encode = functools.partial(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)
        return list(await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, encode))

    async def detokenize(self, ids: list[int], **options: Any) -> str:
        """tokenizer.decode on a tokenizer thread (a long id list takes milliseconds)."""
        decode = functools.partial(self.tokenizer.decode, ids, **options)
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, decode)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def prepare(self, prompt: Union[str, list[int]], sampling_params: Union[None, dict, SamplingParams], *,
                      param_names: Optional[Mapping[str, str]] = None, rid: Optional[str] = None,
                      prompt_chars_checked: bool = False, **options: Any) -> Req:
        """`prepare_request` for this server's model, on a tokenizer thread; its errors become 400s, with
        parameters renamed to the route's names through `param_names` (e.g. {"max_new_tokens": "max_tokens"}).
        `prompt_chars_checked`: the caller already held the prompt's source against --max-prompt-chars (a chat
        template's output is longer than the messages it was made from)."""
        self.check_accepting()
        self.check_admission()
        param_names = param_names or {}
        if isinstance(prompt, str) and not prompt_chars_checked:
            self.check_prompt_chars(len(prompt), param_names.get("prompt", "prompt"))
        rid = rid or uuid.uuid4().hex
        if rid in self.handles:
            raise bad_request(f"a request with rid {rid!r} is already running", param="rid")
        run = functools.partial(prepare_request, self.served_model, prompt, sampling_params, rid=rid, **options)
        self._preparing += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, run)
        except (RequestError, SamplingParamsError) as e:
            message, param = str(e), e.param
            if param in param_names:
                if "_" in param:  # a field name the message quotes (max_new_tokens -> max_tokens)
                    message = message.replace(param, param_names[param])
                param = param_names[param]
            raise bad_request(message, param=param, code=getattr(e, "code", None)) from None
        finally:
            self._preparing -= 1

    # ---- requests ---------------------------------------------------------------------------------
    def check_accepting(self) -> None:
        if self.dead:
            raise unavailable(f"the scheduler is not running: {self.dead}")
        if self.draining:
            raise unavailable("the server is shutting down")

    def check_admission(self) -> None:
        """429 once the requests in flight (prepared, queued or running) pass --max-running-requests by
        --max-queued-requests."""
        queued_limit = self.server_args.max_queued_requests
        if queued_limit is None:
            return
        in_flight = len(self.handles) + self._preparing
        if in_flight >= self.server_args.max_running_requests + queued_limit:
            raise too_many_requests(queued_limit)

    async def submit(self, req: Req, snapshot_ids: bool = False, returned_n: Optional[int] = None,
                     client: str = "") -> RequestHandle:
        """Send a prepared request to the scheduler. `snapshot_ids`: each update carries the choice's output ids
        (the native stream sends them all); `returned_n`: the choices the client gets (best_of ranks n of them);
        `client`: the peer's address (the scheduler caps grammar compiles per client)."""
        self.check_accepting()
        req.client = client or ""
        if req.rid in self.handles:
            raise bad_request(f"a request with rid {req.rid!r} is already running", param="rid")
        handle = RequestHandle(req, self.tokenizer, self.metrics, self.server_args.request_timeout_s,
                               request_abort=self._abort_in_scheduler, run_in_order=self._run_in_order,
                               snapshot_ids=snapshot_ids, returned_n=returned_n)
        self.handles[req.rid] = handle
        self._idle.clear()
        try:
            await self._send_msg(M.message_from_req(req))
        except OverflowError:  # a number prepare_request's range checks missed; msgspec holds 64-bit ints only
            self.handles.pop(req.rid, None)
            if not self.handles:
                self._idle.set()
            raise bad_request("a number in the request is out of range (integers must fit in 64 bits)") from None
        except APIError:
            self.handles.pop(req.rid, None)
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
        if handle.scheduler_finished < handle.n and not self.dead:  # unfinished, or ended here (deadline, abort)
            await self._send_quietly(M.AbortReq(handle.rid))
        if not self.handles:
            self._idle.set()

    def _abort_in_scheduler(self, rid: str) -> None:
        if not self.dead:
            asyncio.get_running_loop().create_task(self._send_quietly(M.AbortReq(rid)))

    async def abort(self, rid: str) -> bool:
        """/abort_request. The scheduler's abort output carries the tokens generated so far (a non-streamed request
        has received none yet), so the request ends with it (or with its own finish, had it just finished); only if
        the scheduler reports neither within ABORT_GRACE_S (it never had the request) does it end here."""
        handle = self.handles.get(rid)
        if handle is None:
            return False
        await self._send_msg(M.AbortReq(rid))
        asyncio.get_running_loop().call_later(ABORT_GRACE_S, self._abort_if_unanswered, handle)
        return True

    @staticmethod
    def _abort_if_unanswered(handle: RequestHandle) -> None:
        if not handle.released and handle.scheduler_finished < handle.n:
            handle.abort_locally()

    async def flush_cache(self) -> bool:
        return (await self._call(lambda rid: M.FlushCacheReq(rid))).ok

    # ---- LoRA adapters while serving ----------------------------------------------------------------
    def _check_lora_enabled(self) -> None:
        if not self.server_args.enable_lora:
            raise bad_request("this server serves no LoRA adapters; start it with --enable-lora (and --max-lora-rank, "
                              "--lora-target-modules for the adapters to come) or --lora-paths", param="lora_name",
                              code="lora_disabled")

    def _set_lora_names(self) -> None:
        self.served_model = dataclasses.replace(self.served_model, lora_names=tuple(self.lora_adapters))

    async def load_lora_adapter(self, name: str, path: str) -> dict[str, str]:
        """Register the adapter folder `path` as `name` in the scheduler; -> the adapters served now. A refusal is a
        400 naming what is wrong (code lora_invalid, lora_exists, lora_unloading)."""
        self._check_lora_enabled()
        self.check_accepting()
        res = await self._call(lambda rid: M.LoadLoraReq(rid, name, path), timeout_s=LORA_LOAD_TIMEOUT_S)
        if not res.ok:
            if res.code == "internal_error":
                raise internal(res.message)
            raise bad_request(res.message, param=res.param, code=res.code)
        self.lora_adapters[name] = path
        self._set_lora_names()
        return dict(self.lora_adapters)

    async def unload_lora_adapter(self, name: str) -> dict[str, str]:
        """Stop taking requests on `name` at once and unload it once its queued and running requests have finished
        (this waits for that); -> the adapters served now."""
        self._check_lora_enabled()
        if name in self.lora_unloading:
            raise bad_request(f"LoRA adapter {name!r} is already being unloaded", param="lora_name",
                              code="lora_unloading")
        if name not in self.lora_adapters:
            served = ", ".join(self.lora_adapters) or "none"
            raise bad_request(f"unknown LoRA adapter {name!r}; adapters served: {served}", param="lora_name",
                              code="lora_not_found")
        del self.lora_adapters[name]
        self._set_lora_names()
        self.lora_unloading.add(name)
        try:
            res = await self._call(lambda rid: M.UnloadLoraReq(rid, name), timeout_s=None)
        finally:
            self.lora_unloading.discard(name)
        if not res.ok:
            if res.code == "internal_error":
                raise internal(res.message)
            raise bad_request(res.message, param=res.param, code=res.code)
        return dict(self.lora_adapters)

    async def get_stats(self) -> dict:
        return (await self._call(lambda rid: M.GetStatsReq(rid))).stats

    async def _call(self, make, timeout_s: Optional[float] = 30.0):
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
        """Every scheduler message goes to the detokenizer thread, which decodes it and applies a step's outputs;
        the event loop only delivers the results (and answers the other messages, in arrival order)."""
        while True:
            data = await self._recv.recv(copy=False)
            self._submit_in_order(self._receive, data.bytes)

    def _receive(self, data: bytes) -> list:
        """On the detokenizer thread: [(handle, items to deliver)] for an OutputBatch, [(None, message)] else."""
        try:
            msg = M.decode_from_scheduler(data)
        except Exception:
            logger.exception("undecodable message from the scheduler")
            return []
        if not isinstance(msg, M.OutputBatch):
            return [(None, msg)]
        by_handle: dict[RequestHandle, list[M.Output]] = {}
        handles = self.handles
        for out in msg.outputs:
            handle = handles.get(out.rid)
            if handle is not None:
                group = by_handle.get(handle)
                if group is None:
                    by_handle[handle] = [out]
                else:
                    group.append(out)
        return [(handle, _guarded(handle.apply_outputs, outs)) for handle, outs in by_handle.items()]

    def _on_message(self, msg) -> None:
        """A scheduler message other than outputs, on the event loop."""
        if isinstance(msg, M.ReqError):
            handle = self.handles.get(msg.rid)
            if handle is not None:
                handle.deliver(for_kind(msg.kind, msg.message, param=msg.param))
        elif isinstance(msg, (M.FlushCacheResult, M.Stats, M.LoraResult)):
            fut = self._pending.get(msg.req_id)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, M.Fatal):
            self._on_dead(f"scheduler crashed: {msg.message.strip().splitlines()[-1]}")
            logger.error("scheduler crashed:\n%s", msg.message)

    def _run_in_order(self, handle: RequestHandle, fn) -> None:
        self._submit_in_order(lambda: [(handle, _guarded(fn))])

    def _submit_in_order(self, fn, *args) -> None:
        """Run fn(*args) -> [(handle, [item, ...]) or (None, message)] on the detokenizer thread after everything
        submitted before; deliver the items (handle the messages) on the event loop in that same order."""
        try:
            future = self._detokenize_pool.submit(fn, *args)
        except RuntimeError:  # closed: the server is going away
            return
        future.add_done_callback(self._delivered_from_thread)

    def _delivered_from_thread(self, future: concurrent.futures.Future) -> None:
        if future.cancelled():
            return
        try:
            self._loop.call_soon_threadsafe(self._deliver_all, future)
        except RuntimeError:  # the event loop is closed: the server is gone
            pass

    def _deliver_all(self, future: concurrent.futures.Future) -> None:
        for handle, items in future.result():
            if handle is None:
                self._on_message(items)
                continue
            for item in items:
                handle.deliver(item)

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
            handle.deliver(internal(reason))
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(unavailable(reason))


def _guarded(fn, *args) -> list:
    """fn's items to deliver; a bug in it ends that request with a 500 instead of leaving it waiting."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        logger.exception("applying scheduler outputs failed")
        return [internal(f"applying the scheduler's outputs failed: {type(e).__name__}: {e}")]
