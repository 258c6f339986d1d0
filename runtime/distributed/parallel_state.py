"""Tensor-parallel state on torch.distributed: one process per rank, NCCL on CUDA, gloo on CPU.

The layers ask for their rank's share through `tp_size()` / `tp_rank()` while the model is built; with one rank
(no `init_tensor_parallel` call) every collective here is a no-op. Control messages (the requests rank 0
broadcasts) travel on a gloo group beside the device group, as msgspec bytes in a uint8 tensor.
"""

from __future__ import annotations

import datetime
import logging
from typing import Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

_TP_SIZE = 1
_TP_RANK = 0
_ACTIVE = False  # a torch.distributed world exists (tp 1 with --dist-init-addr too: the NCCL path on one GPU)
_DEVICE_GROUP = None  # collectives on the model's tensors (NCCL on CUDA)
_CPU_GROUP = None  # gloo: control bytes, whatever the device
_DEVICE: Optional[torch.device] = None

# An idle rank 0 broadcasts an empty step every half second, so a long timeout only bounds a rank that hangs
# without dying; a rank that dies closes its sockets and its peers' collectives fail at once.
_COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


def tp_size() -> int:
    return _TP_SIZE


def tp_rank() -> int:
    return _TP_RANK


def is_initialized() -> bool:
    return _ACTIVE


def init_tensor_parallel(tp_size: int, rank: int, init_addr: str, device: torch.device) -> None:
    """Join the tp_size-rank world whose rendezvous (rank 0's TCP store) is `init_addr` (host:port). A world of one
    rank runs every collective too (the distributed code path, checked on a single GPU)."""
    global _TP_SIZE, _TP_RANK, _DEVICE_GROUP, _CPU_GROUP, _DEVICE, _ACTIVE
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=backend, init_method=f"tcp://{init_addr}", world_size=tp_size, rank=rank,
                            timeout=_COLLECTIVE_TIMEOUT)
    _DEVICE_GROUP = dist.group.WORLD
    _CPU_GROUP = dist.new_group(backend="gloo", timeout=_COLLECTIVE_TIMEOUT) if backend != "gloo" else _DEVICE_GROUP
    _TP_SIZE, _TP_RANK, _DEVICE, _ACTIVE = tp_size, rank, device, True
    # NCCL builds its communicator at the first collective: do it now, not inside a CUDA graph capture
    dist.all_reduce(torch.zeros(1, device=device), group=_DEVICE_GROUP)


def destroy_tensor_parallel() -> None:
    global _TP_SIZE, _TP_RANK, _DEVICE_GROUP, _CPU_GROUP, _DEVICE, _ACTIVE
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP_SIZE, _TP_RANK, _DEVICE_GROUP, _CPU_GROUP, _DEVICE, _ACTIVE = 1, 0, None, None, None, False


def leave_tensor_parallel() -> None:
    """After the stop step, on every rank: wait until all ranks have it, then tear the groups down, so no rank closes
    its connections while another still reads from them. A rank already gone is logged, not raised: the stop is
    what ends the run."""
    if _ACTIVE:
        try:
            dist.barrier(group=_CPU_GROUP)
        except RuntimeError as e:
            logger.warning("tensor parallel: a rank left before the stop step: %s", e)
    destroy_tensor_parallel()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the ranks, in place."""
    if _ACTIVE:
        dist.all_reduce(x, group=_DEVICE_GROUP)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """x: [..., n] per rank -> [..., tp * n], rank r's part at [r * n, (r + 1) * n)."""
    if not _ACTIVE:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x, group=_DEVICE_GROUP)
    return torch.cat(parts, dim=-1)


def broadcast_from_first(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's values of x on every rank, in place."""
    if _ACTIVE:
        dist.broadcast(x, src=0, group=_DEVICE_GROUP)
    return x


def broadcast_bytes(data: Optional[bytes]) -> bytes:
    """Rank 0 passes the bytes, the others None; every rank returns rank 0's bytes (length first, then the payload,
    both on the gloo group)."""
    if not _ACTIVE:
        assert data is not None
        return data
    length = torch.tensor([len(data) if _TP_RANK == 0 else 0], dtype=torch.int64)
    dist.broadcast(length, src=0, group=_CPU_GROUP)
    if _TP_RANK == 0:
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    else:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    if payload.numel():
        dist.broadcast(payload, src=0, group=_CPU_GROUP)
    return data if _TP_RANK == 0 else payload.numpy().tobytes()


def split_units(num_units: int, what: str) -> tuple[int, int]:
    """This rank's (first unit, unit count) of `num_units` heads/rows split over the ranks, as evenly as they go
    (SmolLM2's 3 KV groups over 2 ranks: 1 and 2). Fewer units than ranks (KV heads under GQA) are replicated:
    ranks r*n/tp .. share unit r*n // tp."""
    tp, rank = _TP_SIZE, _TP_RANK
    if num_units >= tp:
        first = rank * num_units // tp
        return first, (rank + 1) * num_units // tp - first
    if tp % num_units:
        raise ValueError(f"{what}: {num_units} cannot be replicated evenly over tp_size={tp}")
    return rank * num_units // tp, 1


def min_over_ranks(value: int) -> int:
    """The smallest of the ranks' values (pool sizes: every rank must schedule against the same KV budget)."""
    if not _ACTIVE:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_CPU_GROUP)
    return int(t.item())
