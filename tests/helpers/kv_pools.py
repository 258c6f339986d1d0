"""KV pools on their fallback route (rotary, then indexed copies), the reference the pools' Triton routes are tested
against on the same device.

A pool picks its route once, when built, from `pools._triton_kernels_run_on(device)`; tests that run the kernels on
CPU tensors under the interpreter patch that to True, and a reference pool is built with it False."""

from __future__ import annotations

from typing import Callable, TypeVar

from braid.runtime.mem_cache import pools

Pool = TypeVar("Pool")


def fallback_pool(make: Callable[[], Pool]) -> Pool:
    """make() with the pool's Triton routes off: the pool it builds stores by rotary and indexed copies."""
    routed = pools._triton_kernels_run_on
    pools._triton_kernels_run_on = lambda device: False
    try:
        return make()
    finally:
        pools._triton_kernels_run_on = routed


class PoolWithoutEpilogueTarget(pools.MHAKVPool):
    """An MHAKVPool that offers the batch-1 qkv GEMV no cache to write (rotary_store_target None): the GEMV leaves
    rotary and the store to the pool's rotate_and_set_kv (its rotary + store kernel), the path the epilogue
    replaced."""

    def rotary_store_target(self, layer_id, loc):
        return None
