"""Attention backends by name, imported lazily so that optional kernels cost nothing until chosen."""

from __future__ import annotations

import importlib

_BACKENDS = {
    "torch": ("braid.runtime.layers.attention.torch_backend", "TorchAttnBackend"),
    "triton": ("braid.runtime.layers.attention.triton_backend", "TritonAttnBackend"),
    "flashinfer": ("braid.runtime.layers.attention.flashinfer_backend", "FlashInferAttnBackend"),
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_backend_class(name: str):
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend '{name}'; choose from {', '.join(available_backends())}")
    module, cls = _BACKENDS[name]
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise ValueError(f"attention backend '{name}' is not available here: {e}") from e


_CUDA_ONLY = {"triton": "Triton kernels", "flashinfer": "FlashInfer kernels"}


def check_backend_device(name: str, device: str) -> None:
    """Refuse at start a backend whose kernels cannot run on `device` (otherwise the first request fails)."""
    if name in _CUDA_ONLY and not device.startswith("cuda"):
        raise ValueError(f"--attention-backend {name} needs a CUDA GPU ({_CUDA_ONLY[name]}); this server runs on "
                         f"{device}: use --attention-backend torch, or leave it unset")


def default_backend(device: str) -> str:
    return "triton" if device.startswith("cuda") else "torch"
