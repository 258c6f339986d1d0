"""Jump-forward: text the grammar forces (JSON keys, punctuation, literals) is appended without sampling.

Forced text is found on the token index itself, byte by byte: in a non-final state where every
allowed token starts with the same byte, that byte is forced (with byte-level BPE every byte is also
a one-byte token, so no valid continuation is missed), and the one-byte token leads to the next
state. This agrees exactly with the masks, for any regex, and costs nothing at compile time
(an interegular FSM of a generic JSON schema takes tens of seconds to build).

The forced bytes are then cut back to whole characters and re-encoded together with the last
few emitted tokens, so the tokens are the ones the tokenizer itself would produce.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from typing import Callable

import torch

FORCED_BYTES_LIMIT = 1024
MAX_WINDOW = 4  # already-emitted tokens that may be re-encoded together with the forced text


@dataclass(frozen=True)
class JumpForward:
    """Caller does `output_ids = output_ids[:len(output_ids) - num_rollback] + token_ids`."""

    num_rollback: int
    token_ids: list[int]


class ForcedBytes:
    """The bytes every continuation from an index state must start with; cached per state."""

    def __init__(self, index, allowed_ids: Callable[[int], torch.Tensor], first_byte: torch.Tensor,
                 single_byte_token: list[int | None]):
        self._index = index
        self._allowed_ids = allowed_ids
        self._first_byte = first_byte  # [V] int16, first byte of each token, -1 for tokens without text
        self._single_byte_token = single_byte_token  # byte value -> id of the token that is exactly that byte
        self._cache: dict[int, bytes] = {}

    def forced_byte(self, state: int) -> int | None:
        if self._index.is_final_state(state):
            return None  # EOS is an alternative
        ids = self._allowed_ids(state)
        if len(ids) == 0:
            return None
        first = self._first_byte[ids]
        byte = int(first[0])
        if byte < 0 or not bool((first == byte).all()):
            return None
        return byte

    def __call__(self, state: int) -> bytes:
        cached = self._cache.get(state)
        if cached is not None:
            return cached
        forced = bytearray()
        current = state
        while len(forced) < FORCED_BYTES_LIMIT:
            byte = self.forced_byte(current)
            token = self._single_byte_token[byte] if byte is not None else None
            nxt = self._index.get_next_state(current, token) if token is not None else None
            if nxt is None:
                break
            forced.append(byte)
            current = nxt
        self._cache[state] = bytes(forced)
        return self._cache[state]


def whole_characters(data: bytes) -> str | None:
    """`data` decoded up to its last complete character; None when it is not UTF-8 from its first byte."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        return decoder.decode(data, final=False)
    except UnicodeDecodeError:
        return None


def retokenize_candidates(tokenizer, token_bytes, accepted: list[int], output_ids: list[int], forced: bytes):
    """(num_rollback, token_ids) to try, smallest window first: the last k tokens' text + the forced text, encoded."""
    shared = 0  # trailing tokens on which output_ids and the grammar state agree
    limit = min(MAX_WINDOW, len(accepted), len(output_ids))
    while shared < limit and int(output_ids[-1 - shared]) == accepted[-1 - shared]:
        shared += 1
    for k in [*range(1, shared + 1), 0]:
        window = b"".join(token_bytes[t] or b"" for t in accepted[len(accepted) - k:]) if k else b""
        text = whole_characters(window + forced)
        if text is None or len(text.encode("utf-8")) <= len(window):
            continue  # the window starts inside a character, or no whole forced character follows it
        token_ids = list(tokenizer.encode(text, add_special_tokens=False))
        if token_ids:
            yield k, token_ids
