"""MosaicQuant's activation clip ratios chosen on the calibration inputs (``a_clip_search``)."""

from __future__ import annotations

import pytest
import torch

from mosaicquant.methods.bits import model_bits
from mosaicquant.methods.mixed import MixedActQuant
from mosaicquant.methods.mosaicquant import (
    A_CLIP_GRID, MosaicQuantConfig, act_output_error, mosaicquant, search_act_clip,
)
from mosaicquant.methods.qlinear import ActQuantSpec

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


@pytest.mark.parametrize("transform, budget", [("pca", 0.0), ("pca", 0.3), ("rotation", 0.0)])
def test_clip_search_on_tiny_model(transform, budget, tiny_llama_model, lm_loss, tiny_lm_tokens):
    model = tiny_llama_model
    _, test, ctx = tiny_lm_tokens
    ref = lm_loss(model, test)
    config = MosaicQuantConfig(transform=transform, budget=budget, a_symmetric=False, a_clip=1.0, block="16",
                               a_clip_search=True)
    mosaicquant(model, config, ctx)
    chosen = ctx.info["a_clip_chosen"]
    assert all(c in A_CLIP_GRID for ratios in chosen.values() for c in ratios)
    # one choice per input: q/k/v share theirs, gate/up theirs
    assert len(chosen) == 4 * len(model.model.layers)
    q, v = model.model.layers[0].self_attn.q_proj.act, model.model.layers[0].self_attn.v_proj.act
    if transform == "pca":
        assert [q.low.clip_ratio, q.high.clip_ratio] == chosen["layers.0.self_attn.q_proj"]
        assert v is not q and v.low == q.low and v.high == q.high
    else:
        assert [q.clip_ratio] == chosen["layers.0.self_attn.q_proj"] and v == q
    assert model_bits(model).metrics()["bits/activation"] == 4.0
    got = lm_loss(model, test)
    assert got < ref + torch.log(torch.tensor(MODEL_PPL_RATIO_MAX)), (ref, got)
