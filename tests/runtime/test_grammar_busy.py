"""A grammar refused because the compile queue is full (--grammar-max-queued) is a load condition: the scheduler aborts
the request with error kind grammar_busy and the HTTP side answers 429 with Retry-After (the Engine a BusyError),
while a grammar that fails for what it says (a compile error, the timeout) is grammar_invalid: a 400 naming the field
(the Engine a ValueError). The kind is a field of the messages; the message text decides nothing."""

from __future__ import annotations

from concurrent.futures import Future

from braid.runtime.constrained.grammar_errors import GrammarBusyError, GrammarError, GrammarTimeoutError
from braid.runtime.core import Req
from braid.runtime.error_kind import BusyError, ErrorKind, exception_for
from braid.runtime.sampling_params import SamplingParams, SamplingParamsError
from braid.runtime.scheduler.intake import RequestIntake, error_kind_of
from braid.runtime.ipc import messages as M
from braid.runtime.server.errors import for_kind
from braid.runtime.server.request_handle import _error_failure


def _failed(exc: Exception) -> Future:
    future = Future()
    future.set_exception(exc)
    return future


def test_poll_grammars_tells_a_full_queue_from_a_bad_grammar():
    intake = RequestIntake.__new__(RequestIntake)  # only the grammar queue is used
    reqs = [Req(rid=f"r{i}", input_ids=[1, 2], sampling_params=SamplingParams(regex="[0-9]+")) for i in range(4)]
    intake.grammar_queue = [(reqs[0], _failed(GrammarBusyError("32 compiles waiting"))),
                            (reqs[1], _failed(GrammarTimeoutError("compile took over 10 s"))),
                            (reqs[2], _failed(GrammarError("unbalanced parenthesis"))),
                            (reqs[3], _failed(EOFError("the compile worker died")))]
    ready, failed = intake.poll_grammars()
    assert ready == [] and intake.grammar_queue == []
    reasons = {req.rid: reason for req, reason in failed}
    assert reasons["r0"].kind is ErrorKind.GRAMMAR_BUSY and "32 compiles waiting" in reasons["r0"].message
    assert all(reasons[r].kind is ErrorKind.GRAMMAR_INVALID for r in ("r1", "r2", "r3"))
    assert reasons["r0"].message.startswith("grammar compiler busy") and reasons["r2"].message.startswith("grammar error")
    assert all(reason.type == "abort" for _, reason in failed)
    assert "kind" not in reasons["r0"].to_json()  # the client's finish_reason stays {type, matched, message}


def test_exceptions_map_to_kinds_by_type():
    assert error_kind_of(GrammarBusyError("busy")) is ErrorKind.GRAMMAR_BUSY
    assert error_kind_of(GrammarTimeoutError("slow")) is ErrorKind.GRAMMAR_INVALID
    assert error_kind_of(SamplingParamsError("temperature: -1", "temperature")) is ErrorKind.INVALID_REQUEST
    assert error_kind_of(KeyError("GrammarBusyError")) is ErrorKind.INTERNAL


def test_http_side_answers_429_for_a_full_queue_and_400_for_a_bad_grammar():
    def output(message: str, kind) -> M.Output:
        return M.Output(rid="r", finished=True, finish_reason={"type": "abort", "matched": None, "message": message},
                        error_kind=kind)

    busy = _error_failure(output("32 compiles waiting", ErrorKind.GRAMMAR_BUSY), SamplingParams(regex="[0-9]+"))
    assert busy.status == 429 and busy.headers["Retry-After"] == "1" and busy.param == "regex"
    assert busy.type == "rate_limit_error" and busy.message == "32 compiles waiting"
    bad = _error_failure(output("unbalanced parenthesis", ErrorKind.GRAMMAR_INVALID), SamplingParams(json_schema="{}"))
    assert bad.status == 400 and bad.param == "json_schema" and bad.headers is None
    assert bad.type == "invalid_request_error"
    # text that once chose the status decides nothing without a kind
    assert _error_failure(output("grammar error: x", None), SamplingParams(regex="[0-9]+")) is None


def test_every_kind_has_one_status_and_one_exception():
    statuses = {k: for_kind(k, "m").status for k in ErrorKind}
    assert statuses == {ErrorKind.INVALID_REQUEST: 400, ErrorKind.GRAMMAR_INVALID: 400, ErrorKind.GRAMMAR_BUSY: 429,
                        ErrorKind.INTERNAL: 500}
    assert for_kind(ErrorKind.INTERNAL, "m").type == "internal_server_error"
    raised = {k: type(exception_for(k, "m")) for k in ErrorKind}
    assert raised == {ErrorKind.INVALID_REQUEST: ValueError, ErrorKind.GRAMMAR_INVALID: ValueError,
                      ErrorKind.GRAMMAR_BUSY: BusyError, ErrorKind.INTERNAL: RuntimeError}
    assert issubclass(BusyError, RuntimeError)  # callers that caught the Engine's RuntimeError still do
