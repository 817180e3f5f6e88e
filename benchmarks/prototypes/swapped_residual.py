"""Kept: the swapped prefill GEMM's cost per kept block, behind SWAP_MIN_TILES_PER_SM's residual entry.

Cost of the residual tail in the operand-swapped prefill GEMM, per kept block per block row.

For a few Llama-3-8B linears at prefill M, times the swapped GEMM alone (activations already
in the ``split8`` layout) with a residual of exactly ``j`` kept 128×128 blocks in every block row
(evenly spaced columns), for each residual walk, against the same GEMM with no residual. The
intercept (j → 0) and slope (per block) of the time separate a fixed cost of the residual code
from the cost of each block. ``fp8_cc`` is the fp8 walk with the compiler's element-wise e4m3
conversions instead of the inline-PTX ones (the default). Checked against the PyTorch
reference before timing.

Usage (GPU)::

    python benchmarks/prototypes/swapped_residual.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mosaicquant.harness.timing import time_calls  # noqa: E402
from mosaicquant.kernels.act_quant import quantize_activations_reference, quantize_activations_triton  # noqa: E402
from mosaicquant.kernels.w4a4_gemm import RESIDUAL_WALKS, w4a4_gemm_swapped_triton  # noqa: E402
from mosaicquant.kernels.zipper import zipper_gemm_reference  # noqa: E402
from mosaicquant.methods.format import ResidualBlocks  # noqa: E402

BLOCK = (128, 128)
SHAPES = ((6144, 4096), (4096, 14336), (28672, 4096))
PER_ROW = (1, 2, 4, 8)


def residual_per_row(n: int, k: int, per_row: int, device) -> ResidualBlocks:
    """``per_row`` kept blocks in every block row, at evenly spaced block columns."""
    bn, bk = BLOCK
    nbr, nbc = -(-n // bn), -(-k // bk)
    cols = torch.linspace(0, nbc - 1, per_row).round().long().unique()
    coords = torch.stack(torch.meshgrid(torch.arange(nbr), cols, indexing="ij"), -1).reshape(-1, 2).to(torch.int32)
    nb = coords.shape[0]
    row_ptr = torch.arange(0, nbr + 1, dtype=torch.int32) * len(cols)
    values = torch.randint(0, 256, (nb, bn, bk // 2), dtype=torch.uint8)
    scales = (torch.rand(nb, bn) * 0.02 + 0.001).to(torch.float16)
    return ResidualBlocks((n, k), BLOCK, coords, row_ptr, values, scales).to(device)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--m", type=int, default=2048)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("swapped_residual.py times compiled kernels: it needs a CUDA GPU (none found)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    for n, k in SHAPES:
        x = torch.randn(args.m, k, device=device, dtype=torch.bfloat16)
        q8, s8 = quantize_activations_triton(x, layout="split8")
        packed, scale = quantize_activations_reference(x.cpu())
        qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
        w_scale = (torch.rand(n, device=device) * 0.02 + 0.001).to(torch.float16)
        base = time_calls([lambda: w4a4_gemm_swapped_triton(q8, s8, qweight, w_scale, k)]).median_us
        rows.append({"n": n, "k": k, "m": args.m, "walk": "none", "per_row": 0, "us": base})
        for j in PER_ROW:
            res = residual_per_row(n, k, j, device)
            ref = zipper_gemm_reference(packed, scale, qweight.cpu(), w_scale.cpu(), k, res.to("cpu"), out_fp32=True)
            for walk, asm in [(w, True) for w in RESIDUAL_WALKS] + [("fp8", False)]:
                out = w4a4_gemm_swapped_triton(q8, s8, qweight, w_scale, k, residual=res, residual_walk=walk,
                                               e4m3_asm=asm)
                err = ((out.float().cpu() - ref).abs().max() / ref.abs().max()).item()
                us = time_calls([lambda res=res, walk=walk, asm=asm: w4a4_gemm_swapped_triton(
                    q8, s8, qweight, w_scale, k, residual=res, residual_walk=walk, e4m3_asm=asm)]).median_us
                name = walk if asm else f"{walk}_cc"
                rows.append({"n": n, "k": k, "m": args.m, "walk": name, "per_row": j, "us": us, "rel_err": err})
        shown = [r for r in rows if r["n"] == n]
        print(f"{n}x{k} M={args.m}: dense {base:.1f} us; " + "; ".join(
            f"{r['walk']} j={r['per_row']}: {r['us'] / base:.2f}x (err {r['rel_err']:.1e})" for r in shown[1:]), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "swapped_residual.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
