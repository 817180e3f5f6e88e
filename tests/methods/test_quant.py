"""Quantizers: bit-exact against hand-computed cases."""

import pytest
import torch

from mosaicquant.methods.quant import all_finite, fake_quantize, qrange, quantize, quantize_with_clip_search


def test_qrange():
    assert qrange(4, True) == (-8, 7)
    assert qrange(4, False) == (0, 15)
    assert qrange(8, True) == (-128, 127)
    assert qrange(2, True) == (-2, 1)


def test_symmetric_per_row_hand_computed():
    x = torch.tensor([[1.0, -2.0, 0.5, 3.5], [0.0, 0.0, 0.0, 0.0], [-7.0, 1.0, 2.0, 3.0]])
    qt = quantize(x, 4)
    # row 0: scale 3.5/7 = 0.5 -> 2, -4, 1, 7 ; row 1: all zero -> scale 1 ; row 2: scale 1
    assert qt.scale.squeeze(-1).tolist() == [0.5, 1.0, 1.0]
    assert qt.q.tolist() == [[2, -4, 1, 7], [0, 0, 0, 0], [-7, 1, 2, 3]]
    assert torch.equal(qt.dequantize(), torch.tensor([[1.0, -2.0, 0.5, 3.5], [0, 0, 0, 0], [-7.0, 1, 2, 3]]))


def test_round_half_to_even():
    # scale = 7/7 = 1: 2.5 -> 2, 3.5 -> 4, -0.5 -> 0
    qt = quantize(torch.tensor([[2.5, 3.5, -0.5, 7.0]]), 4)
    assert qt.q.tolist() == [[2, 4, 0, 7]]


def test_clip_ratio_reaches_extra_negative_level():
    qt = quantize(torch.tensor([[-7.0, 7.0, 1.0]]), 4, clip_ratio=0.5)
    # scale = 0.5 * 7 / 7 = 0.5: -14 -> clamp -8 ; 14 -> 7 ; 2
    assert qt.q.tolist() == [[-8, 7, 2]]


def test_asymmetric_hand_computed():
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    qt = quantize(x, 2, symmetric=False)
    # lo 0, hi 3, scale 1, zero 0
    assert qt.q.tolist() == [[0, 1, 2, 3]] and qt.zero.tolist() == [[0.0]]
    x = torch.tensor([[-1.0, 0.0, 2.0]])
    qt = quantize(x, 2, symmetric=False)
    # lo -1, hi 2, scale 1, zero 1 -> q = x + 1
    assert qt.q.tolist() == [[0, 1, 3]]
    assert torch.equal(qt.dequantize(), x)


def test_per_group():
    x = torch.tensor([[1.0, 2.0, 70.0, -35.0]])
    qt = quantize(x, 8, group_size=2)
    assert torch.allclose(qt.scale, torch.tensor([[2 / 127, 70 / 127]]))
    assert qt.q.tolist() == [[64, 127, 127, -64]]


def test_fake_quantize_matches_quantize_dequantize():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(13, 67, generator=g)
    for sym in (True, False):
        qt = quantize(x, 4, symmetric=sym, clip_ratio=0.9)
        assert torch.equal(fake_quantize(x, 4, symmetric=sym, clip_ratio=0.9), qt.dequantize())


def test_fp16_scales_are_the_stored_ones():
    x = torch.randn(7, 33, generator=torch.Generator().manual_seed(1))
    qt = quantize(x, 4, scale_dtype=torch.float16)
    assert torch.equal(qt.scale, qt.scale.half().float())
    # the integers were computed with the rounded scale
    q = torch.round(x / qt.scale).clamp(-8, 7)
    assert torch.equal(q.to(torch.int8), qt.q)


def test_clip_search_never_worse_than_no_clip():
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(2)) ** 3
    plain = quantize(x, 4)
    searched = quantize_with_clip_search(x, 4)
    err = lambda qt: ((qt.dequantize() - x).abs() ** 2.4).sum(-1)  # noqa: E731
    assert (err(searched) <= err(plain) + 1e-6).all()
    assert (err(searched) < err(plain)).any()


@pytest.mark.parametrize("bad", [1, 9, 16, 4.0, True])
def test_bits_out_of_range(bad):
    with pytest.raises(ValueError, match="bits"):
        quantize(torch.ones(2, 2), bad)


def test_bad_group_and_nan():
    with pytest.raises(ValueError, match="group_size=3"):
        quantize(torch.ones(2, 4), 4, group_size=3)
    with pytest.raises(ValueError, match="NaN"):
        quantize(torch.tensor([[1.0, float("nan")]]), 4)
    with pytest.raises(ValueError, match="clip_ratio"):
        quantize(torch.ones(2, 4), 4, clip_ratio=1.5)


@pytest.mark.parametrize("kwargs", [dict(), dict(symmetric=False), dict(group_size=32),
                                    dict(group_size=32, symmetric=False, scale_dtype=torch.float16)])
def test_clip_search_picks_the_brute_force_shrink(kwargs):
    # the plain definition: for every candidate p, quantize with clip_ratio=p and keep the best per group
    torch.manual_seed(3)
    x = torch.randn(300, 96) * torch.rand(300, 1)  # 300 rows: several of the search's row chunks
    grid, max_shrink, norm = 20, 0.5, 2.4
    got = quantize_with_clip_search(x, 4, grid=grid, max_shrink=max_shrink, norm=norm, **kwargs)
    best_err, best = None, None
    for i in range(int(max_shrink * grid)):
        qt = quantize(x, 4, clip_ratio=1.0 - i / grid, **kwargs)
        deq = (qt.q.float().reshape(300, -1, kwargs.get("group_size") or 96)
               - (0 if qt.zero is None else qt.zero.unsqueeze(-1))) * qt.scale.unsqueeze(-1)
        err = (deq.reshape(300, 96) - x).abs().pow(norm).reshape(300, -1, kwargs.get("group_size") or 96).sum(-1)
        if best_err is None:
            best_err, best = err, qt
            continue
        better = err < best_err * (1 - 1e-5)  # exp2/log2 vs pow: ties within float noise may go either way
        best_err = torch.where(better, err, best_err)
        best = type(qt)(q=torch.where(better.repeat_interleave(kwargs.get("group_size") or 96, -1), qt.q, best.q),
                        scale=torch.where(better, qt.scale, best.scale),
                        zero=None if qt.zero is None else torch.where(better, qt.zero, best.zero),
                        bits=4, group_size=qt.group_size)
    agree = (got.scale == best.scale).float().mean().item()
    assert agree > 0.99, agree
    assert (got.q == best.q).float().mean().item() > 0.99


def test_replace_linears_lets_each_original_go_once_replaced():
    # a new module may hold a 16-bit weight of its own; the originals must not all stay alive until the end
    import weakref

    from mosaicquant.methods.qlinear import replace_linears

    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    seen = []

    def make(name, linear):
        assert all(ref() is None for ref in seen), f"an original before {name} is still alive"
        seen.append(weakref.ref(linear))
        return torch.nn.Linear(8, 8)

    assert replace_linears(model, make) == ["0", "1", "2"]
    assert all(ref() is None for ref in seen)


def x_seed(dtype, bad) -> int:
    return [torch.float32, torch.float64, torch.float16, torch.bfloat16].index(dtype) * 7 + (0 if bad is None else 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), None])
@pytest.mark.parametrize("shape", [(1,), (13, 67), (3, 5, 7)])
def test_all_finite_matches_isfinite(dtype, bad, shape):
    gen = torch.Generator().manual_seed(len(shape) * 97 + x_seed(dtype, bad))
    x = torch.randn(shape, generator=gen).to(dtype)
    if bad is not None:
        x.view(-1)[int(torch.randint(x.numel(), (1,), generator=gen))] = bad
    assert all_finite(x) == bool(torch.isfinite(x).all()) == (bad is None)


def test_all_finite_overflowing_sums_and_opposite_infinities():
    big = {torch.float32: 3e38, torch.float64: 1.7e308, torch.float16: 60000.0, torch.bfloat16: 3e38}
    for dtype, value in big.items():
        x = torch.full((64,), value, dtype=dtype)
        assert torch.isfinite(x).all() and all_finite(x), f"{dtype}: finite values whose sum overflows"
        assert all_finite(torch.cat([x, -x])), dtype
    assert not all_finite(torch.tensor([float("inf"), -float("inf"), 1.0]))


def test_all_finite_other_tensors():
    assert all_finite(torch.empty(0)) and all_finite(torch.arange(5)) and all_finite(torch.ones(3, dtype=torch.bool))
    assert not all_finite(torch.tensor([1 + 1j, complex(float("nan"), 0)]))
    if hasattr(torch, "float8_e4m3fn"):
        assert all_finite(torch.ones(4).to(torch.float8_e4m3fn))
