"""LocalEngine: braid's runtime in this process (no HTTP).

The engine (and torch) load on first use. `Engine.generate(...)` takes the native API's request
fields (the prompt text as `text` or `prompt`) and returns what POST /generate would (with
stream=True, an iterator of the chunk objects, text cumulative).
"""

from __future__ import annotations

import inspect
import threading
from typing import Any, Iterator, Union

from braid.backends.base import CAP_IMAGE
from braid.backends.native import NativeApiBackend
from braid.errors import UnsupportedFeatureError
from braid.chat_template import ChatTemplate


class LocalEngine(NativeApiBackend):
    def __init__(self, model_path: str = "smollm2", *, chat_template: Union[None, str, ChatTemplate] = None,
                 **server_args: Any):
        super().__init__(chat_template)
        self.model_path = model_path
        self.server_args = server_args
        self._engine: Any = None
        self._lock = threading.Lock()

    @property
    def engine(self) -> Any:
        if self._engine is None:
            with self._lock:
                if self._engine is None:
                    from braid.runtime import Engine  # imports torch

                    self._engine = Engine(model_path=self.model_path, **self.server_args)
        return self._engine

    def _engine_kwargs(self, body: dict) -> dict:
        """The request body in the engine's own keyword names."""
        engine = self.engine
        params = getattr(self, "_engine_params", None)
        if params is None:
            params = self._engine_params = set(inspect.signature(engine.generate).parameters)
        kwargs = dict(body)
        if "text" not in params and "prompt" in params:
            kwargs["prompt"] = kwargs.pop("text")
        if "image_data" in kwargs and "image_data" not in params:
            raise UnsupportedFeatureError(self.name, CAP_IMAGE, "image() on the in-process engine")
        kwargs.pop("return_text_in_logprobs", None)  # added here from the engine's tokenizer (see _token_texts)
        return kwargs

    def _token_texts(self, out: Any, body: dict) -> Any:
        """With return_text_in_logprobs, each logprob entry gets its token's text third, as the server adds it."""
        if not body.get("return_text_in_logprobs") or not isinstance(out, dict):
            return out
        decode = self.engine.tokenizer.decode
        meta = out.get("meta_info", {})
        for key in ("input_token_logprobs", "output_token_logprobs"):
            if meta.get(key) is not None:
                meta[key] = [[lp, tid, decode([tid], skip_special_tokens=False)] for lp, tid, *_ in meta[key]]
        for key in ("input_top_logprobs", "output_top_logprobs"):
            if meta.get(key) is not None:
                meta[key] = [None if pos is None else
                             [[lp, tid, decode([tid], skip_special_tokens=False)] for lp, tid, *_ in pos]
                             for pos in meta[key]]
        return out

    def _generate(self, body: dict) -> Any:
        return self._token_texts(self.engine.generate(**self._engine_kwargs(body)), body)

    def _generate_stream(self, body: dict) -> Iterator[dict]:
        out = self.engine.generate(**self._engine_kwargs(body))
        if isinstance(out, dict):  # an engine that ignores stream=True answers once
            yield self._token_texts(out, body)
            return
        for chunk in out:
            yield self._token_texts(chunk, body)

    def _apply_chat_template(self, messages: list[dict]) -> str:
        return self.engine.apply_chat_template(messages)

    def get_model_info(self) -> dict:
        engine = self.engine
        getter = getattr(engine, "get_model_info", None)
        if getter is not None:
            return getter()
        tokenizer = getattr(engine, "tokenizer", None)
        return {"model_path": self.model_path, "chat_template": getattr(tokenizer, "chat_template", None)}

    def get_server_args(self) -> dict:
        """The engine's ServerArgs as a dict (the API key, if any, redacted), as GET /get_server_args gives."""
        import dataclasses

        args = dataclasses.asdict(self.engine.server_args)
        if args.get("api_key"):
            args["api_key"] = "<redacted>"
        return args

    def get_server_info(self) -> dict:
        engine = self.engine
        getter = getattr(engine, "get_server_info", None) or getattr(engine, "get_stats")
        return getter()

    def flush_cache(self) -> None:
        if self._engine is not None:
            self._engine.flush_cache()

    def shutdown(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None and hasattr(engine, "shutdown"):
            engine.shutdown()

    def __repr__(self) -> str:
        state = "loaded" if self._engine is not None else "not loaded"
        return f"LocalEngine({self.model_path!r}, {state})"
