"""Stop strings: the incremental detokenizer and the scheduler's stop check agree with naive references on
random token streams (a small byte-level tokenizer and SmolLM2's), their work per token is bounded by the
longest stop rather than the output, and SamplingParams limits the number and length of stops."""

import random
from types import SimpleNamespace

import pytest

from braid.runtime.sampling_params import (MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams,
                                           SamplingParamsError)
from braid.runtime.scheduler.output import OutputProcessor
from braid.runtime.request_io.detokenizer import IncrementalDetokenizer

REPLACEMENT = "\ufffd"


class NaiveDetokenizer:
    """The detokenizer before bounded matching: every update searches the whole text for every stop."""

    def __init__(self, tokenizer, sp: SamplingParams):
        self.tokenizer, self.stops, self.no_stop_trim = tokenizer, list(sp.stop or []), sp.no_stop_trim
        self.skip_special_tokens = sp.skip_special_tokens
        self.ids, self.decoded, self.prefix_offset, self.read_offset = [], "", 0, 0
        self.emitted, self.stopped_at = 0, None

    def _decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self):
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            self.decoded += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def _visible(self, final):
        text = self.decoded
        if self.stopped_at is None:
            ends = [text.find(s) + (len(s) if self.no_stop_trim else 0) for s in self.stops if s in text]
            self.stopped_at = min(ends) if ends else None
        if self.stopped_at is not None:
            return text[:self.stopped_at]
        if final or not self.stops:
            return text
        hold = max((k for s in self.stops for k in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:k])),
                   default=0)
        return text[:len(text) - hold]

    def update(self, offset, new_ids):
        self.ids = self.ids[:offset] + list(new_ids)
        if offset < self.read_offset:
            self.decoded, self.prefix_offset, self.read_offset = "", 0, 0
        self._advance()
        visible = self._visible(False)
        delta = visible[self.emitted:]
        self.emitted = max(self.emitted, len(visible))
        return delta

    def finish(self):
        self.decoded = self._decode(self.ids).rstrip(REPLACEMENT) if self.ids else ""
        visible = self._visible(True)
        delta = visible[self.emitted:]
        self.emitted = len(visible)
        return delta

    @property
    def text(self):
        return self._visible(self.stopped_at is not None)[:self.emitted]


class ByteTokenizer:
    """Byte-level stand-in: each token is a few bytes over a small alphabet, some of them halves of multi-byte
    characters, so a character can span tokens and a stop can start or end inside one."""

    PIECES = [b"a", b"b", b"c", b"ab", b"ba", b"abc", b" ", b"\n", b"\xc3", b"\xa9", b"\xe2\x82", b"\xac", "é".encode(),
              "€".encode(), b"aa", b"cab"]

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.PIECES[i] for i in ids).decode("utf-8", errors="replace")


ALPHABET = ["a", "b", "c", " ", "\n", "é", "€"]


def random_stops(rng: random.Random, max_len: int) -> list[str]:
    return ["".join(rng.choices(ALPHABET, k=rng.randint(1, max_len))) for _ in range(rng.randint(1, 4))]


def run_both(tokenizer, sp: SamplingParams, ids: list[int], rng: random.Random, rewrites: bool):
    """Stream `ids` to both detokenizers in random chunks, sometimes resending from an earlier offset with
    different tokens first (a jump-forward rewrite); every delta, the final flush and the text must agree."""
    fast, naive = IncrementalDetokenizer(tokenizer, sp), NaiveDetokenizer(tokenizer, sp)
    sent = 0
    while sent < len(ids):
        if rewrites and sent > 2 and rng.random() < 0.15:
            back = rng.randint(1, sent)
            detour = [rng.randrange(len(ByteTokenizer.PIECES)) if isinstance(tokenizer, ByteTokenizer)
                      else ids[rng.randrange(len(ids))] for _ in range(rng.randint(1, 3))]
            assert fast.update(sent - back, detour) == naive.update(sent - back, detour)
            assert fast.text == naive.text
            # then the real tokens again from the rewrite point
            assert fast.update(sent - back, ids[sent - back:sent]) == naive.update(sent - back, ids[sent - back:sent])
        step = rng.randint(1, 4)
        new = ids[sent:sent + step]
        assert fast.update(sent, new) == naive.update(sent, new)
        assert fast.text == naive.text
        sent += len(new)
    assert fast.finish() == naive.finish()
    assert fast.text == naive.text
    return fast


@pytest.mark.parametrize("seed", range(300))
def test_matches_naive_on_random_byte_streams(seed):
    rng = random.Random(seed)
    tokenizer = ByteTokenizer()
    ids = [rng.randrange(len(ByteTokenizer.PIECES)) for _ in range(rng.randint(0, 60))]
    sp = SamplingParams(stop=random_stops(rng, 5) if rng.random() < 0.9 else None, no_stop_trim=rng.random() < 0.5)
    run_both(tokenizer, sp, ids, rng, rewrites=seed % 2 == 1)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from braid.runtime.loader.tokenizer import get_tokenizer

    return get_tokenizer(SimpleNamespace(tokenizer_path=None, model_path="smollm2"))


WORDS = ["the", " cat", " sat", "\n", "\n\n", " on", " mat", ".", " naïve", " café", " 東京", " 🙂", "Answer:", " ###"]


@pytest.mark.parametrize("seed", range(40))
def test_matches_naive_with_smollm2_tokenizer(smollm2_tokenizer, seed):
    rng = random.Random(seed)
    text = "".join(rng.choices(WORDS, k=rng.randint(5, 80)))
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    pieces = [w.strip() or w for w in WORDS]
    stops = [rng.choice(pieces) + rng.choice(["", " ", "\n"]) for _ in range(rng.randint(1, 3))]
    sp = SamplingParams(stop=stops, no_stop_trim=rng.random() < 0.5)
    run_both(smollm2_tokenizer, sp, ids, rng, rewrites=seed % 2 == 1)


def test_stop_across_tokens_and_hold_back():
    detok = IncrementalDetokenizer(ByteTokenizer(), SamplingParams(stop=["abca"]))
    assert detok.update(0, [3]) == ""  # "ab" could start "abca"
    assert detok.update(1, [2]) == ""  # "abc" too
    assert detok.update(2, [1]) == "abcb"  # no suffix of "abcb" starts "abca"
    assert detok.update(3, [5]) == ""  # "abcbabc": "abc" held back
    assert detok.update(4, [0]) == ""  # "abcbabca": the stop, trimmed
    assert detok.finish() == "" and detok.text == "abcb"

    kept = IncrementalDetokenizer(ByteTokenizer(), SamplingParams(stop=["€a"], no_stop_trim=True))
    assert kept.update(0, [0, 10]) == ""  # "a" + half of "€": wait for the whole character
    assert kept.update(2, [11]) == "a"  # "a€": "€" could start "€a"
    assert kept.update(3, [0, 1]) == "€a"  # stop kept, "b" after it dropped
    assert kept.finish() == "" and kept.text == "a€a"


def test_scan_cost_is_bounded_by_the_longest_stop():
    """32k characters of output streamed a token at a time against 16 stops of the maximum length: every update
    searches at most (longest - 1 + new characters) per stop, where the naive search covered the whole text."""
    rng = random.Random(0)
    tokenizer = ByteTokenizer()
    stops = ["".join(rng.choices("abc", k=MAX_STOP_STRING_CHARS - 1)) + "\n" for _ in range(MAX_STOP_STRINGS)]
    sp = SamplingParams(stop=stops)
    sp.verify()
    detok = IncrementalDetokenizer(tokenizer, sp)
    ids = []
    worst = 0
    while len(detok.decoded) < 32_000:
        before_chars, before_searched = len(detok.decoded), detok.chars_searched
        token = rng.choice([0, 1, 2, 3, 4, 5, 6, 12, 13])
        ids.append(token)
        detok.update(len(ids) - 1, [token])
        new_chars = len(detok.decoded) - before_chars
        searched = detok.chars_searched - before_searched
        assert searched <= 2 * MAX_STOP_STRINGS * (MAX_STOP_STRING_CHARS - 1 + new_chars)
        worst = max(worst, searched)
    assert detok.stopped_at is None
    assert worst < MAX_STOP_STRINGS * 32_000 / 10
    # the held-back tail never exceeds the longest stop either
    assert len(detok.decoded) - detok.emitted < MAX_STOP_STRING_CHARS


def test_unbounded_stop_length_still_costs_per_token_not_per_output():
    """Bypassing verify (the issue's 16 stops of 50k characters): cost per update stays O(longest + new)."""
    tokenizer = ByteTokenizer()
    stops = ["ab" * 25_000 + str(i) for i in range(16)]
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=stops))
    for i in range(5_000):
        before = detok.chars_searched
        detok.update(i, [3])  # "ab" again: every stop's prefix keeps matching, all of it held back
        assert detok.chars_searched - before <= 16 * (50_001 + 2) * 2
    assert detok.text == "" and len(detok.decoded) == 10_000


def _naive_scheduler_match(tokenizer, stops, output_ids):
    tail = tokenizer.decode(output_ids[-(max(map(len, stops)) + 2):], skip_special_tokens=False)
    return next((s for s in stops if s in tail), None)


def test_scheduler_stop_check_matches_naive_first_stop(smollm2_tokenizer):
    """The scheduler checks after every token; the first token where it sees a stop and the stop it reports are
    those of the full longest + 2 token window it used to decode."""
    tokenizer = smollm2_tokenizer
    processor = SimpleNamespace(tokenizer=tokenizer)
    for seed in range(60):
        rng = random.Random(seed)
        text = "".join(rng.choices(WORDS, k=rng.randint(5, 120)))
        ids = tokenizer.encode(text, add_special_tokens=False)
        stops = [rng.choice(WORDS).strip() or "\n\n" for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.3:
            stops.append("".join(rng.choices(WORDS, k=rng.randint(8, 40))))
        for n in range(1, len(ids) + 1):
            req = SimpleNamespace(sampling_params=SamplingParams(stop=stops), output_ids=ids[:n])
            expected = _naive_scheduler_match(tokenizer, stops, ids[:n])
            assert OutputProcessor._match_stop_str(processor, req) == expected, (seed, n)
            if expected is not None:
                break


def test_scheduler_stop_check_decodes_a_short_tail(smollm2_tokenizer):
    decoded_lengths = []

    class CountingTokenizer:
        def decode(self, ids, skip_special_tokens=False):
            decoded_lengths.append(len(ids))
            return smollm2_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = smollm2_tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 200, add_special_tokens=False)
    stops = ["x" * MAX_STOP_STRING_CHARS]
    req = SimpleNamespace(sampling_params=SamplingParams(stop=stops), output_ids=ids)
    assert OutputProcessor._match_stop_str(SimpleNamespace(tokenizer=CountingTokenizer()), req) is None
    assert sum(decoded_lengths) < MAX_STOP_STRING_CHARS // 2


@pytest.mark.parametrize("stop, message", [
    (["x"] * (MAX_STOP_STRINGS + 1), f"stop: at most {MAX_STOP_STRINGS} stop strings, got {MAX_STOP_STRINGS + 1}"),
    (["ok", "y" * (MAX_STOP_STRING_CHARS + 1)],
     f"stop: each stop string must be at most {MAX_STOP_STRING_CHARS} characters, got one of {MAX_STOP_STRING_CHARS + 1}"),
    (5, "stop: must be a string or a list of strings"),
    (["a", 5], "stop: must be a string or a list of strings"),
])
def test_stop_limits_are_rejected_naming_the_field(stop, message):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams.from_dict({"stop": stop}).verify()
    assert str(e.value) == message and e.value.param == "stop"


def test_stop_limits_allow_the_maximum():
    SamplingParams.from_dict({"stop": ["z" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS}).verify()
    SamplingParams.from_dict({"stop": "z" * MAX_STOP_STRING_CHARS}).verify()
    # empty strings are dropped before counting
    SamplingParams.from_dict({"stop": ["z"] * MAX_STOP_STRINGS + [""]}).verify()
