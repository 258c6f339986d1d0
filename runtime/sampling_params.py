"""SamplingParams: the single source of truth for sampling fields.

Torch-free on purpose: the language (`import braid`) and the HTTP server import it without the
runtime's heavy dependencies. The DSL, the native API and the OpenAI adapters all convert into it
through `SamplingParams.from_dict` / `merged`, so no field list is retyped elsewhere.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Optional, Union

_MAX_TOP_LOGPROBS = 20
# Stop strings are matched on every generated token: the work per token grows with their number and length.
# OpenAI allows 4 strings; 16 leaves room for SGLang-style stop lists, and 1,000 characters for long delimiters.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1000
_MAX_INT32 = 2**31 - 1  # token counts and ids travel to the scheduler as 64-bit ints and index int32 tensors


class SamplingParamsError(ValueError):
    """A sampling value a user sent is invalid. `param` names the offending field."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


# the fields that carry a grammar, and the grammar kind each one is (at most one per request)
GRAMMAR_FIELDS = ("regex", "json_schema", "ebnf", "structural_tag")
GRAMMAR_KINDS = ("regex", "json", "grammar", "structural_tag")


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: Union[None, str, list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False  # keep the matched stop string in the output
    n: int = 1
    seed: Optional[int] = None
    regex: Optional[str] = None
    json_schema: Union[None, str, dict] = None  # normalized to a JSON string by normalize()
    ebnf: Optional[str] = None  # a context-free grammar: Lark, or GBNF / EBNF (`root ::= ...`)
    structural_tag: Union[None, str, dict] = None  # SGLang's / vLLM's structural tag, normalized to a JSON string
    logit_bias: Optional[dict[int, float]] = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: Optional[list[int]] = None  # sample only among these

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, d: Optional[dict], *, allow_unknown: bool = False) -> "SamplingParams":
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise SamplingParamsError("sampling_params must be an object", "sampling_params")
        names = set(cls.field_names())
        unknown = [k for k in d if k not in names]
        if unknown and not allow_unknown:
            raise SamplingParamsError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}", unknown[0])
        sp = cls(**{k: v for k, v in d.items() if k in names and v is not None})
        sp.normalize()
        return sp

    def merged(self, **overrides: Any) -> "SamplingParams":
        """A copy with every non-None override applied (the DSL's layered defaults)."""
        names = set(self.field_names())
        bad = [k for k in overrides if k not in names]
        if bad:
            raise SamplingParamsError(f"unknown sampling parameter(s): {', '.join(bad)}", bad[0])
        sp = dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})
        sp.normalize()
        return sp

    def to_dict(self, *, drop_defaults: bool = False) -> dict:
        out = dataclasses.asdict(self)
        if drop_defaults:
            default = SamplingParams()
            out = {k: v for k, v in out.items() if v != getattr(default, k)}
        return out

    # ---- validation ---------------------------------------------------------------------------
    def normalize(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop, list):
            self.stop = [s for s in self.stop if s]
        if self.json_schema is not None and not isinstance(self.json_schema, str):
            self.json_schema = _schema_to_json(self.json_schema)
        if isinstance(self.structural_tag, dict):
            self.structural_tag = json.dumps(self.structural_tag)
        if isinstance(self.logit_bias, dict):
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()} or None

    def verify(self, vocab_size: Optional[int] = None) -> None:
        def need(cond: bool, param: str, msg: str) -> None:
            if not cond:
                raise SamplingParamsError(f"{param}: {msg}", param)

        def num(param: str, integer: bool = False) -> None:
            v = getattr(self, param)
            ok = isinstance(v, int) if integer else isinstance(v, (int, float))
            need(ok and not isinstance(v, bool), param, f"must be {'an integer' if integer else 'a number'}, got {v!r}")

        for p in ("max_new_tokens", "min_new_tokens", "top_k", "n"):
            num(p, integer=True)
        for p in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
            num(p)
        for p in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            need(isinstance(getattr(self, p), bool), p, f"must be a boolean, got {getattr(self, p)!r}")
        need(0 <= self.max_new_tokens <= _MAX_INT32, "max_new_tokens", f"must be in [0, {_MAX_INT32}]")
        need(0 <= self.min_new_tokens, "min_new_tokens", "must be >= 0")
        need(self.min_new_tokens <= self.max_new_tokens, "min_new_tokens", "must be <= max_new_tokens")
        need(0.0 <= self.temperature <= 100.0, "temperature", f"must be in [0, 100], got {self.temperature}")
        need(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        need(self.top_k == -1 or 1 <= self.top_k <= _MAX_INT32, "top_k",
             f"must be -1 (disabled) or in [1, {_MAX_INT32}], got {self.top_k}")
        need(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        need(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        need(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        need(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", "must be in (0, 2]")
        need(1 <= self.n <= 128, "n", f"must be in [1, 128], got {self.n}")
        need(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)), "seed", "must be an integer")
        need(self.seed is None or -(2**63) <= self.seed < 2**63, "seed", "must fit in a signed 64-bit integer")
        if self.stop is not None:
            need(isinstance(self.stop, list) and all(isinstance(s, str) for s in self.stop), "stop", "must be a string or a list of strings")
            need(len(self.stop) <= MAX_STOP_STRINGS, "stop",
                 f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
            longest = max(map(len, self.stop), default=0)
            need(longest <= MAX_STOP_STRING_CHARS, "stop",
                 f"each stop string must be at most {MAX_STOP_STRING_CHARS} characters, got one of {longest}")
        if self.stop_token_ids is not None:
            need(isinstance(self.stop_token_ids, list)
                 and all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids),
                 "stop_token_ids", "must be a list of integers")
            need(all(0 <= t <= _MAX_INT32 for t in self.stop_token_ids), "stop_token_ids", "token id out of range")
            if vocab_size is not None:
                need(all(0 <= t < vocab_size for t in self.stop_token_ids), "stop_token_ids", "token id out of range")
        self._verify_token_lists(need, vocab_size)
        grammars = [k for k in GRAMMAR_FIELDS if getattr(self, k) is not None]
        need(self.allowed_token_ids is None or not grammars, "allowed_token_ids",
             f"cannot be combined with {grammars[0] if grammars else 'a grammar'} (the grammar chooses the tokens)")
        need(len(grammars) <= 1, grammars[-1] if grammars else "regex",
             f"{' and '.join(grammars)} are mutually exclusive: give one grammar")
        if self.regex is not None:
            need(isinstance(self.regex, str) and len(self.regex) > 0, "regex", "must be a non-empty string")
        if self.ebnf is not None:
            need(isinstance(self.ebnf, str) and self.ebnf.strip() != "", "ebnf", "must be a non-empty string")
        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema)
            except (TypeError, ValueError) as e:
                raise SamplingParamsError(f"json_schema: not valid JSON ({e})", "json_schema") from None
            need(isinstance(schema, (dict, bool)), "json_schema", "must be a JSON object")
        if self.structural_tag is not None:
            try:
                tag = json.loads(self.structural_tag) if isinstance(self.structural_tag, str) else None
            except ValueError as e:
                raise SamplingParamsError(f"structural_tag: not valid JSON ({e})", "structural_tag") from None
            need(isinstance(tag, dict), "structural_tag", "must be a JSON object")

    def grammar(self) -> Optional[tuple[str, str]]:
        """(kind, spec) of the grammar these params carry: kind is one of GRAMMAR_KINDS; None without one."""
        for field, kind in zip(GRAMMAR_FIELDS, GRAMMAR_KINDS):
            value = getattr(self, field)
            if value is not None:
                return kind, value
        return None

    def _verify_token_lists(self, need, vocab_size: Optional[int]) -> None:
        top = _MAX_INT32 if vocab_size is None else vocab_size - 1

        def token_id(t: Any) -> bool:
            return isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= top

        if self.logit_bias is not None:
            need(isinstance(self.logit_bias, dict), "logit_bias", "must be an object mapping token ids to numbers")
            need(all(token_id(t) for t in self.logit_bias), "logit_bias",
                 f"keys must be token ids in [0, {top}], got {sorted(self.logit_bias, key=str)[:3]}")
            need(all(isinstance(v, (int, float)) and not isinstance(v, bool) and -100 <= v <= 100
                     for v in self.logit_bias.values()), "logit_bias", "values must be numbers in [-100, 100]")
        if self.allowed_token_ids is not None:
            need(isinstance(self.allowed_token_ids, list) and len(self.allowed_token_ids) > 0
                 and all(token_id(t) for t in self.allowed_token_ids), "allowed_token_ids",
                 f"must be a non-empty list of token ids in [0, {top}]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def _token_key(key: Any) -> Any:
    """A logit_bias key as an int token id (JSON object keys are strings); a key that is no integer stays as it
    was for verify() to name."""
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        return int(key)
    return key


def _schema_to_json(schema: Any) -> str:
    if isinstance(schema, dict):
        return json.dumps(schema)
    # pydantic v2 model class
    if hasattr(schema, "model_json_schema"):
        return json.dumps(schema.model_json_schema())
    raise SamplingParamsError("json_schema must be a dict, a JSON string or a pydantic model", "json_schema")


MAX_TOP_LOGPROBS = _MAX_TOP_LOGPROBS
