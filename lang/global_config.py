"""`braid.global_config`: SGLang's `sglang.global_config`, holding the settings that mean something to braid's
language. SGLang also keeps runtime constants there (new-token ratios, retract steps, FlashInfer workspace,
output detokenization); in braid those are ServerArgs fields (`braid serve --help`), so setting them here is an
error rather than a silent no-op."""

from __future__ import annotations

from typing import Any

from braid.defaults import get_default_backend, set_default_backend

_SETTINGS = {
    "verbosity": int,  # 0: quiet; >= 2: print every program's final text after run()
    "enable_precache_with_tracing": bool,  # run_batch first caches the program's traced constant prefix
    "trace": bool,  # every run records a run trace (braid.run_trace; braid.collected_trace() gathers them)
}


class GlobalConfig:
    def __init__(self) -> None:
        object.__setattr__(self, "verbosity", 0)
        object.__setattr__(self, "enable_precache_with_tracing", True)
        object.__setattr__(self, "trace", False)

    @property
    def default_backend(self) -> Any:
        return get_default_backend()

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "default_backend":
            set_default_backend(value)
            return
        kind = _SETTINGS.get(name)
        if kind is None:
            raise AttributeError(f"global_config.{name} is not a braid language setting (settings: default_backend, "
                                 f"{', '.join(_SETTINGS)}); runtime settings are ServerArgs fields of the server")
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise TypeError(f"global_config.{name} must be {kind.__name__}, got {value!r}")
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        return (f"GlobalConfig(default_backend={self.default_backend!r}, verbosity={self.verbosity}, "
                f"enable_precache_with_tracing={self.enable_precache_with_tracing}, trace={self.trace})")


global_config = GlobalConfig()
