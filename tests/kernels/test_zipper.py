import pytest
import torch

from mosaicquant.errors import UserInputError
from mosaicquant.kernels._tiles import TileConfig, fit_to_blocks
from mosaicquant.kernels.act_quant import quantize_activations_reference
from mosaicquant.kernels.tile_table import TileTable
from mosaicquant.kernels.residual_gemm import residual_add_reference, residual_add_triton
from mosaicquant.kernels.w4a4_gemm import w4a4_gemm_reference
from mosaicquant.kernels.zipper import residual_block_map, zipper_gemm, zipper_gemm_reference, zipper_gemm_triton
from mosaicquant.methods.format import PackedW4, ResidualBlocks, unpack_int4

from ._helpers import (
    DEVICE,
    assert_close_bf16,
    assert_residual_matters,
    needs_triton,
    random_activations,
    random_layer,
    random_residual,
)

CPU = torch.device("cpu")

SPLIT = TileConfig(block_m=16, block_n=32, block_kp=32, split_k=2, num_stages=2)
# K steps wider than a residual block column: the tail walk steps through each block on its own
WIDE_STEP = TileConfig(block_m=16, block_n=64, block_kp=64, num_stages=2)


def _case(m, n, k, block, fraction, seed):
    gen = torch.Generator().manual_seed(seed)
    x = random_activations(m, k, gen)
    a_packed, a_scale = quantize_activations_reference(x)
    _, qweight, w_scale = random_layer(n, k, gen)
    residual = random_residual(n, k, block, fraction, gen)
    bias = torch.randn(n, generator=gen)
    return a_packed, a_scale, qweight, w_scale, residual, bias


def _dev(residual):
    return residual.to(DEVICE)


@needs_triton()
@pytest.mark.parametrize("m,n,k,block", [(1, 200, 300, (64, 64)), (13, 77, 257, (32, 64)), (67, 130, 1000, (64, 128))])
@pytest.mark.parametrize("mode", ["inline", "tail"])
def test_fused_matches_reference(m, n, k, block, mode):
    a_packed, a_scale, qweight, w_scale, residual, bias = _case(m, n, k, block, 0.3, seed=m + n)
    ref = zipper_gemm_reference(a_packed, a_scale, qweight, w_scale, k, residual, bias, out_fp32=True)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    zipper_gemm_triton(
        a_packed.to(DEVICE), a_scale.to(DEVICE), qweight.to(DEVICE), w_scale.to(DEVICE), k, _dev(residual),
        bias.to(DEVICE), mode=mode, out=out,
    )
    assert_close_bf16(out, ref, f"zipper {mode} {m}x{n}x{k}")
    assert_residual_matters(a_packed, a_scale, qweight, w_scale, k, bias, ref)


@needs_triton()
@pytest.mark.parametrize("mode", ["inline", "tail"])
def test_fused_split_k(mode):
    m, n, k = 13, 96, 520
    a_packed, a_scale, qweight, w_scale, residual, bias = _case(m, n, k, (32, 64), 0.4, seed=11)
    ref = zipper_gemm_reference(a_packed, a_scale, qweight, w_scale, k, residual, bias, out_fp32=True)
    out = zipper_gemm_triton(
        a_packed.to(DEVICE), a_scale.to(DEVICE), qweight.to(DEVICE), w_scale.to(DEVICE), k, _dev(residual),
        bias.to(DEVICE), mode=mode, config=SPLIT,
    )
    assert_close_bf16(out, ref, f"zipper split-K {mode}")


@needs_triton()
def test_unfused_pipeline_matches_fused_reference():
    m, n, k = 13, 130, 333
    a_packed, a_scale, qweight, w_scale, residual, bias = _case(m, n, k, (64, 64), 0.3, seed=12)
    ref = zipper_gemm_reference(a_packed, a_scale, qweight, w_scale, k, residual, bias, out_fp32=True)
    dense = w4a4_gemm_reference(a_packed, a_scale, qweight, w_scale, k, bias, out_fp32=True)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    residual_add_triton(a_packed.to(DEVICE), a_scale.to(DEVICE), dense.to(DEVICE), _dev(residual), k, out=out)
    assert_close_bf16(out, ref, "unfused")
    assert_close_bf16(residual_add_reference(a_packed, a_scale, dense, residual, k), ref, "unfused reference")


def test_reference_equals_dequantized_weight():
    m, n, k = 5, 70, 150
    a_packed, a_scale, qweight, w_scale, residual, bias = _case(m, n, k, (32, 64), 0.3, seed=13)
    w = PackedW4((n, k), qweight, w_scale.reshape(n, 1), residual=residual).dequantize()
    x_hat = unpack_int4(a_packed, k).float() * a_scale[:, None]
    expect = x_hat @ w.T + bias
    got = zipper_gemm(a_packed, a_scale, qweight, w_scale, k, residual, bias, kernel="torch")
    assert_close_bf16(got, expect, "zipper reference vs dequantized weight")


def test_block_map_indexes_kept_blocks():
    gen = torch.Generator().manual_seed(14)
    residual = random_residual(100, 200, (32, 64), 0.5, gen)
    block_map = residual_block_map(residual)
    assert block_map.shape == residual.grid
    kept = (block_map >= 0).nonzero()
    assert torch.equal(kept.to(torch.int32), residual.coords)
    assert torch.equal(block_map[kept[:, 0], kept[:, 1]], torch.arange(residual.num_blocks, dtype=torch.int32))


def test_bad_residual_and_mode_raise():
    a_packed, a_scale, qweight, w_scale, residual, _ = _case(3, 64, 128, (32, 64), 0.3, seed=15)
    other = ResidualBlocks.empty((64, 256), (32, 64))
    with pytest.raises(UserInputError, match=r"residual is for a \(64, 256\) layer"):
        zipper_gemm(a_packed, a_scale, qweight, w_scale, 128, other, kernel="torch")
    with pytest.raises(UserInputError, match="mode='zip'"):
        zipper_gemm(a_packed, a_scale, qweight, w_scale, 128, residual, kernel="torch", mode="zip")


def test_hand_built_blocks_whose_indices_are_out_of_place_are_refused():
    # the kernels follow coords and row_ptr without bounds checks: they are checked once, as the blocks are built
    import dataclasses

    residual = _case(3, 64, 128, (32, 64), 0.5, seed=1)[4]
    assert residual.coords.tolist() == [[0, 0], [1, 1]] and residual.row_ptr.tolist() == [0, 1, 2]
    cases = [
        ({"coords": torch.tensor([[0, 5], [1, 1]], dtype=torch.int32)}, r"block 0 at \(i, j\) = \(0, 5\) is outside the 2x2"),
        ({"coords": torch.tensor([[0, 0], [-1, 1]], dtype=torch.int32)}, r"block 1 .* is outside"),
        ({"coords": torch.tensor([[1, 1], [0, 0]], dtype=torch.int32)}, "block-row-major order"),
        ({"coords": torch.tensor([[1, 1], [1, 1]], dtype=torch.int32)}, "without repeats"),
        ({"row_ptr": torch.tensor([0, 1, 4], dtype=torch.int32)}, r"row_ptr\[2\] = 4, but the 2 kept blocks' rows give 2"),
        ({"row_ptr": torch.tensor([1, 1, 2], dtype=torch.int32)}, r"row_ptr\[0\] = 1"),
        ({"row_ptr": torch.tensor([0, 2], dtype=torch.int32)}, r"row_ptr must have shape \[3\]"),
        ({"coords": torch.tensor([[0.0, 0.0], [1.0, 1.0]])}, "coords must be an integer tensor"),
    ]
    for change, match in cases:
        with pytest.raises(UserInputError, match=match):
            dataclasses.replace(residual, **change)
        with pytest.raises(UserInputError, match=match):
            ResidualBlocks(residual.shape, residual.block_shape, **{**dict(
                coords=residual.coords, row_ptr=residual.row_ptr, values=residual.values, scales=residual.scales),
                **change})
    # check=False skips the indices' values (views of blocks already checked), not the launchers' checks
    unchecked = ResidualBlocks(residual.shape, residual.block_shape, residual.coords,
                               torch.tensor([0, 1, 4], dtype=torch.int32), residual.values, residual.scales, check=False)
    with pytest.raises(UserInputError, match=r"row_ptr\[2\] = 4"):
        unchecked.validate()


@needs_triton()
def test_residual_and_block_map_on_another_device_are_refused():
    a_packed, a_scale, qweight, w_scale, residual, bias = _case(3, 64, 128, (32, 64), 0.5, seed=1)
    ops = [t.to(DEVICE) for t in (a_packed, a_scale, qweight, w_scale)]
    meta = residual.to("meta")  # no data: a device no operand is on
    with pytest.raises(UserInputError, match=r"the residual must be on the operands' device .*residual.values on meta"):
        zipper_gemm_triton(*ops, 128, meta, bias.to(DEVICE))
    with pytest.raises(UserInputError, match="residual.values on meta"):
        zipper_gemm_reference(a_packed, a_scale, qweight, w_scale, 128, meta)
    dense = torch.zeros(3, 64, device=DEVICE)
    with pytest.raises(UserInputError, match="residual.values on meta"):
        residual_add_triton(ops[0], ops[1], dense, meta, 128)
    block_map = residual_block_map(residual)
    with pytest.raises(UserInputError, match="block_map must be contiguous and on the operands' device"):
        zipper_gemm_triton(*ops, 128, _dev(residual), mode="inline", block_map=block_map.to("meta"))
    wide = torch.cat([block_map, block_map], 1).to(DEVICE)[:, :2]  # rows 4 entries apart
    with pytest.raises(UserInputError, match=r"block_map must be contiguous .* strides \(4, 1\)"):
        zipper_gemm_triton(*ops, 128, _dev(residual), mode="inline", block_map=wide)
    with pytest.raises(UserInputError, match="block_map has dtype int64"):
        zipper_gemm_triton(*ops, 128, _dev(residual), mode="inline", block_map=block_map.long().to(DEVICE))

@needs_triton()
def test_scales_whose_entries_are_not_consecutive_are_refused():
    # an [N, 1] slice of a wider tensor: its entries are 2 apart, the kernel reads them as consecutive
    a_packed, a_scale, qweight, w_scale, residual, _ = _case(3, 64, 128, (32, 64), 0.5, seed=1)
    # made on the device: .to() of a tensor with gaps between its entries returns a contiguous copy
    w_dev = w_scale.to(DEVICE)
    strided = torch.stack([w_dev, 2 * w_dev], 1)[:, :1]
    assert strided.stride() == (2, 1)
    with pytest.raises(UserInputError, match=r"w_scale's 64 entries must be consecutive.*strides \(2, 1\)"):
        zipper_gemm_triton(a_packed.to(DEVICE), a_scale.to(DEVICE), qweight.to(DEVICE), strided, 128,
                           _dev(residual))


@needs_triton()
@pytest.mark.parametrize("mode", ["inline", "tail"])
def test_sixteen_q_unpacking_is_bit_equal_to_the_plain_unpacking(mode):
    m, n, k = 13, 96, 520
    a_packed, a_scale, qweight, w_scale, residual, bias = _case(m, n, k, (32, 64), 0.4, seed=12)
    dev = [t.to(DEVICE) for t in (a_packed, a_scale, qweight, w_scale)]
    outs = [zipper_gemm_triton(*dev, k, _dev(residual), bias.to(DEVICE), mode=mode, config=SPLIT, x16=x16, out_fp32=True)
            for x16 in (False, True)]
    assert torch.equal(outs[0], outs[1])
    ref = zipper_gemm_reference(a_packed, a_scale, qweight, w_scale, k, residual, bias, out_fp32=True)
    assert_close_bf16(outs[1], ref, f"zipper x16 {mode}")


@needs_triton()
@pytest.mark.parametrize("m,n,k,block,config", [
    (1, 200, 304, (64, 64), None),     # ragged last block row and column
    (6, 96, 520, (32, 64), SPLIT),     # blocks dealt over two K splits
    (8, 130, 1024, (64, 128), None),
    (4, 128, 520, (64, 64), WIDE_STEP),  # dense steps of 128 K over blocks of 64 columns
])
def test_dp4a_residual_walk_matches_reference(m, n, k, block, config):
    a_packed, a_scale, qweight, w_scale, residual, bias = _case(m, n, k, block, 0.3, seed=m + k)
    ref = zipper_gemm_reference(a_packed, a_scale, qweight, w_scale, k, residual, bias, out_fp32=True)
    for walk in ("dot", "dp4a"):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        zipper_gemm_triton(a_packed.to(DEVICE), a_scale.to(DEVICE), qweight.to(DEVICE), w_scale.to(DEVICE), k,
                           _dev(residual), bias.to(DEVICE), mode="tail", out=out, config=config, residual_walk=walk)
        assert_close_bf16(out, ref, f"zipper {walk} walk {m}x{n}x{k}")
    assert_residual_matters(a_packed, a_scale, qweight, w_scale, k, bias, ref)


@needs_triton()
@pytest.mark.parametrize("m,n,k,block,fraction,seed,config,what", [
    # 192-column blocks are 96 packed bytes: the walk steps 32 bytes at a time under 64-byte dense steps
    (5, 64, 400, (32, 192), 0.5, 21, TileConfig(block_m=16, block_n=32, block_kp=64, num_stages=2),
     "192-column blocks"),
    # the tiles ZipperEngine's wide layers take at 17-32 tokens (WIDE_DECODE_MAX_M): 32 rows, 128 channels,
    # 128-byte K steps over 64-byte block columns; ragged M, N and K
    (27, 300, 1000, (128, 128), 0.3, 17, TileConfig(block_m=32, block_n=128, block_kp=128, num_warps=8,
                                                    num_stages=3), "32 x 128 tiles"),
])
def test_tail_walk_on_tiles_that_do_not_nest_in_a_block_column(m, n, k, block, fraction, seed, config, what):
    a_packed, a_scale, qweight, w_scale, residual, bias = _case(m, n, k, block, fraction, seed=seed)
    ref = zipper_gemm_reference(a_packed, a_scale, qweight, w_scale, k, residual, bias, out_fp32=True)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    zipper_gemm_triton(a_packed.to(DEVICE), a_scale.to(DEVICE), qweight.to(DEVICE), w_scale.to(DEVICE), k,
                       _dev(residual), bias.to(DEVICE), mode="tail", out=out, residual_walk="dot", config=config)
    assert_close_bf16(out, ref, f"zipper tail walk, {what}")
    assert_residual_matters(a_packed, a_scale, qweight, w_scale, k, bias, ref)


@needs_triton()
@pytest.mark.parametrize("m,n,k,block,config", [
    # tiles of half a block row; the last block row (rows 192-255) reaches past the last tile (160-199)
    (1, 200, 300, (64, 64), TileConfig(block_m=16, block_n=32, block_kp=32, split_k=2, num_stages=2)),
    (5, 96, 520, (32, 64), SPLIT),   # a ragged last block column; two dense splits
    (13, 130, 1000, (64, 128), WIDE_STEP),  # K steps wider than a block column
])
@pytest.mark.parametrize("mode", ["parallel", "parallel_rows"])
def test_parallel_residual_programs_match_reference(m, n, k, block, config, mode):
    # the kept blocks run in programs of their own, summed into the dense tiles' counted fix-up
    a_packed, a_scale, qweight, w_scale, residual, bias = _case(m, n, k, block, 0.4, seed=m + n + 1)
    assert int(residual.row_ptr[-1] - residual.row_ptr[-2]) > 0  # the last block row keeps blocks
    ref = zipper_gemm_reference(a_packed, a_scale, qweight, w_scale, k, residual, bias, out_fp32=True)
    for rep in range(2):  # the tile counters are back at zero after a launch
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        zipper_gemm_triton(a_packed.to(DEVICE), a_scale.to(DEVICE), qweight.to(DEVICE), w_scale.to(DEVICE), k,
                           _dev(residual), bias.to(DEVICE), mode=mode, out=out, config=config)
        assert_close_bf16(out, ref, f"zipper {mode} {m}x{n}x{k} run {rep}")
    assert_residual_matters(a_packed, a_scale, qweight, w_scale, k, bias, ref)
    empty = ResidualBlocks.empty((n, k), block, device=DEVICE)  # no kept block: the dense GEMM alone
    got = zipper_gemm_triton(a_packed.to(DEVICE), a_scale.to(DEVICE), qweight.to(DEVICE), w_scale.to(DEVICE), k,
                             empty, bias.to(DEVICE), mode=mode, config=config)
    dense = w4a4_gemm_reference(a_packed, a_scale, qweight, w_scale, k, bias, out_fp32=True)
    assert_close_bf16(got, dense, f"zipper {mode}, no kept block")


@needs_triton()
def test_parallel_rows_mode_counts_only_rows_that_keep_blocks():
    # block rows with and without kept blocks side by side: a tile's fix-up expects the row's partial
    # only where the row keeps one
    m, n, k, block = 6, 256, 512, (64, 64)
    a_packed, a_scale, qweight, w_scale, residual, bias = _case(m, n, k, block, 0.1, seed=21)
    per_row = torch.diff(residual.row_ptr.long())
    assert (per_row == 0).any() and (per_row > 0).any(), per_row
    ref = zipper_gemm_reference(a_packed, a_scale, qweight, w_scale, k, residual, bias, out_fp32=True)
    for rep in range(2):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        zipper_gemm_triton(a_packed.to(DEVICE), a_scale.to(DEVICE), qweight.to(DEVICE), w_scale.to(DEVICE), k,
                           _dev(residual), bias.to(DEVICE), mode="parallel_rows", out=out, config=SPLIT)
        assert_close_bf16(out, ref, f"zipper parallel_rows, rows with and without blocks, run {rep}")


@needs_triton()
@pytest.mark.parametrize("config", [SPLIT, TileConfig(block_m=16, block_n=64, block_kp=64, num_stages=2)])
@pytest.mark.parametrize("mode", ["parallel", "parallel_rows"])
def test_gated_call_writes_silu_mul_of_its_gate_and_up_halves(mode, config):
    # stacked [gate | up] (I = 128 each): the fix-up of each gate tile and its up tile writes
    # bf16(silu(g)) * u, the same bits as the GEMM's BF16 output followed by the SiLU*mul kernel
    from mosaicquant.kernels.decoder import silu_mul, silu_mul_reference

    m, n, k, block = 6, 256, 512, (64, 64)
    a_packed, a_scale, qweight, w_scale, residual, bias = _case(m, n, k, block, 0.15, seed=31)
    per_row = torch.diff(residual.row_ptr.long())
    assert (per_row == 0).any() and (per_row > 0).any(), per_row
    args = (a_packed.to(DEVICE), a_scale.to(DEVICE), qweight.to(DEVICE), w_scale.to(DEVICE), k, _dev(residual),
            bias.to(DEVICE))
    plain = zipper_gemm_triton(*args, mode=mode, config=config, out_fp32=True)
    # torch rounds fp32 to BF16 to nearest even, as the GPU's conversion does
    want = silu_mul(plain.to(torch.bfloat16), kernel="triton")
    ref = zipper_gemm_reference(a_packed, a_scale, qweight, w_scale, k, residual, bias, out_fp32=True)
    for rep in range(2):  # the pair counters are back at zero after a launch
        out = torch.full((m, n // 2), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        zipper_gemm_triton(*args, mode=mode, config=config, out=out, gated=True)
        assert torch.equal(out, want), f"gated {mode} run {rep}: {(out != want).sum()} of {out.numel()} differ"
        assert_close_bf16(out, silu_mul_reference(ref.to(torch.bfloat16)).float(), f"gated {mode} run {rep}")
    no_res = ResidualBlocks.empty((n, k), block, device=DEVICE)
    dense = zipper_gemm_triton(*args[:5], no_res, args[6], mode=mode, config=config, out_fp32=True)
    got = zipper_gemm_triton(*args[:5], no_res, args[6], mode=mode, config=config, gated=True)
    assert torch.equal(got, silu_mul(dense.to(torch.bfloat16), kernel="triton")), "gated, no kept block"
    torch_path = zipper_gemm(a_packed, a_scale, qweight, w_scale, k, residual, bias, kernel="torch", gated=True)
    assert torch.equal(torch_path, silu_mul_reference(zipper_gemm_reference(a_packed, a_scale, qweight, w_scale, k,
                                                                            residual, bias)))


@needs_triton()
def test_gated_call_refuses_what_it_cannot_take():
    a_packed, a_scale, qweight, w_scale, residual, bias = _case(4, 256, 256, (64, 64), 0.3, seed=5)
    args = (a_packed.to(DEVICE), a_scale.to(DEVICE), qweight.to(DEVICE), w_scale.to(DEVICE), 256, _dev(residual))
    with pytest.raises(UserInputError, match="mode 'tail' has no counted fix-up"):
        zipper_gemm_triton(*args, mode="tail", gated=True, config=SPLIT)
    with pytest.raises(UserInputError, match="writes BF16"):
        zipper_gemm_triton(*args, mode="parallel", gated=True, out_fp32=True, config=SPLIT)
    a2, s2, q2, w2, r2, _ = _case(4, 192, 256, (64, 64), 0.3, seed=6)  # halves of 96: not whole 64-row blocks
    with pytest.raises(UserInputError, match="N=192 is not two halves"):
        zipper_gemm_triton(a2.to(DEVICE), s2.to(DEVICE), q2.to(DEVICE), w2.to(DEVICE), 256, _dev(r2),
                           mode="parallel", gated=True, config=SPLIT)


def test_parallel_mode_refuses_more_tokens_than_one_tile():
    a_packed, a_scale, qweight, w_scale, residual, _ = _case(17, 64, 128, (64, 64), 0.3, seed=3)
    dev = [t.to(DEVICE) for t in (a_packed, a_scale, qweight, w_scale)]
    with pytest.raises(UserInputError, match="mode='parallel' runs one tensor-core tile of 16 tokens"):
        zipper_gemm_triton(*dev, 128, _dev(residual), mode="parallel",
                           config=TileConfig(block_m=16, block_n=32, block_kp=32))


def test_auto_mode_runs_the_parallel_residual_where_measured_faster():
    from mosaicquant.kernels._tiles import parallel_residual

    assert parallel_residual(4, TileConfig(block_m=16, block_n=64, block_kp=64, split_k=4), device=CPU)  # q/k/v
    assert parallel_residual(16, TileConfig(block_m=16, block_n=128, block_kp=128, split_k=1), device=CPU)  # gate/up
    assert not parallel_residual(2, TileConfig(block_m=16, block_n=128, block_kp=128, split_k=1), device=CPU)
    assert not parallel_residual(8, TileConfig(block_m=16, block_n=64, block_kp=64, split_k=8), device=CPU)  # o, down
    assert not parallel_residual(32, TileConfig(block_m=32, block_n=64, block_kp=64, split_k=2), device=CPU)
    o_split4 = TileConfig(block_m=16, block_n=64, block_kp=64, split_k=4)
    assert parallel_residual(8, o_split4, 3.2, device=CPU)  # o_proj at 10 %: ~3 kept blocks per block row
    assert not parallel_residual(8, o_split4, 11.2, device=CPU)  # down_proj: ~11 partials a tile to sum


def test_auto_mode_takes_the_parallel_mode_the_constant_names(monkeypatch, tile_table):
    from mosaicquant.kernels import _tiles

    wide = TileConfig(block_m=16, block_n=128, block_kp=128, split_k=1)  # gate/up
    split4 = TileConfig(block_m=16, block_n=64, block_kp=64, split_k=4)  # q/k/v
    tile_table(parallel_rows_max_split=1)
    assert (_tiles.parallel_mode(wide, device=CPU), _tiles.parallel_mode(split4, device=CPU)) == ("parallel_rows", "parallel")
    tile_table(parallel_rows_max_split=0)
    assert _tiles.parallel_mode(wide, device=CPU) == "parallel"


def test_tail_mode_keeps_k_steps_wider_than_a_block():
    # the inline mode needs each K step inside one block column; the tail walk does not
    assert fit_to_blocks(WIDE_STEP, (64, 64)).block_kp == 32
    assert fit_to_blocks(WIDE_STEP, (64, 64), nest_k=False) == WIDE_STEP
    assert fit_to_blocks(WIDE_STEP, (32, 64), nest_k=False).block_n == 32


@needs_triton()
def test_dp4a_residual_walk_refuses_what_it_cannot_take():
    m, n, k = 9, 64, 256
    a_packed, a_scale, qweight, w_scale, residual, _ = _case(m, n, k, (32, 64), 0.3, seed=3)
    args = (a_packed.to(DEVICE), a_scale.to(DEVICE), qweight.to(DEVICE), w_scale.to(DEVICE), k, _dev(residual))
    with pytest.raises(UserInputError, match="1 to 8"):
        zipper_gemm_triton(*args, residual_walk="dp4a")
    few = (args[0][:4], args[1][:4], *args[2:])
    with pytest.raises(UserInputError, match="no tail walk"):
        zipper_gemm_triton(*few, mode="inline", residual_walk="dp4a")
    with pytest.raises(UserInputError, match="residual_walk='fp8'"):
        zipper_gemm_triton(*args, residual_walk="fp8")


@needs_triton()
@pytest.mark.parametrize("mode,m", [("tail", 8), ("tail", 24), ("parallel_rows", 8)])
def test_walk_pipelining_depth_writes_the_same_bits(monkeypatch, mode, m, tile_table):
    # WALK_STAGES only changes how the kept blocks' loads are buffered, never a result; heavy rows
    # (several blocks each) so the walk loops more than once per program
    from mosaicquant.kernels import _tiles

    assert _tiles.walk_stages(TileTable().walk_stages_min_m - 1, device=CPU) is None
    n, k, block = 256, 1024, (128, 128)
    a_packed, a_scale, qweight, w_scale, residual, bias = _case(m, n, k, block, 0.5, seed=43)
    assert torch.diff(residual.row_ptr.long()).max() >= 3
    args = (a_packed.to(DEVICE), a_scale.to(DEVICE), qweight.to(DEVICE), w_scale.to(DEVICE), k, _dev(residual),
            bias.to(DEVICE))
    config = (TileConfig(block_m=16, block_n=128, block_kp=128, num_warps=8, num_stages=3) if mode == "parallel_rows"
              else TileConfig(block_m=16 if m <= 16 else 32, block_n=64, block_kp=128, split_k=2, num_stages=3))
    ref = zipper_gemm_reference(a_packed, a_scale, qweight, w_scale, k, residual, bias, out_fp32=True)
    tile_table(walk_stages_min_m=1)
    outs = {}
    for stages in (0, 5):
        tile_table(walk_stages=stages)
        outs[stages] = zipper_gemm_triton(*args, mode=mode, config=config, residual_walk="dot")
        assert_close_bf16(outs[stages], ref, f"zipper {mode}, WALK_STAGES={stages}")
    assert torch.equal(outs[0], outs[5]), f"{(outs[0] != outs[5]).sum()} of {outs[0].numel()} differ"


@needs_triton()
@pytest.mark.parametrize("m,split", [(8, 2), (24, 3)])
def test_walk_preload_writes_the_same_bits(monkeypatch, m, split, tile_table):
    # WALK_PRELOAD_MAX_M loads each program's first kept block before the dense loop; rows with none, one or several
    # blocks, a ragged K (the last block column ends early) and more splits than some rows have blocks

    n, k, block = 384, 1000, (128, 128)
    a_packed, a_scale, qweight, w_scale, residual, bias = _case(m, n, k, block, 0.3, seed=47)
    per_row = torch.diff(residual.row_ptr.long())
    assert per_row.max() >= split and per_row.min() < split
    args = (a_packed.to(DEVICE), a_scale.to(DEVICE), qweight.to(DEVICE), w_scale.to(DEVICE), k, _dev(residual),
            bias.to(DEVICE))
    config = TileConfig(block_m=16 if m <= 16 else 32, block_n=64, block_kp=128, split_k=split, num_stages=3)
    ref = zipper_gemm_reference(a_packed, a_scale, qweight, w_scale, k, residual, bias, out_fp32=True)
    outs = {}
    for preload in (False, True):
        tile_table(walk_preload_max_m=m if preload else 0)
        outs[preload] = zipper_gemm_triton(*args, mode="tail", config=config, residual_walk="dot")
        assert_close_bf16(outs[preload], ref, f"zipper tail, preload={preload}")
    assert torch.equal(outs[False], outs[True]), f"{(outs[False] != outs[True]).sum()} differ"


def _spy_kernel_constant(monkeypatch, name):
    """``_zipper_kernel``'s launches replaced by a spy: the returned list collects each launch's constant ``name``."""
    import importlib

    zmod = importlib.import_module("mosaicquant.kernels.zipper")
    seen = []

    class Spy:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append(kwargs[name])

    monkeypatch.setattr(zmod, "_zipper_kernel", Spy())
    return seen


@needs_triton()
@pytest.mark.parametrize("m,split,preload,k,fraction", [(8, 2, True, 1000, 0.3), (8, 2, True, 2000, 0.6),
                                                        (13, 3, False, 2000, 0.6)])
def test_tail_walk_programs_that_walk_no_block_or_several(monkeypatch, m, split, preload, k, fraction, tile_table):
    # the split tail walk: programs that walk no block (a row with fewer blocks than splits) or several, with and
    # without the first block preloaded (the walk then starts a block on)

    n, block = 384, (128, 128)
    a_packed, a_scale, qweight, w_scale, residual, bias = _case(m, n, k, block, fraction, seed=53)
    per_row = torch.diff(residual.row_ptr.long())
    if fraction < 0.5:
        assert per_row.min() < split
    else:  # every program walks at least two blocks in its loop (after the preloaded one, if any)
        assert per_row.min() >= (3 if preload else 2) * split
    args = (a_packed.to(DEVICE), a_scale.to(DEVICE), qweight.to(DEVICE), w_scale.to(DEVICE), k, _dev(residual),
            bias.to(DEVICE))
    config = TileConfig(block_m=16, block_n=64, block_kp=128, split_k=split, num_stages=3)
    ref = zipper_gemm_reference(a_packed, a_scale, qweight, w_scale, k, residual, bias, out_fp32=True)
    tile_table(walk_preload_max_m=m if preload else 0)
    out = zipper_gemm_triton(*args, mode="tail", config=config, residual_walk="dot")
    assert_close_bf16(out, ref, "zipper tail")


@needs_triton()
def test_walk_preload_applies_up_to_its_token_count(monkeypatch, tile_table):
    # the default rule: tail-walk calls of at most WALK_PRELOAD_MAX_M tokens preload, larger ones do not, and the
    # dp4a walk (no tensor-core walk to preload) does not; 0 switches it off

    seen = _spy_kernel_constant(monkeypatch, "WALK_PRELOAD")
    n, k, block = 256, 512, (128, 128)
    assert TileTable().walk_preload_max_m == 8
    for m, walk, expected in [(5, "dot", True), (8, "dot", True), (9, "dot", False), (4, "dp4a", False)]:
        a_packed, a_scale, qweight, w_scale, residual, _ = _case(m, n, k, block, 0.3, seed=m)
        zipper_gemm_triton(a_packed.to(DEVICE), a_scale.to(DEVICE), qweight.to(DEVICE), w_scale.to(DEVICE), k,
                           _dev(residual), mode="tail", residual_walk=walk)
        assert seen[-1] is expected, (m, walk, seen[-1])
    tile_table(walk_preload_max_m=0)
    zipper_gemm_triton(a_packed.to(DEVICE), a_scale.to(DEVICE), qweight.to(DEVICE), w_scale.to(DEVICE), k,
                       _dev(residual), mode="tail", residual_walk="dot")
    assert seen[-1] is False
