"""Backends that speak braid's native generate API (over HTTP or in-process).

Subclasses supply the transport (`_generate`, `_generate_stream`, `get_model_info`, `flush_cache`);
this class builds request bodies, reads responses, and implements select from prompt logprobs:

1. a zero-token prefill of the prefix (max_new_tokens=0) gives its token count P (and caches it);
2. per choice, text = prefix + choice, max_new_tokens=0, return_logprob, logprob_start_len=max(P-1, 0);
   the choice's token logprobs are the input_token_logprobs at positions >= P;
3. for unconditional_likelihood_normalized, the same with a content-free context instead of the prefix
   (braid.choices.unconditional_context).

Images and video are capabilities only when the served model takes them (`is_multimodal` in its model
info); everything else the native API always offers.

The prompt text: the program's own (its chat template's role markers), except where the served model's chat template
iterates over content parts (`chat_template_content_format` "openai" in its model info) and the program waits on an
assistant block: then the model's template renders the program's role blocks (`_apply_chat_template`; an image is
the part {"type": "image"} and its placeholder goes where that template puts it), as /v1/chat/completions would.
"""

from __future__ import annotations

import json
import threading
from abc import abstractmethod
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, Optional, Union

from braid.backends.base import ALL_CAPABILITIES, CAP_IMAGE, CAP_VIDEO, Backend, GenOutput, LogprobRequest, Prompt
from braid.chat_template import ChatTemplate, chat_template_for, get_chat_template
from braid.choices import ChoicesDecision, ChoicesMethod, unconditional_context
from braid.errors import BackendError, UnsupportedFeatureError
from braid.runtime.sampling_params import SamplingParams

_SELECT_PARALLELISM = 8
_RENDERED_CONVERSATIONS = 64  # rendered prompts kept per backend (a program's next calls share its conversation)
# a message's content part (OpenAI shape, as the interpreter records it) -> the part a chat template takes
_TEMPLATE_PARTS = {"text": lambda p: {"type": "text", "text": p["text"]}, "image_url": lambda p: {"type": "image"},
                   "video_url": lambda p: {"type": "video"}}
_MEDIA_CAPABILITIES = frozenset({CAP_IMAGE, CAP_VIDEO})


def sampling_params_json(sp: SamplingParams) -> dict:
    return sp.to_dict(drop_defaults=True)


class NativeApiBackend(Backend):
    def __init__(self, chat_template: Union[None, str, ChatTemplate] = None):
        if isinstance(chat_template, str):
            chat_template = get_chat_template(chat_template)
        self._chat_template_override = chat_template
        self._chat_template: Optional[ChatTemplate] = None
        self._rendered: dict[str, str] = {}  # template messages (JSON) -> the model's template over them
        self._rendered_lock = threading.Lock()

    # ---- transport (subclasses) -----------------------------------------------------------------
    @abstractmethod
    def _generate(self, body: dict) -> Any:
        """One non-streaming generate call; returns the decoded response (dict, or list for batch input)."""

    @abstractmethod
    def _generate_stream(self, body: dict) -> Iterator[dict]:
        """One streaming generate call; yields each chunk object (text cumulative so far)."""

    def _apply_chat_template(self, messages: list[dict]) -> str:
        """The served model's chat template over `messages` (HF's shape) with the generation prompt."""
        raise NotImplementedError(f"{type(self).__name__} cannot render the model's chat template")

    @abstractmethod
    def get_model_info(self) -> dict:
        """{"model_path", "context_length", "vocab_size", "chat_template": str | None}"""

    # ---- capabilities -----------------------------------------------------------------------------
    @property
    def capabilities(self) -> frozenset[str]:
        if self.get_model_info().get("is_multimodal", False):
            return ALL_CAPABILITIES
        return ALL_CAPABILITIES - _MEDIA_CAPABILITIES

    def supports(self, capability: str) -> bool:
        if capability in _MEDIA_CAPABILITIES:  # only these need the model's info
            return capability in self.capabilities
        return capability in ALL_CAPABILITIES

    def require(self, capability: str, needed_by: Optional[str] = None) -> None:
        if self.supports(capability):
            return
        if capability in _MEDIA_CAPABILITIES:
            model = self.get_model_info().get("model_path", "?")
            needed_by = f"{needed_by or capability}; the served model {model} takes no {capability} input"
        raise UnsupportedFeatureError(repr(self), capability, needed_by)

    # ---- Backend --------------------------------------------------------------------------------
    def get_chat_template(self) -> ChatTemplate:
        if self._chat_template_override is not None:
            return self._chat_template_override
        if self._chat_template is None:
            info = self.get_model_info()
            self._chat_template = chat_template_for(info.get("chat_template"), info.get("model_path"))
        return self._chat_template

    def prompt_text(self, prompt: Prompt) -> str:
        """The text the model reads for `prompt` (see the module's docstring)."""
        if (self._chat_template_override is not None or prompt.open_role != "assistant" or not prompt.messages
                or prompt.loose_text or self.get_model_info().get("chat_template_content_format") != "openai"):
            return prompt.text
        messages = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
                     [_TEMPLATE_PARTS[p["type"]](p) for p in m["content"]]} for m in prompt.messages]
        key = json.dumps(messages)
        with self._rendered_lock:
            rendered = self._rendered.get(key)
        if rendered is None:
            rendered = self._apply_chat_template(messages)
            with self._rendered_lock:
                if len(self._rendered) >= _RENDERED_CONVERSATIONS:
                    self._rendered.pop(next(iter(self._rendered)))
                self._rendered[key] = rendered
        return rendered + prompt.open_role_text

    def request_body(self, prompt: Prompt, sp: Union[SamplingParams, dict], logprobs: LogprobRequest = LogprobRequest(),
                     stream: bool = False, text: Optional[str] = None) -> dict:
        body: dict[str, Any] = {
            "text": self.prompt_text(prompt) if text is None else text,
            "sampling_params": sp if isinstance(sp, dict) else sampling_params_json(sp),
        }
        if stream:
            body["stream"] = True
        if logprobs.return_logprob:
            body["return_logprob"] = True
            body["logprob_start_len"] = logprobs.logprob_start_len
            body["top_logprobs_num"] = logprobs.top_logprobs_num
            if logprobs.return_text:
                body["return_text_in_logprobs"] = True
        if prompt.images:
            body["image_data"] = list(prompt.images)
        if prompt.videos:
            body["video_data"] = [list(frames) for frames in prompt.videos]
        return body

    def generate(self, prompt: Prompt, sampling_params: SamplingParams,
                 logprobs: LogprobRequest = LogprobRequest()) -> GenOutput:
        out = self._call(self.request_body(prompt, sampling_params, logprobs))
        return GenOutput(out.get("text", ""), out.get("meta_info", {}))

    def generate_stream(self, prompt: Prompt, sampling_params: SamplingParams,
                        logprobs: LogprobRequest = LogprobRequest()) -> Iterator[tuple[str, Optional[dict]]]:
        sent = ""
        meta: dict = {}
        for chunk in self._generate_stream(self.request_body(prompt, sampling_params, logprobs, stream=True)):
            text = chunk.get("text", "")
            delta = text[len(sent):] if text.startswith(sent) else text
            sent = text if text.startswith(sent) else sent + text
            meta = chunk.get("meta_info", meta)
            if delta:
                yield delta, None
        self.token_usage.add_meta(meta)
        yield "", meta

    def _call(self, body: dict) -> dict:
        """One non-streaming generate (first output of a batch answer), its tokens added to token_usage."""
        out = _one(self._generate(body))
        self.token_usage.add_meta(out.get("meta_info"))
        return out

    def prefill(self, prompt: Prompt) -> dict:
        """A zero-token prefill of `prompt`: caches it; returns its meta_info (prompt_tokens = its length)."""
        out = self._call(self.request_body(prompt, {"max_new_tokens": 0}))
        return out.get("meta_info", {})

    def cache_prefix(self, prompt: Prompt) -> dict:
        return self.prefill(prompt)

    def select(self, prompt: Prompt, choices: list[str], temperature: float, method: ChoicesMethod) -> ChoicesDecision:
        token_logprobs, prefill_meta = self._score_choices(prompt, choices)
        uncond = None
        if method.requires_unconditional_logprobs:
            context = unconditional_context(prompt.open_role, self.get_chat_template())
            uncond, _ = self._score_choices(Prompt(text=context), choices)
        decision = method(choices, token_logprobs, uncond, temperature=temperature)
        # the prompt's own tokens and the share the prefix cache served, from the prefill that scored them
        for key in ("prompt_tokens", "cached_tokens"):
            if key in prefill_meta:
                decision.meta_info.setdefault(key, prefill_meta[key])
        return decision

    def _score_choices(self, prompt: Prompt, choices: list[str]) -> tuple[list[list[float]], dict]:
        """Per choice, the logprobs of its tokens after `prompt` (steps 1 and 2 above); and the meta_info of the
        prompt's prefill."""
        prefix = self.prompt_text(prompt)
        prefill_meta = self.prefill(prompt)
        prefix_len = int(prefill_meta["prompt_tokens"])
        start = max(prefix_len - 1, 0)
        scoring = {"max_new_tokens": 0, "temperature": 0.0}

        def score(choice: str) -> list[float]:
            body = self.request_body(prompt, scoring, LogprobRequest(True, start, 0), text=prefix + choice)
            entries = self._call(body)["meta_info"]["input_token_logprobs"]
            return _choice_logprobs(entries, prefix_len - start, choice)

        with ThreadPoolExecutor(max_workers=min(len(choices), _SELECT_PARALLELISM)) as pool:
            return list(pool.map(score, choices)), prefill_meta


def _one(out: Any) -> dict:
    if isinstance(out, list):
        if not out:
            raise BackendError("generate returned an empty list")
        out = out[0]
    if not isinstance(out, dict):
        raise BackendError(f"generate returned {type(out).__name__}, expected an object")
    return out


def _choice_logprobs(entries: list, skip: int, choice: str) -> list[float]:
    """Logprobs of the tokens after the prefix. When the choice's first characters merged into the
    prefix's last token there may be none past it; then the merged token stands for the choice."""
    tail = [float(lp) for lp, *_ in entries[skip:] if lp is not None]
    if tail or not choice:
        return tail
    known = [float(lp) for lp, *_ in entries if lp is not None]
    return known[-1:]
