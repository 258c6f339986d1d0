"""Constrained decoding on the real SmolLM2 tokenizer, on both engines (llguidance, outlines-core): masks, random
walks, jump-forward, errors, cache."""

import json
import random
import re
import time

import jsonschema
import pytest
import torch

from braid.runtime.constrained import (GrammarBackend, GrammarError, JumpForward, accept_tokens, allocate_bitmask,
                                       build_token_vocabulary, choices_to_regex, fill_bitmasks, json_schema_to_regex,
                                       unpack_row)
from braid.runtime.layers.token_bitmask import apply_token_bitmask_

LOGITS_WIDTH_PAD = 128  # the model's logits are wider than the tokenizer (padded embedding table)

REGEXES = {
    "date": r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "phone": r"\+1 \([0-9]{3}\) [0-9]{3}-[0-9]{4}",
    "ipv4": r"((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])",
    "enumeration": choices_to_regex(["red", "green", "blue", "light blue", "blue-green"]),
    "nested_groups": r"(([a-c]{1,3})-(x|yz)?;){1,3}(end|stop)",
    "digit_run": r"[0-9]{3,12}",
    "unicode": r"(café|naïve) [α-ω]{2,4}!",
}

SCHEMAS = {
    "nested_object": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8},
                               "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
            },
            "nickname": {"type": "string", "maxLength": 6},
        },
        "required": ["name", "address"],
    },
    "array": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
    "enum_number_bool": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "score": {"type": "number"},
                       "ok": {"type": "boolean"}, "note": {"type": "string", "maxLength": 5}},
        "required": ["color", "score", "ok"],
    },
}

FIXED_KEYS_SCHEMA = {
    "type": "object",
    "properties": {
        "first_name": {"type": "string", "maxLength": 4},
        "last_name": {"type": "string", "maxLength": 4},
        "age": {"type": "integer"},
        "city_of_birth": {"type": "string", "maxLength": 4},
        "favourite_color": {"enum": ["red", "green"]},
        "is_registered_member": {"type": "boolean"},
    },
    "required": ["first_name", "last_name", "age", "city_of_birth", "favourite_color", "is_registered_member"],
}


@pytest.fixture(scope="module", autouse=True)
def single_torch_thread():
    """Row-sized ops on [V] masks are microseconds; intra-op threads on a 2-core CI box only add wake-up stalls."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["llguidance", "outlines"])
def backend(smollm2_tokenizer, request):
    be = GrammarBackend(smollm2_tokenizer, vocab_size=len(smollm2_tokenizer) + LOGITS_WIDTH_PAD, timeout_s=10.0,
                        engine=request.param)
    yield be
    be.shutdown()


@pytest.fixture(scope="module")
def outlines_backend(smollm2_tokenizer):
    """outlines-core alone: its forced-byte jump-forward re-encodes across token boundaries (llguidance's
    fast-forward tokens never roll back) and its compiles run in processes that a timeout kills."""
    be = GrammarBackend(smollm2_tokenizer, vocab_size=len(smollm2_tokenizer) + LOGITS_WIDTH_PAD, timeout_s=10.0,
                        engine="outlines")
    yield be
    be.shutdown()


def walk(grammar, tokenizer, generator, jump_forward=False, max_steps=400):
    """Sample uniformly among allowed tokens until the grammar terminates; returns (text, sampled, jumps)."""
    state = grammar.new_state()
    output: list[int] = []
    sampled = 0
    jumps: list[tuple[list[int], JumpForward]] = []
    bitmask = allocate_bitmask(1, grammar.vocab_size)
    while not state.is_terminated():
        assert sampled < max_steps, f"no termination after {max_steps} sampled tokens: {tokenizer.decode(output)!r}"
        if jump_forward:
            jf = state.jump_forward(output)
            if jf is not None:
                jumps.append((list(output), jf))
                output = output[:len(output) - jf.num_rollback] + jf.token_ids
                continue
        state.fill_bitmask(bitmask, 0)
        allowed = unpack_row(bitmask[0], grammar.vocab_size)
        assert torch.equal(allowed, state.allowed_token_ids())
        token = int(allowed[torch.randint(len(allowed), (1,), generator=generator)])
        state.accept_token(token)
        sampled += 1
        if token != grammar.eos_token_id:
            output.append(token)
    return tokenizer.decode(output), sampled, jumps


def test_vocabulary_bytes_round_trip(smollm2_tokenizer):
    tok = smollm2_tokenizer
    vocab = build_token_vocabulary(tok)
    assert len(vocab) == len(tok)
    specials = set(tok.all_special_ids) | {t for t, added in tok.added_tokens_decoder.items() if added.special}
    assert tok.eos_token_id in specials and all(vocab.token_bytes[t] is None for t in specials)
    outlines_ids = {i for ids in vocab.outlines_map().values() for i in ids}
    assert not outlines_ids & specials
    assert len(outlines_ids) == len(tok) - len({t for t in range(len(tok)) if vocab.token_bytes[t] is None})

    rng = random.Random(0)
    ordinary = [t for t in range(len(tok)) if t not in specials]
    for token_id in rng.sample(ordinary, 3000):
        raw = vocab.token_bytes[token_id]
        assert raw, token_id
        assert raw.decode("utf-8", errors="replace") == tok.decode([token_id]), token_id
    for byte_symbol, raw in (("Ġ", b" "), ("Ċ", b"\n"), ("ĉ", b"\t")):
        assert vocab.token_bytes[tok.convert_tokens_to_ids(byte_symbol)] == raw

    text = 'naïve café 日本語 😀 {"key": [1, 2.5]}\n\tend'
    ids = tok.encode(text, add_special_tokens=False)
    assert vocab.decode_bytes(ids).decode("utf-8") == text == tok.decode(ids)


@pytest.mark.parametrize("name", sorted(REGEXES))
def test_random_walks_match_regex(backend, smollm2_tokenizer, name):
    grammar = backend.compile("regex", REGEXES[name])
    generator = torch.Generator().manual_seed(1234)
    pattern = re.compile(REGEXES[name])
    for use_jump_forward in (False, True):
        for _ in range(4):
            text, _, _ = walk(grammar, smollm2_tokenizer, generator, jump_forward=use_jump_forward)
            assert pattern.fullmatch(text), (name, text)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_walks_satisfy_json_schema(backend, smollm2_tokenizer, name):
    schema = SCHEMAS[name]
    grammar = backend.compile("json", json.dumps(schema))
    generator = torch.Generator().manual_seed(99)
    for use_jump_forward in (False, True):
        for _ in range(4):
            text, _, _ = walk(grammar, smollm2_tokenizer, generator, jump_forward=use_jump_forward)
            jsonschema.validate(json.loads(text), schema)


def test_jump_forward_halves_sampled_steps(backend, smollm2_tokenizer):
    tok = smollm2_tokenizer
    grammar = backend.compile("json", json.dumps(FIXED_KEYS_SCHEMA))
    generator = torch.Generator().manual_seed(7)
    sampled = {False: 0, True: 0}
    for use_jump_forward in (False, True):
        for _ in range(6):
            text, steps, jumps = walk(grammar, tok, generator, jump_forward=use_jump_forward)
            jsonschema.validate(json.loads(text), FIXED_KEYS_SCHEMA)
            sampled[use_jump_forward] += steps
            assert bool(jumps) == use_jump_forward
            for before, jf in jumps:
                assert 0 <= jf.num_rollback <= len(before) and jf.token_ids
                kept = before[:len(before) - jf.num_rollback]
                fragment = tok.decode(jf.token_ids)
                assert tok.encode(fragment, add_special_tokens=False) == jf.token_ids
                # Rolled-back tokens are re-encoded, never rewritten: the text only grows.
                assert tok.decode(kept + jf.token_ids).startswith(tok.decode(before))
    assert sampled[True] <= 0.5 * sampled[False], sampled


def test_jump_forward_merges_with_boundary_token(outlines_backend, smollm2_tokenizer):
    tok, backend = smollm2_tokenizer, outlines_backend
    grammar = backend.compile("regex", r'(x|y)","key":"[a-z]')
    state = grammar.new_state()
    output = tok.encode('x"', add_special_tokens=False)
    for t in output:
        state.accept_token(t)
    jf = state.jump_forward(output)
    assert jf is not None and jf.num_rollback >= 1
    new_output = output[:len(output) - jf.num_rollback] + jf.token_ids
    assert tok.decode(new_output) == 'x","key":"'
    assert jf.token_ids == tok.encode(tok.decode(output[len(output) - jf.num_rollback:]) + ',"key":"',
                                      add_special_tokens=False)
    assert state.jump_forward(new_output) is None  # a free choice comes next
    state.accept_token(tok.convert_tokens_to_ids("q"))
    state.accept_token(grammar.eos_token_id)
    assert state.is_terminated()


def test_jump_forward_handles_multibyte_characters(outlines_backend, smollm2_tokenizer):
    tok, backend = smollm2_tokenizer, outlines_backend
    byte_token = {raw: t for t, raw in enumerate(backend.vocabulary.token_bytes) if raw and len(raw) == 1}
    e_acute = "é".encode()  # 2 bytes

    # "é" and "è" share their first byte: only half a character is forced, so nothing is appended.
    grammar = backend.compile("regex", "x(é|è)y")
    state = grammar.new_state()
    state.accept_token(tok.convert_tokens_to_ids("x"))
    assert state.jump_forward([tok.convert_tokens_to_ids("x")]) is None
    assert state.num_accepted == 1

    # A token that ends inside "é": the forced rest completes it and is re-encoded with it.
    grammar = backend.compile("regex", "(é-fixed|a!)")
    state = grammar.new_state()
    output = [byte_token[e_acute[:1]]]
    state.accept_token(output[0])
    jf = state.jump_forward(output)
    assert jf is not None and jf.num_rollback == 1
    assert jf.token_ids == tok.encode("é-fixed", add_special_tokens=False)
    assert state.allowed_token_ids().tolist() == [grammar.eos_token_id]

    # A forced run that starts with a multi-byte character.
    grammar = backend.compile("regex", "[a-z]:ñandú=[0-9]")
    state = grammar.new_state()
    output = tok.encode("q:", add_special_tokens=False)
    for t in output:
        state.accept_token(t)
    jf = state.jump_forward(output)
    assert jf is not None
    assert tok.decode(output[:len(output) - jf.num_rollback] + jf.token_ids) == "q:ñandú="


def test_eos_only_after_final_state_and_terminates(backend, smollm2_tokenizer):
    tok = smollm2_tokenizer
    grammar = backend.compile("regex", r"[0-9]{2,3}")
    eos = grammar.eos_token_id
    state = grammar.new_state()
    state.accept_token(tok.convert_tokens_to_ids("4"))
    assert eos not in state.allowed_token_ids().tolist()
    with pytest.raises(GrammarError):
        state.accept_token(eos)
    state.accept_token(tok.convert_tokens_to_ids("2"))
    assert eos in state.allowed_token_ids().tolist() and not state.is_terminated()
    state.accept_token(tok.convert_tokens_to_ids("7"))
    assert state.allowed_token_ids().tolist() == [eos]  # no continuation left
    state.accept_token(eos)
    assert state.is_terminated()
    with pytest.raises(GrammarError):
        state.accept_token(tok.convert_tokens_to_ids("1"))


def test_rollback_restores_allowed_tokens(backend, smollm2_tokenizer):
    tok = smollm2_tokenizer
    grammar = backend.compile("json", json.dumps(SCHEMAS["enum_number_bool"]))
    state = grammar.new_state()
    ids = tok.encode('{"color":"red","score":1', add_special_tokens=False)
    snapshots = []
    for t in ids:
        snapshots.append(state.allowed_token_ids().clone())
        state.accept_token(t)
    with pytest.raises(GrammarError):
        state.accept_token(tok.convert_tokens_to_ids("}"))  # "ok" is required
    state.rollback(3)
    assert torch.equal(state.allowed_token_ids(), snapshots[-3])
    with pytest.raises(GrammarError):
        state.rollback(len(ids))
    for t in ids[-3:]:
        state.accept_token(t)


def test_tokens_beyond_tokenizer_never_allowed(backend, smollm2_tokenizer):
    grammar = backend.compile("json", json.dumps(SCHEMAS["nested_object"]))
    state = grammar.new_state()
    state.accept_token(smollm2_tokenizer.encode('{"name":"', add_special_tokens=False)[0])
    assert int(state.allowed_token_ids().max()) < len(smollm2_tokenizer)
    with pytest.raises(GrammarError):
        state.accept_token(len(smollm2_tokenizer) + 3)


def test_bad_grammars_raise_quickly(backend):
    # found without compiling, so the request is refused before it queues
    cases = [("regex", "[.*"), ("regex", ""), ("regex", "(ab"), ("json", "{not json"), ("json", "[1, 2]"),
             ("xml", "<a/>")]
    for kind, spec in cases:
        start = time.monotonic()
        with pytest.raises(GrammarError):
            backend.validate(kind, spec)
        with pytest.raises(GrammarError):
            backend.compile(kind, spec)
        assert time.monotonic() - start < 2.0, (kind, spec)
    # Python's parser accepts look-arounds, the compilers do not: the error comes from the compile
    with pytest.raises(GrammarError, match="not supported" if backend.engine_name == "outlines" else "regex"):
        backend.compile("regex", "a(?=b)")
    assert isinstance(backend.submit("json", {"type": "nonsense"}).exception(timeout=5), GrammarError)


def test_outlines_refuses_anchors(outlines_backend):
    with pytest.raises(GrammarError, match="anchors"):
        outlines_backend.compile("regex", "^a$")


def test_pathological_regex_times_out_without_blocking(smollm2_tokenizer):
    be = GrammarBackend(smollm2_tokenizer, vocab_size=len(smollm2_tokenizer), timeout_s=1.0,
                        timeout_retry_after_s=0.0, engine="outlines")
    try:
        be.compile("regex", "[0-9]")  # worker started
        pathological = "(a|b)*a(a|b){24}"
        start = time.monotonic()
        future = be.submit("regex", pathological)
        assert not future.done()
        with pytest.raises(GrammarError, match="longer than"):
            future.result(timeout=20)
        assert time.monotonic() - start < 8.0
        grammar = be.compile("regex", "[a-z]{3}")
        state = grammar.new_state()
        for t in smollm2_tokenizer.encode("cat", add_special_tokens=False):
            state.accept_token(t)
        assert state.allowed_token_ids().tolist() == [grammar.eos_token_id]
        assert be.submit("regex", pathological) is not future  # a timeout is remembered only for a while
    finally:
        be.shutdown()


def test_cache_returns_same_object(backend):
    spec = r"[a-f0-9]{8}"
    first, second = backend.submit("regex", spec), backend.submit("regex", spec)
    assert first is second
    assert backend.compile("regex", spec) is first.result()
    schema = SCHEMAS["array"]
    assert backend.compile("json", json.dumps(schema)) is backend.compile("json", json.dumps(schema))
    if backend.engine_name == "outlines":
        assert backend.compile("json", schema).regex == json_schema_to_regex(schema)


def test_batch_mask_matches_allowed_ids_and_masks_logits(backend, smollm2_tokenizer):
    tok = smollm2_tokenizer
    states = []
    for kind, spec, prefix in [("regex", REGEXES["date"], "2024-0"),
                               ("json", json.dumps(SCHEMAS["nested_object"]), '{"name":"Al'),
                               ("regex", REGEXES["enumeration"], "")]:
        state = backend.compile(kind, spec).new_state()
        for t in tok.encode(prefix, add_special_tokens=False):
            state.accept_token(t)
        states.append(state)
    batch, width = len(states) + 1, backend.vocab_size
    bitmask = allocate_bitmask(batch, width)  # row 1 has no grammar: all allowed
    rows = [0, 2, 3]
    fill_bitmasks([states[0], None, states[1], states[2]], bitmask)
    for row, state in zip(rows, states):
        assert torch.equal(unpack_row(bitmask[row], width), state.allowed_token_ids())
    assert len(unpack_row(bitmask[1], width)) == width
    logits = torch.randn(batch, width, generator=torch.Generator().manual_seed(0))
    apply_token_bitmask_(logits, bitmask)
    finite = torch.isfinite(logits)
    for row in range(batch):
        assert torch.equal(finite[row].nonzero().squeeze(1), unpack_row(bitmask[row], width))


def _computed_mask(state) -> torch.Tensor:
    """An llguidance state's mask as its matcher computes it (no start-mask copy)."""
    row = allocate_bitmask(1, state.grammar.vocab_size)[0]
    state.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
    return row


def test_llguidance_start_state_mask_is_the_compiled_one(smollm2_tokenizer):
    """A request's first mask (the one its extend samples under) is the start mask its grammar's compile computed:
    equal to what the request's own matcher computes, in a batch fill beside advanced states, after a rollback to
    the start, and not for a matcher a refused token left in its error state."""
    tok = smollm2_tokenizer
    be = GrammarBackend(tok, vocab_size=len(tok) + LOGITS_WIDTH_PAD, engine="llguidance")
    try:
        grammars = [be.compile("json", json.dumps(SCHEMAS[name])) for name in sorted(SCHEMAS)] + \
            [be.compile("regex", REGEXES["date"])]
        fresh = [g.new_state() for g in grammars]
        for state in fresh:
            assert state.at_start() and torch.equal(state.grammar.start_mask, _computed_mask(state))
        advanced = grammars[1].new_state()
        for t in tok.encode('{"color":"red","score":1', add_special_tokens=False):
            advanced.accept_token(t)
        rolled_back = grammars[1].new_state()
        for t in tok.encode('{"color":"gr', add_special_tokens=False):
            rolled_back.accept_token(t)
        rolled_back.rollback(rolled_back.num_accepted)
        refused = grammars[0].new_state()  # a batched accept that refuses leaves the matcher in its error state
        assert accept_tokens([refused], [tok.convert_tokens_to_ids("]")]) == [False]
        assert refused.num_accepted == 0 and not refused.at_start()
        states = [fresh[0], advanced, None, rolled_back, refused] + fresh[1:]
        bitmask = allocate_bitmask(len(states), be.vocab_size)
        bitmask.zero_()
        fill_bitmasks(states, bitmask)
        for row, state in enumerate(states):
            if state is None:
                assert not bitmask[row].any()
            else:
                assert torch.equal(bitmask[row], _computed_mask(state)), row
        assert torch.equal(bitmask[3], grammars[1].start_mask) and not torch.equal(bitmask[1], bitmask[3])
    finally:
        be.shutdown()


def test_json_schema_to_regex_inputs():
    pydantic = pytest.importorskip("pydantic")

    class Person(pydantic.BaseModel):
        name: str
        age: int

    regex = json_schema_to_regex(Person)
    assert regex == json_schema_to_regex(Person.model_json_schema()) == json_schema_to_regex(
        json.dumps(Person.model_json_schema()))
    assert re.fullmatch(regex, '{"name":"Ann","age":41}')
    assert not re.fullmatch(regex, '{ "name": "Ann", "age": 41 }')  # compact by default
    spaced = json_schema_to_regex(Person, whitespace_pattern=r"[ ]?")
    assert re.fullmatch(spaced, '{ "name": "Ann", "age": 41 }')
    with pytest.raises(GrammarError):
        json_schema_to_regex(int)
    with pytest.raises(GrammarError):
        choices_to_regex([])
    assert re.fullmatch(choices_to_regex(["a.b", "(x)"]), "(x)")
    assert not re.fullmatch(choices_to_regex(["a.b"]), "axb")
