"""MosaicQuant: the simulated layer equals SPEC §1.7's formula; budgets, blocks and configs."""

import pytest
import torch
from torch import nn

from mosaicquant.errors import UserInputError
from mosaicquant.methods.format import residual_shifts, unpack_int4
from mosaicquant.methods.mosaicquant import MosaicQuantConfig, quantize_linear_mosaic
from mosaicquant.methods.quant import quantize

FORMULA_RTOL = 1e-5


def _layer_and_hessian(n=45, k=70, t=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.1)
        lin.bias.copy_(torch.randn(n, generator=g))
    x = torch.randn(t, k, generator=g) @ torch.randn(k, k, generator=g) * 0.3
    return lin, x, x.T @ x / t


@pytest.mark.parametrize("base, score, rscale", [("rtn", "delta", "free"), ("gptq", "hessian", "free"),
                                                 ("rtn", "hessian", "free"), ("gptq", "hessian", "pow2"),
                                                 ("rtn", "delta", "pow2")])
def test_simulated_layer_equals_spec_formula(base, score, rscale):
    lin, x, h = _layer_and_hessian()
    cfg = MosaicQuantConfig(budget=0.3, block="16x32", base=base, score=score, a_clip=0.9, rscale=rscale)
    layer, stats = quantize_linear_mosaic(lin, h, cfg, seed=0)
    packed = layer.packed
    assert packed.residual.num_blocks > 0
    xs = torch.randn(13, 70, generator=torch.Generator().manual_seed(5))
    # SPEC §1.7: y = s_a ⊙ (Xq · Qwᵀ) ⊙ s_w + Σ_b s_a ⊙ (Xq[:, k∈b] · R_bᵀ) ⊙ s_{r,b}
    qa = quantize(xs, 4, clip_ratio=0.9)
    xq, s_a = qa.q.double(), qa.scale.double()
    qw = unpack_int4(packed.qweight, 70).double()
    y = s_a * (xq @ qw.T) * packed.scales.double().T
    res = packed.residual
    bn, bk = res.block_shape
    r_int = unpack_int4(res.values, bk).double()
    for b, (i, j) in enumerate(res.coords.tolist()):
        rows = slice(i * bn, min((i + 1) * bn, 45))
        cols = slice(j * bk, min((j + 1) * bk, 70))
        nr, nc = rows.stop - rows.start, cols.stop - cols.start
        part = s_a * (xq[:, cols] @ r_int[b, :nr, :nc].T) * res.scales[b, :nr].double()
        y[:, rows] += part
    y += lin.bias.double()
    out = layer(xs).double()
    err = (out - y).norm() / y.norm()
    assert err < FORMULA_RTOL, f"simulated layer deviates from the formula: rel err {err:.2e}"
    assert 0 < stats["recovered"] <= 1
    shifts = residual_shifts(res, packed.scales)
    assert (shifts is not None) == (rscale == "pow2")


def test_pow2_residual_scales_recover_about_what_free_scales_do():
    # the residual's 4-bit step is a small part of its error: a power-of-two step (up to 2x the free one)
    # changes the distortion the kept blocks recover by little
    lin, _, h = _layer_and_hessian(n=64, k=128, t=600)
    got = {}
    for rscale in ("free", "pow2"):
        cfg = MosaicQuantConfig(budget=0.25, block="16x32", base="gptq", rscale=rscale)
        layer, stats = quantize_linear_mosaic(lin, h, cfg, seed=0)
        got[rscale] = stats["recovered"]
    assert got["pow2"] > 0.9 * got["free"], got


@pytest.mark.parametrize("score", ["hessian", "delta"])
def test_rscale_max_shift_bounds_the_shifts_and_lets_the_merged_operand_hold_the_block(score):
    from mosaicquant.kernels.w4a4_gemm import MERGED_MAX_SHIFT, merged_residual_operand

    lin, _, h = _layer_and_hessian(n=64, k=128, t=600)
    shifts = {}
    for cap in (4, MERGED_MAX_SHIFT):
        cfg = MosaicQuantConfig(budget=1.0, block="16x128", base="rtn", score=score, rscale_max_shift=cap)
        layer, stats = quantize_linear_mosaic(lin, h, cfg, seed=0)
        res = layer.packed.residual
        shifts[cap] = residual_shifts(res, layer.packed.scales)
        assert shifts[cap] is not None and int(shifts[cap].max()) <= cap and stats["recovered"] > 0
    assert int(shifts[4].max()) == 4  # the cap binds on this layer
    # base + residual of each kept block as one int8 integer times s_w / 8: the format's weight, exactly
    packed = layer.packed
    merged = merged_residual_operand(packed.qweight, 128, res, shifts[MERGED_MAX_SHIFT])
    merged = merged.view(-1, 16, 1, 2, 64).transpose(-1, -2).reshape(-1, 16, 128).double()  # split8 order undone
    w = packed.dequantize(torch.float64)
    for b, (i, c) in enumerate(res.coords.tolist()):
        want = w[i * 16:(i + 1) * 16, c * 128:(c + 1) * 128]
        got = merged[b] * packed.scales.double()[i * 16:(i + 1) * 16].reshape(-1, 1) / 8
        assert torch.allclose(got, want, rtol=0, atol=1e-12), f"block {b}"


def test_budget_zero_and_block_counts():
    lin, _, h = _layer_and_hessian()
    layer0, stats0 = quantize_linear_mosaic(lin, h, MosaicQuantConfig(budget=0, block="16x32", base="rtn"), 0)
    assert layer0.packed.residual.num_blocks == 0 and stats0 == {}
    # 3 x 3 grid of ragged blocks; the Δ-score keeps exactly round(0.25 * 9) = 2
    layer, _ = quantize_linear_mosaic(lin, h, MosaicQuantConfig(budget=0.25, block="16x32", base="rtn",
                                                                  score="delta"), 0)
    assert layer.packed.residual.num_blocks == 2
    by = layer.packed.nbytes()
    assert by["residual_values"] == 2 * 16 * 16 and by["residual_scales"] == 2 * 16 * 2


def test_residual_reduces_calibration_distortion():
    lin, x, h = _layer_and_hessian(t=600)
    outs = {}
    for budget in (0.0, 0.3):
        layer, _ = quantize_linear_mosaic(lin, h, MosaicQuantConfig(budget=budget, block="16x32", base="rtn",
                                                                     abits=16), 0)
        outs[budget] = ((layer(x) - lin(x)) ** 2).sum().item()
    assert outs[0.3] < 0.8 * outs[0.0], outs


@pytest.mark.parametrize(
    "options, match",
    [
        ({"budget": -0.1}, "budget=-0.1 is out of range"),
        ({"wbits": 8}, "wbits=8 is not allowed"),
        ({"wbits": 16, "budget": 0.1}, "needs 4-bit weights"),
        ({"score": "deltta"}, "score='deltta' is not allowed"),
        ({"transform": "hadamard"}, "transform='hadamard' is not allowed"),
        ({"block": "0"}, "block"),
        ({"kvbits": 1}, "kvbits=1 is out of range"),
        ({"kv_clip": 0.0}, "kv_clip=0.0 is out of range"),
        ({"kv_rotate_v": True}, "kv_rotate_v=true needs a quantized KV cache"),
        ({"rscale": "exp2"}, "rscale='exp2' is not allowed"),
        ({"rscale_max_shift": 5}, "rscale_max_shift=5 is out of range"),
        ({"rscale_max_shift": -1}, "rscale_max_shift=-1 is out of range"),
        ({"w_group_size": 32}, r"rscale=pow2 \(the default\) needs per-channel base scales: with w_group_size=32 set rscale=free"),
    ],
)
def test_config_errors(options, match):
    with pytest.raises(UserInputError, match=match):
        MosaicQuantConfig.from_dict(options)


def test_kv_option_is_quarots_recipe():
    # default: the method's linear layers only (float KV); kvbits=4: QuaRot's KV4 (Q/K Hadamard, asymmetric, 0.95)
    assert not MosaicQuantConfig().kv_spec().active
    spec = MosaicQuantConfig(kvbits=4).kv_spec()
    assert (spec.bits, spec.group_size, spec.symmetric, spec.clip_ratio, spec.rotate_qk) == (4, None, False, 0.95, True)
    assert not spec.rotate_v and MosaicQuantConfig(kvbits=4, kv_rotate_v=True).kv_spec().rotate_v


def test_nan_weights_rejected():
    lin, _, h = _layer_and_hessian()
    with torch.no_grad():
        lin.weight[3, 4] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        quantize_linear_mosaic(lin, h, MosaicQuantConfig(base="rtn"), 0)
