"""HF-format folders: config.json + *.safetensors (sharded or not)."""

from __future__ import annotations

import glob
import json
import os
from typing import Iterator

import torch


def hf_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{folder} has no config.json")
    with open(path) as f:
        return json.load(f)


def iter_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors files")
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
