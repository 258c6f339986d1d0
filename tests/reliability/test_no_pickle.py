"""No pickle across processes: the grammar compile workers' pipe carries bytes only (outlines-core's binary forms
and msgpack replies), on both ends."""

import msgspec
import pytest
from multiprocessing.connection import Connection

from braid.runtime.constrained.compile_pool import CompilePool, _CompileFailed, _Compiled, _Worker, _WorkerReply, outlines_binary
from braid.runtime.constrained.grammar_errors import GrammarError


@pytest.fixture(scope="module")
def vocabulary():
    from outlines_core import Vocabulary

    return Vocabulary(3, {"a": [0], "b": [1], "ab": [2]})


def test_worker_frames_are_msgpack_and_outlines_binary(vocabulary):
    from outlines_core import Index

    worker = _Worker(outlines_binary(vocabulary))
    try:
        worker.ensure_started()  # the vocabulary went over as bytes, the ready reply came back as msgpack
        worker.conn.send_bytes(b"(a|b)+")
        raw = worker.conn.recv_bytes()
        assert not raw.startswith(b"\x80")  # a pickle frame starts with its protocol opcode
        reply = msgspec.msgpack.decode(raw, type=_WorkerReply)
        assert isinstance(reply, _Compiled)
        index = Index.from_binary(reply.index)
        start = index.get_initial_state()
        assert sorted(index.get_allowed_tokens(start)) == [0, 1, 2]
        worker.conn.send_bytes(b"(a|")  # a regex the compiler refuses: an error reply, the worker lives on
        failed = msgspec.msgpack.decode(worker.conn.recv_bytes(), type=_WorkerReply)
        assert isinstance(failed, _CompileFailed) and "cannot compile" in failed.message
        assert worker.alive
    finally:
        worker.close()


def test_pool_compiles_without_pickling_on_the_parent_side(vocabulary, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("pickle on the grammar worker pipe")

    monkeypatch.setattr(Connection, "send", refuse)
    monkeypatch.setattr(Connection, "recv", refuse)
    pool = CompilePool(vocabulary, num_workers=1, timeout_s=30.0)
    try:
        index = pool.submit("a(b)*").result(timeout=60)
        state = index.get_next_state(index.get_initial_state(), 0)
        assert index.is_final_state(state) and sorted(index.get_allowed_tokens(state)) == [1, 3]
        with pytest.raises(GrammarError, match="cannot compile"):
            pool.submit("(a|").result(timeout=60)
    finally:
        pool.shutdown()
