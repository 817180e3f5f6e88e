"""The online Hadamard + 4-bit quantizer at decode sizes: warps per program (GPU).

One program per token: at batch 4 only 4 SMs work, so the kernel's latency is what a decode
step pays (64 calls a step on Llama-3-8B: o_proj's 4096 and down_proj's 14336 inputs). Times
the fused kernel (CUDA graphs, median) at M = 1, 4, 16, 32 with 4, 8 and 16 warps, checks
each against the default, and prints a table; the plain quantizer of the same sizes is the
floor.

    PYTHONUNBUFFERED=1 python3 benchmarks/hadamard_warps.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mosaicquant.harness.timing import time_calls  # noqa: E402
from mosaicquant.kernels.act_quant import quantize_activations_triton  # noqa: E402
from mosaicquant.kernels.hadamard_quant import hadamard_quantize_triton  # noqa: E402
from mosaicquant.methods.hadamard import OnlineHadamard, random_signs  # noqa: E402


def main() -> None:
    device = torch.device("cuda")
    rows = []
    for n in (4096, 14336):
        had = OnlineHadamard(n, signs=random_signs(n, seed=1)).to(device)
        for m in (1, 4, 16, 32):
            x = torch.randn(m, n, device=device, dtype=torch.bfloat16)
            ref = hadamard_quantize_triton(x, had)
            times = {}
            for warps in (4, 8, 16):
                got = hadamard_quantize_triton(x, had, num_warps=warps)
                assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (n, m, warps)
                times[warps] = time_calls([lambda w=warps: hadamard_quantize_triton(x, had, num_warps=w)],
                                          min_us=2000.0, replays=15).median_us
            plain = time_calls([lambda: quantize_activations_triton(x)], min_us=2000.0, replays=15).median_us
            rows.append((n, m, times, plain))
            print(n, m, times, plain, flush=True)
    print("\n| n | M | 4 warps µs | 8 warps µs | 16 warps µs | plain quantizer µs |")
    print("|---|---|---|---|---|---|")
    for n, m, t, plain in rows:
        print(f"| {n} | {m} | {t[4]:.2f} | {t[8]:.2f} | {t[16]:.2f} | {plain:.2f} |")


if __name__ == "__main__":
    main()
