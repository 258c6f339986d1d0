"""A deterministic Backend for interpreter tests (no model).

Characters are its tokens (token_usage counts them). Unconstrained gens answer `responder(prompt, sp)` if given, else
"out<N>" with N the prompt length; regex/json_schema gens answer a matching example. Outputs honour
max_new_tokens (characters) and stop strings. select scores each character of a choice -0.1 when the
choice occurs in the prompt and -1.0 otherwise (`choice_logprobs` overrides). Every call is recorded.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Callable, Optional

from braid.backends.base import ALL_CAPABILITIES, Backend, GenOutput, LogprobRequest, Prompt
from braid.chat_template import CHATML, ChatTemplate
from braid.choices import ChoicesDecision, ChoicesMethod

from lang_examples import example_for_regex, instance_for_schema


class ScriptedBackend(Backend):
    def __init__(self, responder: Optional[Callable[[Prompt, Any], Optional[str]]] = None, *,
                 capabilities: Optional[frozenset] = None, template: ChatTemplate = CHATML,
                 choice_logprobs: Optional[Callable[[Prompt, str], list[float]]] = None,
                 delay_s: float = 0.0, chunk_chars: int = 3, is_chat_model: bool = False):
        self.responder = responder
        self.is_chat_model = is_chat_model
        self.capabilities = frozenset(ALL_CAPABILITIES if capabilities is None else capabilities)
        self.template = template
        self.choice_logprobs = choice_logprobs
        self.delay_s = delay_s
        self.chunk_chars = chunk_chars
        self.calls: list[tuple[str, Any, Any]] = []  # (kind, prompt, details)
        self._lock = threading.Lock()

    def _record(self, kind: str, prompt: Any, details: Any) -> None:
        with self._lock:
            self.calls.append((kind, prompt, details))

    def calls_of(self, kind: str) -> list[tuple[str, Any, Any]]:
        with self._lock:
            return [c for c in self.calls if c[0] == kind]

    def get_chat_template(self) -> ChatTemplate:
        return self.template

    def _text(self, prompt: Prompt, sp) -> str:
        if sp.json_schema is not None:
            return json.dumps(instance_for_schema(sp.json_schema))
        if sp.regex is not None:
            return example_for_regex(sp.regex)
        text = self.responder(prompt, sp) if self.responder else None
        if text is None:
            text = f"out{len(prompt.text)}"
        for stop in sp.stop or ():
            if stop in text:
                text = text[:text.index(stop)] + (stop if sp.no_stop_trim else "")
        return text[:sp.max_new_tokens]

    def _meta(self, prompt: Prompt, text: str, logprobs: LogprobRequest) -> dict:
        meta = {"id": f"scripted-{len(self.calls)}", "prompt_tokens": len(prompt.text),
                "completion_tokens": len(text), "cached_tokens": 0,
                "finish_reason": {"type": "stop", "matched": None}}
        if logprobs.return_logprob:
            meta["output_token_logprobs"] = [[-0.5, ord(ch)] for ch in text]
        return meta

    def generate(self, prompt: Prompt, sampling_params, logprobs: LogprobRequest = LogprobRequest()) -> GenOutput:
        self._record("generate", prompt, (sampling_params, logprobs))
        if self.delay_s:
            time.sleep(self.delay_s)
        text = self._text(prompt, sampling_params)
        meta = self._meta(prompt, text, logprobs)
        self.token_usage.add_meta(meta)
        return GenOutput(text, meta)

    def generate_stream(self, prompt: Prompt, sampling_params, logprobs: LogprobRequest = LogprobRequest()):
        self._record("generate_stream", prompt, (sampling_params, logprobs))
        text = self._text(prompt, sampling_params)
        for i in range(0, len(text), self.chunk_chars):
            if self.delay_s:
                time.sleep(self.delay_s)
            yield text[i:i + self.chunk_chars], None
        meta = self._meta(prompt, text, logprobs)
        self.token_usage.add_meta(meta)
        yield "", meta

    def select(self, prompt: Prompt, choices: list[str], temperature: float, method: ChoicesMethod) -> ChoicesDecision:
        self._record("select", prompt, (list(choices), temperature, method))
        if self.choice_logprobs is not None:
            token_logprobs = [self.choice_logprobs(prompt, c) for c in choices]
        else:
            token_logprobs = [[-0.1 if c in prompt.text else -1.0] * max(len(c), 1) for c in choices]
        uncond = [[-0.5] * max(len(c), 1) for c in choices] if method.requires_unconditional_logprobs else None
        return method(choices, token_logprobs, uncond, temperature=temperature)

    def cache_prefix(self, prompt: Prompt) -> None:
        self._record("cache_prefix", prompt, None)

    def flush_cache(self) -> None:
        self._record("flush_cache", None, None)
