"""One path from user input to a `Req`: tokenization, the request's own validation, its SamplingParams.

The in-process Engine and the HTTP server both call `prepare_request`; the server then sends the Req to
the scheduler process as a `GenerateReq`. Nothing here imports aiohttp or zmq. A user's mistake raises
`RequestError` (or `SamplingParamsError`), ValueErrors that name the parameter; the server answers them
with HTTP 400. The checks against the model and the pool are runtime/request_checks.py's, which the scheduler
runs again as the last line of defence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from braid.runtime.core import Req, RequestError
from braid.runtime.request_checks import RequestLimits, check_request, culprit
from braid.runtime.sampling_params import SamplingParams, SamplingParamsError


@dataclass(frozen=True)
class ServedModel:
    """What request preparation needs to know about the model being served."""

    model_path: str
    name: str  # the served model name
    tokenizer: Any
    context_len: int
    vocab_size: int
    kv_total_tokens: Optional[int] = None
    is_multimodal: bool = False  # has a vision tower: takes images and video
    is_generation: bool = True
    multimodal: Any = None  # runtime/multimodal/prompt.MultimodalPreparer when is_multimodal
    lora_names: tuple[str, ...] = ()  # the LoRA adapters served (--lora-paths names)

    @classmethod
    def from_model_info(cls, model_path: str, name: str, tokenizer: Any, context_len: int, vocab_size: int,
                        model_info: dict) -> "ServedModel":
        """From the scheduler's `Ready.model_info` (a missing key means the model lacks the feature)."""
        kv_total = model_info.get("kv_total_tokens")
        return cls(model_path=model_path, name=name, tokenizer=tokenizer, context_len=context_len,
                   vocab_size=vocab_size, kv_total_tokens=kv_total if isinstance(kv_total, int) else None,
                   is_multimodal=bool(model_info.get("is_multimodal", False)),
                   is_generation=bool(model_info.get("is_generation", True)))

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(self.vocab_size, self.context_len, self.kv_total_tokens)

    @property
    def room(self) -> int:
        """Tokens one request may span: the context, or the KV pool when that is smaller."""
        if self.kv_total_tokens is None:
            return self.context_len
        return min(self.context_len, self.kv_total_tokens)

    def public_info(self) -> dict:
        """The body of /get_model_info (and `Engine.get_model_info()`)."""
        return {"model_path": self.model_path, "served_model_name": self.name, "context_length": self.context_len,
                "vocab_size": self.vocab_size, "chat_template": getattr(self.tokenizer, "chat_template", None),
                "is_generation": self.is_generation, "is_multimodal": self.is_multimodal}


def prepare_request(model: ServedModel, prompt: Union[str, list[int]],
                    sampling_params: Union[None, dict, SamplingParams] = None, *, rid: str,
                    return_logprob: bool = False, logprob_start_len: int = -1, top_logprobs_num: int = 0,
                    stream: bool = False, image_data: Any = None, video_data: Any = None, audio_data: Any = None,
                    add_special_tokens: bool = True, max_new_tokens_fills_context: bool = False,
                    lora_path: Optional[str] = None) -> Req:
    """Tokenize `prompt` (text, or token ids taken as they are), check the request against the model and
    build its Req.

    `sampling_params` given as a dict (or None) goes through `SamplingParams.from_dict`; with
    `max_new_tokens_fills_context` a dict without max_new_tokens may generate the rest of the context
    (the OpenAI routes), otherwise SamplingParams' default applies. Param names in errors: prompt,
    max_new_tokens, logprob_start_len, top_logprobs_num, image_data, video_data, audio_data, or the
    sampling field at fault. lora_path: a served adapter's name (None: the base model); others are refused.
    """
    check_lora_path(model, lora_path)
    mm_inputs = None
    if _check_media(model, image_data, video_data, audio_data) or model.multimodal is not None:
        # a vision model's prompt goes through its preparer even without media: an <image>/<video> mark
        # without its item is a 400, not text
        _tokenize(model, prompt, add_special_tokens)  # the prompt's own checks
        input_ids, mm_inputs = model.multimodal.prepare(model.tokenizer, prompt, image_data, video_data,
                                                        add_special_tokens)
        mm_inputs = mm_inputs if mm_inputs.items else None
    else:
        input_ids = _tokenize(model, prompt, add_special_tokens)
    sp = _sampling_params(model, sampling_params, len(input_ids), max_new_tokens_fills_context)
    check_request(model.limits, input_ids if mm_inputs is None else mm_inputs.model_ids(input_ids, 0), sp,
                  logprob_start_len, top_logprobs_num)
    return Req(rid=rid, input_ids=input_ids, sampling_params=sp, return_logprob=return_logprob,
               logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num, stream=stream,
               mm_inputs=mm_inputs, lora_path=lora_path)


def check_lora_path(model: ServedModel, lora_path: Optional[str]) -> None:
    if lora_path is None:
        return
    if not isinstance(lora_path, str):
        raise RequestError(f"lora_path must be an adapter name (a string), got {type(lora_path).__name__}",
                           param="lora_path")
    if lora_path not in model.lora_names:
        served = (", ".join(model.lora_names) if model.lora_names
                  else "none (--lora-paths name=path, or load_lora_adapter)")
        raise RequestError(f"unknown LoRA adapter {lora_path!r}; adapters served: {served}", param="lora_path")


def _has_media(data: Any) -> bool:
    return data is not None and data != [] and data != ""


def _check_media(model: ServedModel, image_data: Any, video_data: Any, audio_data: Any) -> bool:
    """Whether the request carries images or video (the model takes them); refuses media it cannot take."""
    if _has_media(audio_data):
        raise RequestError(f"model {model.name} takes no audio input", "audio_data", "unsupported_input")
    has_media = False
    for kind, data in (("image", image_data), ("video", video_data)):
        if not _has_media(data):
            continue
        if not model.is_multimodal or model.multimodal is None:
            raise RequestError(f"model {model.name} takes no {kind} input (it has no vision tower)", f"{kind}_data",
                               "unsupported_input")
        has_media = True
    return has_media


def _tokenize(model: ServedModel, prompt: Union[str, list[int]], add_special_tokens: bool) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("the prompt is empty", "prompt")
        return list(model.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
    if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise RequestError("the prompt must be a string or a list of token ids", "prompt")
    return list(prompt)  # emptiness and the vocabulary: check_request


def _sampling_params(model: ServedModel, given: Union[None, dict, SamplingParams], prompt_len: int,
                     max_new_tokens_fills_context: bool) -> SamplingParams:
    if isinstance(given, SamplingParams):
        sp = given
    else:
        if given is not None and not isinstance(given, dict):
            raise SamplingParamsError("sampling_params must be an object", "sampling_params")
        overrides = dict(given or {})
        if max_new_tokens_fills_context and overrides.get("max_new_tokens") is None:
            overrides["max_new_tokens"] = max(model.room - prompt_len, 0)
        try:
            sp = SamplingParams.from_dict(overrides)
        except SamplingParamsError:
            raise
        except (TypeError, ValueError) as e:
            raise SamplingParamsError(f"invalid sampling parameters: {e}", culprit(overrides)) from None
    return sp  # verified by check_request

