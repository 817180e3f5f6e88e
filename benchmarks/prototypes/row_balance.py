"""Kept: what the spread of kept blocks over block rows costs ZipperEngine.

What the spread of kept blocks over block rows costs ZipperEngine, on the GPU.

A budget of 10 % of the 128 × 128 blocks keeps, on average, a tenth of each block row's blocks; placed at random
(MosaicQuant's data-free speed form; after a rotation the method's own choice is close to that) a row keeps a
binomial number, and the row that keeps the most sets the time of every kernel whose programs each walk one row
(unsplit tiles: gate/up at decode sizes, the single-token GEMV). This script times ``QuantLinear`` (BF16 in, BF16
out, activation quantization included, as it routes each call) on the SPEC linears of Llama-3-8B and Qwen3-8B with
the same budget placed two ways:

- ``random``: the blocks at random over the layer (``benchmarks/kernels/zipper.py``'s ``random_residual``);
- ``balanced``: every block row keeps the same number of blocks (give or take one), in random columns;

next to ``dense`` (no residual). Power-of-two residual scales (``rscale=pow2``, the default). Weights rotated
through more than L2, medians of interleaved rounds, every variant checked against the PyTorch reference first.

    PYTHONPATH=. python3 benchmarks/prototypes/row_balance.py [--ms 1,4,8,16,24,32,2048] [--rounds 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path[:0] = [str(Path(__file__).resolve().parents[1] / part) for part in ("kernels", "prototypes")]

from zipper import BLOCK, MODELS, ROTATE_BYTES, check, random_residual, time_calls  # noqa: E402

from mosaicquant.kernels.act_quant import quantize_activations_reference  # noqa: E402
from mosaicquant.kernels.quant_linear import QuantLinear  # noqa: E402
from mosaicquant.kernels.zipper import zipper_gemm_reference  # noqa: E402
from mosaicquant.methods.format import PackedW4, ResidualBlocks  # noqa: E402

BUDGET = 0.10
VARIANTS = ("dense", "random", "balanced")


def balanced_residual(n: int, k: int, budget: float, device, gen: torch.Generator,
                      w_scale: torch.Tensor) -> ResidualBlocks:
    """``round(budget · blocks)`` kept blocks, every block row keeping the same number give or take one (random
    columns), with power-of-two scales of ``w_scale`` as in ``random_residual``."""
    bn, bk = BLOCK
    nbr, nbc = -(-n // bn), -(-k // bk)
    nb = int(round(budget * nbr * nbc))
    per_row = torch.full((nbr,), nb // nbr, dtype=torch.long)
    per_row[torch.randperm(nbr, generator=gen)[:nb % nbr]] += 1
    cols = [torch.randperm(nbc, generator=gen)[:int(c)].sort().values for c in per_row]
    coords = torch.stack([torch.arange(nbr).repeat_interleave(per_row), torch.cat(cols)], 1).to(torch.int32)
    row_ptr = torch.zeros(nbr + 1, dtype=torch.int32)
    row_ptr[1:] = torch.cumsum(per_row, 0).to(torch.int32)
    values = torch.randint(0, 256, (nb, bn, bk // 2), dtype=torch.uint8, generator=gen)
    rows = (coords[:, 0].long().unsqueeze(1) * bn + torch.arange(bn)).clamp(max=n - 1)
    shifts = torch.randint(0, 5, (nb, bn), generator=gen)
    scales = (w_scale.cpu().float()[rows] * 2.0 ** -shifts).to(torch.float16)
    return ResidualBlocks((n, k), BLOCK, coords, row_ptr, values, scales).to(device)


def layers(n: int, k: int, device, gen: torch.Generator) -> list[dict[str, QuantLinear]]:
    """Copies (more than L2 together) of one random base with no residual, a random and a balanced 10 % residual."""
    out = []
    for _ in range(max(2, math.ceil(ROTATE_BYTES / (n * k // 2 * 1.15)))):
        qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
        w_scale = (torch.rand(n, device=device) * 0.01 + 0.001).to(torch.float16)
        res = {"random": random_residual(n, k, BUDGET, device, gen, w_scale=w_scale),
               "balanced": balanced_residual(n, k, BUDGET, device, gen, w_scale)}
        packed = {"dense": PackedW4((n, k), qweight, w_scale.unsqueeze(1))}
        for v, r in res.items():
            packed[v] = PackedW4((n, k), qweight, w_scale.unsqueeze(1), residual=r)
        out.append({v: QuantLinear(p).to(device) for v, p in packed.items()})
    return out


def row_spread(ql: QuantLinear) -> str:
    counts = torch.diff(ql.residual.row_ptr.long())
    return f"{int(counts.min())}-{int(counts.max())} (mean {counts.float().mean():.1f})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", default="1,4,8,16,24,32,2048")
    parser.add_argument("--models", default="llama3-8b,qwen3-8b")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("row_balance.py times GPU kernels: no CUDA device here", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    shapes = {}
    for model in args.models.split(","):
        for name, nk in MODELS[model].items():
            shapes.setdefault(nk, f"{model}.{name}")
    rows, table = [], []
    for (n, k), name in shapes.items():
        qls = layers(n, k, device, gen)
        spread = {v: row_spread(qls[0][v]) for v in ("random", "balanced")}
        print(f"{name} {n}x{k}: blocks a row, random {spread['random']}, balanced {spread['balanced']}", flush=True)
        for m in (int(v) for v in args.ms.split(",")):
            x = (torch.randn(m, k) * 2).to(torch.bfloat16)
            a_p, a_s = quantize_activations_reference(x)
            x = x.to(device)
            refs = {v: zipper_gemm_reference(a_p, a_s, qls[0][v].qweight.cpu(), qls[0][v].w_scale.cpu(), k,
                                             qls[0][v].residual.to("cpu"), out_fp32=True)
                    for v in ("random", "balanced")}
            times = {v: [] for v in VARIANTS}
            for rnd in range(args.rounds):
                for v in VARIANTS:
                    ok = True
                    if v in refs:
                        ok = check(qls[0][v](x).cpu(), refs[v])[0]
                    us = time_calls([lambda q=q[v]: q(x) for q in qls])[0]
                    times[v].append(us)
                    rows.append(dict(layer=name, n=n, k=k, m=m, variant=v, round=rnd, us=us, ok=ok,
                                     blocks_per_row=spread.get(v)))
            med = {v: sorted(t)[len(t) // 2] for v, t in times.items()}
            table.append((name, n, k, m, med))
            print(f"{name:18s} M={m:5d}: " + "  ".join(f"{v} {u:.2f}" for v, u in med.items()), flush=True)
            if args.out is not None:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    failed = [r for r in rows if not r["ok"]]
    print(f"checks: {len(rows) - len(failed)} ok, {len(failed)} FAILED")
    print("| layer | M | dense | random | balanced | random / dense | balanced / dense | balanced / random |")
    for name, n, k, m, d in table:
        print(f"| {name} | {m} | {d['dense']:.2f} | {d['random']:.2f} | {d['balanced']:.2f} | "
              f"{d['random'] / d['dense']:.3f} | {d['balanced'] / d['dense']:.3f} | {d['balanced'] / d['random']:.3f} |")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
