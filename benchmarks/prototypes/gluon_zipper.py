"""Kept: a Gluon starting point for ZipperEngine with its kept blocks staged in shared memory.

A decode ZipperEngine in Gluon whose residual blocks are copied into shared memory beside the dense stream.

The Triton kernels walk a program's kept blocks after their dense K loop: every program reaches its walk at once,
and the blocks' loads come after the dense bytes instead of beside them. Plain
Triton has no way to start a copy before the loop and wait for it after. Gluon, Triton's explicit-layout dialect,
has: this script's kernel issues ``cp.async`` copies of a program's residual blocks (and their activation tiles)
into shared memory together with the first dense stage, and multiplies them after the dense loop. The dense loop
is a hand-written ``cp.async`` ring (``STAGES`` deep) with ``mma_v2`` int8 products. The nibbles are unpacked as
``16 q`` in the operand registers, as in ``mosaicquant.kernels``.

Variants, GEMM alone at decode sizes (activations quantized outside the timing, weights and blocks rotated through
more than L2, split K with fp32 atomic adds into a zeroed output, medians of interleaved rounds; each output checked
against ``zipper_gemm_reference`` first):

- ``g_dense``: the Gluon kernel without blocks;
- ``g_early``: with a 10 % residual, the copies of a program's first ``--slots`` blocks issued right after the
  dense prologue (the rest after the loop), multiplied after the loop;
- ``g_late``: every copy issued after the dense loop (what the Triton tail walk does);
- ``g_inloop``: as ``g_early``, the early blocks multiplied inside the dense loop once their copies have landed;
- ``g_mid``: the blocks' columns and scales loaded in the loop's first step and their copies issued in its
  second (no load chain before the loop);
- ``t_dense`` / ``t_zip``: the Triton kernels ``QuantLinear`` runs (dense W4A4; ZipperEngine ``auto``), for scale.

The prototype's limits: 16-token tiles (M ≤ 16), 64 weight rows a program, 128 × 128 blocks, free residual scales,
split K by fp32 atomic adds; R_MAX (the most blocks a program walks) is a compile-time constant taken from the
layer, and every program multiplies R_MAX blocks (zeros past its row's last).

    PYTHONPATH=. python3 benchmarks/prototypes/gluon_zipper.py [--ms 5,8,16] [--slots 2] [--rounds 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path[:0] = [str(Path(__file__).resolve().parents[1] / part) for part in ("kernels", "prototypes")]

from zipper import BLOCK, ROTATE_BYTES, check, clone_residual, random_residual, time_calls  # noqa: E402

from mosaicquant.kernels.act_quant import quantize_activations_triton  # noqa: E402
from mosaicquant.kernels.w4a4_gemm import w4a4_gemm_triton  # noqa: E402
from mosaicquant.kernels.zipper import residual_block_map, zipper_gemm_reference, zipper_gemm_triton  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
BM, BN, BKP = 16, 64, 64
_LO16 = gl.constexpr("{\nshl.b32 $0, $1, 4;\nand.b32 $0, $0, 0xF0F0F0F0;\n}")
_HI16 = gl.constexpr("and.b32 $0, $1, 0xF0F0F0F0;")


@gluon.jit
def _lo16(x):
    return gl.inline_asm_elementwise(_LO16, "=r,r", [x], dtype=gl.int8, is_pure=True, pack=4)


@gluon.jit
def _hi16(x):
    return gl.inline_asm_elementwise(_HI16, "=r,r", [x], dtype=gl.int8, is_pure=True, pack=4)


@gluon.jit
def _issue_step(w_smem, a_smem, w_ptr, a_ptr, rows_w, cols_w, rows_a, cols_a, stride_wn, stride_am, M, KP, kb,
                live):
    """cp.async of one dense step's weight tile ``[BN, BKP]`` and activation tile ``[BM, BKP]`` (zeros where dead)."""
    kw = kb + cols_w
    async_copy.async_copy_global_to_shared(
        w_smem, w_ptr + rows_w[:, None] * stride_wn + kw[None, :], mask=live & (kw[None, :] < KP))
    ka = kb + cols_a
    async_copy.async_copy_global_to_shared(
        a_smem, a_ptr + rows_a[:, None] * stride_am + ka[None, :],
        mask=live & (rows_a[:, None] < M) & (ka[None, :] < KP))


@gluon.jit
def _issue_blocks(r_smem, ar_smem, a_ptr, res_val_ptr, coords_ptr, first, last, pid_k, res_row0,
                  rows_w, cols_w, rows_a, cols_a, stride_am, M, KP,
                  J0: gl.constexpr, COUNT: gl.constexpr, SPLIT_K: gl.constexpr, BN_RES: gl.constexpr,
                  BKP_RES: gl.constexpr):
    """cp.async of the program's kept blocks ``J0 .. J0 + COUNT - 1`` (its ``BN`` rows of each, ``[BN, BKP_RES]``)
    and their activation tiles into slots ``0 .. COUNT - 1`` (zeros past the row's last block)."""
    for jj in gl.static_range(COUNT):
        p = first + pid_k + (J0 + jj) * SPLIT_K
        valid = p < last
        col = gl.load(coords_ptr + 2 * p + 1, mask=valid, other=0).to(gl.int64)
        async_copy.async_copy_global_to_shared(
            r_smem.index(jj),
            res_val_ptr + p * (BN_RES * BKP_RES) + (res_row0 + rows_w)[:, None] * BKP_RES + cols_w[None, :],
            mask=valid)
        ka = col * BKP_RES + cols_a
        async_copy.async_copy_global_to_shared(
            ar_smem.index(jj), a_ptr + rows_a[:, None] * stride_am + ka[None, :],
            mask=valid & (rows_a[:, None] < M) & (ka[None, :] < KP))


@gluon.jit
def _issue_blocks_at(r_smem, ar_smem, a_ptr, res_val_ptr, cols, jv, first, last, pid_k, res_row0,
                     rows_w, cols_w, rows_a, cols_a, stride_am, M, KP,
                     COUNT: gl.constexpr, SPLIT_K: gl.constexpr, BN_RES: gl.constexpr, BKP_RES: gl.constexpr):
    """:func:`_issue_blocks` of blocks ``0 .. COUNT - 1`` whose block columns ``cols`` (``[R_P2]``) are loaded."""
    for jj in gl.static_range(COUNT):
        p = first + pid_k + jj * SPLIT_K
        valid = p < last
        col = gl.sum(gl.where(jv == jj, cols, 0), axis=0)
        async_copy.async_copy_global_to_shared(
            r_smem.index(jj),
            res_val_ptr + p * (BN_RES * BKP_RES) + (res_row0 + rows_w)[:, None] * BKP_RES + cols_w[None, :],
            mask=valid)
        ka = col * BKP_RES + cols_a
        async_copy.async_copy_global_to_shared(
            ar_smem.index(jj), a_ptr + rows_a[:, None] * stride_am + ka[None, :],
            mask=valid & (rows_a[:, None] < M) & (ka[None, :] < KP))


@gluon.jit
def _block_product(ar_slot, r_slot, s_all, jv, j, op_a: gl.constexpr, op_b: gl.constexpr, mma: gl.constexpr):
    """fp32 ``[BM, BN]``: a block's activation tile times its rows (from shared memory), scaled by row scales ``j``."""
    ar = ar_slot.load(op_a)
    r = r_slot.permute([1, 0]).load(op_b)
    racc = mma_v2(_lo16(ar), _lo16(r), gl.zeros([ar.shape[0], r.shape[1]], gl.int32, mma))
    racc = mma_v2(_hi16(ar), _hi16(r), racc)
    s_j = gl.convert_layout(gl.sum(gl.where(jv[:, None] == j, s_all, 0.0), axis=0), gl.SliceLayout(0, mma))
    return racc.to(gl.float32) * s_j[None, :]


@gluon.jit
def _gz_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, row_ptr_ptr, coords_ptr, res_val_ptr, res_scale_ptr,
               M, N, KP, stride_am, stride_wn,
               HAS_RES: gl.constexpr, EARLY: gl.constexpr, R_MAX: gl.constexpr, R_SLOTS: gl.constexpr,
               R_P2: gl.constexpr, SPLIT_K: gl.constexpr, STAGES: gl.constexpr, BN_RES: gl.constexpr,
               BKP_RES: gl.constexpr, INLOOP: gl.constexpr = False):
    # R_MAX (a multiple of R_SLOTS): the most blocks a program walks; R_SLOTS of them have shared memory at once.
    # EARLY: the first R_SLOTS blocks are copied right after the dense prologue; the rest (and with EARLY off,
    # all) R_SLOTS at a time after the dense loop. INLOOP (with EARLY): the early blocks are multiplied inside the
    # dense loop, block j at step STAGES - 2 + j (their copies have landed by then), while the loop waits on its
    # own copies; blocks the loop has no step for are multiplied after it.
    gl.static_assert(BKP_RES == 64)
    BM_: gl.constexpr = 16
    BN_: gl.constexpr = 64
    BKP_: gl.constexpr = 64
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4], instr_shape=[16, 8])
    op_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
    op_b: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=4)
    ld_w: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])  # [64, 64] bytes, 16 B a copy
    ld_a: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])   # [16, 64] bytes, 8 B a copy
    ld_s: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [1, 4], [1, 0])  # [R_P2, 64] row scales
    sh: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=4, order=[1, 0])

    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    n0 = pid_n * BN_
    rows_w = gl.arange(0, BN_, layout=gl.SliceLayout(1, ld_w))
    cols_w = gl.arange(0, BKP_, layout=gl.SliceLayout(0, ld_w))
    rows_a = gl.arange(0, BM_, layout=gl.SliceLayout(1, ld_a))
    cols_a = gl.arange(0, BKP_, layout=gl.SliceLayout(0, ld_a))
    w_rows = gl.minimum(n0 + rows_w, N - 1).to(gl.int64)

    k_steps = gl.cdiv(KP, BKP_)
    per_split = gl.cdiv(k_steps, SPLIT_K)
    s_begin = pid_k * per_split
    s_end = gl.minimum(s_begin + per_split, k_steps)
    n_steps = s_end - s_begin

    w_smem = gl.allocate_shared_memory(gl.int8, [STAGES, BN_, BKP_], sh)
    a_smem = gl.allocate_shared_memory(gl.int8, [STAGES, BM_, BKP_], sh)
    for s in gl.static_range(STAGES - 1):
        _issue_step(w_smem.index(s), a_smem.index(s), w_ptr, a_ptr, w_rows, cols_w, rows_a, cols_a, stride_wn,
                    stride_am, M, KP, (s_begin + s) * BKP_, s < n_steps)
        async_copy.commit_group()
    if HAS_RES:
        r_smem = gl.allocate_shared_memory(gl.int8, [R_SLOTS, BN_, BKP_RES], sh)
        ar_smem = gl.allocate_shared_memory(gl.int8, [R_SLOTS, BM_, BKP_RES], sh)
        block_row = n0 // BN_RES
        res_row0 = n0 - block_row * BN_RES
        first = gl.load(row_ptr_ptr + block_row).to(gl.int64)
        last = gl.load(row_ptr_ptr + block_row + 1).to(gl.int64)
        jv = gl.arange(0, R_P2, layout=gl.SliceLayout(1, ld_s))
        cs = res_row0 + gl.arange(0, BN_, layout=gl.SliceLayout(0, ld_s))
        if EARLY == 2:  # loaded in the loop's first step, their copies issued in its second
            s_all = gl.zeros([R_P2, BN_], gl.float32, ld_s)
            cols = gl.zeros([R_P2], gl.int64, gl.SliceLayout(1, ld_s))
        else:  # every walked block's row scales, before the loop
            pv = first + pid_k + jv * SPLIT_K
            s_all = gl.load(res_scale_ptr + pv[:, None] * BN_RES + cs[None, :],
                            mask=((pv < last) & (jv < R_MAX))[:, None], other=0.0).to(gl.float32)
        if EARLY == 1:
            _issue_blocks(r_smem, ar_smem, a_ptr, res_val_ptr, coords_ptr, first, last, pid_k, res_row0, rows_w,
                          cols_w, rows_a, cols_a, stride_am, M, KP, 0, R_SLOTS, SPLIT_K, BN_RES, BKP_RES)
            async_copy.commit_group()

    acc = gl.zeros([BM_, BN_], gl.int32, mma)
    y_res = gl.zeros([BM_, BN_], gl.float32, mma)
    for i in range(n_steps):
        async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()
        slot = i % STAGES
        a = a_smem.index(slot).load(op_a)
        w = w_smem.index(slot).permute([1, 0]).load(op_b)
        acc = mma_v2(_lo16(a), _lo16(w), acc)
        acc = mma_v2(_hi16(a), _hi16(w), acc)
        if HAS_RES and EARLY == 1 and INLOOP:
            jj = i - (STAGES - 2)
            if (jj >= 0) & (jj < R_SLOTS):
                y_res += _block_product(ar_smem.index(jj), r_smem.index(jj), s_all, jv, jj, op_a, op_b, mma)
        if HAS_RES and EARLY == 2:
            if i == 0:  # the blocks' scales and columns: in flight while the loop runs
                pv = first + pid_k + jv * SPLIT_K
                live = (pv < last) & (jv < R_MAX)
                s_all = gl.load(res_scale_ptr + pv[:, None] * BN_RES + cs[None, :], mask=live[:, None],
                                other=0.0).to(gl.float32)
                cols = gl.load(coords_ptr + 2 * pv + 1, mask=live, other=0).to(gl.int64)
            if i == 1:  # their copies join this step's group
                _issue_blocks_at(r_smem, ar_smem, a_ptr, res_val_ptr, cols, jv, first, last, pid_k, res_row0,
                                 rows_w, cols_w, rows_a, cols_a, stride_am, M, KP, R_SLOTS, SPLIT_K, BN_RES, BKP_RES)
        nxt = i + STAGES - 1
        _issue_step(w_smem.index(nxt % STAGES), a_smem.index(nxt % STAGES), w_ptr, a_ptr, w_rows, cols_w, rows_a,
                    cols_a, stride_wn, stride_am, M, KP, (s_begin + nxt) * BKP_, nxt < n_steps)
        async_copy.commit_group()

    offs_n = n0 + gl.arange(0, BN_, layout=gl.SliceLayout(0, mma))
    offs_m = gl.arange(0, BM_, layout=gl.SliceLayout(1, mma))
    w_scale = gl.load(w_scale_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32)
    y = acc.to(gl.float32) * w_scale[None, :]
    async_copy.wait_group(0)
    if HAS_RES:
        if EARLY == 2:
            if n_steps < 2:  # the loop never got to them
                pv = first + pid_k + jv * SPLIT_K
                live = (pv < last) & (jv < R_MAX)
                s_all = gl.load(res_scale_ptr + pv[:, None] * BN_RES + cs[None, :], mask=live[:, None],
                                other=0.0).to(gl.float32)
                cols = gl.load(coords_ptr + 2 * pv + 1, mask=live, other=0).to(gl.int64)
                gl.thread_barrier()
                _issue_blocks_at(r_smem, ar_smem, a_ptr, res_val_ptr, cols, jv, first, last, pid_k, res_row0,
                                 rows_w, cols_w, rows_a, cols_a, stride_am, M, KP, R_SLOTS, SPLIT_K, BN_RES, BKP_RES)
                async_copy.commit_group()
                async_copy.wait_group(0)
        for c in gl.static_range(0, R_MAX, R_SLOTS):
            if c > 0 or EARLY == 0:
                gl.thread_barrier()  # the slots' previous blocks are consumed
                _issue_blocks(r_smem, ar_smem, a_ptr, res_val_ptr, coords_ptr, first, last, pid_k, res_row0,
                              rows_w, cols_w, rows_a, cols_a, stride_am, M, KP, c, R_SLOTS, SPLIT_K, BN_RES, BKP_RES)
                async_copy.commit_group()
                async_copy.wait_group(0)
            gl.thread_barrier()
            for jj in gl.static_range(R_SLOTS):
                if c > 0 or not (EARLY == 1 and INLOOP):
                    y += _block_product(ar_smem.index(jj), r_smem.index(jj), s_all, jv, c + jj, op_a, op_b, mma)
                elif STAGES - 2 + jj >= n_steps:  # the loop had no step for this early block
                    y += _block_product(ar_smem.index(jj), r_smem.index(jj), s_all, jv, jj, op_a, op_b, mma)
        y += y_res
    a_scale = gl.load(a_scale_ptr + offs_m, mask=offs_m < M, other=0.0)
    y = y * a_scale[:, None] * 0.00390625  # both operands were 16x
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    gl.atomic_add(out_ptr + offs_m[:, None] * N + offs_n[None, :], y, mask=mask)


def max_blocks_per_program(residual, split: int) -> int:
    counts = torch.diff(residual.row_ptr.long().cpu())
    return max(1, int(((counts + split - 1) // split).max()))


def gluon_zipper(a_packed, a_scale, qweight, w_scale, k, residual, split, r_max, early, stages=4, out=None,
                 zero=True, r_slots=2, inloop=False):
    """fp32 ``[M, N]``: the Gluon kernel (``residual=None``: dense), adding into ``out`` (zeroed first if ``zero``;
    the timed calls skip that, so no memset is timed and their values are not checked)."""
    m, kp = a_packed.shape
    n = qweight.shape[0]
    if m > BM or n % BN or (residual is not None and tuple(residual.block_shape) != (128, 128)):
        raise ValueError(f"the prototype takes M <= {BM}, N a multiple of {BN} and 128 x 128 blocks")
    if out is None:
        out = torch.zeros(m, n, dtype=torch.float32, device=a_packed.device)
    elif zero:
        out.zero_()
    has = residual is not None
    r = residual
    slots = min(r_max, r_slots)
    r_max = -(-r_max // slots) * slots
    _gz_kernel[(n // BN, split)](
        a_packed.view(torch.int8), a_scale, qweight.view(torch.int8), w_scale, out,
        r.row_ptr if has else a_scale, r.coords if has else a_scale, r.values.view(torch.int8) if has else a_scale,
        r.scales if has else a_scale, m, n, kp, a_packed.stride(0), qweight.stride(0),
        HAS_RES=has, EARLY=int(early), R_MAX=r_max if has else 1, R_SLOTS=slots if has else 1,
        R_P2=triton.next_power_of_2(max(2, r_max)), SPLIT_K=split, STAGES=stages, BN_RES=128, BKP_RES=64,
        INLOOP=bool(inloop), num_warps=4)
    return out


def split_for(n: int, kp: int) -> int:
    """Split K while the grid, doubled, holds at most ~4 programs an SM (132 SMs), each keeping at least 4 steps."""
    tiles, steps, split = n // BN, -(-kp // BKP), 1
    while tiles * split * 2 <= 4 * 132 and steps // (2 * split) >= 4:
        split *= 2
    return split


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", default="4,8,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--slots", type=int, default=2, help="blocks a program holds in shared memory at once")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gluon_zipper.py runs Gluon kernels: it needs a CUDA GPU (none found)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    rows, table = [], []
    names = ("g_dense", "g_early", "g_late", "g_inloop", "g_mid", "t_dense", "t_zip")
    for name, (n, k) in SHAPES.items():
        copies = max(2, math.ceil(ROTATE_BYTES / (n * k // 2 * 1.15)))
        qws = [torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device) for _ in range(copies)]
        wss = [(torch.rand(n, device=device) * 0.01 + 0.001).to(torch.float16) for _ in range(copies)]
        r0 = random_residual(n, k, 0.10, device, gen)
        rs = [r0] + [clone_residual(r0) for _ in range(copies - 1)]
        maps = [residual_block_map(r) for r in rs]
        split = split_for(n, k // 2)
        r_max = max_blocks_per_program(r0, split)
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            ap, a_s = quantize_activations_triton(x)
            ref = zipper_gemm_reference(ap, a_s, qws[0], wss[0], k, rs[0], out_fp32=True)
            ref_dense = zipper_gemm_reference(ap, a_s, qws[0], wss[0], k, rs[0].__class__.empty(
                (n, k), BLOCK, device=device), out_fp32=True)
            outs = [torch.zeros(m, n, dtype=torch.float32, device=device) for _ in range(copies)]
            def g(res, early, z, inloop=False):
                return [lambda i=i: gluon_zipper(ap, a_s, qws[i], wss[i], k, rs[i] if res else None, split,
                                                 r_max if res else 1, early, args.stages, outs[i], zero=z,
                                                 r_slots=args.slots, inloop=inloop)
                        for i in range(copies)]

            calls = {
                "g_dense": (g(False, False, False), ref_dense, g(False, False, True)[0]),
                "g_early": (g(True, True, False), ref, g(True, True, True)[0]),
                "g_late": (g(True, False, False), ref, g(True, False, True)[0]),
                "g_inloop": (g(True, True, False, True), ref, g(True, True, True, True)[0]),
                "g_mid": (g(True, 2, False), ref, g(True, 2, True)[0]),
                "t_dense": ([lambda i=i: w4a4_gemm_triton(ap, a_s, qws[i], wss[i], k) for i in range(copies)],
                            ref_dense, None),
                "t_zip": ([lambda i=i: zipper_gemm_triton(ap, a_s, qws[i], wss[i], k, rs[i], block_map=maps[i])
                           for i in range(copies)], ref, None),
            }
            times = {v: [] for v in names}
            for rnd in range(args.rounds):
                for v in names:
                    fns, want, checked = calls[v]
                    ok, rel = check((checked or fns[0])(), want)
                    us = time_calls(fns)[0]
                    times[v].append(us)
                    rows.append(dict(layer=name, n=n, k=k, m=m, split=split, r_max=r_max, variant=v, round=rnd,
                                     us=us, ok=ok, max_rel_err=rel))
            med = {v: sorted(t)[len(t) // 2] for v, t in times.items()}
            table.append((name, m, split, r_max, med))
            print(f"{name:8s} M={m:3d} split {split} r_max {r_max}: "
                  + "  ".join(f"{v} {u:.2f}" for v, u in med.items()), flush=True)
            if args.out is not None:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    failed = [r for r in rows if not r["ok"]]
    print(f"checks: {len(rows) - len(failed)} ok, {len(failed)} FAILED")
    print("| layer | M | split | R_MAX | " + " | ".join(names) + " | g_early - g_dense | g_late - g_dense | "
          "g_inloop - g_dense | g_mid - g_dense | t_zip - t_dense |")
    for name, m, split, r_max, d in table:
        print(f"| {name} | {m} | {split} | {r_max} | " + " | ".join(f"{d[v]:.2f}" for v in names)
              + f" | {d['g_early'] - d['g_dense']:+.2f} | {d['g_late'] - d['g_dense']:+.2f} | "
              f"{d['g_inloop'] - d['g_dense']:+.2f} | {d['g_mid'] - d['g_dense']:+.2f} | "
              f"{d['t_zip'] - d['t_dense']:+.2f} |")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
