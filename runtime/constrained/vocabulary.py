"""Token id -> raw bytes for a HF tokenizer, and the outlines-core `Vocabulary` built from it.

Special tokens (BOS, EOS, chat markers) carry no text and are left out: a grammar never allows them,
except EOS, which the grammar state adds itself once the automaton is in a final state.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache


@lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[str, int]:
    """The printable stand-in character of each byte in byte-level BPE (GPT-2 style), inverted: char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    char_of_byte = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in char_of_byte:
            char_of_byte[b] = chr(256 + shifted)
            shifted += 1
    return {c: b for b, c in char_of_byte.items()}


def _decoder_kind(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "text"
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders", [])}
    if "ByteLevel" in kinds:
        return "byte_level"
    if "ByteFallback" in kinds or "Metaspace" in kinds or "Replace" in kinds:
        return "sentencepiece"
    return "text"


def _byte_level_bytes(token: str) -> bytes | None:
    alphabet = byte_level_alphabet()
    try:
        return bytes(alphabet[c] for c in token)
    except KeyError:
        return None


def _sentencepiece_bytes(token: str) -> bytes:
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return bytes([int(token[3:5], 16)])
    return token.replace("\u2581", " ").encode("utf-8")


def special_token_ids(tokenizer) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            ids.add(token_id)
    return ids


@dataclass(frozen=True)
class TokenVocabulary:
    """token_bytes[id] is the raw text of a token, None for special tokens (never allowed by a grammar)."""

    token_bytes: tuple[bytes | None, ...]
    eos_token_id: int

    def __len__(self) -> int:
        return len(self.token_bytes)

    def decode_bytes(self, token_ids) -> bytes:
        return b"".join(self.token_bytes[t] or b"" for t in token_ids)

    def outlines_map(self) -> dict[bytes, list[int]]:
        by_bytes: dict[bytes, list[int]] = {}
        for token_id, raw in enumerate(self.token_bytes):
            if raw:
                by_bytes.setdefault(raw, []).append(token_id)
        return by_bytes

    def to_outlines(self):
        from outlines_core import Vocabulary

        return Vocabulary(self.eos_token_id, self.outlines_map())


def build_token_vocabulary(tokenizer, eos_token_id: int | None = None) -> TokenVocabulary:
    eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no EOS token; pass eos_token_id explicitly")
    kind = _decoder_kind(tokenizer)
    specials = special_token_ids(tokenizer) | {eos}
    added = {tid: tok.content for tid, tok in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    vocab = tokenizer.get_vocab()
    size = max(len(tokenizer), max(vocab.values()) + 1)
    token_bytes: list[bytes | None] = [None] * size
    for token, token_id in vocab.items():
        if token_id in specials:
            continue
        raw = None
        if token_id in added:
            raw = added[token_id].encode("utf-8")
        elif kind == "byte_level":
            raw = _byte_level_bytes(token)
        elif kind == "sentencepiece":
            raw = _sentencepiece_bytes(token)
        if raw is None:
            raw = tokenizer.convert_tokens_to_string([token]).encode("utf-8")
        token_bytes[token_id] = raw or None
    return TokenVocabulary(tuple(token_bytes), eos)
