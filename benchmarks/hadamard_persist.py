"""The fused Hadamard quantizer at prefill sizes: one program a token against persistent programs (GPU).

One program a token loads the transform's constant operands (``S_D`` and ``Aᵀ``, 32 KiB each on a
``[128, 128]`` view) for every token and runs its products with nothing to overlap them. A
persistent program (``hadamard_quant.PERSISTENT_*``) loads them once and walks tokens ``pid``,
``pid + programs``, ..., its next token's input copied while it transforms the current one
(``stages`` > 1). Each variant is ``l<stages>w<warps>p<programs an SM>``; ``base`` is one program a
token (the warps rule); a leading ``t`` runs the transposed products (``hadamard_quant.TRANSPOSED_MIN_TOKENS``). Every variant's integers and scales are checked bit for bit against ``base``;
rounds interleave the variants; medians of CUDA-graph replays, inputs rotated through more than L2.

    PYTHONUNBUFFERED=1 python3 benchmarks/hadamard_persist.py --sizes 4096,14336 --ms 2048,8192 \\
        --variants base,l1w4p1,l1w8p1,l2w8p1 --rounds 3 --out OUT
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mosaicquant.harness.timing import time_calls  # noqa: E402
from mosaicquant.kernels import hadamard_quant  # noqa: E402
from mosaicquant.kernels.hadamard_quant import hadamard_quantize_triton  # noqa: E402
from mosaicquant.methods.hadamard import OnlineHadamard, random_signs  # noqa: E402

ROTATE_BYTES = 3 * 60 * 2**20
_VARIANT = re.compile(r"l(\d+)w(\d+)p(\d+)$")
_DEFAULTS = {name: getattr(hadamard_quant, name) for name in (
    "PERSISTENT_MIN_TOKENS", "PERSISTENT_STAGES", "PERSISTENT_WARPS", "PERSISTENT_PROGRAMS_PER_SM",
    "TRANSPOSED_MIN_TOKENS")}


def set_variant(name: str) -> None:
    """Set ``hadamard_quant``'s persistent-launch constants for variant ``name`` (``base``: one program a token)."""
    for key, value in _DEFAULTS.items():
        setattr(hadamard_quant, key, value)
    if name.startswith("t"):  # the transposed products for one program a token
        hadamard_quant.TRANSPOSED_MIN_TOKENS = 1
        name = name[1:]
    if name == "base":
        hadamard_quant.PERSISTENT_MIN_TOKENS = None
        return
    if name == "default":
        return
    match = _VARIANT.match(name)
    if not match:
        raise SystemExit(f"variant {name!r}: use base, default or l<stages>w<warps>p<programs an SM>, each with a "
                         f"leading t for the transposed products")
    stages, warps, per_sm = (int(g) for g in match.groups())
    hadamard_quant.PERSISTENT_MIN_TOKENS = 1
    hadamard_quant.PERSISTENT_STAGES = stages
    hadamard_quant.PERSISTENT_WARPS = warps
    hadamard_quant.PERSISTENT_PROGRAMS_PER_SM = per_sm


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4096,14336")
    ap.add_argument("--ms", default="2048,8192")
    ap.add_argument("--variants", default="base,l1w4p1,l1w8p1,l2w8p1")
    ap.add_argument("--layout", default="split8", choices=("split8", "packed"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    variants = args.variants.split(",")
    rows, failed = [], []
    for n in (int(v) for v in args.sizes.split(",")):
        had = OnlineHadamard(n, signs=random_signs(n, seed=1)).to(device)
        for m in (int(v) for v in args.ms.split(",")):
            copies = max(1, math.ceil(ROTATE_BYTES / (2 * m * n)))
            xs = [torch.randn(m, n, device=device, dtype=torch.bfloat16) for _ in range(copies)]
            fn = lambda x: hadamard_quantize_triton(x, had, layout=args.layout)  # noqa: E731
            set_variant("base")
            ref = fn(xs[0])
            times = {v: [] for v in variants}
            for v in variants:
                set_variant(v)
                try:
                    got = fn(xs[0])
                    torch.cuda.synchronize()
                except Exception as exc:  # e.g. more shared memory than an SM has
                    print(f"{v} n={n} m={m}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                    del times[v]
                    continue
                if not (torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])):
                    diff = (got[0].float() - ref[0].float()).abs()
                    failed.append((n, m, v))
                    print(f"CHECK FAILED {v} n={n} m={m}: {int((diff > 0).sum())} values differ, "
                          f"scales equal {torch.equal(got[1], ref[1])}", flush=True)
            for _ in range(args.rounds):
                for v in times:
                    set_variant(v)
                    times[v].append(time_calls([lambda x=x: fn(x) for x in xs], min_us=2000.0, replays=15).median_us)
            set_variant("default")
            med = {v: statistics.median(t) for v, t in times.items()}
            moved = m * n * 2 + m * (n if args.layout == "split8" else n // 2)
            rows.append(dict(n=n, m=m, us=med, rounds=times, bytes=moved))
            print(n, m, {v: f"{t:.1f}" for v, t in med.items()}, flush=True)
    print("\n| n | M | " + " | ".join(f"{v} µs (÷ base)" for v in variants) + " |")
    print("|---|---|" + "---|" * len(variants))
    for r in rows:
        base = r["us"].get("base")
        cells = " | ".join(f"{r['us'][v]:.1f}" + (f" ({r['us'][v] / base:.2f})" if base else "")
                           if v in r["us"] else "–" for v in variants)
        print(f"| {r['n']} | {r['m']} | {cells} |")
    print(f"checks: {sum(len(r['us']) for r in rows) - len(failed)} ok, {len(failed)} FAILED")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as fh:
            json.dump({"layout": args.layout, "rows": rows, "failed": failed}, fh, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
