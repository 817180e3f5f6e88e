"""ZipperEngine's tail walk dealing parts of blocks over the split-K programs (``_tiles.WALK_UNITS``), on the GPU.

With whole blocks a block row's few kept blocks (~3 at 10 % on K = 4,096) land on as many of the row's split-K
programs (8 on o_proj), which carry a block's bytes more than the rest, and the slowest program sets the kernel's
time. Dealt in halves, the same bytes spread over twice as many programs. This script times ZipperEngine as
``"auto"`` routes it (a 10 % random residual, 128 × 128 blocks) on the split layers of Llama-3-8B (q/k/v, o, down;
gate/up is unsplit at these sizes) with whole blocks and halves, next to the dense GEMM on the same tiles. GEMM
alone, activations quantized outside the timing, weights rotated through more than L2, medians of interleaved
rounds, each variant checked against the reference first.

    PYTHONPATH=. python3 benchmarks/walk_units.py [--ms 5,8,12,16,24,32] [--rounds 3] [--out DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from residual_balance import capped  # noqa: E402
from walk_preload import SHAPES, decode_gemm_args, interleaved_medians, report_checks, save_rows  # noqa: E402
from zipper import BLOCK, check, clone_residual, random_residual, random_w4_copies  # noqa: E402

from mosaicquant.kernels._tiles import fit_to_blocks, pick_config  # noqa: E402
from mosaicquant.kernels.act_quant import quantize_activations_triton  # noqa: E402
from mosaicquant.kernels.w4a4_gemm import w4a4_gemm_triton  # noqa: E402
from mosaicquant.kernels.zipper import residual_block_map, zipper_gemm_reference, zipper_gemm_triton  # noqa: E402

VARIANTS = ("w4a4_z", "zip10_u1", "zip10_u2")


def main(argv=None) -> int:
    args = decode_gemm_args(argv, __doc__, "walk_units.py", ms="5,8,12,16,24,32")
    if args is None:
        return 2
    device, gen = torch.device("cuda"), args.gen
    rows, table = [], []
    for name, (n, k) in SHAPES.items():
        if name == "gate_up":
            continue
        qws, wss = random_w4_copies(n, k // 2, device)
        r0 = random_residual(n, k, 0.10, device, gen)
        rs = [r0] + [clone_residual(r0) for _ in range(len(qws) - 1)]
        maps = [residual_block_map(r) for r in rs]
        for m in (int(v) for v in args.ms.split(",")):
            cfg = fit_to_blocks(pick_config(m, n, k // 2, device, BLOCK), BLOCK, nest_k=False)
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            ap, a_s = quantize_activations_triton(x)
            ref = zipper_gemm_reference(ap, a_s, qws[0], wss[0], k, r0, out_fp32=True)
            zip_calls = [lambda i=i: zipper_gemm_triton(ap, a_s, qws[i], wss[i], k, rs[i], block_map=maps[i])
                         for i in range(len(qws))]
            calls = {"w4a4_z": [lambda i=i: w4a4_gemm_triton(ap, a_s, qws[i], wss[i], k, config=cfg)
                                for i in range(len(qws))],
                     "zip10_u1": [capped(("WALK_UNITS", 1), fn) for fn in zip_calls],
                     "zip10_u2": [capped(("WALK_UNITS", 2), fn) for fn in zip_calls]}
            med = interleaved_medians(calls, args.rounds, lambda v, fn: v == "w4a4_z" or check(fn(), ref)[0],
                                      dict(layer=name, n=n, k=k, m=m, split=cfg.split_k), rows)
            table.append((name, m, cfg.split_k, med))
            print(f"{name:8s} M={m:3d} split {cfg.split_k}: " + "  ".join(f"{v} {u:.2f}" for v, u in med.items()),
                  flush=True)
            save_rows(args.out, rows)
    failed = report_checks(rows)
    print("| layer | M | split | " + " | ".join(VARIANTS) + " | u1 - dense | u2 - dense | u2 / u1 |")
    for name, m, split, d in table:
        print(f"| {name} | {m} | {split} | " + " | ".join(f"{d[v]:.2f}" for v in VARIANTS)
              + f" | {d['zip10_u1'] - d['w4a4_z']:+.2f} | {d['zip10_u2'] - d['w4a4_z']:+.2f} | "
              f"{d['zip10_u2'] / d['zip10_u1']:.3f} |")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
