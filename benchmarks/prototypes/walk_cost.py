"""Kept: what a walked kept block costs a program at decode sizes.

What ZipperEngine's tail walk costs a program at decode sizes: the kernel without blocks to walk, one block a
program, two blocks a program, against the dense GEMM on the same tiles.

The tail walk deals a block row's kept blocks round-robin to that row's split-K programs, so with ``c`` blocks in
every block row and ``S`` splits each program walks ``c / S`` of them. This script times, on the Llama-3-8B linears
(GEMM alone, activations quantized outside the timing, weights and blocks rotated through more than L2, medians of
interleaved rounds; ZipperEngine in ``mode="tail"`` with the tensor-core walk):

- ``w4a4``: the dense GEMM on its own tiles; ``w4a4_z``: the dense GEMM on ZipperEngine's tiles (the ones the
  zipper variants run);
- ``zipE``: one kept block in the whole layer (the walk's kernel, nearly nothing to walk);
- ``zip1`` / ``zip2``: every block row keeps ``S`` / ``2 S`` blocks in evenly spaced columns (one / two a program);
- ``zip1_s0``: ``zip1`` with the walk's loop on the launch's stages instead of the tile table's ``walk_stages``;
- ``zip10``: 10 % of the blocks at random (tail walk); ``zip10_auto``: the same blocks as ``"auto"`` routes them.

Each zipper call is checked against the PyTorch reference before it is timed. Prints the per-program cost
``zip1 - zipE`` and ``zip2 - zip1`` and the kernel's own ``zipE - w4a4_z`` last.

    PYTHONPATH=. python3 benchmarks/prototypes/walk_cost.py [--ms 8,16,32] [--rounds 3] [--out DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path[:0] = [str(Path(__file__).resolve().parents[1] / part) for part in ("kernels", "prototypes")]

from residual_balance import capped  # noqa: E402
from walk_preload import SHAPES, decode_gemm_args, interleaved_medians, report_checks, save_rows  # noqa: E402
from zipper import BLOCK, check, clone_residual, random_residual, random_w4_copies  # noqa: E402

from mosaicquant import settings  # noqa: E402
from mosaicquant.kernels._tiles import LOCK_SLOTS, fit_to_blocks, pick_config  # noqa: E402
from mosaicquant.kernels.act_quant import quantize_activations_triton  # noqa: E402
from mosaicquant.kernels.w4a4_gemm import w4a4_gemm_triton  # noqa: E402
from mosaicquant.kernels.zipper import residual_block_map, zipper_gemm_reference, zipper_gemm_triton  # noqa: E402
from mosaicquant.methods.format import ResidualBlocks  # noqa: E402


def layout_residual(n: int, k: int, per_row: int, device, first_only: bool = False) -> ResidualBlocks:
    """``per_row`` kept blocks in evenly spaced columns of every block row (``first_only``: block (0, 0) alone)."""
    bn, bk = BLOCK
    nbr, nbc = -(-n // bn), -(-k // bk)
    if first_only:
        coords = torch.zeros(1, 2, dtype=torch.int32)
    else:
        per_row = min(per_row, nbc)
        cols = torch.tensor([(j * nbc) // per_row for j in range(per_row)], dtype=torch.int32)
        coords = torch.stack([torch.arange(nbr, dtype=torch.int32).repeat_interleave(per_row), cols.repeat(nbr)], 1)
    counts = torch.bincount(coords[:, 0].long(), minlength=nbr)
    row_ptr = torch.zeros(nbr + 1, dtype=torch.int32)
    row_ptr[1:] = torch.cumsum(counts, 0).to(torch.int32)
    nb = coords.shape[0]
    values = torch.randint(0, 256, (nb, bn, bk // 2), dtype=torch.uint8)
    scales = (torch.rand(nb, bn) * 0.02 + 0.001).to(torch.float16)
    return ResidualBlocks((n, k), BLOCK, coords.to(device), row_ptr.to(device), values.to(device), scales.to(device))


def main(argv=None) -> int:
    args = decode_gemm_args(argv, __doc__, "walk_cost.py")
    if args is None:
        return 2
    device, gen = torch.device("cuda"), args.gen
    rows, table = [], []
    for name, (n, k) in SHAPES.items():
        qws, wss = random_w4_copies(n, k // 2, device)
        for m in (int(v) for v in args.ms.split(",")):
            cfg = fit_to_blocks(pick_config(m, n, k // 2, device, BLOCK), BLOCK, nest_k=False)
            tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
            split = cfg.split_k if tiles <= LOCK_SLOTS else 1
            layouts = {"zipE": layout_residual(n, k, 1, device, first_only=True),
                       "zip1": layout_residual(n, k, split, device), "zip2": layout_residual(n, k, 2 * split, device),
                       "zip10": random_residual(n, k, 0.10, device, gen)}
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            ap, a_s = quantize_activations_triton(x)
            calls = {"w4a4": [lambda i=i: w4a4_gemm_triton(ap, a_s, qws[i], wss[i], k) for i in range(len(qws))],
                     "w4a4_z": [lambda i=i: w4a4_gemm_triton(ap, a_s, qws[i], wss[i], k, config=cfg)
                                for i in range(len(qws))]}
            refs = {}
            for label, r in layouts.items():
                rs = [r] + [clone_residual(r) for _ in range(len(qws) - 1)]
                maps = [residual_block_map(x_) for x_ in rs]
                refs[label] = zipper_gemm_reference(ap, a_s, qws[0], wss[0], k, r, out_fp32=True)
                calls[label] = [lambda i=i, rs=rs: zipper_gemm_triton(ap, a_s, qws[i], wss[i], k, rs[i], mode="tail",
                                                                    residual_walk="dot", config=cfg)
                                for i in range(len(qws))]
                if label == "zip1":
                    refs["zip1_s0"] = refs[label]
                    calls["zip1_s0"] = [capped(("walk_stages", 0), fn) for fn in calls[label]]
                if label == "zip10":
                    refs["zip10_auto"] = refs[label]
                    calls["zip10_auto"] = [lambda i=i, rs=rs, maps=maps: zipper_gemm_triton(
                        ap, a_s, qws[i], wss[i], k, rs[i], block_map=maps[i]) for i in range(len(qws))]
            med = interleaved_medians(
                calls, args.rounds, lambda v, fn: v.startswith("w4a4") or check(fn(), refs[v])[0],
                dict(layer=name, n=n, k=k, m=m, split=split, block_n=cfg.block_n, block_m=cfg.block_m), rows)
            table.append((name, m, split, med))
            print(f"{name:8s} M={m:3d} split {split}: " + "  ".join(f"{v} {u:.2f}" for v, u in med.items()), flush=True)
            save_rows(args.out, rows)
    failed = report_checks(rows)
    print("| layer | M | split | w4a4 | w4a4_z | zipE | zip1 | zip2 | zip1_s0 | zip10 | zip10_auto | zipE-w4a4_z | "
          "zip1-zipE | zip2-zip1 |")
    for name, m, split, d in table:
        print(f"| {name} | {m} | {split} | " + " | ".join(f"{d[v]:.2f}" for v in (
            "w4a4", "w4a4_z", "zipE", "zip1", "zip2", "zip1_s0", "zip10", "zip10_auto"))
            + f" | {d['zipE'] - d['w4a4_z']:+.2f} | {d['zip1'] - d['zipE']:+.2f} | {d['zip2'] - d['zip1']:+.2f} |")
    return 1 if failed else 0


if __name__ == "__main__":
    # GEMMs timed back to back: without the decode step's PDL chain a GEMM never lets the next timed one start
    # early, so each time is one GEMM's
    with settings.use(pdl_chain="off"):
        raise SystemExit(main())
