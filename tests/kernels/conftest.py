"""Kernel tests run under Triton's interpreter on CPU tensors when no GPU is present.

TRITON_INTERPRET is read when a kernel is decorated, so it must be set before any module
that defines Triton kernels is imported (this conftest loads before the test modules here).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
