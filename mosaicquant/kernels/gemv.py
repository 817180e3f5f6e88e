"""Decode GEMV: W4A4 (and ZipperEngine) for a handful of tokens on CUDA-core ``dp4a``.

For a handful of tokens (M ≤ 8) the 4-bit GEMM is a matrix-vector product: the tensor-core
tiles of :mod:`mosaicquant.kernels.w4a4_gemm` are mostly padding (16 rows for 1–8 tokens) and
their weight operands must be unpacked into dot layouts. This kernel keeps the weights in 32-bit
words as loaded and multiplies them with ``dp4a`` (``Σ`` of four int8 products into an int32,
one instruction). Its instruction work grows with M while its bytes do not: on the H200 it beat
the tensor-core kernel at M = 1 on every Llama-3 / Qwen3 linear (1.85–3.03× BF16 against
1.61–2.30×) and lost at M ≥ 4 on most, so ``QuantLinear`` routes
single tokens here:

- a packed word holds eight 4-bit values, bytes ``4j … 4j+3`` of the row, the low nibble of
  each byte the even K and the high nibble the odd K (:mod:`mosaicquant.methods.format`);
- ``(w << 4) & 0xF0F0F0F0`` puts the four even values in the bytes' high halves (``16 q``, a
  signed byte, exact) and ``w & 0xF0F0F0F0`` the four odd ones; the activations, packed the
  same way, are split the same way, so one word pair costs two ``dp4a`` per token (the even
  and the odd products) plus two instructions to split the weight word, shared by the tokens;
- the int32 sums hold ``256 ×`` the product (exact while ``64 · 256 · K < 2**31``, ``K < 2**17``)
  and the epilogue's power-of-two rescale removes it exactly.

A program owns ``BN`` output channels and a K range (split-K: fp32 partials summed in split
order by the last program to arrive, as the other GEMMs do). Each thread accumulates its own
words' products over the K loop, element-wise, and the cross-thread sums run once at the end.

With residual blocks (ZipperEngine at decode), the program walks the kept blocks of its block
row after the dense loop (CSR, dealt round-robin over the K splits): each block's words are
multiplied the same way with the activation words of its block column and scaled by the
block's row scales, accumulated in fp32 per thread. The residual thus costs its own bytes and
a few instructions per word, like the dense part.

Taken: ``K`` a multiple of 8 (whole 32-bit words; rows of ``K / 2`` bytes at 4-byte aligned
strides), ``K < 2**17``, M ≤ :data:`GEMV_MAX_M`; residual blocks of ``Bk`` a multiple of 8
columns and ``Bn`` a multiple of 16 rows. :func:`gemv_reason` says why a call is not taken.
The result equals :func:`mosaicquant.kernels.w4a4_gemm.w4a4_gemm_reference` (and
:func:`mosaicquant.kernels.zipper.zipper_gemm_reference`) up to fp32 rounding of the scaled
partial sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mosaicquant.errors import UserInputError
from mosaicquant.kernels._common import (
    check_triton_device,
    gemm_pdl,
    output_buffer,
    triton_interpreting,
    use_pdl,
)
from mosaicquant.kernels._residual_check import check_residual
from mosaicquant.kernels._tiles import LOCK_SLOTS, _sm_count, lock_buffer, pdl_launch
from mosaicquant.kernels._tl import in_range, store_output, wait_for_inputs
from mosaicquant.kernels.w4a4_gemm import X16_MAX_K, check_gemm_args
from mosaicquant.methods.format import ResidualBlocks

__all__ = ["gemv_triton", "gemv_reason", "gemv_config", "GEMV_MAX_M"]

#: most tokens a call may have (one accumulator tile per token lives in registers)
GEMV_MAX_M = 8
# 0xF0F0F0F0 as an int32: the high half of every byte
_HIGH_HALVES = tl.constexpr(-0x0F0F0F10)

_ASM_DP4A = tl.constexpr("dp4a.s32.s32 $0, $1, $2, $3;")


@triton.jit
def _dp4a(a, b, c, USE_ASM: tl.constexpr):
    """``c + Σ_i a.byte[i] · b.byte[i]`` over the four signed bytes of int32 words (element-wise)."""
    if USE_ASM:
        return tl.inline_asm_elementwise(_ASM_DP4A, "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1)
    else:
        for i in tl.static_range(4):
            c += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)
        return c


@triton.jit
def _halves(w):
    """The even and odd values of packed int32 words, as ``16 q`` in the high half of each byte."""
    return (w << 4) & _HIGH_HALVES, w & _HIGH_HALVES


@triton.jit
def _token_mac(acc, w_lo, w_hi, a_row, kw, mask, USE_ASM: tl.constexpr, MASKED: tl.constexpr):
    """``acc += 256 ·`` (even + odd K products) of one token's activation words ``kw`` (of ``a_row``, its
    packed words) with the weight words."""
    if MASKED:
        a = tl.load(a_row + kw, mask=mask, other=0)
    else:
        a = tl.load(a_row + kw)
    a_lo, a_hi = _halves(a)
    acc = _dp4a(w_lo, a_lo[None, :], acc, USE_ASM)
    return _dp4a(w_hi, a_hi[None, :], acc, USE_ASM)


@triton.jit
def _token_rows(a_ptr, stride_am, M):
    """Pointers to the activation rows of tokens 0 … 7; tokens past ``M`` point at token 0 (results dropped)."""
    return (a_ptr, a_ptr + tl.minimum(1, M - 1) * stride_am, a_ptr + tl.minimum(2, M - 1) * stride_am,
            a_ptr + tl.minimum(3, M - 1) * stride_am, a_ptr + tl.minimum(4, M - 1) * stride_am,
            a_ptr + tl.minimum(5, M - 1) * stride_am, a_ptr + tl.minimum(6, M - 1) * stride_am,
            a_ptr + tl.minimum(7, M - 1) * stride_am)


@triton.jit
def _token_tile(v0, v1, v2, v3, v4, v5, v6, v7, BM: tl.constexpr):
    """Per-token ``[BN]`` vectors as the rows of a ``[BM, BN]`` tile (rows past 8 are zero)."""
    rows = tl.arange(0, BM)[:, None]
    y = tl.where(rows == 0, v0[None, :], 0.0)
    y = tl.where(rows == 1, v1[None, :], y)
    y = tl.where(rows == 2, v2[None, :], y)
    y = tl.where(rows == 3, v3[None, :], y)
    y = tl.where(rows == 4, v4[None, :], y)
    y = tl.where(rows == 5, v5[None, :], y)
    y = tl.where(rows == 6, v6[None, :], y)
    return tl.where(rows == 7, v7[None, :], y)


@triton.jit
def _residual_block(p, last, coords_ptr, res_val_ptr, res_scale_ptr, res_rows,
                    BN_RES: tl.constexpr, BKW_RES: tl.constexpr):
    """Block ``p``'s column, the channels' words and row scales (zeros once ``p >= last``)."""
    kept = p < last
    col = tl.load(coords_ptr + 2 * p + 1, mask=kept, other=0).to(tl.int64)
    r = tl.load(res_val_ptr + p * (BN_RES * BKW_RES) + res_rows[:, None] * BKW_RES + tl.arange(0, BKW_RES)[None, :],
                mask=kept, other=0)
    s = tl.load(res_scale_ptr + p * BN_RES + res_rows, mask=kept, other=0.0).to(tl.float32)
    return col, r, s


@triton.jit
def residual_dp4a_begin(row_ptr_ptr, coords_ptr, res_val_ptr, res_scale_ptr, pid_n, pid_k, offs_n,
                        BN: tl.constexpr, BN_RES: tl.constexpr, BKW_RES: tl.constexpr):
    """Start of :func:`residual_dp4a`'s walk: ``(first, last, col, r, s)``, the first block already loaded.

    Called before the dense loop (and before waiting for the activations: the blocks do not
    depend on the kernel before), so the first block's load overlaps the dense work instead of
    following it.
    """
    block_row = (pid_n * BN) // BN_RES
    res_rows = (offs_n - block_row * BN_RES).to(tl.int64)  # storage is padded to full blocks
    first = tl.load(row_ptr_ptr + block_row).to(tl.int64) + pid_k
    last = tl.load(row_ptr_ptr + block_row + 1).to(tl.int64)
    col, r, s = _residual_block(first, last, coords_ptr, res_val_ptr, res_scale_ptr, res_rows, BN_RES, BKW_RES)
    return first, last, col, r, s


@triton.jit
def residual_dp4a(a_ptr, stride_am, M, KW, coords_ptr, res_val_ptr, res_scale_ptr, pid_n, offs_n,
                  first, last, col, r, s, NT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BN_RES: tl.constexpr, BKW_RES: tl.constexpr, SPLIT_K: tl.constexpr, USE_ASM: tl.constexpr):
    """``256 ·`` the residual product of ``BN`` channels (``offs_n``, inside one block row) for up to 8 tokens.

    Walks the kept blocks of the channels' block row, every ``SPLIT_K``-th one from ``first``
    (CSR ``row_ptr``/``coords``; :func:`residual_dp4a_begin` gives ``first``, ``last`` and the
    first block ``col, r, s``): each block's 32-bit words (``BKW_RES`` a row) times the
    activation words of its block column on ``dp4a``, scaled by the block's row scales and
    summed in fp32 per thread; one cross-thread sum at the end. The next block is loaded while
    one is multiplied. ``NT`` (1, 2, 4 or 8, at least ``M``) tokens are multiplied. Returns fp32
    ``[BM, BN]`` (``BM >= NT``; rows from ``M`` on are zero), before the token scales.
    ``a_ptr``/``res_val_ptr`` point to int32 words.
    """
    block_row = (pid_n * BN) // BN_RES
    res_rows = (offs_n - block_row * BN_RES).to(tl.int64)
    rw = tl.arange(0, BKW_RES)
    a0, a1, a2, a3, a4, a5, a6, a7 = _token_rows(a_ptr, stride_am, M)
    r0 = tl.zeros([BN, BKW_RES], dtype=tl.float32)
    r1 = tl.zeros([BN, BKW_RES], dtype=tl.float32)
    r2 = tl.zeros([BN, BKW_RES], dtype=tl.float32)
    r3 = tl.zeros([BN, BKW_RES], dtype=tl.float32)
    r4 = tl.zeros([BN, BKW_RES], dtype=tl.float32)
    r5 = tl.zeros([BN, BKW_RES], dtype=tl.float32)
    r6 = tl.zeros([BN, BKW_RES], dtype=tl.float32)
    r7 = tl.zeros([BN, BKW_RES], dtype=tl.float32)
    for p in range(first, last, SPLIT_K):
        col_next, r_next, s_next = _residual_block(p + SPLIT_K, last, coords_ptr, res_val_ptr, res_scale_ptr,
                                                   res_rows, BN_RES, BKW_RES)
        scale = s[:, None]
        r_lo, r_hi = _halves(r)
        k = col * BKW_RES + rw
        inside = k < KW  # a ragged last block column ends early
        zero = tl.zeros([BN, BKW_RES], dtype=tl.int32)
        r0 += _token_mac(zero, r_lo, r_hi, a0, k, inside, USE_ASM, True).to(tl.float32) * scale
        if NT > 1:
            r1 += _token_mac(zero, r_lo, r_hi, a1, k, inside, USE_ASM, True).to(tl.float32) * scale
        if NT > 2:
            r2 += _token_mac(zero, r_lo, r_hi, a2, k, inside, USE_ASM, True).to(tl.float32) * scale
            r3 += _token_mac(zero, r_lo, r_hi, a3, k, inside, USE_ASM, True).to(tl.float32) * scale
        if NT > 4:
            r4 += _token_mac(zero, r_lo, r_hi, a4, k, inside, USE_ASM, True).to(tl.float32) * scale
            r5 += _token_mac(zero, r_lo, r_hi, a5, k, inside, USE_ASM, True).to(tl.float32) * scale
            r6 += _token_mac(zero, r_lo, r_hi, a6, k, inside, USE_ASM, True).to(tl.float32) * scale
            r7 += _token_mac(zero, r_lo, r_hi, a7, k, inside, USE_ASM, True).to(tl.float32) * scale
        col = col_next
        r = r_next
        s = s_next
    y = _token_tile(tl.sum(r0, axis=1), tl.sum(r1, axis=1), tl.sum(r2, axis=1), tl.sum(r3, axis=1),
                    tl.sum(r4, axis=1), tl.sum(r5, axis=1), tl.sum(r6, axis=1), tl.sum(r7, axis=1), BM)
    return tl.where(tl.arange(0, BM)[:, None] < M, y, 0.0)


@triton.jit
def _gemv_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr,
    row_ptr_ptr, coords_ptr, res_val_ptr, res_scale_ptr,
    M, N, KW, stride_am, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, BN_RES: tl.constexpr, BKW_RES: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    USE_ASM: tl.constexpr, PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    safe_n = in_range(offs_n, N)
    kw = tl.arange(0, BKW)
    k_steps = tl.cdiv(KW, BKW)
    per_split = tl.cdiv(k_steps, SPLIT_K)
    step_begin = pid_k * per_split
    step_end = tl.minimum(step_begin + per_split, k_steps)
    w_ptrs = w_ptr + safe_n[:, None] * stride_wn + (step_begin * BKW + kw)[None, :]
    a0, a1, a2, a3, a4, a5, a6, a7 = _token_rows(a_ptr, stride_am, M)
    acc0 = tl.zeros([BN, BKW], dtype=tl.int32)
    acc1 = tl.zeros([BN, BKW], dtype=tl.int32)
    acc2 = tl.zeros([BN, BKW], dtype=tl.int32)
    acc3 = tl.zeros([BN, BKW], dtype=tl.int32)
    acc4 = tl.zeros([BN, BKW], dtype=tl.int32)
    acc5 = tl.zeros([BN, BKW], dtype=tl.int32)
    acc6 = tl.zeros([BN, BKW], dtype=tl.int32)
    acc7 = tl.zeros([BN, BKW], dtype=tl.int32)
    if HAS_RES:
        res_first, res_last, res_col, res_r, res_s = residual_dp4a_begin(
            row_ptr_ptr, coords_ptr, res_val_ptr, res_scale_ptr, pid_n, pid_k, offs_n, BN, BN_RES, BKW_RES)
    wait_for_inputs(PDL)  # the activations come from the kernel before us
    for step in range(step_begin, step_end):
        k = step * BKW + kw
        inside = k < KW
        if EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=inside[None, :], other=0)
        w_lo, w_hi = _halves(w)
        acc0 = _token_mac(acc0, w_lo, w_hi, a0, k, inside, USE_ASM, not EVEN_K)
        if BM > 1:
            acc1 = _token_mac(acc1, w_lo, w_hi, a1, k, inside, USE_ASM, not EVEN_K)
        if BM > 2:
            acc2 = _token_mac(acc2, w_lo, w_hi, a2, k, inside, USE_ASM, not EVEN_K)
            acc3 = _token_mac(acc3, w_lo, w_hi, a3, k, inside, USE_ASM, not EVEN_K)
        if BM > 4:
            acc4 = _token_mac(acc4, w_lo, w_hi, a4, k, inside, USE_ASM, not EVEN_K)
            acc5 = _token_mac(acc5, w_lo, w_hi, a5, k, inside, USE_ASM, not EVEN_K)
            acc6 = _token_mac(acc6, w_lo, w_hi, a6, k, inside, USE_ASM, not EVEN_K)
            acc7 = _token_mac(acc7, w_lo, w_hi, a7, k, inside, USE_ASM, not EVEN_K)
        w_ptrs += BKW

    w_scale = tl.load(w_scale_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    # per token: the dense sum times the channel scale (the 256 removed at the end)
    y0 = tl.sum(acc0, axis=1).to(tl.float32) * w_scale
    y1 = tl.sum(acc1, axis=1).to(tl.float32) * w_scale
    y2 = tl.sum(acc2, axis=1).to(tl.float32) * w_scale
    y3 = tl.sum(acc3, axis=1).to(tl.float32) * w_scale
    y4 = tl.sum(acc4, axis=1).to(tl.float32) * w_scale
    y5 = tl.sum(acc5, axis=1).to(tl.float32) * w_scale
    y6 = tl.sum(acc6, axis=1).to(tl.float32) * w_scale
    y7 = tl.sum(acc7, axis=1).to(tl.float32) * w_scale
    offs_m = tl.arange(0, BM)
    y = _token_tile(y0, y1, y2, y3, y4, y5, y6, y7, BM)
    if HAS_RES:
        y += residual_dp4a(a_ptr, stride_am, M, KW, coords_ptr, res_val_ptr, res_scale_ptr, pid_n, offs_n,
                           res_first, res_last, res_col, res_r, res_s, BM, BM, BN, BN_RES, BKW_RES, SPLIT_K, USE_ASM)
    a_scale = tl.load(a_scale_ptr + offs_m, mask=offs_m < M, other=0.0)
    y = y * a_scale[:, None] * 0.00390625  # both operands were 16x: exact power-of-two rescale
    store_output(
        out_ptr, part_ptr, lock_ptr, pid_n, pid_k, y, bias_ptr, offs_m, offs_n, M, N, stride_om,
        HAS_BIAS=HAS_BIAS, SPLIT_K=SPLIT_K, OUT_FP32=False,
    )


def gemv_reason(m: int, k: int, residual: ResidualBlocks | None = None) -> str | None:
    """``None`` when the decode GEMV takes a call of ``m`` tokens on a ``K = k`` layer, else why not."""
    if not 1 <= m <= GEMV_MAX_M:
        return f"{m} tokens: the decode GEMV takes 1 to {GEMV_MAX_M}"
    if k % 8:
        return f"K={k} is not a multiple of 8 (the decode GEMV reads whole 32-bit words of eight values)"
    if k >= X16_MAX_K:
        return f"K={k} is too long for the GEMV's int32 sums (K < {X16_MAX_K})"
    if residual is not None:
        bn, bk = residual.block_shape
        if bk % 8 or (bk // 8) & (bk // 8 - 1) or bn % 16:
            return (f"residual blocks {bn}x{bk}: the decode GEMV needs rows a multiple of 16 and columns a "
                    f"power of two >= 8")
    return None


def gemv_config(m: int, n: int, k: int, device: torch.device, residual: ResidualBlocks | None = None) -> dict:
    """Tiles of a decode GEMV launch: keyword arguments of :func:`gemv_triton`.

    ``block_n`` output channels (nesting in the residual's block rows), ``block_kw`` words of K a
    step, and K split until the GPU has about ``programs_per_sm`` programs per SM (each keeping at
    least two steps).
    """
    block_n, block_kw, warps, per_sm = 32, 64, 4, 4
    if device.type != "cuda":  # the interpreter: few, large programs
        block_n = 64
    if residual is not None:
        while residual.block_shape[0] % block_n:
            block_n //= 2
    if device.type != "cuda":
        return {"block_n": block_n, "block_kw": block_kw, "split_k": 1, "num_warps": warps}
    tiles = -(-n // block_n)
    steps = -(-(k // 8) // block_kw)
    split = 1
    while tiles * split < per_sm * _sm_count(device) and steps // (2 * split) >= 2 and split < 32:
        split *= 2
    return {"block_n": block_n, "block_kw": block_kw, "split_k": split, "num_warps": warps}


def gemv_triton(
    a_packed: torch.Tensor,
    a_scale: torch.Tensor,
    qweight: torch.Tensor,
    w_scale: torch.Tensor,
    k: int,
    bias: torch.Tensor | None = None,
    *,
    residual: ResidualBlocks | None = None,
    block_n: int | None = None,
    block_kw: int | None = None,
    split_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 1,
    pdl: bool | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the decode GEMV (dense W4A4, or ZipperEngine with ``residual``).

    Args:
        a_packed, a_scale, qweight, w_scale, k, bias: as :func:`mosaicquant.kernels.w4a4_gemm.w4a4_gemm_triton`
            (``K`` a multiple of 8; ``M`` ≤ :data:`GEMV_MAX_M`).
        residual: optional residual blocks of the layer (fused after the dense loop).
        block_n, block_kw, split_k, num_warps: tiles (``None``: :func:`gemv_config`); ``block_n``
            a power of two ≥ 16 that divides the residual's block rows, ``block_kw`` a power of
            two ≥ 4 (32-bit words of K a step), ``split_k`` in [1, 64].
        num_stages: software-pipelining depth of the K loop.
        pdl: programmatic dependent launch (``None``: the settings' ``pdl``, on by default; measured
            1.04-1.16x faster at M = 1 on the H200).
        out: optional preallocated contiguous ``bfloat16 [M, N]`` output.

    Returns:
        ``bfloat16 [M, N]``.

    Raises:
        UserInputError: bad operands, a call the GEMV does not take (:func:`gemv_reason`), or bad tiles.
    """
    m, n, kp = check_gemm_args(a_packed, a_scale, qweight, w_scale, bias, k)
    return _launch(a_packed, a_scale, m, n, kp, qweight, w_scale, k, bias, residual, block_n, block_kw,
                   split_k, num_warps, num_stages, pdl, out)


def _launch(act, a_scale, m, n, kp, qweight, w_scale, k, bias, residual, block_n, block_kw,
            split_k, num_warps, num_stages, pdl, out) -> torch.Tensor:
    """Check the call's shape and tiles and launch :func:`_gemv_kernel` on packed activations ``act`` with
    scales ``a_scale``."""
    check_triton_device(act.device)
    if residual is not None:
        check_residual(residual, n, k, act.device)
        if residual.num_blocks == 0:
            residual = None
    reason = gemv_reason(max(m, 1), k, residual)
    if reason is not None:
        raise UserInputError(f"the decode GEMV cannot run this call: {reason}")
    for name, t in (("a_packed", act), ("qweight", qweight)):
        if t.stride(0) % 4 or t.storage_offset() % 4:
            raise UserInputError(f"{name} rows must start at 4-byte boundaries (stride {t.stride(0)}, "
                                 f"offset {t.storage_offset()})")
    cfg = gemv_config(m, n, k, act.device, residual)
    block_n = cfg["block_n"] if block_n is None else block_n
    block_kw = cfg["block_kw"] if block_kw is None else block_kw
    split_k = cfg["split_k"] if split_k is None else split_k
    num_warps = cfg["num_warps"] if num_warps is None else num_warps
    if block_n < 16 or block_n & (block_n - 1) or (residual is not None and residual.block_shape[0] % block_n):
        raise UserInputError(f"block_n={block_n} must be a power of two >= 16 dividing the residual's block rows")
    if block_kw < 4 or block_kw & (block_kw - 1):
        raise UserInputError(f"block_kw={block_kw} must be a power of two >= 4")
    if not isinstance(split_k, int) or not 1 <= split_k <= 64:
        raise UserInputError(f"split_k={split_k!r} must be an int in [1, 64]")
    out = output_buffer(out, (m, n), torch.bfloat16, act.device)
    if m == 0 or n == 0:
        return out
    tiles = triton.cdiv(n, block_n)
    if split_k > 1 and (tiles > LOCK_SLOTS or split_k * m * n >= 2**31):
        split_k = 1
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=out.device) if split_k > 1 else out
    kw = kp // 4
    act, stride_am = act.view(torch.int32), act.stride(0) // 4  # 32-bit words of eight values
    if residual is not None:
        bn_res, bk_res = residual.block_shape
        res = (residual.row_ptr, residual.coords, residual.values.view(torch.int32), residual.scales)
    else:
        bn_res, bk_res = block_n, 8
        res = (a_scale,) * 4
    bm = triton.next_power_of_2(m)
    pdl = use_pdl(act.device, pdl)
    _gemv_kernel[(tiles, split_k)](
        act, a_scale, qweight.view(torch.int32), w_scale.reshape(-1),
        bias if bias is not None else a_scale, out, part, lock_buffer(out.device), *res,
        m, n, kw, stride_am, qweight.stride(0) // 4, out.stride(0),
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, BN_RES=bn_res, BKW_RES=bk_res // 8,
        BM=bm, BN=block_n, BKW=block_kw, SPLIT_K=split_k, EVEN_K=kw % block_kw == 0,
        USE_ASM=not triton_interpreting(), PDL=gemm_pdl(act.device, m, pdl),
        num_warps=num_warps, num_stages=num_stages, **pdl_launch(pdl),
    )
    return out
