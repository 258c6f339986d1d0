"""How linear layers store and multiply their weights, chosen per layer when the model is built.

`get_linear_method(None)` is the dense method; quantized methods register here under the name a checkpoint's
`quantization_config.quant_method` gives (compressed-tensors' float-quantized format is read as "fp8") and that
`--quantization` takes. A checkpoint quantized any other way is refused at load.
"""

from __future__ import annotations

from typing import Optional

from braid.runtime.layers.quantization.base import LinearMethod
from braid.runtime.layers.quantization.dense import DenseLinearMethod
from braid.runtime.layers.quantization.fp8 import Fp8LinearMethod

__all__ = ["LinearMethod", "DenseLinearMethod", "Fp8LinearMethod", "LINEAR_METHODS", "get_linear_method"]

LINEAR_METHODS: dict[str, type[LinearMethod]] = {DenseLinearMethod.name: DenseLinearMethod,
                                                 Fp8LinearMethod.name: Fp8LinearMethod}


def get_linear_method(quantization: Optional[str] = None) -> LinearMethod:
    """The method for a quantization name (None: dense weights)."""
    name = quantization or DenseLinearMethod.name
    if name not in LINEAR_METHODS:
        raise ValueError(f"quantization {name!r} is not supported; available: {', '.join(sorted(LINEAR_METHODS))}")
    return LINEAR_METHODS[name]()
