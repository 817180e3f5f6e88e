"""Dense W4A4 GEMM: packed 4-bit activations × packed 4-bit weights → BF16.

Computes, for ``A`` ``[M, K]`` and ``W`` ``[N, K]`` signed 4-bit integers,

    y[m, n] = (acc[m, n] * s_a[m]) * s_w[n] (+ bias[n]),   acc = Σ_k A[m, k] W[n, k]

with an exact int32 ``acc`` and fp32 scaling, written as BF16 (or fp32 for the unfused
pipeline). Per-output-channel weight scales only: group-wise base scales are rejected.

Packed layout (:mod:`mosaicquant.methods.format`, used as stored, no repacking):
``a_packed`` ``uint8 [M, ceil(K/2)]`` and ``qweight`` ``uint8 [N, ceil(K/2)]``, byte ``j``
holding elements ``2j`` (low nibble) and ``2j + 1`` (high nibble). A program owns a
``[BM, BN]`` output tile and walks packed K in steps of ``BKP`` bytes: it loads an
``[BM, BKP]`` activation tile and a ``[BKP, BN]`` weight tile (K-contiguous, 16-byte
loads), splits both into low/high nibbles by shifts, and issues two int8 tensor-core dots
(even K and odd K) into one int32 accumulator, so no interleave/join is needed. By default the
nibbles are unpacked as ``16 q`` (moved to the byte's high half: one or two instructions per
four bytes instead of four or five), the accumulator holds ``256 ×`` the product, and the
epilogue's exact power-of-two rescale gives the same result. For a
handful of rows (``TileConfig.use_dot=False``, M ≤ 4) the same tiles go through CUDA-core
multiply-adds instead of tensor-core dots. K needs no
particular multiple: the tail step is masked (padding nibbles are zero on both sides).

Small M (decode) is memory-bound and has few output tiles, so K is split across
``SPLIT_K`` programs: each writes an fp32 partial, the last to arrive (atomic counter per
tile) sums the partials in split order, adds the bias and writes the output. With
``gated=True`` (a stacked ``[gate | up]`` layer, one tile of tokens) a gate tile and its up tile
share one counter and the last of their partials writes ``bf16(silu(g)) · u``, the SiLU·mul of
the MLP, so the decode step needs no kernel of its own for it.

Prefill-sized M runs the operand-swapped variant (:func:`w4a4_gemm_swapped_triton`,
``Cᵀ = W Aᵀ``) on int8 activations in the ``"split8"`` layout: the unpacked weights are the
tensor-core dot's register operand, so they are never written back to shared memory. It can
also take a layer's residual blocks, walked after its dense loop (``residual_walk``): FP8 dots
accumulating into the output tile itself (default on the GPU; the tile is divided by the
block's row scales before and multiplied back after, exact integer products, one fp32
accumulator: capped at 128 registers, two programs share an SM), or int8 dots into a second
accumulator. Where the blocks' scales are
the base's row scales times ``2^-j`` (MosaicQuant's default ``rscale=pow2``), the ``"shared"`` walk
runs their int8 dots into the dense int32 accumulator itself, the integers shifted left by
``4 - j`` (what ``QuantLinear`` runs for such layers). With ``j <= 3`` (MosaicQuant's
``rscale_max_shift=3``) the ``"merged"`` walk multiplies a kept unit's base and residual as one int8 operand
``8 q + 2^(3-j) r`` and its dense loop skips the steps the kept blocks cover. Where ``M`` leaves a small remainder over a
multiple of the token tile, ``block_m_tail`` runs the last token tile narrower in the same launch.
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from mosaicquant.errors import UserInputError
from mosaicquant.kernels._common import (
    check_same_device,
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
    DENSE_PREFETCH_MIB,
    LOCK_SLOTS,
    PREFETCH_MAX_M,
    TileConfig,
    lock_buffer,
    pdl_default,
    pdl_launch,
    pick_config,
    prefetch_row_bytes,
)
from mosaicquant.kernels._tl import (
    dense_split_k,
    in_range,
    store_counted_gated,
    store_output,
    store_split_tile,
    tile_coords,
    tile_indices,
    to_e4m3,
    unpack_e4m3,
    unpack_hi,
    unpack_hi16,
    unpack_lo,
    unpack_lo16,
    unpack_shift16,
    wait_for_inputs,
)
from mosaicquant.kernels.act_quant import SPLIT_BLOCK, split8_width
from mosaicquant.kernels.decoder import silu_mul_reference
from mosaicquant.kernels.tile_table import table_for
from mosaicquant.methods.format import ResidualBlocks, unpack_int4
from mosaicquant.methods.format import residual_shifts as residual_shifts_of

__all__ = ["w4a4_gemm", "w4a4_gemm_triton", "w4a4_gemm_swapped_triton", "w4a4_gemm_reference", "check_gemm_args",
           "check_weight_args",
           "swapped_residual_reason", "row_tile_order", "gated_shape_reason", "silu_mul_halves", "RESIDUAL_WALKS",
           "shifted_residual_operand", "merged_residual_operand", "dense_step_table", "MERGED_MAX_SHIFT"]

FP8_TAIL_MAX_REGS = 128
# the "shared" walk's register cap at prefill tiles (None: the compiler's choice)
SHARED_TAIL_MAX_REGS: int | None = 128
# ... and its tail's software-pipelining depth there (when tail_stages is not given): 2 against the kernel's 3
# stages measured -0.2 to -3.0 % on the Llama-3-8B linears at M = 2048 / 8192 (medians of three interleaved
# pairs, the same bits; 1 and 4 slower)
SHARED_TAIL_STAGES: int | None = 2
# Both operands unpacked as 16 q: |acc| <= 64 * 256 * K stays below 2**31 up to this K.
X16_MAX_K = 2**17
# how the swapped GEMM multiplies residual blocks (RES_MODE 1-5); "shared", "shifted" and "merged" need power-of-two
# scales (merged: shifts of at most MERGED_MAX_SHIFT)
RESIDUAL_WALKS = ("int8", "fp8", "shared", "shifted", "merged")
# the largest shift j (scale s_w * 2^-j) the "merged" walk takes: 8 q + 2^(3-j) r must be an integer within int8
MERGED_MAX_SHIFT = 3
# software-pipelining depth of the "merged" walk's dense loop: its step index is a load the tiles' loads depend on,
# and at the launch's 3 stages the compiler keeps one weight buffer and waits for every copy each step. On the H200
# (Llama-3-8B linears, M = 2048 / 8192, GEMM alone) 3 and 4 ran 14-43 % slower than 5; 7
# against 5 at M = 512-8192: -4.7 to +0.6 % in one run, -1.2 to +2.0 % in another (6 between)
MERGED_DENSE_STAGES = 7
# the swapped GEMM's K steps (and walked units) as one dot each on the joined halves (_joined_weights) instead of a
# dot per half, when joined_dot is not given. The compiler waits for every dot whose first operand is in registers
# before the next, so two dots a step drained the tensor cores twice. On the H200 (Llama-3-8B linears, GEMM alone,
# M = 512 / 2048 / 8192): dense 0.90-0.99x the time, the shared walk 0.92-0.97x, the
# merged walk 0.91-1.00x; the same bits
JOINED_DOT = True


@triton.jit
def _w4a4_gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr,
    M, N, KP, stride_am, stride_wn, stride_om, PF_ROW_BYTES,
    HAS_BIAS: tl.constexpr, OUT_FP32: tl.constexpr, EVEN_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BKP: tl.constexpr, SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr,
    USE_DOT: tl.constexpr, USE_ASM: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
    X16: tl.constexpr = False, GATED: tl.constexpr = False,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    # out-of-range rows/channels read wrapped indices instead (safe_*, _tl.in_range; their results are never stored)
    pid_m, pid_n, offs_m, offs_n, safe_m, safe_n = tile_indices(pid, M, N, BM, BN, GROUP_M)
    acc = dense_split_k(a_ptr, w_ptr, safe_m, safe_n, stride_am, stride_wn, KP, PF_ROW_BYTES, pid_k,
                        BM, BN, BKP, SPLIT_K, EVEN_K, USE_DOT, USE_ASM, PDL, PREFETCH, X16)
    a_scale = tl.load(a_scale_ptr + offs_m, mask=offs_m < M, other=0.0)
    w_scale = tl.load(w_scale_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    y = acc.to(tl.float32) * a_scale[:, None] * w_scale[None, :]
    if X16:  # both operands were 16x: exact power-of-two rescale (the same rounding as without)
        y = y * 0.00390625
    if GATED:
        # stacked [gate | up] columns, one tile of M rows: gate tile q and up tile q + HALF share a
        # counter; their 2 * SPLIT_K partials (slots: SPLIT_K a tile, in split order) are summed by
        # the last to arrive, which writes bf16(silu(g)) * u at [M, N / 2]
        HALF = (N // 2) // BN
        q = pid_n % HALF
        store_counted_gated(out_ptr, part_ptr, lock_ptr, q, pid_n * SPLIT_K + pid_k, q * SPLIT_K, SPLIT_K,
                            (q + HALF) * SPLIT_K, SPLIT_K, y, bias_ptr, offs_m, q * BN + tl.arange(0, BN), M,
                            N // 2, stride_om, HAS_BIAS=HAS_BIAS)
    else:
        store_output(
            out_ptr, part_ptr, lock_ptr, pid, pid_k, y, bias_ptr, offs_m, offs_n, M, N, stride_om,
            HAS_BIAS=HAS_BIAS, SPLIT_K=SPLIT_K, OUT_FP32=OUT_FP32,
        )


@triton.jit
def _unit_k0(coords_ptr, first, u, units, BKP_RES: tl.constexpr):
    """First K index (= split8 byte offset) of unit ``u`` of a block row's residual walk (0 past the end)."""
    p = first + u // (BKP_RES // 64)
    col = tl.load(coords_ptr + 2 * p + 1, mask=u < units, other=0).to(tl.int64)
    return col * (2 * BKP_RES) + 2 * ((u % (BKP_RES // 64)) * 64)


@triton.jit
def _unit_activations(a_ptr, u, units, k0, safe_m, stride_am, KS):
    """The two split8 activation tiles (even, odd values) of residual unit ``u`` starting at K index ``k0``."""
    half = tl.arange(0, 64)
    a_blk = a_ptr + safe_m[None, :] * stride_am + k0 + half[:, None]
    inside = (u < units) & (k0 < KS)  # a ragged last block column ends early
    return tl.load(a_blk, mask=inside, other=0), tl.load(a_blk + 64, mask=inside, other=0)


@triton.jit
def _unit_joined(a_ptr, u, units, k0, safe_m, stride_am, KS):
    """Residual unit ``u``'s activations as one ``[128, BM]`` tile (its split8 block: even values, then odd)."""
    unit = tl.arange(0, 128)
    return tl.load(a_ptr + safe_m[None, :] * stride_am + k0 + unit[:, None], mask=(u < units) & (k0 < KS), other=0)


@triton.jit
def _join_halves(lo, hi, BN: tl.constexpr):
    """``[BN, 64]`` low and high tiles of one unit as one ``[BN, 128]`` operand (low first; registers renamed)."""
    return tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BN, 128))


@triton.jit
def _joined_weights(w, USE_ASM: tl.constexpr, X16: tl.constexpr, BN: tl.constexpr, BKP: tl.constexpr):
    """A packed step ``[BN, BKP]`` unpacked as one ``[BN, 2 BKP]`` operand in the split8 order of the activations
    (per 128 values: the 64 low nibbles, then the 64 high ones), for one dot per step instead of two.

    In the dot's register layout the concatenation is a renaming of registers (each thread's bytes of the low and the
    high tile sit where the joined tile wants them): no data moves (offline sm_90 compile)."""
    if X16:
        lo = unpack_lo16(w, USE_ASM)
        hi = unpack_hi16(w, USE_ASM)
    else:
        lo = unpack_lo(w, USE_ASM)
        hi = unpack_hi(w, USE_ASM)
    both = tl.reshape(tl.join(lo, hi), (BN, BKP // 64, 64, 2))
    return tl.reshape(tl.permute(both, (0, 1, 3, 2)), (BN, 2 * BKP))


@triton.jit
def _residual_unit(a_ptr, res_val_ptr, res_scale_ptr, first, u, units, k0, safe_m, res_rows, stride_am, KS,
                   BN_RES: tl.constexpr, BKP_RES: tl.constexpr):
    """Unit ``u`` (starting at K index ``k0``): its two activation tiles, packed residual rows and scales.

    Everything past the last unit (``u >= units``) loads as zeros.
    """
    a_even, a_odd = _unit_activations(a_ptr, u, units, k0, safe_m, stride_am, KS)
    r, r_scale = _unit_rows(res_val_ptr, res_scale_ptr, first, u, units, res_rows, BN_RES, BKP_RES)
    return a_even, a_odd, r, r_scale


@triton.jit
def _unit_rows(res_val_ptr, res_scale_ptr, first, u, units, res_rows, BN_RES: tl.constexpr, BKP_RES: tl.constexpr):
    """Unit ``u``'s packed residual rows ``[rows, 64]`` and their scales (zeros past the last unit)."""
    valid = u < units
    p = first + u // (BKP_RES // 64)
    chunk = (u % (BKP_RES // 64)) * 64
    half = tl.arange(0, 64)
    r = tl.load(res_val_ptr + p * (BN_RES * BKP_RES) + res_rows[:, None] * BKP_RES + chunk + half[None, :],
                mask=valid, other=0)
    r_scale = tl.load(res_scale_ptr + p * BN_RES + res_rows, mask=valid, other=0)  # scales (or shifts) as stored
    return r, r_scale


@triton.jit
def _walk_bounds(row_ptr_ptr, pid_n, offs_n, BN: tl.constexpr, BN_RES: tl.constexpr, BKP_RES: tl.constexpr):
    """The residual walk's rows within the block row of weight tile ``pid_n``, its first block and its units."""
    block_row = (pid_n * BN) // BN_RES
    res_rows = (offs_n - block_row * BN_RES).to(tl.int64)  # storage is padded to full blocks
    first = tl.load(row_ptr_ptr + block_row).to(tl.int64)
    units = (tl.load(row_ptr_ptr + block_row + 1).to(tl.int64) - first) * (BKP_RES // 64)
    return res_rows, first, units


@triton.jit
def _merged_dense(acc, w_ptr, a_ptr, res_aux_ptr, safe_n, safe_m, kk, stride_wn, stride_am, KP, k_steps, pid_n, pid_k,
                  BN: tl.constexpr, BN_RES: tl.constexpr, BKP: tl.constexpr, SPLIT_K: tl.constexpr,
                  EVEN_K: tl.constexpr, USE_ASM: tl.constexpr, DENSE_STAGES: tl.constexpr, JOIN: tl.constexpr):
    """The merged walk's dense loop: the steps of the block row's step table (``res_aux_ptr``: the count of steps no
    kept block covers, then those steps), ``16 q`` weights, split over ``SPLIT_K`` programs."""
    block_row = (pid_n * BN) // BN_RES
    srow = res_aux_ptr + block_row.to(tl.int64) * (k_steps + 1)
    n_dense = tl.load(srow)
    if SPLIT_K == 1:
        i_begin = 0
        i_end = n_dense
    else:
        per_split = tl.cdiv(n_dense, SPLIT_K)
        i_begin = pid_k * per_split
        i_end = tl.minimum(i_begin + per_split, n_dense)
    w_row = w_ptr + safe_n[:, None] * stride_wn + kk[None, :]
    a_row = a_ptr + safe_m[None, :] * stride_am + kk[:, None]
    kj = tl.arange(0, 2 * BKP)
    a_both = a_ptr + safe_m[None, :] * stride_am + kj[:, None]
    for i in tl.range(i_begin, i_end, num_stages=DENSE_STAGES):
        step = tl.load(srow + 1 + i).to(tl.int64)
        if JOIN:
            if EVEN_K:
                w = tl.load(w_row + step * BKP)
                a = tl.load(a_both + step * 2 * BKP)
            else:
                w = tl.load(w_row + step * BKP, mask=((step * BKP + kk) < KP)[None, :], other=0)
                a = tl.load(a_both + step * 2 * BKP, mask=((step * BKP + kj % 64) < KP)[:, None], other=0)
            acc = tl.dot(_joined_weights(w, USE_ASM, True, BN, BKP), a, acc, out_dtype=tl.int32)
        else:
            if EVEN_K:
                w = tl.load(w_row + step * BKP)
                a_even = tl.load(a_row + step * 2 * BKP)
                a_odd = tl.load(a_row + step * 2 * BKP + 64)
            else:
                inside = (step * BKP + kk) < KP
                w = tl.load(w_row + step * BKP, mask=inside[None, :], other=0)
                a_even = tl.load(a_row + step * 2 * BKP, mask=inside[:, None], other=0)
                a_odd = tl.load(a_row + step * 2 * BKP + 64, mask=inside[:, None], other=0)
            acc = tl.dot(unpack_lo16(w, USE_ASM), a_even, acc, out_dtype=tl.int32)
            acc = tl.dot(unpack_hi16(w, USE_ASM), a_odd, acc, out_dtype=tl.int32)
    return acc


@triton.jit
def _int8_walk(acc, a_ptr, res_val_ptr, coords_ptr, first, units, unit_begin, safe_m, res_rows, stride_am, KS,
               BN_RES: tl.constexpr, BKP_RES: tl.constexpr, SPLIT_K: tl.constexpr, TAIL_STAGES: tl.constexpr,
               JOIN: tl.constexpr):
    """The walk of int8 block operands stored per block ``[Bn, Bk]``, each 128-value unit as its 64 even values, then
    its 64 odd ones (the split8 order): the "shifted" walk's ``r · 2^(4-j)``, the "merged" walk's
    ``8 q + 2^(3-j) r``."""
    for u in tl.range(unit_begin, units, SPLIT_K, num_stages=TAIL_STAGES):
        k0 = _unit_k0(coords_ptr, first, u, units, BKP_RES)
        p = first + u // (BKP_RES // 64)
        if JOIN:  # a unit's operand is 128 contiguous bytes a row, as its activations: one dot
            a = _unit_joined(a_ptr, u, units, k0, safe_m, stride_am, KS)
            m_blk = (res_val_ptr + p * (BN_RES * 2 * BKP_RES) + res_rows[:, None] * (2 * BKP_RES)
                     + (u % (BKP_RES // 64)) * 128 + tl.arange(0, 128)[None, :])
            acc = tl.dot(tl.load(m_blk, mask=u < units, other=0), a, acc, out_dtype=tl.int32)
        else:
            a_even, a_odd = _unit_activations(a_ptr, u, units, k0, safe_m, stride_am, KS)
            m_blk = (res_val_ptr + p * (BN_RES * 2 * BKP_RES) + res_rows[:, None] * (2 * BKP_RES)
                     + (u % (BKP_RES // 64)) * 128 + tl.arange(0, 64)[None, :])
            m_even = tl.load(m_blk, mask=u < units, other=0)
            m_odd = tl.load(m_blk + 64, mask=u < units, other=0)
            acc = tl.dot(m_even, a_even, acc, out_dtype=tl.int32)
            acc = tl.dot(m_odd, a_odd, acc, out_dtype=tl.int32)
    return acc


@triton.jit
def _residual_mac(y, a_even, a_odd, r, r_scale, BN: tl.constexpr, BM: tl.constexpr, USE_ASM: tl.constexpr):
    """``y += (R_lo · A_even + R_hi · A_odd) ⊙ s_r`` for one residual unit (exact int32 product, fp32 scaling)."""
    r_acc = tl.dot(unpack_lo(r, USE_ASM), a_even, tl.zeros([BN, BM], dtype=tl.int32), out_dtype=tl.int32)
    r_acc = tl.dot(unpack_hi(r, USE_ASM), a_odd, r_acc, out_dtype=tl.int32)
    return y + r_acc.to(tl.float32) * r_scale.to(tl.float32)[:, None]


@triton.jit
def _w4a4_swapped_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr,
    row_ptr_ptr, coords_ptr, res_val_ptr, res_scale_ptr, res_aux_ptr, order_ptr,
    M, N, KP, KS, stride_am, stride_wn, stride_om, N_FULL, N_DIRECT, N_WHOLE,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, RES_MODE: tl.constexpr,
    BN_RES: tl.constexpr, BKP_RES: tl.constexpr, TAIL_STAGES: tl.constexpr, DENSE_STAGES: tl.constexpr,
    BN: tl.constexpr, BM: tl.constexpr, GROUP_N: tl.constexpr, USE_ASM: tl.constexpr,
    BKP: tl.constexpr = 64, SPLIT_K: tl.constexpr = 1, PDL: tl.constexpr = False, X16: tl.constexpr = False,
    E4M3_ASM: tl.constexpr = False, TAIL_BM: tl.constexpr = 0, REM_SPLIT: tl.constexpr = 1,
    JOIN: tl.constexpr = False, ORDERED: tl.constexpr = False,
):
    # Cᵀ = W Aᵀ: weight rows are the dot's first operand (unpacked in registers, where the
    # tensor-core instruction can read them), the "split8" activations its second (int8 tiles
    # loaded as stored, no unpacking). A packed K step of BKP bytes meets BKP / 64 split8 blocks
    # of 128 values: packed byte j of the step pairs with the block's even value j % 64 (and odd
    # value j % 64 + 64). Decode-sized M splits K over SPLIT_K programs (fp32 partials).
    # TAIL_BM > 0: the tokens are N_FULL tiles of BM and a last tile of TAIL_BM (ragged M just above a
    # multiple of BM); in grouped order a weight tile's narrow last tile follows its full ones. A tile's token count
    # is a compile-time constant of the code that runs it, hence a call of _swapped_tile per tile size.
    # REM_SPLIT > 1: the tiles from N_DIRECT on (the grid's last, partial wave) run split over K, REM_SPLIT programs a
    # tile, their partials in a buffer of their own (part_ptr, one [REM_SPLIT, BN, BM] block a split tile) and
    # counters from lock_ptr's slot 0 (_tiles.swapped_rem_split). This launch's first N_WHOLE programs run tiles
    # 0 .. N_WHOLE - 1 whole: N_DIRECT of them where the whole tiles share the launch, 0 where they had one of
    # their own (REM_SPLIT = 1; TileTable.swap_rem_one_launch).
    pid = tl.program_id(0)
    if REM_SPLIT > 1:
        if pid < N_WHOLE:
            _swapped_dispatch(
                pid, 0, 0, a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr,
                row_ptr_ptr, coords_ptr, res_val_ptr, res_scale_ptr, res_aux_ptr, order_ptr,
                M, N, KP, KS, stride_am, stride_wn, stride_om, N_FULL, HAS_BIAS, EVEN_K, RES_MODE, BN_RES, BKP_RES,
                TAIL_STAGES, DENSE_STAGES, BN, BM, GROUP_N, USE_ASM, BKP, 1, PDL, X16, E4M3_ASM, TAIL_BM, False,
                JOIN, ORDERED)
        else:
            q = pid - N_WHOLE
            _swapped_dispatch(
                N_DIRECT + q // REM_SPLIT, q % REM_SPLIT, q // REM_SPLIT, a_ptr, a_scale_ptr, w_ptr, w_scale_ptr,
                bias_ptr, out_ptr, part_ptr, lock_ptr, row_ptr_ptr, coords_ptr, res_val_ptr, res_scale_ptr,
                res_aux_ptr, order_ptr, M, N, KP, KS, stride_am, stride_wn, stride_om, N_FULL, HAS_BIAS, EVEN_K,
                RES_MODE, BN_RES, BKP_RES, TAIL_STAGES, DENSE_STAGES, BN, BM, GROUP_N, USE_ASM, BKP, REM_SPLIT, PDL,
                X16, E4M3_ASM, TAIL_BM, True, JOIN, ORDERED)
    else:
        _swapped_dispatch(
            pid, tl.program_id(1), 0, a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr,
            row_ptr_ptr, coords_ptr, res_val_ptr, res_scale_ptr, res_aux_ptr, order_ptr,
            M, N, KP, KS, stride_am, stride_wn, stride_om, N_FULL, HAS_BIAS, EVEN_K, RES_MODE, BN_RES, BKP_RES,
            TAIL_STAGES, DENSE_STAGES, BN, BM, GROUP_N, USE_ASM, BKP, SPLIT_K, PDL, X16, E4M3_ASM, TAIL_BM, False,
            JOIN, ORDERED)


@triton.jit
def _swapped_dispatch(
    pid, pid_k, slot, a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr,
    row_ptr_ptr, coords_ptr, res_val_ptr, res_scale_ptr, res_aux_ptr, order_ptr,
    M, N, KP, KS, stride_am, stride_wn, stride_om, N_FULL,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, RES_MODE: tl.constexpr,
    BN_RES: tl.constexpr, BKP_RES: tl.constexpr, TAIL_STAGES: tl.constexpr, DENSE_STAGES: tl.constexpr,
    BN: tl.constexpr, BM: tl.constexpr, GROUP_N: tl.constexpr, USE_ASM: tl.constexpr,
    BKP: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr, X16: tl.constexpr,
    E4M3_ASM: tl.constexpr, TAIL_BM: tl.constexpr, COMPACT: tl.constexpr, JOIN: tl.constexpr,
    ORDERED: tl.constexpr = False,
):
    """Tile ``pid`` (grouped order), split ``pid_k`` of ``SPLIT_K``: its coordinates, then :func:`_swapped_tile`
    (``COMPACT``: its partial in slot ``slot`` of a buffer of split tiles, :func:`store_split_tile`). ``ORDERED``:
    the grouped order runs over the weight-row tiles as ``order_ptr`` lists them (:func:`row_tile_order`)."""
    if TAIL_BM > 0:
        pid_n, tile_slot = tile_coords(pid, N, N_FULL + 1, BN, 1, GROUP_N)
        if ORDERED:
            pid_n = tl.load(order_ptr + pid_n)
        if tile_slot < N_FULL:
            _swapped_tile(
                pid, pid_k, pid_n, tile_slot * BM, slot, a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr,
                part_ptr, lock_ptr, row_ptr_ptr, coords_ptr, res_val_ptr, res_scale_ptr, res_aux_ptr,
                M, N, KP, KS, stride_am, stride_wn, stride_om, HAS_BIAS, EVEN_K, RES_MODE, BN_RES, BKP_RES,
                TAIL_STAGES, DENSE_STAGES, BN, BM, USE_ASM, BKP, SPLIT_K, PDL, X16, E4M3_ASM, COMPACT, BM, JOIN)
        else:
            _swapped_tile(
                pid, pid_k, pid_n, N_FULL * BM, slot, a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr,
                part_ptr, lock_ptr, row_ptr_ptr, coords_ptr, res_val_ptr, res_scale_ptr, res_aux_ptr,
                M, N, KP, KS, stride_am, stride_wn, stride_om, HAS_BIAS, EVEN_K, RES_MODE, BN_RES, BKP_RES,
                TAIL_STAGES, DENSE_STAGES, BN, TAIL_BM, USE_ASM, BKP, SPLIT_K, PDL, X16, E4M3_ASM, COMPACT, BM, JOIN)
    else:
        pid_n, pid_m = tile_coords(pid, N, M, BN, BM, GROUP_N)
        if ORDERED:
            pid_n = tl.load(order_ptr + pid_n)
        _swapped_tile(
            pid, pid_k, pid_n, pid_m * BM, slot, a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr,
            part_ptr, lock_ptr, row_ptr_ptr, coords_ptr, res_val_ptr, res_scale_ptr, res_aux_ptr,
            M, N, KP, KS, stride_am, stride_wn, stride_om, HAS_BIAS, EVEN_K, RES_MODE, BN_RES, BKP_RES,
            TAIL_STAGES, DENSE_STAGES, BN, BM, USE_ASM, BKP, SPLIT_K, PDL, X16, E4M3_ASM, COMPACT, BM, JOIN)


@triton.jit
def _swapped_tile(
    pid, pid_k, pid_n, m0, slot, a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr,
    row_ptr_ptr, coords_ptr, res_val_ptr, res_scale_ptr, res_aux_ptr,
    M, N, KP, KS, stride_am, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, RES_MODE: tl.constexpr,
    BN_RES: tl.constexpr, BKP_RES: tl.constexpr, TAIL_STAGES: tl.constexpr, DENSE_STAGES: tl.constexpr,
    BN: tl.constexpr, BM: tl.constexpr, USE_ASM: tl.constexpr,
    BKP: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr, X16: tl.constexpr, E4M3_ASM: tl.constexpr,
    COMPACT: tl.constexpr = False, SLOT_BM: tl.constexpr = 0, JOIN: tl.constexpr = False,
):
    """One program's ``[BN, BM]`` tile of the swapped GEMM: weight rows from ``pid_n * BN``, tokens from ``m0``
    (``COMPACT``: a split's partial goes to slot ``slot`` of a buffer of split tiles of ``[BN, SLOT_BM]``,
    :func:`store_split_tile`)."""
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = m0 + tl.arange(0, BM)
    safe_n = in_range(offs_n, N)
    safe_m = in_range(offs_m, M)
    kk = tl.arange(0, BKP)
    k_steps = tl.cdiv(KP, BKP)
    if SPLIT_K == 1:
        step_begin = 0
        step_end = k_steps
        unit_begin = 0
    else:
        per_split = tl.cdiv(k_steps, SPLIT_K)
        step_begin = pid_k * per_split
        step_end = tl.minimum(step_begin + per_split, k_steps)
        unit_begin = pid_k
    w_ptrs = w_ptr + safe_n[:, None] * stride_wn + (step_begin * BKP + kk)[None, :]
    a_ptrs = a_ptr + safe_m[None, :] * stride_am + (step_begin * 2 * BKP + (kk // 64) * 128 + kk % 64)[:, None]
    w_scale = tl.load(w_scale_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    wait_for_inputs(PDL)  # the activations come from the kernel before us
    acc = tl.zeros([BN, BM], dtype=tl.int32)
    if RES_MODE == 5:
        # "merged" walk: the dense loop runs only the K steps (one split8 block each, BKP = 64) that no kept
        # block of this tile's block row covers; each kept unit (after the loop) multiplies its base and residual
        # as one int8 operand. 16 q · a is a multiple of 16: halving is exact, and the sum then counts in the
        # s_w / 8 units of the merged operands (8 q + 2^(3-j) r)
        acc = _merged_dense(acc, w_ptr, a_ptr, res_aux_ptr, safe_n, safe_m, kk, stride_wn, stride_am, KP, k_steps,
                            pid_n, pid_k, BN, BN_RES, BKP, SPLIT_K, EVEN_K, USE_ASM, DENSE_STAGES, JOIN)
        acc = acc >> 1
    if RES_MODE != 5 and JOIN:
        # one dot a step on the joined operand: the compiler waits for each dot before the next step's unpacking
        # (its register operand keeps a dot from staying in flight), and two dots a step waited twice
        kj = tl.arange(0, 2 * BKP)
        a_both = a_ptr + safe_m[None, :] * stride_am + (step_begin * 2 * BKP + kj)[:, None]
        for step in range(step_begin, step_end):
            if EVEN_K:
                w = tl.load(w_ptrs)
                a = tl.load(a_both)
            else:
                w = tl.load(w_ptrs, mask=((step * BKP + kk) < KP)[None, :], other=0)
                a = tl.load(a_both, mask=((step * BKP + (kj // 128) * 64 + kj % 64) < KP)[:, None], other=0)
            acc = tl.dot(_joined_weights(w, USE_ASM, X16, BN, BKP), a, acc, out_dtype=tl.int32)
            w_ptrs += BKP
            a_both += 2 * BKP
    if RES_MODE != 5 and not JOIN:
        for step in range(step_begin, step_end):
            if EVEN_K:
                w = tl.load(w_ptrs)
                a_even = tl.load(a_ptrs)  # the split8 rows are padded to whole blocks
                a_odd = tl.load(a_ptrs + 64)
            else:
                inside = (step * BKP + kk) < KP
                w = tl.load(w_ptrs, mask=inside[None, :], other=0)
                a_even = tl.load(a_ptrs, mask=inside[:, None], other=0)
                a_odd = tl.load(a_ptrs + 64, mask=inside[:, None], other=0)
            if X16:
                acc = tl.dot(unpack_lo16(w, USE_ASM), a_even, acc, out_dtype=tl.int32)
                acc = tl.dot(unpack_hi16(w, USE_ASM), a_odd, acc, out_dtype=tl.int32)
            else:
                acc = tl.dot(unpack_lo(w, USE_ASM), a_even, acc, out_dtype=tl.int32)
                acc = tl.dot(unpack_hi(w, USE_ASM), a_odd, acc, out_dtype=tl.int32)
            w_ptrs += BKP
            a_ptrs += 2 * BKP
    if RES_MODE > 0:
        # Tail walk over the kept residual blocks of this tile's block row (CSR), in units of one
        # 128-value split8 block (a block column of Bk = 2 * BKP_RES values has Bk / 128 of them;
        # with split K, every SPLIT_K-th unit): the activation tiles are read as in the dense loop
        # (again, mostly from L2), the block's rows are its packed bytes.
        res_rows, first, units = _walk_bounds(row_ptr_ptr, pid_n, offs_n, BN, BN_RES, BKP_RES)
    if RES_MODE == 3:
        # "shared" walk: the kept blocks' scales are s_w * 2^-j (residual_shifts), so a block's integers
        # shifted left by 4 - j count in the s_w / 16 units of the base unpacked as 16 q (X16), and its
        # int8 dots go into the dense accumulator itself: no second accumulator, conversion or rescale.
        for u in tl.range(unit_begin, units, SPLIT_K, num_stages=TAIL_STAGES):
            k0 = _unit_k0(coords_ptr, first, u, units, BKP_RES)
            if JOIN:
                a = _unit_joined(a_ptr, u, units, k0, safe_m, stride_am, KS)
                r, shift = _unit_rows(res_val_ptr, res_aux_ptr, first, u, units, res_rows, BN_RES, BKP_RES)
                r16 = _join_halves(unpack_shift16(r, shift, False, USE_ASM), unpack_shift16(r, shift, True, USE_ASM),
                                   BN)
                acc = tl.dot(r16, a, acc, out_dtype=tl.int32)
            else:
                a_even, a_odd, r, shift = _residual_unit(a_ptr, res_val_ptr, res_aux_ptr, first, u, units, k0, safe_m,
                                                         res_rows, stride_am, KS, BN_RES, BKP_RES)
                acc = tl.dot(unpack_shift16(r, shift, False, USE_ASM), a_even, acc, out_dtype=tl.int32)
                acc = tl.dot(unpack_shift16(r, shift, True, USE_ASM), a_odd, acc, out_dtype=tl.int32)
    if RES_MODE == 4 or RES_MODE == 5:
        acc = _int8_walk(acc, a_ptr, res_val_ptr, coords_ptr, first, units, unit_begin, safe_m, res_rows, stride_am,
                         KS, BN_RES, BKP_RES, SPLIT_K, TAIL_STAGES, JOIN)
    # the dense int32 accumulator dies here; residual blocks of the other walks accumulate into y
    y = acc.to(tl.float32) * w_scale[:, None]
    if RES_MODE == 5:  # counted in s_w / 8
        y = y * 0.125
    elif X16:  # the weights were 16x: exact power-of-two rescale
        y = y * 0.0625
    if RES_MODE == 1 or RES_MODE == 2:
        for u in tl.range(unit_begin, units, SPLIT_K, num_stages=TAIL_STAGES):
            k0 = _unit_k0(coords_ptr, first, u, units, BKP_RES)
            a_even, a_odd, r, r_scale = _residual_unit(
                a_ptr, res_val_ptr, res_scale_ptr, first, u, units, k0, safe_m, res_rows, stride_am, KS, BN_RES, BKP_RES)
            if RES_MODE == 1:
                # exact int32 product in a second accumulator, scaled into y
                y = _residual_mac(y, a_even, a_odd, r, r_scale, BN, BM, USE_ASM)
            else:
                # FP8 tensor-core dots accumulate into y itself (4-bit integers and their
                # products are exact in e4m3 / fp32; a unit's sums stay below 2**24): y is
                # divided by the unit's row scales, the product added, and multiplied back, so
                # no second [BN, BM] accumulator is live (registers, hence two programs per SM)
                # (a zero row scale only comes with zero integers: 1 there adds the same nothing)
                r_scale = r_scale.to(tl.float32)
                r_scale = tl.where(r_scale == 0.0, 1.0, r_scale)
                y = y * (1.0 / r_scale)[:, None]
                if E4M3_ASM:
                    y = tl.dot(unpack_e4m3(r, False, USE_ASM), to_e4m3(a_even, USE_ASM), y)
                    y = tl.dot(unpack_e4m3(r, True, USE_ASM), to_e4m3(a_odd, USE_ASM), y)
                else:
                    y = tl.dot(to_e4m3(unpack_lo(r, USE_ASM)), to_e4m3(a_even), y)
                    y = tl.dot(to_e4m3(unpack_hi(r, USE_ASM)), to_e4m3(a_odd), y)
                y = y * r_scale[:, None]
    a_scale = tl.load(a_scale_ptr + offs_m, mask=offs_m < M, other=0.0)
    y = y * a_scale[None, :]
    if COMPACT:
        store_split_tile(out_ptr, part_ptr, lock_ptr, slot, pid_k, y, bias_ptr, offs_m, offs_n, M, N, stride_om,
                         HAS_BIAS=HAS_BIAS, SPLIT_K=SPLIT_K, BN=BN, BM=BM, SLOT=BN * SLOT_BM)
    else:
        store_output(
            out_ptr, part_ptr, lock_ptr, pid, pid_k, y, bias_ptr, offs_m, offs_n, M, N, stride_om,
            HAS_BIAS=HAS_BIAS, SPLIT_K=SPLIT_K, OUT_FP32=False, TRANS=True,
        )


def check_gemm_args(
    a_packed: torch.Tensor,
    a_scale: torch.Tensor,
    qweight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
) -> tuple[int, int, int]:
    """Check the operands of a 4-bit GEMM and return ``(M, N, KP)``.

    Raises:
        UserInputError: naming the wrong dtype, shape, stride, device or a group-wise scale.
    """
    check_tensor("a_packed", a_packed, dtypes=(torch.uint8,), dim=2)
    n, kp = check_weight_args(qweight, w_scale, bias, k)
    m = a_packed.shape[0]
    check_tensor("a_packed", a_packed, dtypes=(torch.uint8,), shape=(None, kp))
    check_tensor("a_scale", a_scale, dtypes=(torch.float32,), shape=(m,))
    check_same_device(a_packed=a_packed, a_scale=a_scale, qweight=qweight, w_scale=w_scale, bias=bias)
    return m, n, kp


def check_weight_args(
    qweight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
) -> tuple[int, int]:
    """Check the weight side of a 4-bit GEMM (as :func:`check_gemm_args`) and return ``(N, KP)``.

    For an odd ``k`` the weight's padding nibbles must be 0 (the kernels multiply all ``2 * KP`` values): read
    once per weight tensor, see :func:`_check_padding`.

    Raises:
        UserInputError: naming the wrong dtype, shape, stride, a group-wise scale, or a ``k`` the packed
            weight does not match.
    """
    check_tensor("qweight", qweight, dtypes=(torch.uint8,), dim=2)
    if not isinstance(k, int) or k < 1:
        raise UserInputError(f"k={k!r} must be a positive int (the unpacked K)")
    kp = (k + 1) // 2
    n = qweight.shape[0]
    check_tensor("qweight", qweight, dtypes=(torch.uint8,), shape=(None, kp))
    check_tensor("w_scale", w_scale, dtypes=(torch.float32, torch.float16), dim=None)
    if w_scale.dim() == 2 and w_scale.shape[1] != 1:
        raise UserInputError(
            f"w_scale has {w_scale.shape[1]} groups per channel: the 4-bit GEMM kernels support "
            f"per-output-channel weight scales only (group_size=None), shape [{n}] or [{n}, 1]"
        )
    flat = w_scale.reshape(-1)
    if flat.shape[0] != n:
        raise UserInputError(f"w_scale must have {n} entries (one per output channel), got shape {list(w_scale.shape)}")
    if n > 1 and flat.stride(0) != 1:
        # the kernels read w_scale.reshape(-1) as n consecutive values; an [N, 1] slice of a wider tensor
        # passes the last-dimension check (size 1) but its entries are strides apart
        raise UserInputError(
            f"w_scale's {n} entries must be consecutive in memory (unit stride), got shape {list(w_scale.shape)} "
            f"with strides {w_scale.stride()}: pass w_scale.contiguous()"
        )
    if bias is not None:
        check_tensor("bias", bias, dtypes=(torch.float32,), shape=(n,))
    if k % 2:
        _check_padding(qweight, k)
    return n, kp


# qweight tensors of an odd K found with zero padding nibbles: id -> (weak reference, data pointer, version counter)
_CHECKED_PADDING: dict[int, tuple] = {}


def _check_padding(qweight: torch.Tensor, k: int) -> None:
    """An odd ``k``'s padding nibble (the high nibble of each row's last byte) must be 0, as ``pack_int4`` writes it.

    The kernels multiply every value of the packed width, ``2 * ceil(k / 2)``; the reference stops at ``k``. A weight
    packed for ``k + 1`` values and called with ``k`` would give another result. Reading the column back costs a host
    synchronisation, so a tensor is read once (until it is written again) and not under a CUDA graph capture, as
    :func:`_check_row_order` does.
    """
    if qweight.is_meta or qweight.numel() == 0 or _checked_before(_CHECKED_PADDING, qweight) or _capturing():
        return
    set_pad = (qweight[:, -1] >> 4) != 0
    if bool(set_pad.any()):
        kp = qweight.shape[1]
        raise UserInputError(
            f"k={k} does not match qweight: its {kp} packed columns hold {2 * kp} values and the padding nibble after "
            f"value {k} (the high nibble of a row's last byte) is not 0 in row {int(set_pad.nonzero()[0])}; pass the "
            f"K it was packed for, or pack {k} values (pack_int4 pads with 0)")
    _remember(_CHECKED_PADDING, qweight)


def _checked_before(registry: dict[int, tuple], t: torch.Tensor) -> bool:
    """Whether ``t`` passed a check recorded in ``registry`` and has not been written since (:func:`_remember`)."""
    key = registry.get(id(t))
    return key is not None and key[0]() is t and key[1:] == (t.data_ptr(), _version_of(t))


def _remember(registry: dict[int, tuple], t: torch.Tensor) -> None:
    """Record that ``t`` passed a check (forgetting the tensors since freed)."""
    for key in [key for key, v in registry.items() if v[0]() is None]:
        del registry[key]
    registry[id(t)] = (weakref.ref(t), t.data_ptr(), _version_of(t))


def _version_of(t: torch.Tensor) -> int | None:
    """``t``'s version counter (bumped by every in-place write), ``None`` for inference tensors (they keep none)."""
    return None if t.is_inference() else t._version


def w4a4_gemm_triton(
    a_packed: torch.Tensor,
    a_scale: torch.Tensor,
    qweight: torch.Tensor,
    w_scale: torch.Tensor,
    k: int,
    bias: torch.Tensor | None = None,
    *,
    out_fp32: bool = False,
    config: TileConfig | None = None,
    out: torch.Tensor | None = None,
    pdl: bool | None = None,
    prefetch_mib: float | None = None,
    x16: bool = True,
    gated: bool = False,
) -> torch.Tensor:
    """Launch the dense W4A4 Triton GEMM.

    Args:
        a_packed: ``uint8 [M, ceil(K/2)]`` packed activations (unit stride along K).
        a_scale: ``float32 [M]`` per-token scales.
        qweight: ``uint8 [N, ceil(K/2)]`` packed weights.
        w_scale: ``[N]`` or ``[N, 1]`` per-channel scales (fp16 or fp32), consecutive in memory.
        k: the unpacked K; an odd K's padding nibbles 0 (:func:`check_weight_args`).
        bias: optional ``float32 [N]``.
        out_fp32: write fp32 instead of BF16 (the unfused pipeline adds the residual to it).
        config: tiles (default :func:`mosaicquant.kernels._tiles.pick_config`).
        out: optional preallocated contiguous ``[M, N]`` output of the output dtype.
        pdl: programmatic dependent launch; with it, launches of M ≤ 256 may prefetch their
            weights into L2 while the kernel before them finishes (``prefetch_mib``). ``None``:
            where :func:`mosaicquant.kernels._tiles.pdl_default` says so (small M) and
            the settings' ``pdl`` is on (:mod:`mosaicquant.settings`); ``True``/``False`` force it (where the device
            supports it).
        prefetch_mib: with PDL, cap on the weight bytes the launch prefetches into L2
            (:func:`mosaicquant.kernels._tiles.prefetch_row_bytes`; ``None``:
            the settings' ``prefetch_mib`` if set, else
            :data:`mosaicquant.kernels._tiles.DENSE_PREFETCH_MIB`, shared by rows and splits;
            ``0``: PDL without prefetch).
        x16: unpack both operands as ``16 * q`` (:func:`mosaicquant.kernels._tl.mac_int4`; the
            same result exactly; taken only with tensor-core dots and ``K < 2**17``, where the
            256x accumulator cannot overflow). Default on: 1.04-1.37x faster at M <= 32 on the
            H200.
        gated: the layer is stacked ``[gate | up]`` (``N = 2I``): write ``bf16(silu(gate)) · up``,
            ``[M, I]`` BF16, from the counted fix-up of each gate tile and its up tile (the same
            bits as the GEMM followed by :func:`mosaicquant.kernels.decoder.silu_mul`), where
            :func:`gated_shape_reason` finds nothing against it.

    Returns:
        ``[M, N]`` BF16 (or fp32) output; ``[M, N / 2]`` gated.

    Raises:
        UserInputError: bad operands (see :func:`check_gemm_args`), device, or a gated call the
            tiles cannot take.
    """
    m, n, kp = check_gemm_args(a_packed, a_scale, qweight, w_scale, bias, k)
    check_triton_device(a_packed.device)
    cfg = config or pick_config(m, n, kp, a_packed.device)
    if gated:
        reason = gated_shape_reason(m, n, cfg, out_fp32)
        if reason is not None:
            raise UserInputError(f"gated=True cannot run this call: {reason}")
    out = output_buffer(out, (m, n // 2 if gated else n), torch.float32 if out_fp32 else torch.bfloat16,
                        a_packed.device)
    if m == 0 or n == 0:
        return out
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    split = cfg.split_k if tiles <= LOCK_SLOTS and cfg.split_k * m * n < 2**31 else 1
    if gated:  # SPLIT_K slots of one [BM, BN] tile each, for every tile
        part = torch.empty(tiles * split * cfg.block_m * cfg.block_n, dtype=torch.float32, device=out.device)
    else:
        part = torch.empty(split, m, n, dtype=torch.float32, device=out.device) if split > 1 else out
    w_scale = w_scale.reshape(-1)
    if pdl is None and not pdl_default(m, n, kp):
        pdl = False
    pdl = use_pdl(a_packed.device, pdl)
    pf_row = prefetch_row_bytes(n, kp, split, prefetch_mib, DENSE_PREFETCH_MIB)
    _w4a4_gemm_kernel[(tiles, split)](
        a_packed.view(torch.int8), a_scale, qweight.view(torch.int8), w_scale,
        bias if bias is not None else a_scale, out, part, lock_buffer(out.device),
        m, n, kp, a_packed.stride(0), qweight.stride(0), out.stride(0), pf_row,
        HAS_BIAS=bias is not None, OUT_FP32=out_fp32, EVEN_K=kp % cfg.block_kp == 0,
        BM=cfg.block_m, BN=cfg.block_n, BKP=cfg.block_kp, SPLIT_K=split, GROUP_M=cfg.group_m, USE_DOT=cfg.use_dot,
        USE_ASM=not triton_interpreting(), PDL=gemm_pdl(a_packed.device, m, pdl),
        PREFETCH=pdl and m <= PREFETCH_MAX_M and pf_row > 0,
        X16=bool(x16) and cfg.use_dot and k < X16_MAX_K, GATED=bool(gated),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(pdl),
    )
    return out


def gated_shape_reason(m: int, n: int, cfg: TileConfig, out_fp32: bool = False) -> str | None:
    """Why :func:`w4a4_gemm_triton` cannot write SiLU·mul of a stacked ``[gate | up]`` call of ``m``
    tokens on ``cfg``'s tiles (``gated=True``), or ``None``."""
    if out_fp32:
        return "it writes BF16 (out_fp32=True was asked)"
    if n % 2 or (n // 2) % cfg.block_n:
        return f"N={n} is not two halves of whole {cfg.block_n}-channel tiles"
    if m > cfg.block_m:
        return f"M={m} is more than one tile of {cfg.block_m} tokens"
    if (n // 2) // cfg.block_n > LOCK_SLOTS:
        return f"N={n} makes more tile pairs than the {LOCK_SLOTS} counters"
    return None


def row_tile_order(residual: ResidualBlocks, block_n: int) -> torch.Tensor:
    """The swapped GEMM's weight-row tiles of ``block_n`` rows (nested in ``residual``'s block rows), those whose
    block row keeps the most blocks first (ties in row order): ``int32 [ceil(N / block_n)]``, its ``row_order``.

    A tile's program walks its block row's kept blocks after the dense loop, so its time grows with their count;
    started first, the heavy tiles leave the light ones for the last wave.
    """
    bn_res = residual.block_shape[0]
    if bn_res % block_n:
        raise UserInputError(f"block_n={block_n} does not nest in the residual's {bn_res}-row blocks")
    tiles = -(-residual.shape[0] // block_n)
    kept = (residual.row_ptr[1:] - residual.row_ptr[:-1]).to(torch.int64)
    per_tile = kept.repeat_interleave(bn_res // block_n)[:tiles]
    # a stable sort, descending: the negated counts ascending
    return torch.sort(-per_tile, stable=True).indices.to(torch.int32)


def swapped_residual_reason(block_shape: tuple[int, int]) -> str | None:
    """``None`` when the swapped GEMM can fuse residual blocks of ``(Bn, Bk)``, else why not."""
    bn_res, bk_res = block_shape
    if bk_res % SPLIT_BLOCK or bn_res % 16:
        return (f"residual blocks {bn_res}x{bk_res}: the swapped GEMM needs rows a multiple of 16 and columns "
                f"a multiple of {SPLIT_BLOCK} (whole split8 activation blocks)")
    return None


def _split8_order(x: torch.Tensor) -> torch.Tensor:
    """Each 128-value unit of the last dimension as its 64 even values, then its 64 odd ones (the split8 order)."""
    *lead, bk = x.shape
    return x.reshape(*lead, bk // SPLIT_BLOCK, SPLIT_BLOCK // 2, 2).transpose(-1, -2).reshape(*lead, bk).contiguous()


def _residual_ints(residual: ResidualBlocks) -> torch.Tensor:
    """The kept blocks' integers, ``int16 [nb, Bn, Bk]``."""
    nb, (bn, bk) = residual.num_blocks, residual.block_shape
    return unpack_int4(residual.values.reshape(nb * bn, bk // 2), bk).reshape(nb, bn, bk).to(torch.int16)


def shifted_residual_operand(residual: ResidualBlocks, shifts: torch.Tensor) -> torch.Tensor:
    """The ``"shifted"`` walk's operand: each kept block's integers shifted left by ``4 - j``, ``int8 [nb, Bn, Bk]``.

    ``r · 2^(4-j)`` lies in [-128, 112] for ``r`` in [-8, 7] and ``j`` in 0..4; each 128-value unit is stored as
    its even values, then its odd ones (the split8 order the swapped GEMM's activations have).

    Args:
        residual: the layer's kept blocks (columns a multiple of 128).
        shifts: their ``int8 [nb, Bn]`` shifts (:func:`mosaicquant.methods.format.residual_shifts`).
    """
    r = _residual_ints(residual) << (4 - shifts.to(torch.int16)).unsqueeze(-1)
    return _split8_order(r.to(torch.int8))


def merged_residual_operand(qweight: torch.Tensor, k: int, residual: ResidualBlocks,
                            shifts: torch.Tensor) -> torch.Tensor:
    """The ``"merged"`` walk's operand: base and residual of each kept block as one integer, ``int8 [nb, Bn, Bk]``.

    A kept row of scale ``s_w · 2^-j`` holds ``s_w · q + s_w 2^-j r = (s_w / 8) · (8 q + 2^(3-j) r)``; for ``q``
    and ``r`` in [-8, 7] and ``j <= 3`` (:data:`MERGED_MAX_SHIFT`) that integer lies in [-128, 112], exactly an
    int8. Values past the weight's rows or columns are 0; units in the split8 order.

    Raises:
        UserInputError: a shift above :data:`MERGED_MAX_SHIFT`.
    """
    nb, (bn, bk) = residual.num_blocks, residual.block_shape
    n = residual.shape[0]
    if nb and int(shifts.max()) > MERGED_MAX_SHIFT:
        raise UserInputError(
            f"residual_walk='merged' takes residual scales s_w * 2^-j with j <= {MERGED_MAX_SHIFT}; these have j up to "
            f"{int(shifts.max())}: quantize with MosaicQuant's rscale_max_shift={MERGED_MAX_SHIFT}, or use "
            f"residual_walk='shared'")
    nbr, nbc = -(-n // bn), -(-k // bk)
    # the kept blocks' packed bytes only (zero padding past the weight: zero nibbles), then their integers
    packed = torch.zeros(nbr * bn, nbc * bk // 2, dtype=torch.uint8, device=qweight.device)
    packed[:n, :qweight.shape[1]] = qweight
    packed = packed.view(nbr, bn, nbc, bk // 2).permute(0, 2, 1, 3)[residual.coords[:, 0].long(),
                                                                    residual.coords[:, 1].long()]
    q = unpack_int4(packed.reshape(nb * bn, bk // 2), bk).reshape(nb, bn, bk).to(torch.int16)
    cols = residual.coords[:, 1].long().unsqueeze(1) * bk + torch.arange(bk, device=q.device)
    q = q * (cols < k).unsqueeze(1)  # an odd K's padding nibble
    merged = 8 * q + (_residual_ints(residual) << (3 - shifts.to(torch.int16)).unsqueeze(-1))
    return _split8_order(merged.to(torch.int8))


def dense_step_table(residual: ResidualBlocks, k: int) -> torch.Tensor:
    """The ``"merged"`` walk's dense steps: ``int32 [block rows, 1 + ceil(K / 128)]``.

    Row ``i`` holds the number of 128-value K steps that no kept block of block row ``i`` covers, then those steps
    in increasing order (the rest of the row is padding, never read).
    """
    bn, bk = residual.block_shape
    nbr = -(-residual.shape[0] // bn)
    steps = -(-k // SPLIT_BLOCK)
    per = bk // SPLIT_BLOCK
    kept = torch.zeros(nbr, steps + per, dtype=torch.bool, device=residual.coords.device)
    unit = residual.coords[:, 1].long().unsqueeze(1) * per + torch.arange(per, device=kept.device)
    kept[residual.coords[:, 0].long().unsqueeze(1).expand_as(unit), unit] = True
    kept = kept[:, :steps]
    order = torch.sort(kept.to(torch.int32) * steps + torch.arange(steps, device=kept.device), dim=1).indices
    table = torch.empty(nbr, steps + 1, dtype=torch.int32, device=kept.device)
    table[:, 0] = (~kept).sum(1)
    table[:, 1:] = order
    return table


# row_order tensors found to be permutations: id -> (weak reference, data pointer, version counter) at the check
_CHECKED_ORDERS: dict[int, tuple] = {}


def _check_row_order(row_order: torch.Tensor, block_n: int) -> None:
    """``row_order`` must be a permutation of the weight-row tiles, or tiles go unwritten. Reading it back costs a
    host synchronisation, so a tensor is read once (until it is written again) and not under a CUDA graph capture,
    which does not allow it (``QuantLinear`` builds its order with :func:`row_tile_order`)."""
    if _checked_before(_CHECKED_ORDERS, row_order) or _capturing():
        return
    tiles = row_order.numel()
    if not torch.equal(row_order.sort().values.cpu(), torch.arange(tiles, dtype=torch.int32)):
        raise UserInputError(f"row_order must be a permutation of the {tiles} weight-row tiles 0 .. {tiles - 1} of "
                             f"{block_n} rows (row_tile_order builds one)")
    _remember(_CHECKED_ORDERS, row_order)


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (no reading results back to the host)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _check_not_capturing(walk: str, name: str) -> None:
    """Deriving a walk's tables reads results back from the device, which a CUDA graph capture does not allow."""
    if _capturing():
        raise UserInputError(
            f"residual_walk={walk!r} under CUDA graph capture needs {name}: deriving it reads a result back from the "
            f"device, which a capture does not allow; compute it once before capturing (QuantLinear keeps it)")


def w4a4_gemm_swapped_triton(
    a_split: torch.Tensor,
    a_scale: torch.Tensor,
    qweight: torch.Tensor,
    w_scale: torch.Tensor,
    k: int,
    bias: torch.Tensor | None = None,
    *,
    residual: ResidualBlocks | None = None,
    residual_walk: str = "fp8",
    residual_shifts: torch.Tensor | None = None,
    residual_operand: torch.Tensor | None = None,
    dense_steps: torch.Tensor | None = None,
    tail_stages: int | None = None,
    block_n: int = 128,
    block_m: int = 128,
    block_m_tail: int | None = None,
    block_kp: int = 64,
    split_k: int = 1,
    num_warps: int = 8,
    num_stages: int = 3,
    pdl: bool = False,
    x16: bool = True,
    e4m3_asm: bool = True,
    rem_split: int | None = None,
    joined_dot: bool | None = None,
    row_order: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense W4A4 GEMM with the operands swapped (``Cᵀ = W Aᵀ``), for prefill-sized M.

    The weights are unpacked in registers as the dot's first operand; the activations come in
    the ``"split8"`` layout (:func:`mosaicquant.kernels.act_quant.quantize_activations_triton`
    with ``layout="split8"``) and are used as loaded. Same result as :func:`w4a4_gemm_triton`
    (with ``residual``: as :func:`mosaicquant.kernels.zipper.zipper_gemm_triton`, the kept
    blocks walked after the dense loop, ZipperEngine's ``"tail"`` fusion).

    Args:
        a_split: ``int8 [M, split8_width(K)]`` activations.
        a_scale, qweight, w_scale, k, bias: as :func:`w4a4_gemm_triton`.
        residual: optional :class:`~mosaicquant.methods.format.ResidualBlocks` of the layer
            (block columns a multiple of 128, rows a multiple of 16; see
            :func:`swapped_residual_reason`); ``block_n`` shrinks to nest in its block rows.
        residual_walk: how the kept blocks (walked after the dense loop, their activation
            tiles read again) are multiplied: ``"fp8"``, FP8 tensor-core dots accumulating into
            the output tile itself (rescaled by each block's row scales around them; on the
            GPU, int8 dots in the interpreter), or ``"int8"``, int8 dots into a second
            accumulator; the same result up to fp32 rounding. ``"shared"``: for residual scales
            that are the base's row scales times ``2^-j`` (:func:`mosaicquant.methods.format.residual_shifts`,
            MosaicQuant's ``rscale=pow2``), int8 dots of the integers shifted left by ``4 - j`` into the
            dense int32 accumulator itself (needs ``x16``); the exact integer sum, the walk of a dense step.
            ``"shifted"``: the same sums with the shifted integers stored as int8
            (:func:`shifted_residual_operand`, twice the residual's bytes), no unpacking in the walk.
            ``"merged"``: for shifts ``j <= 3``, each kept 128-value unit's base and residual as one int8
            operand ``8 q + 2^(3-j) r`` (:func:`merged_residual_operand`); the dense loop skips the K steps the
            kept blocks cover (:func:`dense_step_table`), so a kept unit costs one int8 step instead of two
            (``block_kp`` 64). The three give the same integer sums.
        residual_shifts: ``int8 [nb, Bn]`` shifts of the ``"shared"``, ``"shifted"`` and ``"merged"`` walks
            (derived from ``residual`` and ``w_scale`` when not given: a host synchronisation).
        residual_operand: the ``"shifted"`` or ``"merged"`` walk's ``int8 [nb, Bn, Bk]`` operand (derived when not
            given).
        dense_steps: the ``"merged"`` walk's :func:`dense_step_table` (derived when not given).
        tail_stages: software-pipelining depth of the residual walk (``None``: the compiler's
            default from ``num_stages``, but :data:`SHARED_TAIL_STAGES` for the shared walk at
            8-warp tiles; 5 compiles to double-buffered tiles but measured no faster on the H200
            with the FP8 walk).
        block_n, block_m: weight rows and tokens per program (powers of two, >= 16).
        block_m_tail: tokens of the last token tile where ``M`` leaves at most that many over a multiple of
            ``block_m`` (a power of two, >= 16, below ``block_m``; ``None``: every tile ``block_m``). At 160
            tokens on 128-token tiles the programs of the second token tile would multiply 96 padding rows;
            with ``block_m_tail=32`` they run 32-token tiles, after their weight tile's full ones (its
            weights then mostly from L2). The same result.
        block_kp: packed K bytes per step (64, 128 or 256: one, two or four split8 blocks).
        split_k: programs sharing an output tile along K (fp32 partials summed in split order
            by the last to arrive, as :func:`w4a4_gemm_triton`; the residual units are dealt
            out among them); for decode-sized M.
        num_warps, num_stages: launch options.
        pdl: programmatic dependent launch (wait for the activation kernel inside the GEMM;
            where the device supports it).
        x16: unpack the weights as ``16 * q`` (two and one instructions per four bytes instead
            of four and five; the same result, exactly). Default on: 1.03-1.11x faster dense at
            M = 2048 on the H200, no change with a residual.
        e4m3_asm: the fp8 walk converts the residual nibbles and the activation tiles to e4m3
            with inline PTX (:func:`mosaicquant.kernels._tl.to_e4m3`, about half the compiler's
            instructions) instead of Triton's element-wise casts; the same values, exactly.
        rem_split: with ``split_k == 1``, programs a tile for the tiles past the last whole wave
            (``tiles mod S``, ``S`` = :data:`~mosaicquant.kernels._tiles.SWAP_PREFILL_PROGRAMS_PER_SM` programs an
            SM; none where the tiles are fewer than ``S``): those tiles are split over K, their partials in a
            buffer of their own. A power of two up to 16; ``None``: :func:`~mosaicquant.kernels._tiles.
            swapped_rem_split`. The same result up to float summation order (as ``split_k``).
        joined_dot: each K step (and each walked unit of the "shared", "shifted" and "merged" walks) as one dot on
            the halves' joined operand instead of a dot per half (``None``: :data:`JOINED_DOT`); the same sums.
        row_order: optional ``int32 [ceil(N / block_n)]`` permutation of the weight-row tiles (after ``block_n``
            shrinks to nest in the residual's block rows): the grouped program order runs over them in this order
            (:func:`row_tile_order`: the rows that keep the most blocks first). The same result; where the last
            wave is split over K (``rem_split``), the order changes which tiles it takes (their fp32 partials summed
            as ``split_k``'s).
        out: optional preallocated contiguous ``bfloat16 [M, N]`` output.

    Returns:
        ``bfloat16 [M, N]``.

    Raises:
        UserInputError: bad operands, a split layout of another width, a residual of another
            shape or block shape the kernel cannot take, or bad tiles.
    """
    check_tensor("a_split", a_split, dtypes=(torch.int8,), dim=2)
    m = a_split.shape[0]
    check_tensor("a_split", a_split, dtypes=(torch.int8,), shape=(m, split8_width(k)))
    # the packed-operand checks, on a stand-in of the packed activations' shape
    _, n, kp = check_gemm_args(a_split[:, : (k + 1) // 2].view(torch.uint8), a_scale, qweight, w_scale, bias, k)
    check_triton_device(a_split.device)
    for name, v in (("block_n", block_n), ("block_m", block_m)):
        if v < 16 or v & (v - 1):
            raise UserInputError(f"{name}={v} must be a power of two >= 16 (tl.dot tiles)")
    if block_m_tail is not None and (not isinstance(block_m_tail, int) or block_m_tail < 16
                                     or block_m_tail & (block_m_tail - 1) or block_m_tail >= block_m):
        raise UserInputError(f"block_m_tail={block_m_tail!r} must be None or a power of two >= 16 below "
                             f"block_m={block_m}")
    if block_kp not in (64, 128, 256):
        raise UserInputError(f"block_kp={block_kp!r} must be 64, 128 or 256 (whole split8 blocks of 128 values)")
    if not isinstance(split_k, int) or not 1 <= split_k <= 64:
        raise UserInputError(f"split_k={split_k!r} must be an int in [1, 64]")
    if rem_split is not None and (isinstance(rem_split, bool) or not isinstance(rem_split, int)
                                  or rem_split not in (1, 2, 4, 8, 16)):
        raise UserInputError(f"rem_split={rem_split!r} must be None or a power of two from 1 to 16")
    if rem_split is not None and rem_split > 1 and split_k > 1:
        raise UserInputError(f"rem_split={rem_split} splits the last wave of an unsplit launch; split_k={split_k} "
                             f"splits every tile: choose one")
    if tail_stages is not None and (not isinstance(tail_stages, int) or not 1 <= tail_stages <= 8):
        raise UserInputError(f"tail_stages={tail_stages!r} must be None or an int in [1, 8]")
    if residual_walk not in RESIDUAL_WALKS:
        raise UserInputError(f"residual_walk={residual_walk!r} is not allowed: choose one of {', '.join(RESIDUAL_WALKS)}")
    if residual is not None:
        check_residual(residual, n, k, a_split.device)
        reason = swapped_residual_reason(residual.block_shape)
        if reason is not None:
            raise UserInputError(reason)
        if residual.num_blocks == 0:
            residual = None
    if residual is not None and residual_walk == "merged" and block_kp != 64:
        raise UserInputError(f"residual_walk='merged' skips single split8 blocks: block_kp must be 64, got {block_kp}")
    if residual is not None and residual_walk in ("shared", "shifted", "merged"):
        if not x16:
            raise UserInputError(f"residual_walk={residual_walk!r} needs x16=True (the residual counts in the s_w / 16 "
                                 f"units of the base unpacked as 16 q)")
        if residual_shifts is None:
            _check_not_capturing(residual_walk, "residual_shifts")
            residual_shifts = residual_shifts_of(residual, w_scale)
            if residual_shifts is None:
                raise UserInputError(
                    f"residual_walk={residual_walk!r} needs residual scales equal to the base's row scales times "
                    f"2^-j, j in 0..4 (MosaicQuant's rscale=pow2); these are not: use residual_walk='fp8' or 'int8'")
        check_tensor("residual_shifts", residual_shifts, dtypes=(torch.int8,),
                     shape=(residual.num_blocks, residual.block_shape[0]))
        check_same_device(a_split=a_split, residual_shifts=residual_shifts)
        if residual_walk in ("shifted", "merged"):
            if residual_operand is None:
                _check_not_capturing(residual_walk, "residual_operand")
                residual_operand = (shifted_residual_operand(residual, residual_shifts) if residual_walk == "shifted"
                                    else merged_residual_operand(qweight, k, residual, residual_shifts))
            check_tensor("residual_operand", residual_operand, dtypes=(torch.int8,),
                         shape=(residual.num_blocks, *residual.block_shape))
            check_same_device(a_split=a_split, residual_operand=residual_operand)
        if residual_walk == "merged":
            if dense_steps is None:
                _check_not_capturing(residual_walk, "dense_steps")
                dense_steps = dense_step_table(residual, k)
            check_tensor("dense_steps", dense_steps, dtypes=(torch.int32,),
                         shape=(-(-n // residual.block_shape[0]), -(-k // SPLIT_BLOCK) + 1))
            check_same_device(a_split=a_split, dense_steps=dense_steps)
    bn_res, bk_res = residual.block_shape if residual is not None else (block_n, SPLIT_BLOCK)
    while bn_res % block_n:
        block_n //= 2
    if row_order is not None:
        check_tensor("row_order", row_order, dtypes=(torch.int32,), shape=(triton.cdiv(n, block_n),))
        check_same_device(a_split=a_split, row_order=row_order)
        _check_row_order(row_order, block_n)
    out = output_buffer(out, (m, n), torch.bfloat16, a_split.device)
    if m == 0 or n == 0:
        return out
    n_full, tail_bm = m // block_m, 0
    if block_m_tail is not None and 0 < m - n_full * block_m <= block_m_tail:
        tail_bm = block_m_tail  # the last token tile narrower
    tiles = triton.cdiv(n, block_n) * (n_full + 1 if tail_bm else triton.cdiv(m, block_m))
    if split_k > 1 and (tiles > LOCK_SLOTS or split_k * m * n >= 2**31):
        split_k = 1  # the same result: the partial buffer and counters cover this size only unsplit
    grid = (tiles, split_k)
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=out.device) if split_k > 1 else out
    # the rule (rem_split None) is for the prefill tiles, whose programs an SM it assumes
    prefill_tiles = block_n == 128 and block_m == 128 and num_warps == 8
    rem, n_split = (1, 0) if split_k > 1 or (rem_split is None and not prefill_tiles) else _tiles.swapped_rem_plan(
        tiles, triton.cdiv(kp, block_kp), a_split.device, rem_split)
    n_direct = tiles - n_split
    pdl = use_pdl(a_split.device, pdl)
    # Triton's interpreter has no FP8 dot: there the fp8 walk runs the int8 one
    if residual is None:
        res_mode = 0
    elif residual_walk in ("shared", "shifted", "merged"):
        res_mode = {"shared": 3, "shifted": 4, "merged": 5}[residual_walk]
    else:
        res_mode = 2 if residual_walk == "fp8" and not triton_interpreting() else 1
    # the fp8 walk keeps one [BN, BM] accumulator: capped at 128 registers a thread, two programs
    # of 8 warps share an SM as in the dense kernel (uncapped it took 172 and ran one per SM)
    launch = {"maxnreg": FP8_TAIL_MAX_REGS} if res_mode == 2 else {}
    if res_mode >= 3 and num_warps == 8:  # prefill tiles
        if SHARED_TAIL_MAX_REGS is not None:
            launch = {"maxnreg": SHARED_TAIL_MAX_REGS}
        if tail_stages is None:
            tail_stages = SHARED_TAIL_STAGES
    if residual is None:
        res = (a_scale,) * 5
    else:
        res = (residual.row_ptr, residual.coords,
               residual_operand if res_mode in (4, 5) else residual.values.view(torch.int8), residual.scales,
               {3: residual_shifts, 5: dense_steps}.get(res_mode, residual.scales))

    join = bool(JOINED_DOT if joined_dot is None else joined_dot)

    def run(grid, part, rem, n_whole, launch):
        _w4a4_swapped_kernel[grid](
            a_split, a_scale, qweight.view(torch.int8), w_scale.reshape(-1), bias if bias is not None else a_scale,
            out, part, lock_buffer(out.device),
            *res, row_order if row_order is not None else a_scale,
            m, n, kp, a_split.shape[1], a_split.stride(0), qweight.stride(0), out.stride(0),
            n_full if tail_bm else 0,  # (a constant where unused: no kernel specialised per M)
            n_direct if rem > 1 else 0, n_whole,
            HAS_BIAS=bias is not None, EVEN_K=kp % block_kp == 0, RES_MODE=res_mode, TAIL_STAGES=tail_stages,
            DENSE_STAGES=MERGED_DENSE_STAGES if res_mode == 5 else num_stages,
            BN_RES=bn_res, BKP_RES=bk_res // 2, BN=block_n, BM=block_m, GROUP_N=8,
            USE_ASM=not triton_interpreting(), BKP=block_kp, SPLIT_K=split_k, PDL=gemm_pdl(a_split.device, m, pdl),
            X16=bool(x16),
            E4M3_ASM=bool(e4m3_asm), TAIL_BM=tail_bm, REM_SPLIT=rem, JOIN=join, ORDERED=row_order is not None,
            num_warps=num_warps, num_stages=num_stages, **launch, **pdl_launch(pdl),
        )

    if rem == 1:
        run(grid, part, 1, 0, launch)
        return out
    # the whole tiles in the split tiles' launch, or first in a launch of their own as the unsplit kernel
    # (TileTable.swap_rem_one_launch)
    one = table_for(a_split.device).swap_rem_one_launch
    if n_direct and not one:
        run((n_direct, 1), out, 1, 0, launch)
    if "maxnreg" not in launch and _tiles.SWAP_REM_MAXNREG:
        launch = {"maxnreg": _tiles.SWAP_REM_MAXNREG}
    run(((n_direct if one else 0) + n_split * rem, 1),
        torch.empty(n_split, rem, block_n, block_m, dtype=torch.float32, device=out.device),
        rem, n_direct if one else 0, launch)
    return out


def int_matmul(a: torch.Tensor, w: torch.Tensor, bound: int | None = None) -> torch.Tensor:
    """Exact ``a @ w.T`` of small integers in floating point (fp32 while exact, else fp64).

    ``bound``: a bound on every partial sum (default ``64 * K``, the bound of 4-bit operands);
    fp32 holds integers exactly up to ``2**24``.
    """
    if bound is None:
        bound = 64 * a.shape[-1]
    dtype = torch.float32 if bound < 2**24 else torch.float64
    return a.to(dtype) @ w.to(dtype).T


def w4a4_gemm_reference(
    a_packed: torch.Tensor,
    a_scale: torch.Tensor,
    qweight: torch.Tensor,
    w_scale: torch.Tensor,
    k: int,
    bias: torch.Tensor | None = None,
    *,
    out_fp32: bool = False,
) -> torch.Tensor:
    """PyTorch reference of :func:`w4a4_gemm_triton` (same arguments, same result up to rounding)."""
    m, n, _ = check_gemm_args(a_packed, a_scale, qweight, w_scale, bias, k)
    acc = int_matmul(unpack_int4(a_packed, k), unpack_int4(qweight, k)).to(torch.float32)
    y = acc * a_scale[:, None] * w_scale.reshape(1, -1).to(torch.float32)
    if bias is not None:
        y = y + bias
    return y if out_fp32 else y.to(torch.bfloat16)


def w4a4_gemm(
    a_packed: torch.Tensor,
    a_scale: torch.Tensor,
    qweight: torch.Tensor,
    w_scale: torch.Tensor,
    k: int,
    bias: torch.Tensor | None = None,
    *,
    kernel: str | None = None,
    config: TileConfig | None = None,
    gated: bool = False,
) -> torch.Tensor:
    """Dense W4A4 GEMM ``y = (A·Wᵀ) ⊙ s_a ⊙ s_w (+ bias)`` in BF16, on the chosen kernel.

    Args:
        a_packed, a_scale: from :func:`mosaicquant.kernels.act_quant.quantize_activations`.
        qweight, w_scale: ``PackedW4.qweight`` and its per-channel scales.
        k: the unpacked K.
        bias: optional ``float32 [N]``.
        kernel: ``"auto"`` / ``"triton"`` / ``"torch"`` / ``None``.
        config: Triton tiles override.
        gated: a stacked ``[gate | up]`` layer: return ``bf16(silu(gate)) · up`` (see :func:`w4a4_gemm_triton`).

    Returns:
        ``bfloat16 [M, N]`` (``[M, N / 2]`` gated).

    Raises:
        UserInputError: bad operands or kernel preference.
    """
    if resolve_kernel(kernel) == "triton":
        return w4a4_gemm_triton(a_packed, a_scale, qweight, w_scale, k, bias, config=config, gated=gated)
    out = w4a4_gemm_reference(a_packed, a_scale, qweight, w_scale, k, bias)
    return silu_mul_halves(out) if gated else out


def silu_mul_halves(y: torch.Tensor) -> torch.Tensor:
    """``bf16(silu(gate)) · up`` of a BF16 ``[M, 2I]`` output of stacked ``[gate | up]`` columns (PyTorch).

    Raises:
        UserInputError: an odd number of columns.
    """
    if y.shape[-1] % 2:
        raise UserInputError(f"gated=True needs stacked [gate | up] columns; N={y.shape[-1]} is odd")
    return silu_mul_reference(y)
