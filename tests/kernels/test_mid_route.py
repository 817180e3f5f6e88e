"""Mid-sized calls (33 tokens up, short of the swapped prefill GEMM's tiles) on the swapped GEMM's mid tiles."""

import pytest
import torch

from mosaicquant.kernels._tiles import swapped_mid_config
from mosaicquant.kernels.quant_linear import QuantLinear
from mosaicquant.methods.format import PackedW4
from mosaicquant.methods.quant import quantize

from ._helpers import DEVICE, assert_close_bf16, needs_triton, pow2_layers, random_activations

CPU = torch.device("cpu")  # 4 "SMs" (_tiles._sm_count), Triton's interpreter


def test_mid_tiles_follow_the_rule():
    # dense: 64 weight rows x 32 tokens up to 64 tokens, then x 64; split-K while the programs cover the SMs less
    # than 1.5 times and each keeps 16 steps of 128 packed bytes
    assert swapped_mid_config(32, 128, 8192, CPU, residual=False) is None  # below SWAP_MID_MIN_M
    cfg = swapped_mid_config(33, 128, 8192, CPU, residual=False)
    assert cfg == dict(block_n=64, block_m=32, block_kp=128, split_k=2, num_warps=4, num_stages=4)
    assert swapped_mid_config(33, 128, 2048, CPU, residual=False)["split_k"] == 1  # 8 steps a program at split 2
    assert swapped_mid_config(65, 128, 2048, CPU, residual=False)["block_m"] == 64
    # enough output tiles (2.9 a SM) keep the other routes
    assert swapped_mid_config(64, 1024, 2048, CPU, residual=False) is None
    # from SWAP_MID_WIDE_MIN_M tokens the wide tier: 128 weight rows x 64 tokens, below 3 tiles a SM
    cfg = swapped_mid_config(300, 160, 2048, CPU, residual=False)
    assert cfg == dict(block_n=128, block_m=64, block_kp=64, split_k=1, num_warps=8, num_stages=3)
    assert swapped_mid_config(300, 128, 1 << 16, CPU, residual=False)["split_k"] == 2  # 5 tiles, 6 wanted
    assert swapped_mid_config(300, 640, 2048, CPU, residual=False) is None  # 25 tiles on 4 SMs
    # residual blocks: 128 weight rows x 64 tokens up to 256, then x 128; from 65 tokens; below 1 tile a SM
    assert swapped_mid_config(64, 128, 2048, CPU, residual=True) is None
    cfg = swapped_mid_config(300, 128, 2048, CPU, residual=True)
    assert cfg == dict(block_n=128, block_m=128, block_kp=64, split_k=2, num_warps=8, num_stages=3)
    assert swapped_mid_config(128, 128, 2048, CPU, residual=True)["block_m"] == 64
    assert swapped_mid_config(300, 256, 2048, CPU, residual=True) is None  # 6 tiles on 4 SMs


def test_mid_route_can_be_switched_off(monkeypatch, tile_table):
    tile_table(swap_mid_wide_min_m=0)  # the narrow tier then: 15 tiles of 64 rows
    assert swapped_mid_config(300, 160, 2048, CPU, residual=False) is None
    tile_table(swap_mid_min_m=0)
    tile_table(swap_mid_residual_min_m=0)
    assert swapped_mid_config(100, 128, 2048, CPU, residual=False) is None
    assert swapped_mid_config(100, 128, 2048, CPU, residual=True) is None


def _spy(monkeypatch):
    import mosaicquant.kernels.quant_linear as ql
    calls = []
    real = ql.w4a4_gemm_swapped_triton
    monkeypatch.setattr(ql, "w4a4_gemm_swapped_triton", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    return calls


@needs_triton()
def test_quant_linear_runs_mid_sized_calls_of_dense_layers_on_the_mid_tiles(monkeypatch):
    gen = torch.Generator().manual_seed(21)
    n, k = 160, 384
    qt = quantize(torch.randn(n, k, generator=gen), 4, scale_dtype=torch.float16)
    packed = PackedW4.from_quantized(qt, bias=torch.randn(n, generator=gen))
    # (swap_min_tiles_per_sm=0: the prefill tiles take this small layer's calls of 65+ tokens on any device)
    layer = QuantLinear(packed, act_clip_ratio=0.9, kernel="triton", swap_min_tiles_per_sm=0).to(DEVICE)
    off = QuantLinear(packed, act_clip_ratio=0.9, kernel="triton", swap_min_tiles_per_sm=0, swap_mid=False).to(DEVICE)
    ref_layer = QuantLinear(packed, act_clip_ratio=0.9, kernel="torch")
    assert [m for m in (17, 32, 33, 40, 70, 300) if layer.swap_route(m) == "mid"] == [33, 40, 70, 300]
    assert off.swap_route(40) is None and off.swap_route(70) == "prefill" and off.swap_route(300) == "prefill"
    calls = _spy(monkeypatch)
    for m, block_m, block_n in ((40, 32, 64), (70, 64, 64), (300, 64, 128)):  # 300: the wide tier, ahead of prefill
        x = random_activations(m, k, gen)
        out = layer(x.to(DEVICE))
        assert calls[-1]["block_m"] == block_m and calls[-1]["block_n"] == block_n
        assert_close_bf16(out, ref_layer(x).float(), f"QuantLinear, mid tiles, M={m}")
        assert_close_bf16(off(x.to(DEVICE)), ref_layer(x).float(), f"QuantLinear, without the mid route, M={m}")


@needs_triton()
def test_quant_linear_runs_mid_sized_calls_of_pow2_residual_layers_on_the_shared_walk(monkeypatch):
    gen = torch.Generator().manual_seed(22)
    n, k = 128, 1024
    _, packed, free_packed = pow2_layers(n, k, (64, 128), 0.4, gen, bias=True)
    layer = QuantLinear(packed, kernel="triton").to(DEVICE)
    free = QuantLinear(free_packed, kernel="triton").to(DEVICE)
    ref_layer = QuantLinear(packed, kernel="torch")
    assert layer.swap_route(64) is None and layer.swap_route(70) == "mid"
    assert free.swap_route(70) is None  # free scales: no shared walk, the packed kernels
    calls = _spy(monkeypatch)
    x = random_activations(70, k, gen)
    out = layer(x.to(DEVICE))
    assert calls[-1]["residual_walk"] == "shared" and calls[-1]["block_m"] == 64
    assert_close_bf16(out, ref_layer(x).float(), "QuantLinear, mid tiles with the shared walk, M=70")


@pytest.mark.parametrize("m", [40, 300])
def test_mid_split_never_exceeds_eight(m):
    cfg = swapped_mid_config(m, 64, 1 << 20, CPU, residual=m > 64)
    assert cfg is not None and cfg["split_k"] <= 8
