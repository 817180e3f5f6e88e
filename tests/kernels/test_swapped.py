"""The "split8" activation layout and the operand-swapped GEMM (prefill variant), dense and with residual blocks."""

import pytest
import torch

from mosaicquant.errors import UserInputError
from mosaicquant.kernels import _tiles
from mosaicquant.kernels._tiles import SWAP_MIN_TILES_PER_SM, _sm_count, swapped_prefill
from mosaicquant.kernels.act_quant import (
    quantize_activations_reference,
    quantize_activations_triton,
    split8_from_int,
    split8_width,
)
from mosaicquant.kernels.hadamard_quant import hadamard_quantize_triton
from mosaicquant.kernels.quant_linear import QuantLinear
from mosaicquant.kernels.w4a4_gemm import swapped_residual_reason, w4a4_gemm_reference, w4a4_gemm_swapped_triton
from mosaicquant.kernels.zipper import zipper_gemm_reference
from mosaicquant.methods.format import PackedW4, unpack_int4
from mosaicquant.methods.hadamard import OnlineHadamard, random_signs
from mosaicquant.methods.quant import quantize

from ._helpers import (
    DEVICE,
    assert_close_bf16,
    needs_triton,
    random_activations,
    random_layer,
    random_residual,
    swapped_dense_case,
)


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
    args, ref = swapped_dense_case(m, n, k, seed=m + n)
    out = w4a4_gemm_swapped_triton(*args, block_n=64, block_m=64)
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


@needs_triton()
@pytest.mark.parametrize("m,n,k,block,fraction", [
    (13, 200, 300, (128, 128), 0.5),   # ragged N and K: the last block row and column run past the layer
    (67, 130, 640, (64, 256), 0.4),    # block rows of 64 (tile shrinks to them), columns of two split8 blocks
    (5, 96, 1000, (32, 128), 1.0),     # every block kept, K not a multiple of 128
])
@pytest.mark.parametrize("walk,tail_stages", [("fp8", None), ("int8", None), ("fp8", 5)])
def test_swapped_gemm_with_residual_matches_zipper_reference(m, n, k, block, fraction, walk, tail_stages):
    gen = torch.Generator().manual_seed(m * n)
    x = random_activations(m, k, gen)
    _, qweight, w_scale = random_layer(n, k, gen)
    residual = random_residual(n, k, block, fraction, gen)
    bias = torch.randn(n, generator=gen)
    packed, scale = quantize_activations_reference(x)
    ref = zipper_gemm_reference(packed, scale, qweight, w_scale, k, residual, bias, out_fp32=True)
    base = w4a4_gemm_reference(packed, scale, qweight, w_scale, k, bias, out_fp32=True)
    assert (ref - base).abs().max() > 1e-2 * ref.abs().max()  # the residual matters at this tolerance
    a8, s8 = quantize_activations_triton(x.to(DEVICE), layout="split8")
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    w4a4_gemm_swapped_triton(a8, s8, qweight.to(DEVICE), w_scale.to(DEVICE), k, bias.to(DEVICE),
                             residual=residual.to(DEVICE), residual_walk=walk, tail_stages=tail_stages,
                             block_n=128, block_m=64, out=out)
    assert_close_bf16(out, ref, f"swapped + residual ({walk}) M={m} N={n} K={k} blocks {block}")


@needs_triton()
def test_swapped_gemm_refuses_residual_blocks_it_cannot_take():
    gen = torch.Generator().manual_seed(1)
    _, qweight, w_scale = random_layer(64, 256, gen)
    residual = random_residual(64, 256, (32, 64), 0.5, gen).to(DEVICE)
    a8 = torch.zeros(4, 256, dtype=torch.int8, device=DEVICE)
    with pytest.raises(UserInputError, match=r"residual blocks 32x64: .* columns a multiple of 128"):
        w4a4_gemm_swapped_triton(a8, torch.ones(4, device=DEVICE), qweight.to(DEVICE), w_scale.to(DEVICE), 256,
                                 residual=residual)
    assert swapped_residual_reason((32, 64)) is not None and swapped_residual_reason((16, 128)) is None
    with pytest.raises(UserInputError, match=r"tail_stages=0 must be None or an int in \[1, 8\]"):
        w4a4_gemm_swapped_triton(a8, torch.ones(4, device=DEVICE), qweight.to(DEVICE), w_scale.to(DEVICE), 256,
                                 tail_stages=0)
    with pytest.raises(UserInputError, match="residual_walk='prefetched' is not allowed"):
        w4a4_gemm_swapped_triton(a8, torch.ones(4, device=DEVICE), qweight.to(DEVICE), w_scale.to(DEVICE), 256,
                                 residual_walk="prefetched")


@needs_triton()
@pytest.mark.parametrize("n,signs", [(576, False), (1536, True)])
def test_hadamard_quant_split8_holds_the_packed_integers(n, signs):
    had = OnlineHadamard(n, signs=random_signs(n, seed=n) if signs else None).to(DEVICE)
    x = random_activations(7, n, torch.Generator().manual_seed(n)).to(DEVICE)
    packed, scale = hadamard_quantize_triton(x, had, 0.9)
    q8, s8 = hadamard_quantize_triton(x, had, 0.9, layout="split8")
    assert q8.shape == (7, split8_width(n)) and torch.equal(s8, scale)
    assert torch.equal(q8.cpu(), split8_from_int(unpack_int4(packed.cpu(), n)))


@needs_triton()
@pytest.mark.parametrize("residual", [True, False])
def test_quant_linear_prefill_route_gives_the_packed_route_result(residual):
    gen = torch.Generator().manual_seed(5)
    n, k = 160, 384
    qt = quantize(torch.randn(n, k, generator=gen), 4, scale_dtype=torch.float16)
    res = random_residual(n, k, (32, 128), 0.3, gen) if residual else None
    packed = PackedW4.from_quantized(qt, residual=res, bias=torch.randn(n, generator=gen))
    x = random_activations(70, k, gen).to(DEVICE)
    # (swap_mid=False: this small layer's mid-sized calls would take the mid tiles, tested on their own)
    swapped = QuantLinear(packed, act_clip_ratio=0.9, kernel="triton", swap_min_m=64, swap_min_tiles_per_sm=0,
                          swap_mid=False).to(DEVICE)
    plain = QuantLinear(packed, act_clip_ratio=0.9, kernel="triton", swap_min_m=None, swap_mid=False).to(DEVICE)
    assert swapped.uses_swapped(70, "triton") and not swapped.uses_swapped(63, "triton")
    assert not plain.uses_swapped(70, "triton") and not swapped.uses_swapped(70, "torch")
    ref = QuantLinear(packed, act_clip_ratio=0.9, kernel="torch")(x.cpu()).float()
    assert_close_bf16(swapped(x), ref, "QuantLinear, swapped route")
    assert_close_bf16(plain(x), ref, "QuantLinear, packed route")
    # a residual the swapped GEMM cannot take keeps the packed route
    if residual:
        narrow = PackedW4.from_quantized(qt, residual=random_residual(n, k, (32, 64), 0.3, gen))
        assert not QuantLinear(narrow, kernel="triton", swap_min_m=1, swap_min_tiles_per_sm=0).uses_swapped(70, "triton")
    with pytest.raises(UserInputError, match="swap_min_m=0"):
        QuantLinear(packed, swap_min_m=0)


@needs_triton()
@pytest.mark.parametrize("m,n,k,opts", [
    (1, 200, 300, dict(block_n=64, block_m=16, block_kp=128, split_k=3, num_warps=4, x16=True)),
    (13, 77, 1000, dict(block_n=64, block_m=16, block_kp=256, split_k=2, num_warps=4, x16=True)),
    (32, 130, 640, dict(block_n=64, block_m=32, block_kp=128, split_k=4, num_warps=4, x16=False)),
])
def test_swapped_gemm_at_decode_tiles_matches_reference(m, n, k, opts):
    # decode tiles: several split8 blocks a step (ragged K masks the last), K split across programs
    args, ref = swapped_dense_case(m, n, k, seed=m + k)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    w4a4_gemm_swapped_triton(*args, out=out, **opts)
    assert_close_bf16(out, ref, f"swapped decode tiles M={m} N={n} K={k} {opts}")


@needs_triton()
def test_swapped_gemm_split_k_deals_out_the_residual_units():
    m, n, k = 16, 130, 1000
    gen = torch.Generator().manual_seed(3)
    x = random_activations(m, k, gen)
    _, qweight, w_scale = random_layer(n, k, gen)
    residual = random_residual(n, k, (64, 256), 0.5, gen)
    packed, scale = quantize_activations_reference(x)
    ref = zipper_gemm_reference(packed, scale, qweight, w_scale, k, residual, out_fp32=True)
    a8, s8 = quantize_activations_triton(x.to(DEVICE), layout="split8")
    out = w4a4_gemm_swapped_triton(a8, s8, qweight.to(DEVICE), w_scale.to(DEVICE), k, residual=residual.to(DEVICE),
                                   block_n=64, block_m=16, block_kp=128, split_k=3, num_warps=4, x16=True)
    assert_close_bf16(out, ref, "swapped, split K, residual")
    with pytest.raises(UserInputError, match="block_kp=96 must be 64, 128 or 256"):
        w4a4_gemm_swapped_triton(a8, s8, qweight.to(DEVICE), w_scale.to(DEVICE), k, block_kp=96)
    with pytest.raises(UserInputError, match=r"split_k=0 must be an int in \[1, 64\]"):
        w4a4_gemm_swapped_triton(a8, s8, qweight.to(DEVICE), w_scale.to(DEVICE), k, split_k=0)


@needs_triton()
def test_quant_linear_decode_route_runs_dense_layers_swapped_at_17_to_32_tokens(monkeypatch, tile_table):
    gen = torch.Generator().manual_seed(6)
    n, k = 130, 640
    qt = quantize(torch.randn(n, k, generator=gen), 4, scale_dtype=torch.float16)
    dense = QuantLinear(PackedW4.from_quantized(qt, bias=torch.randn(n, generator=gen)), act_clip_ratio=0.9,
                        kernel="triton", swap_min_m=512, swap_min_tiles_per_sm=0, swap_mid=False).to(DEVICE)
    with_res = QuantLinear(PackedW4.from_quantized(qt, residual=random_residual(n, k, (32, 128), 0.3, gen)),
                           kernel="triton", swap_min_m=512, swap_min_tiles_per_sm=0).to(DEVICE)
    # 16 tokens stay on the packed kernel (its wide K steps, _tiles.WIDE_K_DECODE_MIN_M)
    assert [m for m in (8, 15, 16, 17, 24, 32, 33, 511, 512) if dense.uses_swapped(m, "triton")] == [17, 24, 32, 512]
    assert [m for m in (16, 32, 512) if with_res.uses_swapped(m, "triton")] == [512]  # residual: decode stays packed
    tile_table(wide_k_decode_min_m=0)
    assert dense.uses_swapped(16, "triton")
    monkeypatch.undo()
    off = QuantLinear(PackedW4.from_quantized(qt), kernel="triton", swap_decode=None)
    assert not off.uses_swapped(16, "triton") and not dense.uses_swapped(16, "torch")
    ref_layer = QuantLinear(PackedW4.from_quantized(qt, bias=dense.bias.cpu()), act_clip_ratio=0.9, kernel="torch")
    for m in (16, 32):
        x = random_activations(m, k, gen)
        assert_close_bf16(dense(x.to(DEVICE)), ref_layer(x).float(), f"QuantLinear decode route M={m}")
    for bad in ((0, 4), (8, 4), "16"):
        with pytest.raises(UserInputError, match="swap_decode="):
            QuantLinear(PackedW4.from_quantized(qt), swap_decode=bad)


def test_quant_linear_decode_route_leaves_residual_layers_on_the_packed_kernels():
    # the swapped GEMM with kept blocks in its tail measured slower at 16-32 tokens on every walk
    gen = torch.Generator().manual_seed(7)
    n, k = 130, 640
    qt = quantize(torch.randn(n, k, generator=gen), 4, scale_dtype=torch.float16)
    dense = QuantLinear(PackedW4.from_quantized(qt), kernel="triton", swap_min_m=512)
    zipped = QuantLinear(PackedW4.from_quantized(qt, residual=random_residual(n, k, (64, 128), 0.3, gen)),
                         kernel="triton", swap_min_m=512)
    assert [m for m in (8, 16, 17, 24, 32, 33) if dense.swap_route(m) == "decode"] == [17, 24, 32]
    assert not any(zipped.uses_swapped(m, "triton") for m in (8, 16, 17, 24, 32, 33))


def test_prefill_route_needs_enough_output_tiles_to_fill_the_gpu():
    # 128 x 128 output tiles per SM: 0.7 for a dense layer, 1.2 with residual blocks (measured)
    sms = _sm_count(torch.device("cpu"))
    assert swapped_prefill(4096, 128, torch.device("cpu"), residual=False)
    assert not swapped_prefill(_tiles.SWAP_MIN_M - 1, 10**6, torch.device("cpu"), residual=False)  # below SWAP_MIN_M
    assert swapped_prefill(_tiles.SWAP_MIN_M, 10**6, torch.device("cpu"), residual=False)
    assert [swapped_prefill(128 * t, 128, torch.device("cpu"), residual=False) for t in range(1, 8)] == \
        [t >= SWAP_MIN_TILES_PER_SM["dense"] * sms for t in range(1, 8)]
    assert [swapped_prefill(128 * t, 128, torch.device("cpu"), residual=True) for t in range(1, 8)] == \
        [t >= SWAP_MIN_TILES_PER_SM["residual"] * sms for t in range(1, 8)]
    assert swapped_prefill(128, 128, torch.device("cpu"), residual=True, min_tiles_per_sm=0)
    qt = quantize(torch.randn(64, 256, generator=torch.Generator().manual_seed(0)), 4, scale_dtype=torch.float16)
    with pytest.raises(UserInputError, match="swap_min_tiles_per_sm=-1"):
        QuantLinear(PackedW4.from_quantized(qt), swap_min_tiles_per_sm=-1)
