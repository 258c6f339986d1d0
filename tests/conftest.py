"""Suite-wide settings.

Triton reads TRITON_INTERPRET when a kernel is decorated, so on machines without a GPU it is set here,
before any test module (in any folder) imports braid's kernel modules.
"""

import os
import shutil

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
