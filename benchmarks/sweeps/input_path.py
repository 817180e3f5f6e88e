"""Checks and times the input side of the W4A4 linears on the GPU: online Hadamard + activation
quantization (PyTorch transform then the Triton quantizer, vs the fused kernel) and projections
that share an input (separate layers vs one stacked GEMM), against BF16 ``F.linear``.

    PYTHONPATH=. python3 benchmarks/sweeps/input_path.py --out $OUT

Shapes: Llama-3-8B ``o_proj`` (4096 → 4096) and ``down_proj`` (14336 → 4096), Qwen3-8B
``down_proj`` (12288 → 4096) with the online Hadamard; Llama-3-8B q/k/v (4096 → 4096 + 1024 +
1024) and gate/up (4096 → 2 × 14336) for the stacked projections. Weights are rotated through
copies larger than L2, every call is captured in a CUDA graph, medians of 15 replays; the
activation quantization is included everywhere. Prints a short table last; writes
``results.json`` under ``--out``. Exit status 1 if a check fails.

Variants (``x`` BF16 ``[M, K]``):

- ``had_torch``: ``OnlineHadamard`` in PyTorch, then the Triton act-quant kernel;
- ``had_fused``: the fused kernel (:mod:`mosaicquant.kernels.hadamard_quant`);
- ``act_only``: the act-quant kernel alone (no transform: the floor);
- ``lin_bf16`` / ``lin_torch_had`` / ``lin_fused_had``: the whole linear (BF16; W4A4 with
  the PyTorch transform; W4A4 with the fused kernel);
- ``proj_bf16`` / ``proj_separate`` / ``proj_stacked``: q/k/v or gate/up as BF16 ``F.linear``
  per member, W4A4 per member, and one stacked W4A4 GEMM.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mosaicquant.harness.timing import time_calls  # noqa: E402
from mosaicquant.kernels.act_quant import quantize_activations_triton  # noqa: E402
from mosaicquant.kernels.convert import FusedProjections, KernelLinear, ProjectionSlice  # noqa: E402
from mosaicquant.kernels.hadamard_quant import hadamard_quantize_reference, hadamard_quantize_triton  # noqa: E402
from mosaicquant.kernels.quant_linear import QuantLinear  # noqa: E402
from mosaicquant.methods.format import PackedW4, unpack_int4  # noqa: E402
from mosaicquant.methods.hadamard import OnlineHadamard  # noqa: E402
from mosaicquant.methods.quant import quantize  # noqa: E402

MS = (1, 4, 16, 32, 128, 512, 2048, 8192)
ROTATE_BYTES = 180 * 2**20
TRANSFORMED = {"llama3.o": (4096, 4096), "llama3.down": (4096, 14336), "qwen3.down": (4096, 12288)}
STACKED = {"llama3.qkv": ([4096, 1024, 1024], 4096), "llama3.gate_up": ([14336, 14336], 4096)}


def packed_layer(n: int, k: int, device) -> PackedW4:
    w = torch.randn(n, k, device=device) * 0.02
    return PackedW4.from_quantized(quantize(w, 4, symmetric=True, scale_dtype=torch.float16)).to(device)


def copies(nbytes_one: int) -> int:
    return max(2, -(-ROTATE_BYTES // max(nbytes_one, 1)) + 1)


def med(calls, min_us=400.0) -> float:
    return time_calls(calls, min_us=min_us, replays=15).median_us


def bench_transformed(name, n, k, device, rows):
    had = OnlineHadamard(k).to(device)
    had_cpu = OnlineHadamard(k)
    packed = packed_layer(n, k, device)
    count = copies(n * k // 2)
    quants = [QuantLinear(packed, kernel="triton") for _ in range(count)]
    fused = [KernelLinear(q, had, fuse_transform=True) for q in quants]
    unfused = [KernelLinear(q, had, fuse_transform=False) for q in quants]
    w16 = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(copies(2 * n * k))]
    for m in MS:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        x[:, ::97] *= 10
        # checks: fused vs unfused quantization, fused vs unfused linear
        p_f, s_f = hadamard_quantize_triton(x, had)
        p_r, s_r = hadamard_quantize_reference(x.cpu(), had_cpu)
        diff = (unpack_int4(p_f.cpu(), k).int() - unpack_int4(p_r, k).int()).abs()
        mismatch = (diff > 0).float().mean().item()
        ok_q = diff.max().item() <= 1 and mismatch <= 1e-3
        y_f, y_u = fused[0](x).float(), unfused[0](x).float()
        rel = ((y_f - y_u).norm() / y_u.norm()).item()
        ok_lin = bool(torch.isfinite(y_f).all()) and rel < 2e-2
        times = {
            "had_torch": med([lambda: quantize_activations_triton(had(x))]),
            "had_fused": med([lambda: hadamard_quantize_triton(x, had)]),
            "act_only": med([lambda: quantize_activations_triton(x)]),
            "lin_bf16": med([lambda w=w: F.linear(x, w) for w in w16]),
            "lin_torch_had": med([lambda mod=mod: mod(x) for mod in unfused]),
            "lin_fused_had": med([lambda mod=mod: mod(x) for mod in fused]),
        }
        row = {"shape": name, "n": n, "k": k, "m": m, "check_quant_ok": ok_q, "int_mismatch": mismatch,
               "check_linear_ok": ok_lin, "linear_rel_diff": rel, **{f"{v}_us": t for v, t in times.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)


def bench_stacked(name, sizes, k, device, rows):
    parts = [packed_layer(n, k, device) for n in sizes]
    stacked = PackedW4.concat_outputs(parts)
    count = copies(sum(sizes) * k // 2)
    sep = [[KernelLinear(QuantLinear(p, kernel="triton"), None) for p in parts] for _ in range(count)]
    groups = []
    for _ in range(count):
        g = FusedProjections(QuantLinear(stacked, kernel="triton"), [f"p{i}" for i in range(len(sizes))], sizes)
        groups.append([ProjectionSlice(g, i) for i in range(len(sizes))])
    w16 = [[torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for n in sizes]
           for _ in range(copies(2 * sum(sizes) * k))]
    for m in MS:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        outs_s = [mod(x).float() for mod in sep[0]]
        outs_g = [mod(x).float() for mod in groups[0]]
        # same integers and scales; the stacked GEMM may pick other tiles (split-K), so its fp32
        # sums differ in order: equal within one BF16 ulp (plus a floor of 1e-3 of the range)
        ok = all(bool(torch.isfinite(a).all()) and bool(((a - b).abs() <= 2.0**-7 * b.abs()
                                                          + 1e-3 * b.abs().max()).all())
                 for a, b in zip(outs_g, outs_s))
        times = {
            "proj_bf16": med([lambda ws=ws: [F.linear(x, w) for w in ws] for ws in w16]),
            "proj_separate": med([lambda mods=mods: [mod(x) for mod in mods] for mods in sep]),
            "proj_stacked": med([lambda mods=mods: [mod(x) for mod in mods] for mods in groups]),
        }
        row = {"shape": name, "n": sum(sizes), "k": k, "m": m, "check_stacked_close": ok,
               **{f"{v}_us": t for v, t in times.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "results/input_path"))
    parser.add_argument("--dry", action="store_true", help="tiny shapes, checks only (CPU, TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    global MS, ROTATE_BYTES, TRANSFORMED, STACKED
    if args.dry:
        MS, ROTATE_BYTES = (1, 13), 1
        TRANSFORMED = {"dry.o": (256, 256), "dry.down": (256, 576)}
        STACKED = {"dry.qkv": ([256, 64, 64], 256)}
    elif not torch.cuda.is_available():
        print("input_path.py times CUDA kernels: no CUDA device here (--dry runs the checks on the CPU)",
              file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    rows: list[dict] = []
    t0 = time.time()
    for name, (n, k) in TRANSFORMED.items():
        bench_transformed(name, n, k, device, rows)
    for name, (sizes, k) in STACKED.items():
        bench_stacked(name, sizes, k, device, rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry)", "rows": rows}, indent=1))
    failed = [r for r in rows if not all(v for key, v in r.items() if key.startswith("check"))]
    print(f"\nchecks: {len(rows) - len(failed)} ok, {len(failed)} FAILED; {time.time() - t0:.0f}s")
    print(f"{'shape':>15} {'M':>5} | {'had_torch':>9} {'had_fused':>9} {'act_only':>8} | "
          f"{'bf16':>7} {'W4 torch-had':>12} {'W4 fused':>9} {'fused/bf16':>10}   (µs)")
    for r in rows:
        if "had_fused_us" in r:
            print(f"{r['shape']:>15} {r['m']:>5} | {r['had_torch_us']:>9.1f} {r['had_fused_us']:>9.1f} "
                  f"{r['act_only_us']:>8.1f} | {r['lin_bf16_us']:>7.1f} {r['lin_torch_had_us']:>12.1f} "
                  f"{r['lin_fused_had_us']:>9.1f} {r['lin_bf16_us'] / r['lin_fused_had_us']:>9.2f}x")
    print(f"{'shape':>15} {'M':>5} | {'bf16':>8} {'W4 separate':>11} {'W4 stacked':>10} {'stacked/bf16':>12}   (µs)")
    for r in rows:
        if "proj_stacked_us" in r:
            print(f"{r['shape']:>15} {r['m']:>5} | {r['proj_bf16_us']:>8.1f} {r['proj_separate_us']:>11.1f} "
                  f"{r['proj_stacked_us']:>10.1f} {r['proj_bf16_us'] / r['proj_stacked_us']:>11.2f}x")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
