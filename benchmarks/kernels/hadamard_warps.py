"""The activation quantizers' warps per program (GPU): the online Hadamard + 4-bit quantizer, and the plain one.

One program per token: at batch 4 only 4 SMs work, so the kernel's latency is what a decode
step pays (64 calls a step on Llama-3-8B: o_proj's 4096 and down_proj's 14336 inputs); at
prefill sizes thousands of programs share the SMs, and the warps set how many run at once.
Times each kernel (CUDA graphs, median) at every M and warp count asked for, checks each
against the default (integers and scales bit-equal), and prints a table. Kernels: ``hadamard``
(the fused Hadamard + quantizer, random signs), ``quant`` (the plain quantizer, packed layout),
``split8`` (the plain quantizer, the swapped GEMM's int8 layout), ``hadamard8`` (the fused Hadamard + quantizer in
that layout, what prefill runs), ``unfused8`` (the transform in PyTorch, then the split8 quantizer: what a caller
runs where the fused kernel refuses a size; timed at its default only). ``--rotate`` cycles the
input through copies larger than L2 (a prefill layer's input is mostly not in L2). ``--blocks``
also times the plain quantizers with ``act_quant.MAX_BLOCK_KP`` at each value (pairs a program
loads at once; a longer row takes two passes, the second reloading it), and ``--ceiling`` a
BF16 → int8 cast of the same input (``x.to(torch.int8)``: the split8 layout's bytes, no reduction).

    PYTHONUNBUFFERED=1 python3 benchmarks/kernels/hadamard_warps.py   # decode sizes
    PYTHONUNBUFFERED=1 python3 benchmarks/kernels/hadamard_warps.py --ms 256,2048,8192 --warps 2,4,8,16 \\
        --kernels hadamard,quant,split8 --rotate --out OUT
    PYTHONUNBUFFERED=1 python3 benchmarks/kernels/hadamard_warps.py --ms 2048,8192 --sizes 4096,14336 --warps 4,8 \
        --kernels split8 --blocks 1024,2048,8192 --ceiling --rotate --out OUT
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from mosaicquant.harness.timing import time_calls  # noqa: E402
from mosaicquant.kernels import act_quant  # noqa: E402
from mosaicquant.kernels.act_quant import quantize_activations_triton  # noqa: E402
from mosaicquant.kernels.hadamard_quant import hadamard_quantize_triton  # noqa: E402
from mosaicquant.methods.hadamard import OnlineHadamard, random_signs  # noqa: E402

ROTATE_BYTES = 3 * 60 * 2**20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,4,16,32")
    ap.add_argument("--sizes", default="4096,14336")
    ap.add_argument("--warps", default="4,8,16")
    ap.add_argument("--kernels", default="hadamard", help="comma-separated: hadamard, quant, split8")
    ap.add_argument("--rotate", action="store_true", help="cycle the input through copies larger than L2")
    ap.add_argument("--blocks", default="", help="comma-separated MAX_BLOCK_KP values for quant / split8")
    ap.add_argument("--ceiling", action="store_true", help="also time x.to(torch.int8)")
    ap.add_argument("--out", default=None, help="directory for results.json")
    args = ap.parse_args(argv)
    default_block = act_quant.MAX_BLOCK_KP
    blocks = [int(b) for b in args.blocks.split(",") if b]
    device = torch.device("cuda")
    warps_list = [int(w) for w in args.warps.split(",")]
    rows = []
    for n in (int(v) for v in args.sizes.split(",")):
        had = OnlineHadamard(n, signs=random_signs(n, seed=1)).to(device)
        kernels = {
            "hadamard": lambda x, w=None: hadamard_quantize_triton(x, had, num_warps=w),
            "quant": lambda x, w=None: quantize_activations_triton(x, num_warps=w),
            "split8": lambda x, w=None: quantize_activations_triton(x, layout="split8", num_warps=w),
            "hadamard8": lambda x, w=None: hadamard_quantize_triton(x, had, num_warps=w, layout="split8"),
            "unfused8": lambda x, w=None: quantize_activations_triton(had(x), layout="split8", num_warps=w),
        }
        for m in (int(v) for v in args.ms.split(",")):
            copies = max(1, math.ceil(ROTATE_BYTES / (2 * m * n))) if args.rotate else 1
            xs = [torch.randn(m, n, device=device, dtype=torch.bfloat16) for _ in range(copies)]
            if args.ceiling:
                t = time_calls([lambda x=x: x.to(torch.int8) for x in xs], min_us=2000.0, replays=15).median_us
                rows.append(dict(kernel="cast_int8", n=n, m=m, default_us=t, warps={}, ok=True, bytes=3 * m * n))
                print("cast_int8", n, m, f"{t:.2f}", flush=True)
            for name in args.kernels.split(","):
                fn = kernels[name]
                ref = fn(xs[0])
                for block in ([None] + blocks if name in ("quant", "split8") else [None]):
                    act_quant.MAX_BLOCK_KP = default_block if block is None else block
                    times = {}
                    default = time_calls([lambda x=x: fn(x) for x in xs], min_us=2000.0, replays=15).median_us
                    for warps in (warps_list if name != "unfused8" else []):
                        got = fn(xs[0], warps)
                        ok = torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
                        t = time_calls([lambda x=x, w=warps: fn(x, w) for x in xs], min_us=2000.0, replays=15).median_us
                        times[warps] = (t, ok)
                    act_quant.MAX_BLOCK_KP = default_block
                    moved = m * n * 2 + m * (n if name.endswith("8") else n // 2)
                    label = name if block is None else f"{name}_b{block}"
                    rows.append(dict(kernel=label, n=n, m=m, default_us=default,
                                     warps={w: t for w, (t, _) in times.items()},
                                     ok=all(ok for _, ok in times.values()), bytes=moved))
                    print(label, n, m, f"default {default:.2f}",
                          {w: f"{t:.2f}{'' if ok else ' FAILED'}" for w, (t, ok) in times.items()}, flush=True)
    head = " | ".join(f"{w} warps µs" for w in warps_list)
    print(f"\n| kernel | n | M | default µs (TB/s) | {head} |")
    print("|---|---|---|---|" + "---|" * len(warps_list))
    for r in rows:
        cells = " | ".join(f"{r['warps'][w]:.2f}" if w in r["warps"] else "–" for w in warps_list)
        print(f"| {r['kernel']} | {r['n']} | {r['m']} | {r['default_us']:.2f} ({r['bytes'] / r['default_us'] / 1e6:.2f}) "
              f"| {cells} |")
    failed = [r for r in rows if not r["ok"]]
    print(f"checks: {len(rows) - len(failed)} ok, {len(failed)} FAILED")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as fh:
            json.dump({"rotate": args.rotate, "rows": rows}, fh, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
