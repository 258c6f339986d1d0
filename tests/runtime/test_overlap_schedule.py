"""Overlapped decode (the default on CUDA) produces exactly what the synchronous loop does.

On CPU the device runs synchronously, so overlap gains nothing here, but the bookkeeping is the same code:
the scheduler's `overlap` switch is turned on to run it against the plain path on the real SmolLM2.
"""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import lark
import pytest
import torch

from braid.runtime.engine import Engine

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.\n",
    "def fibonacci(n):\n    ",
    "Q: What is 17 + 25?\nA:",
    "1, 2, 3, 4,",
    "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n",
]
PARAMS = [
    {"temperature": 0, "max_new_tokens": 20},
    {"temperature": 0, "max_new_tokens": 7, "ignore_eos": True},
    {"temperature": 0, "max_new_tokens": 24, "stop": ["\n\n", "return"]},
    {"temperature": 0.8, "top_p": 0.9, "seed": 7, "max_new_tokens": 16},
    {"temperature": 0, "max_new_tokens": 18, "stop_token_ids": [28]},
    {"temperature": 0, "max_new_tokens": 12, "min_new_tokens": 4},
]


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    with Engine(model_path="smollm2", log_level="warning", max_total_tokens=4096) as e:
        yield e


def run(engine, overlap: bool):
    engine.scheduler.decode.overlap = overlap
    engine.flush_cache()
    before = engine.get_stats()["num_decode_overlapped"]
    out = engine.generate(PROMPTS, PARAMS)
    stats = engine.get_stats()
    assert stats["kv_used_tokens"] == 0 and stats["num_running_reqs"] == 0
    return out, stats["num_decode_overlapped"] - before


def test_overlapped_decode_equals_synchronous(engine):
    plain, n_plain = run(engine, False)
    overlapped, n_overlapped = run(engine, True)
    assert n_plain == 0 and n_overlapped >= 5  # steps really were chained
    for a, b in zip(plain, overlapped):
        assert a["output_ids"] == b["output_ids"]
        assert a["text"] == b["text"]
        assert a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"]
        assert a["meta_info"]["completion_tokens"] == b["meta_info"]["completion_tokens"]
    assert overlapped[1]["meta_info"]["completion_tokens"] == 7  # max_new_tokens honoured without overshoot


def test_overlapped_decode_streams_and_aborts_cleanly(engine):
    engine.scheduler.decode.overlap = True
    sp = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    prompt = "Tell me a story about a dragon."
    whole = engine.generate(prompt, sp)
    chunks = list(engine.generate(prompt, sp, stream=True))
    assert "".join(c["delta"] for c in chunks) == whole["text"]
    assert chunks[-1]["output_ids"] == whole["output_ids"] and len(whole["output_ids"]) == 40

    # a stream closed mid-decode aborts its request while another keeps decoding beside it
    results = {}
    t = threading.Thread(target=lambda: results.update(long=engine.generate("Count slowly: one, two,",
                                                                             {**sp, "max_new_tokens": 60})))
    t.start()
    stream = engine.generate("Describe the moon.", {**sp, "max_new_tokens": 300}, stream=True)
    for i, _ in enumerate(stream):
        if i == 5:
            break
    stream.close()
    t.join(timeout=300)
    assert results["long"]["meta_info"]["completion_tokens"] == 60
    for _ in range(100):
        stats = engine.get_stats()
        if stats["num_running_reqs"] == 0:
            break
        threading.Event().wait(0.05)
    assert stats["num_running_reqs"] == 0 and stats["kv_used_tokens"] == 0
    assert stats["num_decode_overlapped"] > 0


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
LIST_GRAMMAR = 'start: "[" item ("," item)* "]"\nitem: /[0-9]{1,2}/ | start'
GRAMMAR_PROMPTS = ["A person as JSON:", "A date:", "A nested list:", "The capital of France is"]
GRAMMAR_PARAMS = [{"temperature": 0, "max_new_tokens": 40, "json_schema": json.dumps(PERSON)},
                  {"temperature": 0, "max_new_tokens": 20, "regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"},
                  {"temperature": 0, "max_new_tokens": 30, "ebnf": LIST_GRAMMAR},
                  {"temperature": 0, "max_new_tokens": 20}]


def _check_grammar_outputs(out):
    jsonschema.validate(json.loads(out[0]["text"]), PERSON)
    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]", out[1]["text"])
    if out[2]["meta_info"]["finish_reason"]["type"] == "stop":
        lark.Lark(LIST_GRAMMAR).parse(out[2]["text"])


def test_overlapped_grammar_decode_equals_synchronous(engine):
    """Chained steps with grammars: each pass is launched before the step behind it is committed and sampled once
    the masks are filled. Without jump-forward (which a chained commit skips) the outputs are the plain loop's."""
    engine.scheduler.output.jump_forward_enabled = False
    try:
        engine.scheduler.decode.overlap = False
        plain = engine.generate(GRAMMAR_PROMPTS, GRAMMAR_PARAMS)
        engine.scheduler.decode.overlap = True
        before = engine.get_stats()["num_decode_overlapped"]
        overlapped = engine.generate(GRAMMAR_PROMPTS, GRAMMAR_PARAMS)
        stats = engine.get_stats()
    finally:
        engine.scheduler.output.jump_forward_enabled = True
    assert stats["num_decode_overlapped"] - before >= 5
    assert stats["kv_used_tokens"] == 0 and stats["num_running_reqs"] == 0
    for a, b in zip(plain, overlapped):
        assert a["output_ids"] == b["output_ids"] and a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"]
    _check_grammar_outputs(overlapped)


def test_overlapped_grammar_decode_with_jump_forward_stays_valid(engine):
    engine.scheduler.decode.overlap = True
    params = [{**p, "temperature": 1.0, "seed": 3} for p in GRAMMAR_PARAMS]
    out = engine.generate(GRAMMAR_PROMPTS * 3, params * 3)
    for i in range(3):
        _check_grammar_outputs(out[4 * i:4 * i + 4])
    stats = engine.get_stats()
    assert stats["kv_used_tokens"] == 0 and stats["num_running_reqs"] == 0
