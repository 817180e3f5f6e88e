"""The swapped GEMM writing SiLU·mul of a stacked [gate | up] layer itself (``gated=True``): the second of a gate
tile's and its up tile's programs to finish writes it. The result must be the bits of the same GEMM's BF16 output followed by the SiLU·mul
kernel."""

import pytest
import torch

from mosaicquant.harness.errors import UserInputError
from mosaicquant.kernels.act_quant import quantize_activations_triton
from mosaicquant.kernels.decoder import silu_mul
from mosaicquant.kernels.w4a4_gemm import swapped_gated_reason, w4a4_gemm_swapped_triton

from ._helpers import DEVICE, needs_triton, pow2_residual, random_activations, random_layer, random_residual


def _case(m, n, k, block, fraction, seed, max_shift=4):
    gen = torch.Generator().manual_seed(seed)
    _, qweight, w_scale = random_layer(n, k, gen)
    residual = None
    if fraction:
        residual = pow2_residual(random_residual(n, k, block, fraction, gen), w_scale, gen, max_shift=max_shift)
    x = random_activations(m, k, gen)
    bias = torch.randn(n, generator=gen)
    a8, s8 = quantize_activations_triton(x.to(DEVICE), layout="split8")
    if residual is not None:
        residual = residual.to(DEVICE)
    return a8, s8, qweight.to(DEVICE), w_scale.to(DEVICE), bias.to(DEVICE), residual


@needs_triton()
@pytest.mark.parametrize("m,n,k,block,fraction,walk,opts", [
    (67, 512, 640, (128, 128), 0.0, None, dict(block_n=128, block_m=64)),          # dense; ragged M, K
    (13, 256, 1000, (128, 128), 0.0, None, dict(block_n=64, block_m=16, num_warps=4)),  # K not a multiple of 128
    (67, 512, 640, (128, 128), 0.4, "shared", dict(block_n=128, block_m=64)),     # the residual's shared walk
    (40, 512, 512, (128, 128), 0.5, "merged", dict(block_n=128, block_m=32)),     # the merged walk (shifts <= 3)
    (160, 256, 384, (64, 128), 0.5, "shared", dict(block_n=128, block_m=128, block_m_tail=32)),  # narrow last tile
    (16, 512, 512, (128, 128), 0.0, None, dict(block_n=128, block_m=16, rem_split=4)),  # a last-wave split asked for
])
def test_gated_is_the_bf16_output_then_silu_mul(m, n, k, block, fraction, walk, opts):
    a8, s8, qweight, w_scale, bias, residual = _case(m, n, k, block, fraction, seed=m + n + k,
                                                     max_shift=3 if walk == "merged" else 4)
    extra = {} if residual is None else {"residual": residual, "residual_walk": walk}
    plain = w4a4_gemm_swapped_triton(a8, s8, qweight, w_scale, k, bias, **extra, **opts)
    want = silu_mul(plain, kernel="triton")
    out = torch.full((m, n // 2), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    got = w4a4_gemm_swapped_triton(a8, s8, qweight, w_scale, k, bias, **extra, **opts, gated=True, out=out)
    assert got.data_ptr() == out.data_ptr() and got.shape == (m, n // 2)
    assert torch.isfinite(got.float()).all(), "unwritten (poisoned) outputs"
    # not a trivial pass: gate and up differ, and SiLU·mul moved the values
    assert not torch.equal(plain[:, : n // 2], plain[:, n // 2:])
    assert (got.float() - plain[:, n // 2:].float()).abs().max() > 0
    assert torch.equal(got, want), f"gated M={m} N={n} K={k} {walk} {opts}: " \
        f"{int((got != want).sum())} of {got.numel()} differ"


@needs_triton()
def test_gated_refuses_what_it_cannot_take():
    a8, s8, qweight, w_scale, bias, _ = _case(16, 384, 256, (128, 128), 0.0, seed=1)
    with pytest.raises(UserInputError, match=r"gated=True cannot run this call: N=384 is not two halves of whole "
                                             r"128-row tiles"):
        w4a4_gemm_swapped_triton(a8, s8, qweight, w_scale, 256, bias, block_n=128, gated=True)
    with pytest.raises(UserInputError, match="split_k=2: a gated call runs its tiles unsplit"):
        w4a4_gemm_swapped_triton(a8, s8, qweight, w_scale, 256, bias, block_n=64, block_m=16, split_k=2,
                                 num_warps=4, gated=True)


def test_gated_reason():
    assert swapped_gated_reason(28672, 128) is None
    assert swapped_gated_reason(28672, 128, 2) is not None
    assert "N=200" in swapped_gated_reason(200, 128)
    assert "32-bit" in swapped_gated_reason(28672, 128, m=600_000)
    assert "more than the 65536 counters" in swapped_gated_reason(256, 16, m=2**20, block_m=16)
