"""The shared program suite (tests/helpers/programs.py) on every real backend, and the cache effects the language relies on."""

import os
import sys

import pytest
import torch

import braid

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "helpers"))
from programs import PROGRAMS, supported_programs  # noqa: E402

BACKENDS = ["http", "local", "openai"]


def _backend(name, request):
    rt = request.getfixturevalue("runtime")
    if name == "http":
        return rt.endpoint
    if name == "local":
        return request.getfixturevalue("local_engine")
    return braid.OpenAI("smollm2", base_url=rt.url + "/v1", api_key="unused")


@pytest.mark.parametrize("program", list(PROGRAMS))
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_shared_program(backend_name, program, request):
    backend = _backend(backend_name, request)
    supported = supported_programs(backend)
    if backend_name in ("http", "local"):
        assert program in supported, f"braid's runtime must support {program}"
    if program not in supported:
        # the backend declares it cannot: running it must fail with a clear error, not silently
        with pytest.raises(Exception, match="support"):
            PROGRAMS[program](backend)
        return
    PROGRAMS[program](backend)


@braid.function
def pick(s, prefix, choices):
    s += prefix
    s += braid.select("answer", choices=choices)


SELECT_CASES = [
    ("The capital of France is", [" Paris", " London", " Berlin"]),
    ("2 + 2 =", [" 4", " 5", " twenty-two"]),
    ("The opposite of hot is", [" cold", " warm", " purple"]),
    ("Water freezes at zero degrees", [" Celsius", " Fahrenheit", " Kelvin"]),
    ("A dog says", [" woof", " meow", " moo", " quack"]),
    ("The sun rises in the", [" east", " west", " north"]),
]


def _hf_scores(model, tok, prefix, choices):
    p = len(tok.encode(prefix))
    scores = []
    for c in choices:
        ids = tok.encode(prefix + c)
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        toks = ids[p:]
        lps = [logp[p + i - 1, t].item() for i, t in enumerate(toks)]
        scores.append(sum(lps) / len(lps))
    return scores


def test_select_picks_what_hf_picks(runtime):
    from hf_gguf import hf_model_from_gguf

    from braid.runtime.loader.model_path import resolve_model_path
    from braid.runtime.loader.tokenizer import load_tokenizer

    model = hf_model_from_gguf(resolve_model_path("smollm2"))
    tok = load_tokenizer("smollm2")
    for prefix, choices in SELECT_CASES:
        scores = _hf_scores(model, tok, prefix, choices)
        want = choices[max(range(len(choices)), key=lambda i: scores[i])]
        state = pick.run(prefix=prefix, choices=choices, backend=runtime.endpoint)
        assert state["answer"] == want, (prefix, scores)


@braid.function
def four_way(s, context):
    s += context
    forks = s.fork(4)
    for i, f in enumerate(forks):
        f += f"\nIdea {i}:"
        f += braid.gen("idea", max_tokens=4, temperature=0, ignore_eos=True)
    forks.join()


def test_fork_computes_prefix_once(runtime):
    endpoint = runtime.endpoint
    endpoint.flush_cache()
    context = ("Notes on distributed systems. " + " ".join(f"Point {i}: replicas must agree on order." for i in range(60)))
    before = endpoint.get_server_info()
    state = four_way.run(context=context, backend=endpoint)
    after = endpoint.get_server_info()
    from braid.runtime.loader.tokenizer import load_tokenizer

    prefix_len = len(load_tokenizer("smollm2").encode(context))
    assert prefix_len >= 500
    computed = after["num_computed_prompt_tokens_total"] - before["num_computed_prompt_tokens_total"]
    prompt = after["num_prompt_tokens_total"] - before["num_prompt_tokens_total"]
    print(f"fork: prefix {prefix_len} tokens, prompt tokens {prompt}, computed {computed}")
    assert prompt >= 4 * prefix_len
    assert computed < prefix_len + 4 * 40  # the prefix once, plus each branch's own few tokens
    assert state.text().startswith(context)


@braid.function
def answer_with_system(s, system, question):
    s += braid.system(system)
    s += braid.user(question)
    s += braid.assistant(braid.gen("a", max_tokens=4, temperature=0))


def test_run_batch_hits_the_cache(runtime):
    endpoint = runtime.endpoint
    endpoint.flush_cache()
    system = "You are a meticulous librarian. " + " ".join(f"Rule {i}: shelve books by author surname." for i in range(40))
    batch = [{"system": system, "question": f"Where does book number {i} go?"} for i in range(64)]
    before = endpoint.get_server_info()
    states = answer_with_system.run_batch(batch, backend=endpoint, progress_bar=False)
    after = endpoint.get_server_info()
    assert all(s.error() is None for s in states)
    prompt = after["num_prompt_tokens_total"] - before["num_prompt_tokens_total"]
    computed = after["num_computed_prompt_tokens_total"] - before["num_computed_prompt_tokens_total"]
    ratio = computed / prompt
    print(f"run_batch: prompt tokens {prompt}, computed {computed} ({ratio:.1%})")
    assert ratio <= 0.25
    assert after["kv_used_tokens"] == 0


@braid.function
def planet_then_pick(s):
    s += braid.user("Name a planet.")
    s += braid.assistant(braid.gen("planet", max_tokens=8, temperature=0))
    s += braid.user("Is it big?")
    s += braid.assistant(braid.select("big", ["yes", "no"]))


@pytest.mark.parametrize("backend_name", ["http", "local"])
def test_token_usage_and_server_args_match_the_runtime(backend_name, request):
    """backend.token_usage counts what the runtime counted (gen, select's scoring and prefill calls alike), and
    get_server_args gives the runtime's own ServerArgs."""
    backend = _backend(backend_name, request)
    expected_total = 8192
    assert backend.get_server_args()["max_total_tokens"] == expected_total
    assert braid.get_server_args(backend)["max_total_tokens"] == expected_total
    usage = backend.token_usage
    usage.reset()
    before = backend.get_server_info()
    planet_then_pick.run(backend=backend)
    after = backend.get_server_info()
    assert usage.prompt_tokens == after["num_prompt_tokens_total"] - before["num_prompt_tokens_total"]
    assert usage.completion_tokens == after["num_generated_tokens_total"] - before["num_generated_tokens_total"]
    assert 0 < usage.completion_tokens <= 8


@braid.function
def with_token_texts(s):
    s += "The capital of France is"
    s += braid.gen("a", max_tokens=6, temperature=0, return_logprob=True, top_logprobs_num=2,
                   return_text_in_logprobs=True)


@pytest.mark.parametrize("backend_name", ["http", "local"])
def test_return_text_in_logprobs(backend_name, request):
    """SGLang's gen(return_text_in_logprobs=True): every logprob entry is [logprob, token id, token text]."""
    state = with_token_texts.run(backend=_backend(backend_name, request))
    meta = state.get_meta_info("a")
    entries = meta["output_token_logprobs"]
    assert entries and all(len(e) == 3 and isinstance(e[2], str) for e in entries)
    assert state["a"] in "".join(e[2] for e in entries)
    assert all(len(e) == 3 for pos in meta["output_top_logprobs"] for e in pos)
