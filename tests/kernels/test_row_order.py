"""The swapped GEMM's weight-row tiles in the order of their residual work (``row_order``, heavy block rows first)."""

import pytest
import torch

from mosaicquant.errors import UserInputError
from mosaicquant.kernels.act_quant import quantize_activations_triton
from mosaicquant.kernels.w4a4_gemm import row_tile_order, w4a4_gemm_swapped_triton

from ._helpers import DEVICE, assert_close_bf16, needs_triton, pow2_layer, random_activations


def test_row_tile_order_puts_the_rows_that_keep_most_first():
    _, _, _, residual = pow2_layer(1000, 1024, (128, 128), 0.4, seed=1)
    kept = (residual.row_ptr[1:] - residual.row_ptr[:-1]).tolist()
    assert len(set(kept)) > 2  # rows that keep different numbers of blocks
    order = row_tile_order(residual, 128)
    assert order.dtype == torch.int32 and sorted(order.tolist()) == list(range(len(kept)))
    counts = [kept[i] for i in order.tolist()]
    assert counts == sorted(kept, reverse=True)
    for a, b in zip(order.tolist(), order.tolist()[1:]):  # ties keep row order
        assert kept[a] > kept[b] or a < b
    # 32-row tiles: each block row's four tiles together, in its place; the last block row is 1000 - 896 rows
    sub = row_tile_order(residual, 32).tolist()
    assert sub == [4 * b + i for b in order.tolist() for i in range(4)]
    with pytest.raises(UserInputError, match="block_n=96 does not nest in the residual's 128-row blocks"):
        row_tile_order(residual, 96)


@needs_triton()
@pytest.mark.parametrize("walk", ["shared", "merged", None])
@pytest.mark.parametrize("m,opts", [
    (67, dict(block_n=128, block_m=64, rem_split=1)),                        # ragged M
    (160, dict(block_n=128, block_m=128, block_m_tail=32, rem_split=1)),     # a narrow last token tile
    (40, dict(block_n=128, block_m=16, rem_split=4)),                        # whole tiles and split ones
])
def test_row_order_gives_the_same_bits(walk, m, opts):
    # the same bits; where the last wave is split over K, the order changes which tiles it takes, and those sum
    # their splits' partials in fp32 (the same result up to that summation's rounding, as split_k)
    n, k = 640, 512  # five block rows
    gen, qweight, w_scale, residual = pow2_layer(n, k, (128, 128), 0.4, seed=m, max_shift=3 if walk == "merged" else 4)
    x = random_activations(m, k, gen)
    bias = torch.randn(n, generator=gen)
    a8, s8 = quantize_activations_triton(x.to(DEVICE), layout="split8")
    qweight, w_scale, bias, residual = qweight.to(DEVICE), w_scale.to(DEVICE), bias.to(DEVICE), residual.to(DEVICE)
    extra = {} if walk is None else {"residual": residual, "residual_walk": walk}
    order = row_tile_order(residual, 128)
    assert order.tolist() != sorted(order.tolist())  # a real permutation
    plain = w4a4_gemm_swapped_triton(a8, s8, qweight, w_scale, k, bias, **extra, **opts)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    got = w4a4_gemm_swapped_triton(a8, s8, qweight, w_scale, k, bias, **extra, **opts, row_order=order, out=out)
    if opts["rem_split"] == 1:
        assert torch.equal(got, plain), f"{walk} M={m} {opts}: {int((got != plain).sum())} differ"
    else:
        assert_close_bf16(got, plain.float(), f"{walk} M={m} {opts}")


@needs_triton()
def test_row_order_is_checked():
    gen, qweight, w_scale, residual = pow2_layer(256, 256, (128, 128), 0.5, seed=3)
    a8, s8 = quantize_activations_triton(random_activations(8, 256, gen).to(DEVICE), layout="split8")
    with pytest.raises(UserInputError, match="row_order"):
        w4a4_gemm_swapped_triton(a8, s8, qweight.to(DEVICE), w_scale.to(DEVICE), 256,
                                 row_order=torch.zeros(3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(UserInputError, match=r"row_order must be a permutation of the 2 weight-row tiles 0 \.\. 1"):
        w4a4_gemm_swapped_triton(a8, s8, qweight.to(DEVICE), w_scale.to(DEVICE), 256,
                                 row_order=torch.zeros(2, dtype=torch.int32, device=DEVICE))
    # a tensor is read back once, and again after it is written
    order = torch.tensor([1, 0], dtype=torch.int32, device=DEVICE)
    w4a4_gemm_swapped_triton(a8, s8, qweight.to(DEVICE), w_scale.to(DEVICE), 256, row_order=order)
    order[0] = 0
    with pytest.raises(UserInputError, match="row_order must be a permutation"):
        w4a4_gemm_swapped_triton(a8, s8, qweight.to(DEVICE), w_scale.to(DEVICE), 256, row_order=order)


@needs_triton()
def test_quant_linear_runs_its_prefill_tiles_in_row_order(monkeypatch, tile_table):
    import mosaicquant.kernels.quant_linear as ql
    from mosaicquant.kernels.quant_linear import QuantLinear

    from ._helpers import pow2_layers

    gen = torch.Generator().manual_seed(5)
    _, packed, _ = pow2_layers(512, 384, (128, 128), 0.4, gen, bias=False, max_shift=4)
    layer = QuantLinear(packed).to(DEVICE)
    assert layer.res_row_order is not None and layer.res_row_order.shape == (4,)
    seen = []
    plain = ql.w4a4_gemm_swapped_triton
    monkeypatch.setattr(ql, "w4a4_gemm_swapped_triton",
                        lambda *a, **kw: seen.append(kw.get("row_order")) or plain(*a, **kw))
    a8, s8 = quantize_activations_triton(random_activations(200, 384, gen).to(DEVICE), layout="split8")
    outs = {}
    for on in (True, False):
        tile_table(swap_row_order=on)
        seen.clear()
        outs[on] = layer.forward_split8(a8, s8)
        assert (seen[0] is not None) == on
    assert torch.equal(outs[True], outs[False])
