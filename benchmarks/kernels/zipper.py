"""Check and time the W4A4 kernels (dense, ZipperEngine fused, unfused) against BF16 cuBLAS.

Shapes: the linear layers of Llama-3-8B and Qwen3-8B (random weights of the real shapes),
M = 1 … 8192. Variants per (shape, M):

- ``bf16``: ``F.linear`` (cuBLAS), the baseline every ratio refers to;
- ``ql_dense`` / ``ql_zip10``: not timed again, a label on the measured variant that ``QuantLinear``
  runs at that M for a layer without / with the 10% residual (``same_as`` names it);
- ``int8_mm``: ``torch._int_mm`` on pre-quantized int8 operands (no activation quantization);
- ``act_quant``: the activation quantizer alone;
- ``w4a4``: activation quantization + dense W4A4 GEMM (nibbles unpacked as ``16 q``, the
  default); ``w4a4_x1``: the same with the plain sign-extending unpacking;
- ``w4a4_swapdec`` (M = 16 … 32): split8 activation quantization + the swapped GEMM at decode
  tiles (what ``QuantLinear`` runs for a layer without residual at these M);
- ``w4a4_swapmid`` / ``zip10_swapmid`` (mid-sized M where ``_tiles.swapped_mid_config`` gives tiles):
  split8 activation quantization + the swapped GEMM at its mid tiles, dense / with the 10 % residual on
  the shared walk (what ``QuantLinear`` runs there);
- ``zip{p}``: activation quantization + ZipperEngine with a ``p`` % residual budget (random
  block selection, 128×128 blocks), fusion mode ``auto`` (its residual walk on dp4a up to
  ``DP4A_WALK_MAX_M`` tokens); ``zip10_inline`` / ``zip10_tail`` force a mode; ``zip10_dot``
  (M ≤ ``DP4A_WALK_MAX_M``): the tensor-core residual walk;
- ``gemv`` / ``gemv_zip10`` (M ≤ 8): activation quantization + the dp4a decode GEMV, dense and
  with the 10 % residual;
- ``unfused10``: activation quantization + dense GEMM (fp32 out) + residual kernel (+ add);
- ``w4a4_nopdl``, ``w4a4_pdl_nopf``, ``w4a4_pdl_pf``: ``w4a4`` without programmatic dependent
  launch, with it but no L2 weight prefetch, with it and each program's whole weight slice
  prefetched into L2 while the activation kernel runs; ``zip10_pdl`` / ``zip10_nopdl``: ``zip10``
  with PDL forced on (default prefetch) / off. The plain variants use the defaults
  (``mosaicquant.kernels._tiles.pdl_default`` / ``prefetch_default``);
- ``w4a4_swap`` (M ≥ 128): activation quantization to the ``split8`` int8 layout + the
  operand-swapped dense GEMM (``Cᵀ = W Aᵀ``, 128 weight rows × 128 tokens per program, 8 warps,
  3 stages; ``_s4``: 4 stages, ``_bm64``: 64 tokens per program); ``zip{p}_swap``: the same with
  the ``p`` % residual fused in its tail (what ``QuantLinear`` runs at M ≥ ``SWAP_MIN_M``: the
  ``"shared"`` walk, the kept blocks' int8 dots into the dense accumulator, in the row-tile order of
  ``w4a4_gemm.row_tile_order`` where ``_tiles.SWAP_ROW_ORDER`` says so), ``zip10_swap_fp8`` with
  FP8 dots accumulating into the output tile (the walk for free residual scales),
  ``zip10_swap_int8`` with int8 dots into a second accumulator; ``zip10_swap_x1`` / ``w4a4_swap_x1``
  / ``zip10_x1``: the plain sign-extending unpacking instead of ``16 q`` (the default everywhere;
  the swapped one on the FP8 walk); ``zip10_swap_cc``: the FP8 walk with the compiler's element-wise
  e4m3 conversions instead of the inline-PTX ones (the default).

The residuals' scales are the base rows' scales times ``2^-j`` (random ``j`` in 0..4), MosaicQuant's
default format (``rscale=pow2``); the packed kernels and the FP8 / int8 walks run it as any other.

Each variant is checked against its PyTorch reference before it is timed. Timing: CUDA
graphs of back-to-back calls whose weights rotate through copies larger than 3× L2
(launch overhead excluded, as in decode with CUDA graphs), median over replays.
Results: ``results.json`` / ``results.csv`` under ``--out``, a short table printed last.

Usage (on the GPU machine)::

    PYTHONUNBUFFERED=1 python benchmarks/kernels/zipper.py --out $OUT
    TRITON_INTERPRET=1 python benchmarks/kernels/zipper.py --dry   # CPU: correctness on tiny shapes
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mosaicquant.harness.shapes import SHAPE_MODELS  # noqa: E402
from mosaicquant.harness.timing import time_calls as _time_calls  # noqa: E402
from mosaicquant.kernels import _tiles  # noqa: E402
from mosaicquant.kernels._tiles import (  # noqa: E402
    DP4A_WALK_MAX_M,
    GEMV_ROUTE_MAX_M,
    SWAP_DECODE_M,
    TileConfig,
    pick_config,
    swapped_decode_config,
    swapped_mid_config,
    swapped_prefill,
)
from mosaicquant.kernels.act_quant import quantize_activations_reference, quantize_activations_triton  # noqa: E402
from mosaicquant.kernels.gemv import gemv_reason, gemv_triton  # noqa: E402
from mosaicquant.kernels.residual_gemm import residual_add_triton  # noqa: E402
from mosaicquant.kernels.w4a4_gemm import (  # noqa: E402
    row_tile_order,
    w4a4_gemm_reference,
    w4a4_gemm_swapped_triton,
    w4a4_gemm_triton,
)
from mosaicquant.kernels.zipper import residual_block_map, zipper_gemm_reference, zipper_gemm_triton  # noqa: E402
from mosaicquant.methods.format import ResidualBlocks, residual_shifts  # noqa: E402

# the SPEC §4 shapes (--models), from the library's shape models: q/k/v rows are (q heads + 2 kv heads) x head size
_SHAPE_MODELS = {"llama3-8b": "llama-3-8b-shapes", "qwen3-8b": "qwen3-8b-shapes", "qwen3-14b": "qwen3-14b-shapes",
                 "qwen3-32b": "qwen3-32b-shapes", "llama3.2-3b": "llama-3.2-3b-shapes", "qwen3-4b": "qwen3-4b-shapes"}


def _linears(s) -> dict[str, tuple[int, int]]:
    """``(N, K)`` of a shape model's q/k/v, o, gate/up and down linears."""
    return {"qkv": ((s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden), "o": (s.hidden, s.heads * s.head_dim),
            "gate_up": (2 * s.intermediate, s.hidden), "down": (s.hidden, s.intermediate)}


MODELS = {key: _linears(SHAPE_MODELS[name]) for key, name in _SHAPE_MODELS.items()}
DEFAULT_MS = (1, 4, 8, 16, 32, 64, 128, 256, 512, 2048, 8192)
BLOCK = (128, 128)
ROTATE_BYTES = 3 * 60 * 2**20
SWAP_MIN_M = 128  # the swapped GEMM is a prefill variant, timed from here (every M in --dry)
DRY = False  # --dry: tiny shapes, every variant at every M
# bf16 output vs fp32 reference: one bf16 ulp relative, plus an absolute floor at 1e-3 of the output range.
CHECK_RTOL = 2.0**-7
CHECK_ATOL_FRAC = 1e-3


def random_residual(n: int, k: int, budget: float, device, gen: torch.Generator,
                    w_scale: torch.Tensor | None = None, max_shift: int = 4) -> ResidualBlocks:
    """Random kept blocks (budget = fraction of all blocks), random 4-bit values and scales (with ``w_scale``:
    each row's base scale times ``2^-j``, ``j`` random in 0..``max_shift``, MosaicQuant's ``rscale=pow2``)."""
    bn, bk = BLOCK
    nbr, nbc = -(-n // bn), -(-k // bk)
    total = nbr * nbc
    nb = int(round(budget * total))
    if nb == 0:
        return ResidualBlocks.empty((n, k), BLOCK, device=device)
    idx = torch.randperm(total, generator=gen, device="cpu")[:nb].sort().values.to(device)
    coords = torch.stack([idx // nbc, idx % nbc], 1).to(torch.int32)
    counts = torch.bincount(coords[:, 0].long(), minlength=nbr)
    row_ptr = torch.zeros(nbr + 1, dtype=torch.int32, device=device)
    row_ptr[1:] = torch.cumsum(counts, 0).to(torch.int32)
    values = torch.randint(0, 256, (nb, bn, bk // 2), dtype=torch.uint8, device=device, generator=None)
    scales = (torch.rand(nb, bn, device=device) * 0.02 + 0.001).to(torch.float16)
    if w_scale is not None:
        rows = (coords[:, 0].long().unsqueeze(1) * bn + torch.arange(bn, device=device)).clamp(max=n - 1)
        shifts = torch.randint(0, max_shift + 1, (nb, bn), device=device)
        scales = (w_scale.float()[rows] * 2.0 ** -shifts).to(torch.float16)
    return ResidualBlocks((n, k), BLOCK, coords, row_ptr, values, scales)


def random_w4_copies(n: int, kp: int, device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Random packed weights ``[n, kp]`` and fp16 channel scales, and copies of both to rotate through
    more than :data:`ROTATE_BYTES` (at least two): ``(qweights, w_scales)``, the originals first."""
    qweight = torch.randint(0, 256, (n, kp), dtype=torch.uint8, device=device)
    w_scale = (torch.rand(n, device=device) * 0.01 + 0.001).to(torch.float16)
    copies = max(2, math.ceil(ROTATE_BYTES / (qweight.numel() + 2 * n)))
    return ([qweight] + [qweight.clone() for _ in range(copies - 1)],
            [w_scale] + [w_scale.clone() for _ in range(copies - 1)])


def clone_residual(r: ResidualBlocks) -> ResidualBlocks:
    return ResidualBlocks(r.shape, r.block_shape, r.coords.clone(), r.row_ptr.clone(), r.values.clone(), r.scales.clone())


def check(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
    out = out.float()
    ref = ref.float()
    atol = CHECK_ATOL_FRAC * ref.abs().max().item()
    err = (out - ref).abs()
    ok = bool(torch.isfinite(out).all()) and bool((err <= CHECK_RTOL * ref.abs() + atol).all())
    rel = (err.max() / ref.abs().max().clamp_min(1e-30)).item()
    return ok, rel


def time_calls(calls, min_us: float = 400.0, replays: int = 15) -> tuple[float, float, str]:
    """Median µs per call (and spread: IQR/median) of ``calls`` (a list of closures cycled in order)."""
    t = _time_calls(calls, min_us=min_us, replays=replays)
    return t.median_us, 2 * t.spread_us / t.median_us if t.median_us else 0.0, t.how


def measure_ceilings(device) -> dict:
    if device.type != "cuda":
        return {}
    warm = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(50):  # bring the clocks up before measuring
        warm @ warm
    torch.cuda.synchronize()
    del warm
    # An element-wise kernel, not copy_(): a captured device-to-device copy_ becomes a graph
    # memcpy node served by the copy engines, which is slower than the SMs' streaming rate.
    src = torch.randn(2**28, device=device)
    dst = torch.empty_like(src)
    us, _, _ = time_calls([lambda: torch.mul(src, 1.0, out=dst)], min_us=5000, replays=5)
    copy_tbs = 2 * src.numel() * src.element_size() / (us * 1e-6) / 1e12
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    us, _, _ = time_calls([lambda: a @ b], min_us=20000, replays=5)
    return {"copy_TBps_read_plus_write": copy_tbs, "bf16_mm_8192_TFLOPs": 2 * 8192**3 / (us * 1e-6) / 1e12}


def bench_shape(n, k, ms, budgets, device, gen, rows, explore_cfgs, variants_filter):
    kp = (k + 1) // 2
    w_bf16 = (torch.randn(n, k, device=device) * 0.02).to(torch.bfloat16)
    n_bf = max(2, math.ceil(ROTATE_BYTES / w_bf16.numel() / 2))
    w_bf16s = [w_bf16] + [w_bf16.clone() for _ in range(n_bf - 1)]
    qweights, w_scales = random_w4_copies(n, kp, device)
    qweight, w_scale, n_w4 = qweights[0], w_scales[0], len(qweights)
    w4_bytes = qweight.numel() + 2 * n
    residuals, shifts, orders = {}, {}, {}
    for b in sorted(set(budgets) | {10}):
        r = random_residual(n, k, b / 100, device, gen, w_scale=w_scale)
        rs = [r] + [clone_residual(r) for _ in range(n_w4 - 1)]
        residuals[b] = (rs, [residual_block_map(x) for x in rs])
        shifts[b] = [residual_shifts(x, w_scales[i]) for i, x in enumerate(rs)]
        # the weight-row tiles' order QuantLinear passes the shared walk's prefill tiles (_tiles.SWAP_ROW_ORDER)
        orders[b] = [row_tile_order(x, BLOCK[0]) for x in rs]
    w_i8 = torch.randint(-8, 8, (k, n), dtype=torch.int8, device=device)
    n_i8 = max(2, math.ceil(ROTATE_BYTES / w_i8.numel()))
    w_i8s = [w_i8] + [w_i8.clone() for _ in range(n_i8 - 1)]

    for m in ms:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        x[:, :: max(1, k // 7)] *= 8  # a few outlier channels, never all-equal rows
        # The act-quant reference runs on the CPU: torch's CUDA division by a Python scalar
        # multiplies by the reciprocal, which can move a scale by one ulp.
        ap_cpu, as_cpu = quantize_activations_reference(x.cpu())
        ap, a_s = quantize_activations_triton(x)
        act_ok = torch.equal(ap.cpu(), ap_cpu) and torch.equal(a_s.cpu(), as_cpu)
        ap_ref, as_ref = ap, a_s  # each GEMM is checked on the integers it is given
        flops = 2.0 * m * n * k
        io_bytes = m * k * 2 + m * n * 2

        def add(variant, calls, ok, rel, wbytes, extra=None):
            if variants_filter and variant not in variants_filter and not variant.startswith("cfg"):
                return
            try:
                us, spread, how = time_calls(calls)
            except Exception as exc:  # recorded, the run goes on
                rows.append({"n": n, "k": k, "m": m, "variant": variant, "error": repr(exc)[:200]})
                print(f"  {variant}: ERROR {exc!r}"[:200], flush=True)
                return
            row = {
                "n": n, "k": k, "m": m, "variant": variant, "us": us, "spread_iqr_over_median": spread,
                "timing": how, "TFLOPs": flops / (us * 1e-6) / 1e12, "GBps": (wbytes + io_bytes) / (us * 1e-6) / 1e9,
                "check_ok": ok, "max_rel_err": rel,
            }
            if extra:
                row.update(extra)
            rows.append(row)

        def bf16_call(i):
            return lambda: F.linear(x, w_bf16s[i])
        add("bf16", [bf16_call(i) for i in range(n_bf)], True, 0.0, n * k * 2)

        x_i8 = torch.randint(-8, 8, (m, k), dtype=torch.int8, device=device)
        try:
            torch._int_mm(x_i8, w_i8)
            add("int8_mm", [(lambda i=i: torch._int_mm(x_i8, w_i8s[i])) for i in range(n_i8)], True, 0.0, n * k)
        except RuntimeError as exc:
            rows.append({"n": n, "k": k, "m": m, "variant": "int8_mm", "error": str(exc)[:200]})

        add("act_quant", [lambda: quantize_activations_triton(x)], act_ok, 0.0, 0)

        ref = w4a4_gemm_reference(ap_ref, as_ref, qweight, w_scale, k, out_fp32=True)
        ok, rel = check(w4a4_gemm_triton(ap, a_s, qweight, w_scale, k), ref)
        ok = ok and act_ok

        def w4_call(i, cfg=None, pdl=None, prefetch_mib=None, x16=True):
            def call():
                p, s = quantize_activations_triton(x)
                return w4a4_gemm_triton(p, s, qweights[i], w_scales[i], k, config=cfg, pdl=pdl, prefetch_mib=prefetch_mib,
                                        x16=x16)
            return call
        cfg = pick_config(m, n, kp, device)
        add("w4a4", [w4_call(i) for i in range(n_w4)], ok, rel, w4_bytes, {"config": repr(cfg)})
        xok, xrel = check(w4a4_gemm_triton(ap, a_s, qweight, w_scale, k, x16=False), ref)
        add("w4a4_x1", [w4_call(i, x16=False) for i in range(n_w4)], xok and act_ok, xrel, w4_bytes)
        # the same launches without programmatic dependent launch, with it but no L2 weight
        # prefetch, with it and every program's whole weight slice prefetched
        for tag, pdl, pf in (("nopdl", False, None), ("pdl_nopf", True, 0), ("pdl_pf", True, 1 << 16)):
            pok, prel = check(w4a4_gemm_triton(ap, a_s, qweight, w_scale, k, pdl=pdl, prefetch_mib=pf), ref)
            add(f"w4a4_{tag}", [w4_call(i, pdl=pdl, prefetch_mib=pf) for i in range(n_w4)], pok and act_ok, prel, w4_bytes)
        # the operand-swapped GEMM (weights unpacked in registers as the first operand, activations in
        # the split8 int8 layout), with its own activation quantization: at decode tiles where
        # QuantLinear runs it for a dense layer, at its prefill tiles (and variants) from SWAP_MIN_M
        swap_variants = []
        if SWAP_DECODE_M[0] <= m <= SWAP_DECODE_M[1] or DRY:
            swap_variants.append(("swapdec", swapped_decode_config(m, n, kp, device)))
        mid = swapped_mid_config(m, n, kp, device, residual=False)
        if mid is not None:
            swap_variants.append(("swapmid", mid))
        if m >= SWAP_MIN_M:
            swap_variants += [("swap", {}), ("swap_x1", {"x16": False}), ("swap_s4", {"num_stages": 4}),
                              ("swap_bm64", {"block_m": 64})]
        for tag, opts in swap_variants:
            def s_call(i, opts=opts):
                def call():
                    q8, s8 = quantize_activations_triton(x, layout="split8")
                    return w4a4_gemm_swapped_triton(q8, s8, qweights[i], w_scales[i], k, **opts)
                return call
            q8, s8 = quantize_activations_triton(x, layout="split8")
            sok, srel = check(w4a4_gemm_swapped_triton(q8, s8, qweight, w_scale, k, **opts), ref)
            add(f"w4a4_{tag}", [s_call(i) for i in range(n_w4)], sok and act_ok, srel, w4_bytes, {"tiles": opts})
        for j, ecfg in enumerate(explore_cfgs(m)):
            try:
                eok, erel = check(w4a4_gemm_triton(ap, a_s, qweight, w_scale, k, config=ecfg), ref)
            except Exception as exc:
                print(f"  cfg{j}: ERROR {exc!r}"[:200], flush=True)
                continue
            add(f"cfg{j}_w4a4", [w4_call(i, ecfg) for i in range(n_w4)], eok, erel, w4_bytes, {"config": repr(ecfg)})

        for b, mode in [(b, "auto") for b in budgets] + [(10, "inline"), (10, "tail")]:
            rs, maps = residuals[b]
            res_bytes = sum(rs[0].nbytes().values())
            zref = zipper_gemm_reference(ap_ref, as_ref, qweight, w_scale, k, rs[0], out_fp32=True)
            zok, zrel = check(zipper_gemm_triton(ap, a_s, qweight, w_scale, k, rs[0], block_map=maps[0], mode=mode), zref)

            def z_call(i, b=b, mode=mode, pdl=None):
                rs_, maps_ = residuals[b]
                def call():
                    p, s = quantize_activations_triton(x)
                    return zipper_gemm_triton(p, s, qweights[i], w_scales[i], k, rs_[i], block_map=maps_[i], mode=mode,
                                              pdl=pdl)
                return call
            name = f"zip{b}" if mode == "auto" else f"zip{b}_{mode}"
            add(name, [z_call(i) for i in range(n_w4)], zok and act_ok, zrel, w4_bytes + res_bytes,
                {"blocks": rs[0].num_blocks})
            walks = [("", {"residual_walk": "shared"})] + (
                [("_fp8", {"residual_walk": "fp8"}), ("_int8", {"residual_walk": "int8"}),
                 ("_x1", {"residual_walk": "fp8", "x16": False}),
                 ("_cc", {"residual_walk": "fp8", "e4m3_asm": False})] if b == 10 else [])
            walks = walks if m >= SWAP_MIN_M else []
            mid = swapped_mid_config(m, n, kp, device, residual=True) if b == 10 else None
            if mid is not None:
                walks = walks + [("mid", dict(mid, residual_walk="shared"))]
            for suffix, wopts in walks if mode == "auto" and b > 0 else []:
                def zs_call(i, b=b, wopts=wopts):
                    rs_ = residuals[b][0]
                    # the shared walk's shifts come with the layer (QuantLinear derives them once): deriving
                    # them in the call would synchronise with the host inside the graph capture
                    sh = {"residual_shifts": shifts[b][i]} if wopts.get("residual_walk") == "shared" else {}
                    if sh and _tiles.swapped_row_order(wopts, BLOCK[0], device=device):
                        sh["row_order"] = orders[b][i]  # as QuantLinear.forward_split8 runs the call
                    def call():
                        q8, s8 = quantize_activations_triton(x, layout="split8")
                        return w4a4_gemm_swapped_triton(q8, s8, qweights[i], w_scales[i], k, residual=rs_[i], **wopts,
                                                        **sh)
                    return call
                q8, s8 = quantize_activations_triton(x, layout="split8")
                sok, srel = check(w4a4_gemm_swapped_triton(q8, s8, qweight, w_scale, k, residual=rs[0], **wopts), zref)
                add(f"zip{b}_swap{suffix}", [zs_call(i) for i in range(n_w4)], sok and act_ok, srel,
                    w4_bytes + res_bytes, {"blocks": rs[0].num_blocks})
            if b == 10 and mode == "auto":
                xout = zipper_gemm_triton(ap, a_s, qweight, w_scale, k, rs[0], block_map=maps[0], x16=False)
                xok, xrel = check(xout, zref)

                def zx_call(i):
                    rs_, maps_ = residuals[10]
                    def call():
                        p, s = quantize_activations_triton(x)
                        return zipper_gemm_triton(p, s, qweights[i], w_scales[i], k, rs_[i], block_map=maps_[i], x16=False)
                    return call
                add("zip10_x1", [zx_call(i) for i in range(n_w4)], xok and act_ok, xrel, w4_bytes + res_bytes,
                    {"blocks": rs[0].num_blocks})
                for tag, pdl in (("pdl", True), ("nopdl", False)):
                    pout = zipper_gemm_triton(ap, a_s, qweight, w_scale, k, rs[0], block_map=maps[0], pdl=pdl)
                    pok, prel = check(pout, zref)
                    add(f"zip10_{tag}", [z_call(i, pdl=pdl) for i in range(n_w4)], pok and act_ok, prel,
                        w4_bytes + res_bytes, {"blocks": rs[0].num_blocks})
            if b == 10 and mode == "auto":
                dense = w4a4_gemm_triton(ap, a_s, qweight, w_scale, k, out_fp32=True)
                uok, urel = check(residual_add_triton(ap, a_s, dense, rs[0], k), zref)

                def u_call(i):
                    def call():
                        p, s = quantize_activations_triton(x)
                        d = w4a4_gemm_triton(p, s, qweights[i], w_scales[i], k, out_fp32=True)
                        return residual_add_triton(p, s, d, rs[i], k)
                    return call
                add("unfused10", [u_call(i) for i in range(n_w4)], uok and act_ok, urel, w4_bytes + res_bytes)
            if b == 10 and mode == "auto" and m <= DP4A_WALK_MAX_M:
                # the tensor-core residual walk where zip10 (auto) walks on dp4a
                dout = zipper_gemm_triton(ap, a_s, qweight, w_scale, k, rs[0], block_map=maps[0], residual_walk="dot")
                dok, drel = check(dout, zref)

                def zd_call(i):
                    rs_, maps_ = residuals[10]
                    def call():
                        p, s = quantize_activations_triton(x)
                        return zipper_gemm_triton(p, s, qweights[i], w_scales[i], k, rs_[i], block_map=maps_[i],
                                                  residual_walk="dot")
                    return call
                add("zip10_dot", [zd_call(i) for i in range(n_w4)], dok and act_ok, drel, w4_bytes + res_bytes,
                    {"blocks": rs[0].num_blocks})
            if b == 10 and mode == "auto" and gemv_reason(m, k, rs[0]) is None:
                # the decode GEMV (dp4a), dense and with the residual
                for gname, gres, gref in (("gemv", None, ref), ("gemv_zip10", rs, zref)):
                    gok, grel = check(gemv_triton(ap, a_s, qweight, w_scale, k, residual=gres and gres[0]), gref)

                    def g_call(i, gres=gres):
                        def call():
                            p, s = quantize_activations_triton(x)
                            return gemv_triton(p, s, qweights[i], w_scales[i], k, residual=gres and gres[i])
                        return call
                    add(gname, [g_call(i) for i in range(n_w4)], gok and act_ok, grel,
                        w4_bytes + (res_bytes if gres else 0))
        shown = [r for r in rows if r.get("n") == n and r.get("k") == k and r.get("m") == m and "us" in r]
        base = next((r["us"] for r in shown if r["variant"] == "bf16"), float("nan"))
        for r in shown:
            r["speedup_vs_bf16"] = base / r["us"]
        print(f"N={n} K={k} M={m}: " + "  ".join(
            f"{r['variant']}={r['us']:.1f}us({r['speedup_vs_bf16']:.2f}x{'' if r['check_ok'] else ' FAIL'})" for r in shown
        ), flush=True)


def add_quantlinear_rows(rows, n, k, device) -> None:
    """Label, per M, the measured variants ``QuantLinear`` runs: ``ql_dense`` (a layer without residual
    blocks) and ``ql_zip10`` (with the 10% residual). Copies of those rows (``same_as`` names them)."""
    for m in sorted({r["m"] for r in rows if r.get("n") == n and r.get("k") == k}):
        sel = {r["variant"]: r for r in rows if r.get("n") == n and r.get("k") == k and r.get("m") == m and "us" in r}
        if m <= GEMV_ROUTE_MAX_M:
            dense, zipped = "gemv", "gemv_zip10"
        elif SWAP_DECODE_M[0] <= m <= SWAP_DECODE_M[1]:
            dense, zipped = "w4a4_swapdec", "zip10"
        else:
            kp = (k + 1) // 2
            dense = "w4a4_swapmid" if swapped_mid_config(m, n, kp, device, residual=False) is not None else (
                "w4a4_swap" if swapped_prefill(m, n, device, residual=False) else "w4a4")
            zipped = "zip10_swap" if swapped_prefill(m, n, device, residual=True) else (
                "zip10_swapmid" if swapped_mid_config(m, n, kp, device, residual=True) is not None else "zip10")
        for label, src in (("ql_dense", dense), ("ql_zip10", zipped)):
            if src in sel:
                rows.append(dict(sel[src], variant=label, same_as=src))


def report_checks_and_write(rows: list[dict], out, device) -> None:
    """Print how many rows' ``check_ok`` held, and write ``{"versions", "rows"}`` to ``out/results.json`` (if ``out``)."""
    print(f"checks: {sum(r['check_ok'] for r in rows)} passed, {sum(not r['check_ok'] for r in rows)} failed")
    if out:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"versions": versions(device), "rows": rows}, indent=1))


def versions(device) -> dict:
    import triton
    from mosaicquant.harness.results import source_fingerprint
    info = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "source_sha256": source_fingerprint()}
    if device.type == "cuda":
        info.update({"gpu": torch.cuda.get_device_name(device), "cuda": torch.version.cuda,
                     "sms": torch.cuda.get_device_properties(device).multi_processor_count})
    return info


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "results/zipper"))
    parser.add_argument("--models", default="llama3-8b,qwen3-8b")
    parser.add_argument("--layers", default="qkv,o,gate_up,down")
    parser.add_argument("--ms", default=",".join(map(str, DEFAULT_MS)))
    parser.add_argument("--budgets", default="0,5,10,20")
    parser.add_argument("--variants", default="", help="comma list to time (default all)")
    parser.add_argument("--explore", action="store_true", help="also time alternative tile configs of the dense kernel")
    parser.add_argument("--dry", action="store_true", help="tiny shapes, correctness only (CPU interpreter)")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    ms = [int(v) for v in args.ms.split(",")]
    budgets = [int(v) for v in args.budgets.split(",")]
    shapes: dict[tuple[int, int], list[str]] = {}
    if args.dry:
        global ROTATE_BYTES, SWAP_MIN_M, DRY
        DRY = True
        ROTATE_BYTES = 1
        SWAP_MIN_M = 1
        shapes = {(320, 384): ["dry"]}
        ms = [1, 13, 67]
    else:
        for model in args.models.split(","):
            for layer in args.layers.split(","):
                shapes.setdefault(MODELS[model][layer], []).append(f"{model}.{layer}")

    def explore_cfgs(m):
        if not args.explore:
            return []
        if m <= 2:
            bm = 1 << (m - 1).bit_length()
            return [TileConfig(bm, bn, bkp, split_k=s, num_warps=w, num_stages=st, use_dot=False)
                    for bn, bkp, s, w, st in [(32, 128, 1, 4, 4), (16, 128, 2, 4, 6), (64, 32, 2, 4, 6), (128, 64, 1, 8, 3)]]
        if m in (16, 32):
            return [TileConfig(16, bn, bkp, split_k=s, num_warps=w, num_stages=st)
                    for bn, bkp, s, w, st in [(64, 64, 2, 4, 6), (128, 64, 2, 4, 4), (64, 64, 4, 4, 3)]]
        if m == 8192:
            return [TileConfig(128, 256, 64, num_warps=8, num_stages=3), TileConfig(128, 128, 64, num_warps=4, num_stages=4),
                    TileConfig(256, 128, 64, num_warps=8, num_stages=4)]
        return []

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"versions": versions(device), "ceilings": measure_ceilings(device), "block": BLOCK,
            "rotate_bytes": ROTATE_BYTES, "shapes": {f"{n}x{k}": v for (n, k), v in shapes.items()}}
    print(json.dumps(meta), flush=True)
    rows: list[dict] = []
    variants_filter = set(v for v in args.variants.split(",") if v)
    t0 = time.time()
    for (n, k), names in shapes.items():
        print(f"== {n}x{k} ({', '.join(names)})  t={time.time() - t0:.0f}s", flush=True)
        bench_shape(n, k, ms, budgets, device, gen, rows, explore_cfgs, variants_filter)
        add_quantlinear_rows(rows, n, k, device)
        (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        torch.cuda.empty_cache() if device.type == "cuda" else None
    keys = sorted({key for r in rows for key in r})
    with open(out / "results.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)

    measured = [r for r in rows if "same_as" not in r]
    failed = [r for r in measured if r.get("check_ok") is False]
    print(f"\nchecks: {len(measured) - len(failed)} ok, {len(failed)} FAILED; {time.time() - t0:.0f}s")
    cols = ["ql_dense", "gemv", "w4a4", "w4a4_x1", "w4a4_swapdec", "w4a4_swapmid", "w4a4_swap", "w4a4_swap_x1",
            "zip0", "ql_zip10", "gemv_zip10", "zip10", "zip10_dot", "zip10_x1", "zip10_swapmid",
            "zip10_swap", "zip10_swap_fp8", "zip10_swap_cc", "unfused10"]
    print("speedup vs bf16 (same run, median); bf16 us in first column")
    print(f"{'shape':>12} {'M':>5} {'bf16us':>8} " + " ".join(f"{c:>12}" for c in cols))
    for (n, k) in shapes:
        for m in ms:
            sel = {r["variant"]: r for r in rows if r.get("n") == n and r.get("k") == k and r.get("m") == m and "us" in r}
            if "bf16" not in sel:
                continue
            cells = [f"{sel[c]['speedup_vs_bf16']:>11.2f}{'!' if not sel[c]['check_ok'] else ' '}" if c in sel else f"{'-':>12}" for c in cols]
            print(f"{n}x{k:<6} {m:>5} {sel['bf16']['us']:>8.1f} " + " ".join(cells))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
