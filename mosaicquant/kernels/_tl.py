"""Triton device functions the 4-bit GEMM kernels share (unpacking, rounding, split-K fix-up).

Unpacking: a packed byte holds element ``2j`` in its low nibble and ``2j + 1`` in its high
nibble (signed two's complement, :mod:`mosaicquant.methods.format`). Loaded as ``int8``,
``(b << 4) >> 4`` sign-extends the low nibble and ``b >> 4`` (arithmetic shift) the high one.
The GEMMs never interleave the two halves back: with activations packed the same way,

    Σ_k a[k] w[k] = Σ_j a_lo[j] w_lo[j] + Σ_j a_hi[j] w_hi[j],

so each packed K tile feeds two int8 dots (even and odd K), with no join/permute. On the GPU
the unpacking runs as inline PTX on four bytes per 32-bit register (Triton's int8 shifts
work one element per register; measured ALU-bound, see ``benchmarks/NOTES.md``); the
interpreter runs the plain shifts, the GPU benchmark checks the PTX path against the
reference.

Programmatic dependent launch (Hopper and later, ``PDL``): the activation kernels call
:func:`release_dependents` as they start, and a GEMM launched with ``launch_pdl=True`` may
then start while they still run. The GEMM first asks L2 to prefetch its own slice of the
weights (:func:`prefetch_rows_l2`; weights do not depend on the earlier kernel), then waits
(:func:`wait_for_inputs`) before it reads anything the earlier kernel writes or writes
anything itself. The weight stream thus overlaps the activation kernel and the launch gap.
"""

from __future__ import annotations

import triton
import triton.language as tl

# 1.5 * 2**23: adding and subtracting it rounds an fp32 |v| < 2**22 to the nearest integer,
# ties to even (IEEE round-to-nearest-even), the rounding torch.round uses.
ROUND_MAGIC = 12582912.0


# Byte-parallel (SIMD within a 32-bit register) sign extension of one nibble per byte, for
# 4 bytes at once: with n the nibble, t = n ^ 8 = q + 8 in [0, 15] and, per byte,
# ((n ^ 0x88) - 0x08) ^ 0x80 = (t + 0x78) ^ 0x80 = q mod 256; the subtraction never borrows
# across bytes because every byte of (n ^ 0x88) is >= 0x80.
_ASM_LO = tl.constexpr("""{
and.b32 $0, $1, 0x0F0F0F0F;
xor.b32 $0, $0, 0x88888888;
sub.u32 $0, $0, 0x08080808;
xor.b32 $0, $0, 0x80808080;
}""")
_ASM_HI = tl.constexpr("""{
shr.u32 $0, $1, 4;
and.b32 $0, $0, 0x0F0F0F0F;
xor.b32 $0, $0, 0x88888888;
sub.u32 $0, $0, 0x08080808;
xor.b32 $0, $0, 0x80808080;
}""")


@triton.jit
def unpack_lo(packed, USE_ASM: tl.constexpr = False):
    """Low nibbles of an ``int8`` tensor as signed 4-bit values (``int8``).

    ``USE_ASM`` (GPU only): four bytes per 32-bit register operation instead of one.
    """
    if USE_ASM:
        return tl.inline_asm_elementwise(_ASM_LO, "=r,r", [packed], dtype=tl.int8, is_pure=True, pack=4)
    else:
        return (packed << 4) >> 4


@triton.jit
def unpack_hi(packed, USE_ASM: tl.constexpr = False):
    """High nibbles of an ``int8`` tensor as signed 4-bit values (``int8``); see :func:`unpack_lo`."""
    if USE_ASM:
        return tl.inline_asm_elementwise(_ASM_HI, "=r,r", [packed], dtype=tl.int8, is_pure=True, pack=4)
    else:
        return packed >> 4


@triton.jit
def mac_int4(acc, a, w, USE_DOT: tl.constexpr, USE_ASM: tl.constexpr):
    """``acc += A·W`` for packed int8 tiles ``a [BM, BKP]`` and ``w [BKP, BN]`` (int32 ``acc``).

    ``USE_DOT``: two int8 tensor-core dots (even K, odd K). Otherwise CUDA-core multiply-adds
    over a ``[BM, BKP, BN]`` broadcast (for a handful of rows, where tensor-core tiles would be
    mostly padding and the operand layout conversions dominate).
    """
    a_lo = unpack_lo(a, USE_ASM)
    a_hi = unpack_hi(a, USE_ASM)
    w_lo = unpack_lo(w, USE_ASM)
    w_hi = unpack_hi(w, USE_ASM)
    if USE_DOT:
        acc = tl.dot(a_lo, w_lo, acc, out_dtype=tl.int32)
        acc = tl.dot(a_hi, w_hi, acc, out_dtype=tl.int32)
    else:
        prod = (a_lo.to(tl.int32)[:, :, None] * w_lo.to(tl.int32)[None, :, :]
                + a_hi.to(tl.int32)[:, :, None] * w_hi.to(tl.int32)[None, :, :])
        acc += tl.sum(prod, axis=1)
    return acc


_PREFETCH_L2 = tl.constexpr("prefetch.global.L2 [$1];\nmov.u32 $0, 0;")


@triton.jit
def release_dependents(PDL: tl.constexpr):
    """Let a kernel launched after this one with ``launch_pdl=True`` start now (no-op without ``PDL``)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Block until the kernel before this one has finished and its writes are visible (no-op without ``PDL``)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def prefetch_rows_l2(base_ptr, rows, stride, byte_begin, byte_end, LINES: tl.constexpr):
    """Ask L2 to fetch bytes ``[byte_begin, byte_end)`` of each of ``rows`` (int64) of a row-major byte array.

    One ``prefetch.global.L2`` per 128-byte line, ``LINES`` lines of every row per loop step;
    fire-and-forget (no registers wait on it). GPU only (inline PTX).
    """
    lines = tl.arange(0, LINES) * 128
    row_ptr = base_ptr + rows[:, None] * stride
    for off in range(byte_begin, byte_end, LINES * 128):
        at = off + lines[None, :]
        ptrs = row_ptr + tl.where(at < byte_end, at, byte_begin)
        tl.inline_asm_elementwise(_PREFETCH_L2, "=r,l", [ptrs.to(tl.int64, bitcast=False)], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def round_half_even(v):
    """Round fp32 values with ``|v| <= 2**22`` to integers, ties to even (like ``torch.round``)."""
    return (v + 12582912.0) - 12582912.0


@triton.jit
def store_output(
    out_ptr, part_ptr, lock_ptr, tile_id, pid_k, acc, bias_ptr,
    offs_m, offs_n, M, N, stride_om,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, OUT_FP32: tl.constexpr,
):
    """Write an fp32 ``[BM, BN]`` result tile (plus bias) as BF16, or fp32 when ``OUT_FP32``.

    With ``SPLIT_K > 1`` every split writes its fp32 partial to ``part[pid_k]`` and bumps the
    tile's counter; the split that arrives last adds the partials in split order (so the result
    does not depend on arrival order), adds the bias, writes the output and resets the counter
    to zero for the next launch.
    """
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    out_offs = offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
            acc = acc + bias[None, :]
        if OUT_FP32:
            tl.store(out_ptr + out_offs, acc, mask=mask)
        else:
            tl.store(out_ptr + out_offs, acc.to(tl.bfloat16), mask=mask)
    else:
        # Launchers split K only when SPLIT_K * M * N < 2**31, so int32 offsets suffice here.
        part_offs = offs_m[:, None] * N + offs_n[None, :]
        plane = M * N
        tl.store(part_ptr + pid_k * plane + part_offs, acc, mask=mask, cache_modifier=".cg")
        arrived = tl.atomic_add(lock_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.load(part_ptr + part_offs, mask=mask, other=0.0, cache_modifier=".cg")
            for s in range(1, SPLIT_K):
                total += tl.load(part_ptr + s * plane + part_offs, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
                total = total + bias[None, :]
            if OUT_FP32:
                tl.store(out_ptr + out_offs, total, mask=mask)
            else:
                tl.store(out_ptr + out_offs, total.to(tl.bfloat16), mask=mask)
            tl.atomic_xchg(lock_ptr + tile_id, 0, sem="relaxed", scope="gpu")


@triton.jit
def tile_indices(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Program ``pid``'s tile: ``(pid_m, pid_n, offs_m, offs_n, safe_m, safe_n)``.

    ``offs_*`` are the tile's row and column indices; ``safe_*`` the same as int64 with
    out-of-range ones pointed at index 0, for loads whose results are never stored.
    """
    pid_m, pid_n = tile_coords(pid, M, N, BM, BN, GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    safe_m = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    safe_n = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    return pid_m, pid_n, offs_m, offs_n, safe_m, safe_n


@triton.jit
def tile_coords(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """``(pid_m, pid_n)`` of program ``pid`` in grouped order (``GROUP_M`` row tiles share column tiles, for L2 reuse)."""
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % group) % rows_in_group, (pid % group) // rows_in_group
