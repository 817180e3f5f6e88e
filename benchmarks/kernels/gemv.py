"""Check and time the decode GEMV (dp4a, dense and with the residual) against the tensor-core kernels.

Shapes: the linear layers of Llama-3-8B and Qwen3-8B at M = 1, 4, 8. Variants, each with the
activation quantizer included (as ``benchmarks/kernels/zipper.py`` times them):

- ``bf16``: ``F.linear`` (cuBLAS), the baseline of every ratio;
- ``w4a4``: the packed tensor-core GEMM;
- ``zip10``: ZipperEngine (10 % residual) with its default residual walk (``dp4a`` at these M),
  ``zip10_dot``: with the tensor-core walk (the default before the dp4a walk);
- ``gemv`` / ``gemv_zip10``: the decode GEMV at its default tiles, dense and with the 10 %
  residual (programmatic dependent launch on, the default); ``gemv_nopdl``: without it;
- ``--explore``: a grid of GEMV tiles (channels per program, words per step, warps, split,
  stages) at M = 4 on three shapes, reported best first;
- ``--explore-tc``: a grid of the tensor-core GEMM's tiles at M = 4 and 8 on three shapes;

Each variant is checked against its PyTorch reference before it is timed (CUDA graphs, weights
rotating through copies larger than 3× L2, medians). A short table is printed last; rows go
to ``results.json`` under ``--out``.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/kernels/gemv.py --out $OUT [--explore] [--ms 1,4]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path[:0] = [str(Path(__file__).resolve().parents[1] / part) for part in ("kernels", "prototypes")]

from zipper import (  # noqa: E402
    ROTATE_BYTES,
    check,
    clone_residual,
    measure_ceilings,
    random_residual,
    random_w4_copies,
    time_calls,
    versions,
)

from mosaicquant import settings  # noqa: E402
from mosaicquant.kernels._tiles import TileConfig, pick_config  # noqa: E402
from mosaicquant.kernels.act_quant import quantize_activations_triton  # noqa: E402
from mosaicquant.kernels.gemv import gemv_config, gemv_triton  # noqa: E402
from mosaicquant.kernels.w4a4_gemm import w4a4_gemm_reference, w4a4_gemm_triton  # noqa: E402
from mosaicquant.kernels.zipper import residual_block_map, zipper_gemm_reference, zipper_gemm_triton  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "qwen_gate_up": (24576, 4096), "qwen_down": (4096, 12288)}
MS = (1, 2, 4, 8)
EXPLORE_SHAPES = ("o", "gate_up", "down")
# (block_n, block_kw, num_warps, split factor over the default, num_stages)
GRID = [(bn, bkw, w, f, s) for bn, bkw, w in [(16, 64, 4), (32, 32, 4), (32, 64, 4), (32, 128, 4), (64, 64, 4),
                                               (64, 64, 8), (64, 128, 8), (128, 32, 4), (16, 128, 4)]
        for f in (0.5, 1, 2) for s in (1,)] + [(32, 64, 4, 1, 3), (64, 64, 8, 1, 3)]
# tensor-core GEMM tiles at M = 4, 8: (block_n, block_kp, split factor over the default, num_warps, num_stages)
TC_GRID = [(64, 64, 1, 4, 4), (128, 64, 1, 4, 4), (64, 128, 1, 4, 3), (128, 128, 1, 8, 3), (32, 64, 1, 4, 6),
           (64, 64, 1, 4, 6), (64, 64, 2, 4, 4), (64, 64, 0.5, 4, 4), (128, 64, 1, 8, 4), (256, 64, 1, 8, 3)]


def bench(name, n, k, ms, device, rows, explore, explore_tc=False):
    kp = k // 2
    w_bf16 = (torch.randn(n, k, device=device) * 0.02).to(torch.bfloat16)
    w_bf16s = [w_bf16] + [w_bf16.clone() for _ in range(max(2, math.ceil(ROTATE_BYTES / w_bf16.numel() / 2)) - 1)]
    qws, wss = random_w4_copies(n, kp, device)
    qweight, w_scale, n_w4 = qws[0], wss[0], len(qws)
    res = random_residual(n, k, 0.10, device, torch.Generator().manual_seed(n + k))
    ress = [res] + [clone_residual(res) for _ in range(n_w4 - 1)]
    maps = [residual_block_map(r) for r in ress]
    for m in ms:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        x[:, :: max(1, k // 7)] *= 8
        ap, a_s = quantize_activations_triton(x)
        ref_dense = w4a4_gemm_reference(ap, a_s, qweight, w_scale, k, out_fp32=True)
        ref_zip = zipper_gemm_reference(ap, a_s, qweight, w_scale, k, res, out_fp32=True)
        base_us = {}

        def add(variant, calls, out, ref, extra=None, same=True):
            ok, rel = check(out, ref) if ref is not None else (True, 0.0)
            ok = ok and same  # same: the bit-for-bit check a variant brings along
            us, spread, _ = time_calls(calls, min_us=400.0, replays=15)
            if variant == "bf16":
                base_us[m] = us
            row = {"shape": name, "n": n, "k": k, "m": m, "variant": variant, "us": us, "spread": spread,
                   "x_bf16": base_us[m] / us, "ok": ok, "rel_err": rel, **(extra or {})}
            rows.append(row)
            print(f"{name:13s} M={m:<2d} {variant:28s} {us:8.2f} µs  {row['x_bf16']:5.2f}x  ok={ok}", flush=True)
            return row

        add("bf16", [lambda i=i: F.linear(x, w_bf16s[i]) for i in range(len(w_bf16s))], None, None)

        def quant_then(gemm):
            def call(i):
                a, s = quantize_activations_triton(x)
                return gemm(a, s, i)
            return call

        dense_tc = quant_then(lambda a, s, i: w4a4_gemm_triton(a, s, qws[i], wss[i], k))
        add("w4a4", [lambda i=i: dense_tc(i) for i in range(n_w4)], dense_tc(0), ref_dense)
        for variant, walk in (("zip10", "auto"), ("zip10_dot", "dot")):
            z = quant_then(lambda a, s, i, w=walk: zipper_gemm_triton(a, s, qws[i], wss[i], k, ress[i],
                                                                      block_map=maps[i], residual_walk=w))
            add(variant, [lambda i=i, z=z: z(i) for i in range(n_w4)], z(0), ref_zip)
        for variant, opts in (("gemv", {}), ("gemv_nopdl", {"pdl": False})):
            g = quant_then(lambda a, s, i, o=opts: gemv_triton(a, s, qws[i], wss[i], k, **o))
            add(variant, [lambda i=i, g=g: g(i) for i in range(n_w4)], g(0), ref_dense)
        gz = quant_then(lambda a, s, i: gemv_triton(a, s, qws[i], wss[i], k, residual=ress[i]))
        add("gemv_zip10", [lambda i=i: gz(i) for i in range(n_w4)], gz(0), ref_zip)
        if explore_tc and name in EXPLORE_SHAPES and m in (4, 8):
            base = pick_config(m, n, kp, device)
            zbase = pick_config(m, n, kp, device, res.block_shape)
            for bn, bkp, warps, stages in ((64, 64, 4, 4), (128, 64, 8, 3), (128, 64, 4, 4)):
                cfg = TileConfig(16, bn, bkp, split_k=zbase.split_k if warps == 4 else 1, num_warps=warps,
                                 num_stages=stages)
                z = quant_then(lambda a, s, i, c=cfg: zipper_gemm_triton(a, s, qws[i], wss[i], k, ress[i],
                                                                         block_map=maps[i], config=c))
                add(f"zip10_bn{bn}_kp{bkp}_s{cfg.split_k}_w{warps}_st{stages}",
                    [lambda i=i, z=z: z(i) for i in range(n_w4)], z(0), ref_zip, {"explore_zip": vars(cfg)})
            for bn, bkp, f, warps, stages in TC_GRID:
                cfg = TileConfig(16, bn, bkp, split_k=max(1, int(base.split_k * f)), num_warps=warps,
                                 num_stages=stages)
                g = quant_then(lambda a, s, i, c=cfg: w4a4_gemm_triton(a, s, qws[i], wss[i], k, config=c))
                add(f"tc_bn{bn}_kp{bkp}_s{cfg.split_k}_w{warps}_st{stages}", [lambda i=i, g=g: g(i) for i in range(n_w4)],
                    g(0), ref_dense, {"explore_tc": vars(cfg)})
        if explore and name in EXPLORE_SHAPES and m == 4:
            default_split = gemv_config(m, n, k, device)["split_k"]
            for bn, bkw, warps, f, stages in GRID:
                split = max(1, min(64, int(default_split * f)))
                opts = {"block_n": bn, "block_kw": bkw, "num_warps": warps, "split_k": split, "num_stages": stages}
                g = quant_then(lambda a, s, i, o=opts: gemv_triton(a, s, qws[i], wss[i], k, **o))
                add(f"gemv_bn{bn}_kw{bkw}_w{warps}_s{split}_st{stages}", [lambda i=i, g=g: g(i) for i in range(n_w4)],
                    g(0), ref_dense, {"explore": opts})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--explore", action="store_true")
    ap.add_argument("--explore-tc", action="store_true")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    args = ap.parse_args(argv)
    ms = [int(v) for v in args.ms.split(",")]
    device = torch.device("cuda")
    rows: list[dict] = []
    info = {"versions": versions(device), "ceilings": measure_ceilings(device)}
    print(info, flush=True)
    for name in args.shapes.split(","):
        bench(name, *SHAPES[name], ms, device, rows, args.explore, args.explore_tc)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({**info, "rows": rows}, indent=1))
    bad = [r for r in rows if not r["ok"]]
    print(f"\nchecks: {len(rows) - len(bad)} passed, {len(bad)} failed")
    if args.explore:
        print("\n| shape | best GEMV tiles at M = 4 | µs | × BF16 | default µs |")
        print("|---|---|---|---|---|")
        for name in EXPLORE_SHAPES:
            ex = sorted((r for r in rows if r["shape"] == name and "explore" in r), key=lambda r: r["us"])
            dflt = next((r for r in rows if r["shape"] == name and r["m"] == 4 and r["variant"] == "gemv"), None)
            for r in ex[:3]:
                default_us = f"{dflt['us']:.2f}" if dflt else "-"
                print(f"| {name} | {r['variant']} | {r['us']:.2f} | {r['x_bf16']:.2f} | {default_us} |")
    if args.explore_tc:
        print("\n| shape | M | best tensor-core tiles | µs | × BF16 | default µs |")
        print("|---|---|---|---|---|---|")
        for name in EXPLORE_SHAPES:
            for m in (4, 8):
                ex = sorted((r for r in rows if r["shape"] == name and r["m"] == m and "explore_tc" in r),
                            key=lambda r: r["us"])
                dflt = next((r for r in rows if r["shape"] == name and r["m"] == m and r["variant"] == "w4a4"), None)
                for r in ex[:2]:
                    print(f"| {name} | {m} | {r['variant']} | {r['us']:.2f} | {r['x_bf16']:.2f} | "
                          f"{dflt['us'] if dflt else 0:.2f} |")
    print("\n| shape | M | bf16 µs | w4a4 | zip10 | zip10_dot | gemv | gemv_nopdl | gemv_zip10 | (× BF16) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.shapes.split(","):
        for m in ms:
            sel = {r["variant"]: r for r in rows if r["shape"] == name and r["m"] == m}
            cells = " | ".join(f"{sel[v]['x_bf16']:.2f}" if v in sel else "-"
                               for v in ("w4a4", "zip10", "zip10_dot", "gemv", "gemv_nopdl", "gemv_zip10"))
            print(f"| {name} | {m} | {sel['bf16']['us']:.1f} | {cells} | |")
    return 1 if bad else 0


if __name__ == "__main__":
    # GEMMs timed back to back: without the decode step's PDL chain a GEMM never lets the next timed one start
    # early, so each time is one GEMM's
    with settings.use(pdl_chain="off"):
        raise SystemExit(main())
