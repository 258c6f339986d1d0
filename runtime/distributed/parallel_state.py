"""Tensor-parallel state over torch.distributed (NCCL on GPU, gloo on CPU). Single process: size 1, no-ops."""

from __future__ import annotations

import torch
import torch.distributed as dist

_TP_SIZE = 1
_TP_RANK = 0


def init_tensor_parallel(tp_size: int, tp_rank: int, init_method: str, backend: str) -> None:
    global _TP_SIZE, _TP_RANK
    _TP_SIZE, _TP_RANK = tp_size, tp_rank
    if tp_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method=init_method, world_size=tp_size, rank=tp_rank)


def tp_size() -> int:
    return _TP_SIZE


def tp_rank() -> int:
    return _TP_RANK


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP_SIZE > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
