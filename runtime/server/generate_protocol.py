"""The native /generate body: parsed and checked into a GenerateBody (one entry per prompt)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from braid.runtime.server.errors import asks_for_nothing, bad_request, json_type


@dataclass
class GenerateBody:
    """A validated native /generate body; `prompts` holds texts or token-id lists, one per request."""

    prompts: list[Union[str, list[int]]]
    is_batch: bool
    sampling_params: list[Optional[dict]]  # SamplingParams fields, one dict (or None) per prompt
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False  # each logprob entry gets its token's text
    rids: Optional[list[str]] = None
    image_data: list[Any] = field(default_factory=list)  # one entry per prompt
    is_video: bool = False  # modalities says image_data holds video frames
    video_data: list[Any] = field(default_factory=list)  # one entry per prompt: a video (frames) or a list of them
    lora_paths: list[Optional[str]] = field(default_factory=list)  # one LoRA adapter name (or None) per prompt


_GENERATE_KEYS = {"text", "input_ids", "sampling_params", "stream", "return_logprob", "logprob_start_len",
                  "top_logprobs_num", "rid", "image_data", "return_text_in_logprobs", "modalities", "video_data",
                  "lora_path"}


def _is_id_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


_MODALITIES = ("image", "multi-images", "video")


def parse_generate(body: Any) -> GenerateBody:
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object")
    unknown = sorted(set(body) - _GENERATE_KEYS)
    if unknown:
        raise bad_request(f"unknown field(s): {', '.join(unknown)}", param=unknown[0])
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise bad_request("exactly one of text or input_ids is required", param="text")
    if text is not None:
        if isinstance(text, str):
            prompts, is_batch = [text], False
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            prompts, is_batch = list(text), True
        else:
            raise bad_request("text must be a string or a non-empty list of strings", param="text")
    else:
        if _is_id_list(ids) and ids:
            prompts, is_batch = [ids], False
        elif isinstance(ids, list) and ids and all(_is_id_list(x) and x for x in ids):
            prompts, is_batch = list(ids), True
        else:
            raise bad_request("input_ids must be a non-empty list of integers or of such lists", param="input_ids")

    raw_sp = body.get("sampling_params")
    sps = raw_sp if isinstance(raw_sp, list) else [raw_sp] * len(prompts)
    if len(sps) != len(prompts):
        raise bad_request("sampling_params list must have one entry per prompt", param="sampling_params")
    if not all(sp is None or isinstance(sp, dict) for sp in sps):
        raise bad_request("sampling_params must be an object (or a list with one object per prompt)",
                          param="sampling_params")

    rids = request_ids(body.get("rid"), len(prompts))

    modalities = body.get("modalities")
    if modalities is not None and not (isinstance(modalities, list) and all(m in _MODALITIES for m in modalities)):
        raise bad_request(f"modalities must be a list of {', '.join(_MODALITIES)}", param="modalities")
    if "video" in (modalities or ()) and body.get("video_data") is not None:
        raise bad_request("give a video either as video_data or as image_data with modalities ['video'], not both",
                          param="video_data")
    images = _per_prompt(body.get("image_data"), is_batch, len(prompts))
    videos = _per_prompt(body.get("video_data"), is_batch, len(prompts))

    for name in ("stream", "return_logprob", "return_text_in_logprobs"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise bad_request(f"{name} must be a boolean, got {json_type(body[name])}", param=name)
    return_logprob = bool(body.get("return_logprob"))
    if not return_logprob:
        for name, off in _LOGPROB_OPTIONS.items():
            if not asks_for_nothing(body.get(name), (off,)):
                raise bad_request(f"{name} needs return_logprob to be true", param=name)
    return GenerateBody(prompts=prompts, is_batch=is_batch, sampling_params=sps, stream=bool(body.get("stream")),
                           return_logprob=return_logprob,
                           logprob_start_len=_or_default(body.get("logprob_start_len"), -1),
                           top_logprobs_num=_or_default(body.get("top_logprobs_num"), 0),
                           return_text_in_logprobs=bool(body.get("return_text_in_logprobs")), rids=rids,
                           image_data=images, is_video="video" in (modalities or ()), video_data=videos,
                           lora_paths=_lora_paths(body.get("lora_path"), len(prompts)))


def _lora_paths(value: Any, count: int) -> list[Optional[str]]:
    """/generate's lora_path (SGLang's name): one adapter name for every prompt, or a list with one (or null) per
    prompt. Whether the name is served is prepare_request's check."""
    if value is None or isinstance(value, str):
        return [value] * count
    if isinstance(value, list) and len(value) == count and all(v is None or isinstance(v, str) for v in value):
        return list(value)
    raise bad_request(f"lora_path must be an adapter name or a list of {count} names (or nulls), one per prompt",
                      param="lora_path")


# /generate's options that only shape the logprobs return_logprob asks for -> their value that asks for nothing
_LOGPROB_OPTIONS = {"top_logprobs_num": 0, "logprob_start_len": -1, "return_text_in_logprobs": False}


def _or_default(value: Any, default: Any) -> Any:
    return default if value is None else value


def request_ids(rid: Any, count: int) -> Optional[list[str]]:
    """`rid` of /generate and /v1/completions: one non-empty string per prompt, all distinct; for one prompt a
    string (or a list of one), for a batch a list (a single string would name several requests)."""
    if rid is None:
        return None
    if isinstance(rid, str) and count > 1:
        raise bad_request(f"a batch of {count} prompts needs rid as a list of {count} strings, one per prompt",
                          param="rid")
    rids = [rid] if isinstance(rid, str) else rid
    if not (isinstance(rids, list) and all(isinstance(r, str) and r for r in rids) and len(rids) == count):
        raise bad_request("rid must be a non-empty string (or a list with one non-empty string per prompt)",
                          param="rid")
    if len(set(rids)) != len(rids):
        raise bad_request("rid values must be distinct", param="rid")
    return rids


def _per_prompt(data: Any, is_batch: bool, count: int) -> list:
    """image_data / video_data: one entry per prompt of a batch when it is a list of that length, else shared."""
    if data is None:
        return [None] * count
    if is_batch and isinstance(data, list) and len(data) == count:
        return list(data)
    return [data] * count
