"""Kept: the measurement behind _tiles.SWAP_DECODE_M (dense layers' 16-32-token calls on the swapped GEMM).

Decode-sized W4A4 GEMMs: the packed kernel against the operand-swapped one, and cheaper unpacking.

At M <= 32 the 4-bit GEMMs should stream their weights at close to the device's copy rate,
but the packed-activation kernel (``w4a4_gemm_triton``) reached 1.4-1.7 TB/s. Its K loop
unpacks both operands (the activation tile again in every warp) with four to five integer
instructions per four bytes. This script checks and times, for the Llama-3-8B / Qwen3-8B
linears at M = 1 ... 32 (activation quantization included, weights rotated through buffers
larger than L2, CUDA graphs, medians):

- ``bf16``: ``F.linear`` (cuBLAS);
- ``w4a4``: the packed kernel as ``QuantLinear`` runs it today; ``w4a4_x16``: the same with
  both operands unpacked as ``16 q`` (two and one instructions per four bytes, exact);
- ``sw_<cfg>``: split8 activation quantization + the operand-swapped GEMM at decode tiles
  (weights unpacked as ``16 q`` in registers as the first ``wgmma`` operand, int8 activations
  from shared memory, K split across programs); ``cfg`` = weight rows, packed K bytes per step,
  warps, stages; ``sw_<cfg>_x1`` the same with the plain unpacking; ``_nopdl`` without PDL;
- ``zip10``, ``zip10_x16``: the packed ZipperEngine at a 10% residual, plain and ``16 q``;
  ``zip10_sw_<cfg>``: the swapped GEMM with the 10% residual in its tail (FP8 walk).

Usage (GPU)::

    PYTHONUNBUFFERED=1 python benchmarks/prototypes/decode_swap.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / part) for part in ("kernels", "prototypes")]
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import zipper as zb  # noqa: E402  (benchmarks/kernels/zipper.py: shapes, checks, timing, residuals)

from mosaicquant import settings  # noqa: E402
from mosaicquant.kernels._tiles import pdl_default, pick_config  # noqa: E402
from mosaicquant.kernels.act_quant import quantize_activations_triton  # noqa: E402
from mosaicquant.kernels.w4a4_gemm import w4a4_gemm_reference, w4a4_gemm_swapped_triton, w4a4_gemm_triton  # noqa: E402
from mosaicquant.kernels.zipper import residual_block_map, zipper_gemm_reference, zipper_gemm_triton  # noqa: E402

MS = (1, 4, 8, 16, 32)
# (weight rows per program, packed K bytes per step, warps, stages)
CONFIGS = {
    "64x64w4s4": (64, 64, 4, 4),
    "64x128w4s4": (64, 128, 4, 4),
    "64x128w4s6": (64, 128, 4, 6),
    "64x256w4s3": (64, 256, 4, 3),
    "64x256w4s4": (64, 256, 4, 4),
    "128x128w8s4": (128, 128, 8, 4),
}
PLAIN_UNPACK = "64x128w4s4"  # also timed with the plain unpacking and without PDL
RESIDUAL_CFG = "64x128w4s4"


def split_for(tiles: int, k_steps: int, sms: int, waves: int = 2) -> int:
    """Smallest power-of-two split that gives ``waves`` programs per SM, with >= 2 K steps each (<= 16)."""
    split = 1
    while tiles * split < waves * sms and k_steps // (2 * split) >= 2 and split < 16:
        split *= 2
    return split


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="")
    parser.add_argument("--ms", default=",".join(map(str, MS)))
    parser.add_argument("--waves", type=int, default=2)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_swap.py times compiled kernels: it needs a CUDA GPU (none found)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    ms = [int(v) for v in args.ms.split(",")]
    gen = torch.Generator(device="cpu").manual_seed(0)
    torch.manual_seed(0)
    rows = []
    shapes = sorted({s for model in zb.MODELS.values() for s in model.values()})
    for n, k in shapes:
        kp = (k + 1) // 2
        w_bf16 = (torch.randn(n, k, device=device) * 0.02).to(torch.bfloat16)
        n_bf = max(2, math.ceil(zb.ROTATE_BYTES / w_bf16.numel() / 2))
        w_bf16s = [w_bf16] + [w_bf16.clone() for _ in range(n_bf - 1)]
        qws, wss = zb.random_w4_copies(n, kp, device)
        qweight, w_scale, n_w4 = qws[0], wss[0], len(qws)
        w4_bytes = qweight.numel() + 2 * n
        res = zb.random_residual(n, k, 0.10, device, gen)
        ress = [res] + [zb.clone_residual(res) for _ in range(n_w4 - 1)]
        maps = [residual_block_map(r) for r in ress]
        res_bytes = sum(res.nbytes().values())
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            x[:, :: max(1, k // 7)] *= 8
            ap, a_s = quantize_activations_triton(x)
            q8, s8 = quantize_activations_triton(x, layout="split8")
            ref = w4a4_gemm_reference(ap, a_s, qweight, w_scale, k, out_fp32=True)
            zref = zipper_gemm_reference(ap, a_s, qweight, w_scale, k, res, out_fp32=True)
            shown = []

            def add(variant, out, want, calls, wbytes, extra=None):
                ok, rel = zb.check(out, want) if want is not None else (True, 0.0)
                us, spread, _ = zb.time_calls(calls)
                row = {"n": n, "k": k, "m": m, "variant": variant, "us": us, "spread": spread, "check_ok": ok,
                       "max_rel_err": rel, "weight_TBps": wbytes / (us * 1e-6) / 1e12}
                if extra:
                    row.update(extra)
                rows.append(row)
                shown.append(row)

            add("bf16", F.linear(x, w_bf16), None, [lambda i=i: F.linear(x, w_bf16s[i]) for i in range(n_bf)], n * k * 2)
            for tag, x16 in (("", False), ("_x16", True)):
                def w_call(i, x16=x16):
                    def call():
                        p, s = quantize_activations_triton(x)
                        return w4a4_gemm_triton(p, s, qws[i], wss[i], k, x16=x16)
                    return call
                add(f"w4a4{tag}", w4a4_gemm_triton(ap, a_s, qweight, w_scale, k, x16=x16), ref,
                    [w_call(i) for i in range(n_w4)], w4_bytes, {"config": repr(pick_config(m, n, kp, device))})

                def z_call(i, x16=x16):
                    def call():
                        p, s = quantize_activations_triton(x)
                        return zipper_gemm_triton(p, s, qws[i], wss[i], k, ress[i], block_map=maps[i], x16=x16)
                    return call
                add(f"zip10{tag}", zipper_gemm_triton(ap, a_s, qweight, w_scale, k, res, block_map=maps[0], x16=x16),
                    zref, [z_call(i) for i in range(n_w4)], w4_bytes + res_bytes)
            bm = 16 if m <= 16 else 32
            pdl_def = pdl_default(m, n, kp)
            runs = [(name, cfg, True, pdl_def, None) for name, cfg in CONFIGS.items()]
            runs += [(PLAIN_UNPACK + "_x1", CONFIGS[PLAIN_UNPACK], False, pdl_def, None),
                     (PLAIN_UNPACK + "_nopdl", CONFIGS[PLAIN_UNPACK], True, False, None),
                     (PLAIN_UNPACK + "_pdl", CONFIGS[PLAIN_UNPACK], True, True, None),
                     ("zip10_" + RESIDUAL_CFG, CONFIGS[RESIDUAL_CFG], True, pdl_def, ress)]
            for name, (bn, bkp, nw, ns), x16, pdl, rlist in runs:
                tiles = -(-n // bn) * -(-m // bm)
                split = split_for(tiles, -(-kp // bkp), sms, args.waves)
                opts = dict(block_n=bn, block_m=bm, block_kp=bkp, split_k=split, num_warps=nw, num_stages=ns,
                            pdl=pdl, x16=x16)

                def s_call(i, opts=opts, rlist=rlist):
                    def call():
                        q, s = quantize_activations_triton(x, layout="split8")
                        return w4a4_gemm_swapped_triton(q, s, qws[i], wss[i], k,
                                                        residual=rlist[i] if rlist else None, **opts)
                    return call
                try:
                    out = w4a4_gemm_swapped_triton(q8, s8, qweight, w_scale, k, residual=res if rlist else None, **opts)
                    add(name if rlist else f"sw_{name}", out, zref if rlist else ref, [s_call(i) for i in range(n_w4)],
                        w4_bytes + (res_bytes if rlist else 0), {"split_k": split, "pdl": pdl})
                except Exception as exc:  # recorded, the run goes on
                    rows.append({"n": n, "k": k, "m": m, "variant": name, "error": repr(exc)[:300]})
                    print(f"  {name}: ERROR {exc!r}"[:300], flush=True)
            base = shown[0]["us"]
            for r in shown:
                r["speedup_vs_bf16"] = base / r["us"]
            print(f"{n}x{k} M={m}: " + "  ".join(
                f"{r['variant']} {r['speedup_vs_bf16']:.2f}x/{r['weight_TBps']:.2f}TB/s{'' if r['check_ok'] else ' FAIL'}"
                for r in shown), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "decode_swap.json").write_text(json.dumps({"sms": sms, "rows": rows}, indent=1))
    # the short table: per variant, the range over shapes of x BF16 at each M
    variants = list(dict.fromkeys(r["variant"] for r in rows if "us" in r))
    fails = sum(1 for r in rows if "us" in r and not r["check_ok"])
    errors = sum(1 for r in rows if "error" in r)
    print(f"\nchecks failed: {fails}; errors: {errors}")
    print("| variant | " + " | ".join(f"M={m}" for m in ms) + " |")
    print("|---|" + "---|" * len(ms))
    for v in variants:
        cells = []
        for m in ms:
            sp = [r["speedup_vs_bf16"] for r in rows if r.get("variant") == v and r["m"] == m and "us" in r]
            cells.append(f"{min(sp):.2f}-{max(sp):.2f}" if sp else "-")
        print(f"| {v} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    # GEMMs timed back to back: without the decode step's PDL chain a GEMM never lets the next timed one start
    # early, so each time is one GEMM's
    with settings.use(pdl_chain="off"):
        raise SystemExit(main())
