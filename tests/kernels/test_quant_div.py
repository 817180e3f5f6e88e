"""The quantizers' division by a row's scale (mosaicquant.kernels._tl.quant_div) against IEEE division.

Quotients are placed within a few ulps of every half-integer of the 4-bit and 8-bit grids, where a
rounding error would change an integer, and scales span fp32's range, subnormal ones included.
"""

from fractions import Fraction

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from mosaicquant.kernels import _tl
from mosaicquant.kernels._tl import quant_div

from ._helpers import DEVICE, needs_triton

# quant_div's range guard in its "fma" mode
GUARD_LO, GUARD_HI, GUARD_F = (float(c.value) for c in (_tl._GUARD_LO, _tl._GUARD_HI, _tl._GUARD_UP))
assert _tl._GUARD_DOWN.value == 1 / GUARD_F
# the form that runs here: the float64 product on the interpreter, the two-FMA correction compiled
_FORM = "fp64" if _tl._QDIV_FP64.value else "fma"


@triton.jit
def _quant_div_kernel(x_ptr, s_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    s = tl.load(s_ptr + offs, mask=mask, other=1.0)
    tl.store(out_ptr + offs, quant_div(x, s), mask=mask)


def _scales(gen: np.random.Generator, count: int) -> np.ndarray:
    """Positive fp32 scales: log-uniform over fp32's range (subnormals included), the guard's edges, 1."""
    exps = gen.uniform(-148.0, 125.0, count)
    s = (np.exp2(exps) * gen.uniform(1.0, 2.0, count)).astype(np.float32)
    edges = np.array([GUARD_LO, GUARD_HI, 1.0, 2.0**-149, 2.0**-126, 2.0**127], dtype=np.float32)
    edges = np.concatenate([edges, np.nextafter(edges, np.float32(0)), np.nextafter(edges, np.float32(np.inf))])
    s = np.concatenate([s, edges[np.isfinite(edges) & (edges > 0)]])
    return s[np.isfinite(s) & (s > 0)]


def _adversarial(seed: int, count: int = 400) -> tuple[np.ndarray, np.ndarray]:
    """Pairs (x, s) whose quotient lies within 3 ulps of a half-integer in [-128.5, 128.5], and random ones."""
    gen = np.random.default_rng(seed)
    s = _scales(gen, count)
    halves = np.concatenate([np.arange(-10, 10) + 0.5, [-128.5, -127.5, 126.5, 127.5], [0.0, 1.0, 7.0, -8.0]])
    xs, ss = [], []
    for h in halves:
        with np.errstate(over="ignore"):  # h·s past fp32's range is dropped below
            x = (np.float64(h) * s.astype(np.float64)).astype(np.float32)  # the fp32 nearest h·s
        for step in range(-3, 4):
            y = x.copy()
            for _ in range(abs(step)):
                y = np.nextafter(y, np.float32(np.inf) if step > 0 else np.float32(-np.inf))
            xs.append(y)
            ss.append(s)
    with np.errstate(over="ignore"):
        xs.append((gen.standard_normal(len(s)) * s * 5).astype(np.float32))
    ss.append(s)
    x, s = np.concatenate(xs), np.concatenate(ss)
    keep = np.isfinite(x) & (np.abs(x.astype(np.float64) / s.astype(np.float64)) < 1e6)
    return x[keep], s[keep]


@needs_triton()
@pytest.mark.parametrize("seed", [0, 1])
def test_quant_div_is_ieee_division(seed):
    x, s = _adversarial(seed)
    xt, st = torch.from_numpy(x), torch.from_numpy(s)
    expect = xt / st  # IEEE fp32 division on the CPU
    out = torch.full_like(xt, float("nan")).to(DEVICE)
    block = 4096
    _quant_div_kernel[(triton.cdiv(len(x), block),)](xt.to(DEVICE), st.to(DEVICE), out, len(x), BLOCK=block)
    out = out.cpu()
    # The integers are what the quantizers keep; every normal quotient must be the IEEE one itself.
    assert torch.equal(torch.round(out), torch.round(expect)), f"form {_FORM}: integers differ"
    # Quotients from 1/4 up must be the IEEE ones themselves (smaller ones round to 0 either way).
    large = expect.abs() >= 0.25
    bad = (out != expect) & large
    assert not bad.any(), (f"form {_FORM}: {int(bad.sum())} of {int(large.sum())} quotients differ, "
                           f"e.g. x={x[bad.numpy()][:3]} s={s[bad.numpy()][:3]}")
    assert (out[~large].abs() < 0.5).all()
    assert large.sum() > 0.8 * len(x)


def _rn32(v: Fraction) -> Fraction:
    """``v`` rounded to the nearest fp32 value, ties to even (exact rational arithmetic; no overflow)."""
    if v == 0:
        return Fraction(0)
    sign, a = (-1 if v < 0 else 1), abs(v)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    ulp = Fraction(2) ** (max(e, -126) - 23)
    n, rem = divmod(a, ulp)
    n = int(n) + (1 if rem > ulp / 2 or (rem == ulp / 2 and int(n) % 2) else 0)
    return sign * n * ulp


def _fma_mode(x: Fraction, s: Fraction) -> Fraction:
    """quant_div's "fma" mode, each operation rounded once to fp32 as the GPU rounds it."""
    f = Fraction(GUARD_F) if s < GUARD_LO else (1 / Fraction(GUARD_F) if s > GUARD_HI else Fraction(1))
    s, x = s * f, x * f  # exact: powers of two, fp32 range kept
    r = _rn32(1 / s)
    q0 = _rn32(x * r)
    e = _rn32(x - q0 * s)
    return _rn32(e * r + q0)


def test_fma_mode_sequence_is_exact():
    """The GPU's "fma" sequence gives the correctly rounded quotient (exact arithmetic, any machine)."""
    x, s = _adversarial(2, count=60)
    gen = np.random.default_rng(3)
    pick = gen.choice(len(x), size=min(len(x), 6000), replace=False)
    checked = 0
    for xi, si in zip(x[pick].tolist(), s[pick].tolist()):
        xf, sf = Fraction(xi), Fraction(si)
        q = xf / sf
        if abs(q) < Fraction(1, 4):
            assert abs(_fma_mode(xf, sf)) < Fraction(1, 2), (xi, si)  # the integer 0 either way
            continue
        assert _fma_mode(xf, sf) == _rn32(q), (xi, si)
        checked += 1
    assert checked > 4000


def test_rn32_matches_numpy():
    """The exact rounding helper above agrees with numpy's fp32 rounding of fp64 values that are exact."""
    gen = np.random.default_rng(4)
    vals = np.concatenate([gen.standard_normal(500) * 10.0 ** gen.integers(-40, 38, 500), [2.0**-149 * 3, 1.5]])
    for v in vals.tolist():
        assert float(_rn32(Fraction(v))) == float(np.float32(v)), v
