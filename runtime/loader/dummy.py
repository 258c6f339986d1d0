"""load_format='dummy': random weights of the config's true shapes, materialized directly on the target device.

Floating-point weights are drawn in fp32 and then cast, so that one seed gives the same model in every dtype (fp32's
values rounded): comparisons across dtypes (bf16 against fp32, fp8 against bf16) measure rounding, not two models.
(torch's uniform_ drawn directly in bf16 differs from fp32's draws in a few values per thousand.)"""

from __future__ import annotations

import torch


@torch.no_grad()
def materialize_random(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, seed: int = 0) -> None:
    gen = torch.Generator(device=device).manual_seed(seed)
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            floating = p.is_floating_point()
            t = torch.empty(p.shape, device=device, dtype=torch.float32 if floating else p.dtype)
            if name.endswith("norm") or "norm" in type(module).__name__.lower():
                t.fill_(1.0)
            else:
                # small values keep activations finite through many layers
                t.uniform_(-0.02, 0.02, generator=gen)
            if floating and dtype != torch.float32:
                t = t.to(dtype)
            setattr(module, name, torch.nn.Parameter(t, requires_grad=False))
