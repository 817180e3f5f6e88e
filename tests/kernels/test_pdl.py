"""Programmatic dependent launch: the switch, and (on a Hopper GPU) the same results with and without it."""

import re

import pytest
import torch

from mosaicquant import settings
from mosaicquant.errors import UserInputError
from mosaicquant.harness import shapes
from mosaicquant.harness.context import QuantContext
from mosaicquant.harness.runtime import FusedDecoder
from mosaicquant.harness.speedforms import executable, speed_form
from mosaicquant.harness.suites.speed import fused_decode_step
from mosaicquant.kernels import _common
from mosaicquant.kernels._common import (
    PDL_CHAIN_MAX_M,
    chain_launch,
    chain_mode,
    gemm_pdl,
    pdl_supported,
    use_pdl,
)
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
from mosaicquant.registry import get_method

from ._helpers import assert_close_bf16, random_activations, random_layer, random_residual


def test_cpu_and_interpreter_never_use_pdl():
    with settings.use(pdl=True):
        assert not pdl_supported(torch.device("cpu"))
        assert not use_pdl(torch.device("cpu"), True)
    assert pdl_launch(False) == {} and pdl_launch(True) == {"launch_pdl": True}


@pytest.mark.parametrize("setting,arg,want", [(True, None, True), (False, None, False), ("off", None, False),
                                              (False, True, True), (True, False, False)])
def test_switch_reads_argument_then_settings(monkeypatch, setting, arg, want):
    monkeypatch.setattr(_common, "pdl_supported", lambda device: True)
    with settings.use(pdl=setting):
        assert use_pdl(torch.device("cuda"), arg) is want
    assert use_pdl(torch.device("cuda")) is True  # the default once the block ends


@pytest.mark.parametrize("chain,want", [("off", 1), ("on", 2), (" On ", 2)])
def test_chain_mode_reads_the_settings(monkeypatch, chain, want):
    monkeypatch.setattr(_common, "pdl_supported", lambda device: True)
    with settings.use(settings.KernelSettings(pdl=True, pdl_chain=chain)):
        assert chain_mode(torch.device("cuda"), PDL_CHAIN_MAX_M) == want
        assert chain_launch(want) == ({"launch_pdl": True} if want >= 2 else {})
        assert chain_mode(torch.device("cuda"), PDL_CHAIN_MAX_M + 1) == 1  # larger launches keep the plain pairs
    assert chain_mode(torch.device("cuda"), 1) == 2  # the default chain


def test_gemms_signal_their_successor_only_inside_the_chain(monkeypatch):
    monkeypatch.setattr(_common, "pdl_supported", lambda device: True)
    cuda = torch.device("cuda")
    with settings.use(pdl=True, pdl_chain="on"):
        assert gemm_pdl(cuda, 4, True) == 2 and gemm_pdl(cuda, 4, False) == 0
        assert gemm_pdl(cuda, PDL_CHAIN_MAX_M + 1, True) == 1  # waits, but lets nothing start early
    with settings.use(pdl=True, pdl_chain="off"):  # back-to-back GEMMs do not overlap
        assert gemm_pdl(cuda, 4, True) == 1


def test_chain_mode_is_nothing_without_pdl(monkeypatch):
    assert chain_mode(torch.device("cpu"), 1) == 0 and chain_launch(0) == {}
    monkeypatch.setattr(_common, "pdl_supported", lambda device: True)
    with settings.use(pdl=False, pdl_chain="on"):
        assert chain_mode(torch.device("cuda"), 1) == 0  # PDL off turns the chain off too


@pytest.mark.parametrize("field,value,message", [
    ("kernel", "cuda", "kernel='cuda' is not allowed: choose one of 'auto', 'triton', 'torch'"),
    ("pdl_chain", "sideways", "pdl_chain='sideways' is not allowed: choose one of 'off', 'on'"),
    ("pdl", "maybe", "pdl='maybe' is not a boolean"),
    ("prefetch_mib", "-1", "prefetch_mib=-1.0 is out of range: allowed numbers >= 0"),
    ("prefetch_mib", "lots", "prefetch_mib='lots' is not a number"),
])
def test_bad_settings_are_refused_with_the_allowed_values(field, value, message):
    with pytest.raises(UserInputError, match=re.escape(message)):
        settings.KernelSettings.from_dict({field: value})
    with pytest.raises(UserInputError, match="has no option 'pdl_mode'"):
        settings.KernelSettings.from_dict({"pdl_mode": "on"})


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


def test_launcher_default_cap_applies_without_a_setting():
    assert settings.current().prefetch_mib is None
    # the dense GEMM's 8 MiB cap over 12 MiB of q/k/v: two thirds of each row
    assert prefetch_row_bytes(6144, 2048, 1, None, 8.0) == 8 * 2**20 // 6144
    assert prefetch_row_bytes(4096, 2048, 2, None, 8.0) == 1024  # 8 MiB o_proj over 2 splits: each its half
    assert prefetch_row_bytes(6144, 2048, 1, 0, 8.0) == 0  # an argument wins


def test_prefetch_cap_from_the_settings():
    with settings.use(prefetch_mib=24):
        assert prefetch_row_bytes(28672, 2048, 1, None) == 24 * 2**20 // 28672  # in place of the default's 0
        assert prefetch_row_bytes(6144, 2048, 2, None) == 2048  # 12 MiB: under the cap, the whole slices
        assert prefetch_row_bytes(6144, 2048, 2, 0) == 0  # an argument still wins
        assert prefetch_row_bytes(6144, 2048, 2, None, 8.0) == 2048  # and the setting beats a launcher default
    assert prefetch_row_bytes(28672, 2048, 1, None) == 0  # the block's cap is gone after it


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


# big enough for the decode paths of the Llama-3 linears' kinds: split-token quantizers, split-K
# fix-ups, the parallel residual (4-16 tokens), the GEMV (1 token)
_PDL_SHAPES = shapes.ShapeModel("pdl-llama-shapes", "llama", 512, 1536, 2, 8, 2, 64, 1024, False)


@pytest.mark.skipif(not _hopper(), reason="needs a CUDA GPU of compute capability 9.0 or later")
@pytest.mark.parametrize("method", ["fp16", "rtn", "quarot", "mosaicquant", "atom", "resq", "spinquant"])
def test_every_chain_mode_gives_the_same_decode_step_in_a_cuda_graph(monkeypatch, method):
    """The whole fused decode step, captured in a graph under each chain mode, equals plain launches bit for bit."""
    monkeypatch.setitem(shapes.SHAPE_MODELS, _PDL_SHAPES.name, _PDL_SHAPES)
    torch.manual_seed(0)
    model = shapes.build_shape_model(_PDL_SHAPES.name, dtype=torch.bfloat16, device=torch.device("cuda")).eval()
    ctx = QuantContext(calibration=lambda: None, seed=0, device=torch.device("cuda"))
    speed_form(method, model, get_method(method).config() if method != "fp16" else None, ctx)
    executable(model, ctx.info)
    dec = FusedDecoder(model)
    for batch in (1, 4, 8, 32):
        logits = {}
        for mode in ("plain", "off", "on"):
            chosen = settings.KernelSettings(pdl=mode != "plain", pdl_chain="off" if mode == "plain" else mode)
            torch.manual_seed(batch)
            with torch.no_grad(), settings.use(chosen):
                step = fused_decode_step(dec, batch, 40)
                step()  # compile outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = step()
                for _ in range(3):
                    graph.replay()
            torch.cuda.synchronize()
            logits[mode] = out.clone()
        assert logits["plain"].isfinite().all()
        for mode in ("off", "on"):
            assert torch.equal(logits[mode], logits["plain"]), f"{method} batch {batch}: chain {mode!r} differs"
