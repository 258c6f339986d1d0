"""The one map from dtype names (ServerArgs `dtype`, `kv_cache_dtype`, config.json `torch_dtype`) to torch dtypes."""

from __future__ import annotations

from typing import Union

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e5m2": torch.float8_e5m2,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e4m3fn": torch.float8_e4m3fn,
}
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8_DTYPES = (torch.float8_e5m2, torch.float8_e4m3fn)


def dtype_from_name(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[name]


def model_dtype(name: str, device_type: str) -> torch.dtype:
    """The dtype of weights and activations: "auto" is bf16 on GPU and fp32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device_type.startswith("cuda") else torch.float32
    dtype = dtype_from_name(name)
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype {name!r} cannot hold weights and activations; expected auto, float32, bfloat16 or float16")
    return dtype


def kv_cache_dtype(name: Union[str, torch.dtype, None], model_dtype: torch.dtype) -> torch.dtype:
    """The dtype KV values are kept in: the model's for None/"auto", else the named one (fp8 included)."""
    if name is None or name == "auto":
        return model_dtype
    dtype = name if isinstance(name, torch.dtype) else dtype_from_name(name)
    if dtype not in COMPUTE_DTYPES and dtype not in FP8_DTYPES:
        raise ValueError(f"unsupported kv_cache_dtype {dtype}; expected auto, a float dtype or an fp8 dtype")
    return dtype
