"""The swapped prefill GEMM on FP8 (e4m3) tensor cores instead of INT8, at M = 2048 and 8192.

Hopper's FP8 and INT8 tensor cores have the same peak, but plain Triton GEMMs measured faster on FP8 here (SPEC
§2: 1.62-1.79x BF16 against 1.32-1.71x). The swapped prefill GEMM (`w4a4_gemm_swapped_triton`) runs INT8 dots of
the weights unpacked in registers (as ``16 q``, two and one instructions per four bytes) against the ``"split8"``
int8 activations. Its FP8 form here:

- weights: a nibble ``q`` (two's complement) becomes the e4m3 byte ``(q + 8)``, one ``lop3`` per four values
  (plus a shift for the high nibbles): e4m3 bytes 0-15 are the values ``b · 2^-9`` (subnormals, then the first
  binade), so the byte holds ``(q + 8) · 2^-9`` exactly;
- activations: the same split8 layout, as e4m3 values ``a`` (exact for integers up to 16), with each token's sum
  ``Σ_k a`` (written by the quantizer in a kept form; here computed outside the timing);
- ``Σ q a = 2^9 · Σ (q + 8) 2^-9 a − 8 Σ a``, exact in fp32 (``|Σ (q + 8) a| <= 120 K < 2^24``) if the dots
  accumulate exactly. ``fp8`` leaves Triton's default on sm_90 (the tensor cores' own, shorter accumulation across
  a dot's K chain); ``fp8_acc64`` promotes into fp32 after every 64 products (``max_num_imprecise_acc=64``).

Variants (GEMM alone; activations quantized outside the timing; medians of interleaved rounds, µs): ``bf16``
(``F.linear``), ``int8`` (the swapped GEMM as ``QuantLinear`` runs it at prefill, dense), ``fp8``, ``fp8_acc64``,
``fp8_kp128`` (128-byte K steps), and the ceilings without unpacking (both operands one byte a value, same
tiles): ``plain_int8``, ``plain_fp8``.
Each 4-bit variant is checked against the INT8 kernel's output (exact integer products).
Measured on the H200: FP8 0.62-0.74x the INT8 kernel's speed (``benchmarks/NOTES.md`` v32).

    PYTHONPATH=. python3 benchmarks/fp8_prefill.py [--ms 2048,8192] [--rounds 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from walk_preload import interleaved_medians, report_checks, save_rows  # noqa: E402
from zipper import check, random_w4_copies, time_calls  # noqa: E402

from mosaicquant.kernels._tl import in_range, tile_coords  # noqa: E402
from mosaicquant.kernels.act_quant import quantize_activations_triton  # noqa: E402
from mosaicquant.kernels.w4a4_gemm import w4a4_gemm_swapped_triton  # noqa: E402

SHAPES = {
    "llama_qkv": (6144, 4096), "llama_o": (4096, 4096), "llama_gate_up": (28672, 4096), "llama_down": (4096, 14336),
    "qwen_gate_up": (24576, 4096), "qwen_down": (4096, 12288),
}

# (q + 8) as an e4m3 byte: (w & 0x0F0F0F0F) ^ 0x08080808 (lop3 0x6a = (a & b) ^ c)
_ASM_B8_LO = tl.constexpr("lop3.b32 $0, $1, 0x0F0F0F0F, 0x08080808, 0x6a;")
_ASM_B8_HI = tl.constexpr("{ .reg .b32 t; shr.u32 t, $1, 4; lop3.b32 $0, t, 0x0F0F0F0F, 0x08080808, 0x6a; }")


@triton.jit
def unpack_b8(packed, HI: tl.constexpr):
    """Nibbles of an ``int8`` tensor as the e4m3 values ``(q + 8) · 2^-9`` (exact)."""
    if HI:
        return tl.inline_asm_elementwise(_ASM_B8_HI, "=r,r", [packed], dtype=tl.float8e4nv, is_pure=True, pack=4)
    return tl.inline_asm_elementwise(_ASM_B8_LO, "=r,r", [packed], dtype=tl.float8e4nv, is_pure=True, pack=4)


@triton.jit
def _fp8_swapped_kernel(a_ptr, a_scale_ptr, a_sum_ptr, w_ptr, w_scale_ptr, out_ptr, M, N, KP,
                        stride_am, stride_wn, stride_om,
                        BN: tl.constexpr, BM: tl.constexpr, BKP: tl.constexpr, GROUP_N: tl.constexpr,
                        ACC: tl.constexpr):
    pid = tl.program_id(0)
    pid_n, pid_m = tile_coords(pid, N, M, BN, BM, GROUP_N)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = pid_m * BM + tl.arange(0, BM)
    safe_n = in_range(offs_n, N)
    safe_m = in_range(offs_m, M)
    kk = tl.arange(0, BKP)
    w_ptrs = w_ptr + safe_n[:, None] * stride_wn + kk[None, :]
    a_ptrs = a_ptr + safe_m[None, :] * stride_am + ((kk // 64) * 128 + kk % 64)[:, None]
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for _ in range(0, tl.cdiv(KP, BKP)):  # KP a multiple of BKP (checked by the launcher)
        w = tl.load(w_ptrs)
        a_even = tl.load(a_ptrs)
        a_odd = tl.load(a_ptrs + 64)
        if ACC == 0:
            acc = tl.dot(unpack_b8(w, False), a_even, acc)
            acc = tl.dot(unpack_b8(w, True), a_odd, acc)
        else:
            acc = tl.dot(unpack_b8(w, False), a_even, acc, max_num_imprecise_acc=ACC)
            acc = tl.dot(unpack_b8(w, True), a_odd, acc, max_num_imprecise_acc=ACC)
        w_ptrs += BKP
        a_ptrs += 2 * BKP
    w_scale = tl.load(w_scale_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    a_scale = tl.load(a_scale_ptr + offs_m, mask=offs_m < M, other=0.0)
    a_sum = tl.load(a_sum_ptr + offs_m, mask=offs_m < M, other=0.0)
    y = (acc * 512.0 - 8.0 * a_sum[None, :]) * w_scale[:, None] * a_scale[None, :]
    mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    tl.store(out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None], y.to(tl.bfloat16), mask=mask)


def fp8_swapped(a8, a_scale, a_sum, qweight, w_scale, acc=0, block_n=128, block_m=128, block_kp=64,
                num_warps=8, num_stages=3):
    m, n, kp = a8.shape[0], qweight.shape[0], qweight.shape[1]
    if kp % block_kp:
        raise ValueError(f"packed K={kp} must be a multiple of block_kp={block_kp}")
    out = torch.empty(m, n, dtype=torch.bfloat16, device=a8.device)
    grid = (triton.cdiv(n, block_n) * triton.cdiv(m, block_m),)
    _fp8_swapped_kernel[grid](a8, a_scale, a_sum, qweight.view(torch.int8), w_scale, out, m, n, kp,
                              a8.stride(0), qweight.stride(0), out.stride(0),
                              BN=block_n, BM=block_m, BKP=block_kp, GROUP_N=8, ACC=acc,
                              num_warps=num_warps, num_stages=num_stages)
    return out


@triton.jit
def _plain_kernel(a_ptr, w_ptr, out_ptr, M, N, K, stride_am, stride_wn, stride_om,
                  BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, GROUP_N: tl.constexpr, INT: tl.constexpr):
    pid = tl.program_id(0)
    pid_n, pid_m = tile_coords(pid, N, M, BN, BM, GROUP_N)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = pid_m * BM + tl.arange(0, BM)
    kk = tl.arange(0, BK)
    w_ptrs = w_ptr + in_range(offs_n, N)[:, None] * stride_wn + kk[None, :]
    a_ptrs = a_ptr + in_range(offs_m, M)[None, :] * stride_am + kk[:, None]
    acc = tl.zeros([BN, BM], dtype=tl.int32 if INT else tl.float32)
    for _ in range(0, tl.cdiv(K, BK)):
        if INT:
            acc = tl.dot(tl.load(w_ptrs), tl.load(a_ptrs), acc, out_dtype=tl.int32)
        else:
            acc = tl.dot(tl.load(w_ptrs), tl.load(a_ptrs), acc)
        w_ptrs += BK
        a_ptrs += BK
    mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    tl.store(out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None], acc.to(tl.float32).to(tl.bfloat16),
             mask=mask)


def plain(a, w, block=128, num_warps=8, num_stages=3):
    m, n, k = a.shape[0], w.shape[0], w.shape[1]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    grid = (triton.cdiv(n, block) * triton.cdiv(m, block),)
    _plain_kernel[grid](a, w, out, m, n, k, a.stride(0), w.stride(0), out.stride(0), BN=block, BM=block, BK=128,
                        GROUP_N=8, INT=a.dtype == torch.int8, num_warps=num_warps, num_stages=num_stages)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", default="2048,8192")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("fp8_prefill.py times GPU kernels: no CUDA device here", file=sys.stderr)
        return 0
    torch.manual_seed(0)
    dev = torch.device("cuda")
    rows, table = [], []
    for name, (n, k) in SHAPES.items():
        kp = k // 2
        qws, wss = random_w4_copies(n, kp, dev)
        w16 = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        w_i8 = torch.randint(-8, 8, (n, k), device=dev, dtype=torch.int8)
        w_f8 = w_i8.to(torch.float16).to(torch.float8_e4m3fn)
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            x[:, :: max(1, k // 7)] *= 8
            a_split, a_scale = quantize_activations_triton(x, layout="split8")
            a8 = a_split.to(torch.float16).to(torch.float8_e4m3fn)
            a_sum = a_split.float().sum(1)
            a_i8 = a_split[:, :k].contiguous()
            a_f8 = a8[:, :k].contiguous()
            ref = w4a4_gemm_swapped_triton(a_split, a_scale, qws[0], wss[0], k).float()

            def checked(variant, fn, ref=ref):
                if variant in ("bf16", "plain_int8", "plain_fp8"):
                    return True
                out = fn().float()
                ok, rel = check(out, ref)
                exact = (out == ref).float().mean().item()
                print(f"  check {name} M={m} {variant}: ok={ok} max rel err {rel:.2e}, equal to int8 {exact:.4f}")
                return ok

            calls = {
                "bf16": [lambda: F.linear(x, w16)],
                "int8": [lambda i=i: w4a4_gemm_swapped_triton(a_split, a_scale, qws[i], wss[i], k)
                         for i in range(len(qws))],
                "fp8": [lambda i=i: fp8_swapped(a8, a_scale, a_sum, qws[i], wss[i]) for i in range(len(qws))],
                "fp8_acc64": [lambda i=i: fp8_swapped(a8, a_scale, a_sum, qws[i], wss[i], acc=64)
                              for i in range(len(qws))],
                "fp8_kp128": [lambda i=i: fp8_swapped(a8, a_scale, a_sum, qws[i], wss[i], block_kp=128)
                              for i in range(len(qws))],
                "plain_int8": [lambda: plain(a_i8, w_i8)],
                "plain_fp8": [lambda: plain(a_f8, w_f8)],
            }
            med = interleaved_medians(calls, args.rounds, checked, {"layer": name, "n": n, "k": k, "m": m}, rows)
            save_rows(args.out, rows)
            q_us = time_calls([lambda: quantize_activations_triton(x, layout="split8")])[0]
            table.append((name, m, med, q_us))
    print(f"\n{'layer':15s} {'M':>5s} {'quant':>7s} " + " ".join(f"{v:>10s}" for v in table[0][2])
          + "   int8/fp8  int8/fp8_acc64  bf16/(q+int8)  bf16/(q+fp8)")
    for name, m, med, q_us in table:
        print(f"{name:15s} {m:5d} {q_us:7.1f} " + " ".join(f"{med[v]:10.1f}" for v in med)
              + f"   {med['int8'] / med['fp8']:8.3f}  {med['int8'] / med['fp8_acc64']:14.3f}"
              + f"  {med['bf16'] / (q_us + med['int8']):13.3f}  {med['bf16'] / (q_us + med['fp8']):12.3f}")
    return 1 if report_checks(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
