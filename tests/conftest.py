"""Suite-wide settings.

Triton reads TRITON_INTERPRET when a kernel is decorated, so on machines without a GPU it is set here,
before any test module (in any folder) imports braid's kernel modules.

Memory (the suite must fit a small machine): after each module the freed heap goes back to the OS, and a folder's
session-wide server or engine (`close_when_leaving_folder`) stops once that folder's last test is done instead of
living through every later folder.
"""

import gc
import os
import shutil
import sys
from pathlib import Path

# the tests' shared helpers (servers, tiny checkpoints, the shared programs) import by their module names
sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from suite_memory import CLOSE_WHEN_LEAVING, in_folder  # noqa: E402

from braid.runtime.host_memory import return_freed_memory  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """`gpu`-marked tests are skipped where there is no CUDA device (benchmarks/gpu/test_tier.sh runs them where
    there is one)."""
    import torch

    if torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET") == "1":
            raise pytest.UsageError("TRITON_INTERPRET=1 on a machine with CUDA: a test module set it at import, and "
                                    "every Triton kernel decorated after that runs under the interpreter")
        return
    skip = pytest.mark.skip(reason="gpu: needs a CUDA device (benchmarks/gpu/test_tier.sh)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    for folder in list(CLOSE_WHEN_LEAVING):
        if in_folder(item.nodeid, folder) and (nextitem is None or not in_folder(nextitem.nodeid, folder)):
            for close in CLOSE_WHEN_LEAVING.pop(folder):
                close()
            gc.collect()
            return_freed_memory()


@pytest.fixture(scope="module", autouse=True)
def _return_memory_after_each_module():
    yield
    gc.collect()
    return_freed_memory()
