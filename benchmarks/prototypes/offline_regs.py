"""Kept: ZipperEngine's tail-walk registers compiled for sm_90 without a GPU.

Registers and shared memory of ZipperEngine's tail-walk kernel compiled for sm_90 on a machine without a GPU,
with the walk's first-block preload off and on (the tile table's ``walk_preload_max_m``).

The launcher runs on CPU tensors with the tiles and splits it picks for the H200 (132 SMs; PDL and the L2 prefetch
off, as for calls of more than 8 tokens there); the launch is replaced by a
compile-only ``warmup`` for ``GPUTarget("cuda", 90, 32)`` through a stand-in driver, and ``cuobjdump`` (shipped with
Triton) reads the cubin's register count. Pointer alignment and integer divisibility come from the CPU tensors and
values, as a launch's would. Leaves the process's Triton driver replaced: run it on its own.

    python3 benchmarks/prototypes/offline_regs.py [--ms 8,16,32]
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path[:0] = [str(Path(__file__).resolve().parents[1] / part) for part in ("kernels", "prototypes")]

H200_SMS = 132


class _CompileOnlyDriver:
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
    the active driver's target; returns the list the compiled kernels are appended to."""
    kernel = getattr(module, name)
    compiled = []

    class CompileOnly:
        def __getitem__(self, grid):
            return lambda *a, **kw: compiled.append(kernel.run(*a, grid=grid, warmup=True, **kw))

    setattr(module, name, CompileOnly())
    return compiled


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", default="8,16,32")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("offline_regs.py compiles for the GPU: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    driver.set_active(_CompileOnlyDriver())
    from mosaicquant import settings
    from mosaicquant.kernels import _tiles
    from mosaicquant.kernels._tiles import pick_config
    from mosaicquant.kernels.act_quant import quantize_activations_reference
    from residual_balance import SHAPES
    from zipper import random_residual

    _tiles._sm_count = lambda device: H200_SMS
    zmod = importlib.import_module("mosaicquant.kernels.zipper")
    zmod.check_triton_device = lambda device: None
    compiled = compile_only(zmod, "_zipper_kernel")
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    gen = torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES.items():
        res = random_residual(n, k, 0.10, torch.device("cpu"), gen)
        qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
        w_scale = torch.rand(n).to(torch.float16)
        for m in (int(v) for v in args.ms.split(",")):
            a_packed, a_scale = quantize_activations_reference(torch.randn(m, k).to(torch.bfloat16))
            cfg = pick_config(m, n, k // 2, torch.device("cuda"), res.block_shape)  # the H200's tiles
            cells = []
            for preload in (False, True):
                with settings.use_tiles(walk_preload_max_m=m if preload else 0):
                    zmod.zipper_gemm_triton(a_packed, a_scale, qweight, w_scale, k, res, mode="tail",
                                            residual_walk="dot", config=cfg)
                ck = compiled[-1].result() if hasattr(compiled[-1], "result") else compiled[-1]
                with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
                    fh.write(ck.asm["cubin"])
                    fh.flush()
                    usage = subprocess.run([cuobjdump, "--dump-resource-usage", fh.name], capture_output=True,
                                           text=True, check=True).stdout
                regs = next((t.split(":")[1] for t in usage.split() if t.startswith("REG:")), "?")
                cells.append(f"{'preload' if preload else 'no preload'}: {regs} registers, "
                             f"{ck.metadata.shared} B shared, {ck.metadata.num_warps} warps")
            tiles = f"{cfg.block_m}x{cfg.block_n}, {cfg.block_kp} B a step, split {cfg.split_k}"
            print(f"{name:8s} M={m:3d} ({tiles})  " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
