"""Kernel tests run the Triton kernels on CUDA, or on Triton's CPU interpreter elsewhere.

``TRITON_INTERPRET`` is read when a kernel is decorated, so it is set here, before the
kernel modules are imported by the tests of this folder.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
