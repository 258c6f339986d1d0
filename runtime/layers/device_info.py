"""Facts about a CUDA device that kernel launches read on every call (its name, which keys the measured kernel
tables; its SM count, which sizes split-K grids), kept in plain dicts keyed by `device.index` (None: the current
device). A compiled region (--enable-torch-compile) reads a filled entry as a constant, where a call of
torch.cuda.get_device_name / get_device_properties there breaks the graph and its resumed frame recompiles on every
step; `fill` runs before compiling."""

from __future__ import annotations

import torch

_NAMES: dict = {}
_SM_COUNTS: dict = {}


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def device_name(device: torch.device) -> str:
    name = _NAMES.get(device.index)
    if name is None:
        name = _NAMES[device.index] = torch.cuda.get_device_name(_index(device))
    return name


def sm_count(device: torch.device) -> int:
    count = _SM_COUNTS.get(device.index)
    if count is None:
        count = _SM_COUNTS[device.index] = torch.cuda.get_device_properties(_index(device)).multi_processor_count
    return count


def fill(device: torch.device) -> None:
    """Fill every entry for `device` and for its explicit index (the key a tensor on it gives)."""
    for dev in {device, torch.device("cuda", _index(device))}:
        device_name(dev)
        sm_count(dev)
