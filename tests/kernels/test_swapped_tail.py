"""The swapped GEMM's narrower last token tile (``block_m_tail``) for ragged token counts, and QuantLinear's rule."""

import importlib

import pytest
import torch

from mosaicquant.errors import UserInputError
from mosaicquant.kernels._tiles import swapped_tail
from mosaicquant.kernels.act_quant import quantize_activations_reference, quantize_activations_triton
from mosaicquant.kernels.quant_linear import QuantLinear
from mosaicquant.kernels.w4a4_gemm import w4a4_gemm_swapped_triton
from mosaicquant.kernels.zipper import zipper_gemm_reference
from mosaicquant.methods.format import PackedW4
from mosaicquant.methods.quant import quantize

from ._helpers import (
    DEVICE,
    assert_close_bf16,
    needs_triton,
    pow2_layers,
    random_activations,
    random_layer,
    random_residual,
    swapped_dense_case,
)

CPU = torch.device("cpu")

gemm_mod = importlib.import_module("mosaicquant.kernels.w4a4_gemm")  # the package exports a function of that name


class _LaunchSpy:
    """Stands in for the swapped kernel: records each launch's grid and ``TAIL_BM``, then launches the real one."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, kwargs["TAIL_BM"]))
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.fixture
def spy(monkeypatch):
    s = _LaunchSpy(gemm_mod._w4a4_swapped_kernel)
    monkeypatch.setattr(gemm_mod, "_w4a4_swapped_kernel", s)
    return s


def test_tail_rule_rounds_the_remainder_up_to_a_power_of_two():
    assert [swapped_tail(m, 128, device=CPU) for m in (100, 128, 129, 144, 160, 176, 192, 193, 288, 544, 800, 1056, 2080)] == \
        [None, None, 16, 16, 32, 64, 64, None, 32, 32, None, None, None]  # 800 on: full tiles pad less than 1/8
    assert [swapped_tail(m, 64, device=CPU) for m in (70, 96, 97, 160, 288, 320)] == [16, 32, None, 32, None, None]
    assert swapped_tail(40, 32, device=CPU) == 16 and swapped_tail(50, 32, device=CPU) is None  # a tail must be below the tile
    assert swapped_tail(20, 16, device=CPU) is None


def test_tail_rule_can_be_switched_off_or_unbounded(monkeypatch, tile_table):
    tile_table(swap_tail_min_padding=0)
    assert swapped_tail(2080, 128, device=CPU) == 32
    tile_table(swap_tail_max_fraction=0)
    assert swapped_tail(160, 128, device=CPU) is None


@needs_triton()
@pytest.mark.parametrize("m,n,k,opts,tail,programs", [
    # 150 tokens: one full 128-token tile and a 32-token one for each of 2 weight tiles (N 200: ragged)
    (150, 200, 300, dict(block_n=128, block_m=128), 32, 4),
    # split K over 2 programs a tile; 48 = one 32-token tile and a 16-token one, on 3 tiles of 64 weight rows
    (48, 130, 1000, dict(block_n=64, block_m=32, block_kp=128, split_k=2, num_warps=4), 16, 6),
])
def test_swapped_gemm_tail_tile_gives_the_full_tiles_result(spy, m, n, k, opts, tail, programs):
    args, ref = swapped_dense_case(m, n, k, seed=m + n)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    w4a4_gemm_swapped_triton(*args, block_m_tail=tail, out=out, **opts)
    assert spy.launches[-1] == ((programs, opts.get("split_k", 1)), tail)
    assert_close_bf16(out, ref, f"swapped, tail tile of {tail}, M={m}")
    # the integers are exact and the epilogue is per element: the same bits as full-size tiles
    full = w4a4_gemm_swapped_triton(*args, **opts)
    assert spy.launches[-1][1] == 0
    assert torch.equal(out.cpu(), full.cpu())


@needs_triton()
@pytest.mark.parametrize("walk", ["shared", "int8"])
def test_swapped_gemm_tail_tile_walks_the_residual(spy, walk):
    m, n, k = 80, 128, 1024
    gen = torch.Generator().manual_seed(7)
    x = random_activations(m, k, gen)
    qt, packed, free = pow2_layers(n, k, (64, 128), 0.4, gen, bias=True)
    layer = packed if walk == "shared" else free
    res = layer.residual
    a_packed, a_scale = quantize_activations_reference(x)
    ref = zipper_gemm_reference(a_packed, a_scale, layer.qweight, layer.scales.reshape(-1), k, res, layer.bias,
                                out_fp32=True)
    a8, s8 = quantize_activations_triton(x.to(DEVICE), layout="split8")
    out = w4a4_gemm_swapped_triton(a8, s8, layer.qweight.to(DEVICE), layer.scales.reshape(-1).to(DEVICE), k,
                                   layer.bias.to(DEVICE), residual=res.to(DEVICE), residual_walk=walk,
                                   block_n=64, block_m=64, block_m_tail=16)
    assert spy.launches[-1] == ((4, 1), 16)  # 2 weight tiles x (one 64-token tile + one 16-token tile)
    assert_close_bf16(out, ref, f"swapped + residual ({walk}), tail tile, M={m}")


@needs_triton()
def test_swapped_gemm_ignores_a_tail_the_tokens_do_not_need(spy):
    gen = torch.Generator().manual_seed(3)
    _, qweight, w_scale = random_layer(64, 256, gen)
    x = random_activations(100, 256, gen)
    a8, s8 = quantize_activations_triton(x.to(DEVICE), layout="split8")
    args = (a8, s8, qweight.to(DEVICE), w_scale.to(DEVICE), 256)
    # 100 = 64 + 36: a remainder above the 32-token tail runs a full tile
    w4a4_gemm_swapped_triton(*args, block_n=64, block_m=64, block_m_tail=32)
    assert spy.launches[-1] == ((2, 1), 0)
    for bad in (8, 24, 64, 128):
        with pytest.raises(UserInputError, match=f"block_m_tail={bad} must be None or a power of two >= 16 "
                                                 f"below block_m=64"):
            w4a4_gemm_swapped_triton(*args, block_n=64, block_m=64, block_m_tail=bad)


@needs_triton()
def test_quant_linear_runs_ragged_prefill_calls_with_a_tail_tile(spy):
    gen = torch.Generator().manual_seed(11)
    n, k = 160, 384
    qt = quantize(torch.randn(n, k, generator=gen), 4, scale_dtype=torch.float16)
    res = random_residual(n, k, (32, 128), 0.3, gen)
    for residual in (None, res):
        packed = PackedW4.from_quantized(qt, residual=residual, bias=torch.randn(n, generator=gen))
        kw = dict(act_clip_ratio=0.9, kernel="triton", swap_min_m=64, swap_min_tiles_per_sm=0, swap_mid=False)
        layer = QuantLinear(packed, **kw).to(DEVICE)
        plain = QuantLinear(packed, swap_tail=False, **kw).to(DEVICE)
        assert layer.swap_route(144) == "prefill" and layer.swap_tiles(144) == {"block_m_tail": 16}
        assert plain.swap_tiles(144) == {} and layer.swap_tiles(128) == {} and layer.swap_tiles(200) == {}
        x = random_activations(144, k, gen).to(DEVICE)
        out = layer(x)
        assert spy.launches[-1][1] == 16
        assert_close_bf16(out, QuantLinear(packed, act_clip_ratio=0.9, kernel="torch")(x.cpu()).float(),
                          f"QuantLinear, prefill tiles with a tail, residual={residual is not None}")
        assert torch.equal(out.cpu(), plain(x).cpu())
        assert spy.launches[-1][1] == 0
