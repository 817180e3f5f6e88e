"""MosaicQuant with ``transform="pca"``: the basis keeps the float function, the high-variance
subspace gets its own 4-bit activation grid, the speed form refuses it, the bits are counted."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mosaicquant.errors import Unavailable, UserInputError
from mosaicquant.methods.basis import BasisTransform, resq_basis
from mosaicquant.methods.bits import model_bits
from mosaicquant.methods.hadamard import OnlineHadamard
from mosaicquant.methods.mixed import MixedActQuant, MultiPassActQuant
from mosaicquant.methods.qlinear import ActQuantSpec
from mosaicquant.methods.mosaicquant import MosaicQuantConfig, _speed_form, mosaicquant, pca_input_transform

FLOAT_FN_RTOL = 1e-4  # float32 basis change of a float32 layer
MODEL_PPL_RATIO_MAX = 1.5  # quantized vs float next-token loss ratio (exp) on the tiny model
TWO_PASS_ERR_MAX = 0.02  # a second 4-bit pass: about 15x finer step, error power down ~200x


def test_pca_input_transform_keeps_the_float_function_and_splits_the_grid():
    g = torch.Generator().manual_seed(0)
    k, n = 64, 24
    lin = nn.Linear(k, n, bias=False)
    x = torch.randn(200, k, generator=g) @ torch.randn(k, k, generator=g)
    h = x.T @ x / x.shape[0]
    ref = lin(x).detach()
    cfg = MosaicQuantConfig(transform="pca", budget=0)
    basis = resq_basis(h, cfg.n_high(k), seed=0)
    h_rot, act = pca_input_transform(lin, h, cfg, basis=basis)
    assert isinstance(lin.input_transform, BasisTransform)
    assert torch.allclose(lin(lin.input_transform(x)).detach(), ref, rtol=FLOAT_FN_RTOL, atol=FLOAT_FN_RTOL * float(ref.abs().max()))
    assert isinstance(act, MixedActQuant) and act.high.bits == 4 and act.low.bits == 4
    # the last n_high channels carry the most energy
    diag = torch.diagonal(h_rot)
    assert diag[k - cfg.n_high(k):].mean() > diag[: k - cfg.n_high(k)].mean()
    with pytest.raises(ValueError, match="already has an input transform"):
        pca_input_transform(lin, h, cfg, basis=basis)


def test_pca_input_transform_down_proj_is_hadamard_one_grid():
    lin = nn.Linear(64, 16, bias=False)
    cfg = MosaicQuantConfig(transform="pca", a_symmetric=False)
    _, act = pca_input_transform(lin, torch.eye(64), cfg, basis=None)
    assert isinstance(lin.input_transform, OnlineHadamard)
    assert act.bits == 4 and act.symmetric is False


@pytest.mark.parametrize("budget", [0.0, 0.3])
def test_mosaicquant_pca_on_tiny_model(budget, tiny_llama_model, lm_loss, tiny_lm_tokens):
    model = tiny_llama_model
    _, test, ctx = tiny_lm_tokens
    ref = lm_loss(model, test)
    mosaicquant(model, MosaicQuantConfig(transform="pca", budget=budget, block="16"), ctx)
    assert ctx.info["transform"]["transform"] == "pca"
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q.input_transform, BasisTransform) and isinstance(q.act, MixedActQuant)
    assert isinstance(model.model.layers[1].mlp.down_proj.input_transform, OnlineHadamard)
    bits = model_bits(model).metrics()
    assert bits["bits/activation"] == 4.0
    assert (bits["bits/weight_residual"] > 0.5) == (budget > 0)
    got = lm_loss(model, test)
    assert got < ref + torch.log(torch.tensor(MODEL_PPL_RATIO_MAX)), (ref, got)


@pytest.mark.parametrize("options", [{"transform": "pca"}, {"a_symmetric": False}])
def test_speed_form_refuses_what_the_runtime_does_not_execute(options, tiny_llama_model, tiny_lm_tokens):
    with pytest.raises(Unavailable, match="no fast path"):
        _speed_form(tiny_llama_model, MosaicQuantConfig(**options), tiny_lm_tokens[2])


def test_pca_config_errors():
    with pytest.raises(UserInputError, match="high_fraction"):
        MosaicQuantConfig(transform="pca", high_fraction=1.0)
    with pytest.raises(UserInputError, match="transform"):
        MosaicQuantConfig(transform="pcaa")


def test_low_group_basis_orders_subspaces_by_variance():
    g = torch.Generator().manual_seed(1)
    k, r, group = 48, 6, 10
    x = torch.randn(400, k, generator=g, dtype=torch.float64) * torch.logspace(1, -1, k, dtype=torch.float64)
    h = x.T @ x / x.shape[0]
    u = resq_basis(h, r, seed=0, low_group=group)
    assert torch.allclose(u.T @ u, torch.eye(k, dtype=torch.float64), atol=1e-10)
    energy = torch.diagonal(u.T @ h @ u)
    chunks = [energy[s:min(s + group, k - r)].mean() for s in range(0, k - r, group)]
    assert all(a > b for a, b in zip(chunks, chunks[1:]))  # descending variance, group by group
    assert energy[k - r:].mean() > chunks[0]
    # no group: ResQ's basis
    assert torch.equal(resq_basis(h, r, seed=0), resq_basis(h, r, seed=0, low_group=None))


def test_pca_group_gives_the_low_subspace_grouped_scales():
    lin = nn.Linear(64, 16, bias=False)
    cfg = MosaicQuantConfig(transform="pca", pca_group=14)
    h = torch.eye(64)
    _, act = pca_input_transform(lin, h, cfg, basis=resq_basis(h, cfg.n_high(64), seed=0, low_group=14))
    assert act.low.group_size == 14 and act.high.group_size is None
    values, scales = act.effective_bits(64)
    assert values == 4.0 and scales == pytest.approx(16 * (1 + 4) / 64)  # the high grid and 4 low groups per token


def test_two_passes_cut_the_high_subspace_error_and_count_eight_bits():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 16, generator=g) * 3
    spec = ActQuantSpec(bits=4, symmetric=True, clip_ratio=1.0)
    one, two = spec(x), MultiPassActQuant(spec, 2)(x)
    assert (two - x).pow(2).mean() < TWO_PASS_ERR_MAX * (one - x).pow(2).mean()
    assert MultiPassActQuant(spec, 2).effective_bits(16) == (8.0, 2 * 16 / 16)
    lin = nn.Linear(64, 8, bias=False)
    cfg = MosaicQuantConfig(transform="pca", high_passes=2)
    _, act = pca_input_transform(lin, torch.eye(64), cfg, basis=resq_basis(torch.eye(64), 8, seed=0))
    assert act.effective_bits(64)[0] == pytest.approx(4 + 4 * 8 / 64)
    with pytest.raises(UserInputError, match="high_passes"):
        MosaicQuantConfig(high_passes=3)



def test_two_pass_layers_have_no_kernel_path(tiny_llama_model, tiny_lm_tokens):
    from mosaicquant.kernels.mixed_gemm import mixed_from_fake

    mosaicquant(tiny_llama_model, MosaicQuantConfig(transform="pca", budget=0, high_passes=2), tiny_lm_tokens[2])
    reason = mixed_from_fake(tiny_llama_model.model.layers[0].self_attn.q_proj)
    assert isinstance(reason, str) and "multi-pass" in reason


def test_pca_layers_with_a_residual_have_no_mixed_kernel_path(tiny_llama_model, tiny_lm_tokens):
    from mosaicquant.kernels.mixed_gemm import mixed_from_fake

    mosaicquant(tiny_llama_model, MosaicQuantConfig(transform="pca", budget=0.5, block="16"), tiny_lm_tokens[2])
    reason = mixed_from_fake(tiny_llama_model.model.layers[0].mlp.up_proj)
    assert isinstance(reason, str) and "residual" in reason
