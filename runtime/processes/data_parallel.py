"""Data parallelism: --dp-size N independent scheduler groups (each --tp-size ranks) behind one server.

This controller process sits where the scheduler process would: the server talks to it over the same two ZMQ
sockets and the same typed messages. It starts the groups (runtime/processes/scheduler_process.py `spawn`, each with its own
sockets and its own torch.distributed rendezvous), routes each request to the group with the fewest requests in
flight, sends aborts to the request's group, and answers queries for all of them: a flush succeeds when every
group flushed; stats are the groups' totals plus `dp_groups`, each group's own. LoRA adapter loads and unloads go
to every group (each serves every adapter), answered once all have: ok when all are, else the first refusal, and a
load that some groups took and others refused is unloaded from the ones that took it. A group that dies takes the
controller down with a Fatal, so the server goes to its error state.

Started as `python -m braid.runtime.processes.data_parallel` with a JSON config on stdin (no pickle).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import time
from typing import Optional

import zmq

from braid.runtime.ipc import messages as M

logger = logging.getLogger("braid.data_parallel")

_POLL_MS = 500
_START_TIMEOUT_S = 900.0


def merge_stats(per_group: list[dict]) -> dict:
    """The groups' stats summed (rates and ratios averaged; other values where every group has the same), with each
    group's own under `dp_groups`."""
    merged: dict = {}
    for key in per_group[0]:
        values = [g.get(key) for g in per_group]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            total = sum(values)
            merged[key] = total / len(values) if key.endswith(("rate", "ratio")) else total
        elif all(v == values[0] for v in values):  # what every group agrees on (e.g. the adapters registered)
            merged[key] = values[0]
    merged["dp_groups"] = per_group
    return merged


class Group:
    def __init__(self, index: int, proc, send: zmq.Socket, recv: zmq.Socket):
        self.index = index
        self.proc = proc
        self.send = send
        self.recv = recv
        self.in_flight = 0


class DataParallelController:
    def __init__(self, config: dict):
        from braid.runtime.config import ServerArgs
        from braid.runtime.processes.tensor_parallel import group_init_addr, uses_distributed
        from braid.runtime.processes import scheduler_process as process

        self.server_args = ServerArgs(**config["server_args"])
        self.parent_pid = config.get("parent_pid")
        self.ctx = zmq.Context(1)
        self.from_server = self.ctx.socket(zmq.PULL)
        self.from_server.setsockopt(zmq.LINGER, 0)
        self.from_server.connect(config["to_scheduler_addr"])
        self.to_server = self.ctx.socket(zmq.PUSH)
        self.to_server.setsockopt(zmq.LINGER, 2000)
        self.to_server.connect(config["from_scheduler_addr"])
        self.ipc_dir = tempfile.mkdtemp(prefix="braid-dp-")
        self.groups: list[Group] = []
        for g in range(self.server_args.dp_size):
            to_addr = f"ipc://{os.path.join(self.ipc_dir, f'to_{g}')}"
            from_addr = f"ipc://{os.path.join(self.ipc_dir, f'from_{g}')}"
            send = self.ctx.socket(zmq.PUSH)
            send.setsockopt(zmq.LINGER, 0)
            send.bind(to_addr)
            recv = self.ctx.socket(zmq.PULL)
            recv.setsockopt(zmq.LINGER, 0)
            recv.bind(from_addr)
            # each group on its own GPUs: base_gpu_id + g * tp_size onwards
            group_args = self.server_args.replace(dp_size=1, base_gpu_id=self.server_args.base_gpu_id
                                                  + g * self.server_args.tp_size)
            if uses_distributed(self.server_args):
                group_args = group_args.replace(dist_init_addr=group_init_addr(self.server_args, g))
            self.groups.append(Group(g, process.spawn(group_args, to_addr, from_addr), send, recv))
        self.poller = zmq.Poller()
        self.poller.register(self.from_server, zmq.POLLIN)
        for group in self.groups:
            self.poller.register(group.recv, zmq.POLLIN)
        self.owner: dict[str, tuple[Group, int]] = {}  # rid -> (its group, choices not finished yet)
        self.queries: dict[int, list] = {}  # req_id -> the groups' answers so far
        self.lora_loads: dict[int, M.LoadLoraReq] = {}  # req_id -> a load every group was sent
        self.rollback_ids = iter(range(-1, -2**62, -1))  # req_ids of the controller's own unloads (never answered)
        self.running = True

    # ---- start ----
    def wait_ready(self) -> M.Ready:
        ready: dict[int, M.Ready] = {}
        deadline = time.monotonic() + _START_TIMEOUT_S
        while len(ready) < len(self.groups):
            if time.monotonic() > deadline:
                raise RuntimeError(f"data-parallel groups not ready after {_START_TIMEOUT_S:.0f}s")
            self.check_groups()
            for group in self.groups:
                if group.index in ready or not group.recv.poll(50):
                    continue
                msg = M.decode_from_scheduler(group.recv.recv())
                if isinstance(msg, M.Fatal):
                    raise RuntimeError(f"data-parallel group {group.index} failed to start:\n{msg.message}")
                if isinstance(msg, M.Ready):
                    ready[group.index] = msg
        first = ready[0]
        info = dict(first.model_info, dp_size=len(self.groups))
        return M.Ready(first.context_len, first.vocab_size, first.model_path, info)

    def check_groups(self) -> None:
        for group in self.groups:
            code = group.proc.poll()
            if code is not None:
                raise RuntimeError(f"data-parallel group {group.index} exited with code {code}")

    # ---- the loop ----
    def run(self) -> None:
        while self.running:
            events = dict(self.poller.poll(_POLL_MS))
            if self.from_server in events:
                self.drain_server()
            for group in self.groups:
                if group.recv in events:
                    self.drain_group(group)
            self.check_groups()
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                logger.warning("parent process is gone; data-parallel controller exiting")
                return

    def drain_server(self) -> None:
        while True:
            try:
                msg = M.decode_to_scheduler(self.from_server.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            if isinstance(msg, M.GenerateReq):
                group = min(self.groups, key=lambda g: g.in_flight)  # ties: the lowest index
                group.in_flight += 1
                self.owner[msg.rid] = (group, int(msg.sampling_params.get("n") or 1))
                group.send.send(M.encode(msg))
            elif isinstance(msg, M.AbortReq):
                owner = self.owner.get(msg.rid)
                for group in [owner[0]] if owner is not None else self.groups:
                    group.send.send(M.encode(msg))
            elif isinstance(msg, (M.FlushCacheReq, M.GetStatsReq, M.LoadLoraReq, M.UnloadLoraReq)):
                self.queries[msg.req_id] = [None] * len(self.groups)
                if isinstance(msg, M.LoadLoraReq):
                    self.lora_loads[msg.req_id] = msg
                for group in self.groups:
                    group.send.send(M.encode(msg))
            elif isinstance(msg, M.ShutdownReq):
                for group in self.groups:
                    group.send.send(M.encode(msg))
                self.running = False
                return

    def drain_group(self, group: Group) -> None:
        while True:
            try:
                data = group.recv.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = M.decode_from_scheduler(data)
            if isinstance(msg, M.OutputBatch):
                for out in msg.outputs:
                    if out.finished:
                        self.choice_done(out.rid)
                self.to_server.send(data)
            elif isinstance(msg, M.ReqError):
                self.request_done(msg.rid)
                self.to_server.send(data)
            elif isinstance(msg, (M.FlushCacheResult, M.Stats, M.LoraResult)):
                self.answer(group, msg)
            elif isinstance(msg, M.Fatal):
                raise RuntimeError(f"data-parallel group {group.index} crashed:\n{msg.message}")

    def choice_done(self, rid: str) -> None:
        owner = self.owner.get(rid)
        if owner is None:
            return
        group, left = owner
        if left <= 1:
            self.request_done(rid)
        else:
            self.owner[rid] = (group, left - 1)

    def request_done(self, rid: str) -> None:
        owner = self.owner.pop(rid, None)
        if owner is not None:
            owner[0].in_flight -= 1

    def answer(self, group: Group, msg) -> None:
        answers = self.queries.get(msg.req_id)
        if answers is None:
            return
        answers[group.index] = msg
        if any(a is None for a in answers):
            return
        del self.queries[msg.req_id]
        if isinstance(msg, M.FlushCacheResult):
            self.to_server.send(M.encode(M.FlushCacheResult(msg.req_id, all(a.ok for a in answers))))
        elif isinstance(msg, M.LoraResult):
            self.to_server.send(M.encode(self.lora_answer(msg.req_id, answers)))
        else:
            stats = merge_stats([dict(a.stats, dp_rank=i) for i, a in enumerate(answers)])
            self.to_server.send(M.encode(M.Stats(msg.req_id, stats)))

    def lora_answer(self, req_id: int, answers: list) -> M.LoraResult:
        """The groups' LoraResults as one: ok when every group's is, else the first refusal. A load refused by some
        groups only is unloaded from the others, so that the groups keep serving the same adapters."""
        load = self.lora_loads.pop(req_id, None)
        refused = [a for a in answers if not a.ok]
        if not refused:
            return answers[0]
        if load is not None:
            took = [g for g, a in zip(self.groups, answers) if a.ok]
            if took:
                logger.error("LoRA adapter %r loaded in data-parallel groups %s only; unloading it there",
                             load.lora_name, [g.index for g in took])
            for group in took:
                group.send.send(M.encode(M.UnloadLoraReq(next(self.rollback_ids), load.lora_name)))
        return refused[0]

    # ---- stop ----
    def close(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        for group in self.groups:
            while group.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        for group in self.groups:
            if group.proc.poll() is None:
                group.proc.kill()
                group.proc.wait()
        for sock in [self.from_server, *(g.send for g in self.groups), *(g.recv for g in self.groups)]:
            sock.close(0)
        self.to_server.close()
        self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def run(config: dict) -> int:
    from braid.runtime.config import ServerArgs

    server_args = ServerArgs(**config["server_args"])
    logging.basicConfig(level=getattr(logging, server_args.log_level.upper(), logging.INFO),
                        format="[data-parallel %(asctime)s] %(levelname)s %(message)s")
    controller: Optional[DataParallelController] = None
    code = 0
    try:
        controller = DataParallelController(config)
        controller.to_server.send(M.encode(controller.wait_ready()))
        logger.info("%d data-parallel groups ready", len(controller.groups))
        controller.run()
    except Exception as e:
        logger.error("stopped: %s", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
        if controller is not None:
            controller.to_server.send(M.encode(M.Fatal(str(e))))
            for group in controller.groups:
                if group.proc.poll() is None:
                    group.proc.terminate()
        code = 1
    finally:
        if controller is not None:
            controller.close()
    return code


def main() -> None:
    from braid.runtime.processes.scheduler_process import child_process_config

    sys.exit(run(child_process_config()))


if __name__ == "__main__":
    main()
