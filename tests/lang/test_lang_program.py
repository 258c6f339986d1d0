import subprocess
import sys
import threading

import pytest

import braid
from braid.backends.base import CAP_FORK, CAP_GEN
from braid.tracer import ArgumentPlaceholder

from lang_scripted_backend import ScriptedBackend


@braid.function
def qa(s, question, style="short"):
    s += braid.system("You answer questions.")
    s += braid.user("Question: " + question)
    s += braid.assistant(braid.gen("answer", max_tokens=50))


# ---- run_batch ----------------------------------------------------------------------------------
def test_run_batch_keeps_order_and_runs_concurrently():
    active, peak, lock = [0], [0], threading.Lock()

    def responder(prompt, sp):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        import time

        time.sleep(0.02)
        with lock:
            active[0] -= 1
        return "answer to " + prompt.messages[-1]["content"]

    backend = ScriptedBackend(responder)
    questions = [f"q{i}" for i in range(20)]
    results = qa.run_batch([{"question": q} for q in questions], backend=backend, num_threads=8, progress_bar=False)
    assert [r["answer"] for r in results] == [f"answer to Question: {q}" for q in questions]
    assert peak[0] > 1


def test_run_batch_puts_errors_in_their_slot():
    def responder(prompt, sp):
        if "q3" in prompt.text:
            raise ValueError("bad item")
        return "fine"

    results = qa.run_batch([{"question": f"q{i}"} for i in range(6)], backend=ScriptedBackend(responder),
                           progress_bar=False)
    assert isinstance(results[3], ValueError)
    assert all(r["answer"] == "fine" for i, r in enumerate(results) if i != 3)


def test_run_batch_bad_arguments_are_reported_per_item(backend):
    results = qa.run_batch([{"question": "a"}, {"nonsense": 1}], backend=backend, progress_bar=False)
    assert isinstance(results[0], braid.ProgramState)
    assert isinstance(results[1], braid.ProgramError)


def test_run_batch_validates_input(backend):
    with pytest.raises(braid.ProgramError):
        qa.run_batch({"question": "a"}, backend=backend)
    with pytest.raises(braid.ProgramError):
        qa.run_batch(["a"], backend=backend)
    with pytest.raises(braid.ProgramError):
        qa.run_batch([{"question": "a"}], backend=backend, num_threads=0)
    assert qa.run_batch([], backend=backend) == []


def test_run_batch_precaches_the_constant_prefix_once(backend):
    qa.run_batch([{"question": f"q{i}"} for i in range(5)], backend=backend, progress_bar=False)
    caches = backend.calls_of("cache_prefix")
    assert len(caches) == 1
    assert caches[0][1].text == "<|im_start|>system\nYou answer questions.<|im_end|>\n<|im_start|>user\nQuestion: "
    # the cache call precedes every generation
    assert backend.calls[0][0] == "cache_prefix"


def test_run_batch_without_prefix_cache_capability_skips_precache():
    backend = ScriptedBackend(capabilities=frozenset({CAP_GEN, CAP_FORK}))
    qa.run_batch([{"question": "a"}, {"question": "b"}], backend=backend, progress_bar=False)
    assert not backend.calls_of("cache_prefix")


def test_run_batch_progress_bar_writes_to_stderr(backend, capsys):
    qa.run_batch([{"question": "a"}, {"question": "b"}], backend=backend, num_threads=1, progress_bar=True)
    assert "2/2" in capsys.readouterr().err


def test_run_batch_sampling_defaults(backend):
    qa.run_batch([{"question": "a", "temperature": 0.5}, {"question": "b"}], backend=backend,
                 temperature=0.1, progress_bar=False)
    temps = sorted(c[2][0].temperature for c in backend.calls_of("generate"))
    assert temps == [0.1, 0.5]


# ---- run / sampling merge -------------------------------------------------------------------------
def test_sampling_params_merge_layers(backend):
    @braid.function(temperature=0.7, top_p=0.9)
    def prog(s):
        s += braid.gen("a")
        s += braid.gen("b", temperature=0.2, max_tokens=7, seed=3)

    prog.run(backend=backend, top_p=0.5, max_tokens=11, top_k=5)
    (_, _, (sp_a, _)), (_, _, (sp_b, _)) = backend.calls_of("generate")
    assert (sp_a.temperature, sp_a.top_p, sp_a.max_new_tokens, sp_a.top_k) == (0.7, 0.5, 11, 5)
    assert (sp_b.temperature, sp_b.top_p, sp_b.max_new_tokens, sp_b.top_k, sp_b.seed) == (0.2, 0.5, 7, 5, 3)


def test_run_rejects_unknown_keywords_and_missing_arguments(backend):
    with pytest.raises(braid.ProgramError, match="unexpected argument 'bogus'"):
        qa.run(question="x", bogus=1, backend=backend)
    with pytest.raises(braid.ProgramError, match="question"):
        qa.run(backend=backend)
    with pytest.raises(braid.ProgramError):
        qa.run(question="x", temperature=-3, backend=backend)
    with pytest.raises(braid.ProgramError):
        braid.function(max_tokenz=3)(lambda s: None)


def test_positional_arguments(backend):
    state = qa.run("positional?", backend=backend)
    assert state.messages()[1]["content"] == "Question: positional?"
    assert state.arguments == {"question": "positional?"}


def test_program_without_state_parameter_is_rejected():
    with pytest.raises(braid.ProgramError):
        braid.function(lambda: None)


def test_runtime_object_with_endpoint_is_accepted(backend):
    class FakeRuntime:
        endpoint = backend

    assert qa.run(question="x", backend=FakeRuntime())["answer"]
    with pytest.raises(braid.ProgramError, match="not a braid backend"):
        qa.run(question="x", backend=object())


# ---- bind -------------------------------------------------------------------------------------------
def test_bind_fixes_arguments(backend):
    bound = qa.bind(question="bound question")
    state = bound.run(backend=backend)
    assert state.messages()[1]["content"] == "Question: bound question"
    assert qa.bind(style="long").bind(question="q").run(backend=backend).arguments == {"question": "q", "style": "long"}
    with pytest.raises(braid.ProgramError, match="no argument"):
        qa.bind(nope=1)


# ---- trace ------------------------------------------------------------------------------------------
def test_trace_finds_constant_prefix_before_argument():
    tr = qa.trace()
    assert tr.prefix == "<|im_start|>system\nYou answer questions.<|im_end|>\n<|im_start|>user\nQuestion: "
    assert tr.stopped_at == "argument 'question'"
    assert [type(n).__name__ for n in tr.nodes][:4] == ["RoleBegin", "Text", "RoleEnd", "RoleBegin"]


def test_trace_with_given_argument_stops_at_gen():
    tr = qa.trace(question="fixed")
    assert tr.prefix.endswith("Question: fixed<|im_end|>\n<|im_start|>assistant\n")
    assert tr.stopped_at == "gen('answer')"
    assert type(tr.nodes[-1]).__name__ == "Gen"


def test_trace_stops_at_fork_select_image_and_fstrings():
    @braid.function
    def forked(s, x):
        s += "a"
        s.fork(2)

    assert (forked.trace(x="1").prefix, forked.trace(x="1").stopped_at) == ("a", "fork()")

    @braid.function
    def fstring(s, name):
        s += f"Hello {name.upper()}!"

    assert fstring.trace().prefix == "Hello "

    @braid.function
    def selecting(s):
        s += "pick " + braid.select("c", ["a", "b"])

    tr = selecting.trace()
    assert tr.prefix == "pick " and tr.stopped_at == "select('c')"


def test_trace_uses_the_backend_template():
    from braid.chat_template import LLAMA3

    tr = qa.trace(backend=ScriptedBackend(template=LLAMA3))
    assert tr.prefix.startswith("<|start_header_id|>system<|end_header_id|>")


def test_trace_of_program_that_uses_argument_as_number():
    @braid.function
    def loop(s, n):
        s += "count: "
        for i in range(int(n)):
            s += str(i)

    tr = loop.trace()
    assert tr.prefix == "count: " and isinstance(tr.error, ValueError)


def test_placeholder_is_a_marked_string():
    p = ArgumentPlaceholder("q")
    assert isinstance(p, str) and p.arg_name == "q" and "\x00" in ("x" + p)


# ---- import ---------------------------------------------------------------------------------------
def test_import_braid_does_not_import_torch():
    code = ("import braid, braid.backends, sys; "
            "braid.Runtime, braid.RuntimeEndpoint, braid.OpenAI, braid.LocalEngine; "
            "import braid.backends.runtime, braid.backends.local, braid.backends.openai; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
