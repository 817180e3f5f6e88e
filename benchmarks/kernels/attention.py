"""Decode attention with RoPE + KV write: two kernels against the three they replace (GPU).

On the Llama-3-8B attention shape (32 query heads, 8 KV heads, head size 128) with ``--context``
cached tokens, for each batch: ``rope_kv`` alone, ``decode_attention`` alone (its chunks and
their combine), both in turn (``three kernels``), and ``decode_rope_attention`` (``fused``: RoPE
and the KV write inside the chunks' kernel). The fused output is checked against the three
kernels' first; CUDA graphs, medians; a table last. Timed back to back, not inside a decode step
(where programmatic dependent launch overlaps a kernel's start with its predecessor):
``decode_profile.py`` times the step.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/kernels/attention.py
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from mosaicquant.harness.timing import time_calls  # noqa: E402
from mosaicquant.kernels.decoder import decode_attention, decode_rope_attention, rope_kv  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,4,8,16,32")
    ap.add_argument("--context", type=int, default=512)
    args = ap.parse_args()
    device, bf16 = torch.device("cuda"), torch.bfloat16
    heads, kv_heads, d = 32, 8, 128
    length = args.context + 8
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=device).float() / d))
    ang = torch.arange(length, device=device).float()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], 1).cos().to(bf16), torch.cat([ang, ang], 1).sin().to(bf16)
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        qkv = torch.randn(b, (heads + 2 * kv_heads) * d, device=device, dtype=bf16)
        pos = torch.full((b,), args.context, device=device, dtype=torch.int64)
        lengths = (pos + 1).to(torch.int32)
        kc = torch.randn(b, kv_heads, length, d, device=device, dtype=bf16)
        vc = torch.randn_like(kc)

        def rope():
            return rope_kv(qkv, pos, cos, sin, kc, vc, heads, kv_heads, 1)

        q = rope()

        def attn():
            return decode_attention(q, kc, vc, lengths, d ** -0.5)

        def three():
            return decode_attention(rope(), kc, vc, lengths, d ** -0.5)

        def fused():
            return decode_rope_attention(qkv, pos, cos, sin, kc, vc, heads, kv_heads, d ** -0.5)

        ref, got = three().float(), fused().float()
        err = (got - ref).abs().max().item()
        assert err <= 1e-2 * ref.abs().max().item(), f"fused b={b}: max |diff| {err} against the three kernels"
        times = {name: time_calls([fn], min_us=5000.0, replays=21).median_us
                 for name, fn in (("rope_kv", rope), ("attention", attn), ("three kernels", three),
                                  ("fused", fused))}
        rows.append((b, times))
    names = list(rows[0][1])
    print("\n| batch | " + " | ".join(names) + " | fused / three |")
    print("|---" * (len(names) + 2) + "|")
    for b, t in rows:
        print(f"| {b} | " + " | ".join(f"{t[n]:.2f}" for n in names) + f" | {t['fused'] / t['three kernels']:.2f} |")


if __name__ == "__main__":
    main()
