"""The scheduler's side of LoRA adapters: which requests an extend batch may admit, loading and unloading adapters.

Admission (`AdapterAdmission`, one per admission round): the adapters of the requests that hold KV (running,
resumed, in flight) are the round's active set, and they stay pinned in their device slots. A waiting request on
an adapter outside the set is admitted only while the set has fewer than --max-loras-per-batch adapters and a
device slot is free or holds an unpinned adapter; its adapter is then copied into a slot (runtime/lora/manager.py,
least recently used eviction). A request held back this way keeps waiting, never fails; and so that the active
adapters drain and it goes next, the round admits no adapter request that arrived after it (base-model requests
still pass: they add no adapter).

Unloading (`LoraAdapters.unload`): the adapter takes no new request from then on, the requests already queued or
running on it finish as usual, and once none is left it leaves the registry and its slot, its cached prefixes are
freed, and the caller's `done` runs (the server answers the unload then)."""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Optional

from braid.runtime.core import Req, RequestError
from braid.runtime.lora.adapter import LoraError

logger = logging.getLogger(__name__)


class AdapterAdmission:
    """One admission round's adapter bookkeeping (see the module docstring)."""

    def __init__(self, manager, max_per_batch: int, active: set[str]):
        self.manager = manager
        self.max_per_batch = max_per_batch
        self.active = active  # adapters of the requests holding KV, then of those this round admits
        self.held_since: Optional[float] = None  # arrival time of the earliest request held back this round

    def admits(self, req: Req) -> bool:
        name = req.lora_path
        if name is None:
            return True
        if self.held_since is not None and req.created_time > self.held_since:
            return False
        if name in self.active or (len(self.active) < self.max_per_batch
                                   and self.manager.can_place(name, self.active)):
            return True
        self.held_since = req.created_time if self.held_since is None else min(self.held_since, req.created_time)
        return False

    def take(self, req: Req) -> None:
        """req was admitted: its adapter joins the active set, resident in a slot."""
        name = req.lora_path
        if name is not None:
            self.manager.ensure_resident(name, self.active)
            self.active.add(name)


class LoraAdapters:
    def __init__(self, manager, server_args, prefix_cache):
        self.manager = manager
        self.max_per_batch = server_args.max_loras_per_batch
        self.prefix_cache = prefix_cache
        self.unloading: dict[str, list[Callable[[], None]]] = {}  # adapter -> callbacks once it is gone

    def check_request(self, req: Req) -> None:
        """A request may name only a registered adapter that is not being unloaded (RequestError, param lora_path)."""
        name = req.lora_path
        if name is None:
            return
        if name in self.unloading:
            raise RequestError(f"LoRA adapter {name!r} is being unloaded and takes no new requests", param="lora_path")
        if name not in self.manager.registry:
            raise RequestError(f"unknown LoRA adapter {name!r}; adapters served: {self.names_text()}",
                               param="lora_path")

    def names_text(self) -> str:
        names = [n for n in self.manager.registry if n not in self.unloading]
        return ", ".join(names) if names else "none"

    def admission(self, holding_kv: Iterable[Req]) -> AdapterAdmission:
        active = {r.lora_path for r in holding_kv if r.lora_path is not None}
        return AdapterAdmission(self.manager, self.max_per_batch, active)

    def load(self, name: str, path: str) -> None:
        if not isinstance(name, str) or not name or ":" in name:
            raise LoraError(f"lora_name {name!r} must be a non-empty name without ':' (OpenAI 'model' names "
                            "adapters as 'base:name')", param="lora_name")
        if not isinstance(path, str) or not path:
            raise LoraError("lora_path must be the adapter's folder", param="lora_path")
        if name in self.unloading:
            raise LoraError(f"LoRA adapter {name!r} is being unloaded; load it again once the unload has answered",
                            code="lora_unloading", param="lora_name")
        adapter = self.manager.load(name, path)
        logger.info("LoRA adapter %r loaded from %s (rank %d, %s)", name, path, adapter.rank,
                    ", ".join(sorted(adapter.target_modules)))

    def unload(self, name: str, done: Callable[[], None], in_use: set[str]) -> None:
        """Start unloading `name`; `done` runs once it is gone (at once when no request uses it)."""
        if name not in self.manager.registry:
            raise LoraError(f"unknown LoRA adapter {name!r}; adapters served: {self.names_text()}",
                            code="lora_not_found", param="lora_name")
        if name in self.unloading:
            raise LoraError(f"LoRA adapter {name!r} is already being unloaded", code="lora_unloading",
                            param="lora_name")
        self.unloading[name] = [done]
        self.settle(in_use)

    def settle(self, in_use: set[str]) -> None:
        """Finish the unloads whose adapter no queued or running request uses any more."""
        for name in [n for n in self.unloading if n not in in_use]:
            self.manager.unregister(name)
            freed = self.prefix_cache.drop_namespace(name)
            logger.info("LoRA adapter %r unloaded (%d cached tokens freed)", name, freed)
            for done in self.unloading.pop(name):
                done()

    def stats(self) -> dict:
        return {**self.manager.stats(), "lora_unloading_adapters": list(self.unloading)}
