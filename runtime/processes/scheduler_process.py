"""The scheduler process: owns a Scheduler, talks to the HTTP server over two ZMQ PUSH/PULL sockets.

Started as `python -m braid.runtime.processes.scheduler_process` with a JSON config on stdin (server args and
socket addresses), so nothing is pickled, not even at start-up. It sends `Ready` once the model is
loaded, then runs the scheduler loop (scheduler.py) with `SchedulerLoop` as its I/O: incoming
messages are drained between steps, the socket is waited on when idle. It exits on `ShutdownReq`,
SIGTERM, or when its parent dies.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from typing import Optional

import zmq

from braid.runtime.error_kind import GRAMMAR_KINDS, ErrorKind
from braid.runtime.sampling_params import GRAMMAR_FIELDS
from braid.runtime.scheduler.stats_log import ServingStatsLog
from braid.runtime.ipc import messages as M

logger = logging.getLogger("braid.scheduler")

_IDLE_POLL_MS = 500  # wake up this often when idle, to notice a dead parent
_ZERO_COPY_MIN_BYTES = 1 << 16


def spawn(server_args, to_scheduler_addr: str, from_scheduler_addr: str):
    """Start the scheduler process(es); rank 0 connects to the two addresses the caller has bound. Under data
    parallelism one controller process stands for the groups (runtime/processes/data_parallel.py); under tensor
    parallelism the result stands for all of this host's ranks (RankProcesses)."""
    if server_args.dp_size > 1:
        config = {"server_args": dataclasses.asdict(server_args), "to_scheduler_addr": to_scheduler_addr,
                  "from_scheduler_addr": from_scheduler_addr, "parent_pid": os.getpid()}
        return _start([sys.executable, "-m", "braid.runtime.processes.data_parallel"], config)
    from braid.runtime.processes.tensor_parallel import group_init_addr, local_ranks

    init_addr = group_init_addr(server_args)
    procs = [spawn_rank(server_args, rank, init_addr, os.getpid(), to_scheduler_addr, from_scheduler_addr)
             for rank in local_ranks(server_args)]
    return procs[0] if len(procs) == 1 else RankProcesses(procs)


def spawn_rank(server_args, rank: int, init_addr: str, parent_pid: int, to_scheduler_addr: Optional[str] = None,
               from_scheduler_addr: Optional[str] = None) -> subprocess.Popen:
    """One TP rank's scheduler process; rank 0 gets the server's sockets, the others follow rank 0."""
    config = {"server_args": dataclasses.asdict(server_args), "tp_rank": rank, "dist_init_addr": init_addr,
              "parent_pid": parent_pid}
    if rank == 0:
        config.update(to_scheduler_addr=to_scheduler_addr, from_scheduler_addr=from_scheduler_addr)
    return _start([sys.executable, "-m", "braid.runtime.processes.scheduler_process"], config)


def _start(argv: list[str], config: dict) -> subprocess.Popen:
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(config).encode())
    proc.stdin.close()
    return proc


class RankProcesses:
    """A host's TP rank processes seen as one process: it has exited once any rank has (that rank's code, a
    failure first), so the server goes to its error state when any rank dies."""

    def __init__(self, procs: list[subprocess.Popen]):
        self.procs = procs

    @property
    def pid(self) -> int:
        return self.procs[0].pid

    @property
    def returncode(self) -> Optional[int]:
        codes = [p.returncode for p in self.procs if p.returncode is not None]
        if not codes:
            return None
        return next((c for c in codes if c != 0), codes[0])

    def poll(self) -> Optional[int]:
        for p in self.procs:
            p.poll()
        return self.returncode

    def terminate(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()

    def wait(self, timeout: Optional[float] = None) -> int:
        for p in self.procs:
            p.wait(timeout)
        return self.returncode


def spawn_followers(server_args, init_addr: str, ranks, parent_pid: int) -> list[subprocess.Popen]:
    """Start follower rank processes (the scheduler process in follower mode: no sockets, typed config on stdin)."""
    return [spawn_rank(server_args, rank, init_addr, parent_pid) for rank in ranks if rank != 0]


def stop_processes(procs: list[subprocess.Popen], timeout_s: float = 10.0) -> None:
    for proc in procs:
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class EngineRanks:
    """The in-process Engine under TP: rank 0 runs on the Engine's scheduler thread, the others as processes."""

    def __init__(self, server_args):
        if server_args.nnodes > 1:
            raise ValueError("nnodes > 1 is a server feature (python -m braid.launch_server on every host); the "
                             "in-process Engine runs all its ranks on this host")
        from braid.runtime.processes.tensor_parallel import group_init_addr

        self.server_args = server_args
        self.init_addr = group_init_addr(server_args)
        self.followers = spawn_followers(server_args, self.init_addr, range(server_args.tp_size), os.getpid())
        self.leader = None  # rank 0's tensor_parallel.LeaderScheduler once built

    def build_scheduler(self):
        from braid.runtime.processes.tensor_parallel import LeaderScheduler, init_rank
        from braid.runtime.scheduler.scheduler import Scheduler

        try:
            init_rank(self.server_args, 0, self.init_addr)
            self.leader = LeaderScheduler(Scheduler(self.server_args))
        except BaseException:
            self.close()
            raise
        return self.leader

    def close(self) -> None:
        for proc in self.followers:
            if proc.poll() is None and self.leader is None:
                proc.kill()  # rank 0 never joined: they wait at the rendezvous
        from braid.runtime.distributed import parallel_state as ps

        stop_processes(self.followers)
        ps.destroy_tensor_parallel()


def run_node_ranks(server_args) -> int:
    """--node-rank > 0: run this host's TP ranks (followers of rank 0 on node 0) until they exit; one rank failing
    stops the others. SIGTERM/SIGINT stop them too."""
    from braid.runtime.processes.tensor_parallel import group_init_addr, local_ranks

    procs = spawn_followers(server_args, group_init_addr(server_args), local_ranks(server_args), os.getpid())
    stopping = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.append(True))
    logger.info("node %d: ranks %s running, following rank 0 at %s", server_args.node_rank,
                list(local_ranks(server_args)), server_args.dist_init_addr)
    while not stopping and all(p.poll() is None for p in procs):
        time.sleep(0.5)
    codes = [p.poll() for p in procs]
    for p in procs:
        if p.poll() is None:
            p.terminate()
    stop_processes(procs)
    failed = {rank: code for rank, code in zip(local_ranks(server_args), codes) if code not in (None, 0)}
    for rank, code in failed.items():
        logger.error("node %d: rank %d exited with code %d", server_args.node_rank, rank, code)
    return 1 if failed else 0


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            PR_SET_PDEATHSIG = 1
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass


class SchedulerLoop:
    """The scheduler loop's I/O over ZMQ: requests and queries in, batched outputs and answers out."""

    def __init__(self, scheduler, recv_sock: zmq.Socket, send_sock: zmq.Socket, parent_pid: Optional[int],
                 log_stats_interval_s: float = 0.0):
        self.scheduler = scheduler
        self.recv_sock = recv_sock
        self.send_sock = send_sock
        self.parent_pid = parent_pid
        self.poller = zmq.Poller()
        self.poller.register(recv_sock, zmq.POLLIN)
        self.running = True
        self.stats_log = ServingStatsLog(log_stats_interval_s)

    def run(self) -> None:
        from braid.runtime.scheduler.scheduler import run_scheduler_loop

        run_scheduler_loop(self.scheduler, self)

    def send(self, msg) -> None:
        data = M.encode(msg)
        # zero-copy sends hand each frame to pyzmq's garbage-collector thread: slower than a copy below ~64 KiB,
        # which a step's output batch usually is
        self.send_sock.send(data, copy=len(data) < _ZERO_COPY_MIN_BYTES)

    # ---- SchedulerIO ----
    def receive(self, scheduler, block: bool) -> bool:
        self.stats_log.maybe_log(scheduler)  # once per loop iteration, so on every step's path
        if self.poller.poll(_IDLE_POLL_MS if block else 0):
            self._drain()
        elif block and not self._parent_alive():
            logger.warning("parent process is gone; scheduler exiting")
            return False
        return self.running

    def send_outputs(self, outputs) -> None:
        self.send(M.OutputBatch([M.output_from_req_output(o) for o in outputs]))

    def _parent_alive(self) -> bool:
        return self.parent_pid is None or os.getppid() == self.parent_pid

    def _drain(self) -> None:
        while self.running:
            try:
                data = self.recv_sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg = M.decode_to_scheduler(data.bytes)
            except Exception as e:  # a malformed frame is a bug in the server, never the client's fault
                logger.error("dropping undecodable message: %s", e)
                continue
            self.handle(msg)

    def handle(self, msg) -> None:
        if isinstance(msg, M.GenerateReq):
            self._add(msg)
        elif isinstance(msg, M.AbortReq):
            self.scheduler.abort_request(msg.rid)
        elif isinstance(msg, M.FlushCacheReq):
            self.send(M.FlushCacheResult(msg.req_id, bool(self.scheduler.flush_cache())))
        elif isinstance(msg, M.GetStatsReq):
            self.send(M.Stats(msg.req_id, _plain_stats(self.scheduler.get_stats())))
        elif isinstance(msg, M.LoadLoraReq):
            failure = self._lora_call(msg.req_id, lambda: self.scheduler.load_lora_adapter(msg.lora_name,
                                                                                           msg.lora_path))
            self.send(failure or M.LoraResult(msg.req_id, True))
        elif isinstance(msg, M.UnloadLoraReq):
            req_id = msg.req_id
            # answered once the adapter's requests have finished, from inside a scheduler step
            failure = self._lora_call(req_id, lambda: self.scheduler.unload_lora_adapter(
                msg.lora_name, lambda: self.send(M.LoraResult(req_id, True))))
            if failure is not None:
                self.send(failure)
        elif isinstance(msg, M.ShutdownReq):
            self.running = False

    @staticmethod
    def _lora_call(req_id: int, fn) -> Optional[M.LoraResult]:
        """Run a load or unload; None when it went ahead, else the refusal to answer."""
        try:
            fn()
            return None
        except ValueError as e:  # LoraError: the adapter or the request is at fault
            return M.LoraResult(req_id, False, str(e), getattr(e, "code", "lora_invalid"), getattr(e, "param", None))
        except Exception as e:
            logger.exception("LoRA adapter load or unload failed")
            return M.LoraResult(req_id, False, f"{type(e).__name__}: {e}", "internal_error", None)

    def _add(self, msg: M.GenerateReq) -> None:
        try:
            self.scheduler.add_request(M.req_from_message(msg))
        except Exception as e:
            from braid.runtime.scheduler.intake import error_kind_of  # imports torch: not at this module's import

            kind = error_kind_of(e)
            if kind == ErrorKind.INTERNAL:
                logger.exception("add_request failed for %s", msg.rid)
                self.send(M.ReqError(msg.rid, f"{type(e).__name__}: {e}", None, kind))
                return
            # a grammar error names no field; it is the grammar field the request carried (regex, json_schema, ...)
            param = getattr(e, "param", None) or (
                next((f for f in GRAMMAR_FIELDS if msg.sampling_params.get(f) is not None), None)
                if kind in GRAMMAR_KINDS else None)
            self.send(M.ReqError(msg.rid, str(e), param, kind))


def _plain_stats(stats: dict) -> dict:
    out = {}
    for k, v in (stats or {}).items():
        if hasattr(v, "item"):
            v = v.item()
        if isinstance(v, (str, int, float, bool, type(None), list, dict)):
            out[str(k)] = v
    return out


def _model_info(scheduler, server_args) -> dict:
    tok = getattr(scheduler, "tokenizer", None)
    info = {"model_path": server_args.model_path,
            "is_multimodal": bool(getattr(scheduler.model_config, "is_multimodal", False))}
    if tok is not None:
        info["eos_token_id"] = getattr(tok, "eos_token_id", None)
    kv_total = scheduler.get_stats().get("kv_total_tokens")
    if isinstance(kv_total, int):
        info["kv_total_tokens"] = kv_total
    return info


def run_follower(server_args, rank: int, init_addr: str) -> int:
    """A TP rank other than 0: no sockets; it applies rank 0's broadcast commands and runs the same steps."""
    from braid.runtime.processes import tensor_parallel as tp

    try:
        from braid.runtime.scheduler.scheduler import Scheduler, freeze_startup_objects

        tp.init_rank(server_args, rank, init_addr)
        scheduler = Scheduler(server_args)
        freeze_startup_objects()
        tp.follow(scheduler)
        scheduler.shutdown()
        return 0
    except Exception:
        msg = traceback.format_exc()
        logger.error("rank %d stopped: %s", rank, msg.strip().splitlines()[-1])
        logger.debug("%s", msg)
        return 1


def run(config: dict) -> int:
    from braid.runtime.config import ServerArgs

    server_args = ServerArgs(**config["server_args"])
    rank = config.get("tp_rank", 0)
    label = f"scheduler tp{rank}" if server_args.tp_size > 1 else "scheduler"
    logging.basicConfig(level=getattr(logging, server_args.log_level.upper(), logging.INFO),
                        format=f"[{label} %(asctime)s] %(levelname)s %(message)s")
    if rank != 0:
        return run_follower(server_args, rank, config["dist_init_addr"])
    ctx = zmq.Context(1)
    send_sock = ctx.socket(zmq.PUSH)
    send_sock.setsockopt(zmq.LINGER, 2000)
    send_sock.connect(config["from_scheduler_addr"])
    recv_sock = ctx.socket(zmq.PULL)
    recv_sock.setsockopt(zmq.LINGER, 0)
    recv_sock.connect(config["to_scheduler_addr"])
    try:
        from braid.runtime.processes import tensor_parallel as tp
        from braid.runtime.scheduler.scheduler import Scheduler, freeze_startup_objects, run_scheduler_loop

        t0 = time.time()
        tp.init_rank(server_args, 0, config.get("dist_init_addr"))
        scheduler = Scheduler(server_args)
        distributed = tp.uses_distributed(server_args)
        if distributed:
            scheduler = tp.LeaderScheduler(scheduler)
        freeze_startup_objects()
        logger.info("scheduler started in %.1f s", time.time() - t0)
        loop = SchedulerLoop(scheduler, recv_sock, send_sock, config.get("parent_pid"),
                             server_args.log_stats_interval_s)
        loop.send(M.Ready(int(scheduler.context_len), int(scheduler.vocab_size), server_args.model_path,
                          _model_info(scheduler, server_args)))
        run_scheduler_loop(scheduler, scheduler.io(loop) if distributed else loop)
        return 0
    except Exception:
        msg = traceback.format_exc()
        logger.error("scheduler stopped: %s", msg.strip().splitlines()[-1])
        logger.debug("%s", msg)
        send_sock.send(M.encode(M.Fatal(msg)))
        return 1
    finally:
        send_sock.close()
        recv_sock.close()
        ctx.term()


def child_process_config() -> dict:
    """A server child's start: die with the parent, leave Ctrl-C to the server, read the JSON config on stdin."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: let the server drain first
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    config = json.loads(sys.stdin.read())
    if os.getppid() != config.get("parent_pid", os.getppid()):
        sys.exit(1)  # the parent died before the death signal was armed
    return config


def main() -> None:
    sys.exit(run(child_process_config()))


if __name__ == "__main__":
    main()
