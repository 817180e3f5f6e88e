"""The quantizers' rounding to signed 4-bit integers (mosaicquant.kernels._tl.quantize_int4).

``quantize_int4(v)`` must equal ``clamp(round_half_even(v), -8, 7)`` for every finite fp32 ``v``: at and
beside every half-integer of the grid and past it, at signed zeros, subnormals and fp32's extremes. Its
low byte is the integer's two's complement, which the quantizers truncate to ``int8`` or mask to a nibble.
Compiled for sm_90, the quantizers then convert no float to an integer (``F2I``) per value.
"""

import json

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from mosaicquant.kernels._tl import quantize_int4

from ._helpers import DEVICE, needs_triton, ptxas_available, sm90_compile


@triton.jit
def _int4_kernel(v_ptr, byte_ptr, nibble_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    q = quantize_int4(tl.load(v_ptr + offs, mask=mask, other=0.0))
    tl.store(byte_ptr + offs, q.to(tl.int8), mask=mask)
    tl.store(nibble_ptr + offs, (q & 0xF).to(tl.uint8), mask=mask)


def _values() -> np.ndarray:
    halves = np.arange(-40, 41, dtype=np.float32) / 2  # every half-integer (and integer) in [-20, 20]
    near = np.concatenate([halves, np.nextafter(halves, np.float32(-np.inf)), np.nextafter(halves, np.float32(np.inf))])
    f32 = np.finfo(np.float32)
    extremes = np.array([0.0, -0.0, f32.tiny, -f32.tiny, 1e-45, -1e-45, f32.max, -f32.max, 2.0**22, -2.0**22,
                         2.0**23 + 1, -(2.0**23) - 1, 1e30, -1e30], dtype=np.float32)
    rand = np.random.default_rng(0).normal(0.0, 6.0, 4096).astype(np.float32)
    return np.concatenate([near, extremes, rand]).astype(np.float32)


@needs_triton()
def test_quantize_int4_is_clamped_round_half_even():
    v = torch.from_numpy(_values())
    byte = torch.full(v.shape, 99, dtype=torch.int8, device=DEVICE)  # poisoned
    nibble = torch.full(v.shape, 99, dtype=torch.uint8, device=DEVICE)
    block = 8192
    _int4_kernel[(triton.cdiv(len(v), block),)](v.to(DEVICE), byte, nibble, len(v), BLOCK=block)
    want = torch.clamp(torch.round(v), -8, 7).to(torch.int8)  # torch.round: ties to even
    assert torch.equal(byte.cpu(), want), v[byte.cpu() != want][:10]
    assert torch.equal(nibble.cpu(), (want.to(torch.int16) & 0xF).to(torch.uint8))
    assert {int(want.min()), int(want.max())} == {-8, 7}  # both ends of the grid were reached
    assert torch.equal(byte.cpu()[v == 2.5], torch.tensor([2], dtype=torch.int8))  # a tie goes to even
    assert torch.equal(byte.cpu()[v == -3.5], torch.tensor([-4], dtype=torch.int8))


_COMPILE = r"""
import importlib, json, torch
from _offline import CompileOnlyDriver, compile_only
from triton.runtime.driver import driver
driver.set_active(CompileOnlyDriver())
aq = importlib.import_module("mosaicquant.kernels.act_quant")
hq = importlib.import_module("mosaicquant.kernels.hadamard_quant")
from mosaicquant.methods.hadamard import OnlineHadamard
compiled = compile_only(aq, "_act_quant_kernel")
hcompiled = compile_only(hq, "_hadamard_quant_kernel")
hq.triton_interpreting = lambda: False
x = torch.zeros(2048, 4096, dtype=torch.bfloat16)
q = torch.zeros(2048, 4096, dtype=torch.int8)
scale = torch.zeros(2048)
for split8 in (False, True):
    aq._launch(x, q, scale, 4096, 1.0, split8, False, 1, None)
    hq._launch(x, OnlineHadamard(4096), q, scale, 1.0, split8, False, 1, None)
for name, k in [("act_quant", c) for c in compiled] + [("hadamard_quant", c) for c in hcompiled]:
    ptx = k.asm["ptx"]
    print(json.dumps({"kernel": name, "cvt_to_int": ptx.count("cvt.rzi.s") + ptx.count("cvt.rni.s")}))
"""


@pytest.mark.skipif(not ptxas_available(), reason="Triton's NVIDIA backend has no ptxas here")
def test_quantizers_convert_no_float_to_int_for_sm90():
    run, lines = sm90_compile(_COMPILE, timeout=600)
    assert run.returncode == 0 and len(lines) == 4, run.stderr[-2000:]
    assert [line["kernel"] for line in lines] == ["act_quant"] * 2 + ["hadamard_quant"] * 2, json.dumps(lines)
    assert all(line["cvt_to_int"] == 0 for line in lines), lines
