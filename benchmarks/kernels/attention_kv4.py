"""Decode attention (RoPE, the KV write and the split-KV loop in one kernel) over a 16-bit and a 4-bit cache, and
how the 4-bit cache's chunks, loop step and prologue move it (GPU).

On the Llama-3-8B attention shape (32 query heads, 8 KV heads, head size 128), ``--context`` cached tokens a
sequence (a list: each context is its own set of rows), for each batch: ``decode_rope_attention`` over

- ``kv16``: the model's BF16 cache;
- ``kv4``: QuaRot's 4-bit cache (asymmetric, clip 0.95, the Q/K Hadamard; ``decoder.KVFormat``);

each at its default cut (``decoder.attention_splits``; over the 4-bit cache from ~132 sequence × KV-head pairs one
chunk a head) and at explicit chunks (``--chunks``; more programs, then the combining kernel), the 4-bit loop at
``--block-ns`` keys a step, and the kernel's forms (``--forms``, :data:`FORMS`: the new key and value added from
registers rather than read back by the loop, the 4-bit loop's step; each form puts its tile-table entries in force
for its calls). Every call's caches are one of several copies rotated through more than L2
(a layer's cache is read once a decode step, after other layers' weights have passed through L2). Each variant's
output is checked against the default cut's (and that one against ``decode_rope_attention_reference`` at the
smallest batch) first; CUDA graphs, medians of ``--rounds`` interleaved rounds; µs a call, the cache bytes it reads
(keys, values, and the 4-bit cache's scales and zero points), and their rate.

    PYTHONPATH=. python3 benchmarks/kernels/attention_kv4.py [--batches 4,16,32] [--context 512[,575]] [--chunks 128,256]
        [--block-ns 64] [--forms registers] [--rounds 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mosaicquant import settings  # noqa: E402
from mosaicquant.harness.timing import time_calls  # noqa: E402
from mosaicquant.kernels import decoder  # noqa: E402
from mosaicquant.kernels.tile_table import TileTable, table_for  # noqa: E402
from mosaicquant.kernels.decoder import (KVFormat, KVScales, decode_rope_attention,  # noqa: E402
                                         decode_rope_attention_reference)

HEADS, KV_HEADS, D = 32, 8, 128
ROTATE_BYTES = 200 * 2**20
# attention's bf16 accuracy (tests/kernels/test_decoder.py's tolerance)
RTOL, ATOL = 2.0**-6, 4e-3
# outputs allowed off the reference: the Q/K rotation's fp32 sums may round the new key one step apart from the
# reference's (tests/kernels/test_decoder.py checks the kernel's own cache for that reason); a wrong kernel is off
# nearly everywhere
REF_OFF_MAX = 0.01
# The kernel's forms (tile-table entries for a variant's calls; the default form is the device's row).
# "registers": the new key and value added to the softmax from registers after the loop rather than read back by it;
# "step64": the 4-bit loop at 64 keys a step. The 16-bit cache has only the first.
FORMS = {
    "registers": {"attn_new_cached": False},
    "step64": {"attn_kv4_block_n": 64},
}
FORMS_16 = ("registers",)

#: the tile table's entries (the forms' other keys are kernel settings)
TILE_ENTRIES = {f.name for f in dataclasses.fields(TileTable)}


def _inputs(b: int, context: int, device, bits: int, g: torch.Generator):
    length = context + 8
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2).float() / D))
    ang = torch.arange(length).float()[:, None] * inv[None]
    cos = torch.cat([ang, ang], 1).cos().to(torch.bfloat16).to(device)
    sin = torch.cat([ang, ang], 1).sin().to(torch.bfloat16).to(device)
    qkv = torch.randn(b, (HEADS + 2 * KV_HEADS) * D, generator=g).to(torch.bfloat16).to(device)
    pos = torch.full((b,), context, dtype=torch.int64, device=device)
    shape = (b, KV_HEADS, length)
    if bits == 16:
        kc = (torch.randn(*shape, D, generator=g)).to(torch.bfloat16).to(device)
        return qkv, pos, cos, sin, kc, torch.randn_like(kc), None
    kc = torch.randint(0, 256, (*shape, D // 2), dtype=torch.uint8, generator=g).to(device)
    vc = torch.randint(0, 256, (*shape, D // 2), dtype=torch.uint8, generator=g).to(device)
    # grids about zero, as for unit-scale keys and values (zero points 6-10, steps 0.02-0.17)
    scales = KVScales(*(t.to(device) for t in (
        0.02 + 0.15 * torch.rand(shape, generator=g), torch.randint(6, 11, shape, generator=g).float(),
        0.02 + 0.15 * torch.rand(shape, generator=g), torch.randint(6, 11, shape, generator=g).float())))
    return qkv, pos, cos, sin, kc, vc, scales


def cache_bytes(b: int, context: int, bits: int) -> int:
    """Bytes the attention reads from a cache of ``context`` tokens: keys and values, plus the 4-bit cache's fp32
    scale and zero point a head, token, key or value."""
    per = D * 2 if bits == 16 else D // 2 + 8
    return b * KV_HEADS * context * 2 * per


@contextlib.contextmanager
def _settings(block_n: int, flags: dict):
    """A form's kernel settings in force for a block, with the tile table's ``attn_kv4_block_n`` and the form's
    other tile entries (launches read them)."""
    chosen = {k: v for k, v in flags.items() if k not in TILE_ENTRIES}
    tuned = {"attn_kv4_block_n": block_n, **{k: v for k, v in flags.items() if k in TILE_ENTRIES}}
    with settings.use(**chosen), settings.use_tiles(**tuned):
        yield


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="4,16,32")
    ap.add_argument("--context", default="512", help="cached tokens a sequence (comma-separated: several)")
    ap.add_argument("--chunks", default="128,256", help="explicit chunks to time beside the default cut")
    ap.add_argument("--block-ns", default="64", help="4-bit loop steps to time beside the tile table's attn_kv4_block_n")
    ap.add_argument("--forms", default=",".join(FORMS), help="forms (FORMS) to time beside the default")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (median of their medians)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    forms = [f for f in args.forms.split(",") if f]
    unknown = [f for f in forms if f not in FORMS]
    if unknown:
        ap.error(f"--forms: unknown {unknown}; known: {', '.join(FORMS)}")
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if not torch.cuda.is_available():
        print("attention_kv4.py times GPU kernels: no CUDA device here")
        return 2
    device = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    kv4 = KVFormat(4, False, 0.95, True)
    default_bn = table_for(torch.device("cuda")).attn_kv4_block_n
    rows, checks = [], 0
    batches = [int(v) for v in args.batches.split(",")]
    for context, b in ((c, b) for c in (int(v) for v in args.context.split(",")) for b in batches):
        for bits in (16, 4):
            one = cache_bytes(b, context, bits)
            copies = max(2, math.ceil(ROTATE_BYTES / one))
            sets = [_inputs(b, context, device, bits, g) for _ in range(copies)]
            outs = [torch.empty(b, HEADS * D, dtype=torch.bfloat16, device=device) for _ in range(copies)]
            kv = kv4 if bits == 4 else None
            variants = [("default", None, default_bn, {})]
            variants += [(f"chunk {c}", c, default_bn, {}) for c in (int(v) for v in args.chunks.split(",") if v)]
            if bits == 4:
                variants += [(f"{bn} keys a step", None, bn, {})
                             for bn in (int(v) for v in args.block_ns.split(",") if v)]
            variants += [(f"form {f}", None, FORMS[f].get("attn_kv4_block_n", default_bn),
                          {k: v for k, v in FORMS[f].items() if k != "attn_kv4_block_n"})
                         for f in forms if bits == 4 or f in FORMS_16]

            def call(i, chunk):
                qkv, pos, cos, sin, kc, vc, sc = sets[i]
                return decode_rope_attention(qkv, pos, cos, sin, kc, vc, HEADS, KV_HEADS, D ** -0.5, chunk=chunk,
                                             out=outs[i], kernel="triton", kv=kv, scales=sc)

            base = None
            for name, chunk, bn, flags in variants:  # every variant checked before any is timed
                with _settings(bn, flags):
                    got = call(0, chunk).float().clone()
                if base is None:
                    base = got
                    if b == batches[0]:  # the default cut against the PyTorch reference, once a format and context
                        qkv, pos, cos, sin, kc, vc, sc = sets[0]
                        ref = decode_rope_attention_reference(qkv, pos, cos, sin, kc, vc, HEADS, KV_HEADS,
                                                              D ** -0.5, kv=kv, scales=sc).float()
                        off = ((got - ref).abs() > RTOL * ref.abs() + ATOL).float().mean().item()
                        assert off <= REF_OFF_MAX, f"b={b} kv{bits}: {100 * off:.2f} % of outputs off the reference"
                        checks += 1
                bad = ((got - base).abs() > RTOL * base.abs() + ATOL).sum().item()
                assert bad == 0, f"b={b} kv{bits} {name}: {bad} outputs off the default cut's"
                checks += 1
            times = {name: [] for name, *_ in variants}
            for _ in range(args.rounds):  # interleaved: each round times every variant once
                for name, chunk, bn, flags in variants:
                    with _settings(bn, flags):
                        times[name].append(time_calls([lambda i=i, c=chunk: call(i, c) for i in range(copies)],
                                                      min_us=3000.0, replays=21))
            for name, chunk, bn, flags in variants:
                us = statistics.median(t.median_us for t in times[name])
                spread = max(max(t.spread_us for t in times[name]),
                             max(t.median_us for t in times[name]) - min(t.median_us for t in times[name]))
                plan = decoder._AttnPlan.make(device, b, HEADS, KV_HEADS, context + 8, D, chunk,
                                              decoder.ATTN_KV4_PROGRAMS_PER_SM if bits == 4 else None,
                                              bn if bits == 4 else decoder.ATTN_BLOCK_N)
                rows.append({"context": context, "batch": b, "kv_bits": bits, "variant": name, "chunk": plan.chunk,
                             "nsplit": plan.nsplit, "us": us, "spread_us": spread, "cache_mb": one / 1e6,
                             "tb_s": one / (us * 1e-6) / 1e12})
                print(f"context {context} b={b} kv{bits} {name}: {us:.2f} µs (chunk {plan.chunk}, {plan.nsplit} a "
                      "head)", flush=True)
    print(f"\n{checks} checks passed; Llama-3-8B attention shape; medians of {args.rounds} interleaved rounds")
    print("| context | batch | KV bits | variant | chunk × splits | µs | spread | cache MB | TB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']} | {r['batch']} | {r['kv_bits']} | {r['variant']} | {r['chunk']} × {r['nsplit']} | "
              f"{r['us']:.2f} | ±{r['spread_us']:.2f} | {r['cache_mb']:.1f} | {r['tb_s']:.2f} |")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        from zipper import versions  # the versions every benchmark record carries (torch, triton, GPU, source)

        payload = {"versions": versions(device), "args": vars(args), "rows": rows}
        (out / "attention_kv4.json").write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
