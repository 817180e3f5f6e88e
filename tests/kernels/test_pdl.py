"""Programmatic dependent launch: the switch, and (on a Hopper GPU) the same results with and without it."""

import pytest
import torch

from mosaicquant.kernels import _common
from mosaicquant.kernels._common import PDL_ENV_VAR, pdl_supported, use_pdl
from mosaicquant.harness.errors import UserInputError
from mosaicquant.kernels._tiles import (
    PDL_ANY_SIZE_MAX_M,
    PDL_MAX_M,
    PDL_MAX_WEIGHT_BYTES,
    PREFETCH_MIN_KP,
    pdl_default,
    pdl_launch,
    prefetch_default,
    prefetch_row_bytes,
)
from mosaicquant.kernels.act_quant import quantize_activations_triton
from mosaicquant.kernels.w4a4_gemm import w4a4_gemm_reference, w4a4_gemm_triton
from mosaicquant.kernels.zipper import zipper_gemm_triton

from ._helpers import assert_close_bf16, random_activations, random_layer, random_residual


def test_cpu_and_interpreter_never_use_pdl(monkeypatch):
    monkeypatch.setenv(PDL_ENV_VAR, "1")
    assert not pdl_supported(torch.device("cpu"))
    assert not use_pdl(torch.device("cpu"), True)
    assert pdl_launch(False) == {} and pdl_launch(True) == {"launch_pdl": True}


@pytest.mark.parametrize("env,arg,want", [("1", None, True), ("0", None, False), ("off", None, False),
                                          ("0", True, True), ("1", False, False)])
def test_switch_reads_argument_then_environment(monkeypatch, env, arg, want):
    monkeypatch.setattr(_common, "pdl_supported", lambda device: True)
    monkeypatch.setenv(PDL_ENV_VAR, env)
    assert use_pdl(torch.device("cuda"), arg) is want


def test_default_covers_small_m_and_prefetches_long_rows_that_fit_l2():
    assert pdl_default(1, 4096, 7168)  # down_proj at decode: 28 MiB packed
    assert pdl_default(PDL_ANY_SIZE_MAX_M, 28672, 2048)  # 56 MiB gate/up: PDL alone gained at M <= 4
    assert not pdl_default(PDL_MAX_M, 28672, 2048)  # ... and lost at M = 8
    assert pdl_default(PDL_MAX_M, 1, PDL_MAX_WEIGHT_BYTES)
    assert not pdl_default(PDL_MAX_M + 1, 4096, 2048)  # more rows than measured to gain
    assert prefetch_default(4096, 7168) and prefetch_default(4096, PREFETCH_MIN_KP)
    assert not prefetch_default(6144, 2048)  # K = 4096 rows: the prefetch measured slower than PDL alone
    assert not prefetch_default(PDL_MAX_WEIGHT_BYTES // PREFETCH_MIN_KP + 1, PREFETCH_MIN_KP)  # outgrows L2


def test_prefetch_cap_shares_the_bytes_between_rows_and_splits():
    assert prefetch_row_bytes(4096, 7168, 2, None) == 7168  # the whole slice (the default prefetches these)
    assert prefetch_row_bytes(6144, 2048, 2, None) == 0  # the default does not prefetch these
    assert prefetch_row_bytes(4096, 7168, 2, 0) == 0
    assert prefetch_row_bytes(6144, 2048, 1, 1 << 16) == 2048  # a cap above the weights: the whole rows
    assert prefetch_row_bytes(28672, 2048, 1, 24) == 24 * 2**20 // 28672  # 877 of 2048 bytes a row
    assert 28672 * prefetch_row_bytes(28672, 2048, 1, 24) <= 24 * 2**20
    with pytest.raises(UserInputError, match="prefetch_mib"):
        prefetch_row_bytes(1, 1, 1, -1.0)


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9 and not _common.triton_interpreting()


@pytest.mark.skipif(not _hopper(), reason="needs a CUDA GPU of compute capability 9.0 or later")
@pytest.mark.parametrize("m", [1, 13, 300])
def test_pdl_chain_in_a_cuda_graph_matches(m):
    """act-quant → GEMM (dense and fused residual) with PDL, captured in a graph, equals the plain launches."""
    gen = torch.Generator().manual_seed(m)
    n, k = 384, 1024
    x = random_activations(m, k, gen).cuda()
    _, qweight, w_scale = random_layer(n, k, gen)
    qweight, w_scale = qweight.cuda(), w_scale.cuda()
    residual = random_residual(n, k, (128, 128), 0.3, gen).to(torch.device("cuda"))

    def step(pdl, prefetch_mib=None):
        a, s = quantize_activations_triton(x)
        return (w4a4_gemm_triton(a, s, qweight, w_scale, k, pdl=pdl, prefetch_mib=prefetch_mib),
                zipper_gemm_triton(a, s, qweight, w_scale, k, residual, pdl=pdl, prefetch_mib=prefetch_mib))

    plain = step(False)
    step(True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(True)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], plain[0]) and torch.equal(captured[1], plain[1])
    for cap in (0, 0.1):  # PDL without prefetch, and a prefetch capped below the weights' size
        capped = step(True, cap)
        assert torch.equal(capped[0], plain[0]) and torch.equal(capped[1], plain[1])
    a, s = quantize_activations_triton(x)
    assert_close_bf16(captured[0], w4a4_gemm_reference(a, s, qweight, w_scale, k, out_fp32=True), "dense with PDL")
