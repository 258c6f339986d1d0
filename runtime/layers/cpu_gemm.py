"""Prepacked (oneDNN) weights for CPU matmuls: `y = x @ W.T (+ b)` without re-laying-out W on every call.

On CPU, `F.linear` goes through the BLAS library, which (depending on the CPU) can be several times slower
than oneDNN with a weight already reordered into oneDNN's blocked layout, especially for the small-M
matmuls of batched decode. `PackedLinearWeight.pack(weight)` reorders once after loading; `linear(x)` then
serves any number of rows M. Everything else (CUDA, dtypes oneDNN does not pack here, a torch build without
the ops, a weight that changed after packing) falls back to `F.linear` with the dense weight.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# the M the blocked layout is chosen for; the packed weight serves any M
_PACK_BATCH_HINT = 32
# below this many rows the BLAS GEMV beats the packed oneDNN call, whose fixed cost is 10-30 us (SmolLM2 layer
# shapes on the 2-core EPYC, M = 1: 11-33 us vs 22-60 us; M = 4: oneDNN ahead, 24-151 us vs 35-236 us)
_PACKED_MIN_ROWS = 3
_PACKABLE_DTYPES = (torch.float32,)

_available: Optional[bool] = None
# ServerArgs.disable_cpu_prepack turns it off (kernel_switches.apply_kernel_switches); read when weights are packed
_prepack_switch = True


def prepack_available() -> bool:
    """Whether this torch build has oneDNN and the linear prepack ops (checked once)."""
    global _available
    if _available is None:
        ok = False
        try:
            ops = torch.ops.mkldnn
            ok = (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
                  and hasattr(ops, "_linear_pointwise"))
        except (AttributeError, RuntimeError):
            ok = False
        _available = ok
    return _available


def prepack_enabled() -> bool:
    return _prepack_switch and prepack_available()


def set_prepack_enabled(on: bool) -> bool:
    """Pack weights loaded from now on (layers packed before keep their copy); returns the previous setting."""
    global _prepack_switch
    previous, _prepack_switch = _prepack_switch, bool(on)
    return previous


class PackedLinearWeight:
    """A oneDNN-reordered copy of a dense [out, in] weight, tied to the dense tensor it was made from."""

    __slots__ = ("packed", "source", "out_features", "in_features")

    def __init__(self, packed: torch.Tensor, source: torch.Tensor):
        self.packed = packed
        self.source = source  # the dense weight; the packed copy is used only while the module still holds it
        self.out_features, self.in_features = source.shape

    @classmethod
    def pack(cls, weight: Optional[torch.Tensor]) -> Optional["PackedLinearWeight"]:
        """The packed weight, or None where packing does not apply or fails (callers then use F.linear)."""
        if (weight is None or not prepack_enabled() or weight.is_meta or weight.device.type != "cpu"
                or weight.dtype not in _PACKABLE_DTYPES or weight.dim() != 2 or weight.numel() == 0):
            return None
        try:
            with torch.inference_mode():
                dense = weight.detach()
                if not dense.is_contiguous():
                    dense = dense.contiguous()
                packed = torch.ops.mkldnn._reorder_linear_weight(dense, _PACK_BATCH_HINT)
                # check the op actually runs (and agrees) before relying on it
                probe = torch.linspace(-1.0, 1.0, 3 * dense.shape[1], dtype=dense.dtype).view(3, -1)
                got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
                want = F.linear(probe, dense)
                tol = 1e-4 * (1.0 + want.abs().max().item())
                if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4, atol=tol):
                    logger.warning("oneDNN prepacked linear disagrees with F.linear; using F.linear")
                    return None
        except (RuntimeError, TypeError, AttributeError) as e:  # op missing or unsupported in this build
            logger.debug("oneDNN linear prepack unavailable (%s); using F.linear", e)
            return None
        return cls(packed, weight)

    def usable_for(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (weight is self.source and x.device.type == "cpu" and x.dtype == weight.dtype
                and x.shape[-1] == self.in_features and not (torch.is_grad_enabled() and x.requires_grad))

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if x.numel() < _PACKED_MIN_ROWS * self.in_features:  # no rows, or a batch-1/2 decode step
            return F.linear(x, self.source, bias)
        return _onednn_linear(x, self.packed, bias)


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
           packed: Optional[PackedLinearWeight]) -> torch.Tensor:
    """F.linear(x, weight, bias), through the packed copy when there is a valid one for this input."""
    if packed is not None and packed.usable_for(x, weight):
        return packed(x, bias)
    return F.linear(x, weight, bias)
