"""Kept: the measurement behind the tile table's swap_row_order.

The swapped prefill GEMM's weight-row tiles in the order of their residual work, against the grouped order.

A program of the swapped GEMM walks its block row's kept blocks after the dense loop, so its time grows with their
count (a binomial number at random positions: 0-9 of 32 block columns at 10 %). ``row_order``
(:func:`mosaicquant.kernels.w4a4_gemm.row_tile_order`) starts the heavy rows' tiles first, so that the last wave
holds the light ones. Variants, GEMM alone on ``split8`` activations:

- ``dense``: no residual;
- ``shared``: a 10 % residual of 128 × 128 blocks at random positions with power-of-two scales (the shared walk,
  MosaicQuant's default), grouped order;
- ``ordered``: the same with ``row_order``.

``ordered`` is checked bit for bit against ``shared`` with the last wave unsplit (``rem_split=1``; where the
launcher splits it, the order changes which tiles it takes). Weights rotate through more than L2; medians of CUDA-graph
replays, ``--rounds`` interleaved rounds. The table last gives µs, the residual's cost over ``dense`` in each order
and ``ordered`` ÷ ``shared``.

Usage (GPU)::

    python benchmarks/prototypes/row_order.py [--out DIR] [--ms 512,2048,8192] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path[:0] = [str(Path(__file__).resolve().parents[1] / part) for part in ("kernels", "prototypes")]

from mosaicquant.harness.results import source_fingerprint  # noqa: E402
from mosaicquant.harness.timing import time_calls  # noqa: E402
from mosaicquant.kernels.act_quant import quantize_activations_triton  # noqa: E402
from mosaicquant.kernels.w4a4_gemm import row_tile_order, w4a4_gemm_swapped_triton  # noqa: E402
from mosaicquant.methods.format import residual_shifts  # noqa: E402
from zipper import ROTATE_BYTES, random_residual  # noqa: E402  (benchmarks/kernels/zipper.py)

# [N, K] of the SPEC models' linears (q/k/v and gate/up stacked)
SHAPES = {
    "llama3_8b_qkv": (6144, 4096), "llama3_8b_o": (4096, 4096), "llama3_8b_gate_up": (28672, 4096),
    "llama3_8b_down": (4096, 14336), "qwen3_8b_gate_up": (24576, 4096), "qwen3_8b_down": (4096, 12288),
    "qwen3_14b_qkv": (7168, 5120), "qwen3_14b_o": (5120, 5120), "qwen3_14b_down": (5120, 17408),
}
VARIANTS = ("dense", "shared", "ordered")
BUDGET = 0.10


def random_layers(n: int, k: int, device, gen: torch.Generator) -> list[dict]:
    """Copies of a random packed layer with a 10 % residual, rotating through more than L2."""
    kp = (k + 1) // 2
    layers = []
    for _ in range(max(2, math.ceil(ROTATE_BYTES / (n * kp * (1 + BUDGET))))):
        qweight = torch.randint(0, 256, (n, kp), dtype=torch.uint8, generator=gen).to(device)
        w_scale = (torch.rand(n, generator=gen) * 0.01 + 0.001).to(torch.float16).to(device)
        res = random_residual(n, k, BUDGET, device, gen, w_scale=w_scale)
        layers.append(dict(qweight=qweight, w_scale=w_scale, residual=res, shifts=residual_shifts(res, w_scale),
                           order=row_tile_order(res, 128)))
    return layers


def bench(name: str, n: int, k: int, ms: list[int], rounds: int, device, gen) -> list[dict]:
    rows = []
    layers = random_layers(n, k, device, gen)
    kept = (layers[0]["residual"].row_ptr[1:] - layers[0]["residual"].row_ptr[:-1])
    for m in ms:
        x = (torch.randn(m, k, generator=gen) * 2).to(torch.bfloat16).to(device)
        a8, s8 = quantize_activations_triton(x, layout="split8")
        out = torch.empty(m, n, dtype=torch.bfloat16, device=device)

        def gemm(lay, variant, out=out, **kw):
            extra = dict(kw)
            if variant != "dense":
                extra.update(residual=lay["residual"], residual_walk="shared", residual_shifts=lay["shifts"])
            if variant == "ordered":
                extra["row_order"] = lay["order"]
            return w4a4_gemm_swapped_triton(a8, s8, lay["qweight"], lay["w_scale"], k, **extra, out=out)

        calls = {v: [lambda lay=lay, v=v: gemm(lay, v) for lay in layers] for v in VARIANTS}
        ok = True
        for lay in layers[:2]:
            # bit for bit where no tile is split (the last-wave split takes other tiles in another order)
            want = gemm(lay, "shared", out=torch.empty_like(out), rem_split=1).clone()
            got = gemm(lay, "ordered", out=torch.empty_like(out), rem_split=1)
            torch.cuda.synchronize()
            ok = ok and torch.equal(got, want)
        times = {v: [] for v in VARIANTS}
        for _ in range(rounds):
            for v in VARIANTS:
                times[v].append(time_calls(calls[v]).median_us)
        row = dict(shape=name, n=n, k=k, m=m, check_ok=ok, kept_min=int(kept.min()), kept_max=int(kept.max()),
                   kept_mean=float(kept.float().mean()),
                   **{f"{v}_us": statistics.median(times[v]) for v in VARIANTS},
                   **{f"{v}_rounds": times[v] for v in VARIANTS})
        row["shared_over_dense"] = row["shared_us"] / row["dense_us"] - 1
        row["ordered_over_dense"] = row["ordered_us"] / row["dense_us"] - 1
        row["ordered_over_shared"] = row["ordered_us"] / row["shared_us"]
        rows.append(row)
        print(f"{name} M={m}: " + " ".join(f"{v} {row[v + '_us']:.1f}" for v in VARIANTS)
              + f"  ordered/shared {row['ordered_over_shared']:.3f}  check {'ok' if ok else 'FAILED'}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="directory for results.json")
    ap.add_argument("--ms", default="512,2048,8192")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("row_order: needs a CUDA GPU", file=sys.stderr)
        return 2
    names = args.shapes.split(",")
    unknown = [s for s in names if s not in SHAPES]
    if unknown:
        print(f"row_order: unknown shape(s) {', '.join(unknown)}; choose from {', '.join(SHAPES)}", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    ms = [int(v) for v in args.ms.split(",")]
    rows = []
    for name in names:
        rows += bench(name, *SHAPES[name], ms, args.rounds, device, gen)
    failed = sum(not r["check_ok"] for r in rows)
    print(f"\nchecks: {len(rows) - failed} ok, {failed} FAILED")
    print("| layer | M | kept a block row (min-max) | dense µs | grouped µs | ordered µs | residual, grouped | "
          "residual, ordered | ordered ÷ grouped |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['m']} | {r['kept_min']}-{r['kept_max']} | {r['dense_us']:.1f} | "
              f"{r['shared_us']:.1f} | {r['ordered_us']:.1f} | {r['shared_over_dense']:+.1%} | "
              f"{r['ordered_over_dense']:+.1%} | {r['ordered_over_shared']:.3f} |")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, fingerprint=source_fingerprint(),
                    rounds=args.rounds)
        (out / "results.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
