"""How `select` turns per-token logprobs of each choice into a decision.

Input for every method: `token_logprobs[i]` is the list of logprobs of choice i's tokens given the
prompt (position >= the prompt's length); methods that need it also get
`unconditional_token_logprobs[i]`, the logprobs of choice i's tokens after a content-free context
(`unconditional_context`): the markup that opens the current role block, or a newline outside roles,
so that even a one-token choice has a logprob to normalize by.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

from braid.errors import ProgramError


@dataclass
class ChoicesDecision:
    decision: str
    index: int
    scores: list[float]  # one per choice; higher is better
    meta_info: dict[str, Any] = field(default_factory=dict)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("-inf")


class ChoicesMethod(ABC):
    name: str = ""
    requires_unconditional_logprobs: bool = False

    @abstractmethod
    def scores(self, token_logprobs: list[list[float]],
               unconditional_token_logprobs: Optional[list[list[float]]]) -> list[float]:
        """One score per choice (higher wins); used for the decision and for temperature sampling."""

    def pick(self, token_logprobs: list[list[float]], scores: list[float],
             unconditional_token_logprobs: Optional[list[list[float]]]) -> int:
        best = max(scores)
        return scores.index(best)

    def __call__(self, choices: list[str], token_logprobs: list[list[float]],
                 unconditional_token_logprobs: Optional[list[list[float]]] = None,
                 temperature: float = 0.0, rng: Optional[random.Random] = None) -> ChoicesDecision:
        if len(choices) != len(token_logprobs):
            raise ValueError("one logprob list per choice expected")
        if self.requires_unconditional_logprobs and unconditional_token_logprobs is None:
            raise ProgramError(f"{self.name} needs the choices' unconditional logprobs")
        scores = self.scores(token_logprobs, unconditional_token_logprobs)
        if temperature and temperature > 0:
            index = _sample(scores, temperature, rng or random)
        else:
            index = self.pick(token_logprobs, scores, unconditional_token_logprobs)
        meta = {
            "choices_method": self.name,
            "scores": scores,
            "normalized_prompt_logprobs": [_mean(lp) for lp in token_logprobs],
            "token_logprobs": token_logprobs,
        }
        if unconditional_token_logprobs is not None:
            meta["unconditional_token_logprobs"] = unconditional_token_logprobs
        return ChoicesDecision(choices[index], index, scores, meta)

    def __repr__(self) -> str:
        return f"<choices method {self.name}>"


def _sample(scores: list[float], temperature: float, rng: Any) -> int:
    finite = [s for s in scores if s != float("-inf")]
    if not finite:
        return 0
    top = max(finite)
    weights = [math.exp((s - top) / temperature) if s != float("-inf") else 0.0 for s in scores]
    return rng.choices(range(len(scores)), weights=weights, k=1)[0]


class TokenLengthNormalized(ChoicesMethod):
    """Highest mean logprob over the choice's tokens."""

    name = "token_length_normalized"

    def scores(self, token_logprobs, unconditional_token_logprobs):
        return [_mean(lp) for lp in token_logprobs]


class GreedyTokenSelection(ChoicesMethod):
    """Highest logprob of the first token; ties go to the next token, and so on. A choice with fewer
    tokens is padded with its own mean logprob so it can be compared against longer ones sharing its
    prefix tokens."""

    name = "greedy_token_selection"

    def scores(self, token_logprobs, unconditional_token_logprobs):
        return [_mean(lp) for lp in token_logprobs]

    def pick(self, token_logprobs, scores, unconditional_token_logprobs):
        width = max((len(lp) for lp in token_logprobs), default=0)
        padded = [list(lp) + [_mean(lp)] * (width - len(lp)) for lp in token_logprobs]
        alive = list(range(len(token_logprobs)))
        for position in range(width):
            best = max(padded[i][position] for i in alive)
            alive = [i for i in alive if padded[i][position] == best]
            if len(alive) == 1:
                break
        return alive[0]


class UnconditionalLikelihoodNormalized(ChoicesMethod):
    """Highest mean over the choice's tokens of (conditional - unconditional) logprob: how much the
    prompt raises the choice's likelihood above its prior."""

    name = "unconditional_likelihood_normalized"
    requires_unconditional_logprobs = True

    def scores(self, token_logprobs, unconditional_token_logprobs):
        out = []
        for cond, uncond in zip(token_logprobs, unconditional_token_logprobs):
            # tokenizations of a choice with and without a prompt may differ in length; compare totals
            out.append((sum(cond) - sum(uncond)) / len(cond) if cond else float("-inf"))
        return out


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()

_BY_NAME = {m.name: m for m in (token_length_normalized, greedy_token_selection, unconditional_likelihood_normalized)}


def resolve_choices_method(method: Union[str, ChoicesMethod, None]) -> ChoicesMethod:
    if method is None:
        return token_length_normalized
    if isinstance(method, ChoicesMethod):
        return method
    if isinstance(method, str) and method in _BY_NAME:
        return _BY_NAME[method]
    raise ProgramError(f"unknown choices_method {method!r}; use one of {', '.join(_BY_NAME)}")


def unconditional_context(open_role: Optional[str], template: Any) -> str:
    """The context choices are scored against for their unconditional likelihood."""
    if open_role is not None:
        return template.role_prefix(open_role)
    return "\n"


_REGEX_SPECIAL = set("\\.^$*+?{}[]()|/")


def choices_regex(choices: Sequence[str]) -> str:
    """A regex matching exactly one of `choices` (only regex metacharacters escaped, so simple
    regex engines read it too)."""
    def escape(text: str) -> str:
        return "".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in text)

    return "(" + "|".join(escape(c) for c in choices) + ")"
