"""The Backend contract: what the interpreter asks of a model provider.

The interpreter never hands a backend itself; each call gets an immutable `Prompt` snapshot and one
`SamplingParams`. Calls can come from many threads at once (one per program state), so a backend
must be thread-safe.

Capabilities: each backend declares `capabilities`, a frozenset of the CAP_* strings below. Before a
node runs, the interpreter calls `require(cap, what)`, which raises `UnsupportedFeatureError` naming
the backend and the capability when it is missing, so a program fails early with a clear message.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from braid.chat_template import CHATML, ChatTemplate
from braid.choices import ChoicesDecision, ChoicesMethod
from braid.errors import UnsupportedFeatureError
from braid.runtime.sampling_params import SamplingParams

CAP_GEN = "gen"
CAP_STREAM = "stream"  # generate_stream yields text as it is produced
CAP_SELECT = "select"
CAP_CHOICES_METHODS = "choices_methods"  # select honours every ChoicesMethod (scores from logprobs)
CAP_REGEX = "regex"
CAP_JSON_SCHEMA = "json_schema"
CAP_LOGPROBS = "logprobs"  # return_logprob / top_logprobs_num / logprob_start_len
CAP_STOP_TOKEN_IDS = "stop_token_ids"
CAP_IMAGE = "image"
CAP_VIDEO = "video"
CAP_PREFIX_CACHE = "prefix_cache"  # cache_prefix does real work (a zero-token prefill)
CAP_FORK = "fork"

ALL_CAPABILITIES = frozenset({
    CAP_GEN, CAP_STREAM, CAP_SELECT, CAP_CHOICES_METHODS, CAP_REGEX, CAP_JSON_SCHEMA, CAP_LOGPROBS,
    CAP_STOP_TOKEN_IDS, CAP_IMAGE, CAP_VIDEO, CAP_PREFIX_CACHE, CAP_FORK,
})


@dataclass(frozen=True)
class Prompt:
    """What the program has built so far.

    text: the whole rendered prompt (role markers included, one template image token per image).
    images: data URLs in order of appearance.
    videos: one tuple of frame data URLs per video, in order of appearance (text holds one video token each).
    messages: the closed role blocks, [{"role", "content"}], content a str, or a list of
      {"type": "text"|"image_url", ...} parts when the block holds images (OpenAI format).
    open_role / open_role_text: the role block still open at the end of `text`, and its content so far.
    loose_text: whether non-blank text was appended outside any role block.
    """

    text: str
    images: tuple[str, ...] = ()
    videos: tuple[tuple[str, ...], ...] = ()
    messages: tuple[dict, ...] = ()
    open_role: Optional[str] = None
    open_role_text: str = ""
    loose_text: bool = False


@dataclass
class GenOutput:
    """text: the generated text. meta_info: as the native API's meta_info (id, prompt_tokens,
    completion_tokens, cached_tokens, finish_reason {"type", "matched"}, logprob lists if asked)."""

    text: str
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LogprobRequest:
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: no prompt logprobs
    top_logprobs_num: int = 0
    return_text: bool = False  # each logprob entry carries its token's text third: [logprob, id, text]


class TokenUsage:
    """Tokens a backend's calls used, summed over every call since creation or `reset()` (as SGLang's
    `backend.token_usage`): prompt_tokens as the model processed them (a select's scoring calls and a fork's
    prefix caching included), completion_tokens generated. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def add(self, prompt_tokens: Any, completion_tokens: Any) -> None:
        with self._lock:
            self.prompt_tokens += int(prompt_tokens or 0)
            self.completion_tokens += int(completion_tokens or 0)

    def add_meta(self, meta_info: Optional[dict]) -> None:
        """Add a native meta_info's (or OpenAI usage's) prompt_tokens and completion_tokens."""
        if meta_info:
            self.add(meta_info.get("prompt_tokens"), meta_info.get("completion_tokens"))

    def reset(self) -> None:
        with self._lock:
            self.prompt_tokens = 0
            self.completion_tokens = 0

    def __repr__(self) -> str:
        return f"TokenUsage(prompt_tokens={self.prompt_tokens}, completion_tokens={self.completion_tokens})"


class Backend(ABC):
    capabilities: frozenset[str] = frozenset({CAP_GEN})
    # True for backends that take messages and answer whole assistant turns (no prompt continuation)
    is_chat_model: bool = False

    @property
    def token_usage(self) -> TokenUsage:
        usage = self.__dict__.get("_token_usage")
        if usage is None:
            usage = self.__dict__.setdefault("_token_usage", TokenUsage())
        return usage

    # ---- capabilities -------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return type(self).__name__

    def supports(self, capability: str) -> bool:
        return capability in self.capabilities

    def require(self, capability: str, needed_by: Optional[str] = None) -> None:
        if capability not in self.capabilities:
            raise UnsupportedFeatureError(self.name, capability, needed_by)

    # ---- the calls ----------------------------------------------------------------------------
    def get_chat_template(self) -> ChatTemplate:
        """The template role blocks are rendered with. Default: ChatML."""
        return CHATML

    @abstractmethod
    def generate(self, prompt: Prompt, sampling_params: SamplingParams,
                 logprobs: LogprobRequest = LogprobRequest()) -> GenOutput:
        """Continue `prompt.text` under `sampling_params` (regex / json_schema constrain the output)."""

    def generate_stream(self, prompt: Prompt, sampling_params: SamplingParams,
                        logprobs: LogprobRequest = LogprobRequest()) -> Iterator[tuple[str, Optional[dict]]]:
        """Yield (text_delta, None) as text is produced, then ("", meta_info) once at the end.
        Default: one non-streaming generate."""
        out = self.generate(prompt, sampling_params, logprobs)
        if out.text:
            yield out.text, None
        yield "", out.meta_info

    def select(self, prompt: Prompt, choices: list[str], temperature: float,
               method: ChoicesMethod) -> ChoicesDecision:
        """Pick one of `choices` as the continuation of `prompt`."""
        self.require(CAP_SELECT, "select")
        raise NotImplementedError

    def cache_prefix(self, prompt: Prompt) -> Optional[dict]:
        """Make `prompt` cached for later requests that extend it (a zero-token prefill); its meta_info
        (prompt_tokens, cached_tokens) where the backend reports one. Default: nothing, None."""
        return None

    def flush_cache(self) -> None:
        """Drop every cached prefix. Default: nothing."""

    def shutdown(self) -> None:
        """Release connections/processes. Default: nothing."""
