"""The "split8" activation layout and the operand-swapped dense GEMM (prefill variant)."""

import pytest
import torch

from mosaicquant.harness.errors import UserInputError
from mosaicquant.kernels.act_quant import (
    quantize_activations_reference,
    quantize_activations_triton,
    split8_from_int,
    split8_width,
)
from mosaicquant.kernels.w4a4_gemm import w4a4_gemm_reference, w4a4_gemm_swapped_triton
from mosaicquant.methods.format import unpack_int4

from ._helpers import DEVICE, assert_close_bf16, needs_triton, random_activations, random_layer


def test_split8_layout_puts_even_then_odd_values_of_each_block():
    q = torch.arange(300, dtype=torch.int64).remainder(15).sub(7).to(torch.int8)[None, :]
    s = split8_from_int(q)
    assert s.shape == (1, split8_width(300)) == (1, 384)
    assert torch.equal(s[0, :64], q[0, 0:128:2]) and torch.equal(s[0, 64:128], q[0, 1:128:2])
    assert torch.equal(s[0, 256:278], q[0, 256:300:2]) and (s[0, 278:320] == 0).all()
    assert torch.equal(s[0, 320:342], q[0, 257:300:2]) and (s[0, 342:] == 0).all()


@needs_triton()
@pytest.mark.parametrize("m,k", [(3, 10), (5, 300), (2, 576), (1, 20000)])
def test_act_quant_split8_matches_packed_integers(m, k):
    x = random_activations(m, k, torch.Generator().manual_seed(k))
    packed, scale = quantize_activations_reference(x)
    q, s = quantize_activations_triton(x.to(DEVICE), layout="split8")
    assert torch.equal(q.cpu(), split8_from_int(unpack_int4(packed, k)))
    assert torch.equal(s.cpu(), scale)


@needs_triton()
@pytest.mark.parametrize("m,n,k", [(1, 200, 300), (13, 77, 257), (67, 130, 1000), (300, 256, 640)])
def test_swapped_gemm_matches_reference(m, n, k):
    gen = torch.Generator().manual_seed(m + n)
    x = random_activations(m, k, gen)
    _, qweight, w_scale = random_layer(n, k, gen)
    bias = torch.randn(n, generator=gen)
    packed, scale = quantize_activations_reference(x)
    ref = w4a4_gemm_reference(packed, scale, qweight, w_scale, k, bias, out_fp32=True)
    a8, s8 = quantize_activations_triton(x.to(DEVICE), layout="split8")
    out = w4a4_gemm_swapped_triton(a8, s8, qweight.to(DEVICE), w_scale.to(DEVICE), k, bias.to(DEVICE),
                                   block_n=64, block_m=64)
    assert_close_bf16(out, ref, f"swapped M={m} N={n} K={k}")


@needs_triton()
def test_swapped_gemm_rejects_bad_layout_and_tiles():
    gen = torch.Generator().manual_seed(0)
    _, qweight, w_scale = random_layer(32, 256, gen)
    a8 = torch.zeros(4, 256, dtype=torch.int8, device=DEVICE)
    scale = torch.ones(4, device=DEVICE)
    with pytest.raises(UserInputError, match=r"a_split must have shape \[4, 384\]"):
        w4a4_gemm_swapped_triton(a8, scale, qweight.to(DEVICE), w_scale.to(DEVICE), 300)
    with pytest.raises(UserInputError, match="block_m=24 must be a power of two"):
        w4a4_gemm_swapped_triton(a8, scale, qweight.to(DEVICE), w_scale.to(DEVICE), 256, block_m=24)
    with pytest.raises(UserInputError, match="layout='int4' is not allowed"):
        quantize_activations_triton(torch.zeros(2, 8, dtype=torch.bfloat16, device=DEVICE), layout="int4")
