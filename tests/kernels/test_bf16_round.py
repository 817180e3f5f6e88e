"""The kernels' rounding of fp32 values to BF16 (mosaicquant.kernels._tl.round_to_bf16, split_bf16).

``round_to_bf16(v)`` must equal ``v.to(torch.bfloat16).float()`` (round to nearest, ties to even) for every finite
fp32 ``v``: at, between and one ulp beside BF16 values (the ties), at signed zeros, subnormals, the BF16 range's end
(values that round to infinity) and fp32's extremes. Compiled, two values are rounded with one
``cvt.rn.bf16x2.f32``; the interpreter runs the bit arithmetic. Compiled for sm_90, the fused Hadamard quantizer
carries the conversion for its outputs.
``split_bf16(y)`` must give ``y``'s BF16 rounding and the BF16 rounding of the rest.
"""


import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from mosaicquant.kernels._tl import round_to_bf16, split_bf16

from ._helpers import DEVICE, needs_triton, ptxas_available, sm90_compile


@triton.jit
def _round_kernel(v_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, round_to_bf16(tl.load(v_ptr + offs, mask=mask, other=0.0)), mask=mask)


def _values() -> np.ndarray:
    rng = np.random.default_rng(0)
    bf = rng.normal(0.0, 3.0, 2048).astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
    ties = bf | np.uint32(0x8000)  # halfway between two BF16 values: even and odd last bits both occur
    beside = np.concatenate([ties - np.uint32(1), ties + np.uint32(1)])
    f32 = np.finfo(np.float32)
    bf16_max = np.float32(3.3895313892515355e38)
    extremes = np.array([0.0, -0.0, f32.tiny, -f32.tiny, 1e-45, -1e-45, 3e-39, -3e-39, f32.max, -f32.max, bf16_max,
                         -bf16_max, np.nextafter(bf16_max, np.float32(np.inf)), 3.39e38, 1.0, -1.0, 1 + 2.0**-8,
                         1 + 3 * 2.0**-8, 65504.0, 1e-30], dtype=np.float32)
    subnormal_ties = (np.arange(1, 200, dtype=np.uint32) << np.uint32(16)) | np.uint32(0x8000)
    values = np.concatenate([bf.view(np.float32), ties.view(np.float32), beside.view(np.float32), extremes,
                             subnormal_ties.view(np.float32), -subnormal_ties.view(np.float32),
                             rng.standard_cauchy(4096).astype(np.float32)])
    return values[np.isfinite(values)].astype(np.float32)


@needs_triton()
def test_round_to_bf16_is_round_half_even():
    v = torch.from_numpy(_values())
    out = torch.full(v.shape, float("nan"), device=DEVICE)  # poisoned
    block = 4096
    _round_kernel[(triton.cdiv(len(v), block),)](v.to(DEVICE), out, len(v), BLOCK=block)
    want = v.to(torch.bfloat16).float()
    got = out.cpu()
    same = (got.view(torch.int32) == want.view(torch.int32))
    assert bool(same.all()), (v[~same][:8], got[~same][:8], want[~same][:8])
    assert torch.isinf(want).any()  # the range's end was reached (rounds to infinity)
    assert (want.view(torch.int32) & 0xFFFF).eq(0).all()


_COMPILE = r"""
import importlib, json, torch
from _offline import CompileOnlyDriver, compile_only
from triton.runtime.driver import driver
driver.set_active(CompileOnlyDriver())
hq = importlib.import_module("mosaicquant.kernels.hadamard_quant")
from mosaicquant.methods.hadamard import OnlineHadamard
compiled = compile_only(hq, "_hadamard_quant_kernel")
hq.triton_interpreting = lambda: False
x = torch.zeros(2048, 4096, dtype=torch.bfloat16)
q = torch.zeros(2048, 4096, dtype=torch.int8)
scale = torch.zeros(2048)
hq._launch(x, OnlineHadamard(4096), q, scale, 1.0, True, False, 1, None)
ptx = compiled[0].asm["ptx"]
print(json.dumps({"cvt_bf16x2": ptx.count("cvt.rn.bf16x2.f32")}))
"""


@pytest.mark.skipif(not ptxas_available(), reason="Triton's NVIDIA backend has no ptxas here")
def test_hadamard_quantizer_rounds_by_pairs_for_sm90():
    run, lines = sm90_compile(_COMPILE, timeout=600)
    assert run.returncode == 0 and len(lines) == 1, run.stderr[-2000:]
    # the transform's 16-bit operands take 32 conversions by pairs (split_bf16, and the compiler's conversions of
    # its parts, as many with the bit arithmetic); the rounding adds one per two output values of a thread
    # (4,096 values on 128 threads: 16)
    assert lines[0]["cvt_bf16x2"] >= 32 + 16, lines


@triton.jit
def _split_kernel(v_ptr, hi_ptr, lo_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    hi, lo = split_bf16(tl.load(v_ptr + offs, mask=mask, other=0.0))
    tl.store(hi_ptr + offs, hi, mask=mask)
    tl.store(lo_ptr + offs, lo, mask=mask)


@needs_triton()
def test_split_bf16_is_the_rounding_and_the_rounded_rest():
    v = torch.from_numpy(_values())
    v = v[v.abs() < 1e38]  # y - hi of a value that rounds to infinity is not finite
    # normal values (and zeros): the interpreter's conversion of subnormal fp32 values to BF16 is not exact
    v = v[(v == 0) | (v.abs() >= torch.finfo(torch.float32).tiny)]
    hi = torch.full(v.shape, float("nan"), dtype=torch.bfloat16, device=DEVICE)  # poisoned
    lo = torch.full(v.shape, float("nan"), dtype=torch.bfloat16, device=DEVICE)
    block = 4096
    _split_kernel[(triton.cdiv(len(v), block),)](v.to(DEVICE), hi, lo, len(v), BLOCK=block)
    want_hi = v.to(torch.bfloat16)
    want_lo = (v - want_hi.float()).to(torch.bfloat16)
    assert torch.equal(hi.cpu().view(torch.int16), want_hi.view(torch.int16))
    assert torch.equal(lo.cpu().view(torch.int16), want_lo.view(torch.int16))
    assert (want_lo != 0).sum() > len(v) // 4  # the rest is not trivially zero
