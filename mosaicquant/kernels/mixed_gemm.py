"""Mixed-precision GEMM of the Atom and ResQ baselines: 4-bit channel groups + 8-bit channels.

A mixed layer splits its ``K`` input channels into a **low** part (``K_lo`` channels, in a
given order, quantized in groups of ``G`` consecutive channels of that order, 2..4 bits) and
a **high** part (``K_hi`` channels quantized per token, 2..8 bits). Atom reorders the
channels by salience (128 salient channels INT8, the rest 4-bit in groups of 128, symmetric,
SPEC §3); ResQ keeps the last ``K/8`` channels of its rotated basis at 8 bits and the rest at
4 bits per token (asymmetric by default). Both are :class:`MixedFormat` s.

Activation quantizer (:func:`mixed_act_quant`), per token, exactly
:func:`mosaicquant.methods.quant.quantize` on the gathered channels (IEEE ``div_rn``,
ties-to-even, clip ratio): each low group and the high part get their own scale (and zero
point when asymmetric); a last group shorter than ``G`` is quantized as if zero-padded, as
:class:`~mosaicquant.methods.mixed.MixedActQuant` does. **Gather, not reorder**: the kernel
reads the channels of each group through the permutation ``perm = [low channels in group
order, high channels]`` (index loads from the token's row, which sits in L1/L2 after the
first touch), so no reordered copy of ``x`` is written and read back and the op producing
``x`` needs no change; with ``perm=None`` the layout is the identity (ResQ: low channels
first, high last) and the index loads are skipped. One program per token; its low groups
are taken as ``[groups, pairs, 2]`` tiles (many small groups a step, or a large group in
two passes: range, then quantize). The kernel is compiled without FMA contraction, so the
asymmetric range ``hi - lo`` of clipped ends rounds as the reference's separate ops.
A group (or a token's high part) holding NaN or Inf gets the scale NaN (its integers and zero point are
unspecified), so the token's GEMM output row is NaN; the reference raises instead. Finite ends near
``±3.4e38`` whose asymmetric range ``hi - lo`` overflows get the range halved first
(:func:`mosaicquant.kernels._tl.asym_scale`), as the reference does.

Integer storage (activations and weights alike):

- the integers are signed: a ``b``-bit asymmetric grid ``q ∈ [0, 2^b - 1]`` is stored as
  ``q - 2^(b-1)`` with the zero point shifted likewise, so ``x̂ = (q - zero) * scale``
  holds for the stored values; symmetric grids have no zero point;
- low part, **group-padded packing**: group ``g`` occupies bytes ``[g*GP, (g+1)*GP)`` of a
  row, ``GP = ceil(G/2)``, two values a byte, element ``2j`` in the low nibble (as
  :func:`mosaicquant.methods.format.pack_int4`); padding nibbles are 0. For an even ``G``
  this is plain ``pack_int4`` of the (zero-padded) reordered row; an odd ``G`` costs one
  padding nibble a group, and keeps every group byte-aligned for the GEMM's tiles;
- high part: ``int8 [rows, K_hi]``;
- scales ``float32`` (weights: low ``float16`` or ``float32``, high ``float32``), zero points
  ``int32``, one per (row, group) and per row.

GEMM (:func:`mixed_gemm`), for ``M`` tokens and ``N`` output channels::

    y = Σ_g (A_g·W_gᵀ − z_a[:, g] ⊗ ΣW_g) ⊙ (s_a[:, g] ⊗ s_w[:, g])
        + (A_8·W_8ᵀ − z_8 ⊗ ΣW_8) ⊙ (s_8 ⊗ s_w8)  (+ bias)

with ``ΣW_g[n] = Σ_{k∈g} W[n, k]`` (precomputed, int32), the bracket exact in int32 and the
scaling in fp32, BF16 out. A program owns a ``[BM, BN]`` tile; per group it runs one (or a
few) ``BKP``-byte steps of two int8 tensor-core dots (even and odd K nibbles, no
interleave, :func:`mosaicquant.kernels._tl.mac_int4`) into an int32 accumulator, then
folds the group's zero-point correction and scales into an fp32 accumulator; the 8-bit
channels follow as plain int8 dots in ``BK8`` steps. Ragged ``M``/``N`` read a valid row
instead (never stored), ragged ``K`` tails are masked. Small ``M`` splits K across programs
(fp32 partials, summed in split order by the last to finish, as the W4A4 GEMM does): the
groups are shared out, or the K steps of each group when there are fewer groups than
splits; the zero-point terms are added once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from mosaicquant.errors import UserInputError
from mosaicquant.kernels._common import (
    check_input_features,
    check_same_device,
    check_tensor,
    check_triton_device,
    output_buffer,
    resolve_kernel,
    triton_interpreting,
)
from mosaicquant.kernels._tiles import LOCK_SLOTS, lock_buffer
from mosaicquant.kernels._token_split import sm_count
from mosaicquant.kernels._tl import (
    asym_scale,
    mac_int4,
    max_nan,
    maximum_nan,
    min_nan,
    minimum_nan,
    quant_div,
    round_half_even,
    store_output,
    sym_scale,
    tile_indices,
)
from mosaicquant.kernels.w4a4_gemm import int_matmul
from mosaicquant.methods.format import pack_int4, unpack_int4
from mosaicquant.methods.mixed import MixedActQuant
from mosaicquant.methods.qlinear import ActQuantSpec, FakeQuantLinear
from mosaicquant.methods.quant import Quantized, quantize

__all__ = [
    "MixedFormat",
    "MixedActs",
    "MixedWeights",
    "MixedTileConfig",
    "pack_int4_groups",
    "unpack_int4_groups",
    "mixed_weights",
    "mixed_act_quant",
    "mixed_act_quant_triton",
    "mixed_act_quant_reference",
    "act_quant_chunks",
    "pick_mixed_config",
    "mixed_gemm",
    "mixed_gemm_triton",
    "mixed_gemm_reference",
    "check_mixed_gemm_args",
    "MixedQuantLinear",
    "mixed_from_fake",
]

ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Activation quantizer: pairs of a group held at once (larger groups take two passes) and
# pairs of one program's tile (several small groups at once).
MAX_BLOCK_GP = 2048
TILE_PAIRS = 4096
MAX_BLOCK_H = 4096
# Small calls deal a token's low groups over programs of their own, up to this many programs an SM: one program a
# token left a decode call a few programs (Atom's [4, 4096] q/k/v input took 5.9 us and its [4, 14336] down_proj
# input 11.2 us on the H100, 30 us of a 164 us layer).
ACT_QUANT_PROGRAMS_PER_SM = 2
# Mixed GEMMs of at most this many tokens take the decode tiles of pick_mixed_config
DECODE_MAX_M = 32
# Weight recovery from a dequantized weight: a candidate grid must put every value within
# this many steps of an integer (true grids: ~1e-5; a wrong rational grid: >= 1/128)...
RECOVER_STEP_TOL = 1e-3
# ... and reproduce it within this fraction of the row's absmax (fp32 products: ~1e-7).
RECOVER_REL_TOL = 1e-6


# --------------------------------------------------------------------------------------
# Format
# --------------------------------------------------------------------------------------


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class MixedFormat:
    """How a mixed layer's input channels are split and quantized.

    Attributes:
        k_lo: low-precision channels (first in ``perm``), ``>= 0``.
        k_hi: high-precision channels (last in ``perm``), ``>= 0``; ``k_lo + k_hi >= 1``.
        group_size: low group along the low channels' order, or ``None`` for one group
            (per token); a value above ``k_lo`` is one group too.
        lo_bits: 2..4. hi_bits: 2..8.
        lo_symmetric / hi_symmetric: symmetric grids, or asymmetric with a zero point.
        lo_clip / hi_clip: fraction of each range kept, in (0, 1].

    Raises:
        UserInputError: a value out of range, naming it and what is allowed.
    """

    k_lo: int
    k_hi: int
    group_size: int | None = None
    lo_bits: int = 4
    hi_bits: int = 8
    lo_symmetric: bool = True
    hi_symmetric: bool = True
    lo_clip: float = 1.0
    hi_clip: float = 1.0

    def __post_init__(self):
        for name in ("k_lo", "k_hi"):
            v = getattr(self, name)
            if not _is_int(v) or v < 0:
                raise UserInputError(f"MixedFormat.{name}={v!r} must be an integer >= 0")
        if self.k_lo + self.k_hi < 1:
            raise UserInputError("MixedFormat needs at least one channel (k_lo + k_hi >= 1)")
        if self.group_size is not None and (not _is_int(self.group_size) or self.group_size < 1):
            raise UserInputError(f"MixedFormat.group_size={self.group_size!r} must be None or a positive integer")
        if not _is_int(self.lo_bits) or not 2 <= self.lo_bits <= 4:
            raise UserInputError(f"MixedFormat.lo_bits={self.lo_bits!r} is out of range: allowed 2..4 (packed nibbles)")
        if not _is_int(self.hi_bits) or not 2 <= self.hi_bits <= 8:
            raise UserInputError(f"MixedFormat.hi_bits={self.hi_bits!r} is out of range: allowed 2..8 (int8)")
        for name in ("lo_clip", "hi_clip"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < float(v) <= 1.0:
                raise UserInputError(f"MixedFormat.{name}={v!r} is out of range: allowed (0, 1]")

    @property
    def k(self) -> int:
        """Input channels ``K = k_lo + k_hi``."""
        return self.k_lo + self.k_hi

    @property
    def group(self) -> int:
        """Effective low group length (``group_size`` capped at ``k_lo``; ``k_lo`` for ``None``)."""
        if self.k_lo == 0:
            return 1
        return self.k_lo if self.group_size is None else min(self.group_size, self.k_lo)

    @property
    def n_groups(self) -> int:
        """Low groups per row (the last may be shorter than :attr:`group`)."""
        return -(-self.k_lo // self.group) if self.k_lo else 0

    @property
    def group_bytes(self) -> int:
        """Bytes a low group occupies in a packed row, ``ceil(group / 2)``."""
        return (self.group + 1) // 2

    @property
    def lo_bytes(self) -> int:
        """Bytes of a packed low row, ``n_groups * group_bytes``."""
        return self.n_groups * self.group_bytes


def _grid(bits: int, symmetric: bool) -> tuple[int, int, int, int]:
    """``(divisor, qmin, qmax, offset)``: scale = range / divisor, q in [qmin, qmax], stored q - offset."""
    if symmetric:
        half = 2 ** (bits - 1)
        return half - 1, -half, half - 1, 0
    return 2**bits - 1, 0, 2**bits - 1, 2 ** (bits - 1)


class MixedActs(NamedTuple):
    """Quantized activations of ``M`` tokens (see the module docstring for the layout).

    Attributes:
        q_lo: ``uint8 [M, fmt.lo_bytes]`` group-padded packed low part.
        s_lo: ``float32 [M, fmt.n_groups]``.
        z_lo: ``int32 [M, fmt.n_groups]`` (shifted zero points) or ``None`` (symmetric).
        q_hi: ``int8 [M, fmt.k_hi]``.
        s_hi: ``float32 [M]``.
        z_hi: ``int32 [M]`` or ``None`` (symmetric).
    """

    q_lo: torch.Tensor
    s_lo: torch.Tensor
    z_lo: torch.Tensor | None
    q_hi: torch.Tensor
    s_hi: torch.Tensor
    z_hi: torch.Tensor | None


class MixedWeights(NamedTuple):
    """Symmetric integer weights of ``N`` output channels in a :class:`MixedFormat`'s layout.

    Attributes:
        q_lo: ``uint8 [N, fmt.lo_bytes]`` group-padded packed signed 4-bit values.
        s_lo: ``float16`` or ``float32 [N, fmt.n_groups]``.
        sum_lo: ``int32 [N, fmt.n_groups]``: per group, the sum of the row's integers.
        q_hi: ``int8 [N, fmt.k_hi]``.
        s_hi: ``float32 [N]``.
        sum_hi: ``int32 [N]``.
    """

    q_lo: torch.Tensor
    s_lo: torch.Tensor
    sum_lo: torch.Tensor
    q_hi: torch.Tensor
    s_hi: torch.Tensor
    sum_hi: torch.Tensor


def _check_fmt(fmt) -> None:
    if not isinstance(fmt, MixedFormat):
        raise UserInputError(f"fmt must be a MixedFormat, got {type(fmt).__name__}")


def pack_int4_groups(q: torch.Tensor, fmt: MixedFormat) -> torch.Tensor:
    """Pack the low part ``int [R, k_lo]`` (values in [-8, 7]) group-padded: ``uint8 [R, lo_bytes]``.

    Raises:
        UserInputError: wrong shape. ValueError: values outside [-8, 7].
    """
    _check_fmt(fmt)
    if q.dim() != 2 or q.shape[1] != fmt.k_lo:
        raise UserInputError(f"q must have shape [*, {fmt.k_lo}], got {list(q.shape)}")
    r, g, ng = q.shape[0], fmt.group, fmt.n_groups
    if ng == 0:
        return torch.zeros(r, 0, dtype=torch.uint8, device=q.device)
    qi = F.pad(q.to(torch.int16), (0, ng * g - fmt.k_lo)).reshape(r, ng, g)
    qi = F.pad(qi, (0, 2 * fmt.group_bytes - g)).reshape(r, ng * 2 * fmt.group_bytes)
    return pack_int4(qi)


def unpack_int4_groups(packed: torch.Tensor, fmt: MixedFormat) -> torch.Tensor:
    """Inverse of :func:`pack_int4_groups`: ``uint8 [R, lo_bytes]`` → ``int8 [R, k_lo]``."""
    _check_fmt(fmt)
    r, g, ng = packed.shape[0], fmt.group, fmt.n_groups
    if ng == 0:
        return torch.zeros(r, 0, dtype=torch.int8, device=packed.device)
    q = unpack_int4(packed, fmt.lo_bytes * 2).reshape(r, ng, 2 * fmt.group_bytes)[:, :, :g]
    return q.reshape(r, ng * g)[:, :fmt.k_lo].contiguous()


def _group_sums(q: torch.Tensor, fmt: MixedFormat) -> torch.Tensor:
    r, g, ng = q.shape[0], fmt.group, fmt.n_groups
    if ng == 0:
        return torch.zeros(r, 0, dtype=torch.int32, device=q.device)
    qi = F.pad(q.to(torch.int32), (0, ng * g - fmt.k_lo)).reshape(r, ng, g)
    return qi.sum(dim=-1, dtype=torch.int32)


def mixed_weights(
    q_lo: torch.Tensor,
    s_lo: torch.Tensor,
    q_hi: torch.Tensor,
    s_hi: torch.Tensor,
    fmt: MixedFormat,
) -> MixedWeights:
    """Build :class:`MixedWeights` from unpacked symmetric integers and their scales.

    Args:
        q_lo: ``[N, k_lo]`` integers in [-8, 7], columns in the low channels' (group) order.
        s_lo: ``[N, n_groups]`` (fp16 kept as fp16, else stored fp32).
        q_hi: ``[N, k_hi]`` integers in [-128, 127], columns in the high channels' order.
        s_hi: ``[N]`` scales.
        fmt: the layer's :class:`MixedFormat`.

    Returns:
        :class:`MixedWeights` (contiguous, on ``q_lo``'s device).

    Raises:
        UserInputError: shapes that do not match ``fmt``, or integers out of range.
    """
    _check_fmt(fmt)
    n = q_lo.shape[0] if q_lo.dim() == 2 else -1
    for name, t, shape in (("q_lo", q_lo, (n, fmt.k_lo)), ("s_lo", s_lo, (n, fmt.n_groups)),
                           ("q_hi", q_hi, (n, fmt.k_hi)), ("s_hi", s_hi, (n,))):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or n < 0:
            raise UserInputError(f"{name} must have shape {list(shape)}, got "
                                 f"{list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    for name, t, lo, hi in (("q_lo", q_lo, -8, 7), ("q_hi", q_hi, -128, 127)):
        if t.numel() and (int(t.min()) < lo or int(t.max()) > hi):
            raise UserInputError(f"{name} holds values in [{int(t.min())}, {int(t.max())}]; allowed [{lo}, {hi}]")
    scale_lo = s_lo if s_lo.dtype == torch.float16 else s_lo.to(torch.float32)
    return MixedWeights(
        q_lo=pack_int4_groups(q_lo, fmt).contiguous(),
        s_lo=scale_lo.contiguous(),
        sum_lo=_group_sums(q_lo, fmt).contiguous(),
        q_hi=q_hi.to(torch.int8).contiguous(),
        s_hi=s_hi.to(torch.float32).contiguous(),
        sum_hi=q_hi.to(torch.int32).sum(dim=-1, dtype=torch.int32).contiguous(),
    )


def _arg(t: torch.Tensor | None, stand_in: torch.Tensor) -> torch.Tensor:
    """``t``, or a non-empty stand-in for a pointer the kernel does not dereference (None/empty)."""
    return stand_in if t is None or t.numel() == 0 else t


# --------------------------------------------------------------------------------------
# Activation quantizer
# --------------------------------------------------------------------------------------


@triton.jit
def _load_channels(x_row, perm_ptr, pos, ok, GATHER: tl.constexpr):
    """fp32 values of the channels at positions ``pos`` of ``perm`` (0 where not ``ok``)."""
    if GATHER:
        ch = tl.load(perm_ptr + pos, mask=ok, other=0)
    else:
        ch = pos
    return tl.load(x_row + ch, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _grid_params(mn, mx, clip, DIV: tl.constexpr, ASYM: tl.constexpr):
    """Scale and zero point from a group's ``min(x, 0)`` and ``max(x, 0)`` (as ``quantize``; NaN scale and zero
    for a group holding NaN or Inf)."""
    if ASYM:
        lo = mn * clip
        scale = asym_scale(lo, mx * clip, DIV)
        zero = round_half_even(tl.math.div_rn(-lo, scale))
    else:
        scale = sym_scale(maximum_nan(-mn, mx), clip, DIV)
        zero = scale * 0.0
    return scale, zero


@triton.jit
def _quantize(x, scale, zero, QMIN: tl.constexpr, QMAX: tl.constexpr, OFFSET: tl.constexpr, VCLAMP: tl.constexpr):
    """``clamp(round(x / scale) + zero, QMIN, QMAX) - OFFSET`` as fp32 integers.

    Clamping ``x / scale`` to ``±VCLAMP`` (one past the grid's width) first changes no result
    and keeps the magic-number rounding in its exact range for any clip ratio.
    """
    v = tl.minimum(tl.maximum(quant_div(x, scale), -VCLAMP), VCLAMP)
    q = tl.minimum(tl.maximum(round_half_even(v) + zero, QMIN), QMAX)
    return q - OFFSET


@triton.jit
def _mixed_act_quant_kernel(
    x_ptr, perm_ptr, qlo_ptr, slo_ptr, zlo_ptr, qhi_ptr, shi_ptr, zhi_ptr,
    K_LO, K_HI, N_GROUPS, stride_xm, stride_qlo, stride_slo, stride_qhi, lo_clip, hi_clip,
    GROUP: tl.constexpr, GP: tl.constexpr, GATHER: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
    LO_DIV: tl.constexpr, LO_QMIN: tl.constexpr, LO_QMAX: tl.constexpr, LO_OFFSET: tl.constexpr,
    LO_VCLAMP: tl.constexpr, LO_ASYM: tl.constexpr,
    HI_DIV: tl.constexpr, HI_QMIN: tl.constexpr, HI_QMAX: tl.constexpr, HI_OFFSET: tl.constexpr,
    HI_VCLAMP: tl.constexpr, HI_ASYM: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_GP: tl.constexpr, LO_ONE_PASS: tl.constexpr,
    BLOCK_H: tl.constexpr, HI_ONE_PASS: tl.constexpr, LO_CHUNKS: tl.constexpr,
):
    # programs (token, c): c < LO_CHUNKS quantize the low groups g0 = c * BLOCK_G, (c + LO_CHUNKS) * BLOCK_G, ...;
    # c == LO_CHUNKS the high part
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    x_row = x_ptr + row * stride_xm

    if HAS_LO:
        if chunk < LO_CHUNKS:
            # [groups, pairs, 2] tiles: several small groups per step, or one chunk of a large group.
            g3 = tl.arange(0, BLOCK_G)[:, None, None]
            p3 = tl.arange(0, BLOCK_GP)[None, :, None]
            lane = tl.arange(0, 2)[None, None, :]
            g1 = tl.arange(0, BLOCK_G)
            g2 = g1[:, None]
            p2 = tl.arange(0, BLOCK_GP)[None, :]
            slo_row = slo_ptr + row * stride_slo
            zlo_row = zlo_ptr + row * stride_slo
            qlo_row = qlo_ptr + row * stride_qlo
            for g0 in range(chunk * BLOCK_G, N_GROUPS, LO_CHUNKS * BLOCK_G):
                grp = g0 + g3
                if LO_ONE_PASS:
                    j = p3 * 2 + lane
                    pos = grp * GROUP + j
                    ok = (grp < N_GROUPS) & (j < GROUP) & (pos < K_LO)
                    x_all = _load_channels(x_row, perm_ptr, pos, ok, GATHER)
                    mn = min_nan(min_nan(x_all, 2), 1)
                    mx = max_nan(max_nan(x_all, 2), 1)
                else:
                    run_mn = tl.zeros([BLOCK_G, BLOCK_GP], dtype=tl.float32)
                    run_mx = tl.zeros([BLOCK_G, BLOCK_GP], dtype=tl.float32)
                    for p0 in range(0, GP, BLOCK_GP):
                        j = (p0 + p3) * 2 + lane
                        pos = grp * GROUP + j
                        ok = (grp < N_GROUPS) & (j < GROUP) & (pos < K_LO)
                        x = _load_channels(x_row, perm_ptr, pos, ok, GATHER)
                        run_mn = minimum_nan(run_mn, min_nan(x, 2))
                        run_mx = maximum_nan(run_mx, max_nan(x, 2))
                    mn = min_nan(run_mn, 1)
                    mx = max_nan(run_mx, 1)
                # masked lanes read 0, so mn <= 0 <= mx: the ranges of quantize (zero-padded groups)
                scale, zero = _grid_params(mn, mx, lo_clip, LO_DIV, LO_ASYM)
                tl.store(slo_row + g0 + g1, scale, mask=g0 + g1 < N_GROUPS)
                if LO_ASYM:
                    tl.store(zlo_row + g0 + g1, (zero - LO_OFFSET).to(tl.int32), mask=g0 + g1 < N_GROUPS)
                for p0 in range(0, GP, BLOCK_GP):
                    j = (p0 + p3) * 2 + lane
                    pos = grp * GROUP + j
                    ok = (grp < N_GROUPS) & (j < GROUP) & (pos < K_LO)
                    if LO_ONE_PASS:
                        x = x_all
                    else:
                        x = _load_channels(x_row, perm_ptr, pos, ok, GATHER)
                    q = _quantize(x, scale[:, None, None], zero[:, None, None], LO_QMIN, LO_QMAX, LO_OFFSET, LO_VCLAMP)
                    q = tl.where(ok, q, 0.0).to(tl.int8)  # padding nibbles stay 0
                    q_even, q_odd = tl.split(q)
                    packed = (q_even & 0xF) | (q_odd << 4)
                    byte = p0 + p2
                    tl.store(qlo_row + (g0 + g2) * GP + byte, packed, mask=(g0 + g2 < N_GROUPS) & (byte < GP))

    if HAS_HI:
        if chunk == LO_CHUNKS:
            offs = tl.arange(0, BLOCK_H)
            if HI_ONE_PASS:
                ok = offs < K_HI
                xh_all = _load_channels(x_row, perm_ptr, K_LO + offs, ok, GATHER)
                mn_h = min_nan(xh_all, 0)
                mx_h = max_nan(xh_all, 0)
            else:
                run_mn_h = tl.zeros([BLOCK_H], dtype=tl.float32)
                run_mx_h = tl.zeros([BLOCK_H], dtype=tl.float32)
                for k0 in range(0, K_HI, BLOCK_H):
                    k = k0 + offs
                    xh = _load_channels(x_row, perm_ptr, K_LO + k, k < K_HI, GATHER)
                    run_mn_h = minimum_nan(run_mn_h, xh)
                    run_mx_h = maximum_nan(run_mx_h, xh)
                mn_h = min_nan(run_mn_h, 0)
                mx_h = max_nan(run_mx_h, 0)
            scale_h, zero_h = _grid_params(mn_h, mx_h, hi_clip, HI_DIV, HI_ASYM)
            tl.store(shi_ptr + row, scale_h)
            if HI_ASYM:
                tl.store(zhi_ptr + row, (zero_h - HI_OFFSET).to(tl.int32))
            qhi_row = qhi_ptr + row * stride_qhi
            for k0 in range(0, K_HI, BLOCK_H):
                k = k0 + offs
                if HI_ONE_PASS:
                    xh = xh_all
                else:
                    xh = _load_channels(x_row, perm_ptr, K_LO + k, k < K_HI, GATHER)
                qh = _quantize(xh, scale_h, zero_h, HI_QMIN, HI_QMAX, HI_OFFSET, HI_VCLAMP)
                tl.store(qhi_row + k, qh.to(tl.int8), mask=k < K_HI)


def _check_act_inputs(x: torch.Tensor, fmt: MixedFormat, perm: torch.Tensor | None) -> None:
    _check_fmt(fmt)
    check_tensor("x", x, dtypes=ACT_DTYPES, dim=2, shape=(None, fmt.k))
    if perm is not None:
        check_tensor("perm", perm, dtypes=(torch.int32, torch.int64), shape=(fmt.k,))
        check_same_device(x=x, perm=perm)


def _empty_acts(m: int, fmt: MixedFormat, device) -> MixedActs:
    def f32(*shape):
        return torch.empty(*shape, dtype=torch.float32, device=device)

    def i32(*shape):
        return torch.empty(*shape, dtype=torch.int32, device=device)

    return MixedActs(
        q_lo=torch.empty(m, fmt.lo_bytes, dtype=torch.uint8, device=device),
        s_lo=f32(m, fmt.n_groups),
        z_lo=None if fmt.lo_symmetric else i32(m, fmt.n_groups),
        q_hi=torch.empty(m, fmt.k_hi, dtype=torch.int8, device=device),
        s_hi=f32(m),
        z_hi=None if fmt.hi_symmetric else i32(m),
    )


def _fill_unused(acts: MixedActs, fmt: MixedFormat) -> MixedActs:
    """A layer without high channels still gets defined per-token scale 1 and zero point 0."""
    if fmt.k_hi == 0:
        acts.s_hi.fill_(1.0)
        if acts.z_hi is not None:
            acts.z_hi.zero_()
    return acts


def _check_acts(acts, fmt: MixedFormat, m: int | None, name: str = "acts") -> int:
    """Check a :class:`MixedActs` against ``fmt``; returns ``M``."""
    if not isinstance(acts, MixedActs):
        raise UserInputError(f"{name} must be a MixedActs, got {type(acts).__name__}")
    check_tensor(f"{name}.q_lo", acts.q_lo, dtypes=(torch.uint8,), dim=2)
    m = acts.q_lo.shape[0] if m is None else m
    check_tensor(f"{name}.q_lo", acts.q_lo, dtypes=(torch.uint8,), shape=(m, fmt.lo_bytes))
    check_tensor(f"{name}.s_lo", acts.s_lo, dtypes=(torch.float32,), shape=(m, fmt.n_groups))
    check_tensor(f"{name}.q_hi", acts.q_hi, dtypes=(torch.int8,), shape=(m, fmt.k_hi))
    check_tensor(f"{name}.s_hi", acts.s_hi, dtypes=(torch.float32,), shape=(m,))
    for zname, z, sym, shape in (("z_lo", acts.z_lo, fmt.lo_symmetric, (m, fmt.n_groups)),
                                 ("z_hi", acts.z_hi, fmt.hi_symmetric, (m,))):
        if sym and z is not None:
            raise UserInputError(f"{name}.{zname} must be None: the format's grid is symmetric")
        if not sym:
            if z is None:
                raise UserInputError(f"{name}.{zname} is None but the format's grid is asymmetric (zero points needed)")
            check_tensor(f"{name}.{zname}", z, dtypes=(torch.int32,), shape=shape)
    for field in ("s_lo", "z_lo"):
        t = getattr(acts, field)
        if t is not None and not t.is_contiguous():
            raise UserInputError(f"{name}.{field} must be contiguous")
    check_same_device(**{f: t for f, t in acts._asdict().items()})
    return m


def mixed_act_quant_triton(
    x: torch.Tensor,
    fmt: MixedFormat,
    perm: torch.Tensor | None = None,
    out: MixedActs | None = None,
    *,
    chunks: int | None = None,
) -> MixedActs:
    """Launch the Triton mixed activation quantizer (programs per token: its low groups' chunks and its high part).

    Args:
        x: ``[M, K]`` BF16/FP16/FP32 activations, unit stride along K.
        fmt: the layer's :class:`MixedFormat`.
        perm: ``int32``/``int64 [K]`` channel order (low channels in group order, then the
            high channels), or ``None`` for the identity. Must be a permutation of
            ``0..K-1``; the launcher checks its shape and dtype only (no device sync), the
            reference, :func:`mixed_act_quant` and :class:`MixedQuantLinear` (once, at
            construction) check its values.
        out: optional preallocated :class:`MixedActs` (contiguous scales).
        chunks: programs a token's low groups are dealt over, each taking every ``chunks``-th tile of groups
            (default :func:`act_quant_chunks`); the same bits for any value.

    Returns:
        :class:`MixedActs`.

    Raises:
        UserInputError: wrong dtype/shape/stride, a ``chunks`` below 1, or a device the Triton path cannot run on.
    """
    _check_act_inputs(x, fmt, perm)
    if chunks is not None and (not _is_int(chunks) or chunks < 1):
        raise UserInputError(f"chunks={chunks!r} must be an integer >= 1 "
                             "(programs a token's low groups are dealt over)")
    check_triton_device(x.device)
    m = x.shape[0]
    if out is None:
        out = _empty_acts(m, fmt, x.device)
    else:
        _check_acts(out, fmt, m, "out")
        check_same_device(x=x, out=out.q_lo)
    _fill_unused(out, fmt)
    if m == 0:
        return out
    perm32 = perm.to(torch.int32) if perm is not None else None
    lo_div, lo_qmin, lo_qmax, lo_off = _grid(fmt.lo_bits, fmt.lo_symmetric)
    hi_div, hi_qmin, hi_qmax, hi_off = _grid(fmt.hi_bits, fmt.hi_symmetric)
    gp = fmt.group_bytes
    block_gp = min(MAX_BLOCK_GP, triton.next_power_of_2(gp))
    lo_one_pass = gp <= block_gp
    block_g = min(triton.next_power_of_2(max(1, fmt.n_groups)), max(1, TILE_PAIRS // block_gp)) if lo_one_pass else 1
    if chunks is None:
        chunks = act_quant_chunks(m, fmt.n_groups, x.device)
    while block_g > 1 and -(-fmt.n_groups // block_g) < chunks:
        block_g //= 2
    lo_chunks = min(chunks, -(-fmt.n_groups // block_g)) if fmt.k_lo else 0
    block_h = min(MAX_BLOCK_H, triton.next_power_of_2(max(1, fmt.k_hi)))
    pairs = max(block_g * block_gp, block_h // 2)
    num_warps = 2 if pairs <= 256 else (4 if pairs <= 1024 else (8 if pairs <= 4096 else 16))
    _mixed_act_quant_kernel[(m, lo_chunks + (fmt.k_hi > 0))](
        x, _arg(perm32, x), _arg(out.q_lo.view(torch.int8), x), _arg(out.s_lo, x), _arg(out.z_lo, x),
        _arg(out.q_hi, x), out.s_hi, _arg(out.z_hi, x),
        fmt.k_lo, fmt.k_hi, fmt.n_groups, x.stride(0), out.q_lo.stride(0), max(1, fmt.n_groups),
        max(1, out.q_hi.stride(0)) if fmt.k_hi else 1, float(fmt.lo_clip), float(fmt.hi_clip),
        GROUP=fmt.group, GP=gp, GATHER=perm is not None, HAS_LO=fmt.k_lo > 0, HAS_HI=fmt.k_hi > 0,
        LO_DIV=float(lo_div), LO_QMIN=float(lo_qmin), LO_QMAX=float(lo_qmax), LO_OFFSET=float(lo_off),
        LO_VCLAMP=float(lo_qmax - lo_qmin + 1), LO_ASYM=not fmt.lo_symmetric,
        HI_DIV=float(hi_div), HI_QMIN=float(hi_qmin), HI_QMAX=float(hi_qmax), HI_OFFSET=float(hi_off),
        HI_VCLAMP=float(hi_qmax - hi_qmin + 1), HI_ASYM=not fmt.hi_symmetric,
        BLOCK_G=block_g, BLOCK_GP=block_gp, LO_ONE_PASS=lo_one_pass,
        BLOCK_H=block_h, HI_ONE_PASS=fmt.k_hi <= block_h, LO_CHUNKS=lo_chunks, num_warps=num_warps,
        # no FMA contraction: `hi - lo` of clipped ranges must round as quantize's separate ops
        enable_fp_fusion=False,
    )
    return out


def act_quant_chunks(m: int, n_groups: int, device: torch.device) -> int:
    """Programs a token's low groups are dealt over by default: on CUDA enough for
    :data:`ACT_QUANT_PROGRAMS_PER_SM` programs an SM over the call's ``m`` tokens (at most one a group), on the CPU
    one (Triton's interpreter pays per program)."""
    sms = sm_count(device)
    if sms is None or n_groups <= 1:
        return 1
    return max(1, min(n_groups, -(-ACT_QUANT_PROGRAMS_PER_SM * sms // max(1, m))))


def _check_perm_values(perm: torch.Tensor, k: int) -> None:
    if not torch.equal(perm.to(torch.int64).sort().values.cpu(), torch.arange(k)):
        raise UserInputError(f"perm must be a permutation of 0..{k - 1} (each channel exactly once)")


def mixed_act_quant_reference(
    x: torch.Tensor, fmt: MixedFormat, perm: torch.Tensor | None = None
) -> MixedActs:
    """PyTorch reference of the mixed activation quantizer (the shared ``quantize`` per part).

    Args:
        x: ``[M, K]`` float activations.
        fmt: :class:`MixedFormat`.
        perm: channel order or ``None`` (identity); checked to be a permutation.

    Returns:
        :class:`MixedActs`, bit-identical to :func:`mixed_act_quant_triton`'s.

    Raises:
        UserInputError: bad shape/dtype/permutation. ValueError: NaN/Inf in ``x``.
    """
    _check_act_inputs(x, fmt, perm)
    m = x.shape[0]
    if perm is not None:
        _check_perm_values(perm, fmt.k)
        x = x[:, perm.to(torch.int64)]
    out = _fill_unused(_empty_acts(m, fmt, x.device), fmt)
    q_lo, s_lo, z_lo = out.q_lo, out.s_lo, out.z_lo
    if fmt.n_groups:
        g, ng = fmt.group, fmt.n_groups
        _, _, _, off = _grid(fmt.lo_bits, fmt.lo_symmetric)
        lo = F.pad(x[:, :fmt.k_lo].to(torch.float32), (0, ng * g - fmt.k_lo))
        qt = quantize(lo, fmt.lo_bits, symmetric=fmt.lo_symmetric, group_size=g, clip_ratio=float(fmt.lo_clip))
        q = qt.q.to(torch.int16)[:, :fmt.k_lo] - off
        q_lo = pack_int4_groups(q, fmt)
        s_lo = qt.scale.reshape(m, ng)
        z_lo = None if qt.zero is None else (qt.zero.reshape(m, ng) - off).to(torch.int32)
    q_hi, s_hi, z_hi = out.q_hi, out.s_hi, out.z_hi
    if fmt.k_hi:
        _, _, _, off = _grid(fmt.hi_bits, fmt.hi_symmetric)
        qt = quantize(x[:, fmt.k_lo:], fmt.hi_bits, symmetric=fmt.hi_symmetric, clip_ratio=float(fmt.hi_clip))
        q_hi = (qt.q.to(torch.int16) - off).to(torch.int8)
        s_hi = qt.scale.reshape(m)
        z_hi = None if qt.zero is None else (qt.zero.reshape(m) - off).to(torch.int32)
    return MixedActs(q_lo.contiguous(), s_lo.contiguous(), z_lo, q_hi.contiguous(), s_hi.contiguous(), z_hi)


def mixed_act_quant(
    x: torch.Tensor, fmt: MixedFormat, perm: torch.Tensor | None = None, *, kernel: str | None = None
) -> MixedActs:
    """Quantize activations to a :class:`MixedFormat` (gathering the channels through ``perm``).

    Args:
        x: ``[M, K]`` activations (BF16, FP16 or FP32).
        fmt: :class:`MixedFormat`.
        perm: channel order (low channels in group order, then high) or ``None``; checked to
            be a permutation of ``0..K-1`` on either kernel. That reads it (a device
            synchronisation on CUDA): code that calls with one perm again and again checks it
            once and calls :func:`mixed_act_quant_triton`, as :class:`MixedQuantLinear` does.
        kernel: ``"auto"`` / ``"triton"`` / ``"torch"`` / ``None``.

    Returns:
        :class:`MixedActs`.

    Raises:
        UserInputError: bad input, a ``perm`` that is not a permutation, or a bad kernel preference.

    Example:
        >>> fmt = MixedFormat(k_lo=6, k_hi=2, group_size=4)
        >>> acts = mixed_act_quant(torch.randn(3, 8), fmt, kernel="torch")
        >>> acts.q_lo.shape, acts.s_lo.shape, acts.q_hi.shape
        (torch.Size([3, 4]), torch.Size([3, 2]), torch.Size([3, 2]))
    """
    if resolve_kernel(kernel, x.device if isinstance(x, torch.Tensor) else None) == "triton":
        if perm is not None:  # the launcher checks perm's shape and dtype only: a wrong entry reads past K
            _check_act_inputs(x, fmt, perm)
            _check_perm_values(perm, fmt.k)
        return mixed_act_quant_triton(x, fmt, perm)
    return mixed_act_quant_reference(x, fmt, perm)


# --------------------------------------------------------------------------------------
# GEMM
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MixedTileConfig:
    """Launch parameters of one mixed GEMM launch.

    Attributes:
        block_m / block_n: output tile (powers of two >= 16).
        block_kp: packed low-K bytes per step (``2 * block_kp`` K elements), a power of two
            >= 32 (int8 dot K).
        block_k8: 8-bit K per step, a power of two >= 32.
        num_warps, num_stages: Triton launch options.
        group_m: program-id swizzle (M tiles per group) for L2 reuse of weight tiles.
        split_k: programs sharing one output tile along K (fp32 partials summed in split
            order by the last to finish): the low groups are divided among them (or, for
            fewer groups than splits, each group's K steps), and the 8-bit K steps.
    """

    block_m: int
    block_n: int
    block_kp: int
    block_k8: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8
    split_k: int = 1
    groups_per_step: int = 1
    x16: bool = False

    def __post_init__(self):
        for name, low in (("block_m", 16), ("block_n", 16), ("block_kp", 32), ("block_k8", 32)):
            v = getattr(self, name)
            if not _is_int(v) or v < low or v & (v - 1):
                raise UserInputError(f"MixedTileConfig.{name}={v!r} must be a power of two >= {low} (tl.dot tiles)")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise UserInputError(f"MixedTileConfig.num_warps={self.num_warps!r} must be one of 1, 2, 4, 8, 16")
        for name in ("num_stages", "group_m", "split_k", "groups_per_step"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise UserInputError(f"MixedTileConfig.{name}={v!r} must be an integer >= 1")


def _clamp_pow2(v: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(1, v))))


def pick_mixed_config(m: int, n: int, fmt: MixedFormat, device: torch.device) -> MixedTileConfig:
    """Choose tiles for a mixed GEMM of ``m`` tokens and ``n`` output channels.

    ``block_kp`` follows the group (one step per Atom group of 128: 64 bytes). On the GPU calls of
    up to :data:`DECODE_MAX_M` tokens take the decode tiles measured on the H100 (Atom's format on the
    Llama-3-8B linears, M = 4 / 16 / 32: ``benchmarks/kernels/mixed_decode.py``); above that the
    table was measured on the H200 (CUDA graphs, Llama-3-8B shapes, Atom and ResQ formats):
    many short groups (a scale fold every step) prefer 64x128 tiles with 4 warps at every M
    above 64, long groups 128x128 with 8 warps above 256 rows; up to 256 rows K is split
    while the tiles would leave SMs idle (at most 8 ways up to 64 rows, 4 to 128, 2 to 256).
    On the CPU (Triton's interpreter) tiles are large, since its cost grows with the program
    count.
    """
    block_kp = _clamp_pow2(fmt.group_bytes, 32, 64)
    if device.type != "cuda":
        return MixedTileConfig(block_m=16 if m <= 16 else 64, block_n=64, block_kp=block_kp,
                               block_k8=_clamp_pow2(fmt.k_hi, 32, 256), num_warps=4, num_stages=1)
    short_groups = fmt.group_bytes <= block_kp
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if m <= DECODE_MAX_M:
        # measured on the H100 (benchmarks/results/atom_decode_h100): 16-row tiles, 3 stages, two groups a K
        # step, 16q unpacking; K split while tiles x split stay within 4 programs an SM
        block_n = (64 if m <= 16 else 128) if n >= 8192 else (32 if m <= 16 else 64)
        tiles = -(-m // 16) * -(-n // block_n)
        split = 1
        while split < 4 and tiles * (2 * split) <= 4 * sms and fmt.n_groups >= 8 * split:
            split *= 2
        return MixedTileConfig(16, block_n, block_kp, 64, num_warps=4, num_stages=3, split_k=split,
                               groups_per_step=2, x16=True)
    if m <= 64:
        cfg = MixedTileConfig(_clamp_pow2(m, 16, 64), 64, block_kp, 64, num_warps=4, num_stages=4)
    elif m <= 256 or short_groups:
        cfg = MixedTileConfig(64, 128, block_kp, 64, num_warps=4, num_stages=3)
    else:
        cfg = MixedTileConfig(128, 128, block_kp, 64, num_warps=8, num_stages=4)
    if m <= 256:
        tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
        steps = -(-fmt.group_bytes // block_kp)
        units = max(fmt.n_groups, steps if fmt.n_groups == 1 else 0)
        # measured: splitting pays while the tiles leave SMs idle, less so as M grows
        cap = 8 if m <= 64 else (4 if m <= 128 else 2)
        split = 1
        while tiles * 2 * split <= 2 * sms and units // (2 * split) >= 4 and split < cap:
            split *= 2
        cfg = replace(cfg, split_k=split)
    return cfg


@triton.jit
def _mixed_gemm_kernel(
    alo_ptr, alo_s_ptr, alo_z_ptr, wlo_ptr, wlo_s_ptr, wlo_sum_ptr,
    ahi_ptr, ahi_s_ptr, ahi_z_ptr, whi_ptr, whi_s_ptr, whi_sum_ptr,
    bias_ptr, out_ptr, part_ptr, lock_ptr,
    M, N, N_GROUPS, K_HI, stride_alo, stride_wlo, stride_ahi, stride_whi, stride_om,
    GP: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, LO_ASYM: tl.constexpr, HI_ASYM: tl.constexpr,
    HAS_BIAS: tl.constexpr, OUT_FP32: tl.constexpr, EVEN_KHI: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BKP: tl.constexpr, BK8: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_G: tl.constexpr, SPLIT_S: tl.constexpr, USE_ASM: tl.constexpr, GPS: tl.constexpr, X16: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    # out-of-range rows/channels read wrapped indices instead (safe_*, _tl.in_range; their results are never stored)
    pid_m, pid_n, offs_m, offs_n, safe_m, safe_n = tile_indices(pid, M, N, BM, BN, GROUP_M)

    y = tl.zeros([BM, BN], dtype=tl.float32)
    if HAS_LO:
        # split-K: SPLIT_G splits share the groups, SPLIT_S splits the K steps of each group
        pid_g = pid_k // SPLIT_S
        pid_s = pid_k % SPLIT_S
        g_per = tl.cdiv(N_GROUPS, SPLIT_G)
        g_begin = pid_g * g_per
        g_end = tl.minimum(g_begin + g_per, N_GROUPS)
        steps = (GP + BKP - 1) // BKP
        s_per = (steps + SPLIT_S - 1) // SPLIT_S
        rkp = tl.arange(0, BKP)
        a_base = alo_ptr + safe_m[:, None] * stride_alo + rkp[None, :]
        w_base = wlo_ptr + safe_n[None, :] * stride_wlo + rkp[:, None]
        # X16: the integers unpacked as 16 * q, acc holds 256 * the product (exact in int32 and in its fp32 value)
        for g0 in range(g_begin, g_end, GPS):
            # GPS groups a step (one BKP-byte step each, GP == BKP), their loads issued together
            for j in tl.static_range(GPS):
                g = g0 + j
                if GPS > 1:
                    live = g < g_end
                    g = tl.minimum(g, g_end - 1)  # a step past the range re-reads the last group, scaled by 0
                acc = tl.zeros([BM, BN], dtype=tl.int32)
                if GP == BKP:
                    acc = mac_int4(acc, tl.load(a_base + g * GP), tl.load(w_base + g * GP), True, USE_ASM, X16)
                elif GP < BKP:
                    a = tl.load(a_base + g * GP, mask=rkp[None, :] < GP, other=0)
                    w = tl.load(w_base + g * GP, mask=rkp[:, None] < GP, other=0)
                    acc = mac_int4(acc, a, w, True, USE_ASM, X16)
                else:
                    s_end = tl.minimum((pid_s + 1) * s_per, steps)
                    for kp0 in range(pid_s * s_per * BKP, s_end * BKP, BKP):
                        if GP % BKP == 0:
                            a = tl.load(a_base + g * GP + kp0)
                            w = tl.load(w_base + g * GP + kp0)
                        else:
                            a = tl.load(a_base + g * GP + kp0, mask=kp0 + rkp[None, :] < GP, other=0)
                            w = tl.load(w_base + g * GP + kp0, mask=kp0 + rkp[:, None] < GP, other=0)
                        acc = mac_int4(acc, a, w, True, USE_ASM, X16)
                if LO_ASYM:
                    z = tl.load(alo_z_ptr + safe_m * N_GROUPS + g)
                    if SPLIT_S > 1:
                        z = tl.where(pid_s == 0, z, 0)  # the group's zero-point term once
                    wsum = tl.load(wlo_sum_ptr + safe_n * N_GROUPS + g)
                    zterm = z[:, None] * wsum[None, :]
                    if X16:
                        zterm = zterm * 256
                    acc -= zterm
                sa = tl.load(alo_s_ptr + safe_m * N_GROUPS + g)
                sw = tl.load(wlo_s_ptr + safe_n * N_GROUPS + g).to(tl.float32)
                if GPS > 1:
                    sa = tl.where(live, sa, 0.0)
                prod = acc.to(tl.float32)
                if X16:
                    prod = prod * (1.0 / 256)
                y += prod * sa[:, None] * sw[None, :]

    if HAS_HI:
        # every split takes a share of the 8-bit K steps
        h_steps = tl.cdiv(K_HI, BK8)
        h_per = tl.cdiv(h_steps, SPLIT_G * SPLIT_S)
        h_begin = pid_k * h_per * BK8
        h_end = tl.minimum((pid_k + 1) * h_per, h_steps) * BK8
        rk = tl.arange(0, BK8)
        a_ptrs = ahi_ptr + safe_m[:, None] * stride_ahi + (h_begin + rk)[None, :]
        w_ptrs = whi_ptr + safe_n[None, :] * stride_whi + (h_begin + rk)[:, None]
        acc8 = tl.zeros([BM, BN], dtype=tl.int32)
        for k0 in range(h_begin, h_end, BK8):
            if EVEN_KHI:
                a8 = tl.load(a_ptrs)
                w8 = tl.load(w_ptrs)
            else:
                a8 = tl.load(a_ptrs, mask=k0 + rk[None, :] < K_HI, other=0)
                w8 = tl.load(w_ptrs, mask=k0 + rk[:, None] < K_HI, other=0)
            acc8 = tl.dot(a8, w8, acc8, out_dtype=tl.int32)
            a_ptrs += BK8
            w_ptrs += BK8
        if HI_ASYM:
            z8 = tl.load(ahi_z_ptr + safe_m)
            if SPLIT_G * SPLIT_S > 1:
                z8 = tl.where(pid_k == 0, z8, 0)
            wsum8 = tl.load(whi_sum_ptr + safe_n)
            acc8 -= z8[:, None] * wsum8[None, :]
        sa8 = tl.load(ahi_s_ptr + safe_m)
        sw8 = tl.load(whi_s_ptr + safe_n).to(tl.float32)
        y += acc8.to(tl.float32) * sa8[:, None] * sw8[None, :]

    store_output(
        out_ptr, part_ptr, lock_ptr, pid, pid_k, y, bias_ptr, offs_m, offs_n, M, N, stride_om,
        HAS_BIAS=HAS_BIAS, SPLIT_K=SPLIT_G * SPLIT_S, OUT_FP32=OUT_FP32,
    )


def check_mixed_gemm_args(
    acts: MixedActs, weights: MixedWeights, fmt: MixedFormat, bias: torch.Tensor | None
) -> tuple[int, int]:
    """Check the operands of a mixed GEMM and return ``(M, N)``.

    Raises:
        UserInputError: naming the wrong dtype, shape, stride, device or type.
    """
    _check_fmt(fmt)
    m = _check_acts(acts, fmt, None)
    if not isinstance(weights, MixedWeights):
        raise UserInputError(f"weights must be a MixedWeights, got {type(weights).__name__}")
    check_tensor("weights.q_lo", weights.q_lo, dtypes=(torch.uint8,), dim=2)
    n = weights.q_lo.shape[0]
    check_tensor("weights.q_lo", weights.q_lo, dtypes=(torch.uint8,), shape=(n, fmt.lo_bytes))
    check_tensor("weights.s_lo", weights.s_lo, dtypes=(torch.float16, torch.float32), shape=(n, fmt.n_groups))
    check_tensor("weights.sum_lo", weights.sum_lo, dtypes=(torch.int32,), shape=(n, fmt.n_groups))
    check_tensor("weights.q_hi", weights.q_hi, dtypes=(torch.int8,), shape=(n, fmt.k_hi))
    check_tensor("weights.s_hi", weights.s_hi, dtypes=(torch.float16, torch.float32), shape=(n,))
    check_tensor("weights.sum_hi", weights.sum_hi, dtypes=(torch.int32,), shape=(n,))
    for field in ("s_lo", "sum_lo"):
        if not getattr(weights, field).is_contiguous():
            raise UserInputError(f"weights.{field} must be contiguous")
    if bias is not None:
        check_tensor("bias", bias, dtypes=(torch.float32,), shape=(n,))
    check_same_device(acts=acts.q_lo, bias=bias, **{f: t for f, t in weights._asdict().items()})
    return m, n


def mixed_gemm_triton(
    acts: MixedActs,
    weights: MixedWeights,
    fmt: MixedFormat,
    bias: torch.Tensor | None = None,
    *,
    out_fp32: bool = False,
    config: MixedTileConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the mixed 4-bit + 8-bit Triton GEMM.

    Args:
        acts: from :func:`mixed_act_quant`.
        weights: :class:`MixedWeights` of the same ``fmt``.
        fmt: :class:`MixedFormat`.
        bias: optional ``float32 [N]``.
        out_fp32: write fp32 instead of BF16.
        config: tiles (default :func:`pick_mixed_config`).
        out: optional preallocated contiguous ``[M, N]`` output of the output dtype.

    Returns:
        ``[M, N]`` BF16 (or fp32).

    Raises:
        UserInputError: bad operands (see :func:`check_mixed_gemm_args`), config or device.
    """
    m, n = check_mixed_gemm_args(acts, weights, fmt, bias)
    device = acts.q_lo.device
    check_triton_device(device)
    if config is not None and not isinstance(config, MixedTileConfig):
        raise UserInputError(f"config must be a MixedTileConfig, got {type(config).__name__}")
    out = output_buffer(out, (m, n), torch.float32 if out_fp32 else torch.bfloat16, device)
    if m == 0 or n == 0:
        return out
    cfg = config or pick_mixed_config(m, n, fmt, device)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    split = cfg.split_k if tiles <= LOCK_SLOTS and cfg.split_k * m * n < 2**31 else 1
    # split the groups among the programs, or each group's K steps when there are few groups
    split_g, split_s = (split, 1) if fmt.n_groups >= split or fmt.group_bytes <= cfg.block_kp else (1, split)
    part = torch.empty(split, m, n, dtype=torch.float32, device=device) if split > 1 else out
    _mixed_gemm_kernel[(tiles, split)](
        _arg(acts.q_lo.view(torch.int8), out), _arg(acts.s_lo, out), _arg(acts.z_lo, out),
        _arg(weights.q_lo.view(torch.int8), out), _arg(weights.s_lo, out), _arg(weights.sum_lo, out),
        _arg(acts.q_hi, out), acts.s_hi, _arg(acts.z_hi, out), _arg(weights.q_hi, out), weights.s_hi,
        weights.sum_hi, _arg(bias, out), out, part, lock_buffer(device) if split > 1 else out,
        m, n, fmt.n_groups, fmt.k_hi, max(1, acts.q_lo.stride(0)), max(1, weights.q_lo.stride(0)),
        max(1, acts.q_hi.stride(0)), max(1, weights.q_hi.stride(0)), out.stride(0),
        GP=fmt.group_bytes, HAS_LO=fmt.n_groups > 0, HAS_HI=fmt.k_hi > 0,
        LO_ASYM=not fmt.lo_symmetric, HI_ASYM=not fmt.hi_symmetric, HAS_BIAS=bias is not None,
        OUT_FP32=out_fp32, EVEN_KHI=fmt.k_hi % cfg.block_k8 == 0,
        BM=cfg.block_m, BN=cfg.block_n, BKP=cfg.block_kp, BK8=cfg.block_k8, GROUP_M=cfg.group_m,
        SPLIT_G=split_g, SPLIT_S=split_s, USE_ASM=not triton_interpreting(),
        GPS=cfg.groups_per_step if fmt.group_bytes == cfg.block_kp else 1, X16=cfg.x16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def mixed_gemm_reference(
    acts: MixedActs,
    weights: MixedWeights,
    fmt: MixedFormat,
    bias: torch.Tensor | None = None,
    *,
    out_fp32: bool = False,
) -> torch.Tensor:
    """PyTorch reference of :func:`mixed_gemm_triton` (same arguments, same result up to rounding).

    Exact integer products per group (fp32 while exact, else fp64), zero-point corrections,
    fp32 scaling and accumulation over the groups, then the 8-bit part and the bias.
    """
    m, n = check_mixed_gemm_args(acts, weights, fmt, bias)
    y = torch.zeros(m, n, dtype=torch.float32, device=acts.q_lo.device)
    if fmt.n_groups:
        width = 2 * fmt.group_bytes
        a = unpack_int4(acts.q_lo, fmt.lo_bytes * 2).reshape(m, fmt.n_groups, width)
        w = unpack_int4(weights.q_lo, fmt.lo_bytes * 2).reshape(n, fmt.n_groups, width)
        # |acc| <= 64 per product, |zero * sum| <= 8 * 8 per element: 128 * width in all
        bound = 128 * width
        for g in range(fmt.n_groups):
            acc = int_matmul(a[:, g], w[:, g], bound)
            if acts.z_lo is not None:
                acc = acc - acts.z_lo[:, g, None].to(acc.dtype) * weights.sum_lo[None, :, g].to(acc.dtype)
            y += acc.to(torch.float32) * acts.s_lo[:, g, None] * weights.s_lo[None, :, g].to(torch.float32)
    if fmt.k_hi:
        bound = 2 * 128 * 128 * fmt.k_hi
        acc = int_matmul(acts.q_hi, weights.q_hi, bound)
        if acts.z_hi is not None:
            acc = acc - acts.z_hi[:, None].to(acc.dtype) * weights.sum_hi[None, :].to(acc.dtype)
        y += acc.to(torch.float32) * acts.s_hi[:, None] * weights.s_hi[None, :].to(torch.float32)
    if bias is not None:
        y = y + bias
    return y if out_fp32 else y.to(torch.bfloat16)


def mixed_gemm(
    acts: MixedActs,
    weights: MixedWeights,
    fmt: MixedFormat,
    bias: torch.Tensor | None = None,
    *,
    kernel: str | None = None,
    config: MixedTileConfig | None = None,
) -> torch.Tensor:
    """Mixed 4-bit (grouped) + 8-bit GEMM in BF16, on the chosen kernel.

    Args:
        acts: :class:`MixedActs` from :func:`mixed_act_quant`.
        weights: :class:`MixedWeights` from :func:`mixed_weights`.
        fmt: the shared :class:`MixedFormat`.
        bias: optional ``float32 [N]``.
        kernel: ``"auto"`` / ``"triton"`` / ``"torch"`` / ``None``.
        config: Triton tiles override.

    Returns:
        ``bfloat16 [M, N]``.

    Raises:
        UserInputError: bad operands or kernel preference.
    """
    device = acts.q_lo.device if isinstance(acts, MixedActs) and isinstance(acts.q_lo, torch.Tensor) else None
    if resolve_kernel(kernel, device) == "triton":
        return mixed_gemm_triton(acts, weights, fmt, bias, config=config)
    return mixed_gemm_reference(acts, weights, fmt, bias)


# --------------------------------------------------------------------------------------
# The layer
# --------------------------------------------------------------------------------------


class MixedQuantLinear(nn.Module):
    """A mixed-precision (Atom / ResQ) linear on the kernels.

    ``forward``: the online input transform (if any, e.g. ResQ's
    :class:`~mosaicquant.methods.basis.BasisTransform` or an ``OnlineHadamard``), then
    the activation quantizer (channels gathered through ``perm``, checked once, here), then :func:`mixed_gemm`;
    the kernel's BF16 output is returned in the input's dtype (as ``KernelLinear`` does).

    Args:
        fmt: :class:`MixedFormat`.
        weights: :class:`MixedWeights` (held as buffers, unchanged).
        perm: ``[K]`` channel order (low channels in group order, then high), or ``None``.
        bias: optional ``[N]`` (stored fp32).
        input_transform: optional module applied to the input first.
        kernel: ``"auto"`` / ``"triton"`` / ``"torch"``, or ``None`` (read at each call).

    Raises:
        UserInputError: operands that do not fit ``fmt``, a ``perm`` that is not a
            permutation, or a bad kernel preference.
    """

    def __init__(
        self,
        fmt: MixedFormat,
        weights: MixedWeights,
        perm: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        input_transform: nn.Module | None = None,
        kernel: str | None = None,
    ) -> None:
        super().__init__()
        _check_fmt(fmt)
        if not isinstance(weights, MixedWeights):
            raise UserInputError(f"weights must be a MixedWeights, got {type(weights).__name__}")
        n = weights.q_lo.shape[0]
        device = weights.q_lo.device
        if bias is not None:
            bias = bias.detach().to(device=device, dtype=torch.float32).reshape(-1).contiguous()
        probe = MixedActs(
            torch.empty(0, fmt.lo_bytes, dtype=torch.uint8, device=device),
            torch.empty(0, fmt.n_groups, device=device),
            None if fmt.lo_symmetric else torch.empty(0, fmt.n_groups, dtype=torch.int32, device=device),
            torch.empty(0, fmt.k_hi, dtype=torch.int8, device=device), torch.empty(0, device=device),
            None if fmt.hi_symmetric else torch.empty(0, dtype=torch.int32, device=device))
        check_mixed_gemm_args(probe, weights, fmt, bias)
        if perm is not None:
            check_tensor("perm", perm, dtypes=(torch.int32, torch.int64), shape=(fmt.k,))
            _check_perm_values(perm, fmt.k)
            perm = None if torch.equal(perm.cpu().to(torch.int64), torch.arange(fmt.k)) else perm
        if kernel is not None:
            resolve_kernel(kernel)
        self.fmt = fmt
        self.in_features = fmt.k
        self.out_features = n
        self.kernel = kernel
        self.input_transform = input_transform
        self.register_buffer("perm", None if perm is None else perm.to(device=device, dtype=torch.int32).contiguous())
        for field, value in weights._asdict().items():
            self.register_buffer(f"w_{field}", value)
        self.register_buffer("bias", bias)

    @property
    def weights(self) -> MixedWeights:
        """The integer weights and scales (views of this module's buffers)."""
        return MixedWeights(*(getattr(self, f"w_{f}") for f in MixedWeights._fields))

    @property
    def shape(self) -> tuple[int, int]:
        """``(out_features, in_features)``, as the weight's shape."""
        return self.out_features, self.in_features

    def weight_nbytes(self) -> dict[str, int]:
        """Bytes of the stored weight: integers (``base_values``) and scales (``base_scales``).

        The per-group integer sums (zero-point corrections, derivable) are not counted.
        """
        def size(*names):
            return sum(getattr(self, n).numel() * getattr(self, n).element_size() for n in names)
        return {"base_values": size("w_q_lo", "w_q_hi"), "base_scales": size("w_s_lo", "w_s_hi"),
                "residual_values": 0, "residual_scales": 0, "residual_indices": 0}

    def extra_repr(self) -> str:
        f = self.fmt
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"low={f.k_lo} ch @ {f.lo_bits} bits (group {f.group_size}, {'sym' if f.lo_symmetric else 'asym'}, "
                f"clip {f.lo_clip}), high={f.k_hi} ch @ {f.hi_bits} bits ({'sym' if f.hi_symmetric else 'asym'}, "
                f"clip {f.hi_clip}), gather={self.perm is not None}, kernel={self.kernel or 'env/auto'}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., K]`` float → ``[..., N]`` in ``x``'s dtype (BF16-rounded by the kernel).

        Raises:
            UserInputError: a 0-d input, or a last dimension that is not ``in_features``.
        """
        check_input_features(x, self.in_features)
        if self.input_transform is not None:
            x = self.input_transform(x)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).contiguous()
        backend = resolve_kernel(self.kernel, x2.device)
        # perm was checked at construction: the Triton launcher, unlike mixed_act_quant, does not read it again
        quant = mixed_act_quant_triton if backend == "triton" else mixed_act_quant_reference
        acts = quant(x2, self.fmt, self.perm)
        y = mixed_gemm(acts, self.weights, self.fmt, self.bias, kernel=backend)
        return y.reshape(*lead, self.out_features).to(x.dtype)


def _recover_rows(w: torch.Tensor, qmin: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Integers and one scale per row with ``q * s == w`` (to fp32 rounding), or ``None``.

    First candidate scale: the row's smallest nonzero magnitude (``|q| = 1`` is almost
    always present). Rows it does not fit try ``absmax / j`` for every possible largest
    magnitude ``j``. Any fitting grid computes the same products (e.g. ``2q`` at ``s/2``).
    """
    w = w.to(torch.float64)
    n = w.shape[0]
    absmax = w.abs().amax(dim=1) if w.shape[1] else torch.zeros(n, dtype=torch.float64, device=w.device)
    q = torch.zeros_like(w)
    s = torch.ones(n, dtype=torch.float64, device=w.device)
    todo = absmax > 0

    def fits(rows: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = w[rows] / scale[:, None]
        qr = torch.round(r)
        ok = ((r - qr).abs() <= RECOVER_STEP_TOL).all(dim=1)
        ok &= ((qr >= qmin) & (qr <= qmax)).all(dim=1)
        ok &= ((qr * scale[:, None] - w[rows]).abs() <= RECOVER_REL_TOL * absmax[rows, None]).all(dim=1)
        return ok, qr

    def take(rows: torch.Tensor, scale: torch.Tensor) -> None:
        if rows.numel() == 0:
            return
        ok, qr = fits(rows, scale)
        q[rows[ok]] = qr[ok]
        s[rows[ok]] = scale[ok]
        todo[rows[ok]] = False

    mag = torch.where(w != 0, w.abs(), torch.full_like(w, float("inf")))
    rows = torch.nonzero(todo).reshape(-1)
    take(rows, mag[rows].amin(dim=1))
    for j in range(1, max(-qmin, qmax) + 1):
        rows = torch.nonzero(todo).reshape(-1)
        if rows.numel() == 0:
            break
        take(rows, absmax[rows] / j)
    if bool(todo.any()):
        return None
    return q.to(torch.int8), s


def _recover_weights(
    weight: torch.Tensor, fmt: MixedFormat, perm: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | str:
    """``(q_lo, s_lo, q_hi, s_hi)`` from a dequantized weight, or the reason it has no such form."""
    w = weight.detach().to(torch.float64)[:, perm.to(weight.device)]
    n = w.shape[0]
    q_lo = torch.zeros(n, fmt.k_lo, dtype=torch.int8, device=w.device)
    s_lo = torch.ones(n, fmt.n_groups, dtype=torch.float64, device=w.device)
    for g in range(fmt.n_groups):
        lo, hi = g * fmt.group, min((g + 1) * fmt.group, fmt.k_lo)
        got = _recover_rows(w[:, lo:hi], -8, 7)
        if got is None:
            return (f"the weight of low group {g} (channels {lo}..{hi - 1} of the reordered layout) is not "
                    f"4-bit integers times one scale per row ({str(weight.dtype).replace('torch.', '')} weight)")
        q_lo[:, lo:hi], s_lo[:, g] = got
    q_hi = torch.zeros(n, fmt.k_hi, dtype=torch.int8, device=w.device)
    s_hi = torch.ones(n, dtype=torch.float64, device=w.device)
    if fmt.k_hi:
        got = _recover_rows(w[:, fmt.k_lo:], -128, 127)
        if got is None:
            return (f"the weight of the {fmt.k_hi} high-precision channels is not 8-bit integers times one "
                    f"scale per row ({str(weight.dtype).replace('torch.', '')} weight)")
        q_hi, s_hi = got
    # fp16 storage where it is exact (the 4-bit GPTQ scales are fp16 values)
    s16 = s_lo.to(torch.float16)
    s_lo = s16 if torch.equal(s16.to(torch.float64), s_lo) else s_lo.to(torch.float32)
    return q_lo, s_lo, q_hi, s_hi.to(torch.float32)


def _segment_weights(
    segments, fmt: MixedFormat, perm: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | str:
    """``(q_lo, s_lo, q_hi, s_hi)`` from the layer's ``weight_segments``, or the reason they do not fit."""
    by_columns = {}
    for item in segments:
        columns, qt = item
        if not isinstance(qt, Quantized) or qt.zero is not None or qt.scale.reshape(n, -1).shape[1] != 1:
            return "weight_segments holds a segment that is not symmetric with one scale per row"
        by_columns[tuple(sorted(torch.as_tensor(columns).reshape(-1).tolist()))] = (torch.as_tensor(columns).reshape(-1), qt)
    parts = [perm[g * fmt.group:min((g + 1) * fmt.group, fmt.k_lo)] for g in range(fmt.n_groups)]
    if fmt.k_hi:
        parts.append(perm[fmt.k_lo:])
    qs, ss = [], []
    for channels in parts:
        key = tuple(sorted(channels.tolist()))
        if key not in by_columns:
            return "the weight segments do not match the activation groups"
        columns, qt = by_columns[key]
        where = {c: i for i, c in enumerate(columns.tolist())}
        qs.append(qt.q[:, [where[c] for c in channels.tolist()]])
        ss.append(qt.scale.reshape(n))
    q = torch.cat(qs, dim=1) if qs else torch.zeros(n, 0, dtype=torch.int8)
    q_lo, q_hi = q[:, :fmt.k_lo], q[:, fmt.k_lo:]
    if q_lo.numel() and (int(q_lo.min()) < -8 or int(q_lo.max()) > 7):
        return "the low-precision weight segments are not 4-bit"
    s_lo = torch.stack(ss[:fmt.n_groups], dim=1) if fmt.n_groups else torch.ones(n, 0)
    s_hi = ss[-1] if fmt.k_hi else torch.ones(n)
    s16 = s_lo.to(torch.float16)
    s_lo = s16 if torch.equal(s16.to(torch.float32), s_lo.to(torch.float32)) else s_lo.to(torch.float32)
    return q_lo, s_lo, q_hi, s_hi.to(torch.float32)


def mixed_from_fake(layer: nn.Module, *, kernel: str | None = None) -> MixedQuantLinear | str:
    """Build the kernel-backed :class:`MixedQuantLinear` of a simulated Atom or ResQ layer.

    Takes a :class:`~mosaicquant.methods.qlinear.FakeQuantLinear` whose ``act`` is a
    :class:`~mosaicquant.methods.mixed.MixedActQuant` (low channels at 2..4 bits, per token
    or in groups; high channels per token at 2..8 bits) or a plain per-token
    :class:`~mosaicquant.methods.qlinear.ActQuantSpec` at 2..4 bits (ResQ's all-4-bit
    down_proj, asymmetric), symmetric or asymmetric each. The weight integers come from the
    layer's ``weight_segments`` when it carries them (``[(columns, Quantized), ...]`` as
    :func:`~mosaicquant.methods.mixed.gptq_quantize_segments` makes them), or from its dense
    packed 4-bit weight with per-row scales (``layer.packed``), else they are
    recovered from the dequantized weight, per row and activation group: exact for the
    float32 weights the simulation stores in an FP32 model; a weight rounded to BF16/FP16
    has no such form and is reported. The result computes the simulated layer's function
    up to float accumulation order and the final BF16 rounding.

    Args:
        layer: the simulated layer.
        kernel: kernel preference of the new layer.

    Returns:
        :class:`MixedQuantLinear` on the layer's device, or the reason (a string) when the
        layer's format is not one the mixed kernels run.
    """
    if not isinstance(layer, FakeQuantLinear):
        return f"not a simulated quantized linear ({type(layer).__name__})"
    n, k = layer.weight.shape
    act = layer.act
    if isinstance(act, MixedActQuant):
        low, high = act.low, act.high
        low_ch, high_ch = act.low_channels.to(torch.int64).cpu(), act.high_channels.to(torch.int64).cpu()
        if not (isinstance(low, ActQuantSpec) and isinstance(high, ActQuantSpec)):
            kinds = f"{type(low).__name__} / {type(high).__name__}"
            return f"channel quantizers {kinds}: the mixed kernels run one grid per channel (no multi-pass grids)"
    elif isinstance(act, ActQuantSpec):
        low, high = act, ActQuantSpec(bits=8)
        low_ch, high_ch = torch.arange(k), torch.zeros(0, dtype=torch.int64)
    else:
        return f"activation quantizer {type(act).__name__} is not one the mixed kernels run"
    if low_ch.numel() and not low.enabled:
        return "activations are not quantized (16-bit)"
    if low_ch.numel() and low.bits > 4:
        return f"low-precision activations are {low.bits}-bit: the mixed kernels pack 2..4 bits"
    if high_ch.numel() and not high.enabled:
        return "the high-precision channels are not quantized (16-bit)"
    try:
        fmt = MixedFormat(
            k_lo=int(low_ch.numel()), k_hi=int(high_ch.numel()), group_size=low.group_size,
            lo_bits=low.bits if low_ch.numel() else 4, hi_bits=high.bits,
            lo_symmetric=low.symmetric, hi_symmetric=high.symmetric,
            lo_clip=float(low.clip_ratio), hi_clip=float(high.clip_ratio),
        )
    except UserInputError as e:
        return f"format not supported: {e}"
    perm = torch.cat([low_ch, high_ch])
    segments = getattr(layer, "weight_segments", None)
    packed = getattr(layer, "packed", None)
    if packed is not None and packed.residual is not None and packed.residual.num_blocks:
        return "a sparse 4-bit residual (MosaicQuant's blocks): the mixed kernels walk no residual"
    if segments is None and packed is not None and packed.residual is None and packed.group_size in (None, k):
        # a dense packed 4-bit weight with one scale per row (e.g. SpinQuant's): its integers as one segment
        scale = packed.scales.to(torch.float32).reshape(n, 1)
        segments = [(torch.arange(k), Quantized(q=packed.int_weight(), scale=scale, zero=None, bits=4, group_size=None))]
    if segments is not None:
        got = _segment_weights(segments, fmt, perm, n)
    else:
        got = _recover_weights(layer.weight, fmt, perm)
    if isinstance(got, str):
        return got
    device = layer.weight.device
    q_lo, s_lo, q_hi, s_hi = (t.to(device) for t in got)
    weights = mixed_weights(q_lo, s_lo, q_hi, s_hi, fmt)
    return MixedQuantLinear(fmt, weights, perm.to(device), layer.bias, layer.input_transform, kernel=kernel)
