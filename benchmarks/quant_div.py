"""The activation quantizers under each way of dividing by the token's scale (GPU).

``MOSAICQUANT_QUANT_DIV`` (``fma``, ``ieee``, ``fp64``; read when the kernels are imported, so one mode
a process) picks how :func:`mosaicquant.kernels._tl.quant_div` divides. Every mode gives the IEEE
quotient, so the same integers: each case's outputs are hashed, and ``--table`` checks the hashes agree
across the records before it prints the times side by side.

Cases (default launch rules, CUDA graphs, median µs a call): the plain quantizer, the gated one (SiLU·mul
inside), the fused online Hadamard + quantizer and RMSNorm + quantizer, at n = 4096 and 14336 (RMSNorm at
4096) and M = 1 ... 8192.

    for mode in ieee fma fp64; do
        MOSAICQUANT_QUANT_DIV=$mode PYTHONPATH=. python3 benchmarks/quant_div.py --out OUT/$mode.json
    done
    python3 benchmarks/quant_div.py --table OUT/*.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mosaicquant.harness.assets import atomic_write_bytes  # noqa: E402
from mosaicquant.harness.timing import time_calls  # noqa: E402

TOKENS = (1, 4, 16, 32, 2048, 8192)
CASES = (("quant", 4096), ("quant", 14336), ("quant gated", 14336), ("hadamard", 4096), ("hadamard", 14336),
         ("rmsnorm", 4096))


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def measure(tokens: tuple[int, ...], kernels: tuple[str, ...]) -> list[dict]:
    from mosaicquant.kernels import _tl, act_quant, decoder, hadamard_quant
    from mosaicquant.methods.hadamard import OnlineHadamard, random_signs
    from quant_split import activations

    device = torch.device("cuda")
    rows = []
    for name, n in CASES:
        if name not in kernels:
            continue
        had = OnlineHadamard(n, signs=random_signs(n, seed=1)).to(device)
        gen = torch.Generator(device=device).manual_seed(n)
        weight = (1 + 0.2 * torch.randn(n, device=device, generator=gen)).to(torch.bfloat16)
        for m in tokens:
            x, gen = activations(name, n, m, device)
            if name == "hadamard":
                def run(x=x, had=had):
                    return hadamard_quant.hadamard_quantize_triton(x, had)
            elif name == "rmsnorm":
                res = torch.randn(m, n, device=device, generator=gen).to(torch.bfloat16)

                def run(x=x, res=res, weight=weight):
                    return decoder.rmsnorm_quant(x, weight, 1e-5, residual=res.clone())
            else:
                def run(x=x, gated=name == "quant gated"):
                    return act_quant.quantize_activations_triton(x, gated=gated)
            digest = _digest(*run())
            us = time_calls([run], min_us=2000.0, replays=15).median_us
            print(f"{_tl.QUANT_DIV} {name} n={n} M={m}: {us:.2f} us ({digest})", flush=True)
            rows.append({"mode": _tl.QUANT_DIV, "kernel": name, "n": n, "m": m, "us": us, "digest": digest})
    return rows


def table(paths: list[str]) -> int:
    """Times by mode (median over the records of a mode), after checking every mode's digests agree."""
    times, digests, modes = defaultdict(list), defaultdict(set), []
    for p in paths:
        with open(p) as f:
            for r in json.load(f)["rows"]:
                key = (r["kernel"], r["n"], r["m"])
                times[key + (r["mode"],)].append(r["us"])
                digests[key].add(r["digest"])
                if r["mode"] not in modes:
                    modes.append(r["mode"])
    differ = [k for k, d in digests.items() if len(d) > 1]
    for k in differ:
        print(f"OUTPUTS DIFFER across modes: {k}")
    print("| kernel | n | M | " + " | ".join(f"{m} µs" for m in modes) + " | " +
          " | ".join(f"{m} ÷ {modes[0]}" for m in modes[1:]) + " |")
    print("|---|---|---|" + "---|" * (2 * len(modes) - 1))

    def med(v):
        return sorted(v)[len(v) // 2]

    for key in sorted(digests, key=lambda k: (CASES.index((k[0], k[1])), k[2])):
        us = [med(times[key + (m,)]) if times.get(key + (m,)) else float("nan") for m in modes]
        print(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(f"{u:.2f}" for u in us) + " | " +
              " | ".join(f"{u / us[0]:.3f}" for u in us[1:]) + " |")
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="JSON record of this process's mode")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--kernels", default=",".join(dict.fromkeys(name for name, _ in CASES)),
                    help="comma list of: " + ", ".join(dict.fromkeys(name for name, _ in CASES)))
    ap.add_argument("--table", nargs="+", help="records to compare (no timing)")
    args = ap.parse_args(argv)
    if args.table:
        return table(args.table)
    if not args.out:
        ap.error("--out or --table is required")
    rows = measure(tuple(int(t) for t in args.tokens.split(",")), tuple(args.kernels.split(",")))
    atomic_write_bytes(args.out, json.dumps({"rows": rows}, indent=1).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
