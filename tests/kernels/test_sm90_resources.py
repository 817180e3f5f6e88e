"""GPU resources of kernels compiled for sm_90 (the H100 / H200) on this machine, without a GPU.

The interpreter that runs the kernel tests on a CPU has no shared-memory limit, so a kernel can pass
every CPU test and still not launch on the GPU: the fused Hadamard quantizer asked 256 KiB of shared
memory for Qwen3-14B's and Qwen3-32B's down_proj inputs (17408, 25600) until it folded a Sylvester
level into registers. Here every online-Hadamard size of the SPEC's
model shapes, at every split a token may take, is compiled for ``GPUTarget("cuda", 90, 32)`` through
a stand-in driver (``tests/kernels/_offline.py``), in a subprocess (the driver stays replaced
there), and its shared memory is checked against the SM's limit.
"""

from __future__ import annotations

import json

import pytest

from mosaicquant.harness.shapes import SHAPE_MODELS

from ._helpers import ptxas_available, sm90_compile
# Shared memory one block may use on sm_90 (227 KiB; what Triton's launcher checks against on the H200).
SM90_MAX_SHARED = 232448

# Compiles the Hadamard quantizer for each (size, programs a token, layout) given as JSON on argv and prints
# one JSON line per compile: its shared memory, or the compiler's error.
_COMPILE = r"""
import importlib, json, sys, torch
from _offline import CompileOnlyDriver, compile_only
from triton.runtime.driver import driver
driver.set_active(CompileOnlyDriver())
hq = importlib.import_module("mosaicquant.kernels.hadamard_quant")
from mosaicquant.methods.hadamard import OnlineHadamard
compiled = compile_only(hq, "_hadamard_quant_kernel")
hq.triton_interpreting = lambda: False  # the GPU's 16-bit dots, not the interpreter's fp32 stand-ins
for n, p, layout, gated in json.loads(sys.argv[1]):
    had = OnlineHadamard(n)
    x = torch.zeros(4, 2 * n if gated else n, dtype=torch.bfloat16)
    q = torch.zeros(4, n, dtype=torch.int8)
    scale = torch.zeros(4)
    try:
        hq._launch(x, had, q, scale, 1.0, layout == "split8", gated, p, None, None if p == 1 else torch.ones(4))
        print(json.dumps({"case": [n, p, layout, gated], "shared": compiled[-1].metadata.shared}), flush=True)
    except Exception as exc:
        print(json.dumps({"case": [n, p, layout, gated], "error": f"{type(exc).__name__}: {exc}"[:300]}), flush=True)
"""


@pytest.mark.skipif(not ptxas_available(), reason="Triton's NVIDIA backend has no ptxas here")
def test_every_spec_hadamard_size_fits_an_sm90_block():
    from mosaicquant.kernels import hadamard_quant
    from mosaicquant.methods.hadamard import OnlineHadamard

    sizes = sorted({s for m in SHAPE_MODELS.values() for s in (m.heads * m.head_dim, m.intermediate)})
    assert {17408, 25600} <= set(sizes)
    cases = []
    for n in sizes:
        most = hadamard_quant._split_limit(OnlineHadamard(n))[0]
        for p in (p for p in (1, 2, 4, 8) if p <= most):
            cases.append([n, p, "split8", False])
        cases += [[n, 1, "packed", False], [n, 1, "split8", True]]
    run, lines = sm90_compile(_COMPILE, json.dumps(cases), timeout=1200)
    assert run.returncode == 0 and len(lines) == len(cases), run.stderr[-2000:]
    errors = [line for line in lines if "error" in line]
    assert not errors, errors
    over = [(line["case"], line["shared"]) for line in lines if line["shared"] > SM90_MAX_SHARED]
    assert not over, f"shared memory over {SM90_MAX_SHARED} bytes a block on sm_90: {over}"
