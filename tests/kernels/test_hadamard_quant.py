"""The fused online Hadamard + activation quantization kernel against the unfused PyTorch path."""

import pytest
import torch

from mosaicquant.harness.errors import UserInputError
from mosaicquant.kernels.hadamard_quant import (
    fused_hadamard_reason,
    hadamard_quantize,
    hadamard_quantize_reference,
    hadamard_quantize_triton,
)
from mosaicquant.methods.format import unpack_int4
from mosaicquant.methods.hadamard import OnlineHadamard, random_signs

from ._helpers import DEVICE, NAN_U8, needs_triton, random_activations

# The kernel sums the transform in another order than PyTorch (tensor-core tiles, the second
# product on a 16-bit high/low split of the first), so a transformed value can round to the
# neighbouring 16-bit value and, rarely, cross a 4-bit rounding boundary. Measured on these
# inputs: at most 2e-5 of the integers differ, by one level, and every scale is equal.
MAX_MISMATCH = 1e-3
MIN_EQUAL_SCALES = 0.9


def _compare(x, had, clip):
    n = had.size
    packed = torch.full((x.shape[0], n // 2), NAN_U8, dtype=torch.uint8, device=DEVICE)
    scale = torch.full((x.shape[0],), float("nan"), device=DEVICE)
    hadamard_quantize_triton(x.to(DEVICE), had.to(DEVICE), clip, out=(packed, scale))
    ref_packed, ref_scale = hadamard_quantize_reference(x, had, clip)
    q = unpack_int4(packed.cpu(), n).int()
    ref_q = unpack_int4(ref_packed, n).int()
    scale = scale.cpu()
    assert torch.isfinite(scale).all()
    diff = (q - ref_q).abs()
    assert diff.max().item() <= 1, f"integers off by {diff.max().item()} levels"
    assert (diff > 0).float().mean().item() <= MAX_MISMATCH
    assert ((scale - ref_scale).abs() <= ref_scale * 2.0**-7).all(), "a scale is off by more than one BF16 ulp"
    assert (scale == ref_scale).float().mean().item() >= MIN_EQUAL_SCALES


@needs_triton()
@pytest.mark.parametrize("n,signs,transpose", [
    (4096, False, False),   # 2^12: [32, 128] view, Sylvester left factor
    (576, False, False),    # 36 · 16: [36, 16] view padded to 64 rows, Paley factor
    (1536, True, False),    # 12 · 128 with random signs after the transform
    (14336, False, True),   # 28 · 512, transposed: [112, 128] padded to 128
    (12288, True, True),    # 12 · 1024, signs applied first (transposed)
])
@pytest.mark.parametrize("m", [1, 13])
def test_fused_kernel_matches_the_unfused_path(n, signs, transpose, m):
    had = OnlineHadamard(n, signs=random_signs(n, seed=n) if signs else None, transpose=transpose)
    x = random_activations(m, n, torch.Generator().manual_seed(n + m))
    _compare(x, had, 0.9)


@needs_triton()
def test_fp16_inputs_and_an_all_zero_row():
    had = OnlineHadamard(1024)
    x = random_activations(5, 1024, torch.Generator().manual_seed(1)).to(torch.float16)
    x[2] = 0
    _compare(x, had, 1.0)
    _, scale = hadamard_quantize_triton(x.to(DEVICE), had.to(DEVICE))
    assert scale[2].item() == 1.0


@needs_triton()
def test_the_transform_is_not_skipped():
    # quantizing the raw input instead of the transformed one must fail the comparison
    from mosaicquant.kernels.act_quant import quantize_activations_reference

    had = OnlineHadamard(256)
    x = random_activations(4, 256, torch.Generator().manual_seed(2))
    packed, _ = hadamard_quantize_triton(x.to(DEVICE), had.to(DEVICE))
    raw, _ = quantize_activations_reference(x)
    assert (unpack_int4(packed.cpu(), 256) != unpack_int4(raw, 256)).float().mean() > 0.5


def test_what_the_fused_kernel_does_not_take_is_named():
    assert fused_hadamard_reason(OnlineHadamard(4096), torch.bfloat16) is None
    assert "float32" in fused_hadamard_reason(OnlineHadamard(4096), torch.float32)
    assert "at least 16" in fused_hadamard_reason(OnlineHadamard(20), torch.bfloat16)  # 20 = 20 · 2^0
    assert "at most 256" in fused_hadamard_reason(OnlineHadamard(40 * 1024), torch.bfloat16)  # 320 rows
    assert "not an OnlineHadamard" in fused_hadamard_reason(torch.nn.Identity(), torch.bfloat16)


@pytest.mark.parametrize("bad,match", [
    (lambda: hadamard_quantize(torch.randn(2, 64), OnlineHadamard(32), kernel="torch"), "32"),
    (lambda: hadamard_quantize(torch.randn(2, 64), OnlineHadamard(64), 1.5, kernel="torch"), "clip_ratio"),
    (lambda: hadamard_quantize(torch.randn(2, 64), torch.nn.Identity(), kernel="torch"), "OnlineHadamard"),
    (lambda: hadamard_quantize(torch.randn(64), OnlineHadamard(64), kernel="torch"), "2-D"),
])
def test_bad_inputs_raise_clear_errors(bad, match):
    with pytest.raises(UserInputError, match=match):
        bad()


@needs_triton()
def test_triton_launcher_refuses_a_transform_it_cannot_fuse():
    x = torch.randn(2, 20, device=DEVICE).to(torch.bfloat16)
    with pytest.raises(UserInputError, match="at least 16"):
        hadamard_quantize_triton(x, OnlineHadamard(20).to(DEVICE))
    with pytest.raises(UserInputError, match="bfloat16 or float16"):
        hadamard_quantize_triton(torch.randn(2, 64, device=DEVICE), OnlineHadamard(64).to(DEVICE))
