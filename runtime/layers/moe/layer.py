"""FusedMoE: the router gate and the experts of one MoE layer, the experts stacked into two tensors.

Checkpoint names (relative to the layer's `mlp`): `gate.weight` [E, H] loads as an ordinary parameter;
`experts.{e}.{gate,up,down}_proj.weight` go through `FusedMoE.weight_loader` into `w13_weight` [E + S, 2I, H] (gate
rows then up rows) and `w2_weight` [E + S, H, I]. A model wraps its checkpoint iterator in `route_expert_weights` so
those names reach the right layer before CausalLM.load_weights sees the rest.

Shared experts (DeepSeek's `mlp.shared_experts.{gate,up,down}_proj`, one gated MLP of intermediate S * I for
S = n_shared_experts) are stacked as experts E .. E + S - 1 (each I of the S * I intermediate rows) that the router
chooses for every token with weight 1 (router.py): the routed and the shared experts then run in the same launches
(SGLang's "shared experts fusion"), with no separate MLP and no add after it. The split over S experts changes
only how the intermediate sum is grouped.
"""

from __future__ import annotations

import logging
import re
from typing import Iterable, Iterator, Optional

import torch
from torch import nn

from braid.runtime.distributed import parallel_state as ps
from braid.runtime.layers.moe.experts import SUPPORTED_ACTIVATIONS, fused_experts
from braid.runtime.layers.moe.router import check_routing_supported, norm_and_route, route_hidden
from braid.runtime.loader.config_specs import MoESpec

logger = logging.getLogger(__name__)

EXPERT_WEIGHT_NAME = re.compile(r"^(?P<layer>.+)\.experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                                r"\.weight$")
SHARED_EXPERT_WEIGHT_NAME = re.compile(r"^(?P<layer>.+)\.shared_experts\.(?P<proj>gate_proj|up_proj|down_proj)"
                                       r"\.weight$")


class MoEGate(nn.Module):
    """The router's weight [E, H], kept in fp32 after loading; router.route_hidden multiplies by it."""

    def __init__(self, num_experts: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)

    def prepack_weights(self) -> None:
        if self.weight.dtype != torch.float32:
            self.weight = nn.Parameter(self.weight.float(), requires_grad=False)


class FusedMoE(nn.Module):
    """hidden [T, H] -> fp32 router (top-k routed + the spec's n_shared_experts shared slots) -> fused_experts
    -> [T, H].

    Under tensor parallelism each rank holds every expert's slice of the intermediate dim (I / tp), shared experts
    included, and the sum is all-reduced once."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, spec: MoESpec,
                 activation: str = "silu"):
        super().__init__()
        if (num_experts, top_k, intermediate_size) != (spec.n_routed_experts, spec.num_experts_per_tok,
                                                       spec.moe_intermediate_size):
            raise ValueError(f"FusedMoE({num_experts} experts, top-{top_k}, intermediate {intermediate_size}) "
                             f"disagrees with its MoESpec {spec}")
        check_routing_supported(spec)
        if activation not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"MoE activation {activation!r} is not supported; expected one of "
                             f"{SUPPORTED_ACTIVATIONS}")
        self.tp_size, self.tp_rank = ps.tp_size(), ps.tp_rank()
        if intermediate_size % self.tp_size:
            raise ValueError(f"moe_intermediate_size {intermediate_size} does not split over tp {self.tp_size}")
        self.spec = spec
        self.num_experts = num_experts
        self.num_shared = spec.n_shared_experts
        stacked = num_experts + self.num_shared
        self.hidden_size = hidden_size
        self.intermediate_per_rank = intermediate_size // self.tp_size
        self.activation = activation
        self.gate = MoEGate(num_experts, hidden_size)
        self.w13_weight = nn.Parameter(torch.empty(stacked, 2 * self.intermediate_per_rank, hidden_size),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(stacked, hidden_size, self.intermediate_per_rank),
                                      requires_grad=False)
        # which (expert, proj) slices the checkpoint filled, so that a partial checkpoint fails at post_load
        self._loaded_slices: set[tuple[int, str]] = set()

    def weight_loader(self, proj: str, expert: int, loaded: torch.Tensor, device) -> None:
        """One HF expert matrix into the stacked tensors: gate_proj / up_proj [I, H] -> w13 rows [0, I) / [I, 2I);
        down_proj [H, I] -> w2[expert]. The first call materializes both tensors on `device` in loaded's dtype.
        Experts num_experts .. num_experts + num_shared - 1 are the shared ones (shared_weight_loader)."""
        if not 0 <= expert < self.num_experts + self.num_shared:
            raise ValueError(f"checkpoint has expert {expert}; this layer has {self.num_experts}")
        if not loaded.is_floating_point() or loaded.element_size() < 2:
            raise ValueError(f"expert {expert} {proj}: {loaded.dtype} expert weights reach the stacked experts only "
                             "dequantized (dequantize_fp8_experts, for checkpoints with an fp8 quantization_config)")
        inter, rank = self.intermediate_per_rank, self.tp_rank
        for attr in ("w13_weight", "w2_weight"):
            param = getattr(self, attr)
            if param.is_meta:
                setattr(self, attr, nn.Parameter(torch.empty(param.shape, device=device, dtype=loaded.dtype),
                                                 requires_grad=False))
        # the whole matrix (narrowed here), or this rank's slice already (the sharded loader reads only that)
        if proj == "down_proj":
            expected, target = (self.hidden_size, inter * self.tp_size), self.w2_weight.data[expert]
            part = loaded.narrow(1, rank * inter, inter) if loaded.shape == expected else None
            if loaded.shape == target.shape:
                part = loaded
        elif proj in ("gate_proj", "up_proj"):
            expected = (inter * self.tp_size, self.hidden_size)
            offset = 0 if proj == "gate_proj" else inter
            target = self.w13_weight.data[expert].narrow(0, offset, inter)
            part = loaded.narrow(0, rank * inter, inter) if loaded.shape == expected else None
            if loaded.shape == target.shape:
                part = loaded
        else:
            raise ValueError(f"unknown expert projection {proj!r}")
        if part is None:
            raise ValueError(f"expert {expert} {proj}: checkpoint shape {tuple(loaded.shape)}, expected {expected}")
        target.copy_(part)
        self._loaded_slices.add((expert, proj))

    def shared_weight_loader(self, proj: str, loaded: torch.Tensor, device) -> None:
        """The shared experts' one gated MLP (gate_proj / up_proj [S * I, H], down_proj [H, S * I], whole) as S
        stacked experts: shared expert s takes intermediate units [s * I, (s + 1) * I)."""
        inter = self.intermediate_per_rank * self.tp_size
        dim = 1 if proj == "down_proj" else 0
        if self.num_shared == 0 or loaded.dim() != 2 or loaded.shape[dim] != self.num_shared * inter:
            raise ValueError(f"shared_experts.{proj}: checkpoint shape {tuple(loaded.shape)} does not hold "
                             f"{self.num_shared} shared expert(s) of intermediate size {inter}")
        for s in range(self.num_shared):
            self.weight_loader(proj, self.num_experts + s, loaded.narrow(dim, s * inter, inter), device)

    def expert_rank_range(self, proj: str, shape: list[int]) -> Optional[tuple[int, int, int]]:
        """(dim, start, stop) of this rank's slice of a checkpoint expert matrix, for the sharded loader."""
        inter, dim = self.intermediate_per_rank, 1 if proj == "down_proj" else 0
        if len(shape) != 2 or shape[dim] != inter * self.tp_size:
            return None
        return dim, self.tp_rank * inter, (self.tp_rank + 1) * inter

    def prepack_weights(self) -> None:
        """After loading: every expert's three matrices must have come (a dummy load fills none through here)."""
        stacked = self.num_experts + self.num_shared
        if self._loaded_slices and len(self._loaded_slices) != 3 * stacked:
            # (expert, proj); the shared experts are (num_experts + s, proj)
            missing = sorted({(e, p) for e in range(stacked) for p in ("gate_proj", "up_proj", "down_proj")}
                             - self._loaded_slices)
            raise ValueError(f"expert weights missing from the checkpoint: {missing[:5]}"
                             f"{' ...' if len(missing) > 5 else ''}")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [T, H] -> [T, H]; weights and ids [T, top_k + num_shared]
        topk_weights, topk_ids = route_hidden(hidden, self.gate.weight, self.spec, self.num_shared)
        return self._experts(hidden, topk_weights, topk_ids)

    def forward_after_norm(self, hidden: torch.Tensor, residual: torch.Tensor,
                           norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(normed), residual_out) for normed, residual_out = norm(hidden, residual), the pre-MoE RMSNorm with
        its residual add: at decode sizes on CUDA the norm runs inside the router's launch."""
        topk_weights, topk_ids, normed, residual = norm_and_route(hidden, residual, norm, self.gate.weight,
                                                                  self.spec, self.num_shared)
        return self._experts(normed, topk_weights, topk_ids), residual

    def _experts(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        out = fused_experts(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.activation)
        if self.tp_size > 1:
            out = ps.all_reduce(out)
        return out


FP8_EXPERT_TENSOR_NAME = re.compile(r"^(?P<weight>.+\.(?:shared_)?experts\.(?:\d+\.)?(?:gate_proj|up_proj|down_proj))"
                                    r"\.(?P<kind>weight|weight_scale|input_scale)$")


def dequantize_fp8_experts(weights: Iterable[tuple[str, torch.Tensor]],
                           dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """An FP8 checkpoint's expert matrices (e4m3 `weight` with its `weight_scale`, per tensor or per output row) as
    dense `weight`s in `dtype`, whatever order the two come in; their `input_scale`s are dropped (the experts run in
    `dtype`: braid has no fp8 expert kernels, so FP8 MoE checkpoints load at the dense size). Every other tensor
    passes unchanged."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    dropped_input_scales = 0
    for name, tensor in weights:
        match = FP8_EXPERT_TENSOR_NAME.match(name)
        if match is None or (match["kind"] == "weight" and tensor.dtype.itemsize >= 2):
            yield name, tensor
            continue
        if match["kind"] == "input_scale":
            dropped_input_scales += 1
            continue
        parts = pending.setdefault(match["weight"], {})
        parts[match["kind"]] = tensor
        if len(parts) == 2:
            del pending[match["weight"]]
            yield f"{match['weight']}.weight", _dequantized(match["weight"], parts["weight"], parts["weight_scale"], dtype)
    if pending:
        missing = sorted(f"{w}.{'weight_scale' if 'weight' in p else 'weight'}" for w, p in pending.items())
        raise ValueError(f"FP8 expert tensors without their pair in the checkpoint: {missing[:4]}"
                         f"{' ...' if len(missing) > 4 else ''}")
    if dropped_input_scales:
        logger.info("FP8 MoE experts dequantized to %s at load (%d input_scale tensors unused)",
                    str(dtype).removeprefix("torch."), dropped_input_scales)


def _dequantized(name: str, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    rows = weight.shape[0]
    if scale.numel() == 1:
        factor = scale.float().reshape(())
    elif scale.numel() == rows:
        factor = scale.float().reshape(rows, 1)
    else:
        raise ValueError(f"{name}.weight_scale of shape {tuple(scale.shape)}: braid reads one scale per tensor or per "
                         f"output row of the [{rows}, {weight.shape[-1]}] weight (block-wise scales are not supported)")
    return (weight.float() * factor.to(weight.device)).to(dtype)


def route_expert_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                         device) -> Iterator[tuple[str, torch.Tensor]]:
    """Loads `<layer>.experts.{e}.{gate,up,down}_proj.weight` and `<layer>.shared_experts.{gate,up,down}_proj.weight`
    into the FusedMoE at `<layer>` and yields every other (name, tensor) unchanged:
    `super().load_weights(route_expert_weights(self, weights, device), device)`."""
    for name, loaded in weights:
        match = EXPERT_WEIGHT_NAME.match(name)
        shared = SHARED_EXPERT_WEIGHT_NAME.match(name) if match is None else None
        if shared is not None:
            match = shared
        if match is None:
            yield name, loaded
            continue
        try:
            layer = model.get_submodule(match["layer"])
        except AttributeError:
            layer = None
        if not isinstance(layer, FusedMoE):
            raise ValueError(f"checkpoint tensor {name}: {match['layer']} is not a FusedMoE layer in "
                             f"{type(model).__name__}")
        if shared is not None:
            layer.shared_weight_loader(match["proj"], loaded, device)
        else:
            layer.weight_loader(match["proj"], int(match["expert"]), loaded, device)
