"""Model providers for braid programs. Names load lazily so `import braid.backends` stays light."""

_LAZY = {
    "Backend": "braid.backends.base",
    "Prompt": "braid.backends.base",
    "GenOutput": "braid.backends.base",
    "RuntimeEndpoint": "braid.backends.runtime_endpoint",
    "Runtime": "braid.backends.runtime",
    "LocalEngine": "braid.backends.local",
    "OpenAI": "braid.backends.openai",
    "LiteLLM": "braid.backends.litellm",
    "TokenUsage": "braid.backends.base",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'braid.backends' has no attribute {name!r}")


__all__ = list(_LAZY)
