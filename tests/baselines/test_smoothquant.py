"""SmoothQuant W4A4: float function preserved; the α search returns the lowest-loss α."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from mosaicquant.baselines.smoothquant import (
    SmoothQuantConfig,
    collect_smoothing_inputs,
    search_alpha,
    smoothed_output_loss,
    smoothquant,
)
from mosaicquant.errors import UserInputError
from mosaicquant.harness.context import QuantContext
from mosaicquant.methods.qlinear import FakeQuantLinear
from mosaicquant.methods.smoothing import smooth_model

# HF RMSNorm computes in float32 inside a float64 model
FP64_MODEL_RTOL = 1e-5
VOCAB = 101


def _tiny(dtype=torch.float64) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():  # non-trivial norms and a planted activation outlier channel
        for layer in model.model.layers:
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
            layer.input_layernorm.weight[5] = 25.0
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
    return model


def _tokens(n: int, seqlen: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def test_alpha_search_inputs_and_float_function_preserved():
    model = _tiny()
    calib = _tokens(3, 37, 1)
    absmax, samples = collect_smoothing_inputs(model, calib, stride=5, batch_size=2)
    name = "model.layers.0.self_attn.q_proj"
    assert samples[name].shape == (len(range(0, 2 * 37, 5)) + len(range(0, 37, 5)), 48)
    assert (absmax[name] >= samples[name].abs().amax(0)).all()
    assert float(absmax[name][5]) > 5 * float(absmax[name].median())

    test = _tokens(2, 29, 2)
    smoothed = copy.deepcopy(model)
    smooth_model(smoothed, absmax, 0.85)
    with torch.no_grad():
        ref, got = model(test).logits, smoothed(test).logits
    assert torch.allclose(got, ref, rtol=FP64_MODEL_RTOL, atol=FP64_MODEL_RTOL * ref.abs().max())
    # the planted outlier channel is flattened: its norm weight (the input scale) drops the most
    ratio = smoothed.model.layers[0].input_layernorm.weight / model.model.layers[0].input_layernorm.weight
    assert int(ratio.argmin()) == 5


def test_alpha_search_picks_lowest_loss_on_planted_outlier():
    gen = torch.Generator().manual_seed(3)
    k, tokens = 64, 384
    x = torch.randn(tokens, k, generator=gen)
    x[:, [7, 40]] *= 60.0  # activation outliers: α = 0 leaves them to the 4-bit token grid
    weights = [torch.randn(33, k, generator=gen) * 0.1, torch.randn(17, k, generator=gen) * 0.1]
    absmax = x.abs().amax(dim=0)
    grid = (0.0, 0.3, 0.5, 0.7, 0.85, 1.0)
    config = SmoothQuantConfig(alpha_grid=grid, alpha_search=True)
    best, losses = search_alpha([(x, weights, absmax)], config)
    independent = {a: smoothed_output_loss(x, weights, absmax, a, config) for a in grid}
    assert losses == pytest.approx(independent, rel=1e-12)
    assert best == min(independent, key=independent.get)
    assert losses[best] < losses[0.0] / 2, losses  # smoothing matters on the planted case


def test_smoothquant_method_fixed_and_searched_alpha():
    calib = _tokens(4, 40, 4)
    test = _tokens(2, 40, 5)
    results = {}
    # the weight clip search is off only to keep the test fast; the wiring is the same
    for cfg in (SmoothQuantConfig(w_clip_search=False),
                SmoothQuantConfig(alpha_search=True, alpha_grid=(0.3, 0.6, 0.85), search_stride=2,
                                  w_clip_search=False)):
        model = _tiny(torch.float32)
        ctx = QuantContext(calibration=lambda: calib, seed=0, device=torch.device("cpu"), log=lambda s: None)
        smoothquant(model, cfg, ctx)
        assert ctx.info["kv_bits"] == 16 and ctx.info["quantized_linears"] == 14
        assert all(isinstance(layer.self_attn.q_proj, FakeQuantLinear) for layer in model.model.layers)
        with torch.no_grad():
            assert torch.isfinite(model(test).logits).all()
        results[cfg.alpha_search] = ctx.info
    assert results[False]["alpha"] == 0.85 and results[False]["alpha_losses_calib"] is None
    losses = results[True]["alpha_losses_calib"]
    assert set(losses) == {"0.3", "0.6", "0.85"}
    assert results[True]["alpha"] == float(min(losses, key=losses.get))


def test_smoothquant_config_validation():
    with pytest.raises(UserInputError, match="alpha=1.2"):
        SmoothQuantConfig(alpha=1.2)
    with pytest.raises(UserInputError, match="alpha_grid entry=1.5"):
        SmoothQuantConfig(alpha_grid=(0.5, 1.5))
    with pytest.raises(UserInputError, match="alpha_grid is empty"):
        SmoothQuantConfig(alpha_grid=())
    assert SmoothQuantConfig.from_dict({"alpha_grid": "0.4,0.8"}).alpha_grid == (0.4, 0.8)
