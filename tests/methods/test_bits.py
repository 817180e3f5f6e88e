"""Effective bits: hand-computed values for known formats, read from the quantized model's modules."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from mosaicquant.baselines.atom import AtomConfig, atom_quantize_linear
from mosaicquant.methods.mixed import MixedActQuant
from mosaicquant.baselines.resq import ResQConfig, resq_basis, resq_quantize_linear
from mosaicquant.methods.bits import (
    UnknownFormat,
    budget_for_weight_bits,
    model_bits,
    mosaicquant_weight_bits,
)
from mosaicquant.methods.format import PackedW4, ResidualBlocks
from mosaicquant.methods.mosaicquant import MosaicQuantConfig, quantize_linear_mosaic
from mosaicquant.methods.qlinear import ActQuantSpec, fake_quant_linear_from, quantize_weight
from mosaicquant.methods.quant import quantize

#: bit counts are sums of integers over element counts: equal up to float rounding
EXACT = 1e-9


class _Wrap(nn.Module):
    """A model of the given layers (no output head, no attention)."""

    def __init__(self, *layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)


def _metrics(*layers):
    return model_bits(_Wrap(*layers)).metrics()


def _hessian(k, seed=0, outliers=()):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(256, k, generator=gen)
    for c in outliers:
        x[:, c] *= 20
    return x.T @ x / x.shape[0]


def test_rtn_w4_group_128_is_4_plus_16_over_128():
    gen = torch.Generator().manual_seed(1)
    linear = nn.Linear(256, 24, bias=False)
    linear.weight.data = torch.randn(24, 256, generator=gen)
    act = ActQuantSpec(bits=4)
    layer = fake_quant_linear_from(linear, quantize_weight(linear.weight.data, 4, group_size=128), act, 4)
    m = _metrics(layer)
    assert abs(m["bits/weight"] - (4 + 16 / 128)) < EXACT, m
    assert m["bits/weight_values"] == 4 and m["bits/weight_residual"] == 0
    assert m["bits/activation"] == 4 and abs(m["bits/activation_scales"] - 16 / 256) < EXACT


def test_asymmetric_and_8_bit_weights_count_zero_points_and_their_width():
    linear = nn.Linear(96, 16)
    asym = fake_quant_linear_from(linear, quantize_weight(linear.weight.data, 4, symmetric=False), ActQuantSpec(), 4)
    w8 = fake_quant_linear_from(linear, quantize_weight(linear.weight.data, 8, group_size=32),
                                ActQuantSpec(bits=8, symmetric=False, group_size=32), 8)
    assert abs(_metrics(asym)["bits/weight"] - (4 + 32 / 96)) < EXACT  # a scale and a zero point per row
    assert _metrics(asym)["bits/activation"] == 16 and _metrics(asym)["bits/activation_scales"] == 0
    m8 = _metrics(w8)
    assert abs(m8["bits/weight"] - (8 + 16 / 32)) < EXACT
    assert m8["bits/activation"] == 8 and abs(m8["bits/activation_scales"] - 32 / 32) < EXACT


@pytest.mark.parametrize("n, k, block, kept", [(64, 256, (32, 64), 3), (40, 100, (16, 32), 2)])
def test_residual_adds_its_values_scales_and_indices(n, k, block, kept):
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(n, k, generator=gen)
    packed = PackedW4.from_quantized(quantize(w, 4, scale_dtype=torch.float16))
    bn, bk = block
    nbr, nbc = -(-n // bn), -(-k // bk)
    coords = torch.tensor([[i % nbr, (3 * i) % nbc] for i in range(kept)])
    q = torch.randint(-8, 8, (kept, bn, bk), generator=gen, dtype=torch.int8)
    packed.residual = ResidualBlocks.from_blocks((n, k), block, coords, q, torch.rand(kept, bn, generator=gen))
    layer = fake_quant_linear_from(nn.Linear(k, n, bias=False), None, ActQuantSpec(bits=4), 16)
    layer.packed, layer.wbits = packed, 4
    base = n * math.ceil(k / 2) * 8 + n * 16
    residual = kept * (bn * bk * 4 + bn * 16 + 2 * 32) + (nbr + 1) * 32
    m = _metrics(layer)
    assert abs(m["bits/weight"] - (base + residual) / (n * k)) < EXACT, m
    assert abs(m["bits/weight_residual"] - residual / (n * k)) < EXACT


def test_mosaicquant_layer_matches_the_budget_formula():
    n, k = 96, 256
    gen = torch.Generator().manual_seed(3)
    linear = nn.Linear(k, n, bias=False)
    linear.weight.data = torch.randn(n, k, generator=gen)
    config = MosaicQuantConfig(budget=0.25, block="32", score="random", base="rtn")
    layer, _ = quantize_linear_mosaic(linear, _hessian(k), config, seed=0)
    blocks = (n // 32) * (k // 32)
    assert layer.packed.residual.num_blocks == round(0.25 * blocks)
    got = _metrics(layer)["bits/weight"]
    assert abs(got - mosaicquant_weight_bits([(n, k)], 0.25, "32")) < EXACT
    # by hand: base 4 + 16/K, each of the 6 kept 32x32 blocks 32*32*4 + 32*16 + 64 bits, row pointer 4 x 32 bits
    assert abs(got - (4 + 16 / k + (6 * (4096 + 512 + 64) + 4 * 32) / (n * k))) < EXACT
    empty, _ = quantize_linear_mosaic(linear, _hessian(k), MosaicQuantConfig(budget=0, base="rtn"), seed=0)
    assert abs(_metrics(empty)["bits/weight"] - (4 + 16 / k + 32 * (1 + 1) / (n * k))) < EXACT


def test_atom_outliers_at_8_bits_give_4_plus_4h_over_k():
    k, n, h = 384, 8, 128
    gen = torch.Generator().manual_seed(4)
    linear = nn.Linear(k, n, bias=False)
    linear.weight.data = torch.randn(n, k, generator=gen)
    layer = atom_quantize_linear(linear, _hessian(k, outliers=(5, 77)), AtomConfig(n_outliers=h, group_size=128))
    m = _metrics(layer)
    assert abs(m["bits/activation"] - (4 + 4 * h / k)) < EXACT, m
    # weights: 256 columns at 4 bits in 2 groups, 128 at 8 bits; one FP16 scale per row and segment
    assert abs(m["bits/weight"] - ((256 * 4 + 128 * 8) + 3 * 16) / k) < EXACT, m
    # activations: one 16-bit scale per token for the outliers and per group of 128 of the others
    assert abs(m["bits/activation_scales"] - 3 * 16 / k) < EXACT
    four = atom_quantize_linear(linear, _hessian(k), AtomConfig(n_outliers=h, group_size=128, outlier_bits=4))
    none = atom_quantize_linear(linear, _hessian(k), AtomConfig(n_outliers=0, group_size=128))
    assert _metrics(four)["bits/activation"] == 4 and _metrics(none)["bits/activation"] == 4
    assert abs(_metrics(four)["bits/weight"] - (4 + 3 * 16 / k)) < EXACT
    assert abs(_metrics(none)["bits/weight"] - (4 + 3 * 16 / k)) < EXACT  # 3 groups of 128


def test_resq_high_subspace_and_its_4_bit_and_empty_variants():
    k, n = 256, 16
    gen = torch.Generator().manual_seed(5)
    linear = nn.Linear(k, n, bias=False)
    linear.weight.data = torch.randn(n, k, generator=gen)
    h = _hessian(k)
    results = {}
    for label, config in (("default", ResQConfig()), ("4-bit", ResQConfig(high_bits=4)),
                          ("0%", ResQConfig(high_fraction=0.0))):
        r = config.n_high(k)
        layer = resq_quantize_linear(linear, h, config, basis=resq_basis(h, r, seed=0).to(torch.float32))
        results[label] = (r, _metrics(layer))
    r, m = results["default"]
    assert r == 32 and abs(m["bits/activation"] - (4 + 4 * r / k)) < EXACT
    assert abs(m["bits/weight"] - (4 + 4 * r / k + 2 * 16 / k)) < EXACT
    # asymmetric per token: a scale and a zero point for each subspace of a token
    assert abs(m["bits/activation_scales"] - 2 * 32 / k) < EXACT
    assert results["4-bit"][1]["bits/activation"] == 4
    assert abs(results["4-bit"][1]["bits/weight"] - (4 + 2 * 16 / k)) < EXACT
    assert results["0%"][0] == 0 and results["0%"][1]["bits/activation"] == 4
    assert abs(results["0%"][1]["bits/weight"] - (4 + 16 / k)) < EXACT


def test_mixed_act_quant_refuses_another_width():
    q = MixedActQuant(torch.tensor([0]), None, 4, ActQuantSpec(8), ActQuantSpec(4))
    assert q.effective_bits(4) == ((8 + 3 * 4) / 4, 2 * 16 / 4)
    with pytest.raises(ValueError, match="over 4 channels asked for the bits of 6"):
        q.effective_bits(6)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=32)).eval()


def test_float_model_is_16_bits_without_its_head_and_kv_cache_bits():
    from mosaicquant.methods.kvcache import KVQuantSpec, enable_kv_quant

    model = _tiny_llama()
    bits = model_bits(model)
    assert len(bits.linears) == 2 * 7  # q, k, v, o, gate, up, down per layer; the head is not counted
    assert all(v == (16.0 if not k.endswith(("scales", "residual")) else 0.0) for k, v in bits.metrics().items())
    enable_kv_quant(model, KVQuantSpec(bits=4, symmetric=False))
    m = model_bits(model).metrics()
    assert m["bits/kv_values"] == 4 and abs(m["bits/kv"] - (4 + 32 / 16)) < EXACT  # head_dim 16
    enable_kv_quant(model, KVQuantSpec(bits=4, symmetric=True, group_size=8))
    assert abs(model_bits(model).metrics()["bits/kv"] - (4 + 16 / 8)) < EXACT


def test_unknown_formats_are_named_not_guessed():
    class Odd(nn.Module):
        pass

    layer = fake_quant_linear_from(nn.Linear(8, 4), None, ActQuantSpec(), 16)
    layer.act = Odd()
    with pytest.raises(UnknownFormat, match="Odd does not say its bits"):
        _metrics(layer)
    layer = fake_quant_linear_from(nn.Linear(8, 4), None, ActQuantSpec(), 16)
    layer.wbits = 4.5
    with pytest.raises(UnknownFormat, match="4.5 bits per weight and no weight_segments"):
        _metrics(layer)


def test_kernel_layer_counts_its_stored_format():
    from mosaicquant.kernels.quant_linear import QuantLinear

    gen = torch.Generator().manual_seed(6)
    n, k = 32, 128
    packed = PackedW4.from_quantized(quantize(torch.randn(n, k, generator=gen), 4, scale_dtype=torch.float16))
    m = _metrics(QuantLinear(packed, kernel="torch"))
    assert abs(m["bits/weight"] - (4 + 16 / k)) < EXACT and m["bits/activation"] == 4


def test_budget_for_weight_bits_inverts_the_formula():
    shapes = [(576, 576), (192, 576), (1536, 576), (576, 1536)] * 3
    for budget in (0.05, 0.1, 0.3):
        target = mosaicquant_weight_bits(shapes, budget)
        found = budget_for_weight_bits(target, shapes)
        assert abs(mosaicquant_weight_bits(shapes, found) - target) < EXACT, (budget, found)
    assert budget_for_weight_bits(mosaicquant_weight_bits(shapes, 0.0) + 1e-3, shapes) == 0.0
    assert budget_for_weight_bits(100.0, shapes) == 1.0
    assert budget_for_weight_bits(0.0, shapes) == 0.0
    with pytest.raises(ValueError, match="budget=1.5 is out of range"):
        mosaicquant_weight_bits(shapes, 1.5)
    with pytest.raises(ValueError, match="target=nan"):
        budget_for_weight_bits(float("nan"), shapes)


def test_every_record_of_a_sweep_carries_its_bits(tmp_path, tiny_llama_dir, tiny_corpus):
    from mosaicquant.harness.cli import main
    from mosaicquant.harness.results import load_records

    rc = main(["run", "--model", tiny_llama_dir, "--methods", "fp16,rtn:w_group_size=32", "--suites",
               "accuracy:seqlen=32,memory", "--corpus", tiny_corpus, "--calib-samples", "2", "--calib-seqlen", "32",
               "--max-chunks", "1", "--out", str(tmp_path / "res")])
    assert rc == 0
    records = load_records(tmp_path / "res")
    assert len(records) == 4
    for rec in records:
        metric = rec["metrics"]["bits/weight"]
        assert metric["unit"] == "bits" and metric["higher_is_better"] is False
        want = 16.0 if rec["method"]["label"] == "fp16" else 4 + 16 / 32
        assert abs(metric["value"] - want) < EXACT, rec["method"]["label"]


def test_mixed_kernel_layer_counts_what_its_simulated_layer_counts():
    from mosaicquant.kernels.mixed_gemm import MixedQuantLinear, mixed_from_fake

    k, n = 256, 16
    gen = torch.Generator().manual_seed(8)
    linear = nn.Linear(k, n, bias=False)
    linear.weight.data = torch.randn(n, k, generator=gen)
    simulated = atom_quantize_linear(linear, _hessian(k), AtomConfig(n_outliers=64, group_size=64))
    kernel = mixed_from_fake(simulated, kernel="torch")
    assert isinstance(kernel, MixedQuantLinear), kernel
    want, got = _metrics(simulated), _metrics(kernel)
    assert abs(got["bits/activation"] - (4 + 4 * 64 / k)) < EXACT
    assert abs(got["bits/activation_scales"] - want["bits/activation_scales"]) < EXACT
    assert abs(got["bits/weight_values"] - want["bits/weight_values"]) < EXACT, (got, want)
