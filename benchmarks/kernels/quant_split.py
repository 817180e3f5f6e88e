"""Activation quantizers at decode sizes with each token split over P programs (GPU).

One program per token leaves most SMs idle at batch 4: the fused Hadamard + quantizer took
17-18 µs on a 14336-wide row and the plain quantizer 7.8 µs.
Times both kernels (CUDA graphs, median µs per call) at n = 4096 and 14336, M = 1 ... 32:
the fused Hadamard + quantizer (random signs) and the plain quantizer (gated and not), with
P = 1 (one program per token, default warps) and every allowed P of 2, 4, 8, 16 with 4 and 8
warps. Every split result is first checked bit-equal to P = 1 (integers and scales). Prints
a line per case, then a Markdown table; ``*`` marks the default rule's P.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/kernels/quant_split.py [--kernels hadamard] [--sizes 14336]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from mosaicquant.errors import UserInputError  # noqa: E402
from mosaicquant.harness.timing import time_calls  # noqa: E402
from mosaicquant.kernels import act_quant, hadamard_quant  # noqa: E402
from mosaicquant.kernels._token_split import (  # noqa: E402
    check_programs_per_token,
    resolve_programs_per_token,
    sm_count,
)
from mosaicquant.methods.hadamard import OnlineHadamard, random_signs  # noqa: E402

SIZES = (4096, 14336)
TOKENS = (1, 4, 8, 16, 32)
SPLITS = (2, 4, 8, 16)
WARPS = (4, 8)


def activations(name: str, n: int, m: int, device: torch.device) -> tuple[torch.Tensor, torch.Generator]:
    """Seeded BF16 inputs of a quantizer case: ``m`` tokens of ``n`` channels (``2n`` for the gated quantizer's
    ``[gate | up]``), a few outlier channels among them, as activations have; and the generator, for more."""
    gen = torch.Generator(device=device).manual_seed(n + m)
    x = torch.randn(m, 2 * n if name == "quant gated" else n, device=device, generator=gen)
    x[:, ::97] *= 10
    return x.to(torch.bfloat16), gen


def _allowed(p: int, m: int, sms: int, most: int | None) -> bool:
    try:
        check_programs_per_token(p, m, sms, most)
    except UserInputError:
        return False
    return True


def _case(name: str, n: int, m: int, run: Callable[..., tuple[torch.Tensor, torch.Tensor]], default_p: int,
          most: int | None, sms: int) -> dict:
    """Check every allowed split against P = 1, then time them; returns ``{(p, warps): µs}`` and the default."""
    ref_q, ref_s = run(1, None)
    times = {(1, None): time_calls([lambda: run(1, None)], min_us=2000.0, replays=15).median_us}
    for p in SPLITS:
        if not _allowed(p, m, sms, most):
            continue
        for w in WARPS:
            for _ in range(2):  # a second launch finds the barrier reset by the first
                q, s = run(p, w)
                assert torch.equal(q, ref_q) and torch.equal(s, ref_s), (name, n, m, p, w)
            times[(p, w)] = time_calls([lambda p=p, w=w: run(p, w)], min_us=2000.0, replays=15).median_us
    shown = ", ".join(f"P{p}/w{w}: {t:.2f}" if w else f"P1: {t:.2f}" for (p, w), t in times.items())
    print(f"{name} n={n} M={m} default P={default_p}: {shown}", flush=True)
    return {"name": name, "n": n, "m": m, "times": times, "default": default_p}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default="quant,quant gated,hadamard", help="comma-separated subset")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    sms = sm_count(device)
    start = time.perf_counter()
    rows = []
    for name in args.kernels.split(","):
        for n in (int(v) for v in args.sizes.split(",")):
            had = OnlineHadamard(n, signs=random_signs(n, seed=1)).to(device)
            for m in TOKENS:
                x, _ = activations(name, n, m, device)
                if name == "hadamard":
                    def run(p, w, x=x, had=had):
                        return hadamard_quant.hadamard_quantize_triton(x, had, programs_per_token=p, num_warps=w)
                    most, why = hadamard_quant._split_limit(had)
                    default = resolve_programs_per_token(None, m, device, n, hadamard_quant.SPLIT_MIN_WIDTH, most, why)
                else:
                    def run(p, w, x=x, gated=name == "quant gated"):
                        return act_quant.quantize_activations_triton(x, gated=gated, programs_per_token=p, num_warps=w)
                    most = None
                    default = resolve_programs_per_token(None, m, device, n, act_quant.SPLIT_MIN_WIDTH,
                                                         min_row=act_quant.SPLIT_MIN_ROW)
                rows.append(_case(name, n, m, run, default, most, sms))
    print(f"\n{time.perf_counter() - start:.0f} s; µs per call (CUDA graphs, median); split cells: 4 warps / 8 warps;"
          f" * = the default rule's P")
    print("\n| kernel | n | M | P=1 | " + " | ".join(f"P={p}" for p in SPLITS) + " |")
    print("|---|---|---|---|" + "---|" * len(SPLITS))
    for r in rows:
        t = r["times"]
        cells = [f"{t[(1, None)]:.2f}" + ("*" if r["default"] == 1 else "")]
        for p in SPLITS:
            if (p, WARPS[0]) not in t:
                cells.append("")
                continue
            cell = " / ".join(f"{t[(p, w)]:.2f}" for w in WARPS)
            cells.append(cell + ("*" if r["default"] == p else ""))
        print(f"| {r['name']} | {r['n']} | {r['m']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
