"""The fused online Hadamard + activation quantization kernel against the unfused PyTorch path."""

import pytest
import torch

from mosaicquant import settings
from mosaicquant.errors import UserInputError
from mosaicquant.kernels import hadamard_quant
from mosaicquant.kernels.act_quant import split8_width
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
    (17408, True, False),   # 68 · 256: [136, 128] padded to 256, the last Sylvester level folded (Qwen3-14B)
    (25600, False, True),   # 100 · 256: [200, 128] padded to 256, folded (Qwen3-32B)
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
    # above 128 rows a Sylvester level past the 128 columns is folded into registers: 17408 = 68 · 2^8 has one,
    # 140 · 2^7 (140 rows of 128) has none
    assert fused_hadamard_reason(OnlineHadamard(17408), torch.bfloat16) is None
    assert hadamard_quant._folded(OnlineHadamard(17408)) and not hadamard_quant._folded(OnlineHadamard(14336))
    assert "has none past the 128 columns" in fused_hadamard_reason(OnlineHadamard(140 * 128), torch.bfloat16)
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



@needs_triton()
@pytest.mark.parametrize("kernel", [None, "auto"])
def test_the_automatic_choice_runs_the_reference_where_the_fused_kernel_cannot(kernel):
    # as the docstring says: only kernel="triton" refuses a dtype or transform the fused kernel does not take
    gen = torch.Generator().manual_seed(4)
    for x, had in ((random_activations(3, 64, gen).float(), OnlineHadamard(64)),       # float32 input
                   (random_activations(3, 20, gen), OnlineHadamard(20))):             # 20 = 20 · 2^0
        assert fused_hadamard_reason(had, x.dtype) is not None
        x, had = x.to(DEVICE), had.to(DEVICE)
        got = hadamard_quantize(x, had, kernel=kernel)
        want = hadamard_quantize_reference(x, had)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        with pytest.raises(UserInputError, match="the fused Hadamard"):
            hadamard_quantize(x, had, kernel="triton")
    # a preference in the settings is the caller's choice, as kernel="triton" is
    with settings.use(kernel="triton"), pytest.raises(UserInputError, match="bfloat16 or float16"):
        hadamard_quantize(torch.randn(2, 64, device=DEVICE), OnlineHadamard(64).to(DEVICE))

# --- several programs per token -------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="a token's programs wait for each other: GPU only")


def _split_run(x, had, layout, gated, p, given_absmax=None):
    """The kernel at ``p`` programs per token into poisoned outputs (the barrier unless ``given_absmax``)."""
    m, n = x.shape[0], had.size
    if layout == "split8":
        q = torch.zeros(m, split8_width(n), dtype=torch.int8, device=x.device)  # the padding stays zero
        q[:, :n] = NAN_U8 - 256
    else:
        q = torch.full((m, n // 2), NAN_U8, dtype=torch.uint8, device=x.device)
    scale = torch.full((m,), float("nan"), device=x.device)
    hadamard_quant._launch(x, had, q.view(torch.int8), scale, 1.0, layout == "split8", gated, p, None, given_absmax)
    return q, scale


def _case(n, m, signs, transpose, gated, dtype, device):
    had = OnlineHadamard(n, signs=random_signs(n, seed=n) if signs else None, transpose=transpose).to(device)
    x = random_activations(m, 2 * n if gated else n, torch.Generator().manual_seed(n + m)).to(dtype).to(device)
    if m > 1:
        x[1] = 0
    return had, x


@needs_triton()
@pytest.mark.parametrize("n,signs,transpose,gated,layout,dtype", [
    (4096, False, False, False, "packed", torch.bfloat16),
    (1536, True, False, True, "split8", torch.float16),      # [12, 128] padded to 16 rows, signs after
    (14336, True, True, False, "split8", torch.bfloat16),    # [112, 128] padded to 128, signs first
    (1024, False, False, True, "packed", torch.float16),
    (17408, True, True, True, "split8", torch.bfloat16),     # [136, 128] padded to 256: folded, 2 slices at most
])
def test_each_column_slice_transforms_and_quantizes_like_one_program(n, signs, transpose, gated, layout, dtype):
    # the column slices without the barrier (the interpreter cannot wait): the rows' absmax is given,
    # recovered from the clip-1 scales (the transformed values are 16-bit, so 7 · scale rounds back to them)
    had, x = _case(n, 3, signs, transpose, gated, dtype, DEVICE)
    ref_q, ref_s = hadamard_quantize_triton(x, had, layout=layout, gated=gated)
    absmax = torch.where(torch.arange(3, device=DEVICE) != 1, (ref_s * 7).to(dtype).float(), 0.0)
    # narrow slices of the tall views run the transposed products (hadamard_quant._transposed)
    most = hadamard_quant._split_limit(had)[0]
    for p in (p for p in (2, 4, 8) if p <= most):
        q, scale = _split_run(x, had, layout, gated, p, absmax)
        assert torch.equal(q, ref_q) and torch.equal(scale, ref_s), p


@needs_triton()
def test_programs_per_token_is_checked():
    x = random_activations(2, 576, torch.Generator().manual_seed(7)).to(DEVICE)
    with pytest.raises(UserInputError, match=r"programs_per_token=2 is too large.*at most 1.*16 columns"):
        hadamard_quantize_triton(x, OnlineHadamard(576).to(DEVICE), programs_per_token=2)  # [36, 16]
    x = random_activations(2, 4096, torch.Generator().manual_seed(7)).to(DEVICE)
    with pytest.raises(UserInputError, match=r"programs_per_token=16 is too large.*at most 8"):
        hadamard_quantize_triton(x, OnlineHadamard(4096).to(DEVICE), programs_per_token=16)
    with pytest.raises(UserInputError, match=r"programs_per_token=16 is too large.*at most 8.*at least 16 of the 128"):
        hadamard_quantize_triton(random_activations(2, 14336, torch.Generator().manual_seed(7)).to(DEVICE),
                                 OnlineHadamard(14336).to(DEVICE), programs_per_token=16)  # [112, 128] padded to 128
    with pytest.raises(UserInputError, match=r"programs_per_token=4 is too large.*at most 2.*at least 64 of the 128"):
        hadamard_quantize_triton(random_activations(2, 17408, torch.Generator().manual_seed(7)).to(DEVICE),
                                 OnlineHadamard(17408).to(DEVICE), programs_per_token=4)  # folded: no narrow slices
    with pytest.raises(UserInputError, match=r"programs_per_token=6 is not allowed"):
        hadamard_quantize_triton(x, OnlineHadamard(4096).to(DEVICE), programs_per_token=6)
    with pytest.raises(UserInputError, match="num_warps=5 is not allowed"):
        hadamard_quantize_triton(x, OnlineHadamard(4096).to(DEVICE), num_warps=5)
    if not torch.cuda.is_available():
        with pytest.raises(UserInputError, match="programs_per_token=2 needs a CUDA device"):
            hadamard_quantize_triton(x, OnlineHadamard(4096).to(DEVICE), programs_per_token=2)


@needs_gpu
@pytest.mark.parametrize("n,signs,transpose", [(4096, False, False), (14336, True, True), (576, False, False),
                                               (1536, True, False), (25600, True, False)])
@pytest.mark.parametrize("layout", ["packed", "split8"])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_split_tokens_give_the_same_integers_and_scales(n, signs, transpose, layout, gated, dtype):
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    most = hadamard_quant._split_limit(OnlineHadamard(n))[0]  # 576 = 36 · 16: one program only
    for m in (1, 4, 13, 32):
        had, x = _case(n, m, signs, transpose, gated, dtype, DEVICE)
        ref_q, ref_s = hadamard_quantize_triton(x, had, layout=layout, gated=gated, programs_per_token=1)
        for p in (2, 4, 8):
            if m * p > sms or p > most:
                continue
            runs = [_split_run(x, had, layout, gated, p) for _ in range(2)]  # back to back: the barrier resets
            for q, scale in runs:
                assert torch.equal(q, ref_q) and torch.equal(scale, ref_s), (m, p)
            if m > 1:
                assert runs[0][1][1].item() == 1.0
        q, scale = hadamard_quantize_triton(x, had, layout=layout, gated=gated)  # the default rule
        assert torch.equal(q, ref_q) and torch.equal(scale, ref_s), m


def test_default_warps_follow_the_measured_rule():
    from mosaicquant.kernels.hadamard_quant import _warps
    assert [_warps(4, p) for p in (4096, 8192, 16384)] == [8, 8, 16]  # decode: one program a token
    assert [_warps(64, p) for p in (4096, 16384)] == [4, 8]
    assert [_warps(256, p) for p in (4096, 16384)] == [4, 4]  # from 256 tokens 4 warps on long rows too
    # folded views (17408, 25600: R_PAD 256) keep 8 warps from 256 tokens; at decode sizes the rule above
    assert [_warps(m, 32768, folded=True) for m in (256, 2048, 8192)] == [8, 8, 8]
    assert [_warps(m, 16384, folded=True) for m in (4, 32, 64)] == [16, 16, 8]
