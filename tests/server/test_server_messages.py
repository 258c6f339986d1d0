"""Wire messages, the scheduler-process loop (over real ZMQ sockets, with a stand-in scheduler)."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import msgspec
import pytest
import zmq

from braid.runtime.core import ReqOutput
from braid.runtime.error_kind import ErrorKind
from braid.runtime.sampling_params import SamplingParams, SamplingParamsError
from braid.runtime.ipc import messages as M
from braid.runtime.processes.scheduler_process import SchedulerLoop
from server_helpers import process_alive


def test_messages_round_trip_with_their_type():
    msgs = [M.GenerateReq(rid="r", input_ids=[1, 2], sampling_params=SamplingParams(stop=["x"]).to_dict(),
                          return_logprob=True),
            M.AbortReq("r"), M.FlushCacheReq(3), M.GetStatsReq(4), M.ShutdownReq(), M.LoadLoraReq(5, "sql", "/a/b"),
            M.UnloadLoraReq(6, "sql")]
    for m in msgs:
        back = M.decode_to_scheduler(M.encode(m))
        assert type(back) is type(m) and back == m
    assert SamplingParams.from_dict(M.decode_to_scheduler(M.encode(msgs[0])).sampling_params).stop == ["x"]
    with pytest.raises(msgspec.ValidationError):
        M.decode_to_scheduler(M.encode(M.Ready(1, 2, "p")))  # a server->scheduler socket carries only its own types


def test_output_from_req_output_keeps_every_field():
    ro = ReqOutput(rid="a", index=1, output_ids_offset=2, new_token_ids=[5, 6], finished=True,
                   finish_reason={"type": "stop", "matched": "\n"}, prompt_tokens=4, completion_tokens=4,
                   cached_tokens=3, completion_tokens_wo_jump_forward=2,
                   output_token_logprobs=[(-0.5, 5), (-0.25, 6)], output_top_logprobs=[[(-0.5, 5)], None],
                   input_token_logprobs=[(None, 1), (-1.0, 2)], input_top_logprobs=[None, [(-1.0, 2)]])
    out = M.decode_from_scheduler(M.encode(M.OutputBatch([M.output_from_req_output(ro)]))).outputs[0]
    assert out.rid == "a" and out.index == 1 and out.output_ids_offset == 2 and out.new_token_ids == [5, 6]
    assert out.finish_reason == {"type": "stop", "matched": "\n"} and out.cached_tokens == 3
    assert out.completion_tokens_wo_jump_forward == 2
    assert out.output_token_logprobs == [[-0.5, 5], [-0.25, 6]] and out.output_top_logprobs == [[[-0.5, 5]], None]
    assert out.input_token_logprobs == [[None, 1], [-1.0, 2]]
    assert out.error_kind is None
    ro.error_kind = ErrorKind.GRAMMAR_BUSY
    out = M.decode_from_scheduler(M.encode(M.OutputBatch([M.output_from_req_output(ro)]))).outputs[0]
    assert out.error_kind is ErrorKind.GRAMMAR_BUSY  # decoded as the enum, not its text


class StandInScheduler:
    """Emits one token per step per request until max_new_tokens; rejects temperature 7 like a real one would."""

    def __init__(self):
        self.reqs = {}
        self.aborted = []
        self.adapters = []
        self.unload_done = None

    def add_request(self, req):
        if req.sampling_params.temperature == 7:
            raise SamplingParamsError("temperature: too hot", "temperature")
        if req.sampling_params.temperature == 8:
            raise RuntimeError("bug")
        self.reqs[req.rid] = req

    def abort_request(self, rid):
        self.aborted.append(rid)
        self.reqs.pop(rid, None)

    def load_lora_adapter(self, name, path):
        from braid.runtime.lora.adapter import LoraError

        if path == "bad":
            raise LoraError(f"LoRA adapter {name!r} ({path}): no such folder")
        if path == "bug":
            raise RuntimeError("bug")
        self.adapters.append(name)

    def unload_lora_adapter(self, name, done):
        from braid.runtime.lora.adapter import LoraError

        if name not in self.adapters:
            raise LoraError(f"unknown LoRA adapter {name!r}", code="lora_not_found", param="lora_name")
        self.adapters.remove(name)
        self.unload_done = done  # answered later, as a real scheduler does once the adapter's requests finished

    def has_work(self):
        return bool(self.reqs)

    def only_waits_for_grammars(self):
        return False

    def flush_cache(self):
        return not self.reqs

    def get_stats(self):
        return {"num_running_reqs": len(self.reqs), "kv_used_tokens": 0}

    def step(self):
        outs = []
        for rid, req in list(self.reqs.items()):
            req.output_ids.append(len(req.output_ids) + 10)
            done = len(req.output_ids) >= req.sampling_params.max_new_tokens
            outs.append(ReqOutput(rid, 0, len(req.output_ids) - 1, req.output_ids[-1:], done,
                                  {"type": "length", "matched": None} if done else None, len(req.input_ids),
                                  len(req.output_ids), 0, len(req.output_ids)))
            if done:
                del self.reqs[rid]
        return outs


@pytest.fixture
def loop_sockets(tmp_path):
    ctx = zmq.Context()
    to_addr, from_addr = f"ipc://{tmp_path}/to", f"ipc://{tmp_path}/from"
    send, recv = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    send.bind(to_addr)
    recv.bind(from_addr)
    s_recv, s_send = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    s_recv.connect(to_addr)
    s_send.connect(from_addr)
    sched = StandInScheduler()
    loop = SchedulerLoop(sched, s_recv, s_send, parent_pid=None)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()

    def rpc(msg, expect=1):
        if msg is not None:
            send.send(M.encode(msg))
        got = []
        while len(got) < expect:
            assert recv.poll(5000), f"no answer to {msg!r}"
            got.append(M.decode_from_scheduler(recv.recv()))
        return got

    yield rpc, send, sched, thread
    send.send(M.encode(M.ShutdownReq()))
    thread.join(5)
    for s in (send, recv, s_recv, s_send):
        s.close(0)
    ctx.term()


def _gen(rid, **sp):
    return M.GenerateReq(rid=rid, input_ids=[1, 2, 3], sampling_params=SamplingParams(**sp).to_dict(), stream=True)


def test_scheduler_loop_runs_requests_and_answers_calls(loop_sockets):
    rpc, send, sched, thread = loop_sockets
    batches = rpc(_gen("a", max_new_tokens=3), expect=3)
    ids = [o.new_token_ids[0] for b in batches for o in b.outputs]
    assert ids == [10, 11, 12] and batches[-1].outputs[0].finished
    (err,) = rpc(_gen("b", temperature=7))
    assert err == M.ReqError("b", "temperature: too hot", "temperature", ErrorKind.INVALID_REQUEST)
    (err,) = rpc(_gen("c", temperature=8))
    assert isinstance(err, M.ReqError) and err.kind == ErrorKind.INTERNAL and err.message == "RuntimeError: bug"
    (stats,) = rpc(M.GetStatsReq(9))
    assert stats.req_id == 9 and stats.stats == {"num_running_reqs": 0, "kv_used_tokens": 0}
    (flushed,) = rpc(M.FlushCacheReq(10))
    assert flushed == M.FlushCacheResult(10, True)
    send.send(M.encode(_gen("long", max_new_tokens=10_000_000)))
    send.send(M.encode(M.AbortReq("long")))
    deadline = time.time() + 5
    while "long" not in sched.aborted and time.time() < deadline:
        time.sleep(0.01)
    assert sched.aborted == ["long"]
    send.send(M.encode(M.ShutdownReq()))
    thread.join(5)
    assert not thread.is_alive()


def test_scheduler_loop_answers_lora_loads_and_unloads(loop_sockets):
    """Loads answer at once; an unload answers when the scheduler calls its `done`; refusals carry code and param,
    and a bug is an internal_error."""
    rpc, send, sched, thread = loop_sockets
    assert rpc(M.LoadLoraReq(1, "sql", "/adapters/sql")) == [M.LoraResult(1, True)]
    (bad,) = rpc(M.LoadLoraReq(2, "x", "bad"))
    assert bad == M.LoraResult(2, False, "LoRA adapter 'x' (bad): no such folder", "lora_invalid", "lora_path")
    (bug,) = rpc(M.LoadLoraReq(3, "y", "bug"))
    assert not bug.ok and bug.code == "internal_error" and bug.message == "RuntimeError: bug"
    (unknown,) = rpc(M.UnloadLoraReq(4, "nope"))
    assert unknown.code == "lora_not_found" and unknown.param == "lora_name" and not unknown.ok
    send.send(M.encode(M.UnloadLoraReq(5, "sql")))
    deadline = time.time() + 5
    while sched.unload_done is None and time.time() < deadline:
        time.sleep(0.01)
    sched.unload_done()  # on the loop's thread in a real scheduler; the answer goes out on the same socket
    assert rpc(None) == [M.LoraResult(5, True)]


def test_scheduler_process_dies_with_its_parent(tmp_path):
    """The scheduler child is killed when the server process dies, even mid-start-up."""
    parent = textwrap.dedent(f"""
        import sys, time
        from braid.runtime.config import ServerArgs
        from braid.runtime.processes import scheduler_process
        p = scheduler_process.spawn(ServerArgs(), "ipc://{tmp_path}/a", "ipc://{tmp_path}/b")
        print(p.pid, flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    time.sleep(1.0)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 10
    while time.time() < deadline and process_alive(child):
        time.sleep(0.1)
    assert not process_alive(child)

