"""Programmatic dependent launch (PDL) for the decode path's Triton kernels (Hopper and later).

At batch 1 a decode step is ~290 small kernels in one CUDA graph; between two of them the GPU drains the first,
flushes its writes and only then starts the second, a few microseconds each time. A kernel launched with the
PDL attribute may start while the kernel before it is still running: its programs are scheduled as soon as
every program of the previous kernel has signalled (griddepcontrol.launch_dependents) or exited, and they
block in griddepcontrol.wait until that kernel has completed and its memory is visible.

Contract for a kernel that takes `USE_PDL: tl.constexpr` and is launched with `**launch_options(device)`:
before `wait_for_previous_kernel(USE_PDL)` it reads only memory that no kernel of the step writes (weights),
and it writes nothing. `let_next_kernel_launch(USE_PDL)` then `wait_for_previous_kernel(USE_PDL)` at its very
start is always safe. Import both by name: torch.compile re-emits a kernel's source together with the jit
functions it calls by name, not through module attributes. Because every such kernel waits for its
predecessor to complete, completion stays ordered along the stream.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

__all__ = ["enabled", "set_enabled", "launch_options", "let_next_kernel_launch", "wait_for_previous_kernel"]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_HAS_GDC = hasattr(getattr(getattr(tl, "extra", None), "cuda", None), "gdc_wait")

# ServerArgs.disable_pdl turns it off (kernel_switches.apply_kernel_switches)
_enabled = True


def set_enabled(on: bool) -> bool:
    """Launch the decode kernels with PDL where the device has it; returns the previous setting. Graphs captured
    before keep the launches they captured."""
    global _enabled
    previous, _enabled = _enabled, bool(on)
    return previous


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: CUDA, compute capability 9.0+, a Triton that has it."""
    if not _enabled or _INTERPRET or not _HAS_GDC or device.type != "cuda" or torch.version.hip is not None:
        return False  # (ROCm devices also report as "cuda", with capabilities that are no NVIDIA generation)
    if torch.compiler.is_compiling():
        # Inductor launches the kernels of a compiled region itself, without the launch attribute
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (9, 0)


def launch_options(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch: USE_PDL for the kernel, launch_pdl for Triton's launcher."""
    if enabled(device):
        return dict(USE_PDL=True, launch_pdl=True)
    return dict(USE_PDL=False)


@triton.jit
def let_next_kernel_launch(USE_PDL: tl.constexpr):
    """The next kernel (if launched with PDL) may start once every program here has passed this point."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_previous_kernel(USE_PDL: tl.constexpr):
    """Block until the previous kernel has completed and its writes are visible."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
