"""Under tensor parallelism rank 0 decides which requests' grammars count as compiled, at a request's arrival as at
each step's poll: a follower whose compile is slower (or faster) than rank 0's admits the same requests at the
same step, or the ranks' batches differ and their collectives hang. The grammar backend here is a stand-in whose
futures the test completes; the gate and the intake are the real ones."""

import threading
from concurrent.futures import Future

from braid.runtime.core import Req
from braid.runtime.processes.tensor_parallel import GrammarGate
from braid.runtime.sampling_params import SamplingParams
from braid.runtime.scheduler.intake import RequestIntake


class _Compiled:
    def new_state(self):
        return "grammar state"


class _Backend:
    def __init__(self, fut: Future):
        self.fut = fut

    def validate(self, *grammar):
        pass

    def submit(self, *grammar, client=""):
        return self.fut


def _done() -> Future:
    fut = Future()
    fut.set_result(_Compiled())
    return fut


def _intake(fut: Future) -> RequestIntake:
    intake = RequestIntake(None, None, vocab_size=64, context_len=64, kv_pool_size=64, share_prefill=False)
    intake._grammar_backend = _Backend(fut)
    return intake


def _req() -> Req:
    return Req(rid="r", index=0, input_ids=[1, 2, 3], sampling_params=SamplingParams(max_new_tokens=4, regex="a+"))


def test_a_grammar_compiled_on_rank_0_is_admitted_at_once_on_a_slower_follower():
    leader, follower_fut = _intake(_done()), Future()
    leader_gate = GrammarGate(leader, leader=True)
    leader_gate.at_once = decisions = []
    assert [r.rid for r in leader.add(_req())] == ["r"] and decisions and not leader.grammar_queue

    follower = _intake(follower_fut)
    gate = GrammarGate(follower, leader=False)
    gate.at_once = decisions
    threading.Timer(0.2, follower_fut.set_result, [_Compiled()]).start()
    ready = follower.add(_req())  # waits for its own compile, as rank 0 admitted it now
    assert [r.rid for r in ready] == ["r"] and ready[0].grammar == "grammar state" and not follower.grammar_queue


def test_a_grammar_queued_on_rank_0_stays_queued_on_a_faster_follower():
    leader = _intake(Future())
    leader_gate = GrammarGate(leader, leader=True)
    leader_gate.at_once = decisions = []
    assert leader.add(_req()) == [] and decisions == [] and len(leader.grammar_queue) == 1

    follower = _intake(_done())
    gate = GrammarGate(follower, leader=False)
    gate.at_once = decisions
    assert follower.add(_req()) == [] and len(follower.grammar_queue) == 1  # rank 0's poll admits it later


def test_requests_enqueued_by_a_step_always_wait_for_the_poll():
    # samples queued after a shared prefill: no command carries them, so neither rank admits them at arrival
    for leader in (True, False):
        intake = _intake(_done())
        GrammarGate(intake, leader=leader)
        assert intake.enqueue([_req()]) == [] and len(intake.grammar_queue) == 1


def test_without_tensor_parallelism_a_compiled_grammar_skips_the_queue():
    intake = _intake(_done())
    assert [r.rid for r in intake.add(_req())] == ["r"] and not intake.grammar_queue
