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

FP8 (`--quantization fp8`, or an FP8 checkpoint): the stacked experts are e4m3 with fp32 row scales `w13_scale`
[E + S, 2I] / `w2_scale` [E + S, H] (the expert kernels stream e4m3 and scale in-kernel, activations stay in the model
dtype); a checkpoint's e4m3 `weight` and its `weight_scale` (per tensor or per row) load as they are, dense weights
are quantized per row as they load.
"""

from __future__ import annotations

import logging
import re
from typing import Iterable, Iterator, Optional

import torch
from torch import nn

from braid.runtime.distributed import parallel_state as ps
from braid.runtime.layers.moe.expert_inputs import SUPPORTED_ACTIVATIONS
from braid.runtime.layers.moe.experts import fused_experts
from braid.runtime.layers.moe.router import check_routing_supported, norm_and_route, route_hidden
from braid.runtime.layers.quantization.fp8_quantize import FP8_DTYPE, quantize_weight_per_channel
from braid.runtime.loader.config_specs import MoESpec

logger = logging.getLogger(__name__)

EXPERT_WEIGHT_NAME = re.compile(r"^(?P<layer>.+)\.experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                                r"\.(?P<kind>weight|weight_scale|input_scale)$")
SHARED_EXPERT_WEIGHT_NAME = re.compile(r"^(?P<layer>.+)\.shared_experts\.(?P<proj>gate_proj|up_proj|down_proj)"
                                       r"\.(?P<kind>weight|weight_scale|input_scale)$")


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
        self.fp8 = False  # use_fp8(): e4m3 experts with the row scales below
        self.w13_scale: Optional[torch.Tensor] = None  # [E + S, 2I] fp32
        self.w2_scale: Optional[torch.Tensor] = None  # [E + S, H] fp32

    def use_fp8(self) -> None:
        """Store the experts in e4m3 with per-row scales (before loading; the fp8 linear method's counterpart)."""
        self.fp8 = True

    def weight_loader(self, proj: str, expert: int, loaded: torch.Tensor, device,
                      scale: Optional[torch.Tensor] = None) -> None:
        """One HF expert matrix into the stacked tensors: gate_proj / up_proj [I, H] -> w13 rows [0, I) / [I, 2I);
        down_proj [H, I] -> w2[expert]. The first call materializes both tensors on `device` (in loaded's dtype, or
        e4m3 with their scales under use_fp8). An e4m3 matrix comes with its checkpoint `scale` (one value or one per
        row); a dense one is quantized per row under use_fp8. Experts num_experts .. num_experts + num_shared - 1 are
        the shared ones (shared_weight_loader)."""
        if not 0 <= expert < self.num_experts + self.num_shared:
            raise ValueError(f"checkpoint has expert {expert}; this layer has {self.num_experts}")
        is_fp8 = loaded.is_floating_point() and loaded.element_size() == 1
        if not loaded.is_floating_point() or (is_fp8 and not self.fp8) or (is_fp8 and scale is None):
            raise ValueError(f"expert {expert} {proj}: {loaded.dtype} weights need an fp8 layer and their "
                             "weight_scale (a checkpoint with an fp8 quantization_config)")
        inter, rank = self.intermediate_per_rank, self.tp_rank
        for attr in ("w13_weight", "w2_weight"):
            param = getattr(self, attr)
            if param.is_meta:
                dtype = FP8_DTYPE if self.fp8 else loaded.dtype
                setattr(self, attr, nn.Parameter(torch.empty(param.shape, device=device, dtype=dtype),
                                                 requires_grad=False))
        if self.fp8 and self.w13_scale is None:
            self.w13_scale = torch.zeros(self.w13_weight.shape[:2], dtype=torch.float32, device=device)
            self.w2_scale = torch.zeros(self.w2_weight.shape[:2], dtype=torch.float32, device=device)
        row_scales = None
        if is_fp8:  # per tensor or per row of the checkpoint's whole matrix
            row_scales = scale.float().reshape(-1).to(device)
            if row_scales.numel() not in (1, loaded.shape[0]):
                raise ValueError(f"expert {expert} {proj}: weight_scale of shape {tuple(scale.shape)} for a "
                                 f"{tuple(loaded.shape)} weight (per tensor or per output row only)")
            row_scales = row_scales.expand(loaded.shape[0])
        # the whole matrix (narrowed here), or this rank's slice already (the sharded loader reads only that)
        part_scales = row_scales
        if proj == "down_proj":
            expected, target = (self.hidden_size, inter * self.tp_size), self.w2_weight.data[expert]
            target_scales = self.w2_scale[expert] if self.fp8 else None
            part = loaded.narrow(1, rank * inter, inter) if loaded.shape == expected else None
            if loaded.shape == target.shape:
                part = loaded
        elif proj in ("gate_proj", "up_proj"):
            expected = (inter * self.tp_size, self.hidden_size)
            offset = 0 if proj == "gate_proj" else inter
            target = self.w13_weight.data[expert].narrow(0, offset, inter)
            target_scales = self.w13_scale[expert].narrow(0, offset, inter) if self.fp8 else None
            part = loaded.narrow(0, rank * inter, inter) if loaded.shape == expected else None
            if part is not None and row_scales is not None:
                part_scales = row_scales.narrow(0, rank * inter, inter)
            if loaded.shape == target.shape:
                part, part_scales = loaded, row_scales
        else:
            raise ValueError(f"unknown expert projection {proj!r}")
        if part is None:
            raise ValueError(f"expert {expert} {proj}: checkpoint shape {tuple(loaded.shape)}, expected {expected}")
        if self.fp8 and not is_fp8:
            part, part_scales = quantize_weight_per_channel(part.to(device))
        target.copy_(part)
        if target_scales is not None:
            target_scales.copy_(part_scales)
        self._loaded_slices.add((expert, proj))

    def shared_weight_loader(self, proj: str, loaded: torch.Tensor, device,
                             scale: Optional[torch.Tensor] = None) -> None:
        """The shared experts' one gated MLP (gate_proj / up_proj [S * I, H], down_proj [H, S * I], whole) as S
        stacked experts: shared expert s takes intermediate units [s * I, (s + 1) * I) (and their row scales)."""
        inter = self.intermediate_per_rank * self.tp_size
        dim = 1 if proj == "down_proj" else 0
        if self.num_shared == 0 or loaded.dim() != 2 or loaded.shape[dim] != self.num_shared * inter:
            raise ValueError(f"shared_experts.{proj}: checkpoint shape {tuple(loaded.shape)} does not hold "
                             f"{self.num_shared} shared expert(s) of intermediate size {inter}")
        # gate / up row scales split with their rows; a per-tensor scale, or down_proj's (rows of H), go whole
        split_scale = scale is not None and dim == 0 and scale.numel() == loaded.shape[0]
        for s in range(self.num_shared):
            part_scale = scale.reshape(-1).narrow(0, s * inter, inter) if split_scale else scale
            self.weight_loader(proj, self.num_experts + s, loaded.narrow(dim, s * inter, inter), device, part_scale)

    def expert_rank_range(self, proj: str, shape: list[int]) -> Optional[tuple[int, int, int]]:
        """(dim, start, stop) of this rank's slice of a checkpoint expert matrix, for the sharded loader."""
        inter, dim = self.intermediate_per_rank, 1 if proj == "down_proj" else 0
        if len(shape) != 2 or shape[dim] != inter * self.tp_size:
            return None
        return dim, self.tp_rank * inter, (self.tp_rank + 1) * inter

    def prepack_weights(self) -> None:
        """After loading: every expert's three matrices must have come (a dummy load fills none through here); under
        use_fp8, dense stacked experts (a dummy load's) are quantized per row."""
        if self.fp8 and self.w13_weight.dtype != FP8_DTYPE and not self.w13_weight.is_meta:
            for attr in ("w13", "w2"):
                dense = getattr(self, f"{attr}_weight")
                q, scale = quantize_weight_per_channel(dense.reshape(-1, dense.shape[-1]))
                setattr(self, f"{attr}_weight", nn.Parameter(q.view(dense.shape), requires_grad=False))
                setattr(self, f"{attr}_scale", scale.view(dense.shape[:2]).contiguous())
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
        out = fused_experts(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.activation,
                            w13_scale=self.w13_scale, w2_scale=self.w2_scale)
        if self.tp_size > 1:
            out = ps.all_reduce(out)
        return out


def route_expert_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                         device) -> Iterator[tuple[str, torch.Tensor]]:
    """Loads `<layer>.experts.{e}.{gate,up,down}_proj.weight` and `<layer>.shared_experts.{gate,up,down}_proj.weight`
    into the FusedMoE at `<layer>` and yields every other (name, tensor) unchanged:
    `super().load_weights(route_expert_weights(self, weights, device), device)`. An FP8 checkpoint's e4m3 `weight`
    loads with its `weight_scale`, in whichever order the two come; `input_scale`s are not used (the experts take
    activations in the model dtype)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    unused_input_scales = 0
    for name, loaded in weights:
        match = EXPERT_WEIGHT_NAME.match(name)
        shared = SHARED_EXPERT_WEIGHT_NAME.match(name) if match is None else None
        if shared is not None:
            match = shared
        if match is None:
            yield name, loaded
            continue
        if match["kind"] == "input_scale":
            unused_input_scales += 1
            continue
        scale = None
        if match["kind"] == "weight_scale" or loaded.element_size() == 1:
            stem = name.rsplit(".", 1)[0]
            parts = pending.setdefault(stem, {})
            parts[match["kind"]] = loaded
            if len(parts) < 2:
                continue
            del pending[stem]
            loaded, scale = parts["weight"], parts["weight_scale"]
        try:
            layer = model.get_submodule(match["layer"])
        except AttributeError:
            layer = None
        if not isinstance(layer, FusedMoE):
            raise ValueError(f"checkpoint tensor {name}: {match['layer']} is not a FusedMoE layer in "
                             f"{type(model).__name__}")
        if shared is not None:
            layer.shared_weight_loader(match["proj"], loaded, device, scale)
        else:
            layer.weight_loader(match["proj"], int(match["expert"]), loaded, device, scale)
    if pending:
        missing = sorted(f"{stem}.{'weight_scale' if 'weight' in parts else 'weight'}"
                         for stem, parts in pending.items())
        raise ValueError(f"FP8 expert tensors without their pair in the checkpoint: {missing[:4]}"
                         f"{' ...' if len(missing) > 4 else ''}")
    if unused_input_scales:
        logger.info("FP8 MoE experts: %d input_scale tensors unused (activations stay in the model dtype)",
                    unused_input_scales)
