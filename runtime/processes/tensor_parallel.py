"""Tensor parallelism at the scheduler level: rank 0 takes the requests, every rank runs the same schedule.

Rank 0 (the leader) receives requests as usual (ZMQ in the server's scheduler process, the inbox in the Engine).
Once per loop iteration it broadcasts what changed the scheduler's state since the last one (requests added,
aborts, cache flushes; which grammars it found compiled; whether to stop) as one msgspec message in a uint8
tensor on a gloo group. The followers apply the same commands and then run `Scheduler.step()` as rank 0 does, so
every rank builds the same batches and the model's collectives line up. The sampled ids are rank 0's
(ModelRunner broadcasts them), so a draw can never differ between ranks; only rank 0 emits outputs.

What could make the schedules diverge is kept out: grammar compiles finish on each rank at their own time, so
rank 0 decides which compiled grammars a step admits and the followers wait for those; admission reads rank 0's
clock and requests carry rank 0's creation time (the LPM policy ages waiting requests by them).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import socket
import time
from typing import Optional

import msgspec
import torch

from braid.runtime.distributed import parallel_state as ps

logger = logging.getLogger(__name__)


class GrammarDecision(msgspec.Struct):
    rid: str
    index: int
    ok: bool


class Command(msgspec.Struct):
    message: bytes  # messages.encode(GenerateReq | AbortReq | FlushCacheReq)
    created_time: float = 0.0  # a GenerateReq's Req.created_time on rank 0
    accepted: bool = True  # whether rank 0's add_request took it (a follower must agree)
    grammars_at_once: list[GrammarDecision] = []  # its choices whose grammar rank 0 found compiled when it came


class LeaderStep(msgspec.Struct):
    commands: list[Command] = []
    grammars: list[GrammarDecision] = []
    stop: bool = False
    clock: float = 0.0  # rank 0's time.time(): the step's admission clock on every rank


class StepClock:
    """PrefillPlanner's clock under TP: the time rank 0 broadcast with the step, the same on every rank."""

    def __init__(self, planner):
        self.now = time.time()
        planner.clock = self

    def __call__(self) -> float:
        return self.now


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(LeaderStep)


class GrammarGate:
    """Makes the intake admit exactly the grammars rank 0 found compiled (on a follower, waiting for them), instead
    of whatever happens to have finished on this rank: at a request's arrival (`compiled_now`: a grammar compiled
    before skips the queue) and at each step's poll."""

    def __init__(self, intake, leader: bool):
        self.intake = intake
        self.leader = leader
        self.poll_all = intake.poll_grammars
        intake.poll_grammars = self.poll
        self.compiled_before = intake.compiled_now
        intake.compiled_now = self.compiled_now
        self.decided: dict[tuple[str, int], bool] = {}
        # while a command's request is added: its choices whose grammar rank 0 admitted at once (rank 0 appends)
        self.at_once: Optional[list[GrammarDecision]] = None

    def compiled_now(self, req, fut) -> bool:
        if self.at_once is None:
            return False  # enqueued by a step (samples after a shared prefill): the step polls decide, on every rank
        if self.leader:
            now = self.compiled_before(req, fut)
            if now:
                self.at_once.append(GrammarDecision(req.rid, req.index, True))
            return now
        if all((d.rid, d.index) != (req.rid, req.index) for d in self.at_once):
            return False  # queued on rank 0: admitted when rank 0's poll decides it
        if fut.exception() is not None:  # waits for this rank's compile
            raise RuntimeError("a grammar compiled on rank 0 failed on this rank; the ranks' schedules would diverge")
        return True

    def decide(self) -> list[GrammarDecision]:
        """Rank 0: the grammars compiled by now, with whether they compiled."""
        out = [GrammarDecision(req.rid, req.index, fut.exception() is None)
               for req, fut in self.intake.grammar_queue if fut.done()]
        self.decided = {(d.rid, d.index): d.ok for d in out}
        return out

    def follow(self, decisions: list[GrammarDecision]) -> None:
        self.decided = {(d.rid, d.index): d.ok for d in decisions}

    def poll(self):
        from braid.runtime.core import FinishReason
        from braid.runtime.error_kind import ErrorKind

        decided, self.decided = self.decided, {}
        queue = self.intake.grammar_queue
        due = [(req, fut) for req, fut in queue if (req.rid, req.index) in decided]
        if not due:
            return [], []
        concurrent.futures.wait([fut for _, fut in due])
        self.intake.grammar_queue = due
        ready, failed = self.poll_all()
        self.intake.grammar_queue = [(req, fut) for req, fut in queue if (req.rid, req.index) not in decided]
        for req in [r for r in ready if not decided[(r.rid, r.index)]]:
            ready.remove(req)  # rank 0's compile failed (a timeout): this rank fails it too
            failed.append((req, FinishReason("abort", message="grammar error on rank 0",
                                             kind=ErrorKind.GRAMMAR_INVALID)))
        if any(decided[(r.rid, r.index)] for r, _ in failed):
            raise RuntimeError("a grammar compiled on rank 0 failed on this rank; the ranks' schedules would diverge")
        return ready, failed


class LeaderScheduler:
    """Rank 0's Scheduler as its I/O sees it: every state-changing call is recorded for the followers; everything
    else is the Scheduler's own."""

    def __init__(self, scheduler):
        self._scheduler = scheduler
        self._commands: list[Command] = []
        self._gate = GrammarGate(scheduler.intake, leader=True)
        self._clock = StepClock(scheduler.prefill)

    def __getattr__(self, name):
        return getattr(self._scheduler, name)

    def add_request(self, req) -> None:
        from braid.runtime.ipc import messages as M

        command = Command(M.encode(M.message_from_req(req)), req.created_time)
        self._gate.at_once = command.grammars_at_once
        try:
            self._recorded(command, lambda: self._scheduler.add_request(req))
        finally:
            self._gate.at_once = None

    def abort_request(self, rid: str) -> None:
        from braid.runtime.ipc import messages as M

        self._commands.append(Command(M.encode(M.AbortReq(rid))))
        self._scheduler.abort_request(rid)

    def flush_cache(self) -> bool:
        from braid.runtime.ipc import messages as M

        self._commands.append(Command(M.encode(M.FlushCacheReq(0))))
        return self._scheduler.flush_cache()

    def load_lora_adapter(self, name: str, path: str) -> None:
        from braid.runtime.ipc import messages as M

        self._recorded(Command(M.encode(M.LoadLoraReq(0, name, path))),
                       lambda: self._scheduler.load_lora_adapter(name, path))

    def unload_lora_adapter(self, name: str, done) -> None:
        from braid.runtime.ipc import messages as M

        self._recorded(Command(M.encode(M.UnloadLoraReq(0, name))),
                       lambda: self._scheduler.unload_lora_adapter(name, done))

    def _recorded(self, command: Command, apply) -> None:
        """Apply a state change here and record it for the followers, with whether it was refused."""
        self._commands.append(command)
        try:
            apply()
        except Exception:
            command.accepted = False
            raise

    def io(self, inner) -> "LeaderIO":
        return LeaderIO(self, inner)

    def broadcast_step(self, stop: bool) -> None:
        self._clock.now = time.time()
        step = LeaderStep(self._commands, self._gate.decide(), stop, self._clock.now)
        self._commands = []
        ps.broadcast_bytes(_encoder.encode(step))
        if stop:
            ps.leave_tensor_parallel()


class LeaderIO:
    """The scheduler loop's I/O on rank 0: the usual I/O, then one broadcast of what it changed."""

    def __init__(self, leader: LeaderScheduler, inner):
        self.leader = leader
        self.inner = inner

    def receive(self, scheduler, block: bool) -> bool:
        alive = self.inner.receive(self.leader, block)
        self.leader.broadcast_step(stop=not alive)
        return alive

    def send_outputs(self, outputs) -> None:
        self.inner.send_outputs(outputs)


def follow(scheduler) -> None:
    """A follower rank's loop: apply rank 0's commands, run the same step, until rank 0 says stop."""
    from braid.runtime.ipc import messages as M

    gate = GrammarGate(scheduler.intake, leader=False)
    clock = StepClock(scheduler.prefill)
    while True:
        step = _decoder.decode(ps.broadcast_bytes(None))
        clock.now = step.clock
        for command in step.commands:
            msg = M.decode_to_scheduler(command.message)
            if isinstance(msg, M.GenerateReq):
                gate.at_once = command.grammars_at_once
                add_like_rank_0(scheduler, msg, command)
                gate.at_once = None
            elif isinstance(msg, M.AbortReq):
                scheduler.abort_request(msg.rid)
            elif isinstance(msg, M.FlushCacheReq):
                scheduler.flush_cache()
            elif isinstance(msg, M.LoadLoraReq):
                apply_like_rank_0(command, lambda: scheduler.load_lora_adapter(msg.lora_name, msg.lora_path))
            elif isinstance(msg, M.UnloadLoraReq):  # rank 0 answers the unload; here it only has to happen
                apply_like_rank_0(command, lambda: scheduler.unload_lora_adapter(msg.lora_name, lambda: None))
        gate.follow(step.grammars)
        if step.stop:
            ps.leave_tensor_parallel()
            return
        if scheduler.has_work():
            scheduler.step()  # outputs are rank 0's to send


def apply_like_rank_0(command: Command, apply) -> None:
    """A state change rank 0 made (an adapter loaded or unloaded), made here too; one rank 0 refused is not."""
    if not command.accepted:
        return
    try:
        apply()
    except Exception as e:
        raise RuntimeError(f"a change rank 0 made failed on this rank ({e}); the ranks' schedules would diverge") from e


def add_like_rank_0(scheduler, msg, command: Command) -> None:
    """Add a request rank 0 received; its outcome (taken or refused: rank 0 told the client) must be rank 0's.
    Refusals that depend on this rank's timing (a full grammar queue) are the only way the outcomes can differ."""
    from braid.runtime.ipc import messages as M

    req = M.req_from_message(msg)
    req.created_time = command.created_time
    req.client = ""  # the per-client grammar cap counts compiles pending on this rank: rank 0's outcome decides
    try:
        scheduler.add_request(req)
        accepted, reason = True, ""
    except ValueError as e:
        accepted, reason = False, str(e)
    if accepted == command.accepted:
        return
    if not accepted:
        raise RuntimeError(f"request {msg.rid} was taken on rank 0 but refused on this rank ({reason}); the ranks' "
                           "schedules would diverge")
    scheduler.abort_request(msg.rid)  # refused on rank 0: never scheduled here either


# ---- process layout ----------------------------------------------------------------------------------------------

def free_loopback_addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def group_init_addr(server_args, dp_rank: int = 0) -> str:
    """The rendezvous of data-parallel group `dp_rank`: --dist-init-addr with its port + dp_rank, else a free
    loopback port."""
    if server_args.dist_init_addr is None:
        return free_loopback_addr()
    host, _, port = server_args.dist_init_addr.rpartition(":")
    return f"{host}:{int(port) + dp_rank}"


def local_ranks(server_args) -> range:
    """The TP ranks this host runs: tp_size / nnodes of them, node_rank's block."""
    per_node = server_args.tp_size // server_args.nnodes
    return range(server_args.node_rank * per_node, (server_args.node_rank + 1) * per_node)


def rank_device(server_args, rank: int) -> torch.device:
    device = torch.device(server_args.resolved_device)
    if device.type == "cuda":
        return torch.device("cuda", server_args.base_gpu_id + rank % (server_args.tp_size // server_args.nnodes))
    return device


def uses_distributed(server_args) -> bool:
    """Whether the scheduler runs on torch.distributed: under TP, and at tp 1 when --dist-init-addr is given (a
    world of one: every collective and the leader's broadcasts run, which is how one GPU checks the NCCL path)."""
    return server_args.tp_size > 1 or server_args.dist_init_addr is not None


def init_rank(server_args, rank: int, init_addr: Optional[str]) -> None:
    """Join the TP world as `rank` (on CUDA: on its GPU, also without TP); on a CPU host shared by several ranks,
    give each its share of the cores."""
    device = rank_device(server_args, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not uses_distributed(server_args):
        return
    if device.type == "cpu":
        per_host = server_args.tp_size // server_args.nnodes
        # never more threads than the process was given (OMP_NUM_THREADS): spinning OpenMP teams of two ranks on
        # the same cores wait on each other at every collective
        torch.set_num_threads(max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // per_host)))
    ps.init_tensor_parallel(server_args.tp_size, rank, init_addr, device)
