"""The kernel choices of ServerArgs (disable_pdl, disable_decode_gemv, disable_cpu_prepack,
disable_cpu_malloc_tuning) applied process-wide, before the model is built and its graphs captured."""

from __future__ import annotations

import contextlib
from typing import Iterator

from braid.runtime.layers import cpu_gemm, cpu_tuning, gemv, pdl


def apply_kernel_switches(server_args) -> None:
    """Set the process-wide kernel switches from server_args; on CPU also tune malloc unless disabled (that
    cannot be undone within the process)."""
    _switch(server_args)


@contextlib.contextmanager
def kernel_switches_applied(server_args) -> Iterator[None]:
    """apply_kernel_switches for the duration of a block (tests, A/B benchmarks), then the previous switches."""
    pdl_on, gemv_on, prepack_on = _switch(server_args)
    try:
        yield
    finally:
        pdl.set_enabled(pdl_on)
        gemv.set_enabled(gemv_on)
        cpu_gemm.set_prepack_enabled(prepack_on)


def _switch(server_args) -> tuple[bool, bool, bool]:
    """-> the previous (pdl, decode gemv, cpu prepack) settings."""
    previous = (pdl.set_enabled(not server_args.disable_pdl), gemv.set_enabled(not server_args.disable_decode_gemv),
                cpu_gemm.set_prepack_enabled(not server_args.disable_cpu_prepack))
    if server_args.resolved_device == "cpu" and not server_args.disable_cpu_malloc_tuning:
        cpu_tuning.tune_malloc_for_cpu_inference()
    return previous
