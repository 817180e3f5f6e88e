"""Check and time the decode GEMV (dp4a, dense and with the residual) against the tensor-core kernels.

Shapes: the linear layers of Llama-3-8B and Qwen3-8B at M = 1, 4, 8. Variants, each with the
activation quantizer included (as ``benchmarks/zipper.py`` times them):

- ``bf16``: ``F.linear`` (cuBLAS), the baseline of every ratio;
- ``w4a4``: the packed tensor-core GEMM;
- ``zip10``: ZipperEngine (10 % residual) with its default residual walk (``dp4a`` at these M),
  ``zip10_dot``: with the tensor-core walk (the default before the dp4a walk);
- ``gemv`` / ``gemv_zip10``: the decode GEMV at its default tiles, dense and with the 10 %
  residual (programmatic dependent launch on, the default); ``gemv_nopdl``: without it;
- ``--explore``: a grid of GEMV tiles (channels per program, words per step, warps, split,
  stages) at M = 4 on three shapes, reported best first;
- ``--explore-tc``: a grid of the tensor-core GEMM's tiles at M = 4 and 8 on three shapes;
- ``--explore-fq``: the GEMV that quantizes the activations in its prologue
  (``gemv_quantize_triton``, one launch; ``gemv_fq``, ``gemv_zip10_fq`` at the default tiles) and a grid
  of its tiles (wider output tiles quantize the activations fewer times) on every shape, each checked
  bit for bit against the quantizer's launch + the GEMV.

Each variant is checked against its PyTorch reference before it is timed (CUDA graphs, weights
rotating through copies larger than 3× L2, medians). A short table is printed last; rows go
to ``results.json`` under ``--out``.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/gemv.py --out $OUT [--explore] [--explore-fq] [--ms 1,4]
"""

from __future__ import annotations

import argparse
import os
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

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

from mosaicquant.kernels._tiles import TileConfig, pick_config  # noqa: E402
from mosaicquant.kernels.act_quant import quantize_activations_triton  # noqa: E402
from mosaicquant.kernels.gemv import gemv_config, gemv_quantize_triton, gemv_triton  # noqa: E402
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
# tiles of the fused-quantization GEMV: (block_n, block_kw, num_warps, split factor over the default's
# programs at block_n = 32, scaled by block_n / 32)
FQ_GRID = [(32, 64, 4, 1), (64, 64, 4, 1), (64, 32, 4, 1), (128, 64, 8, 1), (128, 32, 4, 1), (256, 32, 8, 1),
           (128, 64, 8, 0.5), (256, 64, 8, 1)]
# tensor-core GEMM tiles at M = 4, 8: (block_n, block_kp, split factor over the default, num_warps, num_stages)
TC_GRID = [(64, 64, 1, 4, 4), (128, 64, 1, 4, 4), (64, 128, 1, 4, 3), (128, 128, 1, 8, 3), (32, 64, 1, 4, 6),
           (64, 64, 1, 4, 6), (64, 64, 2, 4, 4), (64, 64, 0.5, 4, 4), (128, 64, 1, 8, 4), (256, 64, 1, 8, 3)]


def bench(name, n, k, ms, device, rows, explore, explore_tc=False, explore_fq=False):
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
        if explore_fq:
            default_split = gemv_config(m, n, k, device)["split_k"]
            grid = [("gemv_fq", {}, None), ("gemv_zip10_fq", {}, ress)]
            for bn, bkw, warps, f in FQ_GRID:
                split = max(1, min(64, int(default_split * f * bn / 32)))
                grid.append((f"fq_bn{bn}_kw{bkw}_w{warps}_s{split}",
                             {"block_n": bn, "block_kw": bkw, "num_warps": warps, "split_k": split}, None))
            for variant, opts, rs in grid:
                two = gemv_triton(ap, a_s, qweight, w_scale, k, residual=rs and rs[0], **opts)
                one = gemv_quantize_triton(x, qweight, w_scale, k, residual=rs and rs[0], **opts)
                add(variant, [lambda i=i, o=opts, rs=rs: gemv_quantize_triton(x, qws[i], wss[i], k, residual=rs and rs[i],
                                                                             **o)
                              for i in range(n_w4)], one, ref_zip if rs else ref_dense, {"explore_fq": opts},
                    same=torch.equal(one, two))
                if opts:  # the same tiles with the quantizer's own launch before the GEMV
                    g = quant_then(lambda a, s, i, o=opts: gemv_triton(a, s, qws[i], wss[i], k, **o))
                    add("two_" + variant[3:], [lambda i=i, g=g: g(i) for i in range(n_w4)], g(0), ref_dense,
                        {"explore_fq": opts})
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
    ap.add_argument("--explore-fq", action="store_true")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    args = ap.parse_args(argv)
    ms = [int(v) for v in args.ms.split(",")]
    # GEMMs timed back to back: without the decode step's PDL chain a GEMM never lets the next timed one
    # start early, so each time is one GEMM's (set MOSAICQUANT_PDL_CHAIN=on to time them chained)
    os.environ.setdefault("MOSAICQUANT_PDL_CHAIN", "off")
    device = torch.device("cuda")
    rows: list[dict] = []
    info = {"versions": versions(device), "ceilings": measure_ceilings(device)}
    print(info, flush=True)
    for name in args.shapes.split(","):
        bench(name, *SHAPES[name], ms, device, rows, args.explore, args.explore_tc, args.explore_fq)
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
    if args.explore_fq:
        print("\n| shape | M | GEMV, quantizer launched | fused, default tiles | best fused tiles | µs | same tiles, "
              "quantizer launched | (µs) |")
        print("|---|---|---|---|---|---|---|---|")
        for name in args.shapes.split(","):
            for m in ms:
                sel = {r["variant"]: r for r in rows if r["shape"] == name and r["m"] == m}
                ex = sorted((r for r in sel.values() if r["variant"].startswith("fq_")), key=lambda r: r["us"])
                if not ex or "gemv" not in sel or "gemv_fq" not in sel:
                    continue
                best = ex[0]
                two = sel.get("two_" + best["variant"][3:])
                print(f"| {name} | {m} | {sel['gemv']['us']:.2f} | {sel['gemv_fq']['us']:.2f} | {best['variant']} | "
                      f"{best['us']:.2f} | {two['us'] if two else float('nan'):.2f} | |")
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
    sys.exit(main())
