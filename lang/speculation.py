"""API speculative execution (`@braid.function(num_api_spec_tokens=N)`), as SGLang's for API models: one call
generates up to N tokens ahead, and the program's later gens are cut from that text by matching the program's
own literal text, so a program with several gens pays for one call where the speculation holds.

Two forms, chosen by the backend:

- Prompt continuation (completion models, braid's runtime): at an eligible gen with no speculation in hand,
  one call continues the prompt with the gen's sampling parameters, no stop strings and
  max_new_tokens = max(N, the gen's max_tokens). A gen with stop strings is cut at the first one (the stop
  text stays in the speculation for the program's next literal to match); a gen without stop strings waits for
  the program's next literal and is cut where that literal occurs. Literal text that matches the speculation
  consumes it; text that does not discards it. When the speculation cannot decide a gen (its stop or the next
  literal does not occur), the gen takes the whole speculation if that ended on its own (EOS) within the gen's
  max_tokens, and otherwise makes its normal call.
- Chat models (`backend.is_chat_model`): the text and gens of an assistant() block are collected until the
  block ends; one call generates the assistant turn (max_tokens = max(N, the first gen's max_tokens)), which
  must reproduce the block's literal text; each gen is the text between its neighbours (up to its stop string
  when it has one); text past the block's last item is dropped. When the reply does not match, a block whose
  only gen comes first makes that gen's normal call; any other block asks again (SPEC_CHAT_TRIES calls in all)
  and then fails with a ProgramError (a chat API cannot continue a partly written assistant message).

Eligible gens: no grammar (regex, json_schema, ebnf, structural_tag), dtype, logprobs, stop_token_ids, no_stop_trim,
ignore_eos or min_tokens (a cut speculation cannot honour them). Any other gen, select, image or variable scope first
settles a waiting gen and discards the speculation; reading the state (a variable, text(), fork()) settles a waiting
gen.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Union

from braid import ir
from braid.runtime.sampling_params import SamplingParams

SPEC_CHAT_TRIES = 3


def stop_list(sp: SamplingParams) -> list[str]:
    if sp.stop is None:
        return []
    return [sp.stop] if isinstance(sp.stop, str) else [s for s in sp.stop if s]


def is_speculable(node: ir.Gen, sp: SamplingParams, wants_logprobs: bool) -> bool:
    return (sp.grammar() is None and node.dtype is None and not wants_logprobs
            and not sp.stop_token_ids and not sp.no_stop_trim and sp.n == 1 and not sp.ignore_eos
            and not sp.min_new_tokens)


def speculative_params(sp: SamplingParams, num_tokens: int) -> SamplingParams:
    return dataclasses.replace(sp.merged(max_new_tokens=max(num_tokens, sp.max_new_tokens)), stop=None)


@dataclass
class Speculation:
    """Text one speculative call generated that the program has not consumed yet."""

    text: str
    ended_by_model: bool  # the call stopped on EOS (or a stop token), not at its token limit
    completion_tokens: Optional[int]
    call_id: Any = None

    @classmethod
    def from_output(cls, text: str, meta: dict) -> "Speculation":
        finish = (meta.get("finish_reason") or {}).get("type")
        return cls(text, finish == "stop", meta.get("completion_tokens"), meta.get("id"))

    def meta(self, finish_type: str, matched: Optional[str] = None) -> dict:
        return {"id": self.call_id, "speculative": True, "finish_reason": {"type": finish_type, "matched": matched}}

    def consume_literal(self, literal: str) -> None:
        """The program appended `literal`: keep the speculation past it if it predicted it, else drop it."""
        self.text = self.text[len(literal):] if self.text.startswith(literal) else ""

    def cut_at_stop(self, stops: list[str]) -> Optional[tuple[str, str]]:
        """(text before the earliest stop, that stop); the stop stays in the speculation."""
        found = [(self.text.find(s), s) for s in stops]
        found = [(pos, s) for pos, s in found if pos >= 0]
        if not found:
            return None
        pos, stop = min(found)
        value, self.text = self.text[:pos], self.text[pos:]
        return value, stop

    def cut_before(self, literal: str) -> Optional[str]:
        """The text before `literal`'s first occurrence; the speculation continues after the literal."""
        pos = self.text.find(literal)
        if pos < 0:
            return None
        value, self.text = self.text[:pos], self.text[pos + len(literal):]
        return value

    def take_rest(self, max_new_tokens: int) -> Optional[str]:
        """All of it, when a normal call would have given the same: the model ended it within the gen's budget."""
        if not self.ended_by_model or self.completion_tokens is None or self.completion_tokens > max_new_tokens:
            return None
        value, self.text = self.text, ""
        return value


@dataclass
class BlockGen:
    node: ir.Gen
    sp: SamplingParams


BlockItem = Union[str, BlockGen]


def split_reply(reply: str, items: list[BlockItem]) -> Optional[list[str]]:
    """Each item's text in `reply` (a chat model's assistant turn), or None when the reply does not follow the
    block's literal text. Adjacent literals must already be merged."""
    values: list[str] = []
    pos = 0
    for k, item in enumerate(items):
        if isinstance(item, str):
            if not reply.startswith(item, pos):
                return None
            values.append(item)
            pos += len(item)
            continue
        following = items[k + 1] if k + 1 < len(items) else None
        ends = [(reply.find(s, pos), s) for s in stop_list(item.sp)]
        ends = [e for e in ends if e[0] >= 0]
        if ends:
            end = min(ends)[0]
        elif isinstance(following, str):
            end = reply.find(following, pos)
            if end < 0:
                return None
        elif following is None:
            end = len(reply)
        else:
            return None  # two gens in a row without a stop string between them
        values.append(reply[pos:end])
        pos = end
    return values
