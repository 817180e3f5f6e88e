"""ZipperEngine's residual with power-of-two scales ("shared" walk) against its other walks, on the GPU.

MosaicQuant's ``rscale=pow2`` stores each kept row's scale as its base row's scale times ``2^-j``
(``j`` = 0..4). The operand-swapped GEMM can then add a kept block's integers, shifted left by
``4 - j``, into its dense int32 accumulator (``residual_walk="shared"``): a residual unit costs a
dense K step (plus the activation tile's re-read from L2), with no second accumulator, no e4m3
conversion and no rescale of the output tile.

For the Llama-3-8B linears (q/k/v, o, gate/up, down), at decode M (17-32: the swapped GEMM's decode
tiles) and prefill M (2048, 8192), with weights and residuals rotated through more than L2:

- ``bf16``: ``F.linear``;
- GEMM alone on ``split8`` activations: ``dense`` (no residual), ``fp8`` (10 % random blocks,
  free scales: today's prefill walk), ``shared`` (the same blocks with power-of-two scales;
  ``shared_nocap`` without the 128-register cap at prefill tiles);
- ``QuantLinear`` on BF16 input (activation quantization included): ``ql_dense``, ``ql_free`` (10 %,
  free scales: ZipperEngine's packed kernels at M <= 32, the swapped GEMM's fp8 walk at prefill) and
  ``ql_pow2`` (10 %, power-of-two scales; at M <= 32 with ``_tiles.SWAP_DECODE_SHARED_MIN_M = 17``,
  the swapped GEMM's decode tiles with the shared walk).

Every variant is checked against the PyTorch reference before it is timed. Medians of CUDA-graph
replays; the table last gives µs and speedup over ``bf16``.

Usage (GPU)::

    python benchmarks/shared_walk.py [--out DIR] [--ms 17,24,32,2048,8192]
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mosaicquant.harness.timing import time_calls  # noqa: E402
from mosaicquant.kernels import _tiles  # noqa: E402
from mosaicquant.kernels._tiles import swapped_decode_config  # noqa: E402
from mosaicquant.kernels.act_quant import quantize_activations_reference, quantize_activations_triton  # noqa: E402
from mosaicquant.kernels.quant_linear import QuantLinear  # noqa: E402
from mosaicquant.kernels.w4a4_gemm import w4a4_gemm_reference, w4a4_gemm_swapped_triton  # noqa: E402
from mosaicquant.kernels.zipper import zipper_gemm_reference  # noqa: E402
from mosaicquant.methods.format import PackedW4, ResidualBlocks, residual_shifts  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
BLOCK = (128, 128)
BUDGET = 0.10
ROTATE_BYTES = 3 * 60 * 2**20
RTOL, ATOL_FRAC = 2.0**-7, 1e-3
GEMM_MODULE = importlib.import_module("mosaicquant.kernels.w4a4_gemm")  # the package exports a function of that name


def random_layer(n: int, k: int, device, gen: torch.Generator) -> tuple[PackedW4, PackedW4, PackedW4]:
    """One random base with no residual, a 10 % residual of free scales, and the same blocks with pow2 scales."""
    bn, bk = BLOCK
    qweight = torch.randint(0, 256, (n, (k + 1) // 2), dtype=torch.uint8, generator=gen)
    w_scale = (torch.rand(n, 1, generator=gen) * 0.01 + 0.001).to(torch.float16)
    nbr, nbc = -(-n // bn), -(-k // bk)
    nb = int(round(BUDGET * nbr * nbc))
    idx = torch.randperm(nbr * nbc, generator=gen)[:nb].sort().values
    coords = torch.stack([idx // nbc, idx % nbc], 1).to(torch.int32)
    row_ptr = torch.zeros(nbr + 1, dtype=torch.int32)
    row_ptr[1:] = torch.cumsum(torch.bincount(coords[:, 0].long(), minlength=nbr), 0).to(torch.int32)
    values = torch.randint(0, 256, (nb, bn, bk // 2), dtype=torch.uint8, generator=gen)
    free = (torch.rand(nb, bn, generator=gen) * 0.004 + 0.0002).to(torch.float16)
    rows = (coords[:, 0].long().unsqueeze(1) * bn + torch.arange(bn)).clamp(max=n - 1)
    j = torch.randint(0, 5, (nb, bn), generator=gen)
    pow2 = (w_scale[:, 0].float()[rows] * 2.0 ** -j).to(torch.float16)
    dense = PackedW4((n, k), qweight, w_scale)
    res_free = ResidualBlocks((n, k), BLOCK, coords, row_ptr, values, free)
    res_pow2 = ResidualBlocks((n, k), BLOCK, coords, row_ptr, values, pow2)
    with_free = PackedW4((n, k), qweight, w_scale, residual=res_free)
    with_pow2 = PackedW4((n, k), qweight, w_scale, residual=res_pow2)
    return dense.to(device), with_free.to(device), with_pow2.to(device)


def copies(n: int, k: int) -> int:
    return max(2, math.ceil(ROTATE_BYTES / (n * (k + 1) // 2 * 1.15)))


def check(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
    out, ref = out.float(), ref.float()
    err = (out - ref).abs()
    ok = bool(torch.isfinite(out).all()) and bool((err <= RTOL * ref.abs() + ATOL_FRAC * ref.abs().max()).all())
    return ok, (err.max() / ref.abs().max().clamp_min(1e-30)).item()


def bench(name: str, n: int, k: int, ms: list[int], device, gen) -> list[dict]:
    rows = []
    layers = [random_layer(n, k, device, gen) for _ in range(copies(n, k))]
    for m in ms:
        x = (torch.randn(m, k, generator=gen) * 2).to(torch.bfloat16).to(device)
        w_bf16 = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
                  for _ in range(max(2, math.ceil(ROTATE_BYTES / (2 * n * k))))]
        a8, s8 = quantize_activations_triton(x, layout="split8")
        packed_a, scale_a = quantize_activations_reference(x.cpu())
        tiles = swapped_decode_config(m, n, (k + 1) // 2, device) if m <= 32 else {}
        dense0, free0, pow20 = (p.to("cpu") for p in layers[0])
        ref_dense = w4a4_gemm_reference(packed_a, scale_a, dense0.qweight, dense0.scales.reshape(-1), k, out_fp32=True)
        ref_free = zipper_gemm_reference(packed_a, scale_a, free0.qweight, free0.scales.reshape(-1), k, free0.residual,
                                         out_fp32=True)
        ref_pow2 = zipper_gemm_reference(packed_a, scale_a, pow20.qweight, pow20.scales.reshape(-1), k,
                                         pow20.residual, out_fp32=True)
        shifts = [residual_shifts(p.residual, p.scales) for _, _, p in layers]
        assert all(s is not None for s in shifts)
        out = torch.empty(m, n, dtype=torch.bfloat16, device=device)

        def gemm(walk, i, cap=True):
            dense, free, pow2 = layers[i]
            p = {"dense": dense, "fp8": free, "shared": pow2}[walk]
            kw = dict(tiles)
            if walk == "fp8":
                kw.update(residual=p.residual, residual_walk="fp8")
            elif walk == "shared":
                kw.update(residual=p.residual, residual_walk="shared", residual_shifts=shifts[i])
            return lambda: w4a4_gemm_swapped_triton(a8, s8, p.qweight, p.scales.reshape(-1), k, out=out, **kw)

        variants = {
            "bf16": ([lambda w=w: F.linear(x, w) for w in w_bf16], None),
            "dense": ([gemm("dense", i) for i in range(len(layers))], ref_dense),
            "fp8": ([gemm("fp8", i) for i in range(len(layers))], ref_free),
            "shared": ([gemm("shared", i) for i in range(len(layers))], ref_pow2),
        }
        qls = {key: [QuantLinear(layer[idx]).to(device) for layer in layers]
               for key, idx in (("ql_dense", 0), ("ql_free", 1), ("ql_pow2", 2))}
        for key, ref in (("ql_dense", ref_dense), ("ql_free", ref_free), ("ql_pow2", ref_pow2)):
            variants[key] = ([lambda q=q: q(x) for q in qls[key]], ref)
        for vname, (calls, ref) in variants.items():
            caps = [True, False] if vname == "shared" and m > 32 else [True]
            for cap in caps:
                label = vname if cap else "shared_nocap"
                old_cap = GEMM_MODULE.SHARED_TAIL_MAX_REGS
                old_min = _tiles.SWAP_DECODE_SHARED_MIN_M
                GEMM_MODULE.SHARED_TAIL_MAX_REGS = 128 if cap else None
                _tiles.SWAP_DECODE_SHARED_MIN_M = 17
                try:
                    ok, rel = True, 0.0
                    if ref is not None:
                        got = calls[0]()
                        got = (got if got is not None else out).clone()
                        ok, rel = check(got.cpu(), ref)
                    t = time_calls(calls)
                    rows.append(dict(layer=name, n=n, k=k, m=m, variant=label, us=t.median_us,
                                     spread_us=t.spread_us, how=t.how, check_ok=ok, max_rel_err=rel))
                except Exception as exc:  # noqa: BLE001 - a variant that fails is recorded, not fatal
                    rows.append(dict(layer=name, n=n, k=k, m=m, variant=label, error=f"{type(exc).__name__}: {exc}"))
                finally:
                    GEMM_MODULE.SHARED_TAIL_MAX_REGS = old_cap
                    _tiles.SWAP_DECODE_SHARED_MIN_M = old_min
                r = rows[-1]
                print(f"{name} M={m} {label}: " + (f"{r['us']:.1f} us ok={r['check_ok']}" if "us" in r
                                                    else r["error"]), flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="")
    parser.add_argument("--ms", default="17,24,32,2048,8192")
    parser.add_argument("--layers", default=",".join(SHAPES))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("shared_walk.py times compiled kernels: it needs a CUDA GPU (none found)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    ms = [int(v) for v in args.ms.split(",")]
    rows = []
    for name in args.layers.split(","):
        n, k = SHAPES[name]
        rows += bench(name, n, k, ms, device, gen)
    bad = [r for r in rows if r.get("error") or not r.get("check_ok", True)]
    by = {(r["layer"], r["m"], r["variant"]): r.get("us") for r in rows}
    names = ["bf16", "dense", "fp8", "shared", "shared_nocap", "ql_dense", "ql_free", "ql_pow2"]
    print(f"\nchecks: {len(rows) - len(bad)} ok, {len(bad)} failed or errored")
    print("us (x bf16)  " + "  ".join(f"{v:>14}" for v in names))
    for name in args.layers.split(","):
        for m in ms:
            b = by.get((name, m, "bf16"))
            cells = []
            for v in names:
                us = by.get((name, m, v))
                cells.append(f"{us:7.1f} ({b / us:4.2f})" if us and b else f"{'-':>14}")
            print(f"{name:>7} {m:>5} " + "  ".join(cells))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "shared_walk.json").write_text(json.dumps({"rows": rows, "torch": torch.__version__,
                                                          "device": torch.cuda.get_device_name()}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
