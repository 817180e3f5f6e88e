"""MosaicQuant's residual: scores against brute force, greedy selectors, Hessian fit, format round trip."""

from __future__ import annotations

import math

import pytest
import torch

from mosaicquant.errors import UserInputError
from mosaicquant.methods.format import ResidualBlocks, residual_shifts
from mosaicquant.methods.gptq import gptq_quantize
from mosaicquant.methods.quant import quantize, quantize_with_clip_search
from mosaicquant.methods.residual import (
    POW2_MAX_SHIFT,
    SELECTION_METHODS,
    block_grid,
    channel_residual,
    delta_scores,
    dequantize_residual_blocks,
    distortion_recovered,
    exact_greedy_select,
    frobenius_scores,
    hessian_fit_select,
    num_kept_blocks,
    output_distortion,
    quantize_pow2_rows,
    quantize_residual_blocks,
    random_scores,
    select_residual,
    select_top_blocks,
    selected_dense,
    tile_blocks,
    untile_blocks,
)

# float64 scores against a float64 brute-force loop.
SCORE_RTOL = 1e-10
# The same distortion computed two ways in float64 (different summation order).
DISTORTION_RTOL = 1e-9
# The Hessian fit must recover at least this many times the plain residual's fraction
# (measured ≈ 1.5× on the small correlated layer below, ≈ 1.6× on 768×1024).
HESSIAN_OVER_PLAIN_MIN_RATIO = 1.2
# On a GPTQ base the Hessian fit must still recover this much (plain residuals go negative).
HESSIAN_ON_GPTQ_MIN_RECOVERED = 0.05
# Output distortion through H = mean xᵀx vs through the tokens, float32 matmuls.
OUTPUT_DISTORTION_RTOL = 1e-4


def _correlated(n: int, k: int, tokens: int, seed: int):
    """Weight, calibration Hessian and held-out Hessian with inputs X = Z·A (mean convention)."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=gen) / k**0.5
    x_cal = torch.randn(tokens, k, generator=gen) @ mix
    x_held = torch.randn(tokens, k, generator=gen) @ mix
    weight = torch.randn(n, k, generator=gen) * 0.05
    return weight, x_cal.T @ x_cal / tokens, x_held.T @ x_held / tokens


def _rtn_residual(weight: torch.Tensor):
    base = quantize_with_clip_search(weight, 4, scale_dtype=torch.float16).dequantize()
    return base, weight - base


def _block_slices(shape, block_shape, i, j):
    bn, bk = block_shape
    return slice(i * bn, min((i + 1) * bn, shape[0])), slice(j * bk, min((j + 1) * bk, shape[1]))


def _recovered(method, weight, base, h_cal, h_held, block_shape, budget):
    e = weight - base
    coords, q, s = select_residual(method, e, block_shape, budget, hessian=h_cal)
    return distortion_recovered(weight, base, selected_dense(e.shape, block_shape, coords, q, s), h_held)


def test_tile_untile_round_trip_ragged():
    x = torch.randn(45, 70)
    blocks = tile_blocks(x, (16, 32))
    assert blocks.shape == (3, 3, 16, 32)
    assert torch.equal(untile_blocks(blocks, (45, 70)), x)
    assert (blocks[2, :, 13:, :] == 0).all() and (blocks[:, 2, :, 6:] == 0).all()
    assert block_grid((45, 70), "16x32") == (3, 3)


def test_quantize_residual_blocks_matches_per_block_quantizer():
    e = torch.randn(45, 70) * 0.01
    q, s = quantize_residual_blocks(e, (16, 32))
    assert q.shape == (3, 3, 16, 32) and s.shape == (3, 3, 16)
    assert torch.equal(s, s.to(torch.float16).to(torch.float32))
    for i in range(3):
        for j in range(3):
            rows, cols = _block_slices(e.shape, (16, 32), i, j)
            ref = quantize(e[rows, cols], 4, scale_dtype=torch.float16)
            nr, nc = ref.q.shape
            assert torch.equal(q[i, j, :nr, :nc], ref.q)
            assert torch.equal(s[i, j, :nr], ref.scale[:, 0])
            assert (q[i, j, nr:] == 0).all() and (q[i, j, :, nc:] == 0).all()
    deq = dequantize_residual_blocks(q, s, e.shape)
    assert deq.shape == e.shape
    assert (deq - e).abs().max() <= s.max() / 2 + 1e-12


def test_delta_scores_match_brute_force_loop():
    gen = torch.Generator().manual_seed(0)
    e = torch.randn(45, 70, generator=gen) * 0.02
    h = torch.rand(70, generator=gen) * 3 + 0.1
    scores = delta_scores(e, h, (16, 32))
    assert scores.shape == (3, 3)
    for i in range(3):
        for j in range(3):
            rows, cols = _block_slices(e.shape, (16, 32), i, j)
            eb = e[rows, cols].double()
            rb = quantize(e[rows, cols], 4, scale_dtype=torch.float16).dequantize().double()
            hb = h[cols].double()
            expected = sum(
                float(hb[kk]) * (float(eb[nn, kk]) ** 2 - float(eb[nn, kk] - rb[nn, kk]) ** 2)
                for nn in range(eb.shape[0]) for kk in range(eb.shape[1])
            )
            assert float(scores[i, j]) == pytest.approx(expected, rel=SCORE_RTOL)
    assert (scores > 0).all()


def test_frobenius_and_random_scores():
    e = torch.randn(45, 70)
    f = frobenius_scores(e, (16, 32))
    rows, cols = _block_slices(e.shape, (16, 32), 2, 2)
    assert float(f[2, 2]) == pytest.approx(float((e[rows, cols].double() ** 2).sum()), rel=SCORE_RTOL)
    assert torch.equal(random_scores((3, 5), seed=4), random_scores((3, 5), seed=4))
    assert not torch.equal(random_scores((3, 5), seed=4), random_scores((3, 5), seed=5))


@pytest.mark.parametrize("budget,expected", [(0.0, 0), (0.1, 2), (0.125, 3), (0.5, 10), (1.0, 20)])
def test_select_top_blocks_count_and_order(budget, expected):
    scores = torch.randn(4, 5, dtype=torch.float64)
    coords = select_top_blocks(scores, budget)
    assert coords.shape == (expected, 2) and num_kept_blocks(budget, 20) == expected
    picked = scores[coords[:, 0], coords[:, 1]]
    assert torch.equal(picked, torch.sort(scores.flatten(), descending=True).values[:expected])


@pytest.mark.parametrize("budget", [-0.1, 1.5, float("nan"), True, "0.1"])
def test_bad_budget_raises(budget):
    with pytest.raises(ValueError, match="budget="):
        select_top_blocks(torch.randn(3, 3), budget)


@pytest.mark.parametrize("method", SELECTION_METHODS)
def test_budget_zero_keeps_nothing(method):
    weight, h_cal, _ = _correlated(20, 40, 200, seed=1)
    _, e = _rtn_residual(weight)
    coords, q, s = select_residual(method, e, (8, 8), 0.0, hessian=h_cal)
    assert coords.shape == (0, 2) and q.shape == (0, 8, 8) and s.shape == (0, 8)
    assert ResidualBlocks.from_blocks(tuple(e.shape), (8, 8), coords, q, s).num_blocks == 0


def _brute_distortion(err: torch.Tensor, h: torch.Tensor) -> float:
    return float(torch.einsum("nk,kl,nl->", err.double(), h.double(), err.double()))


def test_exact_greedy_matches_brute_force():
    weight, h_cal, _ = _correlated(13, 22, 300, seed=2)
    _, e = _rtn_residual(weight)
    shape, block = tuple(e.shape), (4, 6)
    q, s = quantize_residual_blocks(e, block)
    r = dequantize_residual_blocks(q, s, e.shape)
    nbr, nbc = block_grid(shape, block)
    budget = 0.5
    current, picks = e.double().clone(), []
    for _ in range(num_kept_blocks(budget, nbr * nbc)):
        best = None
        for i in range(nbr):
            for j in range(nbc):
                if (i, j) in picks:
                    continue
                rows, cols = _block_slices(shape, block, i, j)
                trial = current.clone()
                trial[rows, cols] -= r[rows, cols].double()
                gain = _brute_distortion(current, h_cal) - _brute_distortion(trial, h_cal)
                if best is None or gain > best[0]:
                    best = (gain, (i, j), trial)
        if best[0] <= 0:
            break
        picks.append(best[1])
        current = best[2]
    coords = exact_greedy_select(e, r, h_cal, block, budget)
    assert [tuple(c) for c in coords.tolist()] == picks
    assert len(picks) > 0


def test_hessian_fit_matches_brute_force_greedy():
    weight, h_cal, _ = _correlated(13, 22, 300, seed=3)
    _, e = _rtn_residual(weight)
    shape, block, damp_ratio, budget = tuple(e.shape), (4, 6), 0.01, 0.4
    nbr, nbc = block_grid(shape, block)
    h = h_cal.double()
    current, picks = e.double().clone(), []
    for _ in range(num_kept_blocks(budget, nbr * nbc)):
        best = None
        for i in range(nbr):
            for j in range(nbc):
                if (i, j) in picks:
                    continue
                rows, cols = _block_slices(shape, block, i, j)
                hjj = h[cols, cols]
                ridge = damp_ratio * torch.diagonal(hjj).mean() * torch.eye(hjj.shape[0], dtype=torch.float64)
                rhs = current[rows] @ h[:, cols]
                corr = torch.linalg.solve(hjj + ridge, rhs.T).T
                cq = quantize(corr.float(), 4, scale_dtype=torch.float16).dequantize().double()
                trial = current.clone()
                trial[rows, cols] -= cq
                gain = _brute_distortion(current, h_cal) - _brute_distortion(trial, h_cal)
                if best is None or gain > best[0]:
                    best = (gain, (i, j), trial)
        if best[0] <= 0:
            break
        picks.append(best[1])
        current = best[2]
    coords, q, s = hessian_fit_select(e, h_cal, block, budget, damp=damp_ratio)
    assert [tuple(c) for c in coords.tolist()] == picks
    corrected = e.double() - selected_dense(shape, block, coords, q, s).double()
    assert _brute_distortion(corrected, h_cal) == pytest.approx(
        _brute_distortion(current, h_cal), rel=DISTORTION_RTOL
    )


def test_hessian_fit_beats_plain_residual_rtn_base():
    weight, h_cal, h_held = _correlated(45, 70, 600, seed=4)
    base, _ = _rtn_residual(weight)
    block, budget = (16, 32), 0.34
    hess = _recovered("hessian", weight, base, h_cal, h_held, block, budget)
    for plain in ("delta", "exact-greedy", "frobenius"):
        other = _recovered(plain, weight, base, h_cal, h_held, block, budget)
        assert hess > HESSIAN_OVER_PLAIN_MIN_RATIO * other, f"hessian {hess:.3f} vs {plain} {other:.3f}"


def test_hessian_fit_helps_a_gptq_base():
    weight, h_cal, h_held = _correlated(45, 70, 600, seed=5)
    base = gptq_quantize(weight, h_cal, 4, scale_dtype=torch.float16).dequantize()
    block, budget = (16, 32), 0.34
    hess = _recovered("hessian", weight, base, h_cal, h_held, block, budget)
    delta = _recovered("delta", weight, base, h_cal, h_held, block, budget)
    assert hess > HESSIAN_ON_GPTQ_MIN_RECOVERED, f"hessian recovered {hess:.3f}"
    assert hess > delta, f"hessian {hess:.3f} vs delta {delta:.3f}"


@pytest.mark.parametrize("method", ["hessian", "exact-greedy"])
def test_greedy_fraction_in_unit_interval_and_monotone(method):
    weight, h_cal, _ = _correlated(45, 70, 400, seed=6)
    base, e = _rtn_residual(weight)
    fractions, previous = [], None
    for budget in (0.0, 0.12, 0.25, 0.5, 0.75, 1.0):
        coords, q, s = select_residual(method, e, (16, 32), budget, hessian=h_cal)
        if previous is not None:
            assert torch.equal(coords[: previous.shape[0]], previous), "greedy picks are not a prefix"
        previous = coords
        fractions.append(distortion_recovered(weight, base, selected_dense(e.shape, (16, 32), coords, q, s), h_cal))
    assert all(0.0 <= f <= 1.0 for f in fractions), fractions
    assert all(b >= a for a, b in zip(fractions, fractions[1:])), fractions
    assert fractions[-1] > fractions[1] > 0.0


@pytest.mark.parametrize("method", SELECTION_METHODS)
def test_select_residual_round_trips_through_the_format(method):
    weight, h_cal, _ = _correlated(45, 70, 300, seed=7)
    _, e = _rtn_residual(weight)
    coords, q, s = select_residual(method, e, "16x32", 0.3, hessian=h_cal, seed=3)
    assert coords.shape == (3, 2) and q.shape == (3, 16, 32) and s.shape == (3, 16)
    assert int(q.min()) >= -8 and int(q.max()) <= 7
    packed = ResidualBlocks.from_blocks(tuple(e.shape), (16, 32), coords, q, s)
    assert packed.num_blocks == 3
    assert torch.equal(packed.to_dense(), selected_dense(e.shape, (16, 32), coords, q, s))
    if method != "hessian":
        # The plain residual keeps Q4(E) exactly on the kept blocks.
        dense = packed.to_dense()
        full = dequantize_residual_blocks(*quantize_residual_blocks(e, (16, 32)), e.shape)
        for i, j in coords.tolist():
            rows, cols = _block_slices(e.shape, (16, 32), i, j)
            assert torch.equal(dense[rows, cols], full[rows, cols])


def test_select_residual_errors():
    e = torch.randn(20, 40)
    with pytest.raises(UserInputError, match="Did you mean: hessian"):
        select_residual("hesian", e, 8, 0.1)
    with pytest.raises(ValueError, match="needs the input Hessian"):
        select_residual("exact-greedy", e, 8, 0.1)
    with pytest.raises(ValueError, match="h_diag= or hessian="):
        select_residual("delta", e, 8, 0.1)
    with pytest.raises(ValueError, match="bits=3"):
        quantize_residual_blocks(e, 8, bits=3)
    with pytest.raises(ValueError, match="not positive definite"):
        hessian_fit_select(e, -torch.eye(40), 8, 0.5, damp=0.0)
    with pytest.raises(ValueError, match="damp=-0.5"):
        hessian_fit_select(e, torch.eye(40), 8, 0.5, damp=-0.5)


@pytest.mark.parametrize("axis", ["input", "output"])
def test_channel_residual_keeps_whole_channels(axis):
    weight, h_cal, h_held = _correlated(45, 70, 300, seed=8)
    base, e = _rtn_residual(weight)
    budget = 0.2
    indices, corr = channel_residual(e, torch.diagonal(h_cal), budget, axis=axis, group_size=32)
    count = e.shape[1] if axis == "input" else e.shape[0]
    assert indices.numel() == math.floor(budget * count + 0.5)
    mask = torch.zeros(count, dtype=torch.bool)
    mask[indices] = True
    nonzero_lines = (corr != 0).any(dim=0 if axis == "input" else 1)
    assert not nonzero_lines[~mask].any() and nonzero_lines[mask].all()
    frac = distortion_recovered(weight, base, corr, h_held)
    assert 0.0 < frac < 1.0
    with pytest.raises(ValueError, match="axis='diagonal'"):
        channel_residual(e, torch.diagonal(h_cal), budget, axis="diagonal")


def test_output_distortion_is_output_error_per_token():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(123, 37, generator=gen)
    delta = torch.randn(29, 37, generator=gen)
    expected = float(((x @ delta.T) ** 2).sum()) / 123
    assert output_distortion(delta, x.T @ x / 123) == pytest.approx(expected, rel=OUTPUT_DISTORTION_RTOL)


def test_distortion_recovered_bounds_and_errors():
    weight, h_cal, _ = _correlated(20, 30, 200, seed=10)
    base, e = _rtn_residual(weight)
    assert distortion_recovered(weight, base, e, h_cal) == pytest.approx(1.0)
    assert distortion_recovered(weight, base, torch.zeros_like(e), h_cal) == 0.0
    assert distortion_recovered(weight, base, -e, h_cal) < 0.0
    with pytest.raises(ValueError, match="zero output distortion"):
        distortion_recovered(weight, weight, e, h_cal)
    with pytest.raises(ValueError, match="correction_dense"):
        distortion_recovered(weight, base, e[:, :5], h_cal)


def test_pow2_rows_take_the_base_scale_times_a_power_of_two_of_least_error():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 8, 32, generator=gen) * torch.rand(6, 8, 1, generator=gen)
    base = (torch.rand(8, generator=gen) * 0.5 + 0.05).to(torch.float16).float()
    q, s = quantize_pow2_rows(x, base)
    j = torch.log2(base / s)
    assert torch.equal(j, j.round()) and j.min() >= 0 and j.max() <= POW2_MAX_SHIFT
    assert torch.equal(s.half().float(), s) and q.min() >= -8 and q.max() <= 7
    err = ((x - q * s.unsqueeze(-1)) ** 2).sum(-1)
    for jj in range(POW2_MAX_SHIFT + 1):  # no other shift does better on any row
        sj = base * 2.0 ** -jj
        qj = torch.round(x / sj.unsqueeze(-1)).clamp(-8, 7)
        assert (err <= ((x - qj * sj.unsqueeze(-1)) ** 2).sum(-1) + 1e-12).all()
    # a base scale too small for FP16 to hold s_w / 16 keeps the shifts it can hold
    q2, s2 = quantize_pow2_rows(torch.full((1, 4), 1e-7), torch.tensor([2.0 ** -22]))
    assert torch.equal(s2.half().float(), s2) and s2.item() >= 2.0 ** -24
    # a zero base scale: zero integers, zero scale
    q3, s3 = quantize_pow2_rows(torch.ones(1, 4), torch.zeros(1))
    assert not q3.any() and s3.item() == 0.0


def _pow2_rows_per_shift(x, base_rows, hessian_blocks=None, max_shift=POW2_MAX_SHIFT):
    """The plain form of :func:`quantize_pow2_rows`: divide by each candidate scale and keep the best of each row."""
    xf = x.to(torch.float64)
    base = torch.broadcast_to(base_rows.to(torch.float64), xf.shape[:-1])
    best_err = torch.full(base.shape, math.inf, dtype=torch.float64)
    best_q = torch.zeros(xf.shape, dtype=torch.int8)
    best_s = torch.zeros(base.shape, dtype=torch.float64)
    for j in range(max_shift + 1):
        s = base * 2.0 ** -j
        exact = s.to(torch.float16).to(torch.float64) == s
        live = s > 0
        q = torch.where(live.unsqueeze(-1), torch.round(xf / torch.where(live, s, 1.0).unsqueeze(-1)), 0.0).clamp(-8, 7)
        d = xf - q * s.unsqueeze(-1)
        err = (d * d).sum(-1) if hessian_blocks is None else \
            (torch.matmul(d, hessian_blocks.to(torch.float64)) * d).sum(-1)
        take = exact & (err < best_err)
        best_err = torch.where(take, err, best_err)
        best_q = torch.where(take.unsqueeze(-1), q.to(torch.int8), best_q)
        best_s = torch.where(take, s, best_s)
    return best_q, best_s.to(torch.float32)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("max_shift", [0, 3, POW2_MAX_SHIFT])
def test_pow2_rows_equal_the_per_shift_search_bit_for_bit(seed, weighted, max_shift):
    gen = torch.Generator().manual_seed(seed)
    nbr, nbc, bn, bk = 3, 5, 7, 13  # ragged sizes
    x = torch.randn(nbr, nbc, bn, bk, generator=gen) * torch.rand(nbr, nbc, bn, 1, generator=gen) ** 3
    base = (torch.rand(nbr, 1, bn, generator=gen) * 0.3).to(torch.float16).float()
    base[0, 0, 2] = 0.0  # a dead row
    base[1, 0, 3] = 2.0 ** -23  # an FP16 subnormal whose smaller shifts FP16 cannot hold
    x[2, 1, 4] = 0.0  # an all-zero row
    x[2, 2, 5, ::2] = base[2, 0, 5] * 2.5  # values on rounding boundaries
    h = None
    if weighted:
        a = torch.randn(nbc, bk, 3 * bk, generator=gen)
        h = (a @ a.transpose(-1, -2) / (3 * bk)).unsqueeze(0)
    q, s = quantize_pow2_rows(x, base, h, max_shift=max_shift)
    q_ref, s_ref = _pow2_rows_per_shift(x, base, h, max_shift=max_shift)
    assert q.dtype == q_ref.dtype and s.dtype == s_ref.dtype
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)


@pytest.mark.parametrize("pow2", [False, True])
def test_delta_selection_is_the_top_delta_scores_of_the_quantized_blocks(pow2):
    gen = torch.Generator().manual_seed(8)
    e = torch.randn(40, 52, generator=gen) * 0.02
    h_diag = torch.rand(52, generator=gen)
    base = (torch.rand(40, generator=gen) * 0.05).to(torch.float16).float() if pow2 else None
    coords, q, s = select_residual("delta", e, (8, 16), 0.3, h_diag=h_diag, base_scale=base)
    expected = select_top_blocks(delta_scores(e, h_diag, (8, 16), base_scale=base), 0.3)
    q_all, s_all = quantize_residual_blocks(e, (8, 16), base_scale=base)
    assert torch.equal(coords, expected)
    assert torch.equal(q, q_all[coords[:, 0], coords[:, 1]]) and torch.equal(s, s_all[coords[:, 0], coords[:, 1]])
    with pytest.raises(ValueError, match="h_diag must hold finite values"):
        select_residual("delta", e, (8, 16), 0.3, h_diag=-h_diag)


def test_pow2_rows_keep_to_max_shift():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, 32, generator=gen) * 0.01  # small against the base scale: j = 4 is the best for most rows
    base = torch.full((64,), 0.25)
    _, s4 = quantize_pow2_rows(x, base)
    _, s3 = quantize_pow2_rows(x, base, max_shift=3)
    assert (s4 == 0.25 / 16).any() and (s3 >= 0.25 / 8).all()
    with pytest.raises(ValueError, match=r"max_shift=5 is out of range: allowed integers 0\.\.4"):
        quantize_pow2_rows(x, base, max_shift=5)
    with pytest.raises(ValueError, match="max_shift=True is out of range"):
        quantize_pow2_rows(x, base, max_shift=True)


@pytest.mark.parametrize("method", ["hessian", "delta", "random"])
def test_pow2_selection_gives_shifts_the_kernels_take(method):
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(40, 96, generator=gen)
    qt = quantize(w, 4, scale_dtype=torch.float16)
    base = qt.dequantize()
    x = torch.randn(300, 96, generator=gen)
    h = x.T @ x / 300
    coords, q, s = select_residual(method, w - base, (16, 32), 0.4, hessian=h, base_scale=qt.scale[:, 0])
    res = ResidualBlocks.from_blocks((40, 96), (16, 32), coords, q, s)
    shifts = residual_shifts(res, qt.scale)
    assert shifts is not None and shifts.dtype == torch.int8
    rows = (res.coords[:, 0].long().unsqueeze(1) * 16 + torch.arange(16)).clamp(max=39)
    inside = res.coords[:, 0].long().unsqueeze(1) * 16 + torch.arange(16) < 40
    want = qt.scale[:, 0][rows] * 2.0 ** -shifts.float()
    assert torch.equal(res.scales.float()[inside], want[inside])
    free = ResidualBlocks.from_blocks((40, 96), (16, 32), *select_residual(method, w - base, (16, 32), 0.4, hessian=h))
    assert residual_shifts(free, qt.scale) is None
    with pytest.raises(ValueError, match="base_scale must hold one scale per output channel"):
        select_residual(method, w - base, (16, 32), 0.4, hessian=h, base_scale=torch.ones(7))
