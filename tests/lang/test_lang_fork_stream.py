import asyncio
import threading

import pytest

import braid
from braid.backends.base import CAP_FORK, CAP_GEN

from lang_scripted_backend import ScriptedBackend


def test_fork_join_gathers_variables_and_caches_prefix_once(backend):
    @braid.function
    def prog(s):
        s += "Shared prefix. "
        forks = s.fork(3)
        forks += lambda i: f"Branch {i}: " + braid.gen("idea", max_tokens=20)
        forks.join()
        s += "Done."

    state = prog.run(backend=backend)
    ideas = state["idea"]
    assert len(ideas) == 3
    assert ideas == [f"out{len(f'Shared prefix. Branch {i}: ')}" for i in range(3)]
    assert state.text() == "Shared prefix. Done."
    caches = backend.calls_of("cache_prefix")
    assert [c[1].text for c in caches] == ["Shared prefix. "]
    prompts = sorted(c[1].text for c in backend.calls_of("generate"))
    assert prompts == [f"Shared prefix. Branch {i}: " for i in range(3)]
    assert len(state.get_meta_info("idea")) == 3


def test_fork_branches_run_concurrently():
    barrier = threading.Barrier(3, timeout=5)

    def responder(prompt, sp):
        barrier.wait()  # deadlocks (then times out) unless all three branches call at once
        return "x"

    backend = ScriptedBackend(responder)

    @braid.function
    def prog(s):
        forks = s.fork(3)
        forks += braid.gen("v")
        forks.join()

    assert prog.run(backend=backend)["v"] == ["x", "x", "x"]


def test_fork_in_place_access_and_concat_join(backend):
    @braid.function
    def prog(s):
        s += "P:"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f" [{i}]"
        assert len(forks) == 2
        assert forks[1].text() == "P: [1]"
        forks.join(mode="concate_and_append")

    state = prog.run(backend=backend)
    assert state.text() == "P: [0] [1]"


def test_fork_keeps_parent_variables_and_only_gathers_new_ones(backend):
    @braid.function
    def prog(s):
        s += braid.gen("before", max_tokens=3)
        forks = s.fork(2)
        forks += lambda i: braid.gen("after", max_tokens=3)
        for f in forks:
            assert f["before"] == s["before"]
        forks.join()

    state = prog.run(backend=backend)
    assert isinstance(state["before"], str)
    assert isinstance(state["after"], list) and len(state["after"]) == 2


def test_fork_inside_role_continues_the_block(backend):
    @braid.function
    def prog(s):
        s += braid.user("q")
        with s.assistant():
            forks = s.fork(2)
            forks += lambda i: braid.gen("a", max_tokens=5)
            forks.join()

    state = prog.run(backend=backend)
    prompt = backend.calls_of("generate")[0][1]
    assert prompt.open_role == "assistant"
    assert len(state["a"]) == 2


def test_copy_is_independent_and_does_not_cache(backend):
    @braid.function
    def prog(s):
        s += "base"
        c = s.copy()
        c += " copy"
        assert c.text() == "base copy"
        s += " orig"

    assert prog.run(backend=backend).text() == "base orig"
    assert not backend.calls_of("cache_prefix")


def test_fork_errors(backend):
    @braid.function
    def prog(s):
        s.fork(0)

    with pytest.raises(braid.ProgramError):
        prog.run(backend=backend)

    @braid.function
    def twice(s):
        f = s.fork(2)
        f.join()
        f.join()

    with pytest.raises(braid.ProgramError, match="already joined"):
        twice.run(backend=backend)


def test_error_in_a_branch_reaches_join():
    def responder(prompt, sp):
        if "bad" in prompt.text:
            raise ValueError("branch failed")
        return "ok"

    backend = ScriptedBackend(responder)

    @braid.function
    def prog(s):
        forks = s.fork(2)
        forks += lambda i: ("bad " if i else "good ") + braid.gen("v")
        forks.join()

    with pytest.raises(ValueError, match="branch failed"):
        prog.run(backend=backend)


def test_backend_without_prefix_cache_still_forks():
    backend = ScriptedBackend(capabilities=frozenset({CAP_GEN, CAP_FORK}))

    @braid.function
    def prog(s):
        s += "x"
        f = s.fork(2)
        f += braid.gen("v", max_tokens=2)
        f.join()

    assert prog.run(backend=backend)["v"] == ["ou", "ou"]
    assert not backend.calls_of("cache_prefix")


# ---- streaming ------------------------------------------------------------------------------------
@braid.function
def _two_gens(s):
    s += braid.user("hello")
    s += braid.assistant(braid.gen("first", max_tokens=40))
    s += braid.user("again")
    s += braid.assistant(braid.gen("second", max_tokens=40))


def test_text_iter_streams_one_variable():
    backend = ScriptedBackend(lambda p, sp: "streamed answer text", chunk_chars=4)
    state = _two_gens.run(backend=backend, stream=True)
    pieces = list(state.text_iter("first"))
    assert len(pieces) == 5 and "".join(pieces) == "streamed answer text" == state["first"]
    assert backend.calls_of("generate_stream")


def test_text_iter_without_name_yields_everything():
    backend = ScriptedBackend(lambda p, sp: "abcdef", chunk_chars=2)
    state = _two_gens.run(backend=backend, stream=True)
    assert "".join(state.text_iter()) == state.text()


def test_stream_returns_before_generation_finishes():
    release = threading.Event()

    def responder(prompt, sp):
        release.wait(5)
        return "late"

    backend = ScriptedBackend(responder)
    state = _two_gens.run(backend=backend, stream=True)
    assert not release.is_set()  # run() came back while the first gen is still blocked
    release.set()
    assert state["second"] == "late"


def test_text_async_iter():
    backend = ScriptedBackend(lambda p, sp: "async streaming", chunk_chars=5)

    async def collect():
        state = _two_gens.run(backend=backend, stream=True)
        return state, [piece async for piece in state.text_async_iter("second")]

    state, pieces = asyncio.run(collect())
    assert pieces == ["async", " stre", "aming"] and state["second"] == "async streaming"


def test_text_iter_on_finished_non_stream_state(backend):
    state = _two_gens.run(backend=backend)
    assert list(state.text_iter("first")) == [state["first"]]


def test_stream_error_surfaces_in_iterator():
    def responder(prompt, sp):
        raise ConnectionError("lost")

    state = _two_gens.run(backend=ScriptedBackend(responder), stream=True)
    with pytest.raises(ConnectionError):
        list(state.text_iter("first"))
    assert isinstance(state.error(), ConnectionError)


def test_stream_error_in_body_surfaces(backend):
    @braid.function
    def prog(s):
        s += "x"
        raise LookupError("body")

    state = prog.run(backend=backend, stream=True)
    with pytest.raises(LookupError):
        state.text()
