"""The decode GEMV (dense W4A4 and ZipperEngine on dp4a) against the PyTorch references."""

import pytest
import torch

from mosaicquant.errors import UserInputError
from mosaicquant.kernels.act_quant import quantize_activations_reference
from mosaicquant.kernels.gemv import GEMV_MAX_M, gemv_config, gemv_reason, gemv_triton
from mosaicquant.kernels.w4a4_gemm import w4a4_gemm_reference
from mosaicquant.kernels.zipper import zipper_gemm_reference
from mosaicquant.methods.format import pack_int4

from ._helpers import DEVICE, assert_close_bf16, assert_residual_matters, needs_triton, random_activations, random_int4, random_layer, \
    random_residual


def _operands(m, n, k, seed, bias=True):
    gen = torch.Generator().manual_seed(seed)
    a_packed, a_scale = quantize_activations_reference(random_activations(m, k, gen))
    _, qweight, w_scale = random_layer(n, k, gen)
    b = torch.randn(n, generator=gen) if bias else None
    return gen, a_packed, a_scale, qweight, w_scale, b


def _dev(*ts):
    return [t.to(DEVICE) if t is not None else None for t in ts]


@needs_triton()
@pytest.mark.parametrize("m,n,k,tiles", [
    (1, 80, 264, dict(block_n=32, block_kw=16, split_k=1)),     # N and K/8 ragged against the tiles
    (3, 96, 512, dict(block_n=64, block_kw=16, split_k=3)),     # 3 tokens in a 4-row tile, uneven split
    (8, 130, 1024, dict(block_n=32, block_kw=64, split_k=2)),   # the most tokens
    (5, 64, 8, dict(block_n=16, block_kw=4, split_k=1)),        # one word of K
])
def test_dense_matches_reference(m, n, k, tiles):
    _, a_packed, a_scale, qweight, w_scale, bias = _operands(m, n, k, seed=m * n + k)
    ref = w4a4_gemm_reference(a_packed, a_scale, qweight, w_scale, k, bias, out_fp32=True)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    gemv_triton(*_dev(a_packed, a_scale, qweight, w_scale), k, *_dev(bias), out=out, **tiles)
    assert_close_bf16(out, ref, f"gemv {m}x{n}x{k}")


@needs_triton()
def test_extreme_integers_do_not_overflow():
    # every product at its largest magnitude (-8 · -8), the longest K of the SPEC models
    m, n, k = 2, 16, 14336
    a = torch.full((m, k), -8, dtype=torch.int8)
    w = torch.full((n, k), -8, dtype=torch.int8)
    w[1] = 7
    scale = torch.ones(m)
    w_scale = torch.ones(n, dtype=torch.float16)
    ref = w4a4_gemm_reference(pack_int4(a), scale, pack_int4(w), w_scale, k, out_fp32=True)
    out = gemv_triton(*_dev(pack_int4(a), scale, pack_int4(w), w_scale), k, block_n=16, block_kw=256)
    assert_close_bf16(out, ref, "extreme integers")
    assert out[0, 0].item() == 64 * k


@needs_triton()
@pytest.mark.parametrize("m,n,k,block,split", [
    (1, 200, 304, (64, 64), 1),    # ragged last block row and block column
    (4, 128, 1024, (128, 128), 4),  # blocks dealt over four K splits
    (7, 96, 520, (32, 64), 2),
])
def test_residual_matches_the_zipper_reference(m, n, k, block, split):
    gen, a_packed, a_scale, qweight, w_scale, bias = _operands(m, n, k, seed=k + m)
    residual = random_residual(n, k, block, 0.3, gen)
    ref = zipper_gemm_reference(a_packed, a_scale, qweight, w_scale, k, residual, bias, out_fp32=True)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    gemv_triton(*_dev(a_packed, a_scale, qweight, w_scale), k, *_dev(bias), residual=residual.to(DEVICE),
                out=out, block_n=min(32, block[0]), block_kw=16, split_k=split)
    assert_close_bf16(out, ref, f"gemv + residual {m}x{n}x{k}")
    assert_residual_matters(a_packed, a_scale, qweight, w_scale, k, bias, ref)


@needs_triton()
def test_default_tiles_run():
    m, n, k = 4, 96, 256
    gen, a_packed, a_scale, qweight, w_scale, _ = _operands(m, n, k, seed=5, bias=False)
    residual = random_residual(n, k, (32, 128), 0.5, gen)
    ref = zipper_gemm_reference(a_packed, a_scale, qweight, w_scale, k, residual, out_fp32=True)
    out = gemv_triton(*_dev(a_packed, a_scale, qweight, w_scale), k, residual=residual.to(DEVICE))
    assert_close_bf16(out, ref, "default tiles")


def test_what_the_gemv_does_not_take_is_named():
    assert gemv_reason(4, 4096) is None
    assert "1 to 8" in gemv_reason(GEMV_MAX_M + 1, 4096)
    assert "multiple of 8" in gemv_reason(1, 4100)
    assert "too long" in gemv_reason(1, 2**17)
    gen = torch.Generator().manual_seed(0)
    assert "power of two" in gemv_reason(1, 192, random_residual(32, 192, (32, 96), 0.5, gen))


def test_config_nests_in_residual_blocks_and_splits_k_on_the_gpu():
    gen = torch.Generator().manual_seed(0)
    residual = random_residual(64, 256, (16, 128), 0.5, gen)
    assert gemv_config(4, 64, 256, torch.device("cpu"))["split_k"] == 1
    cfg = gemv_config(4, 64, 256, torch.device("cpu"), residual)
    assert cfg["block_n"] <= 64
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        assert gemv_config(4, 4096, 4096, cuda)["split_k"] > 1
        assert gemv_config(4, 64, 4096, cuda, residual)["block_n"] == 16


@needs_triton()
@pytest.mark.parametrize("bad,match", [
    (lambda a, s, w, ws: gemv_triton(a[:, :-1], s, w[:, :-1], ws, 254), "multiple of 8"),
    (lambda a, s, w, ws: gemv_triton(torch.cat([a, a]), torch.cat([s, s]), w, ws, 256), "1 to 8"),
    (lambda a, s, w, ws: gemv_triton(a, s, w, ws, 256, block_n=24), "block_n=24"),
    (lambda a, s, w, ws: gemv_triton(a, s, w, ws, 256, block_kw=6), "block_kw=6"),
    (lambda a, s, w, ws: gemv_triton(a, s, w, ws, 256, split_k=0), "split_k=0"),
    (lambda a, s, w, ws: gemv_triton(a.repeat(2, 1).view(-1)[2:2 + 5 * 128].view(5, 128), s, w, ws, 256), "4-byte"),
    # an [N, 1] slice of a wider tensor: its entries are 2 apart, the kernel reads them as consecutive
    (lambda a, s, w, ws: gemv_triton(a, s, w, torch.stack([ws, 2 * ws], 1)[:, :1], 256), r"strides \(2, 1\)"),
    (lambda a, s, w, ws: gemv_triton(a, s, w, ws, 256, residual=random_residual(32, 256, (32, 64), 0.5,
                                                                                torch.Generator()).to("meta")),
     "the residual must be on the operands' device"),
])
def test_bad_calls_raise_clear_errors(bad, match):
    gen = torch.Generator().manual_seed(1)
    a = pack_int4(random_int4((5, 256), gen)).to(DEVICE)
    s = torch.ones(5, device=DEVICE)
    _, w, ws = random_layer(32, 256, gen)
    with pytest.raises(UserInputError, match=match):
        bad(a, s, w.to(DEVICE), ws.to(DEVICE))
