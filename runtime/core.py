"""The runtime's vocabulary: requests, forward modes and the batch one forward pass consumes.

Field comments say who fills each field.
"""

from __future__ import annotations

import array
import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch

from braid.runtime.error_kind import ErrorKind
from braid.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from braid.runtime.layers.attention.base import AttentionBackend
    from braid.runtime.layers.sampler import SamplingBatchInfo
    from braid.runtime.mem_cache.pools import KVPool, ReqToTokenPool

__all__ = ["SamplingParams", "ForwardMode", "FinishReason", "Req", "ReqOutput", "ForwardBatch", "ForwardOutput",
           "host_tensor", "host_to_device", "tensor_to_device",
           "RequestError"]


def batch_lora_paths(reqs) -> Optional[list]:
    """ForwardBatch.lora_paths for these requests: each one's adapter name, or None when none has one."""
    names = [r.lora_path for r in reqs]
    return names if any(n is not None for n in names) else None


_ARRAY_TYPECODES = {torch.int64: "q", torch.int32: "i", torch.float64: "d", torch.float32: "f"}


def host_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype) for a list of Python numbers, built through an array.array: several times
    faster for the per-step lists over the batch (torch.tensor parses a list element by element). Values the array
    refuses (floats for an int dtype, overflow, other types) go through torch.tensor, which decides as before."""
    code = _ARRAY_TYPECODES.get(dtype)
    if code is not None and values:
        try:
            return torch.frombuffer(array.array(code, values), dtype=dtype)
        except (TypeError, OverflowError):
            pass
    return torch.tensor(values, dtype=dtype)


def host_to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`; to CUDA through pinned memory with a copy that does not wait for the GPU."""
    return tensor_to_device(host_tensor(values, dtype), device)


def tensor_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, as host_to_device copies it (itself when `device` is the CPU)."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host


class ForwardMode(enum.IntEnum):
    EXTEND = 1  # prefill of new tokens on top of a cached prefix (also mixed extend+decode)
    DECODE = 2  # one token per request
    IDLE = 3

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_extend(self) -> bool:
        return self == ForwardMode.EXTEND


class RequestError(ValueError):
    """A request a user got wrong. `param` names the field (in `prepare_request`'s own names), `code` is
    the OpenAI error code when there is one."""

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass
class FinishReason:
    type: str  # "stop" | "length" | "abort"
    matched: Any = None  # the stop token id (int) or stop string (str) that ended it
    message: Optional[str] = None  # for aborts caused by errors
    kind: Optional[ErrorKind] = None  # for aborts the submitter must answer as an error (runtime/error_kind.py)

    def to_json(self) -> dict:
        d = {"type": self.type, "matched": self.matched}
        if self.message is not None:
            d["message"] = self.message
        return d


@dataclass
class Req:
    # ---- filled by the submitter (Engine / server) ----
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: no prompt logprobs; else prompt tokens from this index
    top_logprobs_num: int = 0
    stream: bool = False
    index: int = 0  # choice index for n > 1
    is_internal: bool = False  # the shared-prompt prefill of an n > 1 request: never reported
    # images/videos: pixels, placeholder ranges in input_ids, content hashes (runtime/multimodal/inputs.py)
    mm_inputs: Any = None
    lora_path: Optional[str] = None  # the LoRA adapter's name (--lora-paths); None: the base model. Set by prepare
    client: str = ""  # the HTTP client's address (per-client grammar compile cap); "" in process

    # ---- filled by the scheduler ----
    output_ids: list[int] = field(default_factory=list)
    req_pool_idx: Optional[int] = None
    prefix_indices: Optional[torch.Tensor] = None  # KV slots of the matched/computed prefix
    last_node: Any = None  # radix node locked for this request
    cached_tokens: int = 0  # prompt tokens served from the radix cache (reported to the user)
    kv_committed_len: int = 0  # tokens of fill_ids whose KV lives in req_to_token
    window_kv_from: int = 0  # hybrid KV pool: window-layer KV below this position is released (or the cache's)
    fill_ids: list[int] = field(default_factory=list)  # input_ids + output_ids being/been computed
    extend_input_len: int = 0  # tokens this step extends by
    is_chunked: bool = False  # mid-way through a chunked prefill
    finished_reason: Optional[FinishReason] = None
    retracted_count: int = 0
    grammar: Any = None  # constrained-decoding state (braid.runtime.constrained)
    jump_forward_tokens: int = 0  # completion tokens appended by jump-forward (not sampled)
    spec_drafts: int = 0  # speculative decoding: this request's drafts verified (passes in which it had one)
    spec_accepted_tokens: int = 0  # speculative decoding: their tokens accepted
    spec_state: Any = None  # EAGLE: the draft head's per-request state (runtime/speculative/eagle.py); NGRAM: its TokenMirror

    # ---- logprobs (filled by the scheduler) ----
    output_token_logprobs: list = field(default_factory=list)  # [(logprob, token_id)]
    output_top_logprobs: list = field(default_factory=list)  # [[(logprob, token_id), ...]]
    input_token_logprobs: Optional[list] = None  # [(logprob|None, token_id)] from logprob_start_len
    input_top_logprobs: Optional[list] = None

    # ---- timings ----
    created_time: float = field(default_factory=time.time)
    first_token_time: Optional[float] = None
    scheduled_time: Optional[float] = None  # first admitted to a prefill batch (queue time = this - created_time)

    # ---- the scheduler keeps these up to date for the output side ----
    sent_offset: int = 0  # output_ids already sent to the client
    dirty_offset: Optional[int] = None  # jump-forward rewrote output_ids from here on
    sent_logprob_offset: int = 0
    sent_input_logprobs: bool = False
    input_logprobs_partial: Optional[tuple] = None  # prompt logprobs accumulated across prefill chunks

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def seqlen(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids


@dataclass
class ForwardBatch:
    """Built by the scheduler/ModelRunner; attention backends attach their own metadata."""

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    req_pool_indices: torch.Tensor  # [B] int64, rows of req_to_token
    seq_lens: torch.Tensor  # [B] int32, total tokens per request after this pass
    out_cache_loc: torch.Tensor  # [T] int64, KV slots written by this pass
    seq_lens_cpu: list[int]
    # EXTEND only
    extend_prefix_lens: Optional[torch.Tensor] = None  # [B] int32
    extend_seq_lens: Optional[torch.Tensor] = None  # [B] int32
    extend_start_loc: Optional[torch.Tensor] = None  # [B] int32, offset of each request in T
    extend_prefix_lens_cpu: Optional[list[int]] = None
    extend_seq_lens_cpu: Optional[list[int]] = None
    # filled by ModelRunner
    req_to_token_pool: Optional["ReqToTokenPool"] = None
    kv_pool: Optional["KVPool"] = None
    attn_backend: Optional["AttentionBackend"] = None
    # prompt logprobs: rows of the hidden states whose logits score the next prompt token ([N] int64 into T),
    # and those tokens ([N] int64); None when no request asks for prompt logprobs
    logits_indices: Optional[torch.Tensor] = None
    logits_targets: Optional[torch.Tensor] = None
    # filled by the scheduler: how to sample each request's next token (None: no sampling, logits only)
    sampling_info: Optional["SamplingBatchInfo"] = None
    # the runner returns the logits unsampled (ForwardOutput.pending_logits); the scheduler samples them with
    # ModelRunner.sample once the host has what the grammar masks need (a chained decode step)
    defer_sampling: bool = False
    # EXTEND only: per request its MultimodalInputs or None ([B]); models that take media read what they need
    mm_inputs: Optional[list] = None
    lora_paths: Optional[list] = None  # [B] adapter name or None per request; None when no request has one
    # EAGLE drafting: ModelRunner.forward returns the final hidden states of every row (ForwardOutput.hidden_states)
    capture_hidden: bool = False
    # EAGLE-3: the decoder layers whose input residual stream (hidden + residual) the model concatenates into
    # aux_hidden [T, len * hidden]; such a pass runs eagerly (graphs do not capture it)
    aux_hidden_layers: Optional[tuple[int, ...]] = None
    aux_hidden: Optional[torch.Tensor] = None
    # EXTEND, speculative tree verify (speculative/draft_tree.py): request i's n_i new tokens see its whole prefix and,
    # instead of each other causally, the new tokens its [n_i, n_i] ancestor mask marks ([q, k] True: attended). The
    # masks flattened row-major and concatenated ([sum n_i^2] bool) and each one's first element ([B] int64); such
    # a pass runs eagerly (extend graphs do not capture it). None: causal
    tree_mask: Optional[torch.Tensor] = None
    tree_mask_start: Optional[torch.Tensor] = None
    # attention-backend-specific metadata
    attn_metadata: Any = None


@dataclass
class ForwardOutput:
    """What ModelRunner.forward returns: sampled ids and the logprobs asked for, on the device, plus their host copy.

    `copy_to_host()` starts non-blocking copies into pinned memory; `host()` waits for them (an overlapped decode
    step launches the next step in between)."""

    next_token_ids: Optional[torch.Tensor]  # [B] int64 (None while pending_logits waits to be sampled)
    next_token_logprobs: Optional[torch.Tensor] = None  # [B] fp32, of the sampled ids under the raw distribution
    next_top_logprobs: Optional[torch.Tensor] = None  # [B, k] fp32
    next_top_ids: Optional[torch.Tensor] = None  # [B, k] int64
    input_token_logprobs: Optional[torch.Tensor] = None  # [N] fp32, rows ForwardBatch.logits_indices
    input_top_logprobs: Optional[torch.Tensor] = None  # [N, k]
    input_top_ids: Optional[torch.Tensor] = None  # [N, k]
    pending_logits: Optional[torch.Tensor] = None  # [B, V] fp32 of a pass run with ForwardBatch.defer_sampling
    # ForwardBatch.capture_hidden: [T, hidden] final hidden states of every row, and the aux_hidden the batch asked
    # for ([T, k * hidden]); on the device, valid until the next pass (a graph's static buffer)
    hidden_states: Optional[torch.Tensor] = None
    aux_hidden_states: Optional[torch.Tensor] = None
    _host: Optional[dict] = None
    _ready: Any = None  # torch.cuda.Event recorded after the copies

    _FIELDS = ("next_token_ids", "next_token_logprobs", "next_top_logprobs", "next_top_ids",
               "input_token_logprobs", "input_top_logprobs", "input_top_ids")

    def copy_to_host(self) -> "ForwardOutput":
        on_cuda = self.next_token_ids.is_cuda
        host = {}
        for name in self._FIELDS:
            t = getattr(self, name)
            if t is None:
                continue
            if on_cuda:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                buf.copy_(t, non_blocking=True)
                host[name] = buf
            else:
                host[name] = t
        if on_cuda:
            self._ready = torch.cuda.Event()
            self._ready.record()
        self._host = host
        return self

    def host(self) -> dict[str, list]:
        """Waits for the copies; returns each present field as (nested) Python lists."""
        return {name: t.tolist() for name, t in self.host_tensors().items()}

    def host_tensors(self) -> dict[str, torch.Tensor]:
        """Waits for the copies; returns each present field as a host tensor."""
        if self._host is None:
            self.copy_to_host()
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None
        return self._host


@dataclass(slots=True)
class ReqOutput:
    """What the scheduler reports for a request that advanced (streaming) or finished (one per streamed request per
    step, hence slots: it is built and read field by field on the host's critical path)."""

    rid: str
    index: int  # choice index for n > 1
    output_ids_offset: int  # new_token_ids replace the output from this position (jump-forward may rewrite recent ids)
    new_token_ids: list[int]
    finished: bool
    finish_reason: Optional[dict]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    completion_tokens_wo_jump_forward: int
    output_token_logprobs: Optional[list] = None  # new [(logprob, id)]
    output_top_logprobs: Optional[list] = None
    input_token_logprobs: Optional[list] = None  # first report only
    input_top_logprobs: Optional[list] = None
    # timings, on the finished report only: wall-clock time of the first token, seconds waiting to be scheduled
    first_token_time: Optional[float] = None
    queue_time: Optional[float] = None
    # on the finished report of a request that had drafts verified: tokens per verified draft (1 + accepted / drafts)
    spec_accept_length: Optional[float] = None
    error_kind: Optional[ErrorKind] = None  # finished report only: the abort's FinishReason.kind
