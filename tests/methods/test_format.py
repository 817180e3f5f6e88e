"""Packed 4-bit format: bit-exact packing and the residual block layout."""

import pytest
import torch

from mosaicquant.methods.format import PackedW4, ResidualBlocks, pack_int4, parse_block_shape, unpack_int4
from mosaicquant.methods.quant import quantize


def test_pack_layout_hand_computed():
    q = torch.tensor([[1, -1, 7, -8, 3]], dtype=torch.int8)
    packed = pack_int4(q)
    # byte0 = low 1 | high 0xF ; byte1 = low 7 | high 0x8 ; byte2 = low 3 | pad 0
    assert packed.tolist() == [[0xF1, 0x87, 0x03]]
    assert torch.equal(unpack_int4(packed, 5), q)


@pytest.mark.parametrize("k", [1, 2, 67, 128])
def test_pack_roundtrip(k):
    q = torch.randint(-8, 8, (13, k), dtype=torch.int8, generator=torch.Generator().manual_seed(k))
    assert torch.equal(unpack_int4(pack_int4(q), k), q)


def test_unpack_reads_every_byte_as_two_signed_nibbles():
    packed = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    signed = [(v & 0xF) - 16 * (v & 0xF >= 8) for v in range(256)], [(v >> 4) - 16 * (v >> 4 >= 8) for v in range(256)]
    expected = torch.tensor([x for pair in zip(*signed) for x in pair], dtype=torch.int8).reshape(4, 128)
    assert torch.equal(unpack_int4(packed, 128), expected)
    assert torch.equal(unpack_int4(packed, 127), expected[:, :127])
    assert torch.equal(pack_int4(expected), packed)
    assert torch.equal(pack_int4(expected.to(torch.int32)), packed) and torch.equal(pack_int4(expected.t().t()), packed)


def test_pack_rejects_out_of_range():
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4(torch.tensor([8], dtype=torch.int8))


def test_packed_w4_dequantize_equals_quantized():
    w = torch.randn(45, 70, generator=torch.Generator().manual_seed(0))
    qt = quantize(w, 4, scale_dtype=torch.float16)
    p = PackedW4.from_quantized(qt)
    assert torch.equal(p.dequantize(), qt.dequantize())
    assert p.nbytes()["base_values"] == 45 * 35 and p.nbytes()["base_scales"] == 45 * 2


def test_residual_blocks_dense_view_ragged():
    n, k, bn, bk = 45, 70, 16, 32  # 3 x 3 block grid, ragged last row and column
    g = torch.Generator().manual_seed(3)
    coords = torch.tensor([[2, 2], [0, 1], [2, 0]])
    q = torch.randint(-8, 8, (3, bn, bk), dtype=torch.int8, generator=g)
    q[0, n - 2 * bn:, :] = 0  # outside the layer (rows 45..47 of block row 2)
    q[0, :, k - 2 * bk:] = 0
    scales = torch.rand(3, bn, generator=g) + 0.1
    r = ResidualBlocks.from_blocks((n, k), (bn, bk), coords, q, scales)
    assert r.coords.tolist() == [[0, 1], [2, 0], [2, 2]]
    assert r.row_ptr.tolist() == [0, 1, 1, 3]
    dense = r.to_dense()
    expected = torch.zeros(3 * bn, 3 * bk)
    for (i, j), qb, sb in zip(coords.tolist(), q, scales.half().float()):
        expected[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = qb.float() * sb[:, None]
    assert torch.equal(dense, expected[:n, :k])
    by = r.nbytes()
    assert by["residual_values"] == 3 * bn * bk // 2 and by["residual_scales"] == 3 * bn * 2


def test_residual_rejects_bad_coords():
    q = torch.zeros(1, 4, 4, dtype=torch.int8)
    with pytest.raises(ValueError, match="outside"):
        ResidualBlocks.from_blocks((8, 8), (4, 4), torch.tensor([[2, 0]]), q, torch.ones(1, 4))
    with pytest.raises(ValueError, match="duplicate"):
        ResidualBlocks.from_blocks((8, 8), (4, 4), torch.tensor([[1, 0], [1, 0]]), q.repeat(2, 1, 1), torch.ones(2, 4))


def test_parse_block_shape():
    assert parse_block_shape(128) == (128, 128)
    assert parse_block_shape("64x128") == (64, 128)
    assert parse_block_shape("64") == (64, 64)
    for bad in ("0", "64x63", "axb", "1x2x3"):
        with pytest.raises(ValueError, match="block"):
            parse_block_shape(bad)


def test_residual_shifts_need_every_kept_row_on_the_base_scale_times_a_power_of_two():
    from mosaicquant.methods.format import residual_shifts

    base = torch.tensor([0.5, 0.25, 1.0], dtype=torch.float16)
    q = torch.ones(1, 4, 4, dtype=torch.int8)  # one 4x4 block at (0, 0); rows 3 is padding (N = 3)
    q[0, 3] = 0
    scales = torch.tensor([[0.5 / 16, 0.25, 1.0 / 4, 7.0]])  # shifts 4, 0, 2; the padding row's scale is ignored
    res = ResidualBlocks.from_blocks((3, 4), (4, 4), torch.tensor([[0, 0]]), q, scales)
    assert residual_shifts(res, base).tolist() == [[4, 0, 2, 0]]
    for bad in (0.5 / 32, 0.5 * 2, 0.3):  # j = 5, j = -1, not a power of two
        s = scales.clone()
        s[0, 0] = bad
        assert residual_shifts(ResidualBlocks.from_blocks((3, 4), (4, 4), torch.tensor([[0, 0]]), q, s), base) is None
    # a zero scale qualifies only with zero integers (the shared walk would add them otherwise)
    s = scales.clone()
    s[0, 1] = 0.0
    assert residual_shifts(ResidualBlocks.from_blocks((3, 4), (4, 4), torch.tensor([[0, 0]]), q, s), base) is None
    q0 = q.clone()
    q0[0, 1] = 0
    assert residual_shifts(ResidualBlocks.from_blocks((3, 4), (4, 4), torch.tensor([[0, 0]]), q0, s), base) is not None
    assert residual_shifts(res, torch.ones(3, 2, dtype=torch.float16)) is None  # group-wise base scales
