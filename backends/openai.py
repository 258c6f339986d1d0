"""OpenAI: any OpenAI-compatible endpoint through the official `openai` client (braid's own /v1 included).

Chat models get the program's closed role blocks as messages and must generate inside an
assistant() block. Completion models get the rendered prompt text.

select: completion models score each choice from the prompt's echoed logprobs (so every choices
method works); chat models constrain the answer to the choices: with `constrained="extra_body"`
(default when base_url is given: braid and similar servers) through `extra_body={"regex": ...}`, with
`constrained="response_format"` (default for api.openai.com) through a json_schema response format;
`constrained=None` makes select (and regex/json gens) an error.

Retries are the openai client's, `max_retries` of them: it retries HTTP 429 and 503 (and 408, 409, other 5xx,
connection errors), waiting as Retry-After says when the server sends it (up to 2 minutes; a longer one is not
retried), else with jittered exponential backoff from 0.5 s; a stream only before its body is read.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator, Optional, Union

from braid.backends.base import (CAP_CHOICES_METHODS, CAP_FORK, CAP_GEN, CAP_IMAGE, CAP_JSON_SCHEMA, CAP_REGEX,
                                 CAP_SELECT, CAP_STOP_TOKEN_IDS, CAP_STREAM, CAP_VIDEO, Backend, GenOutput,
                                 LogprobRequest, Prompt)
from braid.backends.retry import DEFAULT_MAX_RETRIES
from braid.chat_template import CHATML, ChatTemplate, get_chat_template
from braid.choices import ChoicesDecision, ChoicesMethod, choices_regex, unconditional_context
from braid.errors import BackendError, BackendRequestError, ProgramError
from braid.runtime.sampling_params import SamplingParams

_COMPLETION_ONLY_MODELS = ("gpt-3.5-turbo-instruct", "davinci-002", "babbage-002")
_CONSTRAINED_MODES = ("extra_body", "response_format", None)
# SamplingParams fields the openai client takes as named arguments (the rest go to extra_body)
_NATIVE_FIELDS = {"max_new_tokens", "temperature", "top_p", "stop", "frequency_penalty", "presence_penalty", "seed",
                  "n", "regex", "json_schema", "ebnf"}


def _guess_chat(model: str) -> bool:
    return not model.startswith(_COMPLETION_ONLY_MODELS)


class OpenAI(Backend):
    def __init__(self, model: str, base_url: Optional[str] = None, api_key: Optional[str] = None,
                 is_chat_model: Optional[bool] = None, *, constrained: Union[str, None] = "auto",
                 chat_template: Union[None, str, ChatTemplate] = None, timeout: float = 600.0,
                 max_retries: int = DEFAULT_MAX_RETRIES, **client_kwargs: Any):
        import openai

        if api_key is None:
            api_key = os.environ.get("OPENAI_API_KEY") or ("EMPTY" if base_url else None)
        if api_key is None:
            raise ProgramError("OpenAI backend needs api_key= or the OPENAI_API_KEY environment variable")
        self.model = model
        self.base_url = base_url
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=max_retries,
                                    **client_kwargs)
        self.is_chat_model = _guess_chat(model) if is_chat_model is None else bool(is_chat_model)
        if constrained == "auto":
            constrained = "extra_body" if base_url else "response_format"
        if constrained not in _CONSTRAINED_MODES:
            raise ProgramError(f"constrained must be 'auto', 'extra_body', 'response_format' or None, got {constrained!r}")
        self.constrained = constrained
        if isinstance(chat_template, str):
            chat_template = get_chat_template(chat_template)
        self._chat_template = chat_template or CHATML
        self.capabilities = self._capabilities()

    def _capabilities(self) -> frozenset[str]:
        caps = {CAP_GEN, CAP_STREAM, CAP_FORK}
        if self.base_url is not None:
            caps.add(CAP_STOP_TOKEN_IDS)  # passed through extra_body
        if self.constrained == "extra_body":
            caps |= {CAP_REGEX, CAP_JSON_SCHEMA}
        if self.is_chat_model:
            caps.add(CAP_IMAGE)
            if self.base_url is not None:  # an OpenAI-compatible server (braid's /v1) takes video_url {"frames"}
                caps.add(CAP_VIDEO)
            if self.constrained is not None:
                caps |= {CAP_SELECT, CAP_JSON_SCHEMA}
        else:
            caps |= {CAP_SELECT, CAP_CHOICES_METHODS}
        return frozenset(caps)

    def __repr__(self) -> str:
        kind = "chat" if self.is_chat_model else "completion"
        return f"OpenAI({self.model!r}, {kind}, base_url={self.base_url!r})"

    def get_chat_template(self) -> ChatTemplate:
        return self._chat_template

    # ---- request building -----------------------------------------------------------------------
    def _request_kwargs(self, sp: SamplingParams) -> dict:
        kw: dict[str, Any] = {"model": self.model, **openai_sampling_kwargs(sp)}
        extra = fields_beyond_openai(sp)
        if extra and self.base_url is None:
            raise ProgramError(f"{self.model}: the OpenAI API takes no {', '.join(sorted(extra))} (braid-compatible "
                               "servers do: pass base_url)")
        if sp.regex is not None:
            extra["regex"] = sp.regex
        if sp.ebnf is not None:  # vLLM's name, which braid's /v1 takes too
            extra["guided_grammar"] = sp.ebnf
        if sp.json_schema is not None:
            if self.constrained == "extra_body":
                extra["json_schema"] = sp.json_schema
            elif self.is_chat_model:
                kw["response_format"] = {"type": "json_schema",
                                         "json_schema": {"name": "output", "schema": json.loads(sp.json_schema)}}
        if extra:
            kw["extra_body"] = extra
        return kw

    def _messages(self, prompt: Prompt) -> list[dict]:
        return chat_messages(prompt, self.model)

    def _call(self, fn: Any, **kwargs: Any) -> Any:
        return call_openai_style(self.model, self.token_usage, fn, kwargs)

    # ---- generation -----------------------------------------------------------------------------
    def generate(self, prompt: Prompt, sampling_params: SamplingParams,
                 logprobs: LogprobRequest = LogprobRequest()) -> GenOutput:
        kw = self._request_kwargs(sampling_params)
        if self.is_chat_model:
            resp = self._call(self.client.chat.completions.create, messages=self._messages(prompt), **kw)
            choice = resp.choices[0]
            text = choice.message.content or ""
        else:
            resp = self._call(self.client.completions.create, prompt=prompt.text, **kw)
            choice = resp.choices[0]
            text = choice.text or ""
        return GenOutput(text, response_meta(resp, choice.finish_reason))

    def generate_stream(self, prompt: Prompt, sampling_params: SamplingParams,
                        logprobs: LogprobRequest = LogprobRequest()) -> Iterator[tuple[str, Optional[dict]]]:
        kw = self._request_kwargs(sampling_params)
        if self.is_chat_model:
            stream = self._call(self.client.chat.completions.create, messages=self._messages(prompt), stream=True,
                                stream_options={"include_usage": True}, **kw)
        else:
            stream = self._call(self.client.completions.create, prompt=prompt.text, stream=True,
                                stream_options={"include_usage": True}, **kw)
        yield from stream_deltas(stream, self.is_chat_model, self.token_usage)

    # ---- select ---------------------------------------------------------------------------------
    def select(self, prompt: Prompt, choices: list[str], temperature: float, method: ChoicesMethod) -> ChoicesDecision:
        self.require(CAP_SELECT, "select")
        if not self.is_chat_model:
            return self._select_by_logprobs(prompt, choices, temperature, method)
        return self._select_constrained(prompt, choices, temperature)

    def _echo_logprobs(self, text: str, start_char: int) -> list[float]:
        """Logprobs of the tokens of `text` that start at or after character `start_char`."""
        base = dict(model=self.model, prompt=text, echo=True, logprobs=1, temperature=0.0)
        try:
            resp = self._call(self.client.completions.create, max_tokens=0, **base)
        except BackendRequestError:  # endpoints that refuse max_tokens=0
            resp = self._call(self.client.completions.create, max_tokens=1, **base)
        lp = resp.choices[0].logprobs
        if lp is None or lp.token_logprobs is None:
            raise BackendError(f"{self.model} returned no prompt logprobs; select needs echo+logprobs support")
        pairs = [(off, v) for off, v in zip(lp.text_offset, lp.token_logprobs) if off < len(text)]
        tail = [float(v) for off, v in pairs if off >= start_char and v is not None]
        if not tail:  # the choice merged into the token that straddles the boundary
            tail = [float(v) for off, v in pairs if off < start_char and v is not None][-1:]
        return tail

    def _select_by_logprobs(self, prompt, choices, temperature, method) -> ChoicesDecision:
        if prompt.images:
            raise ProgramError("select with images needs a chat model")
        token_logprobs = [self._echo_logprobs(prompt.text + c, len(prompt.text)) for c in choices]
        uncond = None
        if method.requires_unconditional_logprobs:
            context = unconditional_context(prompt.open_role, self._chat_template)
            uncond = [self._echo_logprobs(context + c, len(context)) for c in choices]
        return method(choices, token_logprobs, uncond, temperature=temperature)

    def _select_constrained(self, prompt, choices, temperature) -> ChoicesDecision:
        kw: dict[str, Any] = {"model": self.model, "messages": self._messages(prompt), "temperature": temperature,
                              "max_tokens": 16 + max(len(c) for c in choices)}
        if self.constrained == "extra_body":
            kw["extra_body"] = {"regex": choices_regex(choices)}
        else:
            schema = {"type": "object", "properties": {"choice": {"type": "string", "enum": choices}},
                      "required": ["choice"], "additionalProperties": False}
            kw["response_format"] = {"type": "json_schema",
                                     "json_schema": {"name": "choice", "schema": schema, "strict": True}}
        resp = self._call(self.client.chat.completions.create, **kw)
        raw = resp.choices[0].message.content or ""
        answer = raw
        if self.constrained == "response_format":
            try:
                answer = json.loads(raw)["choice"]
            except (ValueError, KeyError, TypeError):
                raise BackendError(f"{self.model} did not follow the choice schema: {raw!r}") from None
        if answer not in choices:
            stripped = answer.strip()
            if stripped not in choices:
                raise BackendError(f"{self.model} answered {raw!r}, which is not one of {choices}")
            answer = stripped
        index = choices.index(answer)
        scores = [0.0 if i == index else float("-inf") for i in range(len(choices))]
        meta = {"choices_method": "constrained", "raw": raw, **response_meta(resp, None)}
        return ChoicesDecision(answer, index, scores, meta)


def openai_sampling_kwargs(sp: SamplingParams) -> dict:
    """The sampling fields the OpenAI API itself names, as its keyword arguments."""
    kw: dict[str, Any] = {"max_tokens": sp.max_new_tokens, "temperature": sp.temperature, "top_p": sp.top_p}
    if sp.stop:
        kw["stop"] = list(sp.stop)
    if sp.frequency_penalty:
        kw["frequency_penalty"] = sp.frequency_penalty
    if sp.presence_penalty:
        kw["presence_penalty"] = sp.presence_penalty
    if sp.seed is not None:
        kw["seed"] = sp.seed
    return kw


def fields_beyond_openai(sp: SamplingParams) -> dict:
    """Non-default SamplingParams fields the OpenAI API has no parameter for (top_k, min_p, ...), regex, json_schema
    and ebnf left out (they have their own routes)."""
    return {k: v for k, v in sp.to_dict(drop_defaults=True).items() if k not in _NATIVE_FIELDS}


def chat_messages(prompt: Prompt, model: str) -> list[dict]:
    """The closed role blocks as chat messages, for a gen/select that opens the assistant's turn."""
    if prompt.open_role != "assistant":
        raise ProgramError(f"{model} is a chat model: gen/select must be inside an assistant() block")
    if prompt.open_role_text.strip():
        raise ProgramError(f"{model} is a chat model: it cannot continue a partly written assistant message; "
                           "put gen/select first in the assistant() block")
    if prompt.loose_text:
        raise ProgramError(f"{model} is a chat model: text outside system/user/assistant blocks would be lost")
    return [dict(m) for m in prompt.messages]


def call_openai_style(model: str, token_usage: Any, fn: Any, kwargs: dict) -> Any:
    """`fn(**kwargs)` with the openai client's errors (LiteLLM's subclass them) as braid's; a response's usage is
    added to `token_usage` (a stream reports its usage in its last chunk: see stream_deltas)."""
    import openai

    try:
        resp = fn(**kwargs)
    except openai.BadRequestError as e:
        raise BackendRequestError(f"{model}: request rejected: {e}", 400) from None
    except openai.APIStatusError as e:
        if 400 <= e.status_code < 500:
            raise BackendRequestError(f"{model}: request rejected ({e.status_code}): {e}", e.status_code) from None
        raise BackendError(f"{model}: server error ({e.status_code}): {e}") from None
    except openai.APIError as e:
        raise BackendError(f"{model}: {e}") from None
    add_usage(token_usage, getattr(resp, "usage", None))
    return resp


def stream_deltas(stream: Any, is_chat: bool, token_usage: Any) -> Iterator[tuple[str, Optional[dict]]]:
    """generate_stream's (delta, None) pieces and final ("", meta_info) from an OpenAI-shaped chunk stream
    (requested with stream_options include_usage: the usage comes once, in the last chunk)."""
    finish, rid, usage = None, None, None
    for chunk in stream:
        rid = chunk.id or rid
        usage = getattr(chunk, "usage", None) or usage
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        delta = (c.delta.content if is_chat else c.text) or ""
        finish = c.finish_reason or finish
        if delta:
            yield delta, None
    add_usage(token_usage, usage)
    yield "", {"id": rid, "finish_reason": {"type": _finish_type(finish), "matched": None}, **usage_meta(usage)}


def add_usage(token_usage: Any, usage: Any) -> None:
    """Add an OpenAI-shaped `usage` object (or dict) to a backend's TokenUsage."""
    if usage is None:
        return
    if isinstance(usage, dict):
        token_usage.add(usage.get("prompt_tokens"), usage.get("completion_tokens"))
    else:
        token_usage.add(getattr(usage, "prompt_tokens", 0), getattr(usage, "completion_tokens", 0))


def _finish_type(reason: Optional[str]) -> str:
    return {"stop": "stop", "length": "length", None: "stop"}.get(reason, reason)


def response_meta(resp: Any, finish_reason: Optional[str]) -> dict:
    return {"id": getattr(resp, "id", None), "finish_reason": {"type": _finish_type(finish_reason), "matched": None},
            **usage_meta(getattr(resp, "usage", None))}


def usage_meta(usage: Any) -> dict:
    """meta_info's token counts from an OpenAI `usage` object; cached_tokens only when the endpoint reports it."""
    if usage is None:
        return {}
    meta = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens}
    cached = getattr(getattr(usage, "prompt_tokens_details", None), "cached_tokens", None)
    if cached is not None:
        meta["cached_tokens"] = cached
    return meta
