import pytest
import torch

from mosaicquant.harness.errors import UserInputError
from mosaicquant.kernels.act_quant import (
    quantize_activations,
    quantize_activations_reference,
    quantize_activations_triton,
)
from mosaicquant.methods.format import pack_int4
from mosaicquant.methods.quant import quantize

from ._helpers import DEVICE, NAN_U8, needs_triton, random_activations


@needs_triton()
@pytest.mark.parametrize("m,k", [(1, 7), (13, 300), (67, 1001)])
@pytest.mark.parametrize("clip", [1.0, 0.9])
def test_triton_matches_shared_quantizer_bit_exact(m, k, clip):
    gen = torch.Generator().manual_seed(m * 1000 + k)
    x = random_activations(m, k, gen)
    x[0, 1] = 0.5 * x[0].float().abs().max()  # exact-tie candidates exist for many rows
    packed = torch.full((m, (k + 1) // 2), NAN_U8, dtype=torch.uint8, device=DEVICE)
    scale = torch.full((m,), float("nan"), device=DEVICE)
    quantize_activations_triton(x.to(DEVICE), clip, out=(packed, scale))
    qt = quantize(x, 4, clip_ratio=clip)
    assert torch.equal(packed.cpu(), pack_int4(qt.q))
    assert torch.equal(scale.cpu(), qt.scale.reshape(-1))


@needs_triton()
def test_all_zero_row_gets_scale_one_and_long_rows_take_two_passes():
    gen = torch.Generator().manual_seed(3)
    x = random_activations(3, 17000, gen)  # > 2 * MAX_BLOCK_KP elements: two-pass path
    x[1] = 0
    packed, scale = quantize_activations_triton(x.to(DEVICE))
    ref_packed, ref_scale = quantize_activations_reference(x)
    assert torch.equal(packed.cpu(), ref_packed) and torch.equal(scale.cpu(), ref_scale)
    assert scale[1].item() == 1.0


def test_reference_packs_like_format():
    gen = torch.Generator().manual_seed(4)
    x = random_activations(5, 33, gen)
    packed, scale = quantize_activations(x, 0.8, kernel="torch")
    assert packed.shape == (5, 17) and packed.dtype == torch.uint8
    assert torch.equal(scale, quantize(x, 4, clip_ratio=0.8).scale.reshape(-1))


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda: quantize_activations(torch.ones(2, 4, dtype=torch.int32), kernel="torch"), "dtype int32"),
        (lambda: quantize_activations(torch.ones(2, 3, 4), kernel="torch"), "2-D"),
        (lambda: quantize_activations(torch.ones(2, 4), 1.5, kernel="torch"), "clip_ratio=1.5"),
        (lambda: quantize_activations(torch.ones(2, 4), kernel="trition"), "Did you mean: triton"),
    ],
)
def test_bad_input_raises_clear_error(bad, match):
    with pytest.raises(UserInputError, match=match):
        bad()
