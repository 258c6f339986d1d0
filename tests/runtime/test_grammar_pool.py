"""The grammar compile pool: pathological regexes do not hold back others, cache, caps, restarts, shutdown."""

import os
import time

import pytest

from braid.runtime.constrained import GrammarBackend, GrammarBusyError, GrammarError, GrammarTimeoutError
from braid.runtime.constrained.compile_pool import CompilePool

TIMEOUT_S = 2.0
# Each takes far longer than TIMEOUT_S to compile (an exponential DFA); distinct so neither is a cache hit.
PATHOLOGICAL = ["(a|b)*a(a|b){24}", "(a|b)*a(a|b){25}", "(a|b)*b(a|b){24}", "(a|b)*b(a|b){25}"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.fixture(scope="module")
def outlines_vocabulary(smollm2_tokenizer):
    from braid.runtime.constrained import build_token_vocabulary

    return build_token_vocabulary(smollm2_tokenizer).to_outlines()


@pytest.fixture
def backend(smollm2_tokenizer):
    be = GrammarBackend(smollm2_tokenizer, vocab_size=len(smollm2_tokenizer), timeout_s=TIMEOUT_S, num_workers=2,
                        engine="outlines")
    be.compile("regex", "[0-9]")  # workers started
    yield be
    be.shutdown()


def test_trivial_regex_not_held_back_by_pathological_ones(backend):
    start = time.monotonic()
    slow = [backend.submit("regex", spec) for spec in PATHOLOGICAL[:2]]
    trivial = backend.submit("regex", "(maybe|perhaps)")
    grammar = trivial.result(timeout=TIMEOUT_S * 3)
    waited = time.monotonic() - start
    assert waited < 1.5, f"the trivial regex waited {waited:.2f}s behind two pathological ones"
    assert not any(f.done() for f in slow)  # they were still compiling: the trivial one did not wait for them
    assert grammar.regex == "(maybe|perhaps)"
    for future in slow:
        assert isinstance(future.exception(timeout=TIMEOUT_S * 3), GrammarTimeoutError)
    assert backend.stats()["spares_started"] >= 1


def test_repeated_spec_is_served_from_the_cache(backend):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    before = backend.stats()
    first = backend.compile("json", schema)
    for _ in range(5):
        assert backend.compile("json", schema) is first
        assert backend.submit("regex", "[xy]{2}").result(timeout=10).regex == "[xy]{2}"
    after = backend.stats()
    assert after["compiles"] - before["compiles"] == 2
    assert after["cache_misses"] - before["cache_misses"] == 2
    assert after["cache_hits"] - before["cache_hits"] == 9


def test_compile_errors_are_cached_and_timeouts_remembered(backend):
    compiles = backend.stats()["compiles"]
    for _ in range(3):
        with pytest.raises(GrammarError, match="anchors"):
            backend.compile("regex", "^a$")
    assert backend.stats()["compiles"] == compiles + 1
    with pytest.raises(GrammarTimeoutError):
        backend.compile("regex", PATHOLOGICAL[2])
    start = time.monotonic()
    with pytest.raises(GrammarTimeoutError):  # a repeat fails at once instead of taking a worker again
        backend.compile("regex", PATHOLOGICAL[2])
    assert time.monotonic() - start < 0.5
    assert backend.stats()["compiles"] == compiles + 2


def test_lru_keeps_the_cache_bounded(smollm2_tokenizer):
    be = GrammarBackend(smollm2_tokenizer, vocab_size=len(smollm2_tokenizer), timeout_s=TIMEOUT_S, num_workers=2,
                        engine="outlines", cache_size=3)
    try:
        for n in range(6):
            be.compile("regex", f"x{{{n + 1}}}")
        be.compile("regex", "x{6}")
        assert be.stats()["cached"] == 3
        assert be.stats()["cache_hits"] == 1
        be.compile("regex", "x{1}")  # evicted: compiled again
        assert be.stats()["compiles"] == 7
    finally:
        be.shutdown()


def test_worker_killed_on_timeout_is_replaced(outlines_vocabulary):
    pool = CompilePool(outlines_vocabulary, num_workers=1, max_workers=1, timeout_s=1.0)
    try:
        assert _wait_until(lambda: len(pool.worker_pids()) == 1)
        [first_pid] = pool.worker_pids()
        with pytest.raises(GrammarTimeoutError):
            pool.submit(PATHOLOGICAL[0]).result(timeout=10)
        assert not _alive(first_pid)
        assert _wait_until(lambda: len(pool.worker_pids()) == 1)
        assert pool.worker_pids() != [first_pid]
        assert _wait_until(lambda: pool.stats["restarts"] == 1)
        index = pool.submit("[a-z]{3}").result(timeout=10)
        assert index.get_initial_state() is not None
    finally:
        pool.shutdown()


def test_queued_compiles_are_capped_and_fail_fast(outlines_vocabulary):
    pool = CompilePool(outlines_vocabulary, num_workers=1, max_workers=1, timeout_s=TIMEOUT_S, max_queued=1)
    try:
        running = pool.submit(PATHOLOGICAL[0])
        assert _wait_until(lambda: pool.num_queued() == 0)  # taken by the worker
        queued = pool.submit(PATHOLOGICAL[1])
        start = time.monotonic()
        with pytest.raises(GrammarBusyError, match="busy"):
            pool.submit("[0-9]")
        assert time.monotonic() - start < 0.1
        assert pool.stats["rejected"] == 1
        for future in (running, queued):
            assert isinstance(future.exception(timeout=TIMEOUT_S * 4), GrammarTimeoutError)
        assert pool.submit("[0-9]").result(timeout=10) is not None
    finally:
        pool.shutdown()


def test_backend_turns_a_full_queue_into_a_grammar_error_not_cached(smollm2_tokenizer):
    be = GrammarBackend(smollm2_tokenizer, vocab_size=len(smollm2_tokenizer), timeout_s=TIMEOUT_S, num_workers=1,
                        engine="outlines", max_queued=1)
    try:
        be.compile("regex", "[0-9]")
        slow = [be.submit("regex", spec) for spec in PATHOLOGICAL[:2]]  # one on the worker, one on its spare
        assert _wait_until(lambda: be.pool.num_queued() == 0 and len(be.pool.worker_pids()) == 2)
        queued = be.submit("regex", PATHOLOGICAL[2])
        refused = be.submit("regex", "(maybe|perhaps)")
        assert refused.done()
        assert isinstance(refused.exception(), GrammarBusyError)
        for future in slow + [queued]:
            future.exception(timeout=TIMEOUT_S * 4)
        assert be.compile("regex", "(maybe|perhaps)").regex == "(maybe|perhaps)"  # the refusal was not cached
    finally:
        be.shutdown()


def test_shutdown_leaves_no_worker_processes(smollm2_tokenizer):
    be = GrammarBackend(smollm2_tokenizer, vocab_size=len(smollm2_tokenizer), timeout_s=TIMEOUT_S * 5, num_workers=2,
                        engine="outlines")
    be.compile("regex", "[0-9]")
    compiling = [be.submit("regex", spec) for spec in PATHOLOGICAL]
    assert _wait_until(lambda: len(be.pool.worker_pids()) == be.pool.max_workers)  # spares started too
    pids = be.pool.worker_pids()
    start = time.monotonic()
    be.shutdown()
    assert time.monotonic() - start < 3.0  # compiles in progress are abandoned, not waited for
    assert not [pid for pid in pids if _alive(pid)]
    assert be.pool.worker_pids() == []
    for future in compiling:
        assert isinstance(future.exception(timeout=1), GrammarError)
    with pytest.raises(GrammarError, match="shut down"):
        be.compile("regex", "[0-9]{2}")
