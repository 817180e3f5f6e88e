"""The floor of a speed cell: the bytes a decode step reads and the flops a prefill does, counted from the model."""

import pytest
import torch

from mosaicquant.harness import shapes
from mosaicquant.harness.context import QuantContext
from mosaicquant.harness.floor import Ceilings, decode_bytes, floor_fraction, measure_ceilings, module_bytes, \
    prefill_flops, prefill_floor_rate, quantized_linears
from mosaicquant.registry import get_method
from mosaicquant.harness.speedforms import executable, speed_form
from mosaicquant.methods.qlinear import weight_memory

TINY = shapes.ShapeModel("tiny-floor-shapes", "llama", 64, 128, 2, 4, 2, 16, 256, False)


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setitem(shapes.SHAPE_MODELS, TINY.name, TINY)
    return shapes.build_shape_model(TINY.name, dtype=torch.bfloat16)


def _kv(batch, context):
    # keys and values, every layer, context + 1 positions, kv_heads x head_dim, 2 bytes
    return 2 * TINY_LAYERS * batch * (context + 1) * 2 * 16 * 2


TINY_LAYERS = 2


def test_float_decode_reads_every_weight_once_the_head_the_rows_and_the_cache(tiny):
    params = sum(p.numel() * p.element_size() for p in tiny.parameters())
    table = tiny.get_input_embeddings().weight
    rows = 4 * 64 * 2
    expected = params - table.numel() * 2 + rows + _kv(4, 32)
    assert decode_bytes(tiny, 4, 32) == expected
    assert not quantized_linears(tiny)


def test_quantized_decode_counts_the_packed_format_and_each_fused_group_once(tiny):
    ctx = QuantContext(calibration=lambda: None, seed=0, device=torch.device("cpu"))
    speed_form("mosaicquant", tiny, get_method("mosaicquant").config(budget=0.25, block="16x64"), ctx)
    executable(tiny, ctx.info)
    stored = weight_memory(tiny)["total_quantized_linears"]
    norms = 2 * TINY_LAYERS * 64 * 2
    layers = sum(module_bytes(layer) for layer in tiny.model.layers)
    # the packed linears as stored plus the norms (and the online Hadamard's few bytes of state)
    assert stored + norms <= layers <= stored + norms + 64
    assert quantized_linears(tiny)
    float_bytes = 2 * TINY_LAYERS * (64 * (64 + 2 * 32 + 64) + 3 * 64 * 128)
    assert layers < 0.4 * float_bytes


def test_prefill_flops_are_the_linears_attention_and_the_last_position_head(tiny):
    weights = TINY_LAYERS * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128)
    tokens = 2 * 64
    attention = TINY_LAYERS * 2 * 2.0 * 64 * 64 * 4 * 16
    head = 2 * 2.0 * 64 * 256
    assert prefill_flops(tiny, 2, 64) == pytest.approx(2.0 * weights * tokens + attention + head)


def test_floor_fraction_and_its_input_checks():
    assert floor_fraction(50.0, 100.0) == 0.5
    with pytest.raises(ValueError, match="positive"):
        floor_fraction(1.0, 0.0)
    with pytest.raises(ValueError, match="CUDA"):
        measure_ceilings(torch.device("cpu"))


@pytest.mark.gpu
def test_prefill_floor_rate_refuses_an_int8_rate_below_bf16():
    # a measured INT8 product slower than BF16 is not the tensor cores' rate: no floor rather than one the
    # W4A4 prefill would beat 10x (an H100 run measured torch._int_mm at 129 TFLOP/s against BF16's 771)
    slow = Ceilings(2674.0, 771.3, 128.8, "NVIDIA H100 80GB HBM3")
    assert prefill_floor_rate(slow, quantized=False) == (771.3, "BF16 tensor cores")
    rate, text = prefill_floor_rate(slow, quantized=True)
    assert rate is None and "129 TFLOP/s, below BF16's 771" in text
    assert prefill_floor_rate(Ceilings(2674.0, 771.3, 1450.0, "x"), quantized=True) == (1450.0, "INT8 tensor cores")
    rate, text = prefill_floor_rate(Ceilings(2674.0, 771.3, None, "x"), quantized=True)
    assert rate is None and "did not run" in text


def test_ceilings_are_measured_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    c = measure_ceilings(torch.device("cuda"))
    assert 100 < c.copy_gb_s < 20_000 and 10 < c.bf16_tflop_s < 5_000
    if c.int8_tflop_s is not None:  # the INT8 tensor cores have at least BF16's rate
        assert c.int8_tflop_s >= c.bf16_tflop_s, (c.int8_tflop_s, c.bf16_tflop_s)
