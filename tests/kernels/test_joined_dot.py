"""The swapped GEMM's K steps (and walked units) as one dot on the joined halves (``joined_dot``)."""

import pytest
import torch

from mosaicquant.kernels.act_quant import quantize_activations_reference, quantize_activations_triton
from mosaicquant.kernels.w4a4_gemm import w4a4_gemm_reference, w4a4_gemm_swapped_triton
from mosaicquant.kernels.zipper import zipper_gemm_reference

from ._helpers import (
    DEVICE,
    assert_close_bf16,
    needs_triton,
    pow2_residual,
    ptxas_available,
    random_activations,
    random_layer,
    random_residual,
    sm90_compile,
)


@needs_triton()
@pytest.mark.parametrize("walk", [None, "shared", "shifted", "merged", "int8"])
@pytest.mark.parametrize("m,n,k,block,opts", [
    (13, 200, 300, (128, 128), dict(block_n=128, block_m=64)),                      # ragged N and K (odd K)
    (67, 130, 1000, (64, 256), dict(block_n=128, block_m=64)),                      # K not a multiple of 128
    (29, 130, 1000, (64, 256), dict(block_n=64, block_m=32, split_k=3, num_warps=4)),  # split K
    (40, 256, 512, (128, 128), dict(block_n=128, block_m=16, rem_split=4)),          # whole and split tiles
    (21, 96, 768, (32, 128), dict(block_n=64, block_m=32, block_kp=128, num_warps=4)),  # two split8 blocks a step
])
def test_joined_dot_gives_the_split_dots_bits(walk, m, n, k, block, opts):
    if walk == "merged" and opts.get("block_kp", 64) != 64:
        pytest.skip("the merged walk steps 64 bytes")
    gen = torch.Generator().manual_seed(m * n + k)
    _, qweight, w_scale = random_layer(n, k, gen)
    residual = None
    if walk is not None:
        residual = pow2_residual(random_residual(n, k, block, 0.5, gen), w_scale, gen, max_shift=3)
    x = random_activations(m, k, gen)
    bias = torch.randn(n, generator=gen)
    packed, scale = quantize_activations_reference(x)
    if residual is None:
        ref = w4a4_gemm_reference(packed, scale, qweight, w_scale, k, bias, out_fp32=True)
    else:
        ref = zipper_gemm_reference(packed, scale, qweight, w_scale, k, residual, bias, out_fp32=True)
    a8, s8 = quantize_activations_triton(x.to(DEVICE), layout="split8")
    qweight, w_scale, bias = qweight.to(DEVICE), w_scale.to(DEVICE), bias.to(DEVICE)
    kw = dict(opts)
    if residual is not None:
        kw.update(residual=residual.to(DEVICE), residual_walk=walk)
    outs = []
    for joined in (True, False):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        w4a4_gemm_swapped_triton(a8, s8, qweight, w_scale, k, bias, joined_dot=joined, out=out, **kw)
        outs.append(out)
    assert_close_bf16(outs[0], ref, f"joined dot, walk {walk}, M={m} N={n} K={k} {opts}")
    # the same integer sums in the same order of float operations: the same bits
    assert torch.equal(outs[0], outs[1])


# Compiles the swapped GEMM at its prefill tiles for sm_90 (tests/kernels/_offline.py's stand-in driver, in a
# subprocess: the driver stays replaced there), dense and with each power-of-two walk, with and without the joined
# dot, and prints one JSON line a compile with what its PTX holds.
_COMPILE = r"""
import importlib, json, torch
from _offline import CompileOnlyDriver, compile_only
from triton.runtime.driver import driver
driver.set_active(CompileOnlyDriver())
from mosaicquant.kernels import _tiles
_tiles._sm_count = lambda device: 132
wmod = importlib.import_module("mosaicquant.kernels.w4a4_gemm")
wmod.triton_interpreting = lambda: False
wmod.check_triton_device = lambda device: None
compiled = compile_only(wmod, "_w4a4_swapped_kernel")
from _helpers import pow2_residual, random_residual
from mosaicquant.methods.format import residual_shifts
gen = torch.Generator().manual_seed(0)
m, n, k = 2048, 1024, 1024
qw = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
ws = (torch.rand(n, generator=gen) * 0.01 + 0.001).to(torch.float16)
res = pow2_residual(random_residual(n, k, (128, 128), 0.25, gen), ws, gen, max_shift=3)
shifts = residual_shifts(res, ws)
a = torch.zeros(m, k, dtype=torch.int8)
for walk in (None, "shared", "merged"):
    for joined in (False, True):
        kw = {} if walk is None else dict(residual=res, residual_walk=walk, residual_shifts=shifts)
        if walk == "merged":
            kw.update(residual_operand=wmod.merged_residual_operand(qw, k, res, shifts),
                      dense_steps=wmod.dense_step_table(res, k))
        wmod.w4a4_gemm_swapped_triton(a, torch.ones(m), qw, ws, k, joined_dot=joined, **kw)
        ck = compiled[-1]
        ptx = (ck.result() if hasattr(ck, "result") else ck).asm["ptx"]
        print(json.dumps({"walk": walk, "joined": joined, "mma": ptx.count("wgmma.mma_async"),
                          "waits": ptx.count("wgmma.wait_group"), "st_shared": ptx.count("st.shared"),
                          "shfl": ptx.count("shfl.sync"), "prmt": ptx.count("prmt")}), flush=True)
"""


@pytest.mark.skipif(not ptxas_available(), reason="Triton's NVIDIA backend has no ptxas here")
def test_joined_dot_halves_the_waits_and_moves_no_data_on_sm90():
    # wgmma with its first operand in registers is waited for before the next step (Triton 3.6): two dots a step,
    # two waits. Joined, one wait a step (the walks' units too), and the join is a renaming of registers: no
    # shuffles, byte permutes or shared-memory stores beyond the split form's
    run, rows = sm90_compile(_COMPILE, timeout=900)
    assert run.returncode == 0 and len(rows) == 6, run.stderr[-2000:]
    by = {(r["walk"], r["joined"]): r for r in rows}
    for walk in (None, "shared", "merged"):
        split, joined = by[(walk, False)], by[(walk, True)]
        assert joined["mma"] == split["mma"], (walk, split, joined)  # the same wgmma instructions
        assert 2 * joined["waits"] == split["waits"], (walk, split, joined)
        for key in ("st_shared", "shfl", "prmt"):
            assert joined[key] == split[key], (walk, key, split, joined)
