"""ResQ: the 8-bit subspace carries the top variance, rotations are orthogonal, float function kept."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mosaicquant.baselines.resq import (
    BasisTransform,
    ResQConfig,
    pca_basis,
    resq,
    resq_basis,
    resq_quantize_linear,
)
from mosaicquant.errors import UserInputError
from mosaicquant.methods.hadamard import OnlineHadamard, apply_hadamard
from mosaicquant.methods.kvcache import kv_quant_spec_of
from mosaicquant.methods.mixed import MixedActQuant
from mosaicquant.methods.qlinear import ActQuantSpec

ORTHO_ATOL = 1e-10
EIG_RTOL = 1e-8
# float32 basis change of a float32 layer
FLOAT_FN_RTOL = 1e-4
# 8-bit per-token error relative to the 4-bit one on the same tokens: 16x finer grid
HIGH_VS_LOW_ERR_MAX = 0.25
SQNR_FLOOR_DB = 12.0
MODEL_PPL_RATIO_MAX = 1.5  # quantized vs float next-token loss ratio (exp) on the tiny model


def _anisotropic(tokens: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs with a planted spectrum: a few large-variance directions in a random basis."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(k, k, generator=gen, dtype=torch.float64))
    spectrum = torch.logspace(2, -1, k, dtype=torch.float64)
    x = torch.randn(tokens, k, generator=gen, dtype=torch.float64) * spectrum.sqrt() @ q.T
    return x, x.T @ x / tokens


def test_high_subspace_holds_top_eigenvalues():
    k, r = 56, 7
    _, h = _anisotropic(800, k, seed=0)
    u = resq_basis(h, r, seed=3)
    assert torch.allclose(u.T @ u, torch.eye(k, dtype=u.dtype), atol=ORTHO_ATOL)
    values, _ = pca_basis(h)
    h_rot = u.T @ h @ u
    # variance captured by the last r channels = sum of the r largest eigenvalues
    assert float(torch.trace(h_rot[-r:, -r:])) == pytest.approx(float(values[:r].sum()), rel=EIG_RTOL)
    assert torch.allclose(torch.linalg.eigvalsh(h_rot[-r:, -r:]).flip(0), values[:r], rtol=1e-6)
    # the two subspaces are decorrelated; the rotation inside spreads the energy
    assert float(h_rot[:-r, -r:].abs().max()) < 1e-8 * float(values[0])
    diag_high = torch.diagonal(h_rot)[-r:]
    assert float(diag_high.max() / diag_high.min()) < float(values[0] / values[r - 1])
    # different seed: different rotations, same subspaces
    u2 = resq_basis(h, r, seed=4)
    assert not torch.allclose(u, u2)
    proj = lambda m: m[:, -r:] @ m[:, -r:].T  # noqa: E731
    assert torch.allclose(proj(u), proj(u2), atol=1e-8)


def test_resq_linear_preserves_function_and_mixes_precision():
    k, n, tokens = 64, 29, 700
    x64, h = _anisotropic(tokens, k, seed=1)
    x = x64.to(torch.float32)
    gen = torch.Generator().manual_seed(2)
    linear = nn.Linear(k, n)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=gen) * 0.1)
        linear.bias.copy_(torch.randn(n, generator=gen))
    cfg = ResQConfig()
    basis = resq_basis(h, cfg.n_high(k), seed=0)
    layer = resq_quantize_linear(linear, h.to(torch.float32), cfg, basis=basis)
    assert isinstance(layer.input_transform, BasisTransform) and isinstance(layer.act, MixedActQuant)
    assert layer.n_high == 8
    assert layer.act.high_channels.tolist() == list(range(56, 64))

    # float function: x U (W U)ᵀ = x Wᵀ
    xu = layer.input_transform(x)
    w_rot = linear.weight.data @ basis.to(torch.float32)
    assert torch.allclose(xu @ w_rot.T, x @ linear.weight.data.T, rtol=FLOAT_FN_RTOL, atol=1e-4)

    # 8-bit on the high subspace, 4-bit on the rest (same tokens, per-token grids)
    from mosaicquant.methods.quant import fake_quantize

    err_high = (layer.act(xu) - xu)[:, 56:].pow(2).mean()
    err_high_4bit = (fake_quantize(xu[:, 56:], 4, symmetric=False) - xu[:, 56:]).pow(2).mean()
    assert err_high < HIGH_VS_LOW_ERR_MAX * err_high_4bit
    err_low = (layer.act(xu) - xu)[:, :56]
    assert torch.equal(layer.act(xu)[:, :56], fake_quantize(xu[:, :56], 4, symmetric=False))
    assert err_low.abs().max() > 0

    y = layer(x)
    y_ref = linear(x)
    sqnr = 10 * torch.log10(y_ref.pow(2).sum() / (y - y_ref).pow(2).sum())
    assert sqnr > SQNR_FLOOR_DB, f"ResQ layer SQNR {sqnr:.1f} dB"


def test_resq_down_proj_path_is_all_4bit_hadamard():
    k, n = 40, 13  # 40 = 20 · 2: Paley factor
    x64, h = _anisotropic(300, k, seed=5)
    linear = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=torch.Generator().manual_seed(6)) * 0.1)
    layer = resq_quantize_linear(linear, h.to(torch.float32), ResQConfig(), basis=None)
    assert isinstance(layer.input_transform, OnlineHadamard)
    assert layer.n_high == 0 and layer.wbits == pytest.approx(4.0)
    assert isinstance(layer.act, ActQuantSpec) and layer.act.bits == 4
    x = x64.to(torch.float32)
    hx = layer.input_transform(x)
    # float: (x H)(W H)ᵀ = x Wᵀ; quantized weights: the 4-bit error only
    w_rot = linear.weight.data @ apply_hadamard(torch.eye(k))
    assert torch.allclose(hx @ w_rot.T, x @ linear.weight.data.T, rtol=FLOAT_FN_RTOL, atol=1e-4)
    y_ref = x @ linear.weight.data.T
    err = hx @ layer.weight.T - y_ref
    sqnr = 10 * torch.log10(y_ref.pow(2).sum() / err.pow(2).sum())
    assert sqnr > SQNR_FLOOR_DB, f"4-bit down_proj weights SQNR {sqnr:.1f} dB"
    with pytest.raises(ValueError, match="already has an input transform"):
        resq_quantize_linear(layer, h.to(torch.float32), ResQConfig(), basis=None)


def test_resq_method_on_tiny_model(tiny_llama_model, lm_loss, tiny_lm_tokens):
    model = tiny_llama_model
    _, test, ctx = tiny_lm_tokens
    ref = lm_loss(model, test)
    resq(model, ResQConfig(), ctx)
    assert ctx.info["kv_bits"] == 4 and ctx.info["wbits"] == "4/8"
    assert kv_quant_spec_of(model).symmetric is False and kv_quant_spec_of(model).rotate_qk
    counts = ctx.info["high_precision_channels"]
    assert counts["layers.0.self_attn.q_proj"] == 12 and counts["layers.1.mlp.down_proj"] == 0
    assert 0.125 < ctx.info["variance_in_high_subspace_calib_mean"] <= 1.0
    got = lm_loss(model, test)
    assert torch.isfinite(torch.tensor(got))
    assert got < ref + torch.log(torch.tensor(MODEL_PPL_RATIO_MAX)), (ref, got)


def test_resq_config_validation():
    with pytest.raises(UserInputError, match="high_fraction=1.0"):
        ResQConfig(high_fraction=1.0)
    with pytest.raises(UserInputError, match="high_bits=9"):
        ResQConfig(high_bits=9)
