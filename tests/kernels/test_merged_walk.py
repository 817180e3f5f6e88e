"""The swapped GEMM's "shifted" and "merged" residual walks, and the operands and step tables they read."""

import pytest
import torch

from mosaicquant.errors import UserInputError
from mosaicquant.kernels.act_quant import quantize_activations_reference, quantize_activations_triton
from mosaicquant.kernels.w4a4_gemm import (
    dense_step_table,
    merged_residual_operand,
    shifted_residual_operand,
    w4a4_gemm_swapped_triton,
)
from mosaicquant.kernels.zipper import zipper_gemm_reference
from mosaicquant.methods.format import residual_shifts, unpack_int4

from ._helpers import (
    DEVICE,
    assert_close_bf16,
    assert_residual_matters,
    needs_triton,
    pow2_layer,
    random_activations,
)


def _unsplit8(x):
    """Inverse of the split8 order of each 128-value unit (even values, then odd ones)."""
    *lead, bk = x.shape
    return x.reshape(*lead, bk // 128, 2, 64).transpose(-1, -2).reshape(*lead, bk)


@pytest.mark.parametrize("n,k,block", [(200, 300, (128, 128)), (130, 640, (64, 256)), (96, 1000, (32, 128))])
def test_operands_hold_the_shifted_and_merged_integers(n, k, block):
    _, qweight, w_scale, residual = pow2_layer(n, k, block, 0.5, seed=n + k, max_shift=3)
    shifts = residual_shifts(residual, w_scale)
    assert shifts is not None and int(shifts.max()) == 3  # the helper draws every shift 0..3
    bn, bk = block
    r = unpack_int4(residual.values.reshape(-1, bk // 2), bk).reshape(-1, bn, bk).long()
    j = shifts.long().unsqueeze(-1)
    assert torch.equal(_unsplit8(shifted_residual_operand(residual, shifts)).long(), r << (4 - j))
    q = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk, dtype=torch.long)
    q[:n, :k] = unpack_int4(qweight, k).long()
    merged = _unsplit8(merged_residual_operand(qweight, k, residual, shifts)).long()
    for b, (i, c) in enumerate(residual.coords.tolist()):
        base = q[i * bn:(i + 1) * bn, c * bk:(c + 1) * bk]
        assert torch.equal(merged[b], 8 * base + (r[b] << (3 - j[b]))), f"block {b} at {(i, c)}"
    # the integers the kernels multiply are what the format means: s_w / 8 * merged = base + residual
    assert int(merged.min()) >= -128 and int(merged.max()) <= 127


def test_dense_step_table_lists_the_steps_no_kept_block_covers():
    n, k, block = 300, 1000, (64, 256)  # 8 steps of 128 values, the last block column half past K
    _, _, w_scale, residual = pow2_layer(n, k, block, 0.5, seed=3, max_shift=3)
    table = dense_step_table(residual, k)
    steps = -(-k // 128)
    assert table.shape == (-(-n // 64), steps + 1) and table.dtype == torch.int32
    for i in range(table.shape[0]):
        kept = set()
        for bi, c in residual.coords.tolist():
            if bi == i:
                kept |= {c * 2, c * 2 + 1}
        want = [s for s in range(steps) if s not in kept]
        count = int(table[i, 0])
        assert count == len(want) and table[i, 1:1 + count].tolist() == want, f"block row {i}"


@needs_triton()
@pytest.mark.parametrize("walk", ["shifted", "merged"])
@pytest.mark.parametrize("m,n,k,block,fraction,opts", [
    (13, 200, 300, (128, 128), 0.5, dict(block_n=128, block_m=64)),     # ragged N and K, prefill tiles
    (67, 130, 640, (64, 256), 0.4, dict(block_n=128, block_m=64)),      # block rows of 64: the tile shrinks
    (5, 96, 1000, (32, 128), 1.0, dict(block_n=128, block_m=64)),       # every block kept, K not a multiple of 128
    (29, 130, 1000, (64, 256), 0.5, dict(block_n=64, block_m=32, split_k=3, num_warps=4)),  # split K
    (40, 256, 512, (128, 128), 0.3, dict(block_n=128, block_m=16, rem_split=4)),  # whole tiles and split ones
])
def test_walks_match_zipper_reference(walk, m, n, k, block, fraction, opts):
    gen, qweight, w_scale, residual = pow2_layer(n, k, block, fraction, seed=m * n, max_shift=3)
    x = random_activations(m, k, gen)
    bias = torch.randn(n, generator=gen)
    packed, scale = quantize_activations_reference(x)
    ref = zipper_gemm_reference(packed, scale, qweight, w_scale, k, residual, bias, out_fp32=True)
    assert_residual_matters(packed, scale, qweight, w_scale, k, bias, ref)
    a8, s8 = quantize_activations_triton(x.to(DEVICE), layout="split8")
    qweight, w_scale, bias, residual = qweight.to(DEVICE), w_scale.to(DEVICE), bias.to(DEVICE), residual.to(DEVICE)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    w4a4_gemm_swapped_triton(a8, s8, qweight, w_scale, k, bias, residual=residual, residual_walk=walk, out=out, **opts)
    assert_close_bf16(out, ref, f"{walk} walk M={m} N={n} K={k} blocks {block} {opts}")
    # the same integer sums as the shared walk: the same bits
    shared = w4a4_gemm_swapped_triton(a8, s8, qweight, w_scale, k, bias, residual=residual, residual_walk="shared",
                                      **opts)
    assert torch.equal(out, shared)


@needs_triton()
def test_merged_walk_refuses_what_it_cannot_take():
    gen, qweight, w_scale, residual = pow2_layer(200, 300, (128, 128), 0.5, seed=5, max_shift=4)
    a8, s8 = quantize_activations_triton(random_activations(13, 300, gen).to(DEVICE), layout="split8")
    qweight, w_scale, residual = qweight.to(DEVICE), w_scale.to(DEVICE), residual.to(DEVICE)
    assert int(residual_shifts(residual, w_scale).max()) == 4
    with pytest.raises(UserInputError, match=r"residual_walk='merged' takes residual scales s_w \* 2\^-j with j <= 3; "
                                             r"these have j up to 4"):
        w4a4_gemm_swapped_triton(a8, s8, qweight, w_scale, 300, residual=residual, residual_walk="merged")
    with pytest.raises(UserInputError, match="block_kp must be 64, got 128"):
        w4a4_gemm_swapped_triton(a8, s8, qweight, w_scale, 300, residual=residual, residual_walk="merged",
                                 block_kp=128)
    with pytest.raises(UserInputError, match="residual_walk='merged' needs x16=True"):
        w4a4_gemm_swapped_triton(a8, s8, qweight, w_scale, 300, residual=residual, residual_walk="merged", x16=False)
    with pytest.raises(UserInputError, match="dense_steps"):
        shifts = residual_shifts(residual, w_scale).clamp(max=3)
        w4a4_gemm_swapped_triton(a8, s8, qweight, w_scale, 300, residual=residual, residual_walk="merged",
                                 residual_shifts=shifts,
                                 residual_operand=torch.zeros(residual.num_blocks, 128, 128, dtype=torch.int8,
                                                              device=DEVICE),
                                 dense_steps=torch.zeros(2, 5, dtype=torch.int32, device=DEVICE))


@needs_triton()
def test_quant_linear_runs_the_merged_walk_where_the_shifts_allow(monkeypatch, tile_table):
    import mosaicquant.kernels.quant_linear as ql
    from mosaicquant.kernels.quant_linear import QuantLinear

    from ._helpers import pow2_layers

    gen = torch.Generator().manual_seed(12)
    n, k = 256, 640
    _, merged_packed, _ = pow2_layers(n, k, (128, 128), 0.3, gen, bias=True, max_shift=3)
    _, shared_packed, _ = pow2_layers(n, k, (128, 128), 0.3, gen, bias=True, max_shift=4)
    layer = QuantLinear(merged_packed).to(DEVICE)
    other = QuantLinear(shared_packed).to(DEVICE)
    assert layer.res_merged is not None and other.res_merged is None
    assert layer.res_merged.shape == (layer.res_coords.shape[0], 128, 128)
    # the merged copies are counted: resident beside the format
    nbytes = layer.weight_nbytes()
    assert nbytes["exec_operands"] == layer.res_merged.numel() + 4 * layer.res_steps.numel()
    assert other.weight_nbytes()["exec_operands"] == 0
    x = random_activations(40, k, gen).to(DEVICE)
    a8, s8 = quantize_activations_triton(x, layout="split8")
    walks = []
    real = ql.w4a4_gemm_swapped_triton
    monkeypatch.setattr(ql, "w4a4_gemm_swapped_triton",
                        lambda *a, **kw: walks.append(kw.get("residual_walk")) or real(*a, **kw))
    got = layer.forward_split8(a8, s8)
    other.forward_split8(a8, s8)
    tile_table(merged_walk=False)
    shared = layer.forward_split8(a8, s8)
    assert walks == ["merged", "shared", "shared"]
    assert torch.equal(got, shared)
    packed, scale = quantize_activations_reference(x.cpu())
    ref = zipper_gemm_reference(packed, scale, merged_packed.qweight, merged_packed.scales.reshape(-1), k,
                                merged_packed.residual, merged_packed.bias, out_fp32=True)
    assert_close_bf16(got, ref, "QuantLinear, merged walk")

