"""ZipperEngine: the dense W4A4 GEMM with the sparse 4-bit residual blocks fused in.

Computes (``mosaicquant.methods.format`` notation)

    y = s_a ⊙ (A·Qwᵀ) ⊙ s_w  +  Σ_{b kept} s_a ⊙ (A[:, k∈b] · R_bᵀ) ⊙ s_{r,b}  (+ bias)

in one launch: int32 accumulation of each product, fp32 scaling and summation of the
scaled partials (``y = s_a * (s_w * acc_dense + Σ_b s_r[b] * acc_b)``), BF16 output.
The residual loop is unrolled over a block's K (``tl.static_range``) so the loop over blocks
is the one the compiler software-pipelines.

Layouts. Activations and the dense base as in :mod:`mosaicquant.kernels.w4a4_gemm`
(packed bytes, low nibble = even K, two int8 dots per packed K step). Residual blocks are
read in the shared format (``values uint8 [nb, Bn, Bk/2]`` packed like the base,
``scales float16 [nb, Bn]``, CSR ``row_ptr``/``coords``). A program's ``[BM, BN]`` tile
must nest in one block row (``BN`` divides ``Bn``) and, in the inline mode, each packed K step
in one block column (``2·BKP`` divides ``Bk``); the launcher shrinks tiles to fit. The tail
walk steps through a block by the largest power of two up to ``BKP`` that divides ``Bk/2``
bytes, so the dense loop keeps its steps (the wide 128-byte steps of wide layers,
:data:`mosaicquant.kernels._tiles.WIDE_DECODE_TILES_PER_SM`).

Three ways to fuse, chosen by ``mode``:

``"inline"`` (the zipper proper). Kernel-side index, built once per layer by
:func:`residual_block_map`: ``block_map int32 [n_block_rows, n_block_cols]``, the index of
the kept block at ``(i, j)`` or -1 (same blocks, same integers, same scales). At each K step
the program looks up its block, and the *already loaded* activation tile also multiplies the
block's ``[BKP, BN]`` slice; the slice's load is predicated off when no block is kept
(no memory traffic), so the loop stays branch-free and software-pipelined, at the price of
issuing the residual dot at every step (meant for memory-bound small M; but see ``"auto"``).

``"tail"``. After the dense K loop the program walks only the kept blocks of its block row
(CSR ``row_ptr``/``coords``), re-reading their activation tiles (from L2): tensor-core
work grows exactly by the residual's share, which suits large (compute-bound) M.

``"parallel"`` (one tile of tokens: decode sizes). The dense programs do only the dense
GEMM; each kept block (each ``BN``-row slice of it) gets a program of its own, and every
program adds its scaled partial to its output tile's fix-up, which counts ``SPLIT_K`` dense
partials plus one per kept block of the tile's block row and sums them in slot order
(:func:`mosaicquant.kernels._tl.store_counted`). No program carries a heavy block row's walk
after its dense loop, at the price of a partial per block.

``"parallel_rows"``: as ``"parallel"``, but one program per (block row, ``BN``-row slice) walks
all of the row's kept blocks, so a tile sums ``SPLIT_K`` partials plus one (where its row keeps
any), and the grid holds one residual program per row instead of one per block (on gate/up at
10 %: 224 instead of ~717; with the 224 dense programs ~1.1 waves instead of ~2.4 at 3 programs
per SM, what an offline sm_90 compile's 80 registers a thread at 8 warps allows). ``"auto"`` runs
it on tiles that split K at most :attr:`~mosaicquant.kernels.tile_table.TileTable.parallel_rows_max_split` ways
(gate/up; on q/k/v, split 4, it was 1.17-1.25x slower than ``"parallel"``).

``gated=True`` (both parallel modes; a stacked ``[gate | up]`` layer): gate tile ``q`` and up tile
``q + I / BN`` share one counter; the last of their contributors sums each tile's partials in slot
order, rounds both to BF16 and writes ``bf16(silu(g)) · u`` at ``[M, I]``
(:func:`mosaicquant.kernels._tl.store_counted_gated`): the same bits as the GEMM's BF16 output
followed by the SiLU·mul kernel, one kernel fewer in the decode step.

``"auto"`` picks tail, or parallel where :func:`mosaicquant.kernels._tiles.parallel_residual`
says so (measured faster there): inline measured slower than
tail at every M, because the per-step residual dot doubles the operand conversion work,
which dominates at small M too. Split-K (small M) splits the dense steps and, in tail mode,
deals the blocks of a row round-robin over the splits.

The tail walk multiplies the blocks on int8 tensor-core dots, or, for a handful of tokens
(``residual_walk``), on CUDA-core ``dp4a`` over the blocks' 32-bit words
(:func:`mosaicquant.kernels.gemv.residual_dp4a`): no ``[BM, BKP]`` activation tile and no
nibble unpacking into dot operands, two instructions a word per token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mosaicquant.errors import UserInputError
from mosaicquant.kernels._common import (
    check_tensor,
    check_triton_device,
    gemm_pdl,
    output_buffer,
    resolve_kernel,
    triton_interpreting,
    use_pdl,
)
from mosaicquant.kernels._residual_check import check_residual
from mosaicquant.kernels import _tiles
from mosaicquant.kernels._tiles import (
    DP4A_WALK_MAX_M,
    LOCK_SLOTS,
    PREFETCH_MAX_M,
    TileConfig,
    fit_to_blocks,
    lock_buffer,
    parallel_mode,
    parallel_residual,
    pdl_default,
    pdl_launch,
    pick_config,
    prefetch_row_bytes,
    walk_stages,
)
from mosaicquant.kernels._tl import (
    dense_split_k,
    in_range,
    mac_int4,
    prefetch_rows_l2,
    store_counted,
    store_counted_gated,
    store_output,
    tile_indices,
    wait_for_inputs,
)
from mosaicquant.kernels.gemv import gemv_reason, residual_dp4a, residual_dp4a_begin
from mosaicquant.kernels.tile_table import table_for
from mosaicquant.kernels.w4a4_gemm import X16_MAX_K, check_gemm_args, gated_shape_reason, int_matmul, silu_mul_halves
from mosaicquant.methods.format import ResidualBlocks, unpack_int4

__all__ = [
    "gated_reason",
    "zipper_gemm",
    "zipper_gemm_triton",
    "zipper_gemm_reference",
    "residual_block_map",
    "FUSE_MODES",
]

FUSE_MODES = ("auto", "inline", "tail", "parallel", "parallel_rows")
RESIDUAL_WALKS = ("auto", "dot", "dp4a")  # how the tail mode multiplies the kept blocks
_MODE_ID = {"inline": 1, "tail": 2}


@triton.jit
def _zipper_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr,
    block_map_ptr, row_ptr_ptr, coords_ptr, res_val_ptr, res_scale_ptr, a_words_ptr, res_words_ptr,
    M, N, KP, stride_am, stride_wn, stride_om, PF_ROW_BYTES, n_block_cols,
    HAS_BIAS: tl.constexpr, OUT_FP32: tl.constexpr, EVEN_K: tl.constexpr, MODE: tl.constexpr,
    BN_RES: tl.constexpr, BKP_RES: tl.constexpr, RKP: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BKP: tl.constexpr, SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr,
    USE_DOT: tl.constexpr, USE_ASM: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
    X16: tl.constexpr = False, DP4A_TOKENS: tl.constexpr = 0,
    WALK_STAGES: tl.constexpr = None, WALK_PRELOAD: tl.constexpr = False,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    # the tail walk's first block loaded before the dense loop (one chunk a block: RKP == BKP_RES)
    PRE: tl.constexpr = MODE == 2 and DP4A_TOKENS == 0 and WALK_PRELOAD and RKP == BKP_RES
    # out-of-range rows/channels read wrapped indices instead (safe_*, _tl.in_range; their results are never stored)
    pid_m, pid_n, offs_m, offs_n, safe_m, safe_n = tile_indices(pid, M, N, BM, BN, GROUP_M)
    block_row = (pid_n * BN) // BN_RES
    # Rows of this tile inside its residual block (storage is padded to full blocks).
    res_rows = (offs_n - block_row * BN_RES).to(tl.int64)

    k_steps = tl.cdiv(KP, BKP)
    per_split = tl.cdiv(k_steps, SPLIT_K)
    step_begin = pid_k * per_split
    step_end = tl.minimum(step_begin + per_split, k_steps)
    if PREFETCH:  # weights and residual blocks do not depend on the kernel before us: start streaming them
        pf_end = tl.minimum(tl.minimum(step_end * BKP, KP), step_begin * BKP + PF_ROW_BYTES)
        prefetch_rows_l2(w_ptr, safe_n, stride_wn, step_begin * BKP, pf_end, LINES=4)
        if MODE == 2:
            # this tile's rows of each of its residual blocks: BN * BKP_RES contiguous bytes a block
            p_first = tl.load(row_ptr_ptr + block_row).to(tl.int64)
            p_last = tl.load(row_ptr_ptr + block_row + 1).to(tl.int64)
            first_row = tl.zeros([1], dtype=tl.int64) + (pid_n * BN - block_row * BN_RES)
            for p in range(p_first + pid_k, p_last, SPLIT_K):
                prefetch_rows_l2(res_val_ptr + p * (BN_RES * BKP_RES), first_row, BKP_RES, 0, BN * BKP_RES, LINES=8)
    if MODE == 2 and DP4A_TOKENS > 0:
        res_first, res_last, res_col, res_r, res_s = residual_dp4a_begin(
            row_ptr_ptr, coords_ptr, res_words_ptr, res_scale_ptr, pid_n, pid_k, offs_n, BN, BN_RES, BKP_RES // 4)
    if PRE:  # the block's coordinates, integers and scales do not depend on the kernel before us
        p0 = tl.load(row_ptr_ptr + block_row).to(tl.int64) + pid_k
        has0 = p0 < tl.load(row_ptr_ptr + block_row + 1).to(tl.int64)
        p0 = tl.where(has0, p0, 0)
        col0 = tl.load(coords_ptr + 2 * p0 + 1, mask=has0, other=0)
        r0 = tl.load(res_val_ptr + p0 * (BN_RES * BKP_RES) + res_rows[None, :] * BKP_RES + tl.arange(0, RKP)[:, None],
                     mask=has0, other=0)
        s0 = tl.load(res_scale_ptr + p0 * BN_RES + res_rows, mask=has0, other=0.0).to(tl.float32)
    wait_for_inputs(PDL)
    if PRE:
        kp0 = col0 * BKP_RES + tl.arange(0, RKP)
        a0 = tl.load(a_ptr + safe_m[:, None] * stride_am + kp0[None, :], mask=has0 & (kp0[None, :] < KP), other=0)
    offs_kp = step_begin * BKP + tl.arange(0, BKP)
    a_ptrs = a_ptr + safe_m[:, None] * stride_am + offs_kp[None, :]
    w_ptrs = w_ptr + safe_n[None, :] * stride_wn + offs_kp[:, None]

    acc = tl.zeros([BM, BN], dtype=tl.int32)
    if MODE == 1:
        res_acc = tl.zeros([BM, BN], dtype=tl.float32)
    for step in range(step_begin, step_end):
        kp = step * BKP + tl.arange(0, BKP)
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            a = tl.load(a_ptrs, mask=kp[None, :] < KP, other=0)
            w = tl.load(w_ptrs, mask=kp[:, None] < KP, other=0)
        acc = mac_int4(acc, a, w, USE_DOT, USE_ASM, X16)
        if MODE == 1:
            block_col = (step * BKP) // BKP_RES
            block = tl.load(block_map_ptr + block_row * n_block_cols + block_col)
            kept = block >= 0
            block64 = tl.maximum(block, 0).to(tl.int64)
            r_ptrs = (res_val_ptr + block64 * (BN_RES * BKP_RES) + res_rows[None, :] * BKP_RES
                      + (kp - block_col * BKP_RES)[:, None])
            r = tl.load(r_ptrs, mask=kept, other=0)
            r_acc = mac_int4(tl.zeros([BM, BN], dtype=tl.int32), a, r, USE_DOT, USE_ASM, X16)
            r_scale = tl.load(res_scale_ptr + block64 * BN_RES + res_rows, mask=kept, other=0.0).to(tl.float32)
            res_acc += r_acc.to(tl.float32) * r_scale[None, :]
        a_ptrs += BKP
        w_ptrs += BKP

    w_scale = tl.load(w_scale_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    # The dense int32 accumulator dies here; the residual then accumulates into y directly,
    # so no second [BM, BN] tile stays live through the dense loop (register pressure).
    y = acc.to(tl.float32) * w_scale[None, :]
    if MODE == 1:
        y += res_acc
    if MODE == 2 and DP4A_TOKENS > 0:
        # a handful of tokens (one M tile): the blocks' words on CUDA-core dp4a (256x the product)
        res = residual_dp4a(a_words_ptr, stride_am // 4, M, KP // 4, coords_ptr, res_words_ptr, res_scale_ptr,
                            pid_n, offs_n, res_first, res_last, res_col, res_r, res_s, DP4A_TOKENS, BM, BN,
                            BN_RES, BKP_RES // 4, SPLIT_K, USE_ASM)
        if X16:
            y += res
        else:
            y += res * 0.00390625
    elif MODE == 2:
        # int64 bounds keep the block offsets below in 64-bit arithmetic.
        first = tl.load(row_ptr_ptr + block_row).to(tl.int64)
        last = tl.load(row_ptr_ptr + block_row + 1).to(tl.int64)
        p_begin = first + pid_k
        if PRE:  # its loads were issued before the dense loop (an absent block: zeros, adding nothing)
            r_acc = mac_int4(tl.zeros([BM, BN], dtype=tl.int32), a0, r0, USE_DOT, USE_ASM, X16)
            y += r_acc.to(tl.float32) * s0[None, :]
            p_begin += SPLIT_K
        for p in tl.range(p_begin, last, SPLIT_K, num_stages=WALK_STAGES):
            block_col = tl.load(coords_ptr + 2 * p + 1)
            r_acc = tl.zeros([BM, BN], dtype=tl.int32)
            for chunk in tl.static_range(0, BKP_RES, RKP):
                kp = block_col * BKP_RES + chunk + tl.arange(0, RKP)
                a = tl.load(a_ptr + safe_m[:, None] * stride_am + kp[None, :], mask=kp[None, :] < KP, other=0)
                r = tl.load(res_val_ptr + p * (BN_RES * BKP_RES) + res_rows[None, :] * BKP_RES
                            + (chunk + tl.arange(0, RKP))[:, None])
                r_acc = mac_int4(r_acc, a, r, USE_DOT, USE_ASM, X16)
            r_scale = tl.load(res_scale_ptr + p * BN_RES + res_rows).to(tl.float32)
            y += r_acc.to(tl.float32) * r_scale[None, :]

    a_scale = tl.load(a_scale_ptr + offs_m, mask=offs_m < M, other=0.0)
    y = y * a_scale[:, None]
    if X16:  # every product was 256x: exact power-of-two rescale (the same rounding as without)
        y = y * 0.00390625
    store_output(
        out_ptr, part_ptr, lock_ptr, pid, pid_k, y, bias_ptr, offs_m, offs_n, M, N, stride_om,
        HAS_BIAS=HAS_BIAS, SPLIT_K=SPLIT_K, OUT_FP32=OUT_FP32,
    )


@triton.jit
def _block_chunk(res_val_ptr, p, res_rows, chunk, BN_RES: tl.constexpr, BKP_RES: tl.constexpr, RKP: tl.constexpr):
    """``RKP`` packed columns from ``chunk`` of kept block ``p``'s rows ``res_rows``, as a ``[RKP, BN]`` dot operand."""
    return tl.load(res_val_ptr + p * (BN_RES * BKP_RES) + res_rows[None, :] * BKP_RES
                   + (chunk + tl.arange(0, RKP))[:, None])


@triton.jit
def _block_product(r, a_ptr, res_val_ptr, res_scale_ptr, p, block_col, res_rows, safe_m, stride_am, KP,
                   BM: tl.constexpr, BN: tl.constexpr, BN_RES: tl.constexpr, BKP_RES: tl.constexpr,
                   RKP: tl.constexpr, USE_ASM: tl.constexpr, X16: tl.constexpr):
    """fp32 ``[BM, BN]``: kept block ``p`` (block column ``block_col``) times the activations, scaled by
    its row scales; ``r`` is its first chunk (:func:`_block_chunk`), loaded by the caller."""
    r_acc = tl.zeros([BM, BN], dtype=tl.int32)
    for chunk in tl.static_range(0, BKP_RES, RKP):
        if chunk > 0:
            r = _block_chunk(res_val_ptr, p, res_rows, chunk, BN_RES, BKP_RES, RKP)
        kp = block_col * BKP_RES + chunk + tl.arange(0, RKP)
        a = tl.load(a_ptr + safe_m[:, None] * stride_am + kp[None, :], mask=kp[None, :] < KP, other=0)
        r_acc = mac_int4(r_acc, a, r, True, USE_ASM, X16)
    r_scale = tl.load(res_scale_ptr + p * BN_RES + res_rows).to(tl.float32)
    return r_acc.to(tl.float32) * r_scale[None, :]


@triton.jit
def _zipper_parallel_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr,
    row_ptr_ptr, coords_ptr, res_val_ptr, res_scale_ptr,
    M, N, KP, stride_am, stride_wn, stride_om, PF_ROW_BYTES, N_DENSE,
    HAS_BIAS: tl.constexpr, OUT_FP32: tl.constexpr, EVEN_K: tl.constexpr,
    BN_RES: tl.constexpr, BKP_RES: tl.constexpr, RKP: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BKP: tl.constexpr, SPLIT_K: tl.constexpr,
    USE_ASM: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, X16: tl.constexpr,
    ROWS: tl.constexpr = False, GATED: tl.constexpr = False, WALK_STAGES: tl.constexpr = None,
):
    # Programs [0, N_DENSE): the dense GEMM, SPLIT_K per output tile (one tile of M rows). Programs
    # from N_DENSE: one per (kept block, BN-row slice of it), or with ROWS one per (block row,
    # BN-row slice) walking all of the row's kept blocks. Every program adds its scaled partial to
    # its tile's counted fix-up (store_counted): a tile sums SPLIT_K dense partials and one per kept
    # block of its block row (ROWS: one for the whole row, if it keeps any), in slot order.
    SUB: tl.constexpr = BN_RES // BN  # tiles of one block row
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BM)
    safe_m = in_range(offs_m, M)
    has_part = pid >= 0
    if pid < N_DENSE:
        t = pid // SPLIT_K
        slot = pid % SPLIT_K
        offs_n = t * BN + tl.arange(0, BN)
        safe_n = in_range(offs_n, N)
        acc = dense_split_k(a_ptr, w_ptr, safe_m, safe_n, stride_am, stride_wn, KP, PF_ROW_BYTES, slot,
                            BM, BN, BKP, SPLIT_K, EVEN_K, True, USE_ASM, PDL, PREFETCH, X16)
        w_scale = tl.load(w_scale_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        y = acc.to(tl.float32) * w_scale[None, :]
    elif ROWS:
        block_row = (pid - N_DENSE) // SUB
        sub = (pid - N_DENSE) % SUB  # which BN rows of the block row
        t = block_row * SUB + sub
        offs_n = t * BN + tl.arange(0, BN)
        res_rows = (sub * BN + tl.arange(0, BN)).to(tl.int64)  # storage is padded to full blocks
        p_first = tl.load(row_ptr_ptr + block_row).to(tl.int64)
        p_last = tl.load(row_ptr_ptr + block_row + 1).to(tl.int64)
        has_part = p_last > p_first
        slot = pid * 0 + SPLIT_K
        wait_for_inputs(PDL)
        y = tl.zeros([BM, BN], dtype=tl.float32)
        for p in tl.range(p_first, p_last, num_stages=WALK_STAGES):
            r = _block_chunk(res_val_ptr, p, res_rows, 0, BN_RES, BKP_RES, RKP)
            y += _block_product(r, a_ptr, res_val_ptr, res_scale_ptr, p, tl.load(coords_ptr + 2 * p + 1), res_rows,
                                safe_m, stride_am, KP, BM, BN, BN_RES, BKP_RES, RKP, USE_ASM, X16)
    else:
        p = ((pid - N_DENSE) // SUB).to(tl.int64)  # the kept block
        sub = (pid - N_DENSE) % SUB  # which BN rows of it
        block_row = tl.load(coords_ptr + 2 * p)
        block_col = tl.load(coords_ptr + 2 * p + 1)
        t = block_row * SUB + sub
        offs_n = t * BN + tl.arange(0, BN)
        res_rows = (sub * BN + tl.arange(0, BN)).to(tl.int64)  # storage is padded to full blocks
        slot = SPLIT_K + (p - tl.load(row_ptr_ptr + block_row)).to(tl.int32)
        r = _block_chunk(res_val_ptr, p, res_rows, 0, BN_RES, BKP_RES, RKP)  # weights: not from the kernel before
        wait_for_inputs(PDL)
        y = _block_product(r, a_ptr, res_val_ptr, res_scale_ptr, p, block_col, res_rows, safe_m, stride_am, KP,
                           BM, BN, BN_RES, BKP_RES, RKP, USE_ASM, X16)
    a_scale = tl.load(a_scale_ptr + offs_m, mask=offs_m < M, other=0.0)
    y = y * a_scale[:, None]
    if X16:  # every product was 256x: exact power-of-two rescale (the same rounding as without)
        y = y * 0.00390625
    if GATED:  # stacked [gate | up] columns: gate tile q and up tile q + HALF finish together
        HALF = (N // 2) // BN
        q = t % HALF
        base_g, exp_g = _tile_slots(row_ptr_ptr, q, BN, BN_RES, SPLIT_K, ROWS)
        base_u, exp_u = _tile_slots(row_ptr_ptr, q + HALF, BN, BN_RES, SPLIT_K, ROWS)
        if has_part:
            store_counted_gated(out_ptr, part_ptr, lock_ptr, q, tl.where(t < HALF, base_g, base_u) + slot,
                                base_g, exp_g, base_u, exp_u, y, bias_ptr, offs_m, q * BN + tl.arange(0, BN), M,
                                N // 2, stride_om, HAS_BIAS=HAS_BIAS)
    else:
        slot_base, expected = _tile_slots(row_ptr_ptr, t, BN, BN_RES, SPLIT_K, ROWS)
        if (t * BN < N) & has_part:  # a ragged last block row may reach past the last tile
            store_counted(out_ptr, part_ptr, lock_ptr, t, slot_base, slot, expected, y, bias_ptr,
                          offs_m, offs_n, M, N, stride_om, HAS_BIAS=HAS_BIAS, OUT_FP32=OUT_FP32)


@triton.jit
def _tile_slots(row_ptr_ptr, t, BN: tl.constexpr, BN_RES: tl.constexpr, SPLIT_K: tl.constexpr, ROWS: tl.constexpr):
    """``(first slot, partials expected)`` of output tile ``t`` in the parallel modes' fix-up."""
    SUB: tl.constexpr = BN_RES // BN
    block_row_t = (t * BN) // BN_RES
    r_first = tl.load(row_ptr_ptr + block_row_t)
    r_count = tl.load(row_ptr_ptr + block_row_t + 1) - r_first
    if ROWS:
        # SPLIT_K + 1 slots a tile; the row's partial counts only where the row keeps a block
        slot_base = t * (SPLIT_K + 1)
        expected = SPLIT_K + tl.minimum(r_count, 1)
    else:
        # slots before tile t: SPLIT_K per tile, and one per kept block of each earlier tile's block row
        slot_base = t * SPLIT_K + SUB * r_first + (t % SUB) * r_count
        expected = SPLIT_K + r_count
    return slot_base, expected


def residual_block_map(residual: ResidualBlocks) -> torch.Tensor:
    """Kernel-side index of the kept blocks: ``int32 [n_block_rows, n_block_cols]``, -1 where none.

    Built once per layer (e.g. at :class:`QuantLinear` construction); it indexes the shared
    format's ``values``/``scales`` and changes no integer or scale.
    """
    nbr, nbc = residual.grid
    block_map = torch.full((nbr, nbc), -1, dtype=torch.int32, device=residual.values.device)
    if residual.num_blocks:
        coords = residual.coords.long()
        block_map[coords[:, 0], coords[:, 1]] = torch.arange(
            residual.num_blocks, dtype=torch.int32, device=block_map.device
        )
    return block_map


def _resolve_mode(mode: str, m: int) -> str:
    if mode not in FUSE_MODES:
        raise UserInputError(f"mode={mode!r} is not allowed: choose one of {', '.join(FUSE_MODES)}")
    if mode == "auto":
        return "tail"
    return mode


def gated_reason(m: int, n: int, cfg: TileConfig, block_shape: tuple[int, int], mode: str,
                 out_fp32: bool = False) -> str | None:
    """Why :func:`zipper_gemm_triton` cannot write SiLU·mul of a stacked ``[gate | up]`` call (``gated=True``)
    of ``m`` tokens on ``cfg``'s tiles in ``mode`` (after ``"auto"`` is resolved), or ``None``."""
    if mode not in ("parallel", "parallel_rows"):
        return f"mode {mode!r} has no counted fix-up (the parallel modes have)"
    reason = gated_shape_reason(m, n, cfg, out_fp32)
    if reason is None and (n // 2) % block_shape[0]:
        reason = f"N={n} is not two halves of whole {block_shape[0]}-row residual blocks"
    return reason


def zipper_gemm_triton(
    a_packed: torch.Tensor,
    a_scale: torch.Tensor,
    qweight: torch.Tensor,
    w_scale: torch.Tensor,
    k: int,
    residual: ResidualBlocks,
    bias: torch.Tensor | None = None,
    *,
    block_map: torch.Tensor | None = None,
    mode: str = "auto",
    out_fp32: bool = False,
    config: TileConfig | None = None,
    out: torch.Tensor | None = None,
    pdl: bool | None = None,
    prefetch_mib: float | None = None,
    x16: bool = True,
    residual_walk: str = "auto",
    gated: bool = False,
) -> torch.Tensor:
    """Launch the fused dense + residual Triton GEMM.

    Args:
        a_packed, a_scale, qweight, w_scale, k, bias: as :func:`mosaicquant.kernels.w4a4_gemm.w4a4_gemm_triton`.
        residual: the layer's :class:`ResidualBlocks` (on the same device).
        block_map: :func:`residual_block_map` of ``residual`` (built here when ``None`` and the
            inline mode needs it; the other modes do not read it). Its shape, dtype and device are
            checked; its entries are not (that would read them: a device synchronisation each call).
        mode: ``"auto"``, ``"inline"``, ``"tail"``, ``"parallel"`` or ``"parallel_rows"`` (see module
            docstring; the parallel modes take one tile of tokens, at most ``config.block_m``).
        out_fp32: write fp32 instead of BF16.
        config: tiles; shrunk to nest in the residual blocks.
        out: optional preallocated contiguous ``[M, N]`` output of the output dtype.
        pdl: programmatic dependent launch, as in :func:`mosaicquant.kernels.w4a4_gemm.w4a4_gemm_triton`
            (decode-sized launches also prefetch their tiles' residual blocks).
        prefetch_mib: cap on the dense weight bytes prefetched, as there (``None``: the settings' ``prefetch_mib``
            if set, else :data:`mosaicquant.kernels._tiles.ZIPPER_PREFETCH_MIB`; residual blocks are
            prefetched whole while the prefetch is on).
        x16: unpack as ``16 * q``, as in :func:`mosaicquant.kernels.w4a4_gemm.w4a4_gemm_triton` (default on).
        residual_walk: how the tail mode multiplies the kept blocks: ``"dot"``, int8 tensor-core dots
            on ``[BM, BKP]`` activation tiles, or ``"dp4a"``, the blocks' 32-bit words on CUDA-core
            ``dp4a`` (:func:`mosaicquant.kernels.gemv.residual_dp4a`; calls the decode GEMV takes:
            at most 8 tokens, ``K`` a multiple of 8); ``"auto"``: ``"dp4a"`` where it can run, up to
            :data:`mosaicquant.kernels._tiles.DP4A_WALK_MAX_M` tokens (measured faster there).
        gated: the layer is stacked ``[gate | up]`` (``N = 2I``): write ``bf16(silu(gate)) · up``,
            ``[M, I]`` BF16, from the fix-up of each pair of tiles (the same bits as the GEMM then
            :func:`mosaicquant.kernels.decoder.silu_mul`); the parallel modes only, where
            :func:`gated_reason` finds nothing against it.

    Returns:
        ``[M, N]`` BF16 (or fp32).

    Raises:
        UserInputError: bad operands, a residual of another shape, a block shape the kernel
            cannot tile, or an unknown mode.
    """
    m, n, kp = check_gemm_args(a_packed, a_scale, qweight, w_scale, bias, k)
    check_residual(residual, n, k, a_packed.device)
    check_triton_device(a_packed.device)
    fuse = _resolve_mode(mode, m)
    if residual_walk not in RESIDUAL_WALKS:
        raise UserInputError(f"residual_walk={residual_walk!r} is not allowed: choose one of "
                             f"{', '.join(RESIDUAL_WALKS)}")
    dp4a_reason = gemv_reason(max(m, 1), k, residual)
    if fuse != "tail":
        dp4a_reason = dp4a_reason or f"mode {fuse!r} has no tail walk"
    if dp4a_reason is None and (a_packed.stride(0) % 4 or a_packed.storage_offset() % 4):
        dp4a_reason = "the activation rows do not start at 4-byte boundaries"
    if residual_walk == "dp4a" and dp4a_reason is not None:
        raise UserInputError(f"residual_walk='dp4a' cannot run this call: {dp4a_reason}")
    use_dp4a = residual_walk == "dp4a" or (residual_walk == "auto" and m <= DP4A_WALK_MAX_M)
    dp4a_tokens = triton.next_power_of_2(max(m, 1)) if use_dp4a and dp4a_reason is None else 0
    if block_map is not None:
        check_tensor("block_map", block_map, dtypes=(torch.int32,), shape=residual.grid)
        if not block_map.is_contiguous() or block_map.device != a_packed.device:
            raise UserInputError(f"block_map must be contiguous and on the operands' device {a_packed.device}, got "
                                 f"strides {block_map.stride()} on {block_map.device}")
    elif fuse == "inline":  # only the inline mode reads it
        block_map = residual_block_map(residual)
    out_dtype = torch.float32 if out_fp32 else torch.bfloat16
    if m == 0 or n == 0:
        return output_buffer(out, (m, n // 2 if gated else n), out_dtype, a_packed.device)
    bn_res, bk_res = residual.block_shape
    cfg = fit_to_blocks(config or pick_config(m, n, kp, a_packed.device, residual.block_shape), residual.block_shape,
                        nest_k=fuse == "inline")
    rkp = cfg.block_kp  # the tail walk's step through a block: a power of two dividing its packed columns
    while (bk_res // 2) % rkp:
        rkp //= 2
    if mode == "auto" and parallel_residual(m, cfg, residual.num_blocks / max(1, residual.grid[0]),
                                            device=a_packed.device):
        fuse = parallel_mode(cfg, device=a_packed.device)
    if gated:
        reason = gated_reason(m, n, cfg, residual.block_shape, fuse, out_fp32)
        if reason is not None:
            raise UserInputError(f"gated=True cannot run this call: {reason}")
    out = output_buffer(out, (m, n // 2 if gated else n), out_dtype, a_packed.device)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    split = cfg.split_k if tiles <= LOCK_SLOTS and cfg.split_k * m * n < 2**31 else 1
    part = torch.empty(split, m, n, dtype=torch.float32, device=out.device) if split > 1 else out
    if pdl is None and not pdl_default(m, n, kp):
        pdl = False
    pdl = use_pdl(a_packed.device, pdl)
    pf_row = prefetch_row_bytes(n, kp, split, prefetch_mib, _tiles.ZIPPER_PREFETCH_MIB)
    if fuse in ("parallel", "parallel_rows"):
        if m > cfg.block_m or not cfg.use_dot:
            raise UserInputError(f"mode={fuse!r} runs one tensor-core tile of {cfg.block_m} tokens; this call has "
                                 f"M={m}" + ("" if cfg.use_dot else " and tiles without tensor-core dots"))
        if tiles > LOCK_SLOTS:
            raise UserInputError(f"mode={fuse!r} needs a counter per output tile: N={n} makes {tiles} tiles, "
                                 f"more than {LOCK_SLOTS}")
        rows = fuse == "parallel_rows"
        sub = bn_res // cfg.block_n
        n_dense = tiles * cfg.split_k
        n_res = sub * (residual.grid[0] if rows else residual.num_blocks)
        slots = tiles * (cfg.split_k + 1) if rows else n_dense + n_res
        part = torch.empty(slots * cfg.block_m * cfg.block_n, dtype=torch.float32, device=out.device)
        _zipper_parallel_kernel[(n_dense + n_res,)](
            a_packed.view(torch.int8), a_scale, qweight.view(torch.int8), w_scale.reshape(-1),
            bias if bias is not None else a_scale, out, part, lock_buffer(out.device),
            residual.row_ptr, residual.coords, residual.values.view(torch.int8), residual.scales,
            m, n, kp, a_packed.stride(0), qweight.stride(0), out.stride(0), pf_row, n_dense,
            HAS_BIAS=bias is not None, OUT_FP32=out_fp32, EVEN_K=kp % cfg.block_kp == 0,
            BN_RES=bn_res, BKP_RES=bk_res // 2, RKP=rkp, BM=cfg.block_m, BN=cfg.block_n, BKP=cfg.block_kp,
            SPLIT_K=cfg.split_k, USE_ASM=not triton_interpreting(), PDL=gemm_pdl(a_packed.device, m, pdl),
            PREFETCH=pdl and m <= PREFETCH_MAX_M and pf_row > 0, X16=bool(x16) and k < X16_MAX_K, ROWS=rows,
            GATED=bool(gated), WALK_STAGES=walk_stages(m, device=a_packed.device),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(pdl),
        )
        return out
    _zipper_kernel[(tiles, split)](
        a_packed.view(torch.int8), a_scale, qweight.view(torch.int8), w_scale.reshape(-1),
        bias if bias is not None else a_scale, out, part, lock_buffer(out.device),
        block_map if block_map is not None else residual.row_ptr, residual.row_ptr, residual.coords,
        residual.values.view(torch.int8), residual.scales,
        *((a_packed.view(torch.int32), residual.values.view(torch.int32)) if dp4a_tokens else (a_scale, a_scale)),
        m, n, kp, a_packed.stride(0), qweight.stride(0), out.stride(0), pf_row, residual.grid[1],
        HAS_BIAS=bias is not None, OUT_FP32=out_fp32, EVEN_K=kp % cfg.block_kp == 0, MODE=_MODE_ID[fuse],
        BN_RES=bn_res, BKP_RES=bk_res // 2, RKP=rkp,
        BM=cfg.block_m, BN=cfg.block_n, BKP=cfg.block_kp, SPLIT_K=split, GROUP_M=cfg.group_m, USE_DOT=cfg.use_dot,
        USE_ASM=not triton_interpreting(), PDL=gemm_pdl(a_packed.device, m, pdl),
        PREFETCH=pdl and m <= PREFETCH_MAX_M and pf_row > 0,
        X16=bool(x16) and cfg.use_dot and k < X16_MAX_K, DP4A_TOKENS=dp4a_tokens,
        WALK_STAGES=walk_stages(m, device=a_packed.device) if fuse == "tail" and not dp4a_tokens else None,
        WALK_PRELOAD=fuse == "tail" and not dp4a_tokens and 0 < m <= table_for(a_packed.device).walk_preload_max_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(pdl),
    )
    return out


def residual_product_reference(
    a_int: torch.Tensor, a_scale: torch.Tensor, residual: ResidualBlocks, chunk: int = 256
) -> torch.Tensor:
    """``Σ_b s_a ⊙ (A[:, k∈b] · R_bᵀ) ⊙ s_{r,b}`` as fp32 ``[M, N]`` (exact integer products).

    Args:
        a_int: ``int8 [M, K]`` activation integers.
        a_scale: ``float32 [M]``.
        residual: the kept blocks.
        chunk: blocks per batched product (bounds temporary memory).
    """
    m, k = a_int.shape
    n = residual.shape[0]
    bn, bk = residual.block_shape
    nbr, nbc = residual.grid
    out = torch.zeros(m, nbr * bn, dtype=torch.float32, device=a_int.device)
    if residual.num_blocks == 0:
        return out[:, :n]
    a_pad = torch.nn.functional.pad(a_int, (0, nbc * bk - k)).view(m, nbc, bk)
    exact = torch.float32 if 64 * bk < 2**24 else torch.float64
    for start in range(0, residual.num_blocks, chunk):
        sl = slice(start, start + chunk)
        coords = residual.coords[sl].long()
        r_int = unpack_int4(residual.values[sl], bk).to(exact)
        a_blocks = a_pad[:, coords[:, 1]].to(exact)
        acc = torch.einsum("mbk,bnk->mbn", a_blocks, r_int).to(torch.float32)
        scaled = acc * residual.scales[sl].to(torch.float32).unsqueeze(0)
        rows = (coords[:, 0:1] * bn + torch.arange(bn, device=coords.device)).reshape(-1)
        out.index_add_(1, rows, scaled.reshape(m, -1))
    return out[:, :n] * a_scale[:, None]


def zipper_gemm_reference(
    a_packed: torch.Tensor,
    a_scale: torch.Tensor,
    qweight: torch.Tensor,
    w_scale: torch.Tensor,
    k: int,
    residual: ResidualBlocks,
    bias: torch.Tensor | None = None,
    *,
    out_fp32: bool = False,
) -> torch.Tensor:
    """PyTorch reference of :func:`zipper_gemm_triton`: ``y = s_a⊙(A·Qwᵀ)⊙s_w + Σ_b s_a⊙(A_b·R_bᵀ)⊙s_r (+ bias)``."""
    m, n, _ = check_gemm_args(a_packed, a_scale, qweight, w_scale, bias, k)
    check_residual(residual, n, k, a_packed.device)
    a_int = unpack_int4(a_packed, k)
    acc = int_matmul(a_int, unpack_int4(qweight, k)).to(torch.float32)
    y = acc * a_scale[:, None] * w_scale.reshape(1, -1).to(torch.float32)
    y = y + residual_product_reference(a_int, a_scale, residual)
    if bias is not None:
        y = y + bias
    return y if out_fp32 else y.to(torch.bfloat16)


def zipper_gemm(
    a_packed: torch.Tensor,
    a_scale: torch.Tensor,
    qweight: torch.Tensor,
    w_scale: torch.Tensor,
    k: int,
    residual: ResidualBlocks,
    bias: torch.Tensor | None = None,
    *,
    kernel: str | None = None,
    block_map: torch.Tensor | None = None,
    mode: str = "auto",
    config: TileConfig | None = None,
    gated: bool = False,
) -> torch.Tensor:
    """ZipperEngine GEMM (dense base + fused sparse residual) in BF16, on the chosen kernel.

    Args:
        a_packed, a_scale: packed activations and per-token scales.
        qweight, w_scale: dense base (per-channel scales).
        k: the unpacked K.
        residual: kept residual blocks.
        bias: optional ``float32 [N]``.
        kernel: ``"auto"`` / ``"triton"`` / ``"torch"`` / ``None``.
        block_map, mode, config: Triton-path options (see :func:`zipper_gemm_triton`).
        gated: a stacked ``[gate | up]`` layer: return ``bf16(silu(gate)) · up`` (see :func:`zipper_gemm_triton`).

    Returns:
        ``bfloat16 [M, N]`` (``[M, N / 2]`` gated).

    Raises:
        UserInputError: bad operands, mode or kernel preference.
    """
    if resolve_kernel(kernel) == "triton":
        return zipper_gemm_triton(
            a_packed, a_scale, qweight, w_scale, k, residual, bias, block_map=block_map, mode=mode, config=config,
            gated=gated,
        )
    _resolve_mode(mode, a_packed.shape[0])
    out = zipper_gemm_reference(a_packed, a_scale, qweight, w_scale, k, residual, bias)
    return silu_mul_halves(out) if gated else out
