"""Compiles are shared between clients in turn: one client's burst of new schemas is served, not refused, and
holds at most half the compiles running at once, so another client's compile starts beside it; the caps (all
waiting, per client) refuse with GrammarBusyError (the server's 429) only past them."""

from __future__ import annotations

import json
import threading

import pytest

from braid.runtime.constrained import GrammarBackend
from braid.runtime.constrained.grammar_errors import GrammarBusyError


def _schema(tag: str, i: int) -> str:
    return json.dumps({"type": "object", "properties": {f"{tag}_{i}": {"type": "integer"}}, "required": [f"{tag}_{i}"]})


@pytest.fixture()
def backend(smollm2_tokenizer):
    """One compile worker (2 compiles at once) whose compiles wait for `backend.gate`, so the queue is as built."""
    be = GrammarBackend(smollm2_tokenizer, vocab_size=len(smollm2_tokenizer), num_workers=1,
                        max_queued_per_client=30, max_queued=40)
    be.gate = threading.Event()
    compile_now = be._primary.compile

    def gated(kind, spec):
        assert be.gate.wait(60)
        return compile_now(kind, spec)

    be._primary.compile = gated
    yield be
    be.gate.set()
    be.shutdown()


def test_a_burst_is_served_and_another_client_waits_for_one_of_its_compiles(backend):
    order, lock, done = [], threading.Lock(), threading.Event()

    def record(name):
        def callback(future):
            with lock:
                order.append(name)
                if len(order) == 31:
                    done.set()
        return callback

    burst = [backend.submit("json", _schema("a", i), client="A") for i in range(30)]
    other = backend.submit("json", _schema("b", 0), client="B")
    for i, future in enumerate(burst):
        future.add_done_callback(record(f"a{i}"))
    other.add_done_callback(record("b0"))
    backend.gate.set()
    assert done.wait(60)
    assert all(f.exception() is None for f in burst + [other])
    # one worker: 2 compiles at once, 1 of them a client's; B's starts beside A's first
    assert order.index("b0") <= 1, order
    assert backend.stats()["rejected"] == 0


def test_caps_refuse_past_the_queue_limits(backend):
    # 1 of client A's starts at once (a client's share of the 2 at once), 30 may wait: the 32nd is refused; client
    # B still gets its compile
    futures = [backend.submit("json", _schema("c", i), client="A") for i in range(32)]
    refused = [f for f in futures if f.done() and isinstance(f.exception(), GrammarBusyError)]
    assert len(refused) == 1 and "30 of them this client's" in str(refused[0].exception())
    assert "--grammar-max-queued-per-client" in str(refused[0].exception())
    later = backend.submit("json", _schema("d", 0), client="B")
    backend.gate.set()
    assert later.result(timeout=60) is not None
    assert backend.submit("json", _schema("d", 0), client="B").result(timeout=60) is not None
    assert all(f.exception(timeout=60) is None for f in futures if f not in refused)
    assert backend.stats()["rejected"] == 1


def test_a_request_whose_grammar_is_compiled_is_admissible_at_once(backend):
    """Intake: a grammar still compiling waits in the grammar queue; one already compiled gives a request ready in
    the same call, with its own grammar state (no scheduler step spent in the queue)."""
    from braid.runtime.core import Req
    from braid.runtime.sampling_params import SamplingParams
    from braid.runtime.scheduler.intake import RequestIntake

    intake = RequestIntake.__new__(RequestIntake)  # only the grammar path of enqueue is used
    intake.grammar_queue, intake._grammar_backend = [], backend

    def req(rid):
        return Req(rid=rid, input_ids=[1, 2], sampling_params=SamplingParams(json_schema=_schema("k", 0)))

    first = req("a")
    assert intake.enqueue([first]) == [] and len(intake.grammar_queue) == 1
    backend.gate.set()
    intake.grammar_queue[0][1].result(timeout=60)
    second = req("b")
    assert intake.enqueue([second]) == [second] and len(intake.grammar_queue) == 1
    assert second.grammar is not None and first.grammar is None
    ready, failed = intake.poll_grammars()
    assert ready == [first] and failed == [] and first.grammar is not second.grammar
