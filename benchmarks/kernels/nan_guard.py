"""Cost of the quantizers' NaN/Inf guard and the decode kernels' range checks, old against new in one run (GPU).

The quantizers take each group's range with NaN-propagating reductions and give a group holding NaN or Inf
the scale NaN (:func:`mosaicquant.kernels._tl.max_nan`, :func:`~mosaicquant.kernels._tl.sym_scale`,
:func:`~mosaicquant.kernels._tl.asym_scale`); the RoPE / attention kernels clamp positions and lengths and
flag the ones out of range (:func:`mosaicquant.kernels.decoder.check_range_faults`). The old forms are
rebuilt here without touching the package: each kernel module is loaded a second time from its own file,
and that copy's helpers are replaced by the old ones (``tl.max`` / ``tl.min`` / ``tl.maximum``, the scale's
``where(scale > 0, scale, 1)``, no range check) before its kernels first compile.

Each case is first checked: old and new give the same integers and scales on finite inputs, and the new
one a NaN scale where a token holds a NaN (the old one a finite scale). Then both are timed
(:func:`mosaicquant.harness.timing.time_calls`: CUDA graphs, median µs a call, inputs rotated through more
than twice the L2) twice, alternating, at Llama-3-8B shapes: M = 1, 16, 256, 4096 tokens of K = 4096 and
14336 (the RoPE / attention kernels: M tokens of 32 heads, 8 KV heads, D = 128, a 4-bit cache). Prints a
line per case, then a table of median times and the new/old ratio.

    PYTHONPATH=. python benchmarks/nan_guard.py
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/nan_guard.py --smoke   # tiny shapes, checks only
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import warnings
from collections.abc import Callable

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from mosaicquant.harness.timing import time_calls  # noqa: E402
from mosaicquant.kernels import _token_split, act_quant, decoder, hadamard_quant, mixed_gemm  # noqa: E402
from mosaicquant.methods.hadamard import OnlineHadamard, random_signs  # noqa: E402

TOKENS = (1, 16, 256, 4096)
WIDTHS = (4096, 14336)
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
ATTN_MAX_M = 256  # decode attention batches (a 512-slot 4-bit cache a sequence)


# ------------------------------------------------------------------------------------------ the old forms
@triton.jit
def old_max(x, axis: tl.constexpr):
    return tl.max(x, axis)


@triton.jit
def old_min(x, axis: tl.constexpr):
    return tl.min(x, axis)


@triton.jit
def old_maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def old_minimum(a, b):
    return tl.minimum(a, b)


@triton.jit
def old_sym_scale(absmax, clip, DIV: tl.constexpr):
    scale = tl.math.div_rn(absmax * clip, DIV)
    return tl.where(scale > 0.0, scale, 1.0)


@triton.jit
def old_asym_scale(lo, hi, DIV: tl.constexpr):
    scale = tl.math.div_rn(hi - lo, DIV)
    return tl.where(scale > 0.0, scale, 1.0)


@triton.jit
def old_in_range(v, lo, hi, FAULTS, BIT: tl.constexpr):
    return v


OLD_HELPERS = dict(max_nan=old_max, min_nan=old_min, maximum_nan=old_maximum, minimum_nan=old_minimum,
                   sym_scale=old_sym_scale, asym_scale=old_asym_scale, _in_range_or_fault=old_in_range)


def _old_copy(module, **extra):
    """``module`` loaded again from its file, as its own module, with the old helpers (and ``extra``) in place of
    the new ones it imported; its kernels compile on first use, so they see the old helpers."""
    spec = importlib.util.spec_from_file_location(f"nan_guard_old.{module.__name__}", module.__file__)
    copy = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = copy  # dataclasses look their module up there
    spec.loader.exec_module(copy)
    for name, fn in {**OLD_HELPERS, **extra}.items():
        if hasattr(copy, name):
            setattr(copy, name, fn)
    return copy


def old_modules() -> dict:
    """The old copies: ``act_quant``, ``hadamard_quant``, ``decoder`` (its norm + quantizer and its 4-bit cache's
    quantizer, no range checks) and ``mixed_gemm``."""
    ts = _old_copy(_token_split)
    return dict(
        act_quant=_old_copy(act_quant, token_scale=ts.token_scale),
        hadamard_quant=_old_copy(hadamard_quant, token_scale=ts.token_scale),
        decoder=_old_copy(decoder),
        mixed_gemm=_old_copy(mixed_gemm),
    )


NEW = dict(act_quant=act_quant, hadamard_quant=hadamard_quant, decoder=decoder, mixed_gemm=mixed_gemm)


# ------------------------------------------------------------------------------------------------- cases
def _acts(m: int, k: int, device, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, device=device, generator=gen)
    x[:, ::97] *= 10
    return x.to(torch.bfloat16)


def _flat(result) -> list[torch.Tensor]:
    """The tensors of a quantizer's result (a tuple or a NamedTuple; ``None`` fields left out)."""
    return [t for t in (result if isinstance(result, tuple) else (result,)) if isinstance(t, torch.Tensor)]


def _scales(result) -> list[torch.Tensor]:
    return [t for t in _flat(result) if t.dtype == torch.float32]


class Case:
    """One kernel at one shape: ``make(mods, x)`` runs it with the old or new modules on input ``x``."""

    def __init__(self, kernel: str, m: int, k: int, make: Callable, inputs: Callable[[int], torch.Tensor],
                 nan_check: bool = True):
        self.kernel, self.m, self.k, self.make, self.inputs, self.nan_check = kernel, m, k, make, inputs, nan_check


def _quant_cases(m: int, k: int, device, hadamard: dict) -> list[Case]:
    def x_of(seed):
        return _acts(m, k, device, seed)

    weight = (torch.rand(k, device=device) + 0.5).to(torch.bfloat16)
    cases = [
        Case("act_quant packed", m, k, lambda mods, x: mods["act_quant"].quantize_activations_triton(x), x_of),
        Case("act_quant split8", m, k,
             lambda mods, x: mods["act_quant"].quantize_activations_triton(x, layout="split8"), x_of),
        Case("rmsnorm_quant", m, k, lambda mods, x: mods["decoder"].rmsnorm_quant(x, weight, 1e-5, kernel="triton"),
             x_of),
    ]
    if k not in hadamard:
        hadamard[k] = OnlineHadamard(k, signs=random_signs(k, seed=k)).to(device)
    had = hadamard[k]
    if hadamard_quant.fused_hadamard_reason(had, torch.bfloat16) is None:
        cases.append(Case("hadamard_quant", m, k, lambda mods, x: mods["hadamard_quant"].hadamard_quantize_triton(
            x, had), x_of))
    hi = min(128, k // 8)

    def atom(mods, x):  # Atom: symmetric groups of 128, the last 128 channels at 8 bits
        fmt = mods["mixed_gemm"].MixedFormat(k_lo=k - hi, k_hi=hi, group_size=128)
        return mods["mixed_gemm"].mixed_act_quant_triton(x, fmt)

    def resq(mods, x):  # ResQ: asymmetric per token, the last K/8 channels at 8 bits
        fmt = mods["mixed_gemm"].MixedFormat(k_lo=k - k // 8, k_hi=k // 8, lo_symmetric=False, hi_symmetric=False)
        return mods["mixed_gemm"].mixed_act_quant_triton(x, fmt)

    cases += [Case("mixed act quant (Atom)", m, k, atom, x_of), Case("mixed act quant (ResQ)", m, k, resq, x_of)]
    return cases


def _decode_cases(m: int, device, heads: int, kv_heads: int, d: int, slots: int) -> list[Case]:
    width = (heads + 2 * kv_heads) * d
    angles = torch.rand(slots, d, device=device) * 6
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    caches = {}

    def cache(mods):
        if id(mods["decoder"]) not in caches:
            dec = mods["decoder"]
            packed = torch.zeros(m, kv_heads, slots, d // 2, dtype=torch.uint8, device=device)
            # an asymmetric 4-bit cache without the Q/K rotation (each module copy has its own KVFormat class)
            caches[id(dec)] = (packed, packed.clone(), dec.KVScales.empty(m, kv_heads, slots, device),
                               dec.KVFormat(4, False, 0.95, False))
        return caches[id(mods["decoder"])]

    positions = torch.randint(0, slots - 1, (m,), device=device)

    def rope(mods, x):
        kc, vc, sc, fmt = cache(mods)
        return mods["decoder"].rope_kv(x, positions, cos, sin, kc, vc, heads, kv_heads, 1, kernel="triton",
                                       kv=fmt, scales=sc)

    def attention(mods, x):
        kc, vc, sc, fmt = cache(mods)
        return mods["decoder"].decode_rope_attention(x, positions, cos, sin, kc, vc, heads, kv_heads, d ** -0.5,
                                                     kernel="triton", kv=fmt, scales=sc)

    cases = [Case("rope_kv, 4-bit cache", m, width, rope, lambda seed: _acts(m, width, device, seed), False)]
    if m <= ATTN_MAX_M:
        cases.append(Case("decode_rope_attention, 4-bit cache", m, width, attention,
                          lambda seed: _acts(m, width, device, seed), False))
    return cases


# ---------------------------------------------------------------------------------------------- checking
def check(case: Case, old: dict) -> str:
    """Old and new equal on finite inputs; with a NaN in token 0, the new scales NaN there (quantizers)."""
    x = case.inputs(1)
    a, b = case.make(old, x), case.make(NEW, x)
    for u, v in zip(_flat(a), _flat(b)):
        if not torch.equal(u, v):
            raise AssertionError(f"{case.kernel} M={case.m} K={case.k}: old and new differ on finite inputs")
    if not case.nan_check:
        return "same outputs"
    bad = x.clone()
    bad[0, 3] = float("nan")
    new_scale = _scales(case.make(NEW, bad))[0].reshape(case.m, -1)[0]
    old_scale = _scales(case.make(old, bad))[0].reshape(case.m, -1)[0]
    if not torch.isnan(new_scale).any():
        raise AssertionError(f"{case.kernel}: the new form gave token 0 (holding NaN) a finite scale")
    return f"same outputs; NaN token: new scale NaN, old {'NaN' if torch.isnan(old_scale).any() else 'finite'}"


def _buffers(case: Case) -> list[torch.Tensor]:
    """Inputs rotated through at least twice the L2 (at most 16 of them)."""
    x = case.inputs(2)
    l2 = 50 * 2**20
    if torch.cuda.is_available():
        l2 = getattr(torch.cuda.get_device_properties(x.device), "L2_cache_size", l2) or l2
    count = max(1, min(16, math.ceil(2 * l2 / (x.numel() * x.element_size()))))
    return [x] + [case.inputs(3 + i) for i in range(count - 1)]


def time_case(case: Case, old: dict) -> tuple[float, float]:
    """Median µs a call of the old and the new form (two alternating timings each, averaged)."""
    bufs = _buffers(case)
    runs = {"old": [], "new": []}
    for _ in range(2):
        for label, mods in (("old", old), ("new", NEW)):
            calls = [lambda x=x, mods=mods: case.make(mods, x) for x in bufs]
            runs[label].append(time_calls(calls).median_us)
    return sum(runs["old"]) / 2, sum(runs["new"]) / 2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; checks and one timing each (interpreter)")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--widths", default=",".join(map(str, WIDTHS)))
    args = parser.parse_args(argv)
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if not torch.cuda.is_available() and not interpreting:
        print("nan_guard.py needs a CUDA GPU (or TRITON_INTERPRET=1 with --smoke)", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() and not interpreting else "cpu")
    if interpreting:  # the interpreter's numpy warns of the NaN arithmetic the checks ask for
        warnings.filterwarnings("ignore", category=RuntimeWarning)
    if args.smoke:
        tokens, widths, decode_shape = (1, 3), (256,), (4, 2, 32, 16)
    else:
        tokens = tuple(int(v) for v in args.tokens.split(","))
        widths = tuple(int(v) for v in args.widths.split(","))
        decode_shape = (HEADS, KV_HEADS, HEAD_DIM, 512)
    old = old_modules()
    hadamard: dict = {}
    cases = [c for m in tokens for k in widths for c in _quant_cases(m, k, device, hadamard)]
    cases += [c for m in tokens for c in _decode_cases(m, device, *decode_shape)]
    rows = []
    for case in cases:
        note = check(case, old)
        old_us, new_us = time_case(case, old)
        rows.append((case, old_us, new_us))
        print(f"{case.kernel}, M={case.m}, K={case.k}: old {old_us:.2f} µs, new {new_us:.2f} µs ({note})", flush=True)
    how = "cuda graphs" if device.type == "cuda" else "cpu wall time (interpreter: not a GPU timing)"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\nmedian µs a call, {name}, {how}")
    print("| kernel | M | K | old µs | new µs | new / old |")
    print("|---|---:|---:|---:|---:|---:|")
    for case, old_us, new_us in rows:
        print(f"| {case.kernel} | {case.m} | {case.k} | {old_us:.2f} | {new_us:.2f} | {new_us / old_us:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
