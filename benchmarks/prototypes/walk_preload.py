"""Kept: the measurement behind the tile table's walk_preload_max_m; the prototypes share its timing helpers.

ZipperEngine's tail walk with its first kept block loaded before the dense loop, off and on at every size
(the tile table's ``walk_preload_max_m``: by default on up to 8 tokens), at decode sizes.

A program reaches its residual walk after its dense loop, and the walk's first block is a chain of dependent loads
(its coordinates, then its integers and activation tile). With the preload those loads are issued before the
dense loop. This script times, on the Llama-3-8B linears (GEMM alone, activations quantized outside the timing,
weights and residual blocks rotated through more than L2, medians of interleaved rounds):

- ``w4a4``: the dense GEMM (budget 0);
- ``zip10_off`` / ``zip10_pre``: ZipperEngine with 10 % of the blocks kept at random, ``mode="auto"`` (the walk runs
  where auto picks the tail mode: o and down from 5 tokens, every layer from 17), preload off / on.

Each ZipperEngine call is checked against the PyTorch reference before it is timed.

    PYTHONPATH=. python3 benchmarks/prototypes/walk_preload.py [--ms 8,16,32] [--rounds 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path[:0] = [str(Path(__file__).resolve().parents[1] / part) for part in ("kernels", "prototypes")]

from residual_balance import SHAPES, capped  # noqa: E402
from zipper import check, clone_residual, random_residual, random_w4_copies, time_calls  # noqa: E402

from mosaicquant import settings  # noqa: E402
from mosaicquant.kernels.act_quant import quantize_activations_triton  # noqa: E402
from mosaicquant.kernels.w4a4_gemm import w4a4_gemm_triton  # noqa: E402
from mosaicquant.kernels.zipper import residual_block_map, zipper_gemm_reference, zipper_gemm_triton  # noqa: E402


def decode_gemm_args(argv, doc: str, script: str, ms: str = "8,16,32") -> argparse.Namespace | None:
    """``--ms`` / ``--rounds`` / ``--out`` of a script timing decode GEMMs alone; ``None`` (having said why) without a
    CUDA device; seeds torch (the script's main runs with the PDL chain off, so each time is one GEMM's); ``args.gen`` is a seeded CPU generator."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--ms", default=ms)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{script} times GPU kernels: no CUDA device here", file=sys.stderr)
        return None
    torch.manual_seed(0)
    args.gen = torch.Generator().manual_seed(0)
    return args


def interleaved_medians(calls: dict, rounds: int, checked, base: dict, rows: list) -> dict[str, float]:
    """Median µs of each variant's ``calls`` (closures cycled in order) over ``rounds`` interleaved rounds; each
    round first runs ``checked(variant, fn)`` (bool) on the variant's first call and appends a row
    (``base`` plus variant, round, us, ok) to ``rows``."""
    times = {}
    for rnd in range(rounds):
        for variant, fns in calls.items():
            ok = checked(variant, fns[0])
            us = time_calls(fns)[0]
            times.setdefault(variant, []).append(us)
            rows.append(dict(base, variant=variant, round=rnd, us=us, ok=ok))
    return {v: sorted(u)[len(u) // 2] for v, u in times.items()}


def save_rows(out: Path | None, rows: list) -> None:
    """``rows`` as ``OUT/results.json`` (rewritten after each cell, so an interrupted run keeps what it timed)."""
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(rows, indent=1))


def report_checks(rows: list) -> bool:
    """Print the checks' tally; whether any failed."""
    failed = [r for r in rows if not r["ok"]]
    print(f"checks: {len(rows) - len(failed)} ok, {len(failed)} FAILED")
    return bool(failed)


def main(argv=None) -> int:
    args = decode_gemm_args(argv, __doc__, "walk_preload.py")
    if args is None:
        return 2
    device, gen = torch.device("cuda"), args.gen
    rows = []
    for name, (n, k) in SHAPES.items():
        qws, wss = random_w4_copies(n, k // 2, device)
        r = random_residual(n, k, 0.10, device, gen)
        rs = [r] + [clone_residual(r) for _ in range(len(qws) - 1)]
        maps = [residual_block_map(x) for x in rs]
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            ap, a_s = quantize_activations_triton(x)
            zref = zipper_gemm_reference(ap, a_s, qws[0], wss[0], k, rs[0], out_fp32=True)
            calls = {"w4a4": [lambda i=i: w4a4_gemm_triton(ap, a_s, qws[i], wss[i], k) for i in range(len(qws))]}
            for tag, pre in (("off", False), ("pre", True)):
                calls[f"zip10_{tag}"] = [capped(("walk_preload_max_m", m if pre else 0), lambda i=i: zipper_gemm_triton(
                    ap, a_s, qws[i], wss[i], k, rs[i], block_map=maps[i]))
                    for i in range(len(qws))]
            med = interleaved_medians(calls, args.rounds, lambda v, fn: v == "w4a4" or check(fn(), zref)[0],
                                      dict(layer=name, n=n, k=k, m=m), rows)
            print(f"{name:8s} M={m:3d}  w4a4 {med['w4a4']:7.2f}  zip10 off {med['zip10_off']:7.2f}  "
                  f"pre {med['zip10_pre']:7.2f}  pre/off {med['zip10_pre'] / med['zip10_off']:.3f}", flush=True)
            save_rows(args.out, rows)
    return 1 if report_checks(rows) else 0


if __name__ == "__main__":
    # GEMMs timed back to back: without the decode step's PDL chain a GEMM never lets the next timed one start
    # early, so each time is one GEMM's
    with settings.use(pdl_chain="off"):
        raise SystemExit(main())
