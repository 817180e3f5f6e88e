"""The RMSNorm + quantizer run by a decode GEMM's last programs (mosaicquant.kernels.norm_fold)."""

import pytest
import torch

from mosaicquant.errors import UserInputError
from mosaicquant.kernels._common import triton_interpreting
from mosaicquant.kernels._tiles import TileConfig, persistent_zeros
from mosaicquant.kernels.act_quant import quantize_activations_reference
from mosaicquant.kernels.decoder import rmsnorm_quant, rmsnorm_quant_reference
from mosaicquant.kernels.norm_fold import norm_fold
from mosaicquant.kernels.w4a4_gemm import w4a4_gemm_triton
from mosaicquant.kernels.zipper import zipper_gemm_triton

from ._helpers import DEVICE, needs_triton, random_activations, random_layer, random_residual

BF16 = torch.bfloat16
SPLIT = TileConfig(block_m=16, block_n=64, block_kp=64, split_k=2, num_stages=2)
WHOLE = TileConfig(block_m=16, block_n=32, block_kp=128, num_stages=2)


def _layer(m, n, k, seed, block=None):
    gen = torch.Generator().manual_seed(seed)
    a_packed, a_scale = quantize_activations_reference(random_activations(m, k, gen))
    _, qweight, w_scale = random_layer(n, k, gen)
    residual = random_residual(n, k, block, 0.3, gen).to(DEVICE) if block else None
    weight = (1 + 0.3 * torch.randn(n, generator=gen)).to(BF16)
    stream = (torch.randn(m, n, generator=gen) * 4).to(BF16)
    dev = [t.to(DEVICE) for t in (a_packed, a_scale, qweight, w_scale, weight, stream)]
    return (*dev, residual)


def _gemm(a, s, qw, ws, k, residual, config, mode, **kw):
    if residual is None:
        return w4a4_gemm_triton(a, s, qw, ws, k, config=config, **kw)
    return zipper_gemm_triton(a, s, qw, ws, k, residual, config=config, mode=mode, **kw)


def _assert_same_norm(fold, q2, s2, what):
    if triton_interpreting():  # one reduction order: the standalone kernel's bits
        assert torch.equal(fold.q, q2) and torch.equal(fold.scale, s2), f"{what}: integers and scales"
        return
    # compiled, the GEMM's warps may sum the squares in another order than the norm kernel's
    assert torch.allclose(fold.scale, s2, rtol=2.0**-7, atol=0), f"{what}: scales"
    if fold.layout == "packed":
        lo = lambda t: ((t.view(torch.int8) << 4) >> 4).int()  # noqa: E731
        hi = lambda t: (t.view(torch.int8) >> 4).int()  # noqa: E731
        d = torch.maximum((lo(fold.q) - lo(q2)).abs(), (hi(fold.q) - hi(q2)).abs())
    else:
        d = (fold.q.int() - q2.int()).abs()
    assert d.max().item() <= 1 and (d > 0).float().mean().item() <= 0.02, f"{what}: integers"


@needs_triton()
@pytest.mark.parametrize("m", [1, 7])
@pytest.mark.parametrize("kind,config,mode", [
    ("dense", SPLIT, None), ("dense", WHOLE, None),
    ("zipper", SPLIT, "tail"), ("zipper", WHOLE, "tail"), ("zipper", SPLIT, "inline"),
])
@pytest.mark.parametrize("layout", ["packed", "split8"])
def test_fold_gives_the_norm_kernels_results(m, kind, config, mode, layout):
    n, k = 330, 256  # ragged last tiles of both configs
    a, s, qw, ws, weight, stream, residual = _layer(m, n, k, seed=m + len(kind), block=(64, 64) if kind == "zipper" else None)
    y_ref = _gemm(a, s, qw, ws, k, residual, config, mode)
    res_two = stream.clone()
    q2, s2 = rmsnorm_quant(y_ref, weight, 1e-5, res_two, clip_ratio=0.9, layout=layout, kernel="triton")
    res_fold = stream.clone()
    fold = norm_fold(weight, 1e-5, res_fold, 0.9, layout)
    fold.q.fill_(0x55 if layout == "packed" else 99)  # poisoned: every byte must be written
    fold.scale.fill_(float("nan"))
    y = _gemm(a, s, qw, ws, k, residual, config, mode, fold=fold)
    what = f"{kind} {mode} M={m} {layout}"
    assert torch.equal(y, y_ref), f"{what}: the GEMM's own output is unchanged"
    assert torch.equal(res_fold, res_two), f"{what}: residual += y, one rounding"
    _assert_same_norm(fold, q2, s2, what)
    # and both against the PyTorch reference of the pair
    qr, sr = rmsnorm_quant_reference(y_ref.cpu(), weight.cpu(), 1e-5, stream.cpu().clone(), 0.9, layout)
    assert torch.allclose(fold.scale.cpu(), sr, rtol=2.0**-7)
    assert persistent_zeros("norm fold counters", 2, torch.int32, y.device).eq(0).all(), "counters reset"


@needs_triton()
@pytest.mark.parametrize("m", [3, 16])
def test_fold_with_fewer_programs_than_rows(m):
    # 2 programs: the last one runs every row (FOLD 1) on the GPU as well
    n, k = 128, 128
    a, s, qw, ws, weight, stream, _ = _layer(m, n, k, seed=m)
    config = TileConfig(block_m=16, block_n=64, block_kp=64, num_stages=2)
    y = w4a4_gemm_triton(a, s, qw, ws, k, config=config)
    res_two = stream.clone()
    q2, s2 = rmsnorm_quant(y, weight, 1e-5, res_two, clip_ratio=0.9, kernel="triton")
    fold = norm_fold(weight, 1e-5, stream.clone(), 0.9)
    assert torch.equal(w4a4_gemm_triton(a, s, qw, ws, k, config=config, fold=fold), y)
    assert torch.equal(fold.residual, res_two)
    _assert_same_norm(fold, q2, s2, f"M={m}, 2 programs")


@needs_triton()
def test_fold_runs_again_on_its_reset_counters():
    m, n, k = 4, 192, 128
    a, s, qw, ws, weight, stream, _ = _layer(m, n, k, seed=3)
    results = []
    for _ in range(3):
        fold = norm_fold(weight, 1e-6, stream.clone(), 1.0)
        w4a4_gemm_triton(a, s, qw, ws, k, config=SPLIT, fold=fold)
        results.append((fold.q.clone(), fold.scale.clone(), fold.residual.clone()))
    for q, sc, r in results[1:]:
        assert torch.equal(q, results[0][0]) and torch.equal(sc, results[0][1]) and torch.equal(r, results[0][2])


@needs_triton()
def test_fold_refuses_what_it_cannot_run():
    m, n, k = 4, 192, 128
    a, s, qw, ws, weight, stream, _ = _layer(m, n, k, seed=5)
    fold = norm_fold(weight, 1e-5, stream[:2].clone(), 0.9)
    with pytest.raises(UserInputError, match=r"residual is \[2, 192\]"):
        w4a4_gemm_triton(a, s, qw, ws, k, config=SPLIT, fold=fold)
    fold = norm_fold(weight, 1e-5, stream.clone(), 0.9)
    with pytest.raises(UserInputError, match="fp32"):
        w4a4_gemm_triton(a, s, qw, ws, k, config=SPLIT, fold=fold, out_fp32=True)
    with pytest.raises(UserInputError, match="norm after it"):
        from mosaicquant.kernels.quant_linear import QuantLinear
        from mosaicquant.methods.format import PackedW4

        layer = QuantLinear(PackedW4(shape=(n, k), qweight=qw, scales=ws.reshape(-1, 1)), gemv_max_m=1).to(DEVICE)
        layer.forward_quantized(a[:1], s[:1], "triton", fold=norm_fold(weight, 1e-5, stream[:1].clone(), 0.9))


def test_norm_fold_checks_its_inputs():
    w = torch.ones(8, dtype=BF16)
    r = torch.zeros(2, 8, dtype=BF16)
    with pytest.raises(UserInputError, match="residual"):
        norm_fold(w, 1e-5, r.float(), 0.9)
    with pytest.raises(UserInputError, match="weight"):
        norm_fold(torch.ones(9, dtype=BF16), 1e-5, r, 0.9)
    with pytest.raises(UserInputError, match="clip_ratio=1.5"):
        norm_fold(w, 1e-5, r, 1.5)
    with pytest.raises(UserInputError, match="layout='rows'"):
        norm_fold(w, 1e-5, r, 0.9, layout="rows")
    fold = norm_fold(w, 1e-5, r, 0.9, layout="split8")
    assert fold.q.dtype == torch.int8 and fold.scale.shape == (2,)
