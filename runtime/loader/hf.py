"""HF-format folders: config.json + *.safetensors (sharded or not)."""

from __future__ import annotations

import glob
import json
import os
import struct
from typing import Iterator

import torch


def hf_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{folder} has no config.json")
    with open(path) as f:
        return json.load(f)


def hf_generation_config(folder: str) -> dict:
    """generation_config.json's contents, or {} when the folder has none."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _safetensors_files(folder: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors files")
    return files


def safetensors_tensor_count(folder: str) -> int:
    """How many tensors the folder's *.safetensors files hold, from their JSON headers (no tensor is read)."""
    count = 0
    for file in _safetensors_files(folder):
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        count += sum(1 for name in header if name != "__metadata__")
    return count


def iter_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in _safetensors_files(folder):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def iter_safetensors_rank_slices(folder: str, rank_range) -> Iterator[tuple[str, torch.Tensor]]:
    """Like iter_safetensors, but under tensor parallelism: `rank_range(name, shape)` gives (dim, start, stop) of
    this rank's part of a tensor (None: the whole tensor), and only that part is read from the file."""
    from safetensors import safe_open

    for file in _safetensors_files(folder):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                part = f.get_slice(name)
                found = rank_range(name, list(part.get_shape()))
                if found is None:
                    yield name, f.get_tensor(name)
                    continue
                dim, start, stop = found
                yield name, part[(slice(None),) * dim + (slice(start, stop),)]
