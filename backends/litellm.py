"""LiteLLM: other model providers (Anthropic, Vertex AI, Bedrock, Azure, Cohere, any OpenAI-compatible server, ...)
through `litellm.completion` (`pip install 'braid[litellm]'`).

    backend = braid.LiteLLM("anthropic/claude-3-5-haiku-latest")          # key from the provider's usual variable
    backend = braid.LiteLLM("openai/smollm2", api_base="http://127.0.0.1:30000/v1", api_key="EMPTY")

Chat models only, as SGLang's LiteLLM backend: gen inside assistant() blocks, streaming, fork. The sampling
parameters LiteLLM passes to every provider are max_tokens, temperature, top_p, stop, seed and the frequency
and presence penalties; any other non-default field (top_k, min_p, regex, select, ...) is refused with a
clear error instead of being dropped. Extra keyword arguments go to every `litellm.completion` call
(api_version, custom_llm_provider, extra_headers, ...).

A request the provider sheds (HTTP 429 or 503) is retried up to `max_retries` times, waiting as its Retry-After
says (braid.backends.retry); a stream only before its body is read. LiteLLM's own `num_retries` is left off: it
retries every API error (a 400 too) without waiting for Retry-After. Providers LiteLLM reaches through the openai
client (openai/..., azure/...) also get that client's own retries (2 by default) inside each attempt.

LiteLLM fetches its model cost map from the network when imported unless LITELLM_LOCAL_MODEL_COST_MAP is set;
braid does not use the map, so it sets that variable (if unset) before the first import.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any, Iterator, Optional, Union

from braid.backends.base import CAP_FORK, CAP_GEN, CAP_STREAM, Backend, GenOutput, LogprobRequest, Prompt
from braid.backends.openai import (call_openai_style, chat_messages, fields_beyond_openai, openai_sampling_kwargs,
                                   response_meta, stream_deltas)
from braid.backends.retry import DEFAULT_MAX_RETRIES, RetryPolicy
from braid.chat_template import CHATML, ChatTemplate, get_chat_template
from braid.errors import ProgramError
from braid.runtime.sampling_params import SamplingParams


def _import_litellm() -> Any:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    try:
        import litellm
    except ImportError:
        raise ProgramError("the LiteLLM backend needs the litellm package: pip install 'braid[litellm]'") from None
    return litellm


class LiteLLM(Backend):
    capabilities = frozenset({CAP_GEN, CAP_STREAM, CAP_FORK})
    is_chat_model = True

    def __init__(self, model: str, *, api_base: Optional[str] = None, api_key: Optional[str] = None,
                 chat_template: Union[None, str, ChatTemplate] = None, timeout: float = 600.0,
                 max_retries: int = DEFAULT_MAX_RETRIES, **completion_kwargs: Any):
        if not isinstance(model, str) or not model:
            raise ProgramError(f"LiteLLM needs a model name such as 'anthropic/<model>', got {model!r}")
        self._litellm = _import_litellm()
        self.model = model
        self.api_base = api_base
        self.api_key = api_key
        self.timeout = timeout
        self.retry_policy = RetryPolicy(max_retries=max_retries)
        self.completion_kwargs = completion_kwargs
        if isinstance(chat_template, str):
            chat_template = get_chat_template(chat_template)
        self._chat_template = chat_template or CHATML

    def __repr__(self) -> str:
        return f"LiteLLM({self.model!r}, api_base={self.api_base!r})"

    def get_chat_template(self) -> ChatTemplate:
        return self._chat_template

    def _request_kwargs(self, prompt: Prompt, sp: SamplingParams) -> dict:
        beyond = fields_beyond_openai(sp)
        if beyond:
            raise ProgramError(f"{self!r} cannot pass {', '.join(sorted(beyond))}: LiteLLM's common parameters are "
                               "max_tokens, temperature, top_p, stop, seed, frequency_penalty, presence_penalty")
        kw: dict[str, Any] = {**self.completion_kwargs, "model": self.model, "timeout": self.timeout,
                              "messages": chat_messages(prompt, self.model), **openai_sampling_kwargs(sp)}
        if self.api_base is not None:
            kw["api_base"] = self.api_base
        if self.api_key is not None:
            kw["api_key"] = self.api_key
        return kw

    def _completion(self, **kwargs: Any) -> Any:
        """litellm.completion, again after each shed answer while retry_policy allows."""
        import openai

        for retries_done in itertools.count():
            try:
                return self._litellm.completion(**kwargs)
            except openai.APIStatusError as e:
                headers = getattr(e.response, "headers", None) or {}
                delay = self.retry_policy.retry_delay(e.status_code, headers.get("retry-after"), retries_done,
                                                      repr(self), str(e.message))
                if delay is None:
                    raise
                time.sleep(delay)

    def generate(self, prompt: Prompt, sampling_params: SamplingParams,
                 logprobs: LogprobRequest = LogprobRequest()) -> GenOutput:
        resp = call_openai_style(self.model, self.token_usage, self._completion,
                                 self._request_kwargs(prompt, sampling_params))
        choice = resp.choices[0]
        return GenOutput(choice.message.content or "", response_meta(resp, choice.finish_reason))

    def generate_stream(self, prompt: Prompt, sampling_params: SamplingParams,
                        logprobs: LogprobRequest = LogprobRequest()) -> Iterator[tuple[str, Optional[dict]]]:
        kw = {**self._request_kwargs(prompt, sampling_params), "stream": True,
              "stream_options": {"include_usage": True}}
        stream = call_openai_style(self.model, self.token_usage, self._completion, kw)
        yield from stream_deltas(stream, True, self.token_usage)
