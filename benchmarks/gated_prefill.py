"""SiLU·mul written by the swapped prefill GEMM of a stacked [gate | up] layer, against the SiLU·mul kernel after it.

Variants, per gate/up shape and prefill M (GEMM on ``split8`` activations, as the fused decoder runs it):

- ``gemm``: the swapped GEMM's ``[M, 2I]`` output alone;
- ``plain``: that GEMM, then :func:`mosaicquant.kernels.decoder.silu_mul` (what the decoder ran before);
- ``gated``: the GEMM with ``gated=True``: each program runs a gate tile and then its up tile and writes
  ``bf16(silu(gate)) · up`` (``[M, I]``), no ``[M, 2I]`` output and no SiLU·mul kernel.

Each with no residual (``dense``) and with a 10 % residual of 128 × 128 blocks at random positions, power-of-two
scales (MosaicQuant's ``rscale=pow2``, the shared walk). ``gated`` is checked bit for bit against ``plain``. Weights
rotate through more than L2; medians of CUDA-graph replays, ``--rounds`` interleaved rounds; the table last gives µs
and ``gated`` ÷ ``plain``.

Usage (GPU)::

    python benchmarks/gated_prefill.py [--out DIR] [--ms 512,2048,8192] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mosaicquant.harness.results import source_fingerprint  # noqa: E402
from mosaicquant.harness.timing import time_calls  # noqa: E402
from mosaicquant.kernels.act_quant import quantize_activations_triton  # noqa: E402
from mosaicquant.kernels.decoder import silu_mul  # noqa: E402
from mosaicquant.kernels.w4a4_gemm import w4a4_gemm_swapped_triton  # noqa: E402
from mosaicquant.methods.format import residual_shifts  # noqa: E402
from zipper import ROTATE_BYTES, random_residual  # noqa: E402  (benchmarks/zipper.py)

# stacked gate/up of the SPEC's models: [2 I, hidden]
SHAPES = {"llama3_8b": (28672, 4096), "qwen3_8b": (24576, 4096), "qwen3_14b": (34816, 5120),
          "llama32_3b": (16384, 3072)}
VARIANTS = ("gemm", "plain", "gated")


def random_layers(n: int, k: int, budget: float, device, gen: torch.Generator) -> list[dict]:
    """Copies of a random packed layer (with a residual at ``budget``) rotating through more than L2."""
    kp = (k + 1) // 2
    count = max(2, math.ceil(ROTATE_BYTES / (n * kp * (1 + budget))))
    layers = []
    for _ in range(count):
        qweight = torch.randint(0, 256, (n, kp), dtype=torch.uint8, generator=gen).to(device)
        w_scale = (torch.rand(n, generator=gen) * 0.01 + 0.001).to(torch.float16).to(device)
        extra = {}
        if budget:
            res = random_residual(n, k, budget, device, gen, w_scale=w_scale)
            extra = dict(residual=res, residual_walk="shared", residual_shifts=residual_shifts(res, w_scale))
        layers.append(dict(qweight=qweight, w_scale=w_scale, extra=extra))
    return layers


def bench(name: str, n: int, k: int, ms: list[int], budget: float, rounds: int, device, gen) -> list[dict]:
    rows = []
    layers = random_layers(n, k, budget, device, gen)
    for m in ms:
        x = (torch.randn(m, k, generator=gen) * 2).to(torch.bfloat16).to(device)
        a8, s8 = quantize_activations_triton(x, layout="split8")
        wide = torch.empty(m, n, dtype=torch.bfloat16, device=device)
        half = torch.empty(m, n // 2, dtype=torch.bfloat16, device=device)
        gated = torch.empty_like(half)

        def gemm(lay, out=wide, **kw):
            return w4a4_gemm_swapped_triton(a8, s8, lay["qweight"], lay["w_scale"], k, **lay["extra"], out=out, **kw)

        calls = {
            "gemm": [lambda lay=lay: gemm(lay) for lay in layers],
            "plain": [lambda lay=lay: silu_mul(gemm(lay), out=half, kernel="triton") for lay in layers],
            "gated": [lambda lay=lay: gemm(lay, out=gated, gated=True) for lay in layers],
        }
        ok = True
        for lay in layers[:2]:
            want = silu_mul(gemm(lay), kernel="triton")
            got = gemm(lay, out=gated, gated=True)
            torch.cuda.synchronize()
            ok = ok and torch.equal(got, want) and bool(torch.isfinite(got.float()).all())
        times = {v: [] for v in VARIANTS}
        for _ in range(rounds):
            for v in VARIANTS:
                times[v].append(time_calls(calls[v]).median_us)
        row = dict(shape=name, n=n, k=k, m=m, budget=budget, check_ok=ok,
                   **{f"{v}_us": statistics.median(times[v]) for v in VARIANTS},
                   **{f"{v}_rounds": times[v] for v in VARIANTS})
        row["gated_over_plain"] = row["gated_us"] / row["plain_us"]
        rows.append(row)
        print(f"{name} M={m} budget={budget}: " + " ".join(f"{v} {row[v + '_us']:.1f}" for v in VARIANTS)
              + f"  gated/plain {row['gated_over_plain']:.3f}  check {'ok' if ok else 'FAILED'}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="directory for results.json")
    ap.add_argument("--ms", default="512,2048,8192")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--budgets", default="0,0.1")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gated_prefill: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    ms = [int(v) for v in args.ms.split(",")]
    rows = []
    for name in args.shapes.split(","):
        if name not in SHAPES:
            print(f"gated_prefill: unknown shape {name!r}; choose from {', '.join(SHAPES)}", file=sys.stderr)
            return 2
        n, k = SHAPES[name]
        for budget in (float(b) for b in args.budgets.split(",")):
            rows += bench(name, n, k, ms, budget, args.rounds, device, gen)
    failed = sum(not r["check_ok"] for r in rows)
    print(f"\nchecks: {len(rows) - failed} ok, {failed} FAILED")
    print("| shape | M | residual | GEMM [M, 2I] µs | + SiLU·mul kernel µs | gated µs | gated ÷ plain |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['m']} | {r['budget']:.0%} | {r['gemm_us']:.1f} | {r['plain_us']:.1f} | "
              f"{r['gated_us']:.1f} | {r['gated_over_plain']:.3f} |")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, fingerprint=source_fingerprint(),
                    rounds=args.rounds)
        (out / "results.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
