"""NaN and Inf in the activations reach the output (or raise) on every quantizer path; finite extremes do not.

A token (or a channel group) holding NaN or Inf gets the scale NaN in every Triton quantizer, so its GEMM
output row is NaN, and the other tokens' integers and scales are the reference's, bit for bit. The PyTorch
reference quantizer raises; the simulated one (``fake_quantize``) gives the whole group NaN. Finite values
near ``±3.4e38`` quantize to finite scales on the symmetric and the asymmetric grids alike.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from mosaicquant.kernels import act_quant
from mosaicquant.kernels._tl import asym_scale, max_nan, sym_scale
from mosaicquant.kernels.act_quant import quantize_activations_reference, quantize_activations_triton
from mosaicquant.kernels.decoder import (
    _kv4_quantize,
    kv4_quantize_reference,
    rmsnorm_quant,
    rmsnorm_quant_reference,
    silu_mul_reference,
)
from mosaicquant.kernels.hadamard_quant import hadamard_quantize_reference, hadamard_quantize_triton
from mosaicquant.kernels.mixed_gemm import (
    MixedFormat,
    mixed_act_quant_reference,
    mixed_act_quant_triton,
    mixed_gemm_triton,
    mixed_weights,
)
from mosaicquant.kernels.w4a4_gemm import w4a4_gemm_reference, w4a4_gemm_triton
from mosaicquant.methods.hadamard import OnlineHadamard
from mosaicquant.methods.quant import fake_quantize, quantize

from ._helpers import DEVICE, needs_triton, random_activations, random_layer

# NaN arithmetic is the point here: the interpreter's numpy warns of it
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")]

NAN = float("nan")
INF = float("inf")
BIG = 3.0e38  # finite in fp32 and BF16; 2 · BIG overflows
BAD_ROWS = {1: NAN, 3: INF, 4: -INF}  # token → the non-finite value put in one of its channels
M = 6


def _poisoned(m: int, k: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Random activations ``[m, k]`` on DEVICE with one NaN, +Inf or -Inf channel in the rows of BAD_ROWS."""
    gen = torch.Generator().manual_seed(seed)
    x = random_activations(m, k, gen).to(dtype)
    for row, value in BAD_ROWS.items():
        x[row, (7 * row) % k] = value
    return x.to(DEVICE)


def _good_rows(m: int) -> list[int]:
    return [r for r in range(m) if r not in BAD_ROWS]


def _assert_scales(scale: torch.Tensor, ref_scale: torch.Tensor, what: str) -> None:
    """NaN scale at every bad row; the reference's scale, bit for bit, at the others."""
    scale = scale.cpu()
    bad = sorted(BAD_ROWS)
    assert torch.isnan(scale[bad]).all(), f"{what}: bad rows' scales {scale[bad].tolist()}, expected NaN"
    good = _good_rows(scale.shape[0])
    assert torch.equal(scale[good], ref_scale[good]), f"{what}: good rows' scales differ from the reference"


def _good_reference(x: torch.Tensor, fn):
    """``fn`` (a reference quantizer) of ``x``'s rows with the bad rows zeroed: its results at the good rows."""
    clean = x.detach().cpu().clone()
    clean[sorted(BAD_ROWS)] = 0
    return fn(clean)


# ---------------------------------------------------------------------------------------------------------------
# PyTorch reference
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_reference_quantizer_raises_on_nonfinite(value):
    x = torch.randn(3, 16)
    x[1, 5] = value
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize(x, 4)
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_activations_reference(x)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [None, 8])
def test_fake_quantize_gives_the_whole_group_nan(symmetric, group_size):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 16, generator=gen)
    expected = fake_quantize(x, 4, symmetric=symmetric, group_size=group_size)
    x[1, 2], x[3, 9], x[4, 0] = NAN, INF, -INF
    out = fake_quantize(x, 4, symmetric=symmetric, group_size=group_size)
    g = group_size or 16
    for row, col in ((1, 2), (3, 9), (4, 0)):
        group = slice(col // g * g, col // g * g + g)
        assert torch.isnan(out[row, group]).all(), f"row {row}: {out[row, group].tolist()}"
        rest = torch.ones(16, dtype=torch.bool)
        rest[group] = False
        assert torch.equal(out[row, rest], expected[row, rest])
    assert torch.equal(out[[0, 2]], expected[[0, 2]])


@pytest.mark.parametrize("symmetric", [True, False])
def test_reference_quantizer_keeps_finite_extremes_finite(symmetric):
    x = torch.tensor([[BIG, -BIG, 1.0, 0.0], [-BIG, -1.0, 0.0, 2.0], [BIG, 0.5, 0.0, 0.0]])
    qt = quantize(x, 4, symmetric=symmetric)
    assert torch.isfinite(qt.scale).all(), qt.scale.flatten().tolist()
    deq = qt.dequantize()
    assert torch.isfinite(deq).all(), deq.tolist()
    # the extremes come back within one quantization step
    step = qt.scale.reshape(-1, 1)
    assert ((deq - x).abs()[:, :2] <= step).all(), (deq, x)
    assert torch.equal(fake_quantize(x, 4, symmetric=symmetric), deq)
    if not symmetric:  # the span 2 · BIG overflows fp32; the scale is its correctly rounded 15th all the same
        assert qt.scale[0].item() == torch.tensor(BIG * 2 / 15, dtype=torch.float64).float().item()


# ---------------------------------------------------------------------------------------------------------------
# Triton quantizers
# ---------------------------------------------------------------------------------------------------------------


@needs_triton()
@pytest.mark.parametrize("k,layout", [(300, "packed"), (300, "split8"), (2 * act_quant.MAX_BLOCK_KP + 70, "packed")])
def test_act_quant_nonfinite_token_gets_nan_scale(k, layout):
    # one-pass rows (300), and rows longer than a tile (the two-pass absmax)
    x = _poisoned(M, k, seed=k)
    q, scale = quantize_activations_triton(x, layout=layout)
    ref_packed, ref_scale = _good_reference(x, quantize_activations_reference)
    _assert_scales(scale, ref_scale, f"act_quant {layout} K={k}")
    good = _good_rows(M)
    if layout == "packed":
        assert torch.equal(q.cpu()[good], ref_packed[good])


@needs_triton()
def test_act_quant_gated_nonfinite_token_gets_nan_scale():
    gen = torch.Generator().manual_seed(11)
    g = random_activations(M, 256, gen)
    u = random_activations(M, 256, gen)
    g[1, 3], u[3, 5], u[4, 0] = NAN, INF, -INF
    x = torch.cat([g, u], 1).to(DEVICE)
    _, scale = quantize_activations_triton(x, gated=True)
    _, ref_scale = _good_reference(silu_mul_reference(x.cpu()), quantize_activations_reference)
    _assert_scales(scale, ref_scale, "gated act_quant")


@needs_triton()
def test_act_quant_split_programs_take_a_nan_absmax():
    # several programs a token meet for the row's absmax (given here: the interpreter cannot run the barrier)
    x = _poisoned(M, 512, seed=5)
    absmax = x.float().abs().amax(1).cpu()
    absmax[3] = INF
    q = torch.empty(M, 256, dtype=torch.uint8, device=DEVICE)
    scale = torch.empty(M, dtype=torch.float32, device=DEVICE)
    act_quant._launch(x, q.view(torch.int8), scale, 512, 1.0, False, False, 2, None, given_absmax=absmax)
    _, ref_scale = _good_reference(x, quantize_activations_reference)
    _assert_scales(scale, ref_scale, "act_quant, 2 programs a token")


@needs_triton()
@pytest.mark.parametrize("layout", ["packed", "split8"])
def test_hadamard_quant_nonfinite_token_gets_nan_scale(layout):
    had = OnlineHadamard(256)
    x = _poisoned(M, 256, seed=7)
    q, scale = hadamard_quantize_triton(x, had.to(DEVICE), layout=layout)
    _, ref_scale = _good_reference(x, lambda c: hadamard_quantize_reference(c, had))
    # the transform spreads the bad channel over the whole row: a NaN scale either way
    assert torch.isnan(scale.cpu()[sorted(BAD_ROWS)]).all(), scale.tolist()
    good = _good_rows(M)
    # the fused transform sums in another order (see test_hadamard_quant): a 16-bit ulp at most
    assert torch.isfinite(scale.cpu()[good]).all()
    assert torch.allclose(scale.cpu()[good], ref_scale[good], rtol=2.0**-7, atol=0)


@needs_triton()
@pytest.mark.parametrize("layout", ["packed", "split8"])
def test_rmsnorm_quant_nonfinite_token_gets_nan_scale(layout):
    x = _poisoned(M, 384, seed=9)
    weight = (torch.rand(384, generator=torch.Generator().manual_seed(1)) + 0.5).to(torch.bfloat16).to(DEVICE)
    q, scale = rmsnorm_quant(x, weight, 1e-5, layout=layout, kernel="triton")
    ref_q, ref_scale = _good_reference(x, lambda c: rmsnorm_quant_reference(c, weight.cpu(), 1e-5, None, 1.0, layout))
    _assert_scales(scale, ref_scale, f"rmsnorm_quant {layout}")
    good = _good_rows(M)
    assert torch.equal(q.cpu()[good], ref_q[good])


@needs_triton()
def test_w4a4_gemm_of_a_nonfinite_token_is_a_nan_row():
    # the quantizer's NaN scale reaches the GEMM's output row; the other rows are the reference's
    m, n, k = M, 48, 256
    x = _poisoned(m, k, seed=17)
    gen = torch.Generator().manual_seed(4)
    _, qweight, w_scale = random_layer(n, k, gen)
    a_packed, a_scale = quantize_activations_triton(x)
    out = w4a4_gemm_triton(a_packed, a_scale, qweight.to(DEVICE), w_scale.to(DEVICE), k).float().cpu()
    assert torch.isnan(out[sorted(BAD_ROWS)]).all()
    good = _good_rows(m)
    assert torch.isfinite(out[good]).all()
    ref_packed, ref_scale = _good_reference(x, quantize_activations_reference)
    ref = w4a4_gemm_reference(ref_packed, ref_scale, qweight, w_scale, k, out_fp32=True)
    assert torch.allclose(out[good], ref[good], rtol=2.0**-7, atol=1e-3 * ref.abs().max().item())


MIXED_FORMATS = {
    "groups-sym": MixedFormat(k_lo=192, k_hi=64, group_size=64),
    "token-asym": MixedFormat(k_lo=192, k_hi=64, group_size=None, lo_symmetric=False, hi_symmetric=False),
    "groups-asym": MixedFormat(k_lo=192, k_hi=64, group_size=32, lo_symmetric=False, lo_clip=0.9),
    # a group longer than the kernel's tile (two passes) and a high part longer than its block (two passes)
    "long": MixedFormat(k_lo=4100, k_hi=4100, group_size=None, lo_symmetric=False),
}


@needs_triton()
@pytest.mark.parametrize("name", list(MIXED_FORMATS))
def test_mixed_act_quant_nonfinite_group_gets_nan_scale(name):
    fmt = MIXED_FORMATS[name]
    x = _poisoned(M, fmt.k, seed=19)
    x[2, fmt.k_lo + 3] = NAN  # a bad value in a token's high part only
    acts = mixed_act_quant_triton(x, fmt)
    clean = x.cpu().clone()
    clean[~torch.isfinite(clean)] = 0
    ref = mixed_act_quant_reference(clean, fmt)
    s_lo, s_hi = acts.s_lo.cpu(), acts.s_hi.cpu()
    g = fmt.group or fmt.k_lo
    for row, value in [*BAD_ROWS.items(), (2, NAN)]:
        col = (7 * row) % fmt.k if row != 2 else fmt.k_lo + 3
        bad_lo = torch.zeros(fmt.n_groups, dtype=torch.bool)
        if col < fmt.k_lo:
            bad_lo[col // g] = True
            assert torch.isnan(s_lo[row, bad_lo]).all(), (name, row, s_lo[row].tolist())
        else:
            assert torch.isnan(s_hi[row]), (name, row, s_hi[row].item())
        if row != 2:  # only the bad group's scale changes
            assert torch.equal(s_lo[row, ~bad_lo], ref.s_lo[row, ~bad_lo]), (name, row)
    good = [r for r in _good_rows(M) if r != 2]
    assert torch.equal(s_lo[good], ref.s_lo[good]) and torch.equal(s_hi[good], ref.s_hi[good])
    assert torch.equal(acts.q_lo.cpu()[good], ref.q_lo[good]) and torch.equal(acts.q_hi.cpu()[good], ref.q_hi[good])
    # and into the GEMM: the bad tokens' output rows are NaN, the others finite
    gen = torch.Generator().manual_seed(6)
    n = 32
    weights = mixed_weights(torch.randint(-8, 8, (n, fmt.k_lo), generator=gen),
                            torch.rand(n, fmt.n_groups, generator=gen) * 0.05 + 0.01,
                            torch.randint(-128, 128, (n, fmt.k_hi), generator=gen),
                            torch.rand(n, generator=gen) * 0.01 + 0.001, fmt)
    weights = type(weights)(*(t.to(DEVICE) for t in weights))
    out = mixed_gemm_triton(acts, weights, fmt).float().cpu()
    assert torch.isnan(out[[*sorted(BAD_ROWS), 2]]).all()
    assert torch.isfinite(out[good]).all()


@needs_triton()
@pytest.mark.parametrize("fmt", [MixedFormat(k_lo=64, k_hi=32, group_size=32, lo_symmetric=False,
                                             hi_symmetric=False),
                                 MixedFormat(k_lo=64, k_hi=32, group_size=32)], ids=["asym", "sym"])
def test_mixed_act_quant_finite_extremes_match_the_reference(fmt):
    x = torch.randn(4, fmt.k, generator=torch.Generator().manual_seed(8))
    x[0, 0], x[0, 1] = BIG, -BIG  # a low group whose span overflows
    x[1, fmt.k_lo], x[1, fmt.k_lo + 1] = BIG, -BIG  # the high part's
    x[2, 5] = -BIG
    x = x.to(DEVICE)
    acts = mixed_act_quant_triton(x, fmt)
    ref = mixed_act_quant_reference(x.cpu(), fmt)
    assert torch.isfinite(ref.s_lo).all() and torch.isfinite(ref.s_hi).all()
    for field in ("q_lo", "s_lo", "z_lo", "q_hi", "s_hi", "z_hi"):
        got, want = getattr(acts, field), getattr(ref, field)
        assert (got is None) == (want is None)
        if got is not None:
            assert torch.equal(got.cpu(), want), field


@triton.jit
def _kv4_probe(x_ptr, q_ptr, s_ptr, z_ptr, R: tl.constexpr, D: tl.constexpr, SYM: tl.constexpr):
    """The KV cache's 4-bit quantizer on ``R`` rows of ``D`` channels: bytes ``[R, D/2]``, scales and zeros ``[R]``."""
    rows = tl.arange(0, R)[:, None]
    half = tl.arange(0, D // 2)[None, :]
    x1 = tl.load(x_ptr + rows * D + half)
    x2 = tl.load(x_ptr + rows * D + D // 2 + half)
    packed, scale, zero = _kv4_quantize(x1, x2, 1.0, SYM)
    tl.store(q_ptr + rows * (D // 2) + half, packed)
    tl.store(s_ptr + tl.arange(0, R), scale)
    tl.store(z_ptr + tl.arange(0, R), zero)


def _kv4(x: torch.Tensor, symmetric: bool):
    r, d = x.shape
    q = torch.empty(r, d // 2, dtype=torch.uint8, device=DEVICE)
    s = torch.empty(r, dtype=torch.float32, device=DEVICE)
    z = torch.empty(r, dtype=torch.float32, device=DEVICE)
    _kv4_probe[(1,)](x, q, s, z, R=r, D=d, SYM=symmetric)
    return q.cpu(), s.cpu(), z.cpu()


@needs_triton()
@pytest.mark.parametrize("symmetric", [True, False])
def test_kv4_quantizer_nonfinite_row_gets_nan_scale(symmetric):
    x = _poisoned(8, 64, seed=21, dtype=torch.float32)
    x[6, 0], x[6, 40] = BIG, -BIG  # finite extremes: the asymmetric span overflows
    q, s, z = _kv4(x, symmetric)
    ref_q, ref_s, ref_z = _good_reference(x, lambda c: kv4_quantize_reference(c, symmetric, 1.0))
    assert torch.isnan(s[sorted(BAD_ROWS)]).all(), s.tolist()
    good = _good_rows(8)
    assert torch.isfinite(ref_s[good]).all()
    assert torch.equal(s[good], ref_s[good]) and torch.equal(z[good], ref_z[good])
    assert torch.equal(q[good], ref_q[good])


@triton.jit
def _scale_probe(lo_ptr, hi_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    lo = tl.load(lo_ptr + i)
    hi = tl.load(hi_ptr + i)
    tl.store(out_ptr + i, asym_scale(lo, hi, 15.0))
    tl.store(out_ptr + N + i, sym_scale(max_nan(tl.join(-lo, hi), 1), 1.0, 7.0))


@needs_triton()
def test_scale_helpers_against_the_reference():
    lo = torch.tensor([-BIG, -1.0, 0.0, -NAN, -INF, -3.0, 0.0, -BIG], device=DEVICE)
    hi = torch.tensor([BIG, 2.0, 0.0, 1.0, 1.0, INF, NAN, 0.0], device=DEVICE)
    out = torch.empty(16, device=DEVICE)
    _scale_probe[(1,)](lo, hi, out, N=8)
    out = out.cpu()
    finite = torch.isfinite(lo.cpu()) & torch.isfinite(hi.cpu())
    assert torch.isnan(out[:8][~finite]).all() and torch.isnan(out[8:][~finite]).all(), out
    x = torch.stack([lo.cpu(), hi.cpu()], 1)[finite]
    want_asym = quantize(x, 4, symmetric=False).scale.flatten()
    want_sym = quantize(x, 4, symmetric=True).scale.flatten()
    assert torch.equal(out[:8][finite], want_asym), (out[:8], want_asym)
    assert torch.equal(out[8:][finite], want_sym), (out[8:], want_sym)


@needs_triton()
def test_w4a4_gemm_of_a_nonfinite_weight_scale_is_a_nan_column():
    m, n, k = 3, 48, 256
    gen = torch.Generator().manual_seed(23)
    x = random_activations(m, k, gen).to(DEVICE)
    _, qweight, w_scale = random_layer(n, k, gen)
    w_scale[5], w_scale[17] = NAN, INF
    a_packed, a_scale = quantize_activations_triton(x)
    out = w4a4_gemm_triton(a_packed, a_scale, qweight.to(DEVICE), w_scale.to(DEVICE), k).float().cpu()
    assert torch.isnan(out[:, 5]).all() and not torch.isfinite(out[:, 17]).any(), out[:, [5, 17]]
    rest = [c for c in range(n) if c not in (5, 17)]
    assert torch.isfinite(out[:, rest]).all()
