"""Kept: the measurement behind _tiles.SWAP_REM_SPLIT_*.

The swapped prefill GEMM with its last, partial wave split over K (``rem_split``) against the unsplit launch.

At the prefill tiles (128 weight rows x 128 tokens, 8 warps: two programs an SM, 264 at once on the H200) a GEMM
of ``T`` tiles runs ``T // 264`` whole waves and a last one of ``T mod 264`` tiles. Where that last wave is short
(Qwen3-14B's o_proj and down_proj at 2048 tokens: 640 tiles, 2 waves and 112 tiles), its tiles can run split
over K, ``F`` programs a tile, so the wave takes about ``1 / F`` of the time
(``_tiles.swapped_rem_split``, whose bounds come from this script's measurements:).

For every SPEC model's linears (``zipper.MODELS``) and every M asked for, where the tiles leave a partial last
wave, times the GEMM alone (split8 activations quantized outside the timing, weights rotated through more than L2,
medians of interleaved rounds): ``whole`` (``rem_split=1``) and ``split2`` / ``split4`` / ... (the last wave split
that many ways), dense and with a 10 % residual of power-of-two scales on the shared walk (what MosaicQuant's
layers run). Each variant is checked against the PyTorch reference first. Prints, per cell, the last wave's fill
and each split's time over the whole launch's.

    PYTHONPATH=. python3 benchmarks/prototypes/wave_split.py [--ms 512,1024,2048,4096,8192] [--splits 2,4] [--rounds 3]
        [--models qwen3-14b,...] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path[:0] = [str(Path(__file__).resolve().parents[1] / part) for part in ("kernels", "prototypes")]

from walk_preload import interleaved_medians, report_checks, save_rows  # noqa: E402
from zipper import MODELS, check, clone_residual, random_residual, random_w4_copies  # noqa: E402

from mosaicquant.kernels import _tiles  # noqa: E402
from mosaicquant.kernels.act_quant import quantize_activations_triton  # noqa: E402
from mosaicquant.kernels.w4a4_gemm import w4a4_gemm_reference, w4a4_gemm_swapped_triton  # noqa: E402
from mosaicquant.kernels.zipper import zipper_gemm_reference  # noqa: E402
from mosaicquant.methods.format import residual_shifts  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", default="512,1024,2048,4096,8192")
    parser.add_argument("--splits", default="2,4")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--layers", default="qkv,o,gate_up,down")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("wave_split.py times GPU kernels: no CUDA device here", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    splits = [int(v) for v in args.splits.split(",") if v]
    slots = _tiles._prefill_slots(device)
    shapes: dict[tuple[int, int], list[str]] = {}
    for model in args.models.split(","):
        for layer in args.layers.split(","):
            shapes.setdefault(MODELS[model][layer], []).append(f"{model}.{layer}")
    rows, table = [], []
    for (n, k), names in shapes.items():
        ms = [m for m in (int(v) for v in args.ms.split(","))
              if (t := triton.cdiv(n, 128) * triton.cdiv(m, 128)) >= slots and t % slots]
        if not ms:
            continue
        qws, wss = random_w4_copies(n, k // 2, device)
        res = random_residual(n, k, 0.10, device, gen, w_scale=wss[0])
        ress = [res] + [clone_residual(res) for _ in range(len(qws) - 1)]
        for m in ms:
            tiles = triton.cdiv(n, 128) * triton.cdiv(m, 128)
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            ap, a_s = quantize_activations_triton(x)
            a8, s8 = quantize_activations_triton(x, layout="split8")
            tail = _tiles.swapped_tail(m, 128)
            opts = {"block_m_tail": tail} if tail is not None else {}
            for kind in ("dense", "zip10"):
                if kind == "dense":
                    ref = w4a4_gemm_reference(ap, a_s, qws[0], wss[0], k, out_fp32=True)
                    extra = [{} for _ in qws]
                else:
                    ref = zipper_gemm_reference(ap, a_s, qws[0], wss[0], k, ress[0], out_fp32=True)
                    extra = [dict(residual=r, residual_walk="shared", residual_shifts=residual_shifts(r, w))
                             for r, w in zip(ress, wss)]
                calls = {}
                for f in [1] + splits:
                    label = "whole" if f == 1 else f"split{f}"
                    calls[label] = [lambda i=i, f=f: w4a4_gemm_swapped_triton(a8, s8, qws[i], wss[i], k, rem_split=f,
                                                                              **extra[i], **opts)
                                    for i in range(len(qws))]
                fill = (tiles % slots) / slots
                med = interleaved_medians(calls, args.rounds, lambda v, fn: check(fn(), ref)[0],
                                          dict(layer=",".join(names), kind=kind, n=n, k=k, m=m, tiles=tiles,
                                               last_wave_fill=fill), rows)
                table.append((",".join(names), kind, m, tiles, fill, med))
                print(f"{','.join(names):24s} {kind:5s} M={m:5d} tiles {tiles} (last wave {fill:.0%}): "
                      + "  ".join(f"{v} {u:.1f}" for v, u in med.items()), flush=True)
                save_rows(args.out, rows)
        torch.cuda.empty_cache()
    failed = report_checks(rows)
    labels = [f"split{f}" for f in splits]
    print("\n| layers | kind | M | tiles | last wave | whole µs | " + " | ".join(f"{v} / whole" for v in labels) + " |")
    print("|---" * (6 + len(labels)) + "|")
    for names, kind, m, tiles, fill, med in table:
        print(f"| {names} | {kind} | {m} | {tiles} | {fill:.0%} | {med['whole']:.1f} | "
              + " | ".join(f"{med[v] / med['whole']:.3f}" for v in labels) + " |")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
