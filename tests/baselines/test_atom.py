"""Atom: salient channels by diag(H) stay 8-bit, the rest 4-bit in (ragged) groups of 128."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mosaicquant.baselines.atom import AtomConfig, atom_quantize_linear
from mosaicquant.errors import UserInputError
from mosaicquant.methods.gptq import gptq_quantize_with_error
from mosaicquant.methods.mixed import MixedActQuant, WeightSegment, gptq_quantize_segments, ragged_groups, salient_order
from mosaicquant.methods.qlinear import ActQuantSpec
from mosaicquant.methods.quant import fake_quantize

# same arithmetic, different association of float64 sums
EXACT_ATOL = 1e-6
# per-token 8-bit error relative to a channel's magnitude: ~ 1/127 of the token range
INT8_REL_ERR_MAX = 1.0 / 100
# a 4-bit grid's error is ~16x an 8-bit grid's: the normal channels must be far above it
INT4_REL_ERR_MIN = 1.0 / 60
SQNR_FLOOR_DB = 8.0
# next-token loss change of the tiny random model (loss ~4.6 nats) after Atom
TINY_MODEL_LOSS_DELTA = 0.1


def _salient_inputs(tokens: int, k: int, salient: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=gen, dtype=torch.float64)
    x[:, salient] *= 40.0
    return x


def test_salient_order_picks_top_diag():
    diag = torch.tensor([5.0, 0.1, 9.0, 3.0, 7.5, 0.2, 1.0])
    normal, outliers = salient_order(diag, 3)
    assert set(outliers.tolist()) == {0, 2, 4}
    assert normal.tolist() == [1, 5, 6, 3]
    with pytest.raises(ValueError, match="n_outliers=8"):
        salient_order(diag, 8)


def test_ragged_groups_layout():
    groups = ragged_groups(torch.arange(448), 128)
    assert [g.numel() for g in groups] == [128, 128, 128, 64]
    assert torch.equal(torch.cat(groups), torch.arange(448))
    with pytest.raises(ValueError, match="group_size=0"):
        ragged_groups(torch.arange(5), 0)


def test_mixed_act_quant_groups_and_ragged_tail():
    k = 13
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, k, generator=gen)
    high = torch.tensor([3, 11])
    low = torch.tensor([c for c in range(k) if c not in (3, 11)][::-1])  # 11 channels, groups 4, 4, 3
    quant = MixedActQuant(high, low, k, ActQuantSpec(8), ActQuantSpec(4, group_size=4, clip_ratio=0.9))
    out = quant(x)
    assert torch.equal(out[:, high], fake_quantize(x[:, high], 8))
    for group in ragged_groups(low, 4):
        assert torch.equal(out[:, group], fake_quantize(x[:, group], 4, clip_ratio=0.9))
    with pytest.raises(ValueError, match="cover the 13 channels"):
        MixedActQuant(high, low[:-1], k, ActQuantSpec(8), ActQuantSpec(4))
    with pytest.raises(ValueError, match="outside 0..12"):
        MixedActQuant(torch.tensor([13]), None, k, ActQuantSpec(8), ActQuantSpec(4))


def test_segments_equal_gptq_dynamic_groups():
    """Segments of equal width and bits are exactly GPTQ with dynamic groups (natural order)."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(11, 60, generator=gen)
    x = torch.randn(300, 60, generator=gen) * torch.linspace(0.2, 3.0, 60)
    h = x.T @ x / 300
    segs = [WeightSegment(torch.arange(i, i + 20), 4) for i in (0, 20, 40)]
    got = gptq_quantize_segments(w, h, segs, act_order=False)
    ref = gptq_quantize_with_error(w, h, 4, group_size=20, act_order=False, clip_search=False,
                                   scale_dtype=torch.float16)
    assert torch.allclose(got.dequantized, ref.dequantized, atol=EXACT_ATOL)
    assert torch.allclose(got.loss, ref.loss, rtol=1e-4)
    with pytest.raises(ValueError, match="partition the 60"):
        gptq_quantize_segments(w, h, segs[:2])


def test_atom_linear_outliers_int8_rest_int4():
    k, n, tokens = 200, 37, 600
    gen = torch.Generator().manual_seed(3)
    salient = torch.randperm(k, generator=gen)[:16]
    x = _salient_inputs(tokens, k, salient, seed=4)
    h = (x.T @ x / tokens).to(torch.float32)
    linear = nn.Linear(k, n, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=gen) * 0.05)
        linear.bias.copy_(torch.randn(n, generator=gen))
    config = AtomConfig(n_outliers=16, group_size=64)  # 184 normal channels: groups 64, 64, 56
    layer = atom_quantize_linear(linear, h, config)

    top = torch.topk(torch.diagonal(h), 16).indices
    assert set(layer.outlier_channels.tolist()) == set(top.tolist()) == set(salient.tolist())
    assert layer.weight_groups == 4
    assert layer.wbits == pytest.approx((184 * 4 + 16 * 8) / k)

    xf = x.to(torch.float32)
    xq = layer.act(xf)
    err = (xq - xf).abs()
    rel = lambda cols: float(err[:, cols].mean() / xf[:, cols].abs().mean())  # noqa: E731
    normal = torch.tensor([c for c in range(k) if c not in set(salient.tolist())])
    assert rel(salient) < INT8_REL_ERR_MAX, f"outlier channels error {rel(salient):.4f}: not 8-bit"
    assert rel(normal) > INT4_REL_ERR_MIN, f"normal channels error {rel(normal):.4f}: not 4-bit"

    # weights: 8-bit columns carry 16 levels per 4-bit step; 4-bit groups at most 16 levels per row
    for col in salient.tolist()[:4]:
        assert layer.weight[:, col].unique().numel() > 16
    for group in ragged_groups(layer.act.low_channels, 64):
        for row in range(3):
            assert layer.weight[row, group].unique().numel() <= 16

    y_ref = linear(xf)
    y = layer(xf)
    sqnr = 10 * torch.log10(y_ref.pow(2).sum() / (y - y_ref).pow(2).sum())
    assert sqnr > SQNR_FLOOR_DB, f"Atom layer SQNR {sqnr:.1f} dB"


def test_atom_method_on_tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    from mosaicquant.baselines.atom import atom
    from mosaicquant.harness.context import QuantContext
    from mosaicquant.methods.kvcache import kv_quant_spec_of

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                                         num_attention_heads=6, num_key_value_heads=2,
                                         max_position_embeddings=64)).eval()
    gen = torch.Generator().manual_seed(7)
    calib = torch.randint(0, 97, (4, 48), generator=gen)
    test = torch.randint(0, 97, (2, 48), generator=gen)
    with torch.no_grad():
        ref = float(model(input_ids=test, labels=test).loss)
    ctx = QuantContext(calibration=lambda: calib, seed=0, device=torch.device("cpu"), log=lambda s: None)
    atom(model, AtomConfig(n_outliers=16, group_size=32), ctx)
    assert ctx.info["wbits"] == "4/8" and ctx.info["kv_bits"] == 4 and ctx.info["quantized_linears"] == 14
    assert set(ctx.info["outlier_channels_per_linear"].values()) == {16}
    spec = kv_quant_spec_of(model)
    assert spec.bits == 4 and not spec.symmetric and spec.group_size is None and not spec.rotate_qk
    down = model.model.layers[0].mlp.down_proj
    assert down.act.low_channels.numel() == 144 and down.weight_groups == 5 + 1  # 32 x 4 + 16, then outliers
    with torch.no_grad():
        got = float(model(input_ids=test, labels=test).loss)
    assert abs(got - ref) < TINY_MODEL_LOSS_DELTA, (ref, got)


def test_atom_config_validation():
    with pytest.raises(UserInputError, match="w_clip=1.5"):
        AtomConfig(w_clip=1.5)
    with pytest.raises(UserInputError, match="kvbits=3.5|kvbits"):
        AtomConfig(kvbits=12)
