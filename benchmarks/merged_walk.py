"""The swapped GEMM's residual walks at prefill: "shared" (today's), "shifted" and "merged", on the GPU.

With power-of-two residual scales (MosaicQuant's ``rscale=pow2``) a kept row's scale is ``s_w · 2^-j``. The
swapped GEMM's walks then add a kept block's integers into the dense int32 accumulator:

- ``shared``: the packed residual nibbles unpacked and shifted left by ``4 - j`` in the walk;
- ``shifted``: the same integers stored shifted as int8 (twice the residual's bytes), no unpacking in the walk;
- ``merged``: for ``j <= 3``, base and residual of a kept 128-value unit as one int8 operand ``8 q + 2^(3-j) r``;
  the dense loop skips the K steps kept blocks cover (a step table), so a kept unit costs one int8 step in place
  of a dense step plus a residual step. ``mergedN``: its dense loop pipelined ``N`` deep instead of
  :data:`~mosaicquant.kernels.w4a4_gemm.MERGED_DENSE_STAGES`; ``merged_tN``: its walk ``N`` deep instead of
  :data:`~mosaicquant.kernels.w4a4_gemm.SHARED_TAIL_STAGES`.
- ``<walk>_sN`` (e.g. ``dense_s4``): that walk with the launch's ``num_stages`` N (the dense loop's depth).
- ``dense64``: the dense GEMM at the merged walk's 64-byte K steps (decode M only; the others take
  :func:`~mosaicquant.kernels._tiles.swapped_decode_config`'s tiles there, 64-byte steps for ``merged``).
- ``<variant>_j`` (e.g. ``dense_j``, ``ql_shared_j``): that variant with each K step and walked unit one dot on the
  joined halves (:data:`~mosaicquant.kernels.w4a4_gemm.JOINED_DOT`) instead of a dot per half.
- ``ql_shared`` / ``ql_merged``: ``QuantLinear`` on BF16 input (activation quantization included) as it routes the
  call, with :data:`mosaicquant.kernels.quant_linear.MERGED_WALK` off / on (on: decode M on the swapped GEMM's
  decode tiles, ``_tiles.SWAP_DECODE_MERGED_MIN_M`` 1); ``ql_dense``: the dense layer as it routes.

For the Llama-3-8B linears (q/k/v, o, gate/up, down) at prefill M, 10 % random blocks of 128 × 128 with random
``j`` in 0..3, weights rotated through more than L2, GEMM alone on ``split8`` activations. ``shared`` is checked
against a float64 reference of the same integers, the other walks against ``shared`` bit for bit. Medians of
CUDA-graph replays, three interleaved rounds; the table last gives µs, the residual's cost over ``dense`` and
speedup over ``bf16``.

Usage (GPU)::

    python benchmarks/merged_walk.py [--out DIR] [--ms 2048,8192] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mosaicquant.harness.results import source_fingerprint  # noqa: E402
from mosaicquant.harness.timing import time_calls  # noqa: E402
from mosaicquant.kernels._tiles import swapped_decode_config  # noqa: E402
from mosaicquant.kernels.act_quant import quantize_activations_triton  # noqa: E402
from mosaicquant.kernels.w4a4_gemm import (  # noqa: E402
    dense_step_table,
    merged_residual_operand,
    shifted_residual_operand,
    w4a4_gemm_swapped_triton,
)
from mosaicquant.kernels.quant_linear import QuantLinear  # noqa: E402
from mosaicquant.methods.format import PackedW4, residual_shifts, unpack_int4  # noqa: E402
from zipper import ROTATE_BYTES, random_residual  # noqa: E402  (benchmarks/zipper.py)

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
BUDGET = 0.10
GEMM_MODULE = importlib.import_module("mosaicquant.kernels.w4a4_gemm")
VARIANTS = ["bf16", "dense", "shared", "shifted", "merged", "merged3", "merged4", "ql_shared", "ql_merged"]
DECODE_VARIANTS = ["bf16", "dense", "dense64", "shared", "merged", "merged4", "ql_dense", "ql_shared", "ql_merged"]
TILES_MODULE = importlib.import_module("mosaicquant.kernels._tiles")
QL_MODULE = importlib.import_module("mosaicquant.kernels.quant_linear")


def random_layer(n: int, k: int, device, gen: torch.Generator) -> dict:
    """A random base and a 10 % residual of power-of-two scales (j in 0..3), with every walk's tables."""
    qweight = torch.randint(0, 256, (n, (k + 1) // 2), dtype=torch.uint8, generator=gen)
    w_scale = (torch.rand(n, generator=gen) * 0.01 + 0.001).to(torch.float16)
    res = random_residual(n, k, BUDGET, device, gen, w_scale=w_scale.to(device), max_shift=3)
    qweight, w_scale = qweight.to(device), w_scale.to(device)
    shifts = residual_shifts(res, w_scale)
    assert shifts is not None and int(shifts.max()) <= 3
    return dict(qweight=qweight, w_scale=w_scale, residual=res, shifts=shifts,
                shifted=shifted_residual_operand(res, shifts),
                merged=merged_residual_operand(qweight, k, res, shifts), steps=dense_step_table(res, k))


def reference(a8: torch.Tensor, s8: torch.Tensor, layer: dict, k: int) -> torch.Tensor:
    """float64 ``(A_int · W_eff^T) ⊙ s_a`` of the split8 integers and base + residual (exact integer products)."""
    m = a8.shape[0]
    a = a8.view(m, -1, 2, 64).transpose(-1, -2).reshape(m, -1)[:, :k].double()
    res = layer["residual"]
    w = unpack_int4(layer["qweight"], k).double() * layer["w_scale"].double()[:, None]
    w = w + res.to_dense(torch.float64)
    return (a @ w.T) * s8.double()[:, None]


def copies(n: int, k: int) -> int:
    return max(2, math.ceil(ROTATE_BYTES / (n * (k + 1) // 2 * 1.2)))


def _base(variant: str) -> str:
    """The variant without its ``_j`` (joined dots) suffix."""
    return variant.removesuffix("_j")


def _settings(variant: str) -> dict:
    """Module settings a variant runs under: (module, attribute) -> value."""
    out = {(GEMM_MODULE, "JOINED_DOT"): variant.endswith("_j")}
    variant = _base(variant)
    if variant.startswith("merged_t"):
        out[(GEMM_MODULE, "SHARED_TAIL_STAGES")] = int(variant[len("merged_t"):])
    elif variant.startswith("merged") and variant != "merged":
        out[(GEMM_MODULE, "MERGED_DENSE_STAGES")] = int(variant[len("merged"):])
    if variant.startswith("ql_"):
        out[(QL_MODULE, "MERGED_WALK")] = variant == "ql_merged"
        out[(TILES_MODULE, "SWAP_DECODE_MERGED_MIN_M")] = 1 if variant == "ql_merged" else 0
    return out


class _Using:
    """Apply a variant's module settings inside a ``with`` block."""

    def __init__(self, variant: str):
        self.settings = _settings(variant)

    def __enter__(self):
        self.old = {key: getattr(*key) for key in self.settings}
        for (mod, attr), value in self.settings.items():
            setattr(mod, attr, value)

    def __exit__(self, *exc):
        for (mod, attr), value in self.old.items():
            setattr(mod, attr, value)


def bench(name: str, n: int, k: int, ms: list[int], rounds: int, variants: list[str], device, gen) -> list[dict]:
    rows = []
    layers = [random_layer(n, k, device, gen) for _ in range(copies(n, k))]
    for m in ms:
        x = (torch.randn(m, k, generator=gen) * 2).to(torch.bfloat16).to(device)
        w_bf16 = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
                  for _ in range(max(2, math.ceil(ROTATE_BYTES / (2 * n * k))))]
        a8, s8 = quantize_activations_triton(x, layout="split8")
        out = torch.empty(m, n, dtype=torch.bfloat16, device=device)

        def gemm(walk, lay):
            kw = {}
            walk, _, stages = _base(walk).partition("_s")  # "<walk>_sN": the launch's num_stages N
            if stages:
                kw["num_stages"] = int(stages)
            if m <= 32:  # the swapped GEMM's decode tiles
                kw = swapped_decode_config(m, n, (k + 1) // 2, device,
                                           block_kp=64 if walk.startswith("merged") or walk == "dense64" else None)
            if m <= 32 and stages:
                kw["num_stages"] = int(stages)
            if walk not in ("dense", "dense64"):
                base = walk.split("_")[0].rstrip("0123456789")
                kw.update(residual=lay["residual"], residual_walk=base, residual_shifts=lay["shifts"])
                if base in ("shifted", "merged"):
                    kw["residual_operand"] = lay[base]
                if base == "merged":
                    kw["dense_steps"] = lay["steps"]
            return lambda: w4a4_gemm_swapped_triton(a8, s8, lay["qweight"], lay["w_scale"], k, out=out, **kw)

        calls = {"bf16": [lambda w=w: F.linear(x, w) for w in w_bf16]}
        qls = {key: [QuantLinear(PackedW4((n, k), lay["qweight"], lay["w_scale"].reshape(n, 1),
                                          residual=None if key == "ql_dense" else lay["residual"])) for lay in layers]
               for key in ("ql_dense", "ql_res") if any(v.startswith("ql_") for v in variants)}
        for v in variants[1:]:
            if v.startswith("ql_"):
                calls[v] = [lambda q=q: q(x) for q in qls["ql_dense" if _base(v) == "ql_dense" else "ql_res"]]
            else:
                calls[v] = [gemm(v, lay) for lay in layers]
        ref = reference(a8, s8, layers[0], k)
        shared_out = None
        status = {}
        outs = {}
        for v in variants[1:]:  # check every variant once, before timing
            try:
                with _Using(v):
                    got = calls[v][0]()
                got = (got if got is not None else out).clone()
                outs[v] = got
                if v.endswith("_j") and _base(v) in outs:  # the same sums as the dots per half
                    ok = torch.equal(got, outs[_base(v)])
                    status[v] = (ok, f"bits {'equal to' if ok else 'differ from'} {_base(v)}")
                elif _base(v).partition("_s")[0] in ("dense", "dense64") or _base(v) == "ql_dense":
                    status[v] = (True, "not checked (no residual)")
                elif v.startswith("ql_") or v == "shared" or (m <= 32 and not torch.equal(got, shared_out)):
                    # against the reference: QuantLinear (activations quantized on the GPU), the shared walk, and at
                    # decode tiles the walks whose split K differs from the shared walk's (64-byte steps: partials
                    # summed in another order); at prefill tiles every walk gives the shared walk's bits
                    err = (got.double() - ref).abs()
                    loose = v.startswith("ql_")
                    ok = bool(torch.isfinite(got).all()) and bool(
                        (err <= (2**-6 if loose else 2**-7) * ref.abs() + (4e-3 if loose else 1e-3) * ref.abs().max())
                        .all())
                    status[v] = (ok, f"max rel err {(err.max() / ref.abs().max()).item():.2e}")
                    if v == "shared":
                        shared_out = got
                else:
                    ok = shared_out is not None and torch.equal(got, shared_out)
                    status[v] = (ok, "bits equal to shared" if ok else "bits differ from shared")
            except Exception as exc:  # noqa: BLE001 - a variant that fails is recorded, not fatal
                status[v] = (False, f"{type(exc).__name__}: {exc}")
        del ref
        rows += time_variants(name, n, k, m, variants, calls, status, rounds, _Using)
    return rows


def time_variants(name: str, n: int, k: int, m: int, variants, calls: dict, status: dict, rounds: int,
                  context=contextlib.nullcontext) -> list[dict]:
    """Time every variant whose check passed (``status[v]``: ``(ok, note)``; none: not checked) ``rounds`` times,
    interleaved, each under ``context(v)``; a row per variant with its median, printed as it is made."""
    times = {v: [] for v in variants}
    for _ in range(rounds):
        for v in variants:
            if not status.get(v, (True, ""))[0]:
                continue
            with context(v):
                times[v].append(time_calls(calls[v]).median_us)
    rows = []
    for v in variants:
        ok, note = status.get(v, (True, ""))
        row = dict(layer=name, n=n, k=k, m=m, variant=v, check_ok=ok, check=note, rounds_us=times[v])
        if times[v]:
            row["us"] = statistics.median(times[v])
        rows.append(row)
        print(f"{name} M={m} {v}: " + (f"{row['us']:.1f} us" if "us" in row else "not timed") + f" {note}",
              flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="")
    parser.add_argument("--ms", default="2048,8192")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", default=",".join(SHAPES))
    parser.add_argument("--variants", default="", help="bf16 and dense always run (default: VARIANTS, or "
                        "DECODE_VARIANTS when every M is at most 32)")
    args = parser.parse_args(argv)
    ms = [int(v) for v in args.ms.split(",")]
    chosen = args.variants.split(",") if args.variants else (DECODE_VARIANTS if max(ms) <= 32 else VARIANTS)
    variants = ["bf16", "dense"] + [v for v in chosen if v not in ("bf16", "dense")]
    if not torch.cuda.is_available():
        print("merged_walk.py times compiled kernels: it needs a CUDA GPU (none found)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name in args.layers.split(","):
        n, k = SHAPES[name]
        rows += bench(name, n, k, ms, args.rounds, variants, device, gen)
    bad = [r for r in rows if not r["check_ok"]]
    by = {(r["layer"], r["m"], r["variant"]): r.get("us") for r in rows}
    print(f"\nchecks: {len(rows) - len(bad)} ok, {len(bad)} failed or errored")
    print("µs (residual over dense; × bf16)")
    print(f"{'layer':>7} {'M':>5} " + " ".join(f"{v:>22}" for v in variants))
    for name in args.layers.split(","):
        for m in ms:
            b, d = by.get((name, m, "bf16")), by.get((name, m, "dense"))
            cells = []
            for v in variants:
                us = by.get((name, m, v))
                if not us:
                    cells.append(f"{'-':>22}")
                    continue
                over = f"{us / d - 1:+6.1%}" if d and v not in ("bf16", "dense") else " " * 6
                cells.append(f"{us:8.1f} {over} ({b / us:4.2f})")
            print(f"{name:>7} {m:>5} " + " ".join(cells))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "merged_walk.json").write_text(json.dumps({
            "rows": rows, "torch": torch.__version__, "device": torch.cuda.get_device_name(),
            "source_sha256": source_fingerprint()}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
