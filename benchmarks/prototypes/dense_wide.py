"""Kept: re-times the dense wide tiles' bounds, the tile table's dense_wide_* entries.

Dense W4A4 wide layers' 17-32-token calls: the packed kernel's wide tiles against the swapped GEMM's decode tiles.

the tile table's ``dense_wide_max_m``, ``dense_wide_min_tiles_per_sm`` and ``dense_wide_max_tiles_per_sm`` decide
which of the two a layer runs (``wide`` below is timed on every layer, whatever they decide).

Times, on the gate/up layers of Llama-3-8B, Qwen3-8B, Qwen3-14B and Qwen3-32B (1.70, 1.45, 2.06 and 3.03 wide tiles a SM
of the H200's 132; GEMM alone, activations quantized outside the timing
in each kernel's layout, weights rotated through more than L2, medians of interleaved rounds):

- ``swapped``: the operand-swapped GEMM at :func:`mosaicquant.kernels._tiles.swapped_decode_config`'s tiles (the
  route of dense layers' calls of 17-32 tokens before this rule);
- ``wide``: the packed kernel on the wide tiles (32 x 128 channels, 128-byte K steps, 8 warps, 3 stages, unsplit);
- ``narrow``: the packed kernel on its 64-channel tiles (what :func:`pick_config` gives without the wide rule).

Each call is checked against the PyTorch reference before it is timed.

    PYTHONPATH=. python3 benchmarks/prototypes/dense_wide.py [--ms 17,24,32] [--rounds 3] [--out DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path[:0] = [str(Path(__file__).resolve().parents[1] / part) for part in ("kernels", "prototypes")]

from residual_balance import capped  # noqa: E402
from walk_preload import decode_gemm_args, interleaved_medians, report_checks, save_rows  # noqa: E402
from zipper import check, random_w4_copies  # noqa: E402

from mosaicquant import settings  # noqa: E402
from mosaicquant.kernels._tiles import pick_config, swapped_decode_config  # noqa: E402
from mosaicquant.kernels.act_quant import quantize_activations_triton  # noqa: E402
from mosaicquant.kernels.w4a4_gemm import (  # noqa: E402
    w4a4_gemm_reference,
    w4a4_gemm_swapped_triton,
    w4a4_gemm_triton,
)

SHAPES = {"llama_gate_up": (28672, 4096), "qwen_gate_up": (24576, 4096), "qwen14b_gate_up": (34816, 5120),
          "qwen32b_gate_up": (51200, 5120)}


def main(argv=None) -> int:
    args = decode_gemm_args(argv, __doc__, "dense_wide.py", ms="17,24,32")
    if args is None:
        return 2
    device = torch.device("cuda")
    rows, table = [], []
    for name, (n, k) in SHAPES.items():
        qws, wss = random_w4_copies(n, k // 2, device)
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            ap, a_s = quantize_activations_triton(x)
            a8, s8 = quantize_activations_triton(x, layout="split8")
            ref = w4a4_gemm_reference(ap, a_s, qws[0], wss[0], k, out_fp32=True)
            tiles = swapped_decode_config(m, n, k // 2, device)
            with_wide = capped(("dense_wide_max_m", 32), capped(("dense_wide_min_tiles_per_sm", 0.0), capped(
                ("dense_wide_max_tiles_per_sm", float("inf")), lambda: pick_config(m, n, k // 2, device))))()
            narrow = capped(("dense_wide_max_m", 16), lambda: pick_config(m, n, k // 2, device))()
            idx = range(len(qws))
            calls = {
                "swapped": [lambda i=i: w4a4_gemm_swapped_triton(a8, s8, qws[i], wss[i], k, **tiles) for i in idx],
                "wide": [lambda i=i: w4a4_gemm_triton(ap, a_s, qws[i], wss[i], k, config=with_wide) for i in idx],
                "narrow": [lambda i=i: w4a4_gemm_triton(ap, a_s, qws[i], wss[i], k, config=narrow) for i in idx],
            }
            med = interleaved_medians(calls, args.rounds, lambda v, fn: check(fn(), ref)[0],
                                      dict(layer=name, n=n, k=k, m=m, wide=str(with_wide), narrow=str(narrow),
                                           swapped=tiles), rows)
            table.append((name, m, med))
            print(f"{name:14s} M={m:3d}: " + "  ".join(f"{v} {u:.2f}" for v, u in med.items()), flush=True)
            save_rows(args.out, rows)
    failed = report_checks(rows)
    print("| layer | M | swapped | wide | narrow | wide / swapped |")
    for name, m, d in table:
        print(f"| {name} | {m} | {d['swapped']:.2f} | {d['wide']:.2f} | {d['narrow']:.2f} | "
              f"{d['wide'] / d['swapped']:.3f} |")
    return 1 if failed else 0


if __name__ == "__main__":
    # GEMMs timed back to back: without the decode step's PDL chain a GEMM never lets the next timed one start
    # early, so each time is one GEMM's
    with settings.use(pdl_chain="off"):
        raise SystemExit(main())
