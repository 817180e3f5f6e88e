"""Kept: the tile grid behind _tiles.SWAP_MID_TILES and the mid route's bounds.

Tiles of the operand-swapped GEMM for mid-sized calls (64-1024 tokens), dense and with the residual.

Between decode (at most 32 tokens) and prefill (2048 and up) ``QuantLinear`` runs the packed kernel on
64 x 64 tiles (65-256 tokens, split-K) or 128 x 128 tiles (257-2047), and the swapped GEMM on its
prefill tiles from 128 tokens where its 128 x 128 output tiles fill the GPU. ``zipper.py`` measured
those calls at 0.5-0.9x BF16 on most Llama-3 / Qwen3 linears. This script times, per layer and M:

- ``bf16``: ``F.linear``;
- ``ql_dense`` / ``ql_pow2``: ``QuantLinear`` as routed (activation quantization included), without
  and with a 10 % residual of power-of-two scales (MosaicQuant's format);
- ``q8``: the ``split8`` activation quantizer alone (what every swapped candidate adds);
- ``swap:<tiles>:s<split>`` / ``shared:<tiles>:s<split>``: the swapped GEMM alone on ``split8``
  activations, dense / with the residual's shared walk, over a grid of tiles (weight rows ``n`` x
  tokens ``m``, packed K bytes a step, warps, stages) and split-K.

``--validate`` then times ``QuantLinear`` as routed (the mid route, ``_tiles.swapped_mid_config``, and the swapped
prefill GEMM from ``_tiles.SWAP_MIN_M`` tokens) against the same layers on the routes before (``ql_dense_off`` /
``ql_pow2_off``: prefill tiles from 128 tokens, no mid route; ``--before nowide`` / ``notail``: the mid route without
its dense wide tier / the swapped GEMM without its narrower last token tile), interleaved, at more M than the grid saw.

Every candidate is checked against the PyTorch reference (computed on the GPU) before it is
timed. Weights rotate through more than L2; medians of CUDA-graph replays. The table last gives,
per layer and M, the routed ``QuantLinear`` and the best candidate plus ``q8``, as speedups over BF16.

Usage (GPU)::

    python benchmarks/prototypes/mid_m.py [--out DIR] [--ms 64,128,256,512,1024] [--layers llama.o,...]
    python benchmarks/prototypes/mid_m.py --validate [--out DIR]
    TRITON_INTERPRET=1 python benchmarks/prototypes/mid_m.py --dry [--validate]   # CPU: checks on one tiny layer
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path[:0] = [str(Path(__file__).resolve().parents[1] / part) for part in ("kernels", "prototypes")]

from zipper import check, random_residual  # noqa: E402

from mosaicquant import settings  # noqa: E402
from mosaicquant.harness.timing import time_calls  # noqa: E402
from mosaicquant.kernels.act_quant import quantize_activations_reference, quantize_activations_triton  # noqa: E402
from mosaicquant.kernels.quant_linear import QuantLinear  # noqa: E402
from mosaicquant.kernels.w4a4_gemm import w4a4_gemm_reference, w4a4_gemm_swapped_triton  # noqa: E402
from mosaicquant.kernels.zipper import zipper_gemm_reference  # noqa: E402
from mosaicquant.methods.format import PackedW4, residual_shifts  # noqa: E402

LAYERS = {"llama.qkv": (6144, 4096), "llama.o": (4096, 4096), "llama.gate_up": (28672, 4096),
          "llama.down": (4096, 14336), "qwen.gate_up": (24576, 4096), "qwen.down": (4096, 12288)}
MS = (64, 128, 256, 512, 1024)
# name: (block_n weight rows, block_m tokens, block_kp packed bytes a step, warps, stages)
TILES = {"n64m32": (64, 32, 128, 4, 4), "n64m64": (64, 64, 128, 4, 4), "n64m128": (64, 128, 128, 4, 4),
         "n128m64": (128, 64, 64, 8, 3), "n128m128": (128, 128, 64, 8, 3)}
SPLITS = (1, 2, 4, 8)
BUDGET = 0.10
ROTATE_BYTES = 3 * 60 * 2**20


def layer_copies(n: int, k: int, device, gen) -> list[tuple[PackedW4, PackedW4, torch.Tensor]]:
    """Random layers rotated through more than L2: ``(dense, with a pow2 residual, its shifts)`` each."""
    kp = (k + 1) // 2
    count = max(2, math.ceil(ROTATE_BYTES / (n * kp * 1.15)))
    out = []
    for _ in range(count):
        qweight = torch.randint(0, 256, (n, kp), dtype=torch.uint8, device=device)
        w_scale = (torch.rand(n, device=device) * 0.01 + 0.001).to(torch.float16)
        res = random_residual(n, k, BUDGET, device, gen, w_scale=w_scale)
        shifts = residual_shifts(res, w_scale)
        assert shifts is not None
        out.append((PackedW4((n, k), qweight, w_scale.reshape(n, 1)),
                    PackedW4((n, k), qweight, w_scale.reshape(n, 1), residual=res), shifts))
    return out


def candidates(m: int, n: int, k: int, sms: int):
    """``(label, tiles kwargs)`` of the grid worth timing at ``m`` tokens."""
    kp = (k + 1) // 2
    for name, (bn, bm, bkp, warps, stages) in TILES.items():
        if bm > max(32, 2 * m):
            continue
        tiles = -(-n // bn) * -(-m // bm)
        steps = -(-kp // bkp)
        for split in SPLITS:
            if split > 1 and (steps // split < 4 or tiles * split > 6 * sms):
                continue
            yield f"{name}:s{split}", dict(block_n=bn, block_m=bm, block_kp=bkp, num_warps=warps,
                                          num_stages=stages, split_k=split)


def bench(name: str, n: int, k: int, ms, device, gen, sms: int) -> list[dict]:
    rows = []
    layers = layer_copies(n, k, device, gen)
    w_bf16 = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
              for _ in range(max(2, math.ceil(ROTATE_BYTES / (2 * n * k))))]
    ql_dense = [QuantLinear(d).to(device) for d, _, _ in layers]
    ql_pow2 = [QuantLinear(r).to(device) for _, r, _ in layers]
    for m in ms:
        x = (torch.randn(m, k, generator=gen) * 2).to(torch.bfloat16).to(device)
        a8, s8 = quantize_activations_triton(x, layout="split8")
        pa, sa = quantize_activations_reference(x)
        d0, r0, _ = layers[0]
        ref_dense = w4a4_gemm_reference(pa, sa, d0.qweight, d0.scales.reshape(-1), k, out_fp32=True)
        ref_pow2 = zipper_gemm_reference(pa, sa, r0.qweight, r0.scales.reshape(-1), k, r0.residual, out_fp32=True)
        out = torch.empty(m, n, dtype=torch.bfloat16, device=device)

        def record(variant, calls, ref, **extra):
            ok, rel = True, 0.0
            if ref is not None:
                got = calls[0]()
                got = out if got is None else got
                ok, rel = check(got.float(), ref)
            t = time_calls(calls)
            us, spread, how = t.median_us, t.spread_us / t.median_us if t.median_us else 0.0, t.how
            rows.append(dict(layer=name, n=n, k=k, m=m, variant=variant, us=us, spread=spread, ok=ok, rel_err=rel,
                             how=how, **extra))
            print(f"{name:14s} M={m:5d} {variant:22s} {us:9.2f} us {'ok' if ok else 'FAILED'}", flush=True)

        record("bf16", [lambda w=w: F.linear(x, w) for w in w_bf16], None)
        record("ql_dense", [lambda q=q: q(x) for q in ql_dense], ref_dense, route=ql_dense[0].swap_route(m))
        record("ql_pow2", [lambda q=q: q(x) for q in ql_pow2], ref_pow2, route=ql_pow2[0].swap_route(m))
        record("q8", [lambda: quantize_activations_triton(x, layout="split8")], None)
        for label, kw in candidates(m, n, k, sms):
            dense_calls = [lambda d=d, kw=kw: w4a4_gemm_swapped_triton(a8, s8, d.qweight, d.scales.reshape(-1), k,
                                                                       out=out, **kw) for d, _, _ in layers]
            shared_calls = [lambda r=r, s=s, kw=kw: w4a4_gemm_swapped_triton(
                a8, s8, r.qweight, r.scales.reshape(-1), k, out=out, residual=r.residual, residual_walk="shared",
                residual_shifts=s, **kw) for _, r, s in layers]
            record(f"swap:{label}", dense_calls, ref_dense, tiles=kw)
            record(f"shared:{label}", shared_calls, ref_pow2, tiles=kw)
    return rows


VALIDATE_MS = (40, 48, 64, 80, 96, 112, 128, 160, 192, 256, 320, 384, 512, 768, 1024)
# the routes before the mid tiles: the swapped prefill GEMM from 128 tokens, no mid route
BEFORE = dict(swap_min_m=128, swap_mid=False)


def validate(name: str, n: int, k: int, ms, device, gen, rounds: int = 2, before: str = "nomid") -> list[dict]:
    """``QuantLinear`` as routed now (``ql_*``) and with the routes before (``ql_*_off``), interleaved ``rounds``
    times, with BF16, dense and with the residual. ``before``: ``"nomid"`` (:data:`BEFORE`: no mid route, prefill
    tiles from 128 tokens), ``"nowide"`` (the mid route without its dense wide tier, the tile table's ``swap_mid_wide_min_m`` = 0) or
    ``"notail"`` (every token tile full size, ``QuantLinear(swap_tail=False)``)."""
    rows = []
    layers = layer_copies(n, k, device, gen)
    w_bf16 = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
              for _ in range(max(2, math.ceil(ROTATE_BYTES / (2 * n * k))))]
    off_kw = {"nomid": BEFORE, "nowide": {}, "notail": {"swap_tail": False}}[before]
    qls = {"ql_dense": [QuantLinear(d).to(device) for d, _, _ in layers],
           "ql_dense_off": [QuantLinear(d, **off_kw).to(device) for d, _, _ in layers],
           "ql_pow2": [QuantLinear(r).to(device) for _, r, _ in layers],
           "ql_pow2_off": [QuantLinear(r, **off_kw).to(device) for _, r, _ in layers]}
    for m in ms:
        x = (torch.randn(m, k, generator=gen) * 2).to(torch.bfloat16).to(device)
        pa, sa = quantize_activations_reference(x)
        d0, r0, _ = layers[0]
        ref_dense = w4a4_gemm_reference(pa, sa, d0.qweight, d0.scales.reshape(-1), k, out_fp32=True)
        ref_pow2 = zipper_gemm_reference(pa, sa, r0.qweight, r0.scales.reshape(-1), k, r0.residual, out_fp32=True)
        for rnd in range(rounds):
            t = time_calls([lambda w=w: F.linear(x, w) for w in w_bf16])
            rows.append(dict(layer=name, n=n, k=k, m=m, variant="bf16", round=rnd, us=t.median_us, ok=True))
            for key, mods in qls.items():
                no_wide = {"swap_mid_wide_min_m": 0} if key.endswith("_off") and before == "nowide" else {}
                with settings.use_tiles(**no_wide):
                    ok, rel = check(mods[0](x).float(), ref_pow2 if "pow2" in key else ref_dense)
                    t = time_calls([lambda q=q: q(x) for q in mods])
                    route = mods[0].swap_route(m)
                    tiles = mods[0].swap_tiles(m) if route in ("mid", "prefill") else None
                rows.append(dict(layer=name, n=n, k=k, m=m, variant=key, round=rnd, us=t.median_us, ok=ok,
                                 rel_err=rel, route=route, tiles=tiles))
            print(f"{name:14s} M={m:5d} round {rnd}: " + "  ".join(
                f"{r['variant']}={r['us']:.1f}" for r in rows if r["m"] == m and r["round"] == rnd), flush=True)
    return rows


def validate_table(rows: list[dict]) -> str:
    by = {}
    for r in rows:
        by.setdefault((r["layer"], r["m"]), {}).setdefault(r["variant"], []).append(r)
    lines = ["layer           M  bf16us  dense: now/before  routes        x bf16 now / before    "
             "pow2: now/before  routes        x bf16 now / before"]
    for (layer, m), v in by.items():
        med = {key: sorted(r["us"] for r in rs)[len(rs) // 2] for key, rs in v.items()}
        bf = med["bf16"]
        cells = []
        for key in ("ql_dense", "ql_pow2"):
            on, off = med[key], med[key + "_off"]
            routes = f"{v[key][0]['route']}/{v[key + '_off'][0]['route']}"
            cells.append(f"{on / off:5.2f}  {routes:16s} {bf / on:5.2f} / {bf / off:5.2f}")
        lines.append(f"{layer:14s} {m:5d} {bf:7.1f}   " + "      ".join(cells))
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    by = {}
    for r in rows:
        by.setdefault((r["layer"], r["m"]), {})[r["variant"]] = r
    lines = ["layer           M   bf16us  ql_dense  best dense (x, tiles)          ql_pow2  best pow2 (x, tiles)"]
    for (layer, m), v in by.items():
        bf = v["bf16"]["us"]
        q8 = v["q8"]["us"]
        best = {}
        for kind in ("swap", "shared"):
            cands = [(r["us"], key) for key, r in v.items() if key.startswith(kind + ":") and r["ok"]]
            best[kind] = min(cands) if cands else (float("nan"), "-")
        lines.append(
            f"{layer:14s} {m:5d} {bf:7.1f}  {bf / v['ql_dense']['us']:6.2f}   "
            f"{bf / (best['swap'][0] + q8):5.2f} {best['swap'][1]:22s}  {bf / v['ql_pow2']['us']:6.2f}   "
            f"{bf / (best['shared'][0] + q8):5.2f} {best['shared'][1]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    global ROTATE_BYTES
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--ms", default=None)
    parser.add_argument("--layers", default=",".join(LAYERS))
    parser.add_argument("--validate", action="store_true",
                        help="QuantLinear as routed against the routes before the mid tiles (default M: VALIDATE_MS)")
    parser.add_argument("--before", choices=("nomid", "nowide", "notail"), default="nomid",
                        help="--validate's other routes: no mid route, the mid route without its dense wide tier, or "
                             "without the narrower last token tile")
    parser.add_argument("--dry", action="store_true", help="CPU (TRITON_INTERPRET=1): one tiny layer, checks only")
    args = parser.parse_args(argv)
    if args.dry:
        LAYERS["dry"] = (192, 512)
        args.layers, args.ms = "dry", args.ms or "64"
        ROTATE_BYTES = 0  # two copies of each layer
        device, sms = torch.device("cpu"), 4
    elif not torch.cuda.is_available():
        print("mid_m.py times GPU kernels: no CUDA device here (--dry checks on the CPU)", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda")
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    gen = torch.Generator().manual_seed(0)
    ms = [int(v) for v in (args.ms or ",".join(map(str, VALIDATE_MS if args.validate else MS))).split(",")]
    rows = []
    for name in args.layers.split(","):
        n, k = LAYERS[name]
        rows += (validate(name, n, k, ms, device, gen, before=args.before) if args.validate
                 else bench(name, n, k, ms, device, gen, sms))
        if args.out is not None:  # what is done so far survives a time limit
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "results.json").write_text(json.dumps({"rows": rows}))
    failed = [r for r in rows if not r["ok"]]
    text = validate_table(rows) if args.validate else table(rows)
    print(f"\nchecks: {sum(r['ok'] for r in rows)} ok, {len(failed)} FAILED")
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "rows": rows}, indent=1))
        (args.out / "table.txt").write_text(text + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
