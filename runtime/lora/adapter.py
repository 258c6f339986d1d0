"""A PEFT LoRA adapter folder read into per-module (A, B) pairs: adapter_config.json + adapter_model.safetensors.

What braid applies is PEFT's plain LoRA: y = W x + scale * B (A x), scale = lora_alpha / r (lora_alpha / sqrt(r)
with use_rslora), on the decoder's q/k/v/o and gate/up/down projections. Everything else an adapter can hold
(DoRA, biases, fan_in_fan_out weights, per-module rank or alpha patterns, extra trained modules, pickled weights)
is refused with what is wrong, since applying it partly would serve wrong outputs."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

# HF projection name -> (braid module holding it, output slice). braid fuses q/k/v into qkv_proj and gate/up into
# gate_up_proj (runtime/models/blocks.py), so those adapters write into slices of the stacked output.
SUPPORTED_TARGETS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                     "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                     "down_proj": ("down_proj", 0)}

_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<which>lora_A|lora_B)(?:\.[^.]+)?\.weight$")


class LoraError(ValueError):
    """A refused adapter operation, naming what is wrong. code: lora_invalid (the folder: its files, config, shapes,
    rank or target modules), lora_not_found, lora_exists, lora_unloading, lora_disabled; param: the field of a
    load / unload body at fault (lora_path or lora_name)."""

    def __init__(self, message: str, code: str = "lora_invalid", param: str = "lora_path"):
        super().__init__(message)
        self.code = code
        self.param = param


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    target_modules: frozenset[str]  # HF projection names (q_proj, ...)
    # HF module name ("model.layers.0.self_attn.q_proj") -> (A [r, in], B [out, r]), fp32 on the host
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def _refuse(name: str, path: str, what: str) -> LoraError:
    return LoraError(f"LoRA adapter {name!r} ({path}): {what}")


def read_adapter_config(name: str, path: str) -> dict:
    if not os.path.isdir(path):
        raise _refuse(name, path, "no such folder (expected a PEFT adapter folder)")
    cfg_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_file):
        raise _refuse(name, path, "no adapter_config.json (expected a PEFT adapter folder)")
    try:
        with open(cfg_file) as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        raise _refuse(name, path, f"adapter_config.json is not JSON: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise _refuse(name, path, f"adapter_config.json cannot be read: {e}") from None
    if not isinstance(cfg, dict):
        raise _refuse(name, path, "adapter_config.json is not a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise _refuse(name, path, f"peft_type {peft_type!r} is not supported (LORA only)")
    if cfg.get("use_dora"):
        raise _refuse(name, path, "use_dora: DoRA adapters are not supported")
    if cfg.get("fan_in_fan_out"):
        raise _refuse(name, path, "fan_in_fan_out: adapters with transposed (Conv1D) weights are not supported")
    if cfg.get("bias", "none") != "none":
        raise _refuse(name, path, f"bias {cfg.get('bias')!r}: adapters that train biases are not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise _refuse(name, path, f"{key}: per-module ranks or alphas are not supported")
    if cfg.get("modules_to_save"):
        raise _refuse(name, path, f"modules_to_save {cfg['modules_to_save']}: fully trained modules are not "
                                  "supported")
    # PEFT variants that change what the adapter computes beyond B (A x)
    for key in ("lora_bias", "layer_replication", "target_parameters", "trainable_token_indices",
                "alora_invocation_tokens", "use_qalora", "use_bdlora"):
        if cfg.get(key):
            raise _refuse(name, path, f"{key} is set: this LoRA variant is not supported")
    if cfg.get("layers_to_transform") is not None:
        raise _refuse(name, path, "layers_to_transform: adapters on a subset of layers are not supported")
    r = cfg.get("r")
    if not isinstance(r, int) or r < 1:
        raise _refuse(name, path, f"r must be a positive integer, got {r!r}")
    return cfg


def load_adapter(name: str, path: str, max_rank: int | None = None,
                 allowed_targets: frozenset[str] | None = None) -> LoraAdapter:
    """Read and check one adapter folder. max_rank / allowed_targets: --max-lora-rank / --lora-target-modules."""
    from safetensors.torch import load_file

    cfg = read_adapter_config(name, path)
    rank = cfg["r"]
    if max_rank is not None and rank > max_rank:
        raise _refuse(name, path, f"rank {rank} exceeds --max-lora-rank {max_rank}")
    listed = cfg.get("target_modules")
    if isinstance(listed, list):  # a regex string is checked below, module by module
        if not all(isinstance(t, str) for t in listed):
            raise _refuse(name, path, f"target_modules must be module names, got {listed!r}")
        for target in sorted(set(listed)):
            if target not in SUPPORTED_TARGETS:
                raise _refuse(name, path, f"target module {target!r} is not supported; braid applies LoRA to "
                                          f"{', '.join(SUPPORTED_TARGETS)}")
    alpha = cfg.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise _refuse(name, path, f"lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    st_file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(st_file):
        if os.path.isfile(os.path.join(path, "adapter_model.bin")):
            raise _refuse(name, path, "adapter_model.bin is a pickle, which braid does not load; save the adapter "
                                      "with safe_serialization=True (adapter_model.safetensors)")
        raise _refuse(name, path, "no adapter_model.safetensors")
    try:
        tensors = load_file(st_file)
    except Exception as e:  # safetensors' own error type for a truncated or corrupt file, OSError for the rest
        raise _refuse(name, path, f"adapter_model.safetensors cannot be read: {e}") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise _refuse(name, path, f"tensor {key!r} is not a LoRA A/B weight (e.g. a DoRA magnitude or a bias)")
        pairs.setdefault(m["module"], {})[m["which"]] = t
    weights, targets = {}, set()
    for module, ab in pairs.items():
        target = module.rsplit(".", 1)[-1]
        if target not in SUPPORTED_TARGETS:
            raise _refuse(name, path, f"target module {target!r} ({module}) is not supported; braid applies LoRA "
                                      f"to {', '.join(SUPPORTED_TARGETS)}")
        if allowed_targets is not None and target not in allowed_targets:
            raise _refuse(name, path, f"target module {target!r} is not in --lora-target-modules "
                                      f"{sorted(allowed_targets)}")
        if set(ab) != {"lora_A", "lora_B"}:
            raise _refuse(name, path, f"{module} has {sorted(ab)}, expected lora_A and lora_B")
        a, b = ab["lora_A"], ab["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise _refuse(name, path, f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not "
                                      f"have rank r={rank} (expected [r, in] and [out, r])")
        weights[module] = (a.float(), b.float())
        targets.add(target)
    if not weights:
        raise _refuse(name, path, "adapter_model.safetensors holds no LoRA weights")
    return LoraAdapter(name=name, path=path, rank=rank, scaling=scaling, target_modules=frozenset(targets),
                       weights=weights)
