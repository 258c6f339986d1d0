"""The one check of a request against the model and the KV pool.

It runs where a request is prepared (runtime/request_io/prepare.py, in the server process or the Engine) and again where
the scheduler admits it (runtime/scheduler/intake.py): the scheduler trusts no other process, and only it knows its
KV pool's size for sure. Both run this function, so a request refused on either side reads the same. A user's mistake
raises `RequestError` or `SamplingParamsError` (ValueErrors naming the parameter, HTTP 400).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from braid.runtime.core import RequestError
from braid.runtime.sampling_params import MAX_TOP_LOGPROBS, SamplingParams, SamplingParamsError

_MAX_INT32 = 2**31 - 1


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    context_len: int
    kv_total_tokens: Optional[int] = None  # tokens the KV pool holds; None where not known (a check left out)


def check_request(limits: RequestLimits, model_ids: Sequence[int], sp: SamplingParams, logprob_start_len: int = -1,
                  top_logprobs_num: int = 0) -> None:
    """Raise for a request the model or the pool cannot serve. `model_ids`: the prompt's token ids as the model sees
    them (a multimodal request's placeholders as their item's token id, MultimodalInputs.model_ids)."""
    if not model_ids:
        raise RequestError("the prompt is empty", "prompt")
    if min(model_ids) < 0 or max(model_ids) >= limits.vocab_size:
        raise RequestError(f"the prompt holds a token id outside the vocabulary [0, {limits.vocab_size})", "prompt")
    verify_sampling_params(sp, limits.vocab_size)
    _check_length(limits, len(model_ids), sp.max_new_tokens)
    _check_logprobs(len(model_ids), logprob_start_len, top_logprobs_num)


def verify_sampling_params(sp: SamplingParams, vocab_size: Optional[int]) -> None:
    """`sp.verify`, with the TypeErrors and ValueErrors it lets through turned into a SamplingParamsError naming the
    first field at fault."""
    try:
        sp.verify(vocab_size)
    except SamplingParamsError:
        raise
    except (TypeError, ValueError) as e:
        raise SamplingParamsError(f"invalid sampling parameters: {e}", culprit(sp.to_dict(drop_defaults=True))) from None


def culprit(fields: dict) -> Optional[str]:
    """The first field that fails on its own (for errors SamplingParams raises without naming one)."""
    for name, value in fields.items():
        try:
            SamplingParams.from_dict({name: value}).verify()
        except (TypeError, ValueError):
            return name
    return None


def _check_length(limits: RequestLimits, prompt_len: int, max_new_tokens: int) -> None:
    context_len, kv_total = limits.context_len, limits.kv_total_tokens
    if prompt_len >= context_len:
        raise RequestError(f"The prompt is {prompt_len} tokens, the model's context is {context_len} tokens",
                           "prompt", "context_length_exceeded")
    if prompt_len + max_new_tokens > context_len:
        raise RequestError(f"The prompt ({prompt_len} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the "
                           f"model's context of {context_len} tokens", "max_new_tokens", "context_length_exceeded")
    if kv_total is not None and prompt_len + max_new_tokens > kv_total:
        raise RequestError(f"The prompt ({prompt_len} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the KV "
                           f"cache of {kv_total} tokens", "max_new_tokens", "context_length_exceeded")


def _check_logprobs(prompt_len: int, logprob_start_len: int, top_logprobs_num: int) -> None:
    for name, value, low in (("logprob_start_len", logprob_start_len, -1), ("top_logprobs_num", top_logprobs_num, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= _MAX_INT32:
            raise RequestError(f"{name} must be an integer in [{low}, {_MAX_INT32}], got {value!r}", name)
    if top_logprobs_num > MAX_TOP_LOGPROBS:
        raise RequestError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs_num}",
                           "top_logprobs_num")
    # checked with or without return_logprob: the scheduler always refused a start past the prompt
    if logprob_start_len >= prompt_len:
        raise RequestError(f"logprob_start_len must be < the prompt length ({prompt_len})", "logprob_start_len")
