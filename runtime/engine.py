"""Engine: the offline, in-process entry point. Owns a Scheduler driven by a background thread."""

from __future__ import annotations

import concurrent.futures
import gc
import itertools
import logging
import os
import queue
import threading
import uuid
from typing import Iterator, Optional, Union

import torch

from braid.runtime.chat_format import render_chat_template, resolve_content_format, with_chat_template
from braid.runtime.config import ServerArgs
from braid.runtime.core import Req
from braid.runtime.error_kind import exception_for
from braid.runtime.host_memory import return_freed_memory
from braid.runtime.sampling_params import SamplingParams
from braid.runtime.request_io.output_accumulator import OutputAccumulator
from braid.runtime.request_io.prepare import ServedModel, prepare_request

logger = logging.getLogger(__name__)


class _Pending:
    """A submitted request as its caller waits for it: one accumulator per choice, the scheduler's outputs."""

    def __init__(self, req: Req, tokenizer):
        self.rid = req.rid
        self.accs = [OutputAccumulator(i, tokenizer, req.sampling_params, len(req.input_ids), req.return_logprob)
                     for i in range(req.sampling_params.n)]
        self.events: "queue.Queue" = queue.Queue()
        self.stream = req.stream
        self.remaining = len(self.accs)


class Engine:
    """`Engine(model_path="smollm2", **server_args)`; `generate(...)` takes one prompt or a list."""

    def __init__(self, model_path: str = "smollm2", **kwargs):
        self.server_args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        logging.basicConfig(level=self.server_args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list = []
        self._pending: dict[str, _Pending] = {}
        self._closed = False
        self._error: Optional[BaseException] = None
        self._counter = itertools.count()
        self._preparer = None  # the MultimodalPreparer of a vision model, built on first use
        self._ranks = None  # tensor parallelism: the follower rank processes (runtime/processes/tensor_parallel.py)
        self._lora_names = tuple(self.server_args.lora_adapters)  # adapters requests may name (load/unload change it)
        # The scheduler (model load included) is built on the thread that runs it: every torch op then runs on
        # one thread. On CPU this matters: each thread that runs parallel ops gets its own OpenMP team, and
        # with more team threads than cores OpenMP stops spinning between parallel regions, so every small op
        # of the forward pass pays thread wake-ups (decode steps ~1.4x slower).
        self.scheduler = None
        built: "queue.Queue" = queue.Queue()
        self._thread = threading.Thread(target=self._run, args=(built,), name="braid-scheduler", daemon=True)
        self._thread.start()
        kind, value = built.get()
        if kind == "error":
            self._thread.join()
            raise value
        self.scheduler = value
        self.tokenizer = with_chat_template(self.scheduler.tokenizer, self.server_args.chat_template)
        # how the chat template takes a message's content (runtime/chat_format.py), as the server resolves it
        self.chat_content_format = resolve_content_format(self.server_args.chat_template_content_format,
                                                          getattr(self.tokenizer, "chat_template", None))

    # ---- context manager ----
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # ---- the scheduler thread ----
    def _run(self, built: "queue.Queue") -> None:
        from braid.runtime.scheduler.scheduler import Scheduler

        try:
            if self.server_args.dp_size > 1:
                raise ValueError("dp_size > 1 is a server feature (python -m braid.launch_server --dp-size N); the "
                                 "in-process Engine runs one scheduler group")
            from braid.runtime.processes.tensor_parallel import init_rank, uses_distributed
            from braid.runtime.processes.scheduler_process import EngineRanks

            if uses_distributed(self.server_args):
                self._ranks = EngineRanks(self.server_args)
                sched = self._ranks.build_scheduler()  # rank 0: records what the other ranks must replay
            else:
                init_rank(self.server_args, 0, None)  # on CUDA: --base-gpu-id's GPU for this thread
                sched = Scheduler(self.server_args)
        except BaseException as e:  # noqa: BLE001 - re-raised by __init__
            built.put(("error", e))
            return
        built.put(("ok", sched))
        self._loop(sched)

    def _loop(self, sched) -> None:
        from braid.runtime.scheduler.scheduler import run_scheduler_loop

        try:
            run_scheduler_loop(sched, self if self._ranks is None else sched.io(self))
        except BaseException as e:  # a bug: fail every waiting caller rather than hang them
            logger.exception("scheduler step failed")
            self._error = e
            for p in list(self._pending.values()):
                p.events.put(("error", e))
        finally:
            if self._ranks is not None:
                self._ranks.close()

    # ---- SchedulerIO (runs on the scheduler thread) ----
    def receive(self, sched, block: bool) -> bool:
        with self._wake:
            while block and not self._inbox and not self._closed:
                self._wake.wait()
            if self._closed:
                return False
            inbox, self._inbox = self._inbox, []
        for kind, payload in inbox:
            if kind == "add":
                req, pending = payload
                try:
                    sched.add_request(req)
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    pending.events.put(("error", e))
            elif kind == "abort":
                sched.abort_request(payload)
            else:
                fn, box = payload
                try:
                    box.put(("ok", fn()))
                except Exception as e:  # noqa: BLE001
                    box.put(("error", e))
        return True

    def send_outputs(self, outputs) -> None:
        for out in outputs:
            p = self._pending.get(out.rid)
            if p is not None:
                p.events.put(("out", out))

    def _call(self, fn):
        box: "queue.Queue" = queue.Queue()
        with self._wake:
            self._inbox.append(("call", (fn, box)))
            self._wake.notify()
        kind, value = box.get()
        if kind == "error":
            raise value
        return value

    # ---- API ----
    def generate(self, prompt: Union[None, str, list[str]] = None, sampling_params: Union[None, dict, list, SamplingParams] = None,
                 input_ids=None, return_logprob: bool = False, logprob_start_len: int = -1, top_logprobs_num: int = 0,
                 stream: bool = False, rid: Optional[str] = None, image_data=None, video_data=None,
                 lora_path: Union[None, str, list] = None):
        """What POST /generate answers: a result dict (a list for a batch or n > 1), or with stream=True an
        iterator of chunks (text cumulative, plus `delta` and `index`). lora_path: a --lora-paths adapter name for
        every prompt, or a list with one name (or None: the base model) per prompt. Bad input raises ValueError."""
        batch = isinstance(prompt, list) or (input_ids is not None and len(input_ids) > 0 and isinstance(input_ids[0], list))
        prompts = prompt if isinstance(prompt, list) else [prompt] if prompt is not None else None
        ids_list = input_ids if (input_ids is not None and batch) else [input_ids] if input_ids is not None else None
        if prompts is None and ids_list is None:
            raise ValueError("generate() needs prompt or input_ids")
        count = len(prompts) if prompts is not None else len(ids_list)
        sps = sampling_params if isinstance(sampling_params, list) else [sampling_params] * count
        if len(sps) != count:
            raise ValueError("sampling_params list must match the number of prompts")
        per_prompt = batch and isinstance(image_data, list) and len(image_data) == count
        images = image_data if per_prompt else [image_data] * count
        videos = video_data if batch and isinstance(video_data, list) and len(video_data) == count else [video_data] * count
        if stream and count != 1:
            raise ValueError("stream=True takes a single prompt")
        loras = lora_path if isinstance(lora_path, list) else [lora_path] * count
        if len(loras) != count:
            raise ValueError(f"lora_path list has {len(loras)} entries for {count} prompts")
        model = self.served_model()
        rids = [rid if (rid and count == 1) else f"{rid or uuid.uuid4().hex}-{next(self._counter)}"
                for _ in range(count)]

        def prepare(i: int) -> Req:
            return prepare_request(model, prompts[i] if prompts is not None else ids_list[i], sps[i], rid=rids[i],
                                   return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                                   top_logprobs_num=top_logprobs_num, stream=stream, image_data=images[i],
                                   video_data=videos[i], lora_path=loras[i])

        # every prompt is checked before any is submitted; media decoding and resizing (PIL, which releases the
        # GIL) run on a few threads when a batch carries images or video
        has_media = any(x is not None for x in images + videos)
        if has_media and count > 1:
            with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1, count)) as pool:
                reqs = list(pool.map(prepare, range(count)))
        else:
            reqs = [prepare(i) for i in range(count)]
        pendings = []
        for req in reqs:
            pending = _Pending(req, self.tokenizer)
            pendings.append(pending)
            with self._wake:
                if self._error is not None:
                    raise RuntimeError("the engine's scheduler failed earlier") from self._error
                self._pending[req.rid] = pending
                self._inbox.append(("add", (req, pending)))
                self._wake.notify()
        if stream:
            return self._stream(pendings[0])
        results = []
        for p in pendings:
            results.extend(self._wait(p))
        return results if (batch or len(results) > 1) else results[0]

    def served_model(self) -> ServedModel:
        sched = self._live_scheduler()
        return ServedModel(model_path=self.server_args.model_path, name=self.server_args.model_name,
                           tokenizer=self.tokenizer, context_len=sched.context_len, vocab_size=sched.vocab_size,
                           kv_total_tokens=sched.kv_pool.size, is_multimodal=sched.model_config.is_multimodal,
                           multimodal=self._multimodal_preparer(sched.model_config),
                           lora_names=self._lora_names)

    def _multimodal_preparer(self, model_config):
        if not model_config.is_multimodal:
            return None
        if self._preparer is None:
            from braid.runtime.multimodal.media import MediaLimits
            from braid.runtime.multimodal.prompt import MultimodalPreparer

            self._preparer = MultimodalPreparer.for_model(model_config, MediaLimits.from_server_args(self.server_args))
        return self._preparer

    def get_model_info(self) -> dict:
        """What GET /get_model_info answers."""
        return dict(self.served_model().public_info(), chat_template_content_format=self.chat_content_format)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The model's chat template over `messages` ({"role", "content"}: text, or template parts {"type": "text" |
        "image" | "video"}) in the template's content format: what the server's POST /apply_chat_template answers."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; give its tokenizer one, or prompt with text")
        return render_chat_template(self.tokenizer, messages, self.chat_content_format, add_generation_prompt)

    def _next_event(self, p: _Pending):
        kind, value = p.events.get()
        if kind == "error":
            self._pending.pop(p.rid, None)
            raise value
        kind = value.error_kind if value.finished else None
        if kind is not None:
            # e.g. a grammar that failed to compile: the caller's error, as the server's 400 (ValueError); the compile
            # queue full, the server's 429 (BusyError)
            self._pending.pop(p.rid, None)
            if p.remaining > 1:
                self.abort(p.rid)
            raise exception_for(kind, str(value.finish_reason.get("message", "")))
        return value

    def _wait(self, p: _Pending) -> list[dict]:
        while p.remaining:
            out = self._next_event(p)
            if p.accs[out.index].add(out) is not None and out.finished:
                p.remaining -= 1
        self._pending.pop(p.rid, None)
        return [a.native_result(p.rid) for a in p.accs]

    def _stream(self, p: _Pending) -> Iterator[dict]:
        try:
            while p.remaining:
                out = self._next_event(p)
                acc = p.accs[out.index]
                update = acc.add(out)
                if update is None:
                    continue
                if update.finished:
                    p.remaining -= 1
                res = acc.native_result(p.rid)
                res["delta"] = update.delta
                res["index"] = out.index
                yield res
        finally:
            if p.remaining:
                self.abort(p.rid)
            self._pending.pop(p.rid, None)

    def abort(self, rid: str) -> None:
        with self._wake:
            self._inbox.append(("abort", rid))
            self._wake.notify()

    def flush_cache(self) -> bool:
        return self._call(self._live_scheduler().flush_cache)

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Register the PEFT adapter folder `path` as `name` while serving (what POST /load_lora_adapter does); it
        goes into a device slot when a request names it. Raises ValueError (LoraError) naming what is wrong: a bad
        folder, weights that do not fit the model, a rank over --max-lora-rank, a target module without adapter
        buffers, a name already loaded."""
        sched = self._live_scheduler()
        self._call(lambda: sched.load_lora_adapter(name, path))
        with self._lock:
            if name not in self._lora_names:
                self._lora_names = (*self._lora_names, name)

    def unload_lora_adapter(self, name: str) -> None:
        """Unload `name` (what POST /unload_lora_adapter does): requests naming it are refused from now on, the ones
        already submitted finish as usual, and this returns once they have and the adapter is gone. Raises
        ValueError (LoraError) for an adapter that is not loaded."""
        sched = self._live_scheduler()
        gone: "queue.Queue" = queue.Queue()
        # refused here at once (a refused unload leaves nothing to restore: the adapter was unknown or on its way out)
        with self._lock:
            self._lora_names = tuple(n for n in self._lora_names if n != name)
        self._call(lambda: sched.unload_lora_adapter(name, lambda: gone.put(True)))
        while True:
            try:
                gone.get(timeout=1.0)
                return
            except queue.Empty:
                if self._error is not None or not self._thread.is_alive():
                    raise RuntimeError("the engine's scheduler stopped before the adapter was "
                                       "unloaded") from self._error

    def get_stats(self) -> dict:
        return self._call(self._live_scheduler().get_stats)

    def _live_scheduler(self):
        if self.scheduler is None:
            raise RuntimeError("the engine has been shut down")
        return self.scheduler

    def shutdown(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)
        sched, self.scheduler = self.scheduler, None
        if sched is not None:
            sched.shutdown()
        if sched is not None and not self._thread.is_alive():
            # the model, KV pool and radix tree hold reference cycles: free their memory now, not at the next gc
            del sched
            gc.collect()
            if torch.cuda.is_initialized():
                torch.cuda.empty_cache()
            return_freed_memory()
