import pytest
import torch
import triton
import triton.language as tl

from mosaicquant.errors import UserInputError
from mosaicquant.kernels._tiles import TileConfig, fit_to_blocks, pick_config
from mosaicquant.kernels._tl import in_range
from mosaicquant.kernels.act_quant import quantize_activations_reference
from mosaicquant.kernels.w4a4_gemm import w4a4_gemm, w4a4_gemm_reference, w4a4_gemm_triton

from ._helpers import DEVICE, assert_close_bf16, needs_triton, random_activations, random_layer

# Big tiles keep the interpreter's program count low; split-K and a small tile cover the
# fix-up path and ragged edges.
CONFIGS = {
    "default": None,
    "split3": TileConfig(block_m=16, block_n=64, block_kp=32, split_k=3, num_stages=2),
    "fma": TileConfig(block_m=2, block_n=32, block_kp=64, split_k=2, num_stages=2, use_dot=False),
}


def _operands(m, n, k, seed, bias=True):
    gen = torch.Generator().manual_seed(seed)
    x = random_activations(m, k, gen)
    a_packed, a_scale = quantize_activations_reference(x)
    _, qweight, w_scale = random_layer(n, k, gen)
    b = torch.randn(n, generator=gen) if bias else None
    return a_packed, a_scale, qweight, w_scale, b


SHAPES = [(1, 100, 300), (13, 77, 257), (67, 130, 1000)]
# The CUDA-core path is meant for a handful of rows: M = 67 leaves it out.
CASES = [(m, n, k, c) for (m, n, k) in SHAPES for c in CONFIGS if not (c == "fma" and m > 13)]


@needs_triton()
@pytest.mark.parametrize("m,n,k,config", CASES)
def test_triton_matches_reference_on_ragged_shapes(m, n, k, config):
    cfg = CONFIGS[config]
    ops = _operands(m, n, k, seed=m + n + k)
    ref = w4a4_gemm_reference(*ops[:4], k, ops[4], out_fp32=True)
    dev = [t.to(DEVICE) for t in ops]
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    w4a4_gemm_triton(*dev[:4], k, dev[4], config=cfg, out=out)
    assert_close_bf16(out, ref, f"w4a4 {m}x{n}x{k} {config}")


@needs_triton()
def test_fp32_output_and_no_bias():
    m, n, k = 13, 70, 130
    ops = _operands(m, n, k, seed=5, bias=False)
    ref = w4a4_gemm_reference(*ops[:4], k, out_fp32=True)
    out = w4a4_gemm_triton(*[t.to(DEVICE) for t in ops[:4]], k, out_fp32=True)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@triton.jit
def _in_range_kernel(out_ptr, n, B: tl.constexpr):
    offs = tl.arange(0, B)
    tl.store(out_ptr + offs, in_range(offs, n))


@needs_triton()
@pytest.mark.parametrize("n", [1, 4, 17, 31, 32])
def test_out_of_range_tile_rows_read_distinct_rows_in_range(n):
    # the tiles' rows past the end (tokens past M, weight rows past N) load in-range rows, spread over them
    # (offs % n) rather than all on row 0, whose line would be requested once per such row by every program
    out = torch.full((32,), -1, dtype=torch.int64, device=DEVICE)
    _in_range_kernel[(1,)](out, n, B=32)
    got = out.cpu()
    assert torch.equal(got, torch.arange(32) % n)
    assert int(torch.bincount(got).max()) == -(-32 // n), "an in-range row read more often than the wrap needs"


def test_reference_equals_dequantized_matmul():
    m, n, k = 4, 9, 11
    gen = torch.Generator().manual_seed(6)
    x = random_activations(m, k, gen)
    a_packed, a_scale = quantize_activations_reference(x)
    q, qweight, w_scale = random_layer(n, k, gen)
    from mosaicquant.methods.format import unpack_int4

    expect = (unpack_int4(a_packed, k).float() * a_scale[:, None]) @ (q.float() * w_scale.float()[:, None]).T
    got = w4a4_gemm(a_packed, a_scale, qweight, w_scale, k, kernel="torch").float()
    assert_close_bf16(got, expect, "reference")


def test_tile_config_fits_residual_blocks():
    cfg = pick_config(8, 4096, 2048, torch.device("cpu"), residual_block=(48, 64))
    assert 48 % cfg.block_n == 0 and cfg.block_kp == 64  # rows nest; K steps may span block columns
    assert 32 % fit_to_blocks(cfg, (48, 64)).block_kp == 0  # the inline mode's K steps nest too
    with pytest.raises(UserInputError, match="cannot be tiled"):
        pick_config(8, 4096, 2048, torch.device("cpu"), residual_block=(40, 64))
    # 32 columns are 16 packed bytes: narrower than the compiled int8 dots' K of 32
    with pytest.raises(UserInputError, match="columns a multiple of 64"):
        pick_config(8, 4096, 2048, torch.device("cpu"), residual_block=(16, 32))
    with pytest.raises(UserInputError, match="block_m=24"):
        TileConfig(block_m=24, block_n=64, block_kp=64)


def test_bad_operands_raise_clear_errors():
    a_packed, a_scale, qweight, w_scale, _ = _operands(3, 8, 16, seed=7)
    with pytest.raises(UserInputError, match="group"):
        w4a4_gemm(a_packed, a_scale, qweight, torch.ones(8, 2, dtype=torch.float16), 16, kernel="torch")
    with pytest.raises(UserInputError, match=r"qweight must have shape \[\*, 8\]"):
        w4a4_gemm(a_packed, a_scale, qweight[:, :4], w_scale, 16, kernel="torch")
    with pytest.raises(UserInputError, match="a_packed has dtype int8"):
        w4a4_gemm(a_packed.view(torch.int8), a_scale, qweight, w_scale, 16, kernel="torch")
    with pytest.raises(UserInputError, match=r"a_scale must have shape \[3\]"):
        w4a4_gemm(a_packed, a_scale[:2], qweight, w_scale, 16, kernel="torch")


@pytest.mark.parametrize("kernel", ["torch", pytest.param("triton", marks=needs_triton())])
def test_an_odd_k_must_match_the_packed_weight(kernel):
    # K = 63 and 64 have the same packed width: the kernels multiply all 64 values, so a weight packed for 64
    # called with k=63 gave another result than the reference, which stops at 63
    a_packed, a_scale, qweight, w_scale, _ = [t.to(DEVICE) for t in _operands(4, 32, 64, seed=3)]
    with pytest.raises(UserInputError, match=r"k=63 does not match qweight: its 32 packed columns hold 64 values"):
        w4a4_gemm(a_packed, a_scale, qweight, w_scale, 63, kernel=kernel)
    # packed for 63 values (padding nibble 0): the reference's result
    ops = _operands(4, 32, 63, seed=3)
    qweight = ops[2].to(DEVICE)
    got = w4a4_gemm(ops[0].to(DEVICE), ops[1].to(DEVICE), qweight, ops[3].to(DEVICE), 63, kernel=kernel)
    assert_close_bf16(got, w4a4_gemm_reference(*ops[:4], 63, out_fp32=True), "k=63")
    # the padding is read once per weight tensor, and again once the tensor is written
    from mosaicquant.kernels.w4a4_gemm import _CHECKED_PADDING, _checked_before

    assert _checked_before(_CHECKED_PADDING, qweight)
    qweight[5, -1] |= 0x30
    assert not _checked_before(_CHECKED_PADDING, qweight)
    with pytest.raises(UserInputError, match="is not 0 in row 5"):
        w4a4_gemm(ops[0].to(DEVICE), ops[1].to(DEVICE), qweight, ops[3].to(DEVICE), 63, kernel=kernel)


@pytest.mark.parametrize("kernel", ["torch", pytest.param("triton", marks=needs_triton())])
def test_scales_whose_entries_are_not_consecutive_are_refused(kernel):
    # an [N, 1] slice of a wider tensor passes the last-dimension check (size 1), but its N entries are
    # 2 apart: the kernels read w_scale.reshape(-1) as N consecutive values
    a_packed, a_scale, qweight, w_scale, _ = [t.to(DEVICE) for t in _operands(3, 8, 16, seed=7)]
    strided = torch.stack([w_scale, 2 * w_scale], 1)[:, :1]
    with pytest.raises(UserInputError, match=r"w_scale's 8 entries must be consecutive.*strides \(2, 1\)"):
        w4a4_gemm(a_packed, a_scale, qweight, strided, 16, kernel=kernel)
    # an [N, 1] view of N consecutive values is taken, whatever the stride of its size-1 dimension
    column = torch.stack([w_scale, 2 * w_scale], 0).t()[:, :1]
    assert column.stride() == (1, 8)
    want = w4a4_gemm(a_packed, a_scale, qweight, w_scale, 16, kernel=kernel)
    assert torch.equal(w4a4_gemm(a_packed, a_scale, qweight, column, 16, kernel=kernel), want)


@needs_triton()
@pytest.mark.parametrize("config", ["default", "split3"])
def test_sixteen_q_unpacking_gives_the_plain_unpacking_result_exactly(config):
    # x16 (the default) unpacks nibbles as 16 q and rescales by 1/256 at the end: a power of two,
    # so every product, partial sum and rounding is the plain path's times 256 -- bit-equal output.
    # (Without a bias: on an unsplit tile the compiler fuses the plain path's last scale multiply with
    # the bias add into one rounding, where x16 rounds twice, as the PyTorch reference does.)
    m, n, k = 13, 130, 1000
    ops = [t.to(DEVICE) for t in _operands(m, n, k, seed=11)]
    plain = w4a4_gemm_triton(*ops[:4], k, config=CONFIGS[config], x16=False, out_fp32=True)
    x16 = w4a4_gemm_triton(*ops[:4], k, config=CONFIGS[config], x16=True, out_fp32=True)
    assert torch.equal(plain, x16)
    x16 = w4a4_gemm_triton(*ops[:4], k, ops[4], config=CONFIGS[config], x16=True, out_fp32=True)
    assert_close_bf16(x16, w4a4_gemm_reference(*[t.cpu() for t in ops[:4]], k, ops[4].cpu(), out_fp32=True), "x16")


def test_wide_dense_layers_take_unsplit_wide_tiles_at_decode_sizes(monkeypatch, tile_table):
    from mosaicquant.kernels import _tiles

    monkeypatch.setattr(_tiles, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    wide = pick_config(4, 28672, 2048, cuda)
    assert (wide.block_n, wide.block_kp, wide.split_k, wide.num_warps) == (128, 128, 1, 8)
    assert pick_config(4, 4096, 2048, cuda).block_n == 64  # o_proj: split-K instead
    zip_wide = pick_config(4, 28672, 2048, cuda, residual_block=(128, 128))  # ZipperEngine's tail walk: also wide
    assert (zip_wide.block_n, zip_wide.block_kp) == (128, 128)
    assert pick_config(4, 28672, 2048, cuda, residual_block=(64, 128)).block_n == 64  # rows nest in the blocks
    assert pick_config(32, 28672, 2048, cuda).block_kp == 64  # dense: none above 16 tokens (DENSE_WIDE_MAX_M)
    tile_table(dense_wide_max_m=32)
    assert pick_config(32, 28672, 2048, cuda).block_kp == 128
    # ZipperEngine's layers keep them up to 32 tokens, on 32-row tiles (WIDE_DECODE_MAX_M)
    zip32 = pick_config(32, 28672, 2048, cuda, residual_block=(128, 128))
    assert (zip32.block_m, zip32.block_n, zip32.block_kp, zip32.split_k, zip32.num_warps) == (32, 128, 128, 1, 8)
    tile_table(wide_decode_max_m=16)
    assert pick_config(32, 28672, 2048, cuda, residual_block=(128, 128)).block_n == 64


def test_decode_tile_depths_are_read_when_tiles_are_picked(monkeypatch, tile_table):
    # WIDE_DECODE_STAGES / WIDE_DECODE_BLOCK_KP / DECODE_STAGES: benchmarks/kernels/decode_depth.py varies them per call
    from mosaicquant.kernels import _tiles

    monkeypatch.setattr(_tiles, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    wide, narrow = pick_config(4, 28672, 2048, cuda), pick_config(4, 4096, 2048, cuda)
    assert (wide.num_stages, wide.block_kp, narrow.num_stages) == (3, 128, 4)  # the defaults
    tile_table(wide_decode_stages=5)
    tile_table(wide_decode_block_kp=256)
    tile_table(decode_stages=6)
    wide, narrow = pick_config(4, 28672, 2048, cuda), pick_config(4, 4096, 2048, cuda)
    assert (wide.block_n, wide.num_stages, wide.block_kp) == (128, 5, 256)
    assert (narrow.block_n, narrow.num_stages) == (64, 6)
    assert pick_config(40, 4096, 2048, cuda).num_stages == 6  # 17-64 tokens on the packed kernel's 64-channel tiles
    zip_wide = pick_config(4, 28672, 2048, cuda, residual_block=(128, 128))
    assert (zip_wide.num_stages, zip_wide.block_kp) == (5, 256)


def test_wide_dense_layers_keep_wide_tiles_up_to_the_dense_bound(monkeypatch, tile_table):
    # DENSE_WIDE_MAX_M: dense wide layers' calls of 17 tokens and more take the wide tiles (32-row tiles) up to it,
    # and QuantLinear then keeps them on the packed kernel instead of the swapped GEMM's decode tiles
    from mosaicquant.kernels import _tiles
    from mosaicquant.kernels.quant_linear import QuantLinear
    from mosaicquant.methods.format import PackedW4
    from mosaicquant.methods.quant import quantize

    monkeypatch.setattr(_tiles, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    tile_table(dense_wide_max_m=16)
    assert [_tiles.wide_decode(m, 28672, cuda, False) for m in (16, 17, 32)] == [True, False, False]
    assert pick_config(24, 28672, 2048, cuda).block_n == 64
    tile_table(dense_wide_max_m=32)
    assert [_tiles.wide_decode(m, 28672, cuda, False) for m in (16, 17, 32, 33)] == [True, True, True, False]
    assert not _tiles.wide_decode(24, 4096, cuda, False)  # o_proj: not wide
    # Qwen3-8B's gate/up: wide at 16 tokens, but too few 128-channel tiles a SM for the dense bound above 16
    assert [_tiles.wide_decode(m, 24576, cuda, False) for m in (16, 17)] == [True, False]
    assert _tiles.wide_decode(24, 24576, cuda, True)  # ZipperEngine's layers keep WIDE_DECODE_MAX_M's rule
    # Qwen3-14B's and Qwen3-32B's gate/up: more than two wide tiles a SM (a second wave) keep the swapped GEMM
    widths = (34816, 51200)
    assert [_tiles.wide_decode(m, n, cuda, False) for m in (16, 17) for n in widths] == [True, True, False, False]
    assert _tiles.wide_decode(17, 34816, cuda, True)  # (not ZipperEngine's layers)
    tile_table(dense_wide_max_tiles_per_sm=3.1)
    assert _tiles.wide_decode(17, 51200, cuda, False)
    tile_table(dense_wide_min_tiles_per_sm=1.4)
    assert _tiles.wide_decode(17, 24576, cuda, False)
    assert not _tiles.wide_decode(24, 28672, torch.device("cpu"), False)  # the interpreter's tiles
    wide = pick_config(24, 28672, 2048, cuda)
    assert (wide.block_m, wide.block_n, wide.block_kp, wide.split_k, wide.num_warps) == (32, 128, 128, 1, 8)
    # the route: a dense layer's wide call leaves the swapped decode tiles; the others keep them
    gen = torch.Generator().manual_seed(3)
    layer = QuantLinear(PackedW4.from_quantized(quantize(torch.randn(256, 128, generator=gen), 4)), kernel="triton")
    for on, routes in ((True, [None, None]), (False, ["decode", "decode"])):
        monkeypatch.setattr(_tiles, "wide_decode", lambda m, n, device, residual, on=on: on and m <= 32)
        assert [layer.swap_route(m) for m in (17, 32)] == routes, on


def test_dense_64_channel_layers_take_wide_k_steps_at_16_tokens(monkeypatch, tile_table):
    # as many K steps a program as the 64-byte tiles, four times the bytes a step (WIDE_K_DECODE_MIN_M)
    from mosaicquant.kernels import _tiles

    monkeypatch.setattr(_tiles, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    for n, kp, split in ((6144, 2048, 1), (4096, 2048, 2), (4096, 7168, 2)):  # q/k/v, o, down
        narrow = pick_config(8, n, kp, cuda)
        wide_k = pick_config(16, n, kp, cuda)
        assert (narrow.block_n, narrow.block_kp) == (64, 64)
        assert (wide_k.block_n, wide_k.block_kp, wide_k.split_k) == (64, 256, split), (n, kp, wide_k)
    # ZipperEngine: 128-byte steps at the same split for the tail walk of tiles split 8 ways (o, down),
    # above the dp4a walk's 4 tokens (TAIL_WIDE_K_MIN_M)
    for m, kp_step in ((4, 64), (5, 128), (16, 128), (17, 64)):
        zipper = pick_config(m, 4096, 7168, cuda, residual_block=(128, 128))
        assert (zipper.block_kp, zipper.split_k) == (kp_step, 8), (m, zipper)
    assert pick_config(8, 6144, 2048, cuda, residual_block=(128, 128)).block_kp == 64  # q/k/v: split 4
    tile_table(wide_k_decode_min_m=8)
    assert pick_config(8, 4096, 7168, cuda).block_kp == 256
    tile_table(wide_k_decode_min_m=0)
    assert pick_config(16, 4096, 7168, cuda).block_kp == 64


def test_decode_split_k_keeps_enough_k_steps_a_program(monkeypatch, tile_table):
    # from 17 tokens split-K stops before a program would keep fewer than DECODE_SPLIT_MIN_STEPS_17 (packed
    # kernel, 17-64 tokens) or SWAP_DECODE_SPLIT_MIN_STEPS (swapped GEMM's decode tiles) K steps
    from mosaicquant.kernels import _tiles

    monkeypatch.setattr(_tiles, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    res = (128, 128)
    layers = {"qkv": (6144, 2048), "o": (4096, 2048), "down": (4096, 7168)}
    # the defaults (8 and 8): ZipperEngine's o at 17-64 tokens from 8 ways to 4, the others kept; 16 tokens and
    # fewer keep the 4-step rule
    assert [pick_config(m, *layers["o"], cuda, res).split_k for m in (16, 17, 32, 64)] == [8, 4, 4, 4]
    assert [pick_config(32, *layers[x], cuda, res).split_k for x in ("qkv", "down")] == [4, 8]
    assert [_tiles.swapped_decode_config(32, *layers[x], cuda)["split_k"] for x in ("qkv", "o", "down")] == [2, 2, 4]
    tile_table(decode_split_min_steps_17=4)
    tile_table(swap_decode_split_min_steps=2)
    assert pick_config(32, *layers["o"], cuda, res).split_k == 8
    assert [_tiles.swapped_decode_config(32, *layers[x], cuda)["split_k"] for x in ("qkv", "o", "down")] == [4, 8, 8]


@needs_triton()
@pytest.mark.parametrize("config", [
    TileConfig(block_m=16, block_n=64, block_kp=64, num_stages=2),  # unsplit: a partial a tile all the same
    TileConfig(block_m=16, block_n=32, block_kp=32, split_k=3, num_stages=2),
])
def test_gated_dense_call_writes_silu_mul_of_its_gate_and_up_halves(config):
    # stacked [gate | up] (I = 128 each): the fix-up of each gate tile and its up tile writes
    # bf16(silu(g)) * u, the same bits as the GEMM's BF16 output followed by the SiLU*mul kernel
    from mosaicquant.kernels.decoder import silu_mul, silu_mul_reference

    m, n, k = 6, 256, 520
    ops = _operands(m, n, k, seed=17)
    dev = [t.to(DEVICE) for t in ops]
    plain = w4a4_gemm_triton(*dev[:4], k, dev[4], config=config, out_fp32=True)
    # torch rounds fp32 to BF16 to nearest even, as the GPU's conversion does (the interpreter truncates)
    want = silu_mul(plain.to(torch.bfloat16), kernel="triton")
    ref = w4a4_gemm_reference(*ops[:4], k, ops[4])
    for rep in range(2):  # the pair counters are back at zero after a launch
        out = torch.full((m, n // 2), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        w4a4_gemm_triton(*dev[:4], k, dev[4], config=config, out=out, gated=True)
        assert torch.equal(out, want), f"gated run {rep}: {(out != want).sum()} of {out.numel()} differ"
        assert_close_bf16(out, silu_mul_reference(ref).float(), f"gated dense run {rep}")
    assert torch.equal(w4a4_gemm(*ops[:4], k, ops[4], kernel="torch", gated=True), silu_mul_reference(ref))


@needs_triton()
def test_gated_dense_call_refuses_what_it_cannot_take():
    ops = [t.to(DEVICE) for t in _operands(17, 192, 256, seed=4)]
    cfg = TileConfig(block_m=16, block_n=64, block_kp=64)
    with pytest.raises(UserInputError, match="N=192 is not two halves of whole 64-channel tiles"):
        w4a4_gemm_triton(ops[0][:4], ops[1][:4], *ops[2:4], 256, config=cfg, gated=True)
    ops = [t.to(DEVICE) for t in _operands(17, 256, 256, seed=4)]
    with pytest.raises(UserInputError, match="M=17 is more than one tile of 16 tokens"):
        w4a4_gemm_triton(*ops[:4], 256, config=cfg, gated=True)
    with pytest.raises(UserInputError, match="writes BF16"):
        w4a4_gemm_triton(ops[0][:4], ops[1][:4], *ops[2:4], 256, config=cfg, gated=True, out_fp32=True)
    with pytest.raises(UserInputError, match="N=255 is odd"):
        w4a4_gemm(ops[0][:4].cpu(), ops[1][:4].cpu(), ops[2][:255].cpu(), ops[3][:255].cpu(), 256, kernel="torch",
                  gated=True)
