"""`\\d`, `\\w`, `\\s` (and negations) are ASCII classes in every regex braid compiles: the rewrite itself, the
token masks on the real SmolLM2 vocabulary (user regex, JSON-schema pattern), and sampling at temperature 1.0."""

import json
import re

import pytest

from braid.runtime.constrained import GrammarBackend
from braid.runtime.constrained.regex_classes import ascii_shorthand_classes

ASCII_DIGITS = set("0123456789")


@pytest.mark.parametrize("regex, expected", [
    (r"\d{3}-\d{4}", r"[0-9]{3}-[0-9]{4}"),
    (r"\w+\s\W\S\D", r"[0-9A-Za-z_]+[\t\n\x0B\f\r ][^0-9A-Za-z_][^\t\n\x0B\f\r ][^0-9]"),
    (r"[\d.]+", r"[0-9.]+"),
    (r"[^\d\s]", r"[^0-9\t\n\x0B\f\r ]"),
    (r"[a\D]", r"[a[^0-9]]"),
    (r"\\d", r"\\d"),  # an escaped backslash followed by a literal d
    (r"\p{Nd}\x{661}\.", r"\p{Nd}\x{661}\."),
    (r"[]\d]", r"[]0-9]"),
    (r"[[:alpha:]\d]", r"[[:alpha:]0-9]"),
])
def test_rewrite(regex, expected):
    assert ascii_shorthand_classes(regex) == expected


def test_rewrite_keeps_python_meaning_on_ascii():
    """On ASCII text the rewritten regex accepts exactly what the original does (Python's re, ASCII flag)."""
    regex = r"(\w+)@[\w.]+\s?[^\d\s]\d{2}"
    rewritten = ascii_shorthand_classes(regex)
    for text in ["ab_1@x.y z12", "a@b q99", "a@b 112", "ab@cd\t-00", "ab@cd  x12", "é@x y12"]:
        assert bool(re.fullmatch(regex, text, re.ASCII)) == bool(re.fullmatch(rewritten, text)), text


@pytest.fixture(scope="module")
def grammars(smollm2_tokenizer):
    backend = GrammarBackend(smollm2_tokenizer, vocab_size=len(smollm2_tokenizer), timeout_s=20.0, num_workers=1,
                             engine="outlines")
    yield backend
    backend.shutdown()


def _token_texts(grammar, tokenizer, fsm_state: int) -> set[str]:
    allowed = grammar.allowed_ids(fsm_state)
    return {tokenizer.decode([int(t)]) for t in allowed if int(t) != grammar.eos_token_id}


@pytest.mark.parametrize("kind, spec, allowed_chars", [
    ("regex", r"\d", ASCII_DIGITS),
    ("regex", r"\w", set("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_")),
    ("regex", r"\s", set("\t\n\x0b\f\r ")),
    ("regex", r"[^\D]", ASCII_DIGITS),
])
def test_masks_admit_only_ascii(grammars, smollm2_tokenizer, kind, spec, allowed_chars):
    grammar = grammars.compile(kind, spec)
    texts = _token_texts(grammar, smollm2_tokenizer, grammar.initial_cursor().fsm_state)
    assert texts, "the grammar allows no first token"
    chars = set("".join(texts))
    assert chars <= allowed_chars, sorted(chars - allowed_chars)[:10]


def test_json_pattern_digits_are_ascii(grammars, smollm2_tokenizer):
    """After the opening quote, a schema pattern's \\d admits only ASCII digits."""
    grammar = grammars.compile("json", {"type": "string", "pattern": r"^\d{2}$"})
    state = grammar.initial_cursor().fsm_state
    quote = smollm2_tokenizer.encode('"')
    assert len(quote) == 1
    state = grammar.index.get_next_state(state, quote[0])
    texts = _token_texts(grammar, smollm2_tokenizer, state)
    assert texts and set("".join(texts)) <= ASCII_DIGITS, texts


@pytest.mark.parametrize("kind, spec, prefix", [
    ("regex", r"\d{3}", ""), ("regex", r"[^\D]+", ""), ("regex", r"x\w", "x"),
    ("json", json.dumps({"type": "string", "pattern": r"^\d{2}$"}), '"'),
    ("json", json.dumps({"type": "object", "patternProperties": {r"^\d$": {"type": "integer"}},
                         "additionalProperties": False}), '{"'),
])
def test_llguidance_masks_admit_only_ascii(smollm2_tokenizer, kind, spec, prefix):
    """The llguidance engine reads \\d, \\w as ASCII too, in regexes and in a schema's patterns."""
    backend = GrammarBackend(smollm2_tokenizer, vocab_size=len(smollm2_tokenizer), engine="llguidance")
    try:
        state = backend.compile(kind, spec).new_state()
        for t in smollm2_tokenizer.encode(prefix, add_special_tokens=False):
            state.accept_token(t)
        texts = {smollm2_tokenizer.decode([t]) for t in state.allowed_token_ids().tolist()
                 if t != backend.eos_token_id}
        assert texts and set("".join(texts)) <= set("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_"), \
            sorted(set("".join(texts)))[-10:]
    finally:
        backend.shutdown()


@pytest.fixture(scope="module")
def engine():
    from braid.runtime import Engine

    with Engine(model_path="smollm2", log_level="warning", max_total_tokens=4096, max_running_requests=64) as e:
        yield e


def test_sampled_digits_are_ascii_at_temperature_1(engine):
    """64 samples of \\d{3}-\\d{4} at temperature 1.0 on SmolLM2 hold only ASCII digits and the dash (before the
    rewrite, most replies held Unicode digits such as U+1FBF1)."""
    n = 64
    outs = engine.generate(["Make up a phone number: "] * n,
                           [{"temperature": 1.0, "max_new_tokens": 16, "regex": r"\d{3}-\d{4}", "seed": i}
                            for i in range(n)])
    texts = [o["text"] for o in outs]
    bad = [t for t in texts if not re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)]
    assert not bad, bad[:5]
    assert len(set(texts)) > 1  # really sampled


@pytest.mark.parametrize("dtype", [int, float])
def test_dtype_numbers_end_without_eos(engine, dtype):
    """gen(dtype=int/float)'s regex ends by itself: with EOS disabled (a model that never stops) every sample still
    finishes on the pattern's end (one space or newline, digit runs bounded), far before max_new_tokens."""
    from braid.sampling import dtype_regex

    n, max_new_tokens = 8, 48
    outs = engine.generate(["Count the stars in the sky: "] * n,
                           [{"temperature": 1.0, "max_new_tokens": max_new_tokens, "regex": dtype_regex(dtype),
                             "ignore_eos": True, "seed": i} for i in range(n)])
    for out in outs:
        meta = out["meta_info"]
        assert meta["finish_reason"]["type"] == "stop" and meta["completion_tokens"] < max_new_tokens, out
        dtype(out["text"].strip())
