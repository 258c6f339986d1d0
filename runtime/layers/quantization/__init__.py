"""How linear layers store and multiply their weights, chosen per layer when the model is built.

`get_linear_method(None)` is the dense method; quantized methods register here under the name a checkpoint's
`quantization_config.quant_method` gives (fp8 is the next one; a `--quantization` flag comes with it). Until then a
quantized checkpoint is refused at load.
"""

from __future__ import annotations

from typing import Optional

from braid.runtime.layers.quantization.base import LinearMethod
from braid.runtime.layers.quantization.dense import DenseLinearMethod

__all__ = ["LinearMethod", "DenseLinearMethod", "LINEAR_METHODS", "get_linear_method"]

LINEAR_METHODS: dict[str, type[LinearMethod]] = {DenseLinearMethod.name: DenseLinearMethod}


def get_linear_method(quantization: Optional[str] = None) -> LinearMethod:
    """The method for a quantization name (None: dense weights)."""
    name = quantization or DenseLinearMethod.name
    if name not in LINEAR_METHODS:
        raise ValueError(f"quantization {name!r} is not supported; available: {', '.join(sorted(LINEAR_METHODS))}")
    return LINEAR_METHODS[name]()
