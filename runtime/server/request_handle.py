"""The server's side of one submitted request: its choices' accumulators, latency metrics, local aborts.

`TokenizerManager.submit()` returns a `RequestHandle`; the HTTP handler iterates `handle.steps()` (per scheduler
step, a list of `ChoiceUpdate`s, several tokens each when the scheduler streams at an interval) or
`handle.updates()` (the same updates one by one) and calls `TokenizerManager.release(handle)` when it is done.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import TYPE_CHECKING, AsyncIterator, Callable, Optional

from braid.runtime.core import Req
from braid.runtime.error_kind import GRAMMAR_KINDS
from braid.runtime.sampling_params import GRAMMAR_FIELDS
from braid.runtime.ipc import messages as M
from braid.runtime.server.errors import APIError, for_kind
from braid.runtime.server.metrics import ServerMetrics
from braid.runtime.request_io.output_accumulator import ChoiceUpdate, OutputAccumulator

if TYPE_CHECKING:
    from braid.runtime.sampling_params import SamplingParams


DEADLINE_GRACE_S = 5.0


class RequestHandle:
    """Outputs are applied to the choices on the detokenizer thread (`apply_outputs`, one call per handle per
    scheduler step, serialized by TokenizerManager), and each step's updates are delivered to the handler on the
    event loop as one list (`deliver`), so a streaming handler wakes and writes once per step."""

    def __init__(self, req: Req, tokenizer, metrics: ServerMetrics, timeout_s: Optional[float] = None,
                 request_abort: Optional[Callable[[str], None]] = None,
                 run_in_order: Optional[Callable[["RequestHandle", Callable[[], list]], None]] = None,
                 snapshot_ids: bool = False, returned_n: Optional[int] = None):
        self.req = req
        self.rid = req.rid
        self.stream = req.stream
        self.prompt_ids = req.input_ids
        self.sampling_params = req.sampling_params
        self.return_logprob = req.return_logprob
        self.top_logprobs_num = req.top_logprobs_num
        self.n = req.sampling_params.n
        self.metrics = metrics
        self._items: collections.deque = collections.deque()  # list[ChoiceUpdate] per step, or an APIError
        self._waiter: Optional[asyncio.Future] = None
        self.choices = [OutputAccumulator(i, tokenizer, req.sampling_params, len(req.input_ids), req.return_logprob,
                                          snapshot_ids) for i in range(self.n)]
        self.created = time.time()
        self._arrival = time.perf_counter()
        for choice in self.choices:
            choice.arrival_time = self.created
        self._last_token_time: Optional[float] = None
        self.returned_n = self.n if returned_n is None else returned_n  # fewer than n when best_of ranks them
        self._first_token_seen = False
        self._queue_time: Optional[float] = None
        self.num_finished = 0  # choices whose last update the handler has taken
        self._applied_finished = 0  # choices finished on the detokenizer thread
        self.scheduler_finished = 0  # choices the scheduler reported finished; the rest need an AbortReq on release
        self.timeout_s = timeout_s
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.request_abort = request_abort  # sends AbortReq(rid) to the scheduler
        # runs a function on the detokenizer thread after the outputs already queued there, then delivers its result
        self.run_in_order = run_in_order or _run_now
        self.released = False
        self.abort_message: Optional[str] = None  # replaces the scheduler's message when it reports an abort

    @property
    def finished(self) -> bool:
        return self.num_finished >= self.n

    # ---- detokenizer thread -------------------------------------------------------------------
    def apply_outputs(self, outs: list) -> list:
        """Apply one step's outputs; returns what to deliver: [list of ChoiceUpdate] or [APIError]."""
        updates = []
        for out in outs:
            error = _error_failure(out, self.sampling_params)
            if error is not None:
                return [error]
            update = self._apply(out)
            if update is not None:
                updates.append(update)
        return [updates] if updates else []

    def _abort_choices(self, message: Optional[str]) -> list:
        updates = [u for u in (c.abort(message) for c in self.choices) if u is not None]
        for u in updates:
            self._count_finished(u.choice)
        return [updates] if updates else []

    # ---- event loop ---------------------------------------------------------------------------
    def deliver(self, item) -> None:
        """Hand one step's updates (or an error) to the handler."""
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def steps(self) -> AsyncIterator[list[ChoiceUpdate]]:
        """Each step's updates until every choice finished; raises APIError if the scheduler rejected the request."""
        while not self.finished:
            item = await self._next_item()
            if isinstance(item, APIError):
                self.num_finished = self.n
                raise item
            self.num_finished += sum(1 for u in item if u.finished)
            yield item

    async def updates(self) -> AsyncIterator[ChoiceUpdate]:
        """The updates of `steps()` one by one."""
        async for step in self.steps():
            for update in step:
                yield update

    async def _next_item(self):
        """The next delivered item; past the deadline, asks the scheduler to abort (its last output keeps the
        text so far) and, if that does not come within DEADLINE_GRACE_S, ends the request here."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            if self._deadline is None:
                await self._waiter
                continue
            try:
                await asyncio.wait_for(self._waiter, max(0.0, self._deadline - time.monotonic()))
            except asyncio.TimeoutError:
                message = f"the request did not finish within its deadline of {self.timeout_s:g}s (--request-timeout-s)"
                if self.abort_message is None and self.request_abort is not None:
                    self.abort_message = message
                    self._deadline = time.monotonic() + DEADLINE_GRACE_S
                    self.request_abort(self.rid)
                else:
                    self._deadline = None
                    self.abort_locally(message)
        self._waiter = None
        return self._items.popleft()

    def _apply(self, out: M.Output) -> Optional[ChoiceUpdate]:
        if out.finished:
            self.scheduler_finished += 1
        c = self.choices[out.index]
        if c.finished:
            return None
        if self.abort_message and out.finished and (out.finish_reason or {}).get("type") == "abort":
            out.finish_reason = {**out.finish_reason, "message": self.abort_message}
        if out.new_token_ids and self.stream:
            now = time.perf_counter()
            if not self._first_token_seen:
                self._first_token_seen = True
                self.metrics.observe_first_token(now - self._arrival)
                new_after_first = len(out.new_token_ids) - 1
            else:
                new_after_first = len(out.new_token_ids)
            if self._last_token_time is not None:
                self.metrics.observe_tokens(now - self._last_token_time, new_after_first)
            self._last_token_time = now
        elif out.finished and out.first_token_time is not None and out.new_token_ids:
            # a non-streamed choice: its first token's time comes from the scheduler (the same host's clock)
            ttft = max(out.first_token_time - self.created, 0.0)
            if not self._first_token_seen:
                self._first_token_seen = True
                self.metrics.observe_first_token(ttft)
            decode_s = time.perf_counter() - self._arrival - ttft
            self.metrics.observe_tokens(max(decode_s, 0.0), len(out.new_token_ids) - 1)
        if out.finished and out.queue_time is not None:
            self._queue_time = out.queue_time if self._queue_time is None else min(self._queue_time, out.queue_time)
        update = c.add(out)
        if update.finished:
            self._count_finished(c)
        return update

    def _count_finished(self, c: OutputAccumulator) -> None:
        self._applied_finished += 1
        self.metrics.observe_choice(c.prompt_tokens, c.completion_tokens, c.finish_reason.get("type"))
        if self._applied_finished >= self.n:
            self.metrics.observe_request(time.perf_counter() - self._arrival, len(self.prompt_ids), self._queue_time,
                                         self.returned_n, self.n)

    def abort_locally(self, message: Optional[str] = None) -> None:
        """Finish every unfinished choice with finish_reason abort, after the outputs already on their way (later
        scheduler outputs are dropped)."""
        self.run_in_order(self, lambda: self._abort_choices(message))


def _run_now(handle: RequestHandle, fn: Callable[[], list]) -> None:
    for item in fn():
        handle.deliver(item)


def _error_failure(out: M.Output, sp: "SamplingParams") -> Optional[APIError]:
    """A request the scheduler aborted with an error kind (its grammar could not be compiled: the client's error, 400;
    the grammar compile queue was full, --grammar-max-queued: retry later, 429), as the error the handler raises; None
    for any other output. A grammar error names the grammar field the request carried."""
    kind = out.error_kind if out.finished else None
    if kind is None:
        return None
    message = str((out.finish_reason or {}).get("message", ""))
    param = next((f for f in GRAMMAR_FIELDS if getattr(sp, f) is not None), None) if kind in GRAMMAR_KINDS else None
    return for_kind(kind, message, param=param)


async def merge_steps(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, list[ChoiceUpdate]]]:
    """Each step's updates of several requests as they arrive, tagged with the handle's position in `handles`."""
    if len(handles) == 1:
        async for step in handles[0].steps():
            yield 0, step
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, handle: RequestHandle) -> None:
        try:
            async for step in handle.steps():
                queue.put_nowait((i, step))
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


async def drain(handles: list[RequestHandle]) -> None:
    """Wait until every choice of every handle finished (raises the first APIError)."""
    async for _ in merge_steps(handles):
        pass
