"""The residual walks' bounds and first block hoisted before the dense loop, GEMM alone, on the GPU.

After its dense K loop a ZipperEngine program walks its block row's kept blocks. Each block's activation tile
needs the block's column, which needs the row's bounds: two dependent loads before the first block's operands
can load. With the hoist the bounds and the first block's column (a few scalars) load before the dense loop, so
after it that block's activations, integers and scales load at once.

Two kernels, on the Llama-3-8B linears (weights and blocks rotated through more than L2, activations quantized
outside the timing, medians of interleaved rounds, each variant checked against the PyTorch reference first):

- decode (``--ms``, default 12, 16, 24, 32: no PDL at these sizes, as in the decode step): ZipperEngine's tail
  walk on tensor-core dots (``_tiles.WALK_HOIST_MAX_M``). ``w4a4_z`` is the dense GEMM on ZipperEngine's tiles;
  ``zipE`` one kept block in the layer; ``zip1`` one block a program; ``zip10`` 10 % at random in ``mode="tail"``;
  ``zip10_auto`` the same blocks as ``"auto"`` routes them. ``_h``: with the hoist.
- prefill (``--prefill-ms``, default 2048): the swapped GEMM's shared walk (power-of-two scales) on its prefill
  tiles (``_tiles.SWAP_WALK_HOIST``): ``dense``, ``shared`` (10 % at random), ``shared_h``.

    PYTHONPATH=. python3 benchmarks/walk_hoist.py [--ms 12,16,24,32] [--prefill-ms 2048] [--rounds 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from residual_balance import capped  # noqa: E402
from walk_cost import layout_residual  # noqa: E402
from walk_preload import SHAPES, interleaved_medians, report_checks, save_rows  # noqa: E402
from zipper import BLOCK, check, clone_residual, random_residual, random_w4_copies  # noqa: E402

from mosaicquant.kernels._tiles import LOCK_SLOTS, fit_to_blocks, pick_config  # noqa: E402
from mosaicquant.kernels.act_quant import quantize_activations_triton  # noqa: E402
from mosaicquant.kernels.w4a4_gemm import w4a4_gemm_swapped_triton, w4a4_gemm_triton  # noqa: E402
from mosaicquant.kernels.zipper import residual_block_map, zipper_gemm_reference, zipper_gemm_triton  # noqa: E402
from mosaicquant.methods.format import residual_shifts  # noqa: E402

DECODE = ("w4a4_z", "zipE", "zipE_h", "zip1", "zip1_h", "zip10", "zip10_h", "zip10_auto", "zip10_auto_h")
PREFILL = ("dense", "shared", "shared_h")


def hoisted(fn, name: str, value):
    return capped((name, value), fn)


def decode_cells(name, n, k, m, qws, wss, device, gen, rounds, rows):
    cfg = fit_to_blocks(pick_config(m, n, k // 2, device, BLOCK), BLOCK, nest_k=False)
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    split = cfg.split_k if tiles <= LOCK_SLOTS else 1
    layouts = {"zipE": layout_residual(n, k, 1, device, first_only=True),
               "zip1": layout_residual(n, k, split, device), "zip10": random_residual(n, k, 0.10, device, gen)}
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    ap, a_s = quantize_activations_triton(x)
    calls = {"w4a4_z": [lambda i=i: w4a4_gemm_triton(ap, a_s, qws[i], wss[i], k, config=cfg) for i in range(len(qws))]}
    refs = {}
    for label, r in layouts.items():
        rs = [r] + [clone_residual(r) for _ in range(len(qws) - 1)]
        maps = [residual_block_map(x_) for x_ in rs]
        ref = zipper_gemm_reference(ap, a_s, qws[0], wss[0], k, r, out_fp32=True)
        tail = [lambda i=i, rs=rs: zipper_gemm_triton(ap, a_s, qws[i], wss[i], k, rs[i], mode="tail",
                                                      residual_walk="dot", config=cfg) for i in range(len(qws))]
        variants = {label: tail}
        if label == "zip10":
            variants["zip10_auto"] = [lambda i=i, rs=rs, maps=maps: zipper_gemm_triton(
                ap, a_s, qws[i], wss[i], k, rs[i], block_map=maps[i]) for i in range(len(qws))]
        for v, fns in variants.items():
            refs[v] = refs[v + "_h"] = ref
            calls[v] = [hoisted(fn, "WALK_HOIST_MAX_M", 0) for fn in fns]
            calls[v + "_h"] = [hoisted(fn, "WALK_HOIST_MAX_M", 64) for fn in fns]
    calls = {v: calls[v] for v in DECODE}
    return interleaved_medians(calls, rounds, lambda v, fn: v.startswith("w4a4") or check(fn(), refs[v])[0],
                               dict(kind="decode", layer=name, n=n, k=k, m=m, split=split, block_n=cfg.block_n,
                                    block_m=cfg.block_m), rows)


def prefill_cells(name, n, k, m, qws, wss, device, gen, rounds, rows):
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    ap, a_s = quantize_activations_triton(x)
    a8, s8 = quantize_activations_triton(x, layout="split8")
    rs = [random_residual(n, k, 0.10, device, gen, w_scale=wss[i]) for i in range(len(qws))]
    shifts = [residual_shifts(r, w) for r, w in zip(rs, wss)]
    assert all(s is not None for s in shifts)
    ref = zipper_gemm_reference(ap, a_s, qws[0], wss[0], k, rs[0], out_fp32=True)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=device)

    def shared(i):
        return lambda: w4a4_gemm_swapped_triton(a8, s8, qws[i], wss[i], k, residual=rs[i], residual_walk="shared",
                                                residual_shifts=shifts[i], out=out)

    calls = {"dense": [lambda i=i: w4a4_gemm_swapped_triton(a8, s8, qws[i], wss[i], k, out=out)
                       for i in range(len(qws))],
             "shared": [hoisted(shared(i), "SWAP_WALK_HOIST", False) for i in range(len(qws))],
             "shared_h": [hoisted(shared(i), "SWAP_WALK_HOIST", True) for i in range(len(qws))]}

    def checked(v, fn):
        if v == "dense":
            return True
        got = fn()
        return check(got if got is not None else out, ref)[0]

    return interleaved_medians(calls, rounds, checked, dict(kind="prefill", layer=name, n=n, k=k, m=m), rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", default="12,16,24,32")
    parser.add_argument("--prefill-ms", default="2048")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("walk_hoist.py times GPU kernels: no CUDA device here", file=sys.stderr)
        return 2
    os.environ.setdefault("MOSAICQUANT_PDL_CHAIN", "off")
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    device = torch.device("cuda")
    ms = [int(v) for v in args.ms.split(",") if v]
    pms = [int(v) for v in args.prefill_ms.split(",") if v]
    rows, dec, pre = [], [], []
    for name, (n, k) in SHAPES.items():
        qws, wss = random_w4_copies(n, k // 2, device)
        for m in ms:
            med = decode_cells(name, n, k, m, qws, wss, device, gen, args.rounds, rows)
            dec.append((name, m, med))
            print(f"{name:8s} M={m:4d}: " + "  ".join(f"{v} {u:.2f}" for v, u in med.items()), flush=True)
            save_rows(args.out, rows)
        for m in pms:
            med = prefill_cells(name, n, k, m, qws, wss, device, gen, args.rounds, rows)
            pre.append((name, m, med))
            print(f"{name:8s} M={m:4d}: " + "  ".join(f"{v} {u:.2f}" for v, u in med.items()), flush=True)
            save_rows(args.out, rows)
    failed = report_checks(rows)
    print("| layer | M | " + " | ".join(DECODE) + " | zip10_h / zip10 | zip10_auto_h / zip10_auto |")
    for name, m, d in dec:
        print(f"| {name} | {m} | " + " | ".join(f"{d[v]:.2f}" for v in DECODE)
              + f" | {d['zip10_h'] / d['zip10']:.3f} | {d['zip10_auto_h'] / d['zip10_auto']:.3f} |")
    print("| layer | M | " + " | ".join(PREFILL) + " | shared / dense | shared_h / shared |")
    for name, m, d in pre:
        print(f"| {name} | {m} | " + " | ".join(f"{d[v]:.1f}" for v in PREFILL)
              + f" | {d['shared'] / d['dense']:.3f} | {d['shared_h'] / d['shared']:.3f} |")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
