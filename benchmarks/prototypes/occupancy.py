"""Kept: the decode GEMMs' registers, shared memory and resident programs read on a GPU.

Registers, shared memory and resident programs of the decode GEMMs, and ZipperEngine's time per split.

For each Llama-3-8B linear at decode sizes: the dense W4A4 GEMM, ZipperEngine (10 % random
residual; its tail walk, and where ``"auto"`` routes it its parallel mode, ``zip10_par``) and
the decode GEMV at their default tiles, as compiled:
registers a thread, shared memory a program, and how many programs the H200 holds at once
(the least of the register file, shared memory and thread limits per SM, times the SMs) against
the grid. A grid above that runs in more than one wave. Then ZipperEngine is timed at the
default split-K (marked ``*``) and at half, twice and four times it, as is the dense GEMM.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/prototypes/occupancy.py --out $OUT
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path[:0] = [str(Path(__file__).resolve().parents[1] / part) for part in ("kernels", "prototypes")]

from zipper import check, clone_residual, random_residual, random_w4_copies, report_checks_and_write, time_calls  # noqa: E402

gemv_mod = importlib.import_module("mosaicquant.kernels.gemv")
w4a4_mod = importlib.import_module("mosaicquant.kernels.w4a4_gemm")
zipper_mod = importlib.import_module("mosaicquant.kernels.zipper")
from mosaicquant import settings  # noqa: E402
from mosaicquant.kernels._tiles import parallel_residual, pick_config  # noqa: E402
from mosaicquant.kernels.act_quant import quantize_activations_triton  # noqa: E402
from mosaicquant.kernels.gemv import gemv_triton  # noqa: E402
from mosaicquant.kernels.w4a4_gemm import w4a4_gemm_reference, w4a4_gemm_triton  # noqa: E402
from mosaicquant.kernels.zipper import residual_block_map, zipper_gemm_reference, zipper_gemm_triton  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
MS = (1, 4, 8, 16)
SPLIT_FACTORS = (0.5, 1, 2, 4)  # split-K tried, as multiples of the default (marked *)
REGS_PER_SM = 65536
THREADS_PER_SM = 2048
SMEM_PER_SM = 227 * 1024

_LAST: dict = {}


def _capture(jit_fn, name):
    run = jit_fn.run

    def wrapped(*args, grid=None, **kwargs):
        kernel = run(*args, grid=grid, **kwargs)
        g = grid(kwargs) if callable(grid) else grid
        _LAST[name] = (kernel, tuple(g) + (1,) * (3 - len(g)))
        return kernel
    jit_fn.run = wrapped


def occupancy(name: str, sms: int) -> dict:
    kernel, grid = _LAST.pop(name)
    regs = kernel.n_regs
    warps = kernel.metadata.num_warps
    shared = kernel.metadata.shared
    per_warp = math.ceil(regs * 32 / 256) * 256  # registers are allocated per warp in 256s
    by_regs = REGS_PER_SM // (per_warp * warps)
    by_smem = SMEM_PER_SM // shared if shared else 32
    by_threads = THREADS_PER_SM // (32 * warps)
    per_sm = max(0, min(by_regs, by_smem, by_threads, 32))
    programs = grid[0] * grid[1] * grid[2]
    return {"regs": regs, "shared": shared, "warps": warps, "per_sm": per_sm, "resident": per_sm * sms,
            "programs": programs, "waves": programs / max(1, per_sm * sms)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--ms", default=",".join(map(str, MS)))
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    _capture(w4a4_mod._w4a4_gemm_kernel, "w4a4")
    _capture(zipper_mod._zipper_kernel, "zipper")
    _capture(zipper_mod._zipper_parallel_kernel, "zipper_par")
    _capture(gemv_mod._gemv_kernel, "gemv")
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    rows = []
    for name, (n, k) in SHAPES.items():
        kp = k // 2
        qws, wss = random_w4_copies(n, kp, device)
        qweight, w_scale, copies = qws[0], wss[0], len(qws)
        r = random_residual(n, k, 0.10, device, gen)
        rs = [r] + [clone_residual(r) for _ in range(copies - 1)]
        maps = [residual_block_map(x) for x in rs]
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            ap, a_s = quantize_activations_triton(x)
            zref = zipper_gemm_reference(ap, a_s, qweight, w_scale, k, r, out_fp32=True)
            dref = w4a4_gemm_reference(ap, a_s, qweight, w_scale, k, out_fp32=True)
            variants = {}
            if m == 1:
                variants["gemv_zip10"] = ("gemv", lambda i: gemv_triton(ap, a_s, qws[i], wss[i], k, residual=rs[i]),
                                          True)
            for label, res_block in (("w4a4", None), ("zip10", r.block_shape)):
                base = pick_config(m, n, kp, device, res_block)
                splits = sorted({max(1, int(base.split_k * f)) for f in SPLIT_FACTORS})
                for split in splits:
                    cfg = replace(base, split_k=split)
                    tag = f"{label}_split{split}" + ("*" if split == base.split_k else "")
                    if res_block is None:
                        variants[tag] = ("w4a4", lambda i, cfg=cfg: w4a4_gemm_triton(ap, a_s, qws[i], wss[i], k,
                                                                                    config=cfg), False)
                    else:
                        variants[tag] = ("zipper", lambda i, cfg=cfg: zipper_gemm_triton(
                            ap, a_s, qws[i], wss[i], k, rs[i], block_map=maps[i], config=cfg, mode="tail"), True)
                        if split == base.split_k and parallel_residual(m, cfg, r.num_blocks / r.grid[0]):
                            variants["zip10_par*"] = ("zipper_par", lambda i, cfg=cfg: zipper_gemm_triton(
                                ap, a_s, qws[i], wss[i], k, rs[i], config=cfg, mode="parallel"), True)
                            variants["zip10_par_rows"] = ("zipper_par", lambda i, cfg=cfg: zipper_gemm_triton(
                                ap, a_s, qws[i], wss[i], k, rs[i], config=cfg, mode="parallel_rows"), True)
            for variant, (kname, call, has_res) in variants.items():
                out = call(0)
                occ = occupancy(kname, sms)
                ok = check(out, zref)[0] if has_res else check(out, dref)[0]
                us, spread, _ = time_calls([lambda i=i, call=call: call(i) for i in range(copies)])
                rows.append({"shape": name, "m": m, "variant": variant, "us": us, "spread": spread, "check_ok": ok,
                             **occ})
                print(f"{name:8s} M={m:<3d} {variant:16s} {us:7.2f} µs regs {occ['regs']:3d} smem {occ['shared']:6d} "
                      f"{occ['per_sm']:2d}/SM grid {occ['programs']:5d} waves {occ['waves']:.2f} ok={ok}", flush=True)
    print()
    print("| shape | M | variant | µs | regs | smem B | programs/SM | grid | waves |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r_ in rows:
        print(f"| {r_['shape']} | {r_['m']} | {r_['variant']} | {r_['us']:.2f} | {r_['regs']} | {r_['shared']} | "
              f"{r_['per_sm']} | {r_['programs']} | {r_['waves']:.2f} |")
    report_checks_and_write(rows, args.out, device)
    return 0


if __name__ == "__main__":
    # GEMMs timed back to back: without the decode step's PDL chain a GEMM never lets the next timed one start
    # early, so each time is one GEMM's
    with settings.use(pdl_chain="off"):
        raise SystemExit(main())
