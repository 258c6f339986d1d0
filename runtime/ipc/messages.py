"""Typed messages between the HTTP server process and the scheduler process.

msgpack-encoded msgspec Structs, tagged by class name, so each socket carries one Union type and no
pickle ever crosses a socket.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import msgspec

from braid.runtime.error_kind import ErrorKind

# ---- server -> scheduler ----------------------------------------------------------------------


class MediaItem(msgspec.Struct):
    """One image or video of a request (runtime/multimodal/inputs.MultimodalItem): its pixels as raw fp32 bytes."""

    modality: str
    pixels: bytes  # fp32, C order, `shape`
    shape: list[int]
    image_size: list[int]
    anyres: bool
    content_hash: str
    num_tokens: int
    offset: int
    token_id: int


class GenerateReq(msgspec.Struct, tag=True):
    """A prepared `Req` (runtime/request_io/prepare.py) on the wire; the scheduler process rebuilds the Req."""

    rid: str
    input_ids: list[int]
    sampling_params: dict  # SamplingParams.to_dict(); rebuilt with SamplingParams.from_dict
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    media: Optional[list[MediaItem]] = None
    client: str = ""
    lora_path: Optional[str] = None


def message_from_req(req: Any) -> GenerateReq:
    """The wire form of a prepared `Req`."""
    return GenerateReq(rid=req.rid, input_ids=req.input_ids, sampling_params=req.sampling_params.to_dict(),
                       return_logprob=req.return_logprob, logprob_start_len=req.logprob_start_len,
                       top_logprobs_num=req.top_logprobs_num, stream=req.stream, media=_media_items(req.mm_inputs),
                       client=req.client, lora_path=req.lora_path)


def req_from_message(msg):
    """The Req a GenerateReq carries (the scheduler process's and the TP followers' intake); `message_from_req`'s
    inverse."""
    from braid.runtime.core import Req
    from braid.runtime.sampling_params import SamplingParams

    req = Req(rid=msg.rid, input_ids=list(msg.input_ids), sampling_params=SamplingParams.from_dict(msg.sampling_params),
              return_logprob=msg.return_logprob, logprob_start_len=msg.logprob_start_len,
              top_logprobs_num=msg.top_logprobs_num, stream=msg.stream, client=msg.client,
              lora_path=msg.lora_path)
    if msg.media is not None:
        from braid.runtime.multimodal.inputs import inputs_from_wire

        req.mm_inputs = inputs_from_wire(msg.media)
    return req


def _media_items(mm: Any) -> Optional[list[MediaItem]]:
    if mm is None:
        return None
    return [MediaItem(modality=it.modality, pixels=it.pixel_values.contiguous().numpy().tobytes(),
                      shape=list(it.pixel_values.shape), image_size=list(it.image_size), anyres=it.anyres,
                      content_hash=it.content_hash, num_tokens=it.num_tokens, offset=it.offset, token_id=it.token_id)
            for it in mm.items]


class AbortReq(msgspec.Struct, tag=True):
    rid: str


class FlushCacheReq(msgspec.Struct, tag=True):
    req_id: int


class GetStatsReq(msgspec.Struct, tag=True):
    req_id: int


class ShutdownReq(msgspec.Struct, tag=True):
    pass


class LoadLoraReq(msgspec.Struct, tag=True):
    """Register the PEFT adapter folder lora_path as lora_name (answered by a LoraResult)."""

    req_id: int
    lora_name: str
    lora_path: str


class UnloadLoraReq(msgspec.Struct, tag=True):
    """Unload lora_name once the requests on it have finished (answered by a LoraResult then)."""

    req_id: int
    lora_name: str


ToScheduler = Union[GenerateReq, AbortReq, FlushCacheReq, GetStatsReq, ShutdownReq, LoadLoraReq, UnloadLoraReq]

# ---- scheduler -> server ----------------------------------------------------------------------


class Ready(msgspec.Struct, tag=True):
    context_len: int
    vocab_size: int
    model_path: str
    model_info: dict = {}


class Output(msgspec.Struct, tag=True):
    """One request's progress in one scheduler step (mirrors braid.runtime.core.ReqOutput)."""

    rid: str
    index: int = 0
    output_ids_offset: int = 0
    new_token_ids: list[int] = []
    finished: bool = False
    finish_reason: Optional[dict] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens_wo_jump_forward: int = 0
    output_token_logprobs: Optional[list] = None  # new [(logprob, id)]
    output_top_logprobs: Optional[list] = None  # new [[(logprob, id), ...] | None]
    input_token_logprobs: Optional[list] = None  # first output only
    input_top_logprobs: Optional[list] = None
    first_token_time: Optional[float] = None  # finished output only: wall-clock time of the first token
    queue_time: Optional[float] = None  # finished output only: seconds the request waited to be scheduled
    error_kind: Optional[ErrorKind] = None  # finished output only: an abort the server answers as an error
    spec_accept_length: Optional[float] = None  # finished output only, with speculative decoding


class OutputBatch(msgspec.Struct, tag=True):
    outputs: list[Output]


class ReqError(msgspec.Struct, tag=True):
    """add_request rejected the request; `kind` says whose fault it was and whether a retry may succeed."""

    rid: str
    message: str
    param: Optional[str] = None
    kind: ErrorKind = ErrorKind.INVALID_REQUEST


class FlushCacheResult(msgspec.Struct, tag=True):
    req_id: int
    ok: bool


class Stats(msgspec.Struct, tag=True):
    req_id: int
    stats: dict


class LoraResult(msgspec.Struct, tag=True):
    """A LoadLoraReq's or UnloadLoraReq's answer: ok, or the refusal (runtime/lora/adapter.LoraError): its message,
    code (lora_invalid, lora_not_found, lora_exists, lora_unloading, lora_disabled; internal_error for a bug) and the
    body field at fault (lora_name or lora_path)."""

    req_id: int
    ok: bool
    message: str = ""
    code: Optional[str] = None
    param: Optional[str] = None


class Fatal(msgspec.Struct, tag=True):
    """The scheduler loop crashed; the process exits after sending this."""

    message: str


FromScheduler = Union[Ready, OutputBatch, ReqError, FlushCacheResult, Stats, LoraResult, Fatal]


def _enc_hook(obj: Any) -> Any:
    # numpy / torch scalars and arrays that slip into outputs
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "item"):
        return obj.item()
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_to_scheduler = msgspec.msgpack.Decoder(ToScheduler)
_from_scheduler = msgspec.msgpack.Decoder(FromScheduler)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_to_scheduler(data: bytes) -> ToScheduler:
    return _to_scheduler.decode(data)


def decode_from_scheduler(data: bytes) -> FromScheduler:
    return _from_scheduler.decode(data)


def output_from_req_output(o: Any) -> Output:
    """The wire form of a braid.runtime.core.ReqOutput. Its fields already hold plain Python values (ids from
    .tolist(), logprobs as tuples, which msgspec writes as arrays), so they are passed through unconverted: this runs
    for every streamed request on every step."""
    return Output(o.rid, o.index, o.output_ids_offset, o.new_token_ids, o.finished, o.finish_reason, o.prompt_tokens,
                  o.completion_tokens, o.cached_tokens, o.completion_tokens_wo_jump_forward, o.output_token_logprobs,
                  o.output_top_logprobs, o.input_token_logprobs, o.input_top_logprobs, o.first_token_time,
                  o.queue_time, o.error_kind, o.spec_accept_length)

