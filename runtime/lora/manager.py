"""LoraManager: registered adapters in host memory, the device slots they are paged into, and each pass's selection.

Registering an adapter reads and checks its folder (adapter.py) and its weights against the linears that carry
adapter buffers; its weights then stay in host memory for as long as it is registered, however many there are.
The device holds a fixed pool of `--max-loaded-loras` slots: every linear that a servable target module lands in
(qkv_proj, o_proj, gate_up_proj, down_proj of the shared blocks) carries a `LoraLayer` as `Linear.lora`, its
buffers stacked over the slots, allocated once at start for the rank and target modules fixed then. An adapter
occupies a slot only while it is resident: `ensure_resident` copies it into a free slot, or over the least
recently used resident adapter that the caller does not pin (the scheduler pins the adapters of the requests that
hold KV), which goes back to being in host memory only. `Linear.forward` adds the delta of each row's slot when the
current pass has adapter rows."""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Collection, Optional

import torch
from torch import nn

from braid.runtime.layers.gemv import LoraEpilogue
from braid.runtime.lora.adapter import SUPPORTED_TARGETS, LoraAdapter, LoraError, load_adapter
from braid.runtime.lora.bgmv_kernels import bgmv_shrink
from braid.runtime.lora.ops import lora_expand, lora_shrink

logger = logging.getLogger(__name__)

# braid module -> the HF projections stacked in its output, in slice order
_STACKS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
           "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
# --max-lora-rank when it is unset and no --lora-paths adapter gives one (vLLM's default)
DEFAULT_MAX_LORA_RANK = 16


class LoraBatch:
    """The adapter selection of the forward pass in progress, shared by every LoraLayer. idx: [T] int64 slot per
    token (-1: base), None when no row of the batch has an adapter; groups: the host's (slot, token rows) list."""

    def __init__(self, scale: torch.Tensor):
        self.scale = scale  # [N] per-slot scaling (0 for an empty slot)
        self.idx: Optional[torch.Tensor] = None
        self.groups: Optional[list[tuple[int, torch.Tensor]]] = []  # None: the ops derive them from idx


class LoraLayer:
    """One linear's adapter weights, this tensor-parallel rank's part: A stacked over its output slices
    [N, S * R, in], B per slice [N, out_s, R] (ranks below R padded with zeros, slices an adapter does not target left
    zero). Under TP they are split as the base linear is: a column-parallel linear keeps its rows of each B slice
    (A whole), a row-parallel one its columns of A (B whole), so its partial delta joins the partial output before
    the all-reduce sums them."""

    def __init__(self, batch: LoraBatch, num_slots: int, rank: int, linear, device, dtype):
        self.batch = batch
        self.rank = rank
        output_sizes = linear.output_sizes
        # the linear's TP parts (ColumnParallelLinear / RowParallelLinear; a plain Linear is whole on every rank)
        self.full_in = getattr(linear, "full_in_features", linear.in_features)
        self.in_start = getattr(linear, "in_start", 0)
        self.full_out = list(getattr(linear, "full_output_sizes", output_sizes))
        self.out_starts = list(getattr(linear, "shard_starts", [0] * len(output_sizes)))
        self.a = torch.zeros(num_slots, len(output_sizes) * rank, linear.in_features, device=device, dtype=dtype)
        # every slice's B stacked along rows [N, sum(out_s), R] (the batch-1 GEMV's epilogue reads it whole); self.b
        # are its per-slice views [N, out_s, R]
        self.b_rows = torch.zeros(num_slots, sum(output_sizes), rank, device=device, dtype=dtype)
        self.b = list(self.b_rows.split(list(output_sizes), dim=1))
        starts = [sum(output_sizes[:i]) for i in range(1, len(output_sizes))] + [sum(output_sizes)] * 2
        self.slice_starts = (starts[0], starts[1])  # the rows where slices 1 and 2 begin (the total past the last)

    def clear_slot(self, slot: int) -> None:
        self.a[slot].zero_()
        for b in self.b:
            b[slot].zero_()

    def set_slice(self, slot: int, sub: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """a [r, full in], b [full out_s, r]: the whole checkpoint matrices; this rank's parts go into the slot."""
        r = a.shape[0]
        a = a.narrow(1, self.in_start, self.a.shape[2])
        b = b.narrow(0, self.out_starts[sub], self.b[sub].shape[1])
        self.a[slot, sub * self.rank: sub * self.rank + r] = a.to(self.a.dtype)
        self.b[sub][slot, :, :r] = b.to(self.a.dtype)

    @property
    def active(self) -> bool:
        return self.batch.idx is not None

    def gemv_epilogue(self, x: torch.Tensor) -> LoraEpilogue:
        """x: [1, in], for a batch-1 GEMV that adds the delta in its epilogue: the (per-row) shrink runs now, the
        expand inside the GEMV."""
        batch = self.batch
        return LoraEpilogue(bgmv_shrink(x, self.a, batch.idx), self.b_rows, batch.scale, batch.idx, self.slice_starts)

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # x: [T, in], y: [T, out] (the base output, updated in place)
        batch = self.batch
        if x.shape[0] != batch.idx.shape[0]:
            raise RuntimeError(f"LoRA: {x.shape[0]} rows but the batch's adapter index has {batch.idx.shape[0]}")
        h = lora_shrink(x, self.a, batch.idx, batch.groups)
        return lora_expand(y, h, self.b, batch.scale, batch.idx, batch.groups)


class LoraManager:
    def __init__(self, model: nn.Module, server_args, device, dtype):
        from braid.runtime.layers.linear import Linear

        self.allowed = server_args.lora_target_module_set
        start = [load_adapter(name, path, server_args.max_lora_rank, self.allowed)
                 for name, path in server_args.lora_adapters.items()]
        self.rank = server_args.max_lora_rank or max((a.rank for a in start), default=DEFAULT_MAX_LORA_RANK)
        # the projections that carry buffers: --lora-target-modules, else those the start adapters target, else all
        if self.allowed is not None:
            self.targets = frozenset(self.allowed)
        elif start:
            self.targets = frozenset().union(*(a.target_modules for a in start))
        else:
            self.targets = frozenset(SUPPORTED_TARGETS)
        self.num_slots = server_args.max_loaded_loras or max(server_args.max_loras_per_batch, 1)
        self.device, self.dtype = device, dtype
        self.batch = LoraBatch(torch.zeros(self.num_slots, device=device, dtype=dtype))
        fused = {SUPPORTED_TARGETS[t][0] for t in self.targets}
        self.layers: dict[str, LoraLayer] = {}  # only the linears a servable target lands in pay for the delta
        for name, mod in model.named_modules():
            suffix = name.rsplit(".", 1)[-1]
            if suffix in fused and isinstance(mod, Linear) and len(mod.output_sizes) == len(_STACKS[suffix]):
                mod.lora = self.layers[name] = LoraLayer(self.batch, self.num_slots, self.rank, mod, device, dtype)
        self.registry: dict[str, LoraAdapter] = {}  # every registered adapter, weights on the host
        self.slot_names: list[Optional[str]] = [None] * self.num_slots
        self.slots: dict[str, int] = {}  # resident adapter -> its slot
        self.lru: OrderedDict[str, None] = OrderedDict()  # resident adapters, least recently used first
        self.num_slot_loads = 0
        self.num_evictions = 0
        for adapter in start:
            self.register(adapter)
        for adapter in start[:self.num_slots]:
            self.ensure_resident(adapter.name, ())
        logger.info("LoRA: %d adapter(s) registered (%s), %d device slot(s), rank up to %d, on %d linears",
                    len(self.registry), ", ".join(self.registry) or "none", self.num_slots, self.rank,
                    len(self.layers))

    # ---- the registry (host memory) ----
    def load(self, name: str, path: str) -> LoraAdapter:
        """Read, check and register the adapter folder `path` as `name` (raises LoraError naming what is wrong)."""
        adapter = load_adapter(name, path, self.rank, self.allowed)
        self.register(adapter)
        return adapter

    def register(self, adapter: LoraAdapter) -> None:
        if adapter.name in self.registry:
            raise LoraError(f"LoRA adapter {adapter.name!r} is already loaded (from "
                            f"{self.registry[adapter.name].path}); unload it first", code="lora_exists",
                            param="lora_name")
        self._check(adapter)
        # host copies in the buffers' dtype: what a slot load copies as is
        adapter.weights = {m: (a.to(self.dtype), b.to(self.dtype)) for m, (a, b) in adapter.weights.items()}
        self.registry[adapter.name] = adapter

    def unregister(self, name: str) -> None:
        """Forget `name` and free its slot. The caller makes sure no request uses it any more."""
        self.registry.pop(name)
        if name in self.slots:
            self._vacate(name)

    def _check(self, adapter: LoraAdapter) -> None:
        """Every module of the adapter lands in a linear that carries buffers, with shapes that fit it."""
        for hf_module, (a, b) in adapter.weights.items():
            parent, proj = hf_module.rsplit(".", 1)
            if proj not in self.targets:
                raise LoraError(f"LoRA adapter {adapter.name!r} ({adapter.path}): target module {proj!r} has no "
                                f"adapter buffers on this server, which serves {sorted(self.targets)} (the "
                                "--lora-paths adapters' targets when --lora-target-modules is not given)")
            fused, sub = SUPPORTED_TARGETS[proj]
            layer = self.layers.get(f"{parent}.{fused}")
            if layer is None:
                raise LoraError(f"LoRA adapter {adapter.name!r} ({adapter.path}): the model has no {proj} at "
                                f"{hf_module} that takes an adapter")
            out_s, in_f = layer.full_out[sub], layer.full_in
            if a.shape[1] != in_f or b.shape[0] != out_s:
                raise LoraError(f"LoRA adapter {adapter.name!r} ({adapter.path}): {hf_module} lora_A "
                                f"{tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the base linear "
                                f"(in {in_f}, out {out_s})")

    # ---- the device slots ----
    def can_place(self, name: str, pinned: Collection[str]) -> bool:
        """Whether `name` is resident, or a slot is free or held by an adapter outside `pinned`."""
        return name in self.slots or self._slot_for_new(pinned) is not None

    def ensure_resident(self, name: str, pinned: Collection[str]) -> int:
        """`name`'s slot, copying it into one first when it is not resident: a free slot, else the slot of the least
        recently used resident adapter outside `pinned` (evicted: its weights stay registered on the host)."""
        slot = self.slots.get(name)
        if slot is not None:
            self.lru.move_to_end(name)
            return slot
        adapter = self.registry.get(name)
        if adapter is None:
            raise RuntimeError(f"LoRA adapter {name!r} is not registered (a scheduling bug)")
        slot = self._slot_for_new(pinned)
        if slot is None:
            raise RuntimeError(f"no LoRA slot is free for {name!r}: all {self.num_slots} hold pinned adapters (a "
                               "scheduling bug: admission checks can_place)")
        if self.slot_names[slot] is not None:
            self.num_evictions += 1
            self._vacate(self.slot_names[slot])
        self._write(slot, adapter)
        self.slot_names[slot] = name
        self.slots[name] = slot
        self.lru[name] = None
        self.num_slot_loads += 1
        return slot

    def _slot_for_new(self, pinned: Collection[str]) -> Optional[int]:
        for slot, held in enumerate(self.slot_names):
            if held is None:
                return slot
        for name in self.lru:
            if name not in pinned:
                return self.slots[name]
        return None

    def _vacate(self, name: str) -> None:
        slot = self.slots.pop(name)
        self.lru.pop(name, None)
        self.slot_names[slot] = None
        with torch.inference_mode():
            self.batch.scale[slot] = 0.0

    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        # the buffers may have been made under inference mode, where only inference mode may write them
        with torch.inference_mode():
            for layer in self.layers.values():
                layer.clear_slot(slot)
            for hf_module, (a, b) in adapter.weights.items():
                parent, proj = hf_module.rsplit(".", 1)
                fused, sub = SUPPORTED_TARGETS[proj]
                self.layers[f"{parent}.{fused}"].set_slice(slot, sub, a, b)
            self.batch.scale[slot] = adapter.scaling

    # ---- each forward pass ----
    def slot_of(self, name: Optional[str]) -> int:
        if name is None:
            return -1
        slot = self.slots.get(name)
        if slot is None:
            raise RuntimeError(f"LoRA adapter {name!r} is not resident in a device slot (a scheduling bug: admission "
                               f"loads it); resident: {sorted(self.slots)}")
        return slot

    def _token_slots(self, fb) -> list[int]:
        """fb's slot per token (-1: base), from fb.lora_paths (one adapter name or None per request); [] when no
        request of the batch names an adapter."""
        names = fb.lora_paths
        row_slots = [self.slot_of(name) for name in names] if names is not None else []
        if not any(s >= 0 for s in row_slots):
            return []
        for name in set(names):
            if name is not None:
                self.lru.move_to_end(name)
        lens = fb.extend_seq_lens_cpu if fb.extend_seq_lens_cpu is not None else [1] * fb.batch_size
        if len(lens) != len(row_slots):
            raise RuntimeError(f"LoRA: {len(row_slots)} adapter names for a batch of {len(lens)} requests")
        return [s for s, n in zip(row_slots, lens) for _ in range(n)]

    def prepare(self, fb) -> None:
        """Set the eager pass's per-token slots."""
        token_slots = self._token_slots(fb)
        if not token_slots:
            self.batch.idx, self.batch.groups = None, []
            return
        idx = torch.tensor(token_slots, dtype=torch.int64)
        device = self.batch.scale.device
        # the torch ops' per-adapter rows; the CUDA kernels read idx alone, so no row lists are copied there
        groups = None if device.type == "cuda" else [(s, torch.nonzero(idx == s).flatten())
                                                     for s in sorted(set(token_slots)) if s >= 0]
        self.batch.idx, self.batch.groups = idx.to(device), groups

    # ---- CUDA graphs: the captured pass reads its slots from a static index buffer ----
    def use_static_idx(self, idx: torch.Tensor) -> None:
        """Every LoraLayer of the pass about to run (or be captured) reads `idx` ([T] int64, a view of a graph
        runner's buffer); the delta ops run for every such pass, adapter rows or not (a decode batch on the base model
        alone replays graphs captured without them). A new view per pass, so the
        kernels' row order is computed inside each capture (sgmv_kernels.row_order keys it by the tensor)."""
        self.batch.idx, self.batch.groups = idx, None

    def load_static_idx(self, fb, idx: torch.Tensor, rows: int) -> bool:
        """Write fb's per-token slots into idx[:rows] (-1 past them and for a batch without adapters), for a
        replay that reads that buffer. -> whether any row is on an adapter."""
        token_slots = self._token_slots(fb)
        idx[len(token_slots):rows].fill_(-1)
        if token_slots:
            slots = torch.tensor(token_slots, dtype=torch.int64)
            if idx.device.type == "cuda":
                slots = slots.pin_memory()
            idx[:len(token_slots)].copy_(slots, non_blocking=True)
        return bool(token_slots)

    def clear(self) -> None:
        self.batch.idx, self.batch.groups = None, []

    def stats(self) -> dict:
        return dict(lora_registered_adapters=list(self.registry), lora_slots=list(self.slot_names),
                    lora_num_slots=self.num_slots, lora_free_slots=self.slot_names.count(None),
                    lora_slot_loads_total=self.num_slot_loads, lora_slot_evictions_total=self.num_evictions)
