"""A grammar refused because the compile queue is full (--grammar-max-queued) is a load condition: the scheduler aborts
the request with the "grammar compiler busy" message and the HTTP side answers 429 with Retry-After, while a
grammar that fails for what it says (a compile error, the timeout) stays a 400 naming the field."""

from __future__ import annotations

from concurrent.futures import Future

from braid.runtime.constrained.fsm import GrammarBusyError, GrammarError, GrammarTimeoutError
from braid.runtime.core import GRAMMAR_BUSY_PREFIX, Req
from braid.runtime.sampling_params import SamplingParams
from braid.runtime.scheduler.intake import RequestIntake
from braid.runtime.server import messages as M
from braid.runtime.server.request_handle import _grammar_failure


def _failed(exc: Exception) -> Future:
    future = Future()
    future.set_exception(exc)
    return future


def test_poll_grammars_tells_a_full_queue_from_a_bad_grammar():
    intake = RequestIntake.__new__(RequestIntake)  # only the grammar queue is used
    reqs = [Req(rid=f"r{i}", input_ids=[1, 2], sampling_params=SamplingParams(regex="[0-9]+")) for i in range(3)]
    intake.grammar_queue = [(reqs[0], _failed(GrammarBusyError("32 compiles waiting"))),
                            (reqs[1], _failed(GrammarTimeoutError("compile took over 10 s"))),
                            (reqs[2], _failed(GrammarError("unbalanced parenthesis")))]
    ready, failed = intake.poll_grammars()
    assert ready == [] and intake.grammar_queue == []
    messages = {req.rid: reason.message for req, reason in failed}
    assert messages["r0"].startswith(GRAMMAR_BUSY_PREFIX) and "32 compiles waiting" in messages["r0"]
    assert messages["r1"].startswith("grammar error") and messages["r2"].startswith("grammar error")
    assert all(reason.type == "abort" for _, reason in failed)


def test_http_side_answers_429_for_a_full_queue_and_400_for_a_bad_grammar():
    def output(message: str) -> M.Output:
        return M.Output(rid="r", finished=True, finish_reason={"type": "abort", "matched": None, "message": message})

    busy = _grammar_failure(output(f"{GRAMMAR_BUSY_PREFIX}: 32 compiles waiting"), SamplingParams(regex="[0-9]+"))
    assert busy.status == 429 and busy.headers["Retry-After"] == "1" and busy.param == "regex"
    bad = _grammar_failure(output("grammar error: unbalanced parenthesis"), SamplingParams(json_schema="{}"))
    assert bad.status == 400 and bad.param == "json_schema" and bad.headers is None
    assert _grammar_failure(output("aborted by the client"), SamplingParams(regex="[0-9]+")) is None
