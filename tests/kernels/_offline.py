"""Compile Triton kernels for sm_90 on a machine without a GPU (the kernel tests' resource checks).

A stand-in for Triton's driver answers what a compile-only ``warmup`` asks (device 0, stream 0, the sm_90 target);
:func:`compile_only` turns a kernel's ``kernel[grid](...)`` launches into such compiles. Run in a process of its own
(``_helpers.sm90_compile``): the driver stays replaced.
"""

from __future__ import annotations

import torch
from triton.backends.compiler import GPUTarget


class CompileOnlyDriver:
    """What a compile-only ``warmup`` asks of Triton's driver, for an sm_90 target."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


def compile_only(module, name: str) -> list:
    """Replace ``module.<name>``, a Triton kernel launched as ``kernel[grid](...)``, by a compile-only ``warmup`` for
    the active driver's target (in this process only); returns the list the compiled kernels are appended to."""
    kernel = getattr(module, name)
    compiled = []

    class CompileOnly:
        def __getitem__(self, grid):
            return lambda *a, **kw: compiled.append(kernel.run(*a, grid=grid, warmup=True, **kw))

    setattr(module, name, CompileOnly())
    return compiled
