"""Triton device functions the 4-bit GEMM kernels share (unpacking, rounding, split-K fix-up).

Unpacking: a packed byte holds element ``2j`` in its low nibble and ``2j + 1`` in its high
nibble (signed two's complement, :mod:`mosaicquant.methods.format`). Loaded as ``int8``,
``(b << 4) >> 4`` sign-extends the low nibble and ``b >> 4`` (arithmetic shift) the high one.
The GEMMs never interleave the two halves back: with activations packed the same way,

    Σ_k a[k] w[k] = Σ_j a_lo[j] w_lo[j] + Σ_j a_hi[j] w_hi[j],

so each packed K tile feeds two int8 dots (even and odd K), with no join/permute. On the GPU
the unpacking runs as inline PTX on four bytes per 32-bit register (Triton's int8 shifts
work one element per register; measured ALU-bound); the
interpreter runs the plain shifts, the GPU benchmark checks the PTX path against the
reference.

Programmatic dependent launch (Hopper and later, ``PDL``): the activation kernels signal
(:func:`chain_start`) as they start, and a GEMM launched with ``launch_pdl=True`` may
then start while they still run. The GEMM first asks L2 to prefetch its own slice of the
weights (:func:`prefetch_rows_l2`; weights do not depend on the earlier kernel), then waits
(:func:`wait_for_inputs`) before it reads anything the earlier kernel writes or writes
anything itself. The weight stream thus overlaps the activation kernel and the launch gap.
With ``_common.chain_mode`` ``"on"`` (the default) the decode step's other kernels (norms,
RoPE, attention, SiLU·mul, the quantizers) are launched with PDL as well and wait first, and
a GEMM signals once it has waited, so every launch gap of the step overlaps the kernel before.
"""

from __future__ import annotations

import os

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


# The same nibbles scaled by 16 (the nibble moved to the byte's high half, low half zero): a
# signed byte holding 16 q is exactly 16 q, so a dot of such bytes is 16x (or 256x, both operands)
# the 4-bit dot and the scaling folds away exactly (a power of two). Two and one instructions per
# four bytes instead of four and five: the high nibble is already in place (mask), the low one is
# shifted there (the bits shifted in from the byte below are masked off).
_ASM_LO16 = tl.constexpr("""{
shl.b32 $0, $1, 4;
and.b32 $0, $0, 0xF0F0F0F0;
}""")
_ASM_HI16 = tl.constexpr("and.b32 $0, $1, 0xF0F0F0F0;")


@triton.jit
def unpack_lo16(packed, USE_ASM: tl.constexpr = False):
    """Low nibbles of an ``int8`` tensor as ``16 * q`` (``int8``, exact: -128 … 112)."""
    if USE_ASM:
        return tl.inline_asm_elementwise(_ASM_LO16, "=r,r", [packed], dtype=tl.int8, is_pure=True, pack=4)
    else:
        return (packed << 4).to(tl.int8)


@triton.jit
def unpack_hi16(packed, USE_ASM: tl.constexpr = False):
    """High nibbles of an ``int8`` tensor as ``16 * q`` (``int8``); see :func:`unpack_lo16`."""
    if USE_ASM:
        return tl.inline_asm_elementwise(_ASM_HI16, "=r,r", [packed], dtype=tl.int8, is_pure=True, pack=4)
    else:
        return (packed & -16).to(tl.int8)


# Nibbles as q * 2^(4 - j) (int8), j in 0..4 the same for the four bytes of a register (one row's K run):
# t holds 16 q a byte (the x16 unpacking); a right shift of the word by j keeps each byte's bits in the
# byte (they sit at bits 4-7); the sign is filled in as (sign bits >> j) * (2^(j+1) - 2), bits 8-j .. 7 of
# each negative byte (the top byte's carry falls off the word). $2's low byte holds j.
_SHIFT16_TAIL = """and.b32 j, $2, 0xFF;
and.b32 s, t, 0x80808080;
shr.u32 s, s, j;
shl.b32 f, 2, j;
sub.u32 f, f, 2;
mul.lo.u32 f, s, f;
shr.u32 t, t, j;
or.b32 $0, t, f;
}"""
_ASM_LO_SHIFT16 = tl.constexpr("""{
.reg .b32 t, s, j, f;
shl.b32 t, $1, 4;
and.b32 t, t, 0xF0F0F0F0;
""" + _SHIFT16_TAIL)
_ASM_HI_SHIFT16 = tl.constexpr("""{
.reg .b32 t, s, j, f;
and.b32 t, $1, 0xF0F0F0F0;
""" + _SHIFT16_TAIL)


@triton.jit
def unpack_shift16(packed, shift, HI: tl.constexpr, USE_ASM: tl.constexpr = False):
    """The low (or, with ``HI``, high) nibbles of an ``int8 [R, C]`` tensor as ``q * 2^(4 - j)`` (``int8``, exact).

    ``shift``: ``int8 [R]``, ``j`` in 0..4 a row (a residual block row's scale ``s_w · 2^-j``: these
    integers then count in the ``s_w / 16`` units of the base unpacked as ``16 q``).
    """
    if USE_ASM:
        sh = tl.broadcast_to(shift[:, None], packed.shape)
        if HI:
            return tl.inline_asm_elementwise(_ASM_HI_SHIFT16, "=r,r,r", [packed, sh], dtype=tl.int8, is_pure=True,
                                             pack=4)
        return tl.inline_asm_elementwise(_ASM_LO_SHIFT16, "=r,r,r", [packed, sh], dtype=tl.int8, is_pure=True, pack=4)
    if HI:
        return unpack_hi16(packed) >> shift[:, None]
    return unpack_lo16(packed) >> shift[:, None]


# Small integers to FP8 e4m3 (exact for |q| <= 16), four bytes a register: each byte is biased to
# an unsigned b (q + 8 for a nibble, q + 128 for an int8), placed under 0x64 to form the fp16
# 1024 + b (two a register, prmt), the bias subtracted in fp16x2, and each pair converted to e4m3
# by the hardware. 10-12 instructions per four values, about half of the compiler's element-wise
# int8 -> fp16 -> e4m3 chain.
_E4M3_TAIL = """
mov.b32 k, 0x64646464;
prmt.b32 lo, t, k, 0x4140;
prmt.b32 hi, t, k, 0x4342;
sub.f16x2 lo, lo, m;
sub.f16x2 hi, hi, m;
cvt.rn.satfinite.e4m3x2.f16x2 l8, lo;
cvt.rn.satfinite.e4m3x2.f16x2 h8, hi;
mov.b32 $0, {l8, h8};
}"""
_E4M3_REGS = """{
.reg .b32 t, k, m, lo, hi;
.reg .b16 l8, h8;
"""
_ASM_NIB_LO_E4M3 = tl.constexpr(_E4M3_REGS + """and.b32 t, $1, 0x0F0F0F0F;
xor.b32 t, t, 0x08080808;
mov.b32 m, 0x64086408;""" + _E4M3_TAIL)
_ASM_NIB_HI_E4M3 = tl.constexpr(_E4M3_REGS + """shr.u32 t, $1, 4;
and.b32 t, t, 0x0F0F0F0F;
xor.b32 t, t, 0x08080808;
mov.b32 m, 0x64086408;""" + _E4M3_TAIL)
_ASM_I8_E4M3 = tl.constexpr(_E4M3_REGS + """xor.b32 t, $1, 0x80808080;
mov.b32 m, 0x64806480;""" + _E4M3_TAIL)


@triton.jit
def to_e4m3(q, USE_ASM: tl.constexpr = False):
    """``int8`` integers with ``|q| <= 16`` as exact FP8 e4m3 values."""
    if USE_ASM:
        return tl.inline_asm_elementwise(_ASM_I8_E4M3, "=r,r", [q], dtype=tl.float8e4nv, is_pure=True, pack=4)
    else:
        return q.to(tl.float16).to(tl.float8e4nv)


@triton.jit
def unpack_e4m3(packed, HI: tl.constexpr, USE_ASM: tl.constexpr = False):
    """The low (or, with ``HI``, high) nibbles of an ``int8`` tensor as exact FP8 e4m3 values.

    Unpacked and converted in one pass (:func:`to_e4m3`'s method).
    """
    if not USE_ASM:
        if HI:
            return unpack_hi(packed).to(tl.float16).to(tl.float8e4nv)
        return unpack_lo(packed).to(tl.float16).to(tl.float8e4nv)
    if HI:
        return tl.inline_asm_elementwise(_ASM_NIB_HI_E4M3, "=r,r", [packed], dtype=tl.float8e4nv, is_pure=True, pack=4)
    return tl.inline_asm_elementwise(_ASM_NIB_LO_E4M3, "=r,r", [packed], dtype=tl.float8e4nv, is_pure=True, pack=4)


@triton.jit
def mac_int4(acc, a, w, USE_DOT: tl.constexpr, USE_ASM: tl.constexpr, X16: tl.constexpr = False):
    """``acc += A·W`` for packed int8 tiles ``a [BM, BKP]`` and ``w [BKP, BN]`` (int32 ``acc``).

    ``USE_DOT``: two int8 tensor-core dots (even K, odd K). Otherwise CUDA-core multiply-adds
    over a ``[BM, BKP, BN]`` broadcast (for a handful of rows, where tensor-core tiles would be
    mostly padding and the operand layout conversions dominate).

    ``X16`` (tensor-core dots only): both operands unpacked as ``16 * q`` (:func:`unpack_lo16`),
    three instructions per eight bytes instead of nine; ``acc`` then holds ``256 *`` the
    product (callers fold ``1 / 256`` into their scaling; exact while ``64 * 256 * K < 2**31``).
    """
    if X16:
        a_lo = unpack_lo16(a, USE_ASM)
        a_hi = unpack_hi16(a, USE_ASM)
        w_lo = unpack_lo16(w, USE_ASM)
        w_hi = unpack_hi16(w, USE_ASM)
    else:
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
def wait_for_inputs(PDL: tl.constexpr):
    """Block until the kernel before this one has finished and its writes are visible (``PDL``
    true: the GEMM was launched with PDL); with ``PDL == 2`` (``_common.gemm_pdl``: the step's
    chain is on) then let the kernel after this one launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def chain_start(CHAIN: tl.constexpr):
    """The start of a non-GEMM kernel of the decode step (``CHAIN`` from ``_common.chain_mode``).

    ``0``: nothing. ``1``: signal the kernel after (a GEMM launched with PDL) as we start.
    ``2``: wait for the kernel before (we were launched with PDL), then signal. Called first,
    before any load or store of data another kernel touches.
    """
    if CHAIN == 1:
        tl.extra.cuda.gdc_launch_dependents()
    if CHAIN == 2:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


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


# How the quantizers divide by a row's scale (:func:`quant_div`): compiled, a reciprocal per row and a two-FMA
# correction per value ("fma"); Triton's interpreter evaluates fma as a product and a sum, each rounded, so there a
# float64 product per value ("fp64"). Either gives the IEEE quotient, so the same integers.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_QDIV_FP64 = tl.constexpr(_INTERPRETING)
# The "fma" mode's range guard: scales outside [2**-60, 2**60] are multiplied (with x) by 2**64 or 2**-64.
_GUARD_LO = tl.constexpr(2.0**-60)
_GUARD_HI = tl.constexpr(2.0**60)
_GUARD_UP = tl.constexpr(2.0**64)
_GUARD_DOWN = tl.constexpr(2.0**-64)


@triton.jit
def quant_div(x, scale):
    """``x / scale`` (fp32) rounded as the IEEE division ``div_rn`` rounds it, for the quantizers.

    ``scale`` (positive, finite) is one value per row, shaped to broadcast against ``x``; its reciprocal is
    taken once. The IEEE division per value (``div_rn``: a reciprocal, a correction, a range check) cost the
    quantizers ~1.2 µs a 4096-wide row on 4 warps; neither form here pays it (the
    per-value ``div_rn`` and the float64 product on the GPU measured no faster):

    - "fma" (GPU): ``r = div_rn(1, s)``, ``q0 = x·r``, ``e = fma(q0, -s, x)``, ``q = fma(e, r, q0)``. With ``r``
      the correctly rounded reciprocal and ``q0`` within an ulp of ``x / s``, ``e`` is exact and ``q`` is the
      correctly rounded quotient (Markstein's theorem), provided ``x``, ``s`` and ``e`` stay in fp32's normal
      range: scales below ``2**-60`` or above ``2**60`` are first multiplied, with ``x``, by ``2**64`` or
      ``2**-64`` (exact), which holds it for every quotient of ``1/4`` or more. Smaller quotients may differ in
      their last bits, and stay below ``1/2``: the integer 0 either way.
    - "fp64" (the interpreter, whose fma is not fused): ``fp32(fp64(x) · fp64(1 / s))``. The product is
      within ``2**-52`` relative of ``x / s``, and a quotient of two fp32 values is never an fp32 rounding
      midpoint and lies at least ``2**-49`` relative from every one, so rounding to fp32 gives ``div_rn``'s
      value wherever it is normal.

    ``tests/kernels/test_quant_div.py`` checks the form that runs against torch's division at quotients within a
    few ulps of every half-integer, and the "fma" sequence in exact rational arithmetic.
    """
    if _QDIV_FP64:
        return (x.to(tl.float64) * (1.0 / scale.to(tl.float64))).to(tl.float32)
    else:
        f = tl.where(scale < _GUARD_LO, _GUARD_UP, tl.where(scale > _GUARD_HI, _GUARD_DOWN, 1.0))
        s = scale * f
        xs = x * f
        r = tl.math.div_rn(1.0, s)
        q0 = xs * r
        # fma(q0, -s, x), not fma(-q0, s, x): the compiler turned -q0 into a second product per value, x · -r
        e = tl.math.fma(q0, -s, xs)
        return tl.math.fma(e, r, q0)


@triton.jit
def round_half_even(v):
    """Round fp32 values with ``|v| <= 2**22`` to integers, ties to even (like ``torch.round``)."""
    return (v + 12582912.0) - 12582912.0


@triton.jit
def quantize_int4(v):
    """``clamp(round_half_even(v), -8, 7)`` of fp32 ``v`` as ``int32`` values whose low byte is the integer's
    two's complement (truncate to ``int8`` for the byte, or mask the nibble).

    Clamped first (rounding commutes with clamping to integers), ``v + 1.5 · 2**23`` rounds to the nearest
    integer ``q``, ties to even, and holds it in the low bits of its fp32 encoding (``0x4B400000 + q``): no
    rounding subtraction, no float-to-integer conversion (``F2I``, which runs on the SM's conversion units at a
    fraction of the FP32 rate). On the H200 the plain quantizer took 0.80–0.94× its time with it, the Hadamard
    one 0.94–0.99×.
    """
    return (tl.minimum(tl.maximum(v, -8.0), 7.0) + 12582912.0).to(tl.int32, bitcast=True)


# Non-finite inputs: a group (a token's row, a channel group) holding NaN or Inf gets the scale NaN, so
# everything computed from it (its dequantized values, its GEMM output row) is NaN; its integers are
# unspecified. Triton's tl.max / tl.maximum drop NaN (the GPU's max.f32 and the interpreter alike), so
# the ranges are taken with NaN-propagating reductions: on the GPU a reduction whose combine is
# max.NaN.f32 (one instruction, as max.f32); on the interpreter, which runs a combine function of its
# own element by element in Python, numpy's max plus the sum of ``x · 0`` (NaN where any value is NaN
# or ±Inf, 0 elsewhere), both numpy reductions.
_NAN_BY_SUM = tl.constexpr(_INTERPRETING)
@triton.jit
def _maximum_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _minimum_nan(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def max_nan(x, axis: tl.constexpr):
    """``tl.max(x, axis)`` where the reduced values are finite; never finite where they hold NaN or ±Inf
    (NaN where they hold a NaN)."""
    if _NAN_BY_SUM:
        return tl.max(x, axis) + tl.sum(x * 0.0, axis)
    else:
        return tl.reduce(x, axis, _maximum_nan)


@triton.jit
def min_nan(x, axis: tl.constexpr):
    """``tl.min(x, axis)`` where the reduced values are finite; never finite where they hold NaN or ±Inf
    (NaN where they hold a NaN)."""
    if _NAN_BY_SUM:
        return tl.min(x, axis) + tl.sum(x * 0.0, axis)
    else:
        return tl.reduce(x, axis, _minimum_nan)


@triton.jit
def maximum_nan(a, b):
    """Element-wise ``tl.maximum``, NaN where either is NaN."""
    return _maximum_nan(a, b)


@triton.jit
def minimum_nan(a, b):
    """Element-wise ``tl.minimum``, NaN where either is NaN."""
    return _minimum_nan(a, b)


@triton.jit
def sym_scale(absmax, clip, DIV: tl.constexpr):
    """Scale of a symmetric grid, ``absmax · clip / DIV`` (IEEE division), as
    :func:`mosaicquant.methods.quant.quantize` takes it: 1 for an all-zero group, NaN where ``absmax`` is NaN or Inf (a non-finite input).
    """
    scale = tl.math.div_rn(absmax * clip, DIV)
    return tl.where(absmax < float("inf"), tl.where(scale > 0.0, scale, 1.0), float("nan"))


@triton.jit
def asym_scale(lo, hi, DIV: tl.constexpr):
    """Scale of an asymmetric grid, ``(hi - lo) / DIV`` (IEEE division), from a group's clipped ``lo <= 0 <= hi``.

    As :func:`mosaicquant.methods.quant.quantize` takes it: 1 for an all-zero group, NaN where ``lo`` or ``hi`` is
    not finite. Where ``hi - lo`` overflows (finite ends near ``±3.4e38``) the span is taken halved,
    ``2 · ((hi/2 - lo/2) / DIV)``: the correctly rounded quotient still (halving and doubling are exact at that
    size), finite where the direct form overflows to Inf.
    """
    span = hi - lo
    scale = tl.where(span < float("inf"), tl.math.div_rn(span, DIV), 2.0 * tl.math.div_rn(hi * 0.5 - lo * 0.5, DIV))
    finite = (hi < float("inf")) & (lo > -float("inf"))
    return tl.where(finite, tl.where(scale > 0.0, scale, 1.0), float("nan"))


@triton.jit
def store_output(
    out_ptr, part_ptr, lock_ptr, tile_id, pid_k, acc, bias_ptr,
    offs_m, offs_n, M, N, stride_om,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, OUT_FP32: tl.constexpr, TRANS: tl.constexpr = False,
):
    """Write an fp32 ``[BM, BN]`` result tile (plus bias) as BF16, or fp32 when ``OUT_FP32``.

    With ``SPLIT_K > 1`` every split writes its fp32 partial to ``part[pid_k]`` and bumps the
    tile's counter; the split that arrives last adds the partials in split order (so the result
    does not depend on arrival order), adds the bias, writes the output and resets the counter
    to zero for the next launch. ``TRANS``: the tile is ``[BN, BM]`` (the operand-swapped GEMM's
    ``Cᵀ``), written to the same ``[M, N]`` output. Returns whether this program wrote the tile's
    output (the only split, or the last to arrive).
    """
    if TRANS:
        mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
        out_offs = offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    else:
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        out_offs = offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
        bias = bias[:, None] if TRANS else bias[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc = acc + bias
        if OUT_FP32:
            tl.store(out_ptr + out_offs, acc, mask=mask)
        else:
            tl.store(out_ptr + out_offs, acc.to(tl.bfloat16), mask=mask)
        wrote = True
    else:
        # Launchers split K only when SPLIT_K * M * N < 2**31, so int32 offsets suffice here.
        if TRANS:
            part_offs = offs_m[None, :] * N + offs_n[:, None]
        else:
            part_offs = offs_m[:, None] * N + offs_n[None, :]
        plane = M * N
        tl.store(part_ptr + pid_k * plane + part_offs, acc, mask=mask, cache_modifier=".cg")
        arrived = tl.atomic_add(lock_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
        wrote = arrived == SPLIT_K - 1
        if wrote:
            total = tl.load(part_ptr + part_offs, mask=mask, other=0.0, cache_modifier=".cg")
            for s in range(1, SPLIT_K):
                total += tl.load(part_ptr + s * plane + part_offs, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total = total + bias
            if OUT_FP32:
                tl.store(out_ptr + out_offs, total, mask=mask)
            else:
                tl.store(out_ptr + out_offs, total.to(tl.bfloat16), mask=mask)
            tl.atomic_xchg(lock_ptr + tile_id, 0, sem="relaxed", scope="gpu")
    return wrote


@triton.jit
def store_split_tile(
    out_ptr, part_ptr, lock_ptr, slot, pid_k, acc, bias_ptr, offs_m, offs_n, M, N, stride_om,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, SLOT: tl.constexpr,
):
    """:func:`store_output` of one K split of a ``[BN, BM]`` tile of ``Cᵀ`` (``TRANS``), its partial kept in a
    buffer of its own: ``part[slot, pid_k]`` (``float32 [slots, SPLIT_K, SLOT]``, ``SLOT >= BN · BM`` values a
    partial, so tiles of fewer tokens share the layout) and counter ``lock[slot]``.

    For launches that split only some tiles (the swapped GEMM's last wave): the partials take
    ``slots · SPLIT_K`` tiles of memory, not ``SPLIT_K`` copies of the output. The split that arrives last adds
    the partials in split order, adds the bias and writes BF16; it resets the counter.
    """
    mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    local = tl.arange(0, BN)[:, None] * BM + tl.arange(0, BM)[None, :]
    base = part_ptr + slot.to(tl.int64) * (SPLIT_K * SLOT)
    tl.store(base + pid_k * SLOT + local, acc, cache_modifier=".cg")
    arrived = tl.atomic_add(lock_ptr + slot, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT_K - 1:
        total = tl.load(base + local, cache_modifier=".cg")
        for s in range(1, SPLIT_K):
            total += tl.load(base + s * SLOT + local, cache_modifier=".cg")
        if HAS_BIAS:
            total = total + tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)[:, None]
        out_offs = offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
        tl.store(out_ptr + out_offs, total.to(tl.bfloat16), mask=mask)
        tl.atomic_xchg(lock_ptr + slot, 0, sem="relaxed", scope="gpu")


@triton.jit
def dense_split_k(a_ptr, w_ptr, safe_m, safe_n, stride_am, stride_wn, KP, PF_ROW_BYTES, pid_k,
                  BM: tl.constexpr, BN: tl.constexpr, BKP: tl.constexpr, SPLIT_K: tl.constexpr,
                  EVEN_K: tl.constexpr, USE_DOT: tl.constexpr, USE_ASM: tl.constexpr, PDL: tl.constexpr,
                  PREFETCH: tl.constexpr, X16: tl.constexpr):
    """The int32 ``[BM, BN]`` product of split ``pid_k`` of the packed K steps (:func:`mac_int4` a step).

    Rows ``safe_m`` of the packed activations, rows ``safe_n`` of the packed weights; with
    ``PREFETCH`` the split's first ``PF_ROW_BYTES`` of each weight row are asked of L2 before
    waiting for the kernel before (``PDL``), since the weights do not depend on it.
    """
    k_steps = tl.cdiv(KP, BKP)
    per_split = tl.cdiv(k_steps, SPLIT_K)
    step_begin = pid_k * per_split
    step_end = tl.minimum(step_begin + per_split, k_steps)
    if PREFETCH:
        pf_end = tl.minimum(tl.minimum(step_end * BKP, KP), step_begin * BKP + PF_ROW_BYTES)
        prefetch_rows_l2(w_ptr, safe_n, stride_wn, step_begin * BKP, pf_end, LINES=4)
    wait_for_inputs(PDL)
    offs_kp = step_begin * BKP + tl.arange(0, BKP)
    a_ptrs = a_ptr + safe_m[:, None] * stride_am + offs_kp[None, :]
    w_ptrs = w_ptr + safe_n[None, :] * stride_wn + offs_kp[:, None]
    acc = tl.zeros([BM, BN], dtype=tl.int32)
    for step in range(step_begin, step_end):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            kp = step * BKP + tl.arange(0, BKP)
            a = tl.load(a_ptrs, mask=kp[None, :] < KP, other=0)
            w = tl.load(w_ptrs, mask=kp[:, None] < KP, other=0)
        acc = mac_int4(acc, a, w, USE_DOT, USE_ASM, X16)
        a_ptrs += BKP
        w_ptrs += BKP
    return acc


@triton.jit
def store_counted(
    out_ptr, part_ptr, lock_ptr, tile_id, slot_base, slot, expected, acc, bias_ptr,
    offs_m, offs_n, M, N, stride_om, HAS_BIAS: tl.constexpr, OUT_FP32: tl.constexpr,
):
    """Like :func:`store_output` with a tile summed from ``expected`` contributions (a run-time count).

    Each contributor writes its fp32 ``[BM, BN]`` tile to partial slot ``slot_base + slot`` (slots
    ``slot_base … slot_base + expected - 1`` belong to this tile, ``BM · BN`` floats each) and bumps
    the tile's counter; the one that arrives last adds the slots in order (the result does not
    depend on arrival order), adds the bias, writes the output and resets the counter. With
    ``expected == 1`` the tile is stored directly.
    """
    BM: tl.constexpr = acc.shape[0]
    BN: tl.constexpr = acc.shape[1]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    out_offs = offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tile = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
    # partials travel only within the output (a decode call of 4 tokens fills 4 of a tile's 16 rows)
    finish = expected == 1
    if not finish:
        tl.store(part_ptr + (slot_base + slot).to(tl.int64) * (BM * BN) + tile, acc, mask=mask, cache_modifier=".cg")
        arrived = tl.atomic_add(lock_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
        finish = arrived == expected - 1
        if finish:
            acc = sum_slots(part_ptr, slot_base, expected, tile, mask, BM, BN)
            tl.atomic_xchg(lock_ptr + tile_id, 0, sem="relaxed", scope="gpu")
    if finish:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
        if OUT_FP32:
            tl.store(out_ptr + out_offs, acc, mask=mask)
        else:
            tl.store(out_ptr + out_offs, acc.to(tl.bfloat16), mask=mask)


@triton.jit
def sum_slots(part_ptr, base, count, tile, mask, BM: tl.constexpr, BN: tl.constexpr):
    """fp32 sum of the ``[BM, BN]`` partial slots ``base … base + count - 1``, in slot order."""
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for s in range(0, count):
        acc += tl.load(part_ptr + (base + s).to(tl.int64) * (BM * BN) + tile, mask=mask, other=0.0,
                       cache_modifier=".cg")
    return acc


@triton.jit
def store_counted_gated(
    out_ptr, part_ptr, lock_ptr, pair_id, slot, base_g, exp_g, base_u, exp_u, acc, bias_ptr,
    offs_m, offs_c, M, HALF_N, stride_om, HAS_BIAS: tl.constexpr,
):
    """:func:`store_counted` for a pair of tiles of stacked ``[gate | up]`` columns, written as ``silu(g) · u``.

    Every contributor to the gate tile or the up tile of columns ``offs_c`` writes its fp32
    partial to slot ``slot`` and bumps the pair's counter ``pair_id``; the last of the ``exp_g +
    exp_u`` to arrive sums the gate slots ``base_g …`` and the up slots ``base_u …`` in order, adds
    the bias, rounds both to BF16 (as the GEMM's output is rounded) and writes
    ``bf16(silu(g)) · u`` in BF16 (:func:`silu_mul_rounded`), at ``[M, HALF_N]``. The same bits as
    the GEMM's ``[M, 2 · HALF_N]`` BF16 output followed by the SiLU·mul kernel.
    """
    BM: tl.constexpr = acc.shape[0]
    BN: tl.constexpr = acc.shape[1]
    mask = (offs_m[:, None] < M) & (offs_c[None, :] < HALF_N)
    tile = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
    tl.store(part_ptr + slot.to(tl.int64) * (BM * BN) + tile, acc, mask=mask, cache_modifier=".cg")
    arrived = tl.atomic_add(lock_ptr + pair_id, 1, sem="acq_rel", scope="gpu")
    if arrived == exp_g + exp_u - 1:
        g = sum_slots(part_ptr, base_g, exp_g, tile, mask, BM, BN)
        u = sum_slots(part_ptr, base_u, exp_u, tile, mask, BM, BN)
        tl.atomic_xchg(lock_ptr + pair_id, 0, sem="relaxed", scope="gpu")
        if HAS_BIAS:
            g += tl.load(bias_ptr + offs_c, mask=offs_c < HALF_N, other=0.0)[None, :]
            u += tl.load(bias_ptr + HALF_N + offs_c, mask=offs_c < HALF_N, other=0.0)[None, :]
        y = silu_mul_rounded(round_to_bf16(g), round_to_bf16(u), True)
        tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_c[None, :], y.to(tl.bfloat16), mask=mask)


@triton.jit
def in_range(offs, n):
    """Indices ``offs`` as int64 rows of ``[0, n)`` for loads whose results are never stored: the ones past
    the end wrap around (``offs % n``). Pointing them all at row 0 instead made that row's line a hot spot,
    requested by every program once per out-of-range row at each K step: 17 tokens on 32-row tiles ran
    ~2x slower than 32."""
    return (offs % n).to(tl.int64)


@triton.jit
def tile_indices(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Program ``pid``'s tile: ``(pid_m, pid_n, offs_m, offs_n, safe_m, safe_n)``.

    ``offs_*`` are the tile's row and column indices; ``safe_*`` the same as int64 brought into
    range by :func:`in_range`, for loads whose results are never stored.
    """
    pid_m, pid_n = tile_coords(pid, M, N, BM, BN, GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    safe_m = in_range(offs_m, M)
    safe_n = in_range(offs_n, N)
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


# How round_to_bf16 and split_bf16 round (the same values either way): compiled, two values with one
# ``cvt.rn.bf16x2.f32``, each widened back with one integer instruction; on the interpreter (it runs no PTX), the
# rounding bias added to the fp32 encoding and masked (about four integer instructions a value, measured slower on
# the GPU:).
_BF16_CVT = tl.constexpr(not _INTERPRETING)
# $2, $3: two fp32 values; cvt.rn.bf16x2 puts its first source in the high half. $0 = the first value's BF16 in
# the high half of an fp32 encoding (the packed word shifted left), $1 = the second's (the low half cleared).
_ASM_BF16X2 = tl.constexpr("""{
.reg .b32 t;
cvt.rn.bf16x2.f32 t, $3, $2;
shl.b32 $0, t, 16;
and.b32 $1, t, 0xFFFF0000;
}""")


@triton.jit
def round_to_bf16(z):
    """fp32 → the nearest BF16 value (ties to even), kept in fp32; finite inputs.

    Not ``.to(tl.bfloat16)``: Triton's interpreter truncates that conversion, and compiled
    ``.to(bf16).to(fp32)`` pairs were seen not to round on the H200.
    Compiled, one ``cvt.rn.bf16x2.f32`` rounds two values; on the interpreter bit
    arithmetic on the fp32 encoding. Both are round-to-nearest-even.
    """
    if _BF16_CVT:
        return tl.inline_asm_elementwise(_ASM_BF16X2, "=r,=r,r,r", [z], dtype=tl.float32, is_pure=True, pack=2)
    else:
        u = z.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        return u.to(tl.float32, bitcast=True)


# $2, $3: two fp32 values y; $0: their BF16 roundings h (packed), $1: the BF16 roundings of y - h (packed)
_ASM_BF16X2_SPLIT = tl.constexpr("""{
.reg .b32 h0, h1, d0, d1;
cvt.rn.bf16x2.f32 $0, $3, $2;
shl.b32 h0, $0, 16;
and.b32 h1, $0, 0xFFFF0000;
sub.rn.f32 d0, $2, h0;
sub.rn.f32 d1, $3, h1;
cvt.rn.bf16x2.f32 $1, d1, d0;
}""")


@triton.jit
def split_bf16(y):
    """fp32 ``y`` as two BF16 tensors ``(hi, lo)``: ``hi`` = ``y`` rounded to BF16, ``lo`` = ``y - hi`` rounded to
    BF16 (so ``hi + lo`` holds 16 significant bits of ``y``), both to nearest, ties to even. Compiled, each pair
    of values takes two ``cvt.rn.bf16x2.f32``; on the interpreter :func:`round_to_bf16`'s
    bit arithmetic, whose results the conversions to BF16 then keep exactly (the interpreter's conversion truncates).
    """
    if _BF16_CVT:
        return tl.inline_asm_elementwise(_ASM_BF16X2_SPLIT, "=r,=r,r,r", [y], dtype=(tl.bfloat16, tl.bfloat16),
                                         is_pure=True, pack=2)
    else:
        hi = round_to_bf16(y)
        return hi.to(tl.bfloat16), round_to_bf16(y - hi).to(tl.bfloat16)


@triton.jit
def rnd(x, DT: tl.constexpr, BITS: tl.constexpr):
    """``x`` rounded to the 16-bit dtype ``DT`` (nearest, ties to even), kept in fp32; ``BITS``: by
    :func:`round_to_bf16` (BF16), else by the dtype conversion."""
    if BITS:
        return round_to_bf16(x)
    else:
        return x.to(DT).to(tl.float32)


@triton.jit
def silu_mul_rounded(g, u, IS_BF16: tl.constexpr):
    """``silu(g) · u`` of fp32 values from a 16-bit tensor, rounded as transformers' eager ops round.

    ``silu`` is rounded to the 16-bit dtype (BF16 if ``IS_BF16``, else FP16), then the product;
    the result is kept in fp32 (exactly representable in the 16-bit dtype).
    """
    a = g / (1.0 + tl.exp(-g))
    if IS_BF16:
        return round_to_bf16(round_to_bf16(a) * u)
    else:
        return (a.to(tl.float16).to(tl.float32) * u).to(tl.float16).to(tl.float32)
