"""LoraManager: the adapters of --lora-paths resident in stacked per-layer buffers, and the per-batch selection.

Each linear an adapter targets (qkv_proj, o_proj, gate_up_proj, down_proj of the shared blocks) gets a `LoraLayer` as
`Linear.lora`; `Linear.forward` adds its delta when the current batch has adapter rows. Slots are fixed at start:
adapter i of --lora-paths is slot i, for the whole run (no paging yet, so all of them must fit one batch)."""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from braid.runtime.lora.adapter import SUPPORTED_TARGETS, LoraAdapter, load_adapter
from braid.runtime.lora.ops import lora_expand, lora_shrink

logger = logging.getLogger(__name__)

# braid module -> the HF projections stacked in its output, in slice order
_STACKS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
           "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class LoraBatch:
    """The adapter selection of the forward pass in progress, shared by every LoraLayer. idx: [T] int64 slot per
    token (-1: base), None when no row of the batch has an adapter; groups: the host's (slot, token rows) list."""

    def __init__(self, scale: torch.Tensor):
        self.scale = scale  # [N] per-slot scaling
        self.idx: Optional[torch.Tensor] = None
        self.groups: list[tuple[int, torch.Tensor]] = []


class LoraLayer:
    """One linear's adapter weights: A stacked over its output slices [N, S * R, in], B per slice [N, out_s, R]
    (ranks below R padded with zeros, slices an adapter does not target left zero)."""

    def __init__(self, batch: LoraBatch, num_slots: int, rank: int, in_features: int, output_sizes: list[int],
                 device, dtype):
        self.batch = batch
        self.rank = rank
        self.a = torch.zeros(num_slots, len(output_sizes) * rank, in_features, device=device, dtype=dtype)
        self.b = [torch.zeros(num_slots, out, rank, device=device, dtype=dtype) for out in output_sizes]

    def set_slice(self, slot: int, sub: int, a: torch.Tensor, b: torch.Tensor) -> None:
        r = a.shape[0]
        self.a[slot, sub * self.rank: sub * self.rank + r] = a.to(self.a.dtype)
        self.b[sub][slot, :, :r] = b.to(self.a.dtype)

    @property
    def active(self) -> bool:
        return self.batch.idx is not None

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # x: [T, in], y: [T, out] (the base output, updated in place)
        batch = self.batch
        if x.shape[0] != batch.idx.shape[0]:
            raise RuntimeError(f"LoRA: {x.shape[0]} rows but the batch's adapter index has {batch.idx.shape[0]}")
        h = lora_shrink(x, self.a, batch.idx, batch.groups)
        return lora_expand(y, h, self.b, batch.scale, batch.idx, batch.groups)


class LoraManager:
    def __init__(self, model: nn.Module, server_args, device, dtype):
        paths = server_args.lora_adapters
        allowed = server_args.lora_target_module_set
        self.adapters: list[LoraAdapter] = [load_adapter(name, path, server_args.max_lora_rank, allowed)
                                            for name, path in paths.items()]
        self.slots = {a.name: i for i, a in enumerate(self.adapters)}
        self.rank = server_args.max_lora_rank or max((a.rank for a in self.adapters), default=1)
        self.num_slots = max(len(self.adapters), 1)
        self.device, self.dtype = device, dtype
        self.batch = LoraBatch(torch.tensor([a.scaling for a in self.adapters] or [0.0], device=device, dtype=dtype))
        self.modules = dict(model.named_modules())
        self.layers: dict[str, LoraLayer] = {}  # only the linears some adapter targets pay for the delta
        for slot, adapter in enumerate(self.adapters):
            self._place(slot, adapter)
        logger.info("LoRA: %d adapter(s) (%s), rank up to %d, on %d linears", len(self.adapters),
                    ", ".join(self.slots) or "none", self.rank, len(self.layers))

    def _layer(self, name: str) -> Optional[LoraLayer]:
        """The LoraLayer of braid module `name`, attached on first use; None where no linear of that shape is."""
        from braid.runtime.layers.linear import Linear

        if name in self.layers:
            return self.layers[name]
        mod = self.modules.get(name)
        stack = _STACKS[name.rsplit(".", 1)[-1]]
        if not isinstance(mod, Linear) or len(mod.output_sizes) != len(stack):
            return None
        mod.lora = self.layers[name] = LoraLayer(self.batch, self.num_slots, self.rank, mod.in_features,
                                                 mod.output_sizes, self.device, self.dtype)
        return mod.lora

    def _place(self, slot: int, adapter: LoraAdapter) -> None:
        for hf_module, (a, b) in adapter.weights.items():
            parent, proj = hf_module.rsplit(".", 1)
            fused, sub = SUPPORTED_TARGETS[proj]
            layer = self._layer(f"{parent}.{fused}")
            if layer is None:
                raise ValueError(f"LoRA adapter {adapter.name!r} ({adapter.path}): the model has no {proj} at "
                                 f"{hf_module} that takes an adapter")
            out_s, in_f = layer.b[sub].shape[1], layer.a.shape[2]
            if a.shape[1] != in_f or b.shape[0] != out_s:
                raise ValueError(f"LoRA adapter {adapter.name!r} ({adapter.path}): {hf_module} lora_A "
                                 f"{tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the base linear "
                                 f"(in {in_f}, out {out_s})")
            layer.set_slice(slot, sub, a, b)

    def slot_of(self, name: Optional[str]) -> int:
        if name is None:
            return -1
        slot = self.slots.get(name)
        if slot is None:
            raise ValueError(f"unknown LoRA adapter {name!r}; loaded: {sorted(self.slots)}")
        return slot

    def prepare(self, fb) -> None:
        """Set the batch's per-token slots from fb.lora_paths (one adapter name or None per request)."""
        names = fb.lora_paths
        row_slots = [self.slot_of(name) for name in names] if names is not None else []
        if not any(s >= 0 for s in row_slots):
            self.batch.idx, self.batch.groups = None, []
            return
        lens = fb.extend_seq_lens_cpu if fb.extend_seq_lens_cpu is not None else [1] * fb.batch_size
        if len(lens) != len(row_slots):
            raise RuntimeError(f"LoRA: {len(row_slots)} adapter names for a batch of {len(lens)} requests")
        token_slots = [s for s, n in zip(row_slots, lens) for _ in range(n)]
        idx = torch.tensor(token_slots, dtype=torch.int64)
        groups = [(s, torch.nonzero(idx == s).flatten().to(self.batch.scale.device)) for s in sorted(set(row_slots))
                  if s >= 0]
        self.batch.idx, self.batch.groups = idx.to(self.batch.scale.device), groups

    def clear(self) -> None:
        self.batch.idx, self.batch.groups = None, []
