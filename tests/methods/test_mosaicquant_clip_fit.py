"""MosaicQuant's calibration-chosen activation clips (``a_clip_search``) and weights fitted to the
quantized activations (``fit_quantized_acts``)."""

from __future__ import annotations

import pytest
import torch

from mosaicquant.methods.bits import model_bits
from mosaicquant.methods.mixed import MixedActQuant
from mosaicquant.methods.mosaicquant import (
    A_CLIP_GRID, MosaicQuantConfig, act_output_error, fit_to_quantized_inputs, mosaicquant, search_act_clip,
)
from mosaicquant.methods.qlinear import ActQuantSpec

LSQ_RTOL = 1e-4  # the float32 result of the (barely) damped solve against an exact float64 lstsq
MODEL_PPL_RATIO_MAX = 1.5  # quantized vs float next-token loss ratio (exp) on the tiny model


def _heavy_tailed(t, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g)
    x = x * torch.distributions.StudentT(2.0).sample((t, 1))  # a few tokens far larger than the rest
    return x, torch.randn(24, k, generator=g)


def test_clip_search_picks_a_grid_ratio_no_worse_than_the_start():
    x, w = _heavy_tailed(512, 32, 0)
    start = ActQuantSpec(4, symmetric=False, clip_ratio=1.0)
    got, err = search_act_clip(start, x, [w])
    assert got.clip_ratio in A_CLIP_GRID + (1.0,)
    assert err <= act_output_error(start, x, [w])
    assert err == pytest.approx(min(act_output_error(ActQuantSpec(4, symmetric=False, clip_ratio=c), x, [w])
                                    for c in A_CLIP_GRID))
    assert start.clip_ratio == 1.0  # the start is not changed


def test_clip_search_of_a_split_grid_sets_each_part_and_the_gram_path_agrees():
    x, w = _heavy_tailed(300, 40, 1)
    x[:, -5:] *= 30.0  # a high subspace of five channels
    spec = ActQuantSpec(4, symmetric=False)
    mixed = MixedActQuant(torch.arange(35, 40), torch.arange(35), 40, high=spec, low=spec)
    got, err = search_act_clip(mixed, x, [w])
    assert isinstance(got, MixedActQuant) and err <= act_output_error(mixed, x, [w])
    assert got.low.clip_ratio in A_CLIP_GRID and got.high.clip_ratio in A_CLIP_GRID
    wide = [w, torch.randn(60, 40, generator=torch.Generator().manual_seed(2))]  # 84 rows > K: through W^T W
    direct = sum(float(((got(x) - x).double() @ m.double().T).square().sum()) for m in wide)
    assert act_output_error(got, x, wide) == pytest.approx(direct, rel=1e-9)


def test_fit_to_quantized_inputs_is_the_least_squares_weight():
    x, w = _heavy_tailed(400, 32, 3)
    xq = ActQuantSpec(4)(x)
    w_star, hq = fit_to_quantized_inputs(w, x, xq, percdamp=1e-9)
    exact = torch.linalg.lstsq(xq.double(), (x @ w.T).double()).solution.T
    assert torch.allclose(w_star.double(), exact, rtol=LSQ_RTOL, atol=LSQ_RTOL * float(exact.abs().max()))
    assert torch.allclose(hq, xq.T @ xq / 400, rtol=1e-5, atol=1e-6)
    loss = lambda m: float((x @ w.T - xq @ m.T).square().sum())  # noqa: E731
    assert loss(w_star) < loss(w)
    # unquantized inputs: the weight comes back
    same, _ = fit_to_quantized_inputs(w, x, x, percdamp=1e-9)
    assert torch.allclose(same, w, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="shapes"):
        fit_to_quantized_inputs(w, x, xq[:, :8], percdamp=0.01)


@pytest.mark.parametrize("options", [{"a_clip_search": True}, {"fit_quantized_acts": True},
                                     {"a_clip_search": True, "fit_quantized_acts": True, "budget": 0.3}])
def test_options_on_tiny_model(options, tiny_llama_model, lm_loss, tiny_lm_tokens):
    model = tiny_llama_model
    _, test, ctx = tiny_lm_tokens
    ref = lm_loss(model, test)
    config = MosaicQuantConfig(transform="pca", a_symmetric=False, a_clip=1.0, block="16",
                               **{"budget": 0.0, **options})
    mosaicquant(model, config, ctx)
    chosen = ctx.info.get("a_clip_chosen")
    assert (chosen is not None) == config.a_clip_search
    if chosen:
        assert all(c in A_CLIP_GRID for ratios in chosen.values() for c in ratios)
        q = model.model.layers[0].self_attn.q_proj.act
        assert [q.low.clip_ratio, q.high.clip_ratio] == chosen["layers.0.self_attn.q_proj"]
    assert model_bits(model).metrics()["bits/activation"] == 4.0
    got = lm_loss(model, test)
    assert got < ref + torch.log(torch.tensor(MODEL_PPL_RATIO_MAX)), (ref, got)

