import pytest
import torch

from mosaicquant.errors import UserInputError
from mosaicquant.kernels import act_quant
from mosaicquant.kernels.act_quant import (
    quantize_activations,
    quantize_activations_reference,
    quantize_activations_triton,
    split8_width,
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


# --- several programs per token -------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="a token's programs wait for each other: GPU only")


def _row_absmax(scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Each row's absmax from its clip-1 scale: the absmax is a value of ``x``'s 16-bit dtype and the
    scale that value / 7 rounded, so 7 · scale rounds back to it (all-zero rows: 0)."""
    return torch.where(x.abs().amax(1) > 0, (scale * 7).to(x.dtype).float(), 0.0)


def _split_run(x, layout, gated, p, given_absmax=None):
    """The kernel at ``p`` programs per token into poisoned outputs (the barrier unless ``given_absmax``)."""
    m, k = x.shape[0], x.shape[1] // (2 if gated else 1)
    if layout == "split8":
        q = torch.full((m, split8_width(k)), NAN_U8 - 256, dtype=torch.int8, device=x.device)
    else:
        q = torch.full((m, (k + 1) // 2), NAN_U8, dtype=torch.uint8, device=x.device)
    scale = torch.full((m,), float("nan"), device=x.device)
    act_quant._launch(x, q.view(torch.int8), scale, k, 1.0, layout == "split8", gated, p, None, given_absmax)
    return q, scale


@needs_triton()
@pytest.mark.parametrize("k,gated,layout,dtype", [
    (1001, False, "packed", torch.bfloat16),   # odd K: the last slice ends on a half pair
    (1001, False, "split8", torch.float16),
    (300, True, "packed", torch.float16),      # 150 pairs: some of the 8 slices are empty
    (4096, True, "split8", torch.bfloat16),
    (40000, False, "packed", torch.bfloat16),  # P = 2: slices of 10048 pairs take two passes
])
def test_each_slice_quantizes_like_one_program(k, gated, layout, dtype):
    # the slicing without the barrier (the interpreter cannot wait): the rows' absmax is given
    gen = torch.Generator().manual_seed(k)
    x = random_activations(3, 2 * k if gated else k, gen).to(dtype).to(DEVICE)
    x[1] = 0
    ref_q, ref_s = quantize_activations_triton(x, layout=layout, gated=gated)
    for p in (2, 4, 8):
        q, scale = _split_run(x, layout, gated, p, _row_absmax(ref_s, x))
        assert torch.equal(q, ref_q) and torch.equal(scale, ref_s), p


@needs_triton()
def test_programs_per_token_and_warps_are_checked():
    x = random_activations(2, 64, torch.Generator().manual_seed(5)).to(DEVICE)
    for bad in (0, 3, 2.5):
        with pytest.raises(UserInputError, match=f"programs_per_token={bad!r} is not allowed"):
            quantize_activations_triton(x, programs_per_token=bad)
    with pytest.raises(UserInputError, match="num_warps=6 is not allowed"):
        quantize_activations_triton(x, num_warps=6)
    if not torch.cuda.is_available():
        with pytest.raises(UserInputError, match="programs_per_token=2 needs a CUDA device"):
            quantize_activations_triton(x, programs_per_token=2)
    else:
        sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
        x = random_activations(sms // 16 + 1, 64, torch.Generator().manual_seed(5)).to(DEVICE)
        with pytest.raises(UserInputError, match=f"more than the GPU's {sms} SMs"):
            quantize_activations_triton(x, programs_per_token=16)


@needs_gpu
@pytest.mark.parametrize("k", [4096, 14336, 576, 1536])
@pytest.mark.parametrize("layout", ["packed", "split8"])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_split_tokens_give_the_same_integers_and_scales(k, layout, gated, dtype):
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    for m in (1, 4, 13, 32):
        x = random_activations(m, 2 * k if gated else k, torch.Generator().manual_seed(k + m)).to(dtype).to(DEVICE)
        if m > 1:
            x[1] = 0
        ref_q, ref_s = quantize_activations_triton(x, layout=layout, gated=gated, programs_per_token=1)
        for p in (2, 4, 8):
            if m * p > sms:
                continue
            runs = [_split_run(x, layout, gated, p) for _ in range(2)]  # back to back: the barrier resets
            for q, scale in runs:
                assert torch.equal(q, ref_q) and torch.equal(scale, ref_s), (m, p)
            if m > 1:
                assert runs[0][1][1].item() == 1.0
        q, scale = quantize_activations_triton(x, layout=layout, gated=gated)  # the default rule
        assert torch.equal(q, ref_q) and torch.equal(scale, ref_s), m


@needs_gpu
def test_split_tokens_replay_in_a_cuda_graph():
    x = random_activations(4, 14336, torch.Generator().manual_seed(6)).to(DEVICE)
    ref_q, ref_s = quantize_activations_triton(x, programs_per_token=1)
    q = torch.empty_like(ref_q)
    scale = torch.empty_like(ref_s)
    quantize_activations_triton(x, out=(q, scale), programs_per_token=8)  # compiled, barrier allocated
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            quantize_activations_triton(x, out=(q, scale), programs_per_token=8)
    for _ in range(5):
        q.fill_(NAN_U8)
        scale.fill_(float("nan"))
        graph.replay()
        assert torch.equal(q, ref_q) and torch.equal(scale, ref_s)


def test_default_warps_follow_the_measured_rule():
    # decode sizes: long rows many warps; from PREFILL_WARPS_MIN_M tokens fewer, so more programs share an SM
    from mosaicquant.kernels.act_quant import PREFILL_WARPS_MIN_M, _warps
    assert [_warps(kp, 1, 4) for kp in (1024, 2048, 8192)] == [4, 8, 16]
    assert [_warps(kp, 1, PREFILL_WARPS_MIN_M) for kp in (1024, 2048, 8192)] == [4, 4, 8]
    assert _warps(2048, 1, PREFILL_WARPS_MIN_M - 1) == 8
    assert _warps(512, 8, 4) == 8  # split programs
