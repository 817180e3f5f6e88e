"""Online Hadamard transform fused with activation quantization: BF16 in, packed int4 + scale out.

The rotated methods (QuaRot, SpinQuant's online part, MosaicQuant's rotation) transform the
inputs of ``o_proj`` / ``down_proj`` at run time, ``x ← x H_n D / √n``
(:class:`mosaicquant.methods.hadamard.OnlineHadamard`), and then quantize them per token to
4 bits. Run as separate PyTorch ops, the transform costs a cast, a dense product, a chain of
butterflies and a Paley product — more than the 4-bit GEMM itself at decode sizes. This
kernel does both in one pass, one program per token, the row held on chip (or, at decode
sizes on a GPU, ``P`` programs per token, each taking ``D / P`` columns of the view below;
see the end):

1. ``n = R · D`` with ``D = min(2^k, 128)`` (``n = m · 2^k``, ``m`` the Paley factor). The
   row, viewed as ``X [R, D]`` (element ``i = r·D + d``), is transformed as
   ``x (A ⊗ S_D) = Aᵀ X S_D`` with ``A = H_m ⊗ S_{2^k / D}`` (``R × R``, entries ±1) and
   ``S_D`` the Sylvester matrix: two tensor-core products, ``Y = X S_D`` in the input's
   16-bit dtype (±1 entries, exact products, fp32 sums) and ``Z = Aᵀ Y`` with ``Y`` split
   into a 16-bit high part and a 16-bit remainder (two products, ~16 significant bits of
   ``Y``, fp32 sums). ``R`` is padded to a power of two ≥ 16 with zero rows of ``A``.
2. ``Z / √n`` (times the signs ``D``, if any) is rounded to the input dtype — exactly where
   the PyTorch path rounds the transform's output — then quantized like
   :mod:`mosaicquant.kernels.act_quant`: ``scale = absmax · clip / 7`` (IEEE division; an
   all-zero row gets 1), ``q = clamp(round_half_even(z / scale), -8, 7)``, packed two a byte
   (low nibble = even index), scale ``float32 [M]``; or, with ``layout="split8"``, one
   ``int8`` a byte in act_quant's split8 layout (for the swapped prefill GEMM).

The result equals ``quantize_activations(OnlineHadamard(x))`` up to float summation order:
a transformed value can land one 16-bit ulp away from the PyTorch path's, which moves its
4-bit integer only when it sits on a rounding boundary (rare; the tests bound how often).

Several programs per token (``programs_per_token``): the ``[R, D]`` view's columns are
independent through the transform, ``Z[:, c] = Aᵀ (X S_D[:, c])``, so program ``s`` of a token
loads the whole ``X`` (cheap), multiplies by its ``D / P`` columns of ``S_D`` and then by ``Aᵀ``
(both products ``P`` times smaller), rounds, and quantizes its columns after the token's
programs have met for the row's absmax (:mod:`mosaicquant.kernels._token_split`). Every value
goes through the same products, in the same order, as with one program, so the integers and
scales are the same (the tests check them bit for bit on the GPU). Narrow slices (16 or 32
columns) of views of 64 rows or more are multiplied transposed (:func:`_transposed`: as they
are, they hit a Triton bug).

Views of more than 128 padded rows (``R_PAD = 256``: Qwen3-14B's 17408 = 68 · 2^8, Qwen3-32B's 25600 =
100 · 2^8) fold the last Sylvester level of ``A`` into registers: ``A = A' ⊗ S_2`` (``2^k / D ≥ 2``), so
``Aᵀ Y`` is a butterfly of ``Y``'s row pairs, ``(y_{2i} + y_{2i+1}, y_{2i} - y_{2i+1})``, viewed as
``[R/2, 2D]``, then ``A'ᵀ`` of half the size. Unfolded, the ``R_PAD × R_PAD`` operand and the two
``[R_PAD, D]`` parts of ``Y`` asked for 256 KiB of shared memory, more than a Hopper SM has (227 KiB): the
kernel did not launch on the GPU. Folded views split into at most ``D / 64`` programs a token (no transposed
products).

A token whose row holds NaN or Inf (before or after the transform, which spreads one over the row) gets
the scale NaN, so its GEMM output row is NaN (:func:`mosaicquant.kernels._tl.max_nan`); the others are
unaffected.

Taken: 16-bit inputs (BF16 / FP16), ``D ≥ 16`` (``2^k ≥ 16``) and ``R ≤ 256`` (``n ≤ 32768`` for
``2^k ≥ 128``), with a Sylvester level to fold above 128 rows: every hidden and intermediate size of the SPEC
models.
:func:`fused_hadamard_reason` says why anything else is not, and callers then run the
transform and the quantizer separately (the same function, slower).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from mosaicquant.errors import UserInputError
from mosaicquant.kernels._common import (
    chain_launch,
    chain_mode,
    check_same_device,
    check_tensor,
    check_triton_device,
    kernel_preference,
    resolve_kernel,
    triton_interpreting,
)
from mosaicquant.kernels._tl import chain_start, max_nan, quant_div, quantize_int4, silu_mul_rounded, split_bf16
from mosaicquant.kernels._tl import round_to_bf16 as _round_to_bf16
from mosaicquant.kernels._token_split import (
    barrier_buffer,
    check_num_warps,
    resolve_programs_per_token,
    token_scale,
    token_slice,
)
from mosaicquant.kernels.act_quant import LAYOUTS, quantize_activations_reference, split8_width
from mosaicquant.methods.hadamard import OnlineHadamard, _sylvester, hadamard_factor

__all__ = [
    "hadamard_quantize",
    "hadamard_quantize_triton",
    "hadamard_quantize_reference",
    "fused_hadamard_reason",
    "MAX_ROWS",
]

#: largest padded row count ``R`` of the ``[R, D]`` view (the ``Aᵀ`` product is ``R × R``)
MAX_ROWS = 256
#: views of more padded rows than this fold a Sylvester level of ``A`` into registers (see the module docstring)
FOLD_ABOVE_ROWS = 128
_DENSE = 128  # the inner Sylvester block D (at most)
_DTYPES = (torch.bfloat16, torch.float16)
# The default rule's least slice (values per program) when tokens are split over several programs.
# On the H200 (benchmarks/kernels/quant_split.py, M = 1 ... 32) a 4096-wide row ([32, 128] view) took
# 4.3-4.7 µs with one program and 3.8-4.1 split 8 ways (512 values a program, 4 warps) at M <= 16;
# a 14336-wide one ([112, 128] padded to 128) 17.1-17.4 µs with one and 6.0-6.3 split 8 ways (the
# transposed products, 4 warps) at M <= 16, 7.3 split 4 ways at M = 32.
SPLIT_MIN_WIDTH = 512
# Slices narrower than this of views of 64 rows or more run the transposed products (see _transposed).
WGMMA_MIN_COLUMNS = 64


@triton.jit
def _hadamard_quant_kernel(
    x_ptr, left_ptr, syl_ptr, signs_ptr, q_ptr, scale_ptr, sync_ptr,
    R, stride_xm, stride_qm, inv_sqrt_n, clip_ratio,
    D: tl.constexpr, R_PAD: tl.constexpr,
    HAS_SIGNS: tl.constexpr, SIGNS_FIRST: tl.constexpr, DOT_F32: tl.constexpr, CHAIN: tl.constexpr,
    SPLIT8: tl.constexpr = False, GATED: tl.constexpr = False, up_offset=0,
    P: tl.constexpr = 1, SYNC: tl.constexpr = True, TRANS: tl.constexpr = False, FOLD: tl.constexpr = False,
):
    chain_start(CHAIN)  # the GEMM that reads our output may start (it waits for us before reading)
    DS: tl.constexpr = D // P  # columns of the [R, D] view this program transforms and quantizes
    # program token · P + s: columns [s · DS, (s + 1) · DS), Z[:, cols] = Aᵀ (X S_D[:, cols])
    row, slice_id, tag = token_slice(sync_ptr, P, SYNC)
    c0 = slice_id * DS
    rows = tl.arange(0, R_PAD)
    cols = tl.arange(0, D)
    part = c0 + tl.arange(0, DS)
    idx = rows[:, None] * D + cols[None, :]
    out_idx = rows[:, None] * D + part[None, :]
    valid = rows[:, None] < R
    x = tl.load(x_ptr + row * stride_xm + idx, mask=valid, other=0.0)
    if GATED:  # x holds [gate | up]: the transform's input is silu(gate) · up, rounded as silu_mul rounds it
        up = tl.load(x_ptr + row * stride_xm + up_offset + idx, mask=valid, other=0.0).to(tl.float32)
        x = silu_mul_rounded(x.to(tl.float32), up, x_ptr.dtype.element_ty == tl.bfloat16).to(x_ptr.dtype.element_ty)
    if HAS_SIGNS:
        if SIGNS_FIRST:
            s = tl.load(signs_ptr + idx, mask=valid, other=1.0)
            x = (x.to(tl.float32) * s).to(x_ptr.dtype.element_ty)  # ±1: exact
    if TRANS:
        # the transposed products, Zᵀ = ((S_D[:, cols])ᵀ Xᵀ) Aᵀᵀ: the slice's columns are the dots'
        # M, which keeps a narrow slice of a tall view off wgmma (see _split_limit)
        syl = tl.load(syl_ptr + part[:, None] * D + cols[None, :])  # S_D[cols, :] = S_D[:, cols]ᵀ
        left = tl.load(left_ptr + rows[None, :] * R_PAD + rows[:, None])  # leftᵀ
    elif FOLD:
        syl = tl.load(syl_ptr + cols[:, None] * D + part[None, :])
        half_rows = tl.arange(0, R_PAD // 2)
        left = tl.load(left_ptr + half_rows[:, None] * (R_PAD // 2) + half_rows[None, :])  # A'ᵀ
    else:
        syl = tl.load(syl_ptr + cols[:, None] * D + part[None, :])
        left = tl.load(left_ptr + rows[:, None] * R_PAD + rows[None, :])
    if DOT_F32:
        # Triton's interpreter computes 16-bit dots wrongly (bfloat16); the same products in fp32
        x = x.to(tl.float32)
        syl = syl.to(tl.float32)
        left = left.to(tl.float32)
    if TRANS:
        y = tl.dot(syl, tl.trans(x), out_dtype=tl.float32)  # (X S_D[:, cols])ᵀ
    else:
        y = tl.dot(x, syl, out_dtype=tl.float32)  # X S_D: ±1 weights, exact products
    if FOLD:
        # A = A' ⊗ S_2: rows 2i and 2i + 1 of Y become (y_2i + y_2i+1, y_2i - y_2i+1), side by side in row i of
        # a [R_PAD / 2, 2 DS] view that A'ᵀ multiplies (column j · DS + c of it is row 2i + j, column c)
        pairs = tl.permute(tl.reshape(y, [R_PAD // 2, 2, DS]), [0, 2, 1])
        y_even, y_odd = tl.split(pairs)
        y = tl.reshape(tl.permute(tl.join(y_even + y_odd, y_even - y_odd), [0, 2, 1]), [R_PAD // 2, 2 * DS])
    if x_ptr.dtype.element_ty == tl.bfloat16:
        y_hi, y_lo = split_bf16(y)
    else:
        y_hi = y.to(x_ptr.dtype.element_ty)
        y_lo = (y - y_hi.to(tl.float32)).to(x_ptr.dtype.element_ty)
    if DOT_F32:
        y_hi = y_hi.to(tl.float32)
        y_lo = y_lo.to(tl.float32)
    if TRANS:
        z = tl.dot(y_hi, left, out_dtype=tl.float32)
        z = tl.trans(tl.dot(y_lo, left, z, out_dtype=tl.float32))
    else:
        z = tl.dot(left, y_hi, out_dtype=tl.float32)
        z = tl.dot(left, y_lo, z, out_dtype=tl.float32)
    if FOLD:
        z = tl.reshape(z, [R_PAD, DS])  # row i's two halves are rows 2i, 2i + 1 of the view
    z = z * inv_sqrt_n
    if HAS_SIGNS:
        if not SIGNS_FIRST:
            s = tl.load(signs_ptr + out_idx, mask=valid, other=1.0)
            z = z * s
    # the transform's output in the activation dtype, as the unfused path rounds it
    if x_ptr.dtype.element_ty == tl.bfloat16:
        z = _round_to_bf16(z)
    else:
        z = z.to(tl.float16).to(tl.float32)

    absmax = max_nan(max_nan(tl.abs(z), 1), 0)
    scale = token_scale(absmax, clip_ratio, sync_ptr, row, slice_id, tag, P, SYNC)
    if c0 == 0:
        tl.store(scale_ptr + row, scale)
    q = quantize_int4(quant_div(z, scale)).to(tl.int8)
    half = c0 // 2 + tl.arange(0, DS // 2)  # the slice's pairs within a row of the view
    if SPLIT8:
        if D == 128:
            # each row of the [R, 128] view is one split8 block: its even, then its odd values,
            # as two contiguous stores
            q_even, q_odd = tl.split(tl.reshape(q, [R_PAD, DS // 2, 2]))
            at = q_ptr + row * stride_qm + rows[:, None] * 128 + half[None, :]
            tl.store(at, q_even, mask=rows[:, None] < R)
            tl.store(at + 64, q_odd, mask=rows[:, None] < R)
        else:
            # element i → byte (i // 128) * 128 + (i % 2) * 64 + (i % 128) // 2 (act_quant's "split8")
            at = (out_idx // 128) * 128 + (out_idx % 2) * 64 + (out_idx % 128) // 2
            tl.store(q_ptr + row * stride_qm + at, q, mask=valid)
    else:
        q_even, q_odd = tl.split(tl.reshape(q, [R_PAD, DS // 2, 2]))
        packed = (q_even & 0xF) | (q_odd << 4)
        tl.store(q_ptr + row * stride_qm + rows[:, None] * (D // 2) + half[None, :], packed, mask=rows[:, None] < R)


def _warps(m: int, padded: int, folded: bool = False) -> int:
    """Warps per program for ``m`` tokens of ``padded`` values a program (its slice of the padded ``[R, D]`` view);
    ``folded``: the view folds a Sylvester level (:func:`_folded`).

    At decode sizes (``m <= 32``) one program per token is all the kernel has, and more warps
    shorten it: on the H200, 4096 values took 4.5 µs with 8 warps against 4.8 with 4, and
    14336 (16384 padded) 17.2 µs with 16 against 18.3 with 8 (``benchmarks/kernels/hadamard_warps.py``).
    Larger calls keep 4 warps up to 4096 values and 8 above, but 4 from 256 tokens: 14336 values
    (16384 padded) at 256 / 1024 / 2048 / 8192 tokens took 17.98 / 64.39 / 125.54 / 481.03 µs on 4
    warps against 18.81 / 70.24 / 139.20 / 526.06 on 8 (at 64 tokens 13.03 against 9.66;
    ``benchmarks/kernels/hadamard_warps.py``, inputs rotated through more than L2).
    Split programs follow the same rule by their slice: 4096 values split 8 ways (512 a program) took
    3.6-4.3 µs with 4 warps against 4.4-4.6 with 8, and 14336 split 2 ways (8192 padded) 10.5-11.2 with
    8 against 12.1-12.6 with 4 (``benchmarks/kernels/quant_split.py``).

    Folded views keep 8 warps from 256 tokens too. Their programs hold a [256, 128] row and need ~160 KiB of
    shared memory, one program an SM: on 4 warps the 17408-wide rows of 2048 tokens took 887 µs (split8 layout;
    8 warps 248, 16 warps 532), the 25600-wide 988 (8 warps 264, 16 warps 551). At 1-32 tokens 8 warps ran the
    kernel alone in 9.5-10.6 µs against 11.2-12.5 on the rule's 16, but QuaRot's Qwen3-14B decode step was
    slower with them (4,506 against 4,359 µs at batch 4, 5,578 against 5,327 at 32), so decode keeps the rule
    (``benchmarks/kernels/hadamard_warps.py``, ``benchmarks/kernels/decode_profile.py``).
    """
    if m <= 32 and padded >= 4096:
        return 8 if padded <= 8192 else 16
    return 4 if padded <= 4096 or (m >= 256 and not folded) else 8


def _view_of(transform: OnlineHadamard) -> tuple[int, int, int]:
    """``(R, D, R_PAD)`` of the ``[R, D]`` row view."""
    p = 1 << transform.log2_sylvester
    d = min(p, _DENSE)
    r = transform.size // d
    return r, d, max(16, triton.next_power_of_2(r))


def _folded(transform: OnlineHadamard) -> bool:
    """Whether the kernel folds a Sylvester level of ``A`` into registers for ``transform`` (views of more than
    :data:`FOLD_ABOVE_ROWS` padded rows)."""
    return _view_of(transform)[2] > FOLD_ABOVE_ROWS


def _split_limit(transform: OnlineHadamard) -> tuple[int, str]:
    """The most programs per token the kernel takes for ``transform``, and why: ``tl.dot`` needs slices
    of at least 16 columns (64 on folded views: they do not run the transposed products)."""
    r, d, r_pad = _view_of(transform)
    least = WGMMA_MIN_COLUMNS if r_pad > FOLD_ABOVE_ROWS else 16  # folded views (_folded)
    return max(1, d // least), f"slices of at least {least} of the {d} columns of the [{r}, {d}] view"


def _transposed(r_pad: int, d: int, p: int) -> bool:
    """Whether a split launch runs the transposed products (``TRANS``).

    Views of 64 rows or more (``R_PAD >= 64``) run their products on Hopper's ``wgmma``, where
    Triton 3.6 computed wrong values or made illegal memory accesses with slices of 16 or 32
    columns on the H200 (at 4, 8 and 16 warps, without the barrier too); slices of 64 columns
    were right at every warp count tried. Such slices are multiplied transposed instead, the
    slice's columns as the dots' M (16 or 32 rows: ``mma``).
    """
    return p > 1 and r_pad >= 64 and d // p < WGMMA_MIN_COLUMNS


def fused_hadamard_reason(transform: object, dtype: torch.dtype) -> str | None:
    """``None`` when the fused kernel takes this transform and input dtype, else why not."""
    if not isinstance(transform, OnlineHadamard):
        return f"the input transform is {type(transform).__name__}, not an OnlineHadamard"
    if dtype not in _DTYPES:
        return f"activations are {str(dtype).replace('torch.', '')}; the fused kernel takes bfloat16 or float16"
    r, d, r_pad = _view_of(transform)
    if d < 16:
        return (f"size {transform.size} = {transform.factor_order}·2^{transform.log2_sylvester}: the fused "
                f"kernel needs a power-of-two part of at least 16")
    if r_pad > MAX_ROWS:
        return f"size {transform.size} needs {r} rows of {d} (the fused kernel takes at most {MAX_ROWS})"
    if r_pad > FOLD_ABOVE_ROWS and (1 << transform.log2_sylvester) < 2 * d:
        return (f"size {transform.size} needs {r} rows of {d}: above {FOLD_ABOVE_ROWS} the fused kernel folds a "
                f"Sylvester level into registers, and {transform.size} = {transform.factor_order}"
                f"·2^{transform.log2_sylvester} has none past the {d} columns")
    return None


@functools.cache
def _operands(m: int, log2_p: int, transpose: bool, device: torch.device, dtype: torch.dtype, fold: bool = False):
    """``(Aᵀ padded to [R_PAD, R_PAD], S_D)`` in ``dtype`` on ``device`` (one copy each); with ``fold``, ``A'ᵀ``
    (``A = A' ⊗ S_2``) padded to ``[R_PAD / 2, R_PAD / 2]``."""
    p = 1 << log2_p
    d = min(p, _DENSE)
    a = torch.kron(hadamard_factor(m, torch.float64), _sylvester(p // d // (2 if fold else 1), torch.float64))
    r = a.shape[0]
    r_pad = max(16, triton.next_power_of_2(2 * r) // 2 if fold else triton.next_power_of_2(r))
    left = torch.zeros(r_pad, r_pad, dtype=torch.float64)
    # x (A ⊗ S) = Aᵀ X S; transposed: x (A ⊗ S)ᵀ = A X S (Sylvester matrices are symmetric)
    left[:r, :r] = a if transpose else a.T
    syl = _sylvester(d, torch.float64)
    return left.to(device=device, dtype=dtype).contiguous(), syl.to(device=device, dtype=dtype).contiguous()


def _check(x: torch.Tensor, transform: object, clip_ratio: float, gated: bool = False) -> None:
    check_tensor("x", x, dtypes=(torch.bfloat16, torch.float16, torch.float32), dim=2)
    if not isinstance(transform, OnlineHadamard):
        raise UserInputError(f"transform must be an OnlineHadamard, got {type(transform).__name__}")
    width = 2 * transform.size if gated else transform.size
    if x.shape[1] != width:
        raise UserInputError(f"x has {x.shape[1]} columns; the transform is of size {transform.size}"
                             + (" and a gated input holds [gate | up]" if gated else ""))
    if not isinstance(clip_ratio, (int, float)) or not 0.0 < float(clip_ratio) <= 1.0:
        raise UserInputError(f"clip_ratio={clip_ratio!r} is out of range: allowed (0, 1]")


def hadamard_quantize_triton(
    x: torch.Tensor, transform: OnlineHadamard, clip_ratio: float = 1.0,
    out: tuple[torch.Tensor, torch.Tensor] | None = None, layout: str = "packed", gated: bool = False,
    num_warps: int | None = None, programs_per_token: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the fused kernel.

    Args:
        x: ``[M, n]`` BF16/FP16 activations, unit stride along ``n``.
        transform: the layer's :class:`OnlineHadamard` (size ``n``; signs and transpose honoured).
        clip_ratio: fraction of each token's absmax kept, in (0, 1].
        out: optional preallocated contiguous ``(packed uint8 [M, n/2], scale float32 [M])``
            (``"packed"`` layout only).
        layout: ``"packed"`` or ``"split8"`` (``int8 [M, split8_width(n)]``, for the swapped
            prefill GEMM; see :mod:`mosaicquant.kernels.act_quant`).
        gated: ``x`` is ``[M, 2n]`` ``[gate | up]``; the transform's input is ``silu(gate) · up``
            with :func:`mosaicquant.kernels.decoder.silu_mul`'s roundings (a gated MLP's
            down-projection input, without its own kernel).
        num_warps: warps per program (default :func:`_warps` of a program's slice).
        programs_per_token: programs that share each token (a power of two; each takes ``D / P``
            columns of the ``[R, D]`` view, at least 16: :func:`_split_limit`; the same results for any).
            ``None``: :func:`mosaicquant.kernels._token_split.default_programs_per_token` with
            slices of at least ``SPLIT_MIN_WIDTH`` values. More than 1 only on a GPU with
            ``M · P`` at most its SM count; under Triton's interpreter (programs run one after
            another, and a token's programs wait for each other) it must be 1.

    Returns:
        ``(packed, scale)``.

    Raises:
        UserInputError: bad arguments, a transform or dtype the kernel does not take (the
            message says why), a programs-per-token or warp count not allowed, or a device the
            Triton path cannot run on.
    """
    _check(x, transform, clip_ratio, gated)
    reason = fused_hadamard_reason(transform, x.dtype)
    if reason is not None:
        raise UserInputError(f"the fused Hadamard + quantization kernel cannot run this input: {reason}")
    device = check_same_device(x=x)
    check_triton_device(device)
    m, n = x.shape[0], transform.size
    if layout not in LAYOUTS:
        raise UserInputError(f"layout={layout!r} is not allowed: choose one of {', '.join(LAYOUTS)}")
    check_num_warps(num_warps)
    p = resolve_programs_per_token(programs_per_token, m, device, n, SPLIT_MIN_WIDTH, *_split_limit(transform))
    if layout == "split8":
        if out is not None:
            raise UserInputError("out= takes the packed layout only")
        width = split8_width(n)
        # the padding past n (to a whole 128-value block) must read as zeros
        packed = (torch.zeros if width != n else torch.empty)(m, width, dtype=torch.int8, device=device)
        scale = torch.empty(m, dtype=torch.float32, device=device)
    elif out is not None:
        packed, scale = out
        check_tensor("out[0]", packed, dtypes=(torch.uint8,), shape=(m, n // 2))
        check_tensor("out[1]", scale, dtypes=(torch.float32,), shape=(m,))
        if not packed.is_contiguous() or packed.device != device or scale.device != device:
            raise UserInputError("out tensors must be contiguous and on x's device")
    else:
        packed = torch.empty(m, n // 2, dtype=torch.uint8, device=device)
        scale = torch.empty(m, dtype=torch.float32, device=device)
    signs = transform.signs
    if signs is not None and (signs.device != device or signs.dtype != torch.float32):
        raise UserInputError(f"the transform's signs are {signs.dtype} on {signs.device}; move the transform "
                             f"to {device} (float32 signs)")
    if m:
        _launch(x, transform, packed.view(torch.int8), scale, clip_ratio, layout == "split8", gated, p, num_warps)
    return packed, scale


def _launch(x: torch.Tensor, transform: OnlineHadamard, q: torch.Tensor, scale: torch.Tensor, clip_ratio: float,
            split8: bool, gated: bool, p: int, num_warps: int | None, given_absmax: torch.Tensor | None = None) -> None:
    """Run the kernel on checked arguments: ``M · p`` programs, ``p`` per token (token-major).

    ``q`` is the output's ``int8`` view. ``given_absmax`` (tests on the interpreter, ``p > 1``): each
    transformed row's absmax, given, so that a token's programs need not wait for each other (the
    kernel's ``SYNC=False``); ``None`` uses the barrier.
    """
    m, n = x.shape[0], transform.size
    chain = chain_mode(x.device, m)
    r, d, r_pad = _view_of(transform)
    fold = r_pad > FOLD_ABOVE_ROWS  # _folded(transform)
    left, syl = _operands(transform.factor_order, transform.log2_sylvester, transform.transpose, x.device, x.dtype,
                          fold)
    signs = transform.signs
    if p == 1:
        sync, wait = scale, True  # the kernel does not read it
    elif given_absmax is None:
        sync, wait = barrier_buffer(x.device), True
    else:
        sync, wait = given_absmax.to(device=x.device, dtype=torch.float32).contiguous(), False
    _hadamard_quant_kernel[(m * p,)](
        x, left, syl, signs if signs is not None else scale, q, scale, sync,
        r, x.stride(0), q.stride(0), 1.0 / math.sqrt(n), float(clip_ratio),
        D=d, R_PAD=r_pad, HAS_SIGNS=signs is not None, SIGNS_FIRST=transform.transpose,
        DOT_F32=triton_interpreting(), CHAIN=chain, SPLIT8=split8,
        GATED=gated, up_offset=n if gated else 0, P=p, SYNC=wait, TRANS=_transposed(r_pad, d, p), FOLD=fold,
        num_warps=num_warps if num_warps is not None else _warps(m, r_pad * d // p, fold), **chain_launch(chain),
    )


def hadamard_quantize_reference(
    x: torch.Tensor, transform: OnlineHadamard, clip_ratio: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused PyTorch path: ``quantize_activations_reference(transform(x), clip_ratio)``."""
    _check(x, transform, clip_ratio)
    return quantize_activations_reference(transform(x), clip_ratio)


def hadamard_quantize(
    x: torch.Tensor, transform: OnlineHadamard, clip_ratio: float = 1.0, kernel: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_activations(transform(x), clip_ratio)`` in one kernel where it can.

    Args:
        x: ``[M, n]`` activations.
        transform: the online Hadamard applied before quantization.
        clip_ratio: in (0, 1].
        kernel: ``"auto"`` / ``"triton"`` / ``"torch"`` / ``None`` (the settings' ``kernel``, default
            ``"auto"``). ``"auto"`` runs the PyTorch reference where the fused kernel does not take
            the transform or dtype (:func:`fused_hadamard_reason`: e.g. float32 input, a size
            without a power-of-two part of 16); ``"triton"`` raises there.

    Returns:
        ``(packed uint8 [M, n/2], scale float32 [M])``.

    Raises:
        UserInputError: bad input; with ``kernel="triton"``, a transform or dtype the fused
            kernel does not take.

    Example:
        >>> had = OnlineHadamard(64)
        >>> packed, scale = hadamard_quantize(torch.randn(3, 64, dtype=torch.bfloat16), had, kernel="torch")
        >>> packed.shape, scale.shape
        (torch.Size([3, 32]), torch.Size([3]))
    """
    backend = resolve_kernel(kernel, x.device if isinstance(x, torch.Tensor) else None)
    if backend == "triton" and kernel_preference(kernel) == "auto" and isinstance(x, torch.Tensor) \
            and fused_hadamard_reason(transform, x.dtype) is not None:
        backend = "torch"  # the automatic choice: the reference where the fused kernel does not take the input
    if backend == "triton":
        return hadamard_quantize_triton(x, transform, clip_ratio)
    return hadamard_quantize_reference(x, transform, clip_ratio)
