"""load_format='dummy': random weights of the config's true shapes, materialized directly on the target device."""

from __future__ import annotations

import torch


@torch.no_grad()
def materialize_random(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, seed: int = 0) -> None:
    gen = torch.Generator(device=device).manual_seed(seed)
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            t = torch.empty(p.shape, device=device, dtype=dtype if p.is_floating_point() else p.dtype)
            if name.endswith("norm") or "norm" in type(module).__name__.lower():
                t.fill_(1.0)
            else:
                # small values keep activations finite through many layers
                t.uniform_(-0.02, 0.02, generator=gen)
            setattr(module, name, torch.nn.Parameter(t, requires_grad=False))
