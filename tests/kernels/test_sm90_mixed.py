"""Atom's decode kernels compile for sm_90 (the H100 / H200) without a GPU, in every form the decode sweep times.

The mixed GEMM's decode tiles with groups a K step and the 16q unpacking, and the mixed activation quantizer with a
token's groups dealt over programs: each is compiled for ``GPUTarget("cuda", 90, 32)`` through the stand-in driver
(``tests/kernels/_offline.py``, in a subprocess), and its PTX and resources are read. Neither kernel is in the decode
step's PDL chain (measured slower on the H100: docs/speed.md), so neither waits nor signals.
"""

from __future__ import annotations

import pytest

from ._helpers import ptxas_available, sm90_compile
from .test_sm90_resources import SM90_MAX_SHARED

_COMPILE = r"""
import importlib, json, os, subprocess, tempfile, torch, triton
from _offline import CompileOnlyDriver, compile_only
from triton.runtime.driver import driver
driver.set_active(CompileOnlyDriver())
mx = importlib.import_module("mosaicquant.kernels.mixed_gemm")
mx.check_triton_device = lambda device: None
mx.triton_interpreting = lambda: False
gemm = compile_only(mx, "_mixed_gemm_kernel")
quant = compile_only(mx, "_mixed_act_quant_kernel")
fmt = mx.MixedFormat(k_lo=4096 - 128, k_hi=128, group_size=128, lo_clip=0.9)
gen = torch.Generator().manual_seed(0)
w = mx.mixed_weights(torch.randint(-8, 8, (6144, fmt.k_lo), generator=gen, dtype=torch.int8),
                     torch.ones(6144, fmt.n_groups, dtype=torch.float16),
                     torch.randint(-127, 128, (6144, fmt.k_hi), generator=gen, dtype=torch.int8),
                     torch.ones(6144), fmt)
acts = mx._fill_unused(mx._empty_acts(4, fmt, "cpu"), fmt)
x = torch.zeros(4, 4096, dtype=torch.bfloat16)


CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def usage(ck):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(ck.asm["cubin"])
        fh.flush()
        out = subprocess.run([CUOBJDUMP, "--dump-resource-usage", fh.name], capture_output=True, text=True,
                             check=True).stdout
    fields = dict(t.split(":", 1) for t in out.split() if ":" in t)
    return int(fields.get("REG", -1)), int(fields.get("STACK", 0))


def report(label, compiled):
    ck = compiled[-1]
    ck = ck.result() if hasattr(ck, "result") else ck
    ptx = ck.asm["ptx"]
    regs, stack = usage(ck)
    print(json.dumps({"case": label, "shared": ck.metadata.shared, "regs": regs, "stack": stack,
                      "wait": ptx.count("griddepcontrol.wait"), "signal": ptx.count("griddepcontrol.launch_dependents"),
                      "prefetch": ptx.count("prefetch.global.L2")}),
          flush=True)


for chunks in (1, 31):
    label = f"quant chunks={chunks}"
    try:
        mx.mixed_act_quant_triton(x, fmt, torch.arange(4096, dtype=torch.int32), chunks=chunks)
        report(label, quant)
    except Exception as exc:
        print(json.dumps({"case": label, "error": f"{type(exc).__name__}: {exc}"[:400]}), flush=True)
for bn, gps, x16, stages in ((32, 1, False, 4), (32, 2, True, 3), (64, 2, True, 6), (128, 2, False, 3),
                             (128, 1, True, 6)):
    label = f"gemm n{bn} g{gps} x16={x16} s{stages}"
    cfg = mx.MixedTileConfig(16, bn, 64, 64, num_warps=4, num_stages=stages, split_k=2, groups_per_step=gps,
                             x16=x16)
    try:
        mx.mixed_gemm_triton(acts, w, fmt, config=cfg)
        report(label, gemm)
    except Exception as exc:
        print(json.dumps({"case": label, "error": f"{type(exc).__name__}: {exc}"[:400]}), flush=True)
"""


@pytest.mark.skipif(not ptxas_available(), reason="Triton's NVIDIA backend has no ptxas here")
def test_mixed_decode_kernels_compile_for_sm90():
    run, lines = sm90_compile(_COMPILE, timeout=1200)
    assert run.returncode == 0 and len(lines) == 7, run.stderr[-3000:]
    errors = [line for line in lines if "error" in line]
    assert not errors, errors
    for line in lines:
        assert line["shared"] <= SM90_MAX_SHARED and 0 < line["regs"] <= 255 and line["stack"] == 0, line
        assert line["wait"] == 0 and line["signal"] == 0 and line["prefetch"] == 0, f"a PDL instruction: {line}"
