"""What ends a request and what its text keeps, as a vLLM 0.6 / SGLang user expects: min_new_tokens holds off stop
strings (the scheduler's check and the detokenizer's trim agree, a stop straddling the min_new_tokens-th token
counts), and no_stop_trim (vLLM's include_stop_str_in_output) keeps a stop token's text. Checked against naive
references on token streams and on the in-process Engine with SmolLM2."""

import random
from types import SimpleNamespace

import pytest

from braid.runtime.core import ReqOutput
from braid.runtime.sampling_params import SamplingParams
from braid.runtime.scheduler.output import OutputProcessor
from braid.runtime.request_io.output_accumulator import OutputAccumulator
from test_stop_strings import REPLACEMENT, ByteTokenizer, random_stops, smollm2_tokenizer  # noqa: F401

NEWLINE = 198  # SmolLM2's "\n"
THE = 260  # SmolLM2's " the"


def held_off_chars(tokenizer, ids: list[int], min_new_tokens: int) -> int:
    """Characters of the text before the min_new_tokens-th token (a character it completes belongs to it)."""
    if min_new_tokens <= 1:
        return 0
    return len(tokenizer.decode(ids[:min_new_tokens - 1]).rstrip(REPLACEMENT))


def naive_stop_end(tokenizer, ids: list[int], sp: SamplingParams) -> int:
    """Where the text is cut: the earliest end (start, unless no_stop_trim) among the stops' first occurrences
    that end after the held-off text."""
    text = tokenizer.decode(ids).rstrip(REPLACEMENT)
    floor = held_off_chars(tokenizer, ids, sp.min_new_tokens)
    ends = []
    for s in sp.stop or []:
        pos = text.find(s, max(0, floor - len(s) + 1))
        if pos != -1:
            ends.append(pos + len(s) if sp.no_stop_trim else pos)
    return min(ends, default=len(text))


def feed(tokenizer, sp: SamplingParams, ids: list[int], finish_reason: dict, rng: random.Random) -> OutputAccumulator:
    """Stream ids to an accumulator in random chunks; emitted text is never taken back."""
    acc = OutputAccumulator(0, tokenizer, sp, prompt_tokens=3)
    sent, text = 0, ""
    while True:
        new = ids[sent:sent + rng.randint(1, 4)]
        last = sent + len(new) >= len(ids)
        update = acc.add(ReqOutput("r", 0, sent, new, last, finish_reason if last else None, 3, sent + len(new), 0,
                                   sent + len(new)))
        text += update.delta
        assert update.text == text
        sent += len(new)
        if last:
            return acc


@pytest.mark.parametrize("seed", range(300))
def test_detokenizer_holds_off_stops_until_min_new_tokens_on_random_byte_streams(seed):
    rng = random.Random(seed)
    tokenizer = ByteTokenizer()
    ids = [rng.randrange(len(ByteTokenizer.PIECES)) for _ in range(rng.randint(1, 40))]
    sp = SamplingParams(stop=random_stops(rng, 4), min_new_tokens=rng.randint(0, len(ids) + 2),
                        no_stop_trim=rng.random() < 0.5)
    acc = feed(tokenizer, sp, ids, {"type": "length", "matched": None}, rng)
    expected = tokenizer.decode(ids).rstrip(REPLACEMENT)[:naive_stop_end(tokenizer, ids, sp)]
    assert acc.text == expected, (ids, sp)


WORDS = ["the", " cat", " sat", "\n", "\n\n", " on", " mat", ".", " caf\u00e9", " \U0001f642", "Answer:", " ###"]


@pytest.mark.parametrize("seed", range(40))
def test_scheduler_and_detokenizer_agree_on_the_stop_after_min_new_tokens(smollm2_tokenizer, seed):
    """The scheduler ends the request at the first token whose text completes a stop that ends after the held-off
    text; the accumulator cuts the text at that stop."""
    rng = random.Random(seed)
    tokenizer = smollm2_tokenizer
    ids = tokenizer.encode("".join(rng.choices(WORDS, k=rng.randint(10, 80))), add_special_tokens=False)
    stops = [rng.choice(["\n", "\n\n", "cat", ".\n", " on the", "Answer:"]) for _ in range(rng.randint(1, 2))]
    sp = SamplingParams(stop=stops, min_new_tokens=rng.randint(1, len(ids)), no_stop_trim=rng.random() < 0.3)
    processor = SimpleNamespace(tokenizer=tokenizer)
    finished_at, matched = len(ids), None
    for n in range(sp.min_new_tokens, len(ids) + 1):
        matched = OutputProcessor._match_stop_str(processor, SimpleNamespace(sampling_params=sp, output_ids=ids[:n]))
        if matched is not None:
            finished_at = n
            break
    text = tokenizer.decode(ids[:finished_at])
    floor = held_off_chars(tokenizer, ids, sp.min_new_tokens)
    # the naive rule: the first n from min_new_tokens whose text holds a stop ending after the held-off text
    for n in range(sp.min_new_tokens, finished_at):
        prefix = tokenizer.decode(ids[:n])
        assert not any(prefix.find(s, max(0, floor - len(s) + 1)) != -1 for s in stops), (seed, n)
    if matched is not None:
        assert text.find(matched, max(0, floor - len(matched) + 1)) != -1
    reason = {"type": "stop", "matched": matched} if matched else {"type": "length", "matched": None}
    acc = feed(tokenizer, sp, ids[:finished_at], reason, rng)
    assert acc.text == text[:naive_stop_end(tokenizer, ids[:finished_at], sp)]


def test_a_stop_straddling_the_min_new_tokens_th_token_counts(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("one.\n\ntwo.\n\nthree", add_special_tokens=False)
    first_pair = ids.index(NEWLINE)
    assert ids[first_pair + 1] == NEWLINE, "SmolLM2 tokenizes each newline on its own"
    second_pair = ids.index(NEWLINE, first_pair + 2)
    sp = SamplingParams(stop=["\n\n"], min_new_tokens=second_pair + 2)  # its second newline is that token
    req = SimpleNamespace(sampling_params=sp, output_ids=ids[:second_pair + 2])
    assert OutputProcessor._match_stop_str(SimpleNamespace(tokenizer=smollm2_tokenizer), req) == "\n\n"
    acc = feed(smollm2_tokenizer, sp, ids[:second_pair + 2], {"type": "stop", "matched": "\n\n"}, random.Random(0))
    assert acc.text == "one.\n\ntwo."
    # one token later the pair lies wholly in the held-off text: nothing to stop at up to the end
    later = SamplingParams(stop=["\n\n"], min_new_tokens=second_pair + 3)
    for n in range(second_pair + 3, len(ids) + 1):
        req = SimpleNamespace(sampling_params=later, output_ids=ids[:n])
        assert OutputProcessor._match_stop_str(SimpleNamespace(tokenizer=smollm2_tokenizer), req) is None
    acc = feed(smollm2_tokenizer, later, ids, {"type": "length", "matched": None}, random.Random(0))
    assert acc.text == "one.\n\ntwo.\n\nthree"


# ---- the in-process Engine with SmolLM2 ----

@pytest.fixture(scope="module")
def engine():
    from braid.runtime import Engine

    with Engine(model_path="smollm2", log_level="warning", max_total_tokens=8192) as e:
        yield e
        stats = e.get_stats()
        assert stats["kv_free_tokens"] + stats["kv_cached_tokens"] == stats["kv_total_tokens"]


GREEDY = {"temperature": 0}


def stream_text(engine, prompt: str, sp: dict) -> tuple[str, dict]:
    text, last = "", None
    for chunk in engine.generate(prompt, sp, stream=True):
        text += chunk["delta"]
        last = chunk
    assert last["text"] == text
    return text, last["meta_info"]


@pytest.mark.parametrize("min_new_tokens", [20, 40])
def test_engine_min_new_tokens_holds_off_stop_strings(engine, min_new_tokens):
    """The issue's request: a newline comes first, yet the text runs on to the first newline after the
    min_new_tokens-th token's text begins (or to EOS)."""
    prompt = "The end."
    sp = {**GREEDY, "max_new_tokens": 50, "min_new_tokens": min_new_tokens}
    reference = engine.generate(prompt, sp)  # the same tokens: min_new_tokens masks EOS in both runs
    ids = reference["output_ids"]
    assert ids[0] == NEWLINE and NEWLINE in ids[1:min_new_tokens - 1], "the test needs newlines before the boundary"
    stopped = engine.generate(prompt, {**sp, "stop": ["\n"]})
    n = stopped["meta_info"]["completion_tokens"]
    assert n >= min_new_tokens and stopped["output_ids"] == ids[:n]
    text = engine.tokenizer.decode(ids[:n], skip_special_tokens=True)
    floor = held_off_chars(engine.tokenizer, ids, min_new_tokens)
    cut = text.find("\n", floor)
    if stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": "\n"}:
        assert cut != -1 and stopped["text"] == text[:cut] and ids[n - 1] == NEWLINE
    else:  # EOS: no newline after the held-off text
        assert cut == -1 and stopped["text"] == reference["text"] and n == len(ids)
    assert stopped["text"].startswith("\n") and len(stopped["text"]) >= floor
    streamed, meta = stream_text(engine, prompt, {**sp, "stop": ["\n"]})
    assert streamed == stopped["text"]
    assert (meta["completion_tokens"], meta["finish_reason"]) == (n, stopped["meta_info"]["finish_reason"])


def test_engine_stop_straddling_min_new_tokens(engine):
    prompt = "The end."
    # min_new_tokens masks EOS up to its token: the runs below sample the same tokens until they stop
    reference = engine.generate(prompt, {**GREEDY, "max_new_tokens": 30, "min_new_tokens": 30})["output_ids"]
    pairs = [i for i in range(1, len(reference) - 2) if reference[i] == reference[i + 1] == NEWLINE]
    assert pairs, "the test needs a blank line after the first token"
    first = pairs[0]
    sp = {**GREEDY, "max_new_tokens": 30, "stop": ["\n\n"]}
    out = engine.generate(prompt, {**sp, "min_new_tokens": first + 2})  # the pair's second newline is that token
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "\n\n"}
    assert out["meta_info"]["completion_tokens"] == first + 2
    assert out["text"] == engine.tokenizer.decode(reference[:first])
    later = engine.generate(prompt, {**sp, "min_new_tokens": first + 3})
    assert later["meta_info"]["completion_tokens"] > first + 2
    assert "\n\n" in later["text"][1:]  # the held-off pair stays in the text


def test_engine_no_stop_trim_keeps_the_stop_token_text(engine):
    prompt = "Once upon a time"
    sp = {**GREEDY, "max_new_tokens": 30, "stop_token_ids": [THE]}
    trimmed = engine.generate(prompt, sp)
    kept = engine.generate(prompt, {**sp, "no_stop_trim": True})
    assert trimmed["meta_info"]["finish_reason"] == kept["meta_info"]["finish_reason"] == {"type": "stop",
                                                                                          "matched": THE}
    assert kept["output_ids"] == trimmed["output_ids"] and kept["output_ids"][-1] == THE
    assert kept["text"] == trimmed["text"] + " the"
    assert stream_text(engine, prompt, {**sp, "no_stop_trim": True})[0] == kept["text"]
    assert stream_text(engine, prompt, sp)[0] == trimmed["text"]


def test_engine_no_stop_trim_keeps_eos_text_only_when_special_tokens_show(engine):
    prompt = "The end."
    sp = {**GREEDY, "max_new_tokens": 50}
    plain = engine.generate(prompt, sp)
    eos = engine.tokenizer.eos_token
    assert plain["meta_info"]["finish_reason"] == {"type": "stop", "matched": engine.tokenizer.eos_token_id}
    assert engine.generate(prompt, {**sp, "no_stop_trim": True})["text"] == plain["text"]  # skipped special token
    shown = {**sp, "skip_special_tokens": False}
    assert engine.generate(prompt, shown)["text"] == plain["text"]
    kept = engine.generate(prompt, {**shown, "no_stop_trim": True})
    assert kept["text"] == plain["text"] + eos
    assert stream_text(engine, prompt, {**shown, "no_stop_trim": True})[0] == kept["text"]
