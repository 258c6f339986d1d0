"""The language's public constructors: function, gen, select, image, video, roles."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

from braid import ir
from braid.choices import ChoicesMethod, resolve_choices_method, token_length_normalized
from braid.defaults import resolve_backend
from braid.errors import ProgramError
from braid.media import image_to_data_url, video_to_frame_data_urls
from braid.program import BraidFunction
from braid.runtime.sampling_params import SamplingParams
from braid.sampling import DTYPE_NAMES, dtype_regex, merge, pick_sampling_keywords, schema_to_json, to_field_overrides


def function(func: Optional[Callable] = None, *, num_api_spec_tokens: Optional[int] = None,
             **default_sampling: Any) -> Any:
    """`@braid.function` or `@braid.function(temperature=0, max_tokens=64)` (sampling defaults for
    every gen of the program; run()'s keywords override them, gen's own override both).
    num_api_spec_tokens=N: API speculative execution, one call generating up to N tokens ahead for several
    gens (see braid.speculation)."""
    if func is None:
        return lambda f: BraidFunction(f, default_sampling=default_sampling, num_api_spec_tokens=num_api_spec_tokens)
    return BraidFunction(func, default_sampling=default_sampling, num_api_spec_tokens=num_api_spec_tokens)


def gen(
    name: Optional[str] = None,
    max_tokens: Optional[int] = None,
    stop: Union[None, str, list[str]] = None,
    stop_token_ids: Optional[list[int]] = None,
    temperature: Optional[float] = None,
    top_p: Optional[float] = None,
    top_k: Optional[int] = None,
    min_p: Optional[float] = None,
    frequency_penalty: Optional[float] = None,
    presence_penalty: Optional[float] = None,
    ignore_eos: Optional[bool] = None,
    return_logprob: bool = False,
    logprob_start_len: Optional[int] = None,
    top_logprobs_num: Optional[int] = None,
    return_text_in_logprobs: bool = False,
    dtype: Optional[type] = None,
    regex: Optional[str] = None,
    json_schema: Any = None,
    grammar: Optional[str] = None,
    choices: Optional[Sequence[str]] = None,
    choices_method: Union[ChoicesMethod, str, None] = None,
    **more_sampling: Any,
) -> ir.Node:
    """Generate text into variable `name`. Sampling keywords left None inherit the program's defaults;
    any other SamplingParams field (seed, repetition_penalty, min_new_tokens, ...) goes in **more_sampling.
    dtype (int, float, bool, str) constrains the output with a regex and converts the variable.
    json_schema: a dict, a JSON string or a pydantic model class. grammar: a context-free grammar, Lark text or
    GBNF / EBNF text with `root ::= ...` (SamplingParams' `ebnf`). choices: makes this a select()."""
    if choices is not None:
        return select(name, choices, temperature=temperature or 0.0,
                      choices_method=choices_method or token_length_normalized)
    if isinstance(dtype, str):
        dtype = DTYPE_NAMES.get(dtype, dtype)
    keywords = pick_sampling_keywords(locals())
    keywords.update(more_sampling)
    if json_schema is not None:
        keywords["json_schema"] = schema_to_json(json_schema)
    if grammar is not None:
        if keywords.get("ebnf") is not None:
            raise ProgramError("gen: grammar and ebnf are the same parameter; give one")
        if not isinstance(grammar, str) or not grammar.strip():
            raise ProgramError(f"gen: grammar must be the text of a grammar (Lark or EBNF), got {grammar!r}")
        keywords["ebnf"] = grammar
    if dtype is not None:
        if regex is not None or json_schema is not None or keywords.get("ebnf") is not None:
            raise ProgramError("gen: dtype cannot be combined with regex, json_schema or grammar")
        keywords["regex"] = dtype_regex(dtype)
    sampling = to_field_overrides(keywords)
    if sampling.get("n", 1) != 1:
        raise ProgramError("gen produces one sample; fork the state for several")
    merge(SamplingParams(), sampling)  # invalid values fail here, in the program's thread
    if name is not None and not isinstance(name, str):
        raise ProgramError(f"gen name must be a string, got {name!r}")
    if top_logprobs_num is not None and (not isinstance(top_logprobs_num, int) or top_logprobs_num < 0):
        raise ProgramError(f"top_logprobs_num must be a non-negative integer, got {top_logprobs_num!r}")
    if return_text_in_logprobs and not (return_logprob or top_logprobs_num):
        raise ProgramError("gen: return_text_in_logprobs needs return_logprob=True or top_logprobs_num")
    return ir.Gen(name, sampling, return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                  top_logprobs_num=top_logprobs_num, dtype=dtype, return_text_in_logprobs=return_text_in_logprobs)


def gen_int(name: Optional[str] = None, **kwargs: Any) -> ir.Node:
    return gen(name, dtype=int, **kwargs)


def gen_string(name: Optional[str] = None, **kwargs: Any) -> ir.Node:
    return gen(name, dtype=str, **kwargs)


def select(name: Optional[str] = None, choices: Optional[Sequence[str]] = None, temperature: float = 0.0,
           choices_method: Union[ChoicesMethod, str, None] = token_length_normalized) -> ir.Node:
    """Append whichever of `choices` the model finds likeliest (see braid.choices for the methods);
    temperature > 0 samples among them instead."""
    if choices is None or isinstance(choices, str) or len(choices) == 0:
        raise ProgramError("select needs a non-empty list of choices")
    choices = list(choices)
    bad = [c for c in choices if not isinstance(c, str)]
    if bad:
        raise ProgramError(f"select choices must be strings, got {bad[0]!r}")
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ProgramError(f"select temperature must be >= 0, got {temperature!r}")
    return ir.Select(name, choices, float(temperature), resolve_choices_method(choices_method))


def image(source: Any) -> ir.Node:
    """An image: a path, http(s) URL, data URL, bytes or PIL.Image."""
    return ir.Image(image_to_data_url(source))


def video(path: Any, num_frames: int) -> ir.Node:
    """`num_frames` evenly spaced frames of a video (file, frame folder or list of images)."""
    return ir.Video(video_to_frame_data_urls(path, num_frames), source=str(path))


def _role(role: str, expr: Any) -> ir.Node:
    if expr is None:
        return ir.Concat([ir.RoleBegin(role), ir.RoleEnd(role)])
    return ir.Concat([ir.RoleBegin(role), ir.as_node(expr), ir.RoleEnd(role)])


def system(expr: Any = None) -> ir.Node:
    return _role("system", expr)


def user(expr: Any = None) -> ir.Node:
    return _role("user", expr)


def assistant(expr: Any = None) -> ir.Node:
    return _role("assistant", expr)


def system_begin() -> ir.Node:
    return ir.RoleBegin("system")


def system_end() -> ir.Node:
    return ir.RoleEnd("system")


def user_begin() -> ir.Node:
    return ir.RoleBegin("user")


def user_end() -> ir.Node:
    return ir.RoleEnd("user")


def assistant_begin() -> ir.Node:
    return ir.RoleBegin("assistant")


def assistant_end() -> ir.Node:
    return ir.RoleEnd("assistant")


def flush_cache(backend: Any = None) -> None:
    """Drop the backend's cached prefixes."""
    resolve_backend(backend).flush_cache()


def _server_route(backend: Any, method: str) -> dict:
    resolved = resolve_backend(backend)
    getter = getattr(resolved, method, None)
    if getter is None:
        raise ProgramError(f"{resolved.name} is not a braid runtime; {method} needs RuntimeEndpoint, Runtime or "
                           "LocalEngine")
    return getter()


def get_server_info(backend: Any = None) -> dict:
    """The runtime's /get_server_info (load, cache and token counters, server args)."""
    return _server_route(backend, "get_server_info")


def get_server_args(backend: Any = None) -> dict:
    """The runtime's ServerArgs (/get_server_args)."""
    return _server_route(backend, "get_server_args")
