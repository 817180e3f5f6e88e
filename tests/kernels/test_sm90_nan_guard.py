"""The NaN-propagating quantizers and the range-checked decode kernels compile for sm_90, without a GPU.

The interpreter runs numpy, not the GPU's instructions: here every changed kernel is compiled for
``GPUTarget("cuda", 90, 32)`` through a stand-in driver (``tests/kernels/_offline.py``, in a
subprocess), and its PTX is read: each quantizer's ranges use the NaN-propagating ``max.NaN`` (and
``min.NaN`` on the asymmetric grids), and each kernel that reads positions or lengths has its atomic OR
of the fault word.
"""

from __future__ import annotations

import pytest

from ._helpers import ptxas_available, sm90_compile

_COMPILE = r"""
import importlib, json, sys, torch
from _offline import CompileOnlyDriver, compile_only
from triton.runtime.driver import driver
driver.set_active(CompileOnlyDriver())
names = ("act_quant", "decoder", "mixed_gemm", "gemv", "hadamard_quant", "_token_split")
mods = {n: importlib.import_module(f"mosaicquant.kernels.{n}") for n in names}
for m in mods.values():
    m.check_triton_device = lambda device: None
    m.triton_interpreting = lambda: False
    m.resolve_kernel = lambda kernel, device=None: "triton"
mods["_token_split"].sm_count = lambda device: 132
mods["act_quant"].sm_count = lambda device: 132
kernels = (("act_quant", "_act_quant_kernel"), ("decoder", "_rope_kv_kernel"), ("decoder", "_attn_split_kernel"),
           ("decoder", "_attn_combine_kernel"), ("decoder", "_rope_attn_kernel"), ("decoder", "_rmsnorm_quant_kernel"),
           ("mixed_gemm", "_mixed_act_quant_kernel"), ("gemv", "_gemv_kernel"),
           ("hadamard_quant", "_hadamard_quant_kernel"))
compiled = {name: compile_only(mods[mod], name) for mod, name in kernels}
dec, aq, mx, gv, hq = (mods[n] for n in ("decoder", "act_quant", "mixed_gemm", "gemv", "hadamard_quant"))
from mosaicquant.methods.hadamard import OnlineHadamard
bf = torch.bfloat16


def case(label, kernel, fn):
    try:
        fn()
        ck = compiled[kernel][-1]
        ck = ck.result() if hasattr(ck, "result") else ck
        ptx = ck.asm["ptx"]
        print(json.dumps({"case": label, "max_nan": ptx.count("max.NaN"), "min_nan": ptx.count("min.NaN"),
                          "or": sum(1 for ln in ptx.splitlines() if ("atom" in ln or "red." in ln) and ".or." in ln)}),
              flush=True)
    except Exception as exc:
        print(json.dumps({"case": label, "error": f"{type(exc).__name__}: {exc}"[:400]}), flush=True)


x = torch.zeros(4, 4096, dtype=bf)
case("act_quant packed", "_act_quant_kernel", lambda: aq.quantize_activations_triton(x))
case("act_quant split8, 4 programs a token", "_act_quant_kernel",
     lambda: aq.quantize_activations_triton(torch.zeros(4, 14336, dtype=bf), layout="split8", programs_per_token=4))
case("act_quant two passes", "_act_quant_kernel",
     lambda: aq.quantize_activations_triton(torch.zeros(4, 20000, dtype=bf)))
case("hadamard_quant", "_hadamard_quant_kernel", lambda: hq.hadamard_quantize_triton(x, OnlineHadamard(4096)))
case("rmsnorm_quant", "_rmsnorm_quant_kernel", lambda: dec.rmsnorm_quant(x, torch.ones(4096, dtype=bf), 1e-5))
for sym in (True, False):
    fmt = mx.MixedFormat(k_lo=4096 - 128, k_hi=128, group_size=128, lo_symmetric=sym, hi_symmetric=sym)
    case(f"mixed act quant symmetric={sym}", "_mixed_act_quant_kernel", lambda: mx.mixed_act_quant_triton(x, fmt))
H, KV, D, L, B = 32, 8, 128, 64, 2
qkv = torch.zeros(B, (H + 2 * KV) * D, dtype=bf)
pos = torch.tensor([1, 2])
cos = torch.zeros(L, D, dtype=bf)
for sym in (True, False):
    kv = dec.KVFormat(4, sym, 0.95, False)
    kc = torch.zeros(B, KV, L, D // 2, dtype=torch.uint8)
    sc = dec.KVScales.empty(B, KV, L, "cpu")
    case(f"rope_kv 4-bit symmetric={sym}", "_rope_kv_kernel",
         lambda: dec.rope_kv(qkv, pos, cos, cos.clone(), kc, kc.clone(), H, KV, 1, kv=kv, scales=sc))
    case(f"decode_rope_attention 4-bit symmetric={sym}", "_rope_attn_kernel",
         lambda: dec.decode_rope_attention(qkv, pos, cos, cos.clone(), kc, kc.clone(), H, KV, D ** -0.5, kv=kv,
                                           scales=sc))
kb = torch.zeros(B, KV, L, D, dtype=bf)
case("decode_attention", "_attn_split_kernel",
     lambda: dec.decode_attention(torch.zeros(B, H, D, dtype=bf), kb, kb.clone(),
                                  torch.tensor([3, 4], dtype=torch.int32), D ** -0.5))
"""

QUANTIZERS = ["act_quant packed", "act_quant split8, 4 programs a token", "act_quant two passes", "hadamard_quant",
              "rmsnorm_quant", "mixed act quant symmetric=True", "mixed act quant symmetric=False",
              "rope_kv 4-bit symmetric=True", "rope_kv 4-bit symmetric=False",
              "decode_rope_attention 4-bit symmetric=True", "decode_rope_attention 4-bit symmetric=False"]
ASYMMETRIC = ["mixed act quant symmetric=False", "rope_kv 4-bit symmetric=False",
              "decode_rope_attention 4-bit symmetric=False"]
RANGE_CHECKED = ["rope_kv 4-bit symmetric=True", "rope_kv 4-bit symmetric=False",
                 "decode_rope_attention 4-bit symmetric=True", "decode_rope_attention 4-bit symmetric=False",
                 "decode_attention"]


@pytest.mark.skipif(not ptxas_available(), reason="Triton's NVIDIA backend has no ptxas here")
def test_guarded_kernels_compile_for_sm90():
    run, lines = sm90_compile(_COMPILE, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    got = {line["case"]: line for line in lines}
    assert set(got) == set(QUANTIZERS) | set(RANGE_CHECKED), (sorted(got), run.stderr[-2000:])
    errors = [line for line in lines if "error" in line]
    assert not errors, errors
    for name in QUANTIZERS:
        assert got[name]["max_nan"] > 0, f"{name}: no NaN-propagating max in its PTX"
    for name in ASYMMETRIC:
        assert got[name]["min_nan"] > 0, f"{name}: no NaN-propagating min in its PTX"
    for name in RANGE_CHECKED:
        assert got[name]["or"] > 0, f"{name}: no atomic OR of the fault word in its PTX"
