"""The non-linear ops of a decoder step as single kernels: RMSNorm, RoPE + KV write, attention, SiLU·mul.

A Llama/Qwen decoder layer in transformers' eager code runs some thirty small kernels
besides its linears (casts, ``pow``/``mean``/``rsqrt`` of each RMSNorm, the halves and
products of RoPE, the cache update, the softmax pieces, the activation). At decode sizes
each one is a few microseconds of fixed cost, so on an 8B model they take about as long as
the BF16 linears themselves and bound what any weight format can gain end to end. These
kernels do each group in one launch, for every method alike (the BF16 baseline included):

- :func:`rmsnorm`: ``s = x + residual`` (stored back into ``residual``) and
  ``w · bf16(s / rms(s))``, one program per token, the row held on chip;
  :func:`rmsnorm_quant` continues with the 4-bit activation quantizer
  (:mod:`mosaicquant.kernels.act_quant`'s operations and layouts) for a W4A4 GEMM that reads
  the norm's output directly, so the normalized row is never stored;
- :func:`rope_kv`: per token, the optional per-head q/k RMSNorm (Qwen3), rotary
  embedding of q and k from precomputed cos/sin tables, q written out, k and v written
  into the KV cache at the token's position;
- a 4-bit KV cache (:class:`KVFormat`, :class:`KVScales`): the RoPE kernels optionally rotate q and k
  by a Hadamard matrix (QuaRot's online Q/K rotation) and quantize each new key and value per head
  and token (:mod:`mosaicquant.methods.kvcache`'s grid, the same integers and scales), two channels
  a byte; the decode attention reads the integers straight into its dots;
- :func:`decode_attention`: attention of one new query per sequence over its cached keys,
  split along the cache (flash-decoding): every program takes one KV head of one
  sequence — its ``G`` query heads share the loaded keys (grouped-query attention) — and
  a chunk of the cache, keeps an online softmax, and writes fp32 partials that a second
  kernel combines; lengths are read on the device, so a captured CUDA graph replays at
  any position;
- :func:`silu_mul`: ``bf16(silu(g)) · u`` of the gate/up halves.

Each op rounds where transformers' eager code rounds (the residual sum, the normalized
row, every RoPE product, the activation), so the RMSNorm, RoPE and SiLU·mul outputs equal
the eager ones up to fp32 summation order and the last ulp of ``exp``/``rsqrt``; attention
agrees to bf16 accuracy (fp32 softmax, bf16 probabilities into the value product, as in
flash attention). :mod:`mosaicquant.harness.runtime` assembles them into a decoder.

Every op has a PyTorch reference here (``*_reference``), which the ``"torch"`` kernel
preference runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mosaicquant.errors import UserInputError
from mosaicquant.kernels._common import (
    check_same_device,
    check_tensor,
    chain_launch,
    chain_mode,
    check_triton_device,
    resolve_kernel,
    triton_interpreting,
)
from mosaicquant.kernels._tl import (
    asym_scale,
    chain_start,
    max_nan,
    maximum_nan,
    minimum_nan,
    quant_div,
    rnd,
    round_half_even,
    silu_mul_rounded,
    sym_scale,
)
from mosaicquant.kernels._tiles import persistent_zeros
from mosaicquant.kernels._tl import round_to_bf16 as _round_to_bf16
from mosaicquant.kernels.act_quant import (
    LAYOUTS,
    quantize_activations_reference,
    quantize_store,
    split8_from_int,
    split8_width,
)
from mosaicquant.kernels.tile_table import table_for
from mosaicquant.methods.format import unpack_int4
from mosaicquant.methods.hadamard import apply_hadamard
from mosaicquant.methods.quant import _apply, _params

__all__ = [
    "rmsnorm",
    "rmsnorm_reference",
    "rmsnorm_quant",
    "rmsnorm_quant_reference",
    "rope_kv",
    "rope_kv_reference",
    "decode_attention",
    "check_range_faults",
    "range_fault_word",
    "RANGE_FAULTS",
    "decode_attention_reference",
    "decode_rope_attention",
    "decode_rope_attention_reference",
    "attention_splits",
    "KVFormat",
    "KVScales",
    "kv4_quantize_reference",
    "kv4_dequantize_reference",
    "silu_mul",
    "silu_mul_reference",
]

_HALF = (torch.bfloat16, torch.float16)
# Keys a step of the attention kernels over a 16-bit cache. Measured (Llama-3-8B shapes, context 512, CUDA-graph
# step, 2 interleaved rounds, us at batch 16 / 32): BF16 5,005 / 5,362 at 64, 5,081 / 5,371 at 32, 5,002 / 5,547 at
# 128; MosaicQuant 3,172 / 3,829, 3,265 / 3,850, 3,170 / 3,984.
ATTN_BLOCK_N = 64
# The decode attention cuts the cache into chunks for about this many programs an SM, twice as many where
# fewer than ATTN_FEW_PAIRS (sequence, KV head) pairs share the GPU. Measured (Llama-3-8B shapes, context
# 512, CUDA-graph step, µs, 1 against 2 an SM): MosaicQuant 2,764 / 2,933 / 3,241 / 4,256 against 2,735 / 2,985 /
# 3,292 / 4,342 at batch 4 / 8 / 16 / 32 (8 KV heads: 32 pairs at batch 4).
ATTN_PROGRAMS_PER_SM = 1
ATTN_FEW_PAIRS = 64
# From this many pairs an SM the default cut is one chunk a head (the chunks' programs then write the output
# themselves: TileTable.attn_direct_one_chunk), rather than two chunks and their combine where pairs fall just short of the
# SMs (128 pairs on 132 SMs at batch 16). Measured (Llama-3-8B shapes, context 512, CUDA-graph step at batch
# 16, 3 interleaved rounds, µs): BF16 5,070 -> 5,024, QuaRot (16-bit KV) 2,898 -> 2,867, MosaicQuant 3,259 -> 3,233;
# one chunk at batch 4 / 8 (32 / 64 pairs) was 6-11 % slower for the W4A4 methods.
ATTN_ONE_CHUNK_PAIRS_PER_SM = 0.95
# Where the cache is one chunk (nsplit == 1: from ~132 sequence x KV-head pairs), decode_rope_attention's programs
# write the output themselves, as the combining kernel would, and that kernel is not launched.
# Over a 4-bit cache: programs an SM the cache is cut for (ATTN_PROGRAMS_PER_SM's role, not doubled for few pairs) and
# warps a program; the queries' Hadamard stays in butterflies (on the tensor cores, the ±1 matrix loaded, it was
# slower). Measured (Llama-3-8B shapes, context 512, QuaRot's CUDA-graph step at batch 4 / 16 / 32, µs): butterflies
# 2,676 / 3,060 / 3,915, the dot 2,897 / 3,205 / 4,051; 2 or 4 programs an SM 2,964 / 3,665 / 4,404 and 2,958 /
# 3,811 / 4,762 (with the register-built matrix, itself 2,960 / 3,267 / 4,000); 8 warps 3,144 / 3,556 / 4,545.
# Batch 4 / 8 / 16 with the doubling 2,688 / 2,791 / 3,077; 0.5 an SM (so 1 at batch 4) 2,494 / 2,794 / 3,330;
# 0.25 2,609 / 3,141 / 3,339. Re-checked with the current loop at batch 4 / 8 / 16 / 32: 1 an SM 2,485 / 2,637 / 2,915 /
# 3,609, 0.5 2,487 / 2,671 / 3,015 / 3,614, 0.2 2,712 / 2,817 / 3,023 / 3,598.
ATTN_KV4_PROGRAMS_PER_SM = 1.0
ATTN_KV4_WARPS = 4
# The 4-bit cache's loop (_attend_chunk_kv4): the integers into the dots biased by 128 (BF16 made by byte permutes on
# the GPU: ATTN_KV4_ASM); keys a step and software-pipeline stages (None: Triton's default). QuaRot's CUDA-graph step,
# Llama-3-8B shapes, context 512, batch 4 / 16 / 32: 2,517 / 3,104 / 3,944 µs unbiased at 64 keys,
# 2,503 / 3,006 / 3,761 biased, 2,502 / 2,925 / 3,609 biased at 128 keys and 2 stages (one run); 256 keys, 8 warps,
# 1 or 3 stages were slower.
ATTN_KV4_ASM = True
ATTN_KV4_STAGES = 2
# decode_rope_attention's new token: the program whose chunk holds it writes its key and value into the cache and,
# after a CTA barrier, its loop reads them back as one more cached key (TileTable.attn_new_cached), rather than adding them to
# the online softmax from registers after the loop. Over a 4-bit cache the new key's and value's quantizer reduces
# each row's (min, max) pairs in one reduction (KernelSettings.attn_kv4_minmax; the same bits) rather than four. Measured (
# benchmarks/kernels/attention_kv4.py, Llama-3-8B attention, µs a call at batch 4 / 16 / 32, context 575, registers form ->
# both): 4-bit cache 14.30 / 17.58 / 23.50 -> 9.80 / 15.36 / 20.56 (the min-max reduction alone 13.01 / 17.10 /
# 22.51), 16-bit cache 8.84 / 15.81 / 23.76 -> 8.56 / 15.03 / 23.19. Where the new key starts a loop step of its
# own (position a multiple of the step: 64 keys at 16 bits, 128 at 4 bits) that step costs one more iteration:
# at context 512 the 16-bit cache took 7.93 / 14.88 / 21.90 -> 8.06 / 15.23 / 22.67, the 4-bit one still gained.
# The new key's and value's quantizer takes each row's extremes as one max over the joined (max, -min) pairs of the
# halves (exact, the same bits as four reductions or a (min, max) pair reduction with its own combine function; 38 CTA
# barriers before the first product against the pairs' 44 in the offline sm_90 compile, and on the interpreter numpy's
# max). Measured against the pairs' reduction (benchmarks/kernels/attention_kv4.py, H100, Llama-3-8B attention, 4-bit
# cache, context 511 / 512, batch 4 / 16 / 32): 1 to 3 % faster at every point
# (benchmarks/results/zipper_h100_llama3/attn.log).
# The 4-bit cache's kernels compiled without fused multiply-adds (the grid's range as methods.quant rounds it); with
# them the step was the same within 0.3 %, and the GPU's scales differed from the reference's in the last bit.
KV4_NO_FP_FUSION = True
_LOG2E = 1.4426950408889634


def _tl_dtype(dtype: torch.dtype):
    return tl.bfloat16 if dtype == torch.bfloat16 else tl.float16


def _bits(dtype: torch.dtype) -> bool:
    # BF16 roundings by bit arithmetic: Triton's interpreter truncates fp32 -> bf16 conversions, and on
    # the H200 the compiled ``.to(bf16).to(fp32)`` pairs did not round every RoPE product (15% of the
    # outputs off by up to 2 ulps of the inputs); integer ops are kept as written everywhere
    return dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------- RMSNorm


@triton.jit
def add_residual(x, r_ptrs, mask, DT: tl.constexpr, BITS: tl.constexpr):
    """``x + residual`` rounded to ``DT`` (as the eager add rounds it), stored back as the new residual."""
    x = rnd(x + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32), DT, BITS)
    tl.store(r_ptrs, x.to(DT), mask=mask)
    return x


@triton.jit
def norm_quant_row(X, R, W, Q, S, n, kp, eps, clip_ratio, HB: tl.constexpr, HAS_RES: tl.constexpr,
                   DT: tl.constexpr, BITS: tl.constexpr, SPLIT8: tl.constexpr):
    """One row: ``r += x`` (with ``HAS_RES``), RMSNorm, then the activation quantizer (scale to ``S``, ints to ``Q``)."""
    pairs = tl.arange(0, HB)
    k = pairs[:, None] * 2 + tl.arange(0, 2)[None, :]
    mask = k < n
    x = tl.load(X + k, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x = add_residual(x, R + k, mask, DT, BITS)
    var = tl.sum(tl.sum(x * x, axis=1), axis=0) / n
    y = rnd(x * (1.0 / tl.sqrt(var + eps)), DT, BITS)
    w = tl.load(W + k, mask=mask, other=0.0).to(tl.float32)
    z = rnd(w * y, DT, BITS)  # the normalized row exactly as rmsnorm() stores it
    # then act_quant's quantizer on it (same operations, same integers)
    scale = sym_scale(max_nan(max_nan(tl.abs(z), 1), 0), clip_ratio, 7.0)
    tl.store(S, scale)
    quantize_store(z, scale, Q, pairs, kp, SPLIT8)


@triton.jit
def _rmsnorm_kernel(X, R, W, OUT, n, eps, stride_x, stride_r, stride_o,
                    BLOCK: tl.constexpr, HAS_RES: tl.constexpr, DT: tl.constexpr, BITS: tl.constexpr,
                    CHAIN: tl.constexpr):
    chain_start(CHAIN)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x = add_residual(x, R + row * stride_r + offs, mask, DT, BITS)
    var = tl.sum(x * x, axis=0) / n
    y = rnd(x * (1.0 / tl.sqrt(var + eps)), DT, BITS)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + offs, rnd(w * y, DT, BITS).to(DT), mask=mask)


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                      residual: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' RMSNorm (after ``residual += x`` when a residual is given, in place)."""
    if residual is not None:
        residual.copy_(residual + x)
        x = residual
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _check_norm_inputs(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> tuple[int, int]:
    check_tensor("x", x, dtypes=_HALF, dim=2)
    t, n = x.shape
    check_tensor("weight", weight, dtypes=(x.dtype,), shape=(n,))
    if residual is not None:
        check_tensor("residual", residual, dtypes=(x.dtype,), shape=(t, n))
    check_same_device(x=x, weight=weight, residual=residual)
    return t, n


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
            out: torch.Tensor | None = None, kernel: str | None = None) -> torch.Tensor:
    """RMSNorm of the rows of ``x`` (after ``residual += x``, in place, when ``residual`` is given).

    Args:
        x: ``[T, n]`` BF16/FP16 rows (unit stride along ``n``).
        weight: ``[n]`` norm weight, same dtype.
        eps: the norm's epsilon.
        residual: ``[T, n]`` running residual stream; it becomes ``residual + x`` and is normalized.
        out: optional ``[T, n]`` output buffer.
        kernel: kernel preference (see :mod:`mosaicquant.kernels._common`).

    Returns:
        ``[T, n]``: ``weight · bf16(s · rsqrt(mean(s²) + eps))`` with ``s = x`` (or the new residual).

    Raises:
        UserInputError: shapes, dtypes or strides the kernel cannot take.
    """
    t, n = _check_norm_inputs(x, weight, residual)
    if resolve_kernel(kernel, x.device) == "torch":
        y = rmsnorm_reference(x, weight, eps, residual)
        return y if out is None else out.copy_(y)
    check_triton_device(x.device)
    if not weight.is_contiguous():
        raise UserInputError("weight must be contiguous")
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    check_tensor("out", out, dtypes=(x.dtype,), shape=(t, n))
    check_same_device(x=x, out=out)
    if t:
        res = residual if residual is not None else x
        chain = chain_mode(x.device, t)
        _rmsnorm_kernel[(t,)](x, res, weight, out, n, float(eps), x.stride(0), res.stride(0), out.stride(0),
                              BLOCK=triton.next_power_of_2(n), HAS_RES=residual is not None,
                              DT=_tl_dtype(x.dtype), BITS=_bits(x.dtype), CHAIN=chain,
                              num_warps=4 if n <= 4096 else 8, **chain_launch(chain))
    return out


# ---------------------------------------------------------------------------------------------- RoPE + KV write


@triton.jit
def _rope_half(x1, x2, c, s, DT: tl.constexpr, BITS: tl.constexpr):
    # transformers: q·cos + rotate_half(q)·sin, each product rounded to the 16-bit dtype
    o1 = rnd(rnd(x1 * c, DT, BITS) - rnd(x2 * s, DT, BITS), DT, BITS).to(DT)
    o2 = rnd(rnd(x2 * c, DT, BITS) + rnd(x1 * s, DT, BITS), DT, BITS).to(DT)
    return o1, o2


@triton.jit
def _head_norm(x1, x2, w1, w2, eps, D: tl.constexpr, DT: tl.constexpr, BITS: tl.constexpr):
    var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D
    r = (1.0 / tl.sqrt(var + eps))[:, None]
    y1 = rnd(w1[None, :] * rnd(x1 * r, DT, BITS), DT, BITS)
    y2 = rnd(w2[None, :] * rnd(x2 * r, DT, BITS), DT, BITS)
    return y1, y2


@triton.jit
def _rotated_qk(q_ptrs, q_mask, k_ptrs, k_mask, COS, SIN, QN, KN, pos, stride_cos, eps, D: tl.constexpr,
                QK_NORM: tl.constexpr, DT: tl.constexpr, BITS: tl.constexpr):
    """Query and key heads at ``q_ptrs``/``k_ptrs`` (``[heads, D/2]`` pointers to their first halves), with
    the per-head norm (``QK_NORM``) and RoPE at ``pos``: their halves ``q1, q2, k1, k2``, rounded to ``DT``."""
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, HALF)
    c = tl.load(COS + pos * stride_cos + d).to(tl.float32)[None, :]
    s = tl.load(SIN + pos * stride_cos + d).to(tl.float32)[None, :]
    q1 = tl.load(q_ptrs, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q_ptrs + HALF, mask=q_mask, other=0.0).to(tl.float32)
    k1 = tl.load(k_ptrs, mask=k_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k_ptrs + HALF, mask=k_mask, other=0.0).to(tl.float32)
    if QK_NORM:
        q1, q2 = _head_norm(q1, q2, tl.load(QN + d).to(tl.float32), tl.load(QN + HALF + d).to(tl.float32),
                            eps, D, DT, BITS)
        k1, k2 = _head_norm(k1, k2, tl.load(KN + d).to(tl.float32), tl.load(KN + HALF + d).to(tl.float32),
                            eps, D, DT, BITS)
    q1, q2 = _rope_half(q1, q2, c, s, DT, BITS)
    k1, k2 = _rope_half(k1, k2, c, s, DT, BITS)
    return q1, q2, k1, k2


@triton.jit
def _butterfly(x, R: tl.constexpr, N: tl.constexpr, H: tl.constexpr):
    """One stage of the Walsh-Hadamard transform of the rows of ``x [R, N]``: pairs ``H`` apart → sum, difference."""
    y = tl.permute(tl.reshape(x, (R, N // (2 * H), 2, H)), (0, 1, 3, 2))
    a, b = tl.split(y)
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (R, N))


@triton.jit
def _hadamard_halves(x1, x2, D: tl.constexpr, DT: tl.constexpr, BITS: tl.constexpr):
    """Rows ``[x1 | x2]`` (halves ``[R, D/2]``) times ``H_D / √D`` (Sylvester order, as
    :func:`mosaicquant.methods.hadamard.apply_hadamard`: QuaRot's online Q/K rotation), in fp32 butterflies,
    rounded to ``DT``; returns the halves. ``H_D = [[H, H], [H, -H]]``: the halves are ``H (x1 ± x2)``."""
    HALF: tl.constexpr = D // 2
    R: tl.constexpr = x1.shape[0]
    a = x1.to(tl.float32) + x2.to(tl.float32)
    b = x1.to(tl.float32) - x2.to(tl.float32)
    for i in tl.static_range(HALF.bit_length() - 1):
        a = _butterfly(a, R, HALF, 1 << i)
        b = _butterfly(b, R, HALF, 1 << i)
    norm = 1.0 / tl.sqrt(D * 1.0)
    return rnd(a * norm, DT, BITS), rnd(b * norm, DT, BITS)


@triton.jit
def _kv4_quantize(x1, x2, clip, SYM: tl.constexpr):
    """One 4-bit group per row of ``[x1 | x2]`` (halves ``[R, D/2]``, fp32): :func:`kv4_quantize_reference`'s
    operations (``methods.quant``'s grid: IEEE divisions, ties to even). Returns the packed bytes ``[R, D/2]``
    (channel ``j`` in the low nibble of byte ``j``, channel ``j + D/2`` in its high nibble), the scales and
    the zero points ``[R]`` (fp32; 8 on the symmetric grid, whose integers are stored offset by 8). A row holding
    NaN or Inf gets the scale NaN (the reference's too), so its dequantized values are NaN."""
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if SYM:
        amax = max_nan(maximum_nan(tl.abs(x1), tl.abs(x2)), 1)
        scale = sym_scale(amax, clip, 7.0)
        zero = scale * 0.0 + 8.0
        # clamping to [-9, 9] first keeps the magic-number rounding exact and clamp(round(v), -8, 7) unchanged
        u1 = tl.minimum(tl.maximum(round_half_even(tl.minimum(tl.maximum(
            quant_div(x1, scale[:, None]), -9.0), 9.0)), -8.0), 7.0) + 8.0
        u2 = tl.minimum(tl.maximum(round_half_even(tl.minimum(tl.maximum(
            quant_div(x2, scale[:, None]), -9.0), 9.0)), -8.0), 7.0) + 8.0
    else:
        # one max over the joined (max, -min) pairs of the halves' element-wise extremes (exact)
        hi, neg_lo = tl.split(max_nan(tl.join(maximum_nan(x1, x2), -minimum_nan(x1, x2)), 1))
        lo = -neg_lo
        lo = minimum_nan(lo, 0.0) * clip
        hi = maximum_nan(hi, 0.0) * clip
        scale = asym_scale(lo, hi, 15.0)
        zero = round_half_even(tl.math.div_rn(-lo, scale))
        # |v| > 32 lands outside [0, 15] after the zero point either way
        u1 = tl.minimum(tl.maximum(round_half_even(tl.minimum(tl.maximum(
            quant_div(x1, scale[:, None]), -32.0), 32.0)) + zero[:, None], 0.0), 15.0)
        u2 = tl.minimum(tl.maximum(round_half_even(tl.minimum(tl.maximum(
            quant_div(x2, scale[:, None]), -32.0), 32.0)) + zero[:, None], 0.0), 15.0)
    packed = u1.to(tl.uint8) | (u2.to(tl.uint8) << 4)
    return packed, scale, zero


@triton.jit
def _kv4_unpack(packed, scale, zero):
    """fp32 halves ``(u - zero) · scale`` of packed rows ``[R, D/2]`` with their ``[R]`` scales and zeros."""
    u1 = (packed & 0xF).to(tl.float32)
    u2 = (packed >> 4).to(tl.float32)
    return (u1 - zero[:, None]) * scale[:, None], (u2 - zero[:, None]) * scale[:, None]


@triton.jit
def _kv4_store(x1, x2, CP, SP, ZP, at, sat, mask, clip, SYM: tl.constexpr):
    """Quantize rows ``[x1 | x2]`` (:func:`_kv4_quantize`) and store them at ``CP + at`` (``[R, D/2]`` offsets),
    their scales and zeros at ``SP + sat``, ``ZP + sat`` (``[R, 1]``); returns their fp32 dequantized halves."""
    packed, scale, zero = _kv4_quantize(x1, x2, clip, SYM)
    tl.store(CP + at, packed, mask=mask)
    tl.store(SP + sat, scale[:, None], mask=mask)
    tl.store(ZP + sat, zero[:, None], mask=mask)
    return _kv4_unpack(packed, scale, zero)


@triton.jit
def _rope_kv_kernel(QKV, POS, COS, SIN, QN, KN, QOUT, KC, VC, KS, KZ, VS, VZ, KD, VD, FAULTS, eps, clip,
                    tokens_per_seq, pos_max, stride_t, stride_cos, stride_qo, stride_cb, stride_ch, stride_cl,
                    stride_sb, stride_sh, stride_db, stride_dh, stride_dl,
                    HQ: tl.constexpr, HKV: tl.constexpr, HQP: tl.constexpr, HKVP: tl.constexpr,
                    D: tl.constexpr, QK_NORM: tl.constexpr, DT: tl.constexpr, BITS: tl.constexpr,
                    ROT: tl.constexpr, KV4: tl.constexpr, SYM: tl.constexpr, DEQ: tl.constexpr,
                    CHAIN: tl.constexpr):
    chain_start(CHAIN)
    t = tl.program_id(0).to(tl.int64)
    b = t // tokens_per_seq
    pos = _in_range_or_fault(tl.load(POS + t).to(tl.int64), 0, pos_max, FAULTS, _FAULT_ROPE_KV)
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, HALF)
    row = QKV + t * stride_t
    hq = tl.arange(0, HQP)[:, None]
    mq = hq < HQ
    hk = tl.arange(0, HKVP)[:, None]
    mk = hk < HKV
    k_row = row + HQ * D
    q1, q2, k1, k2 = _rotated_qk(row + hq * D + d[None, :], mq, k_row + hk * D + d[None, :], mk, COS, SIN, QN, KN,
                                 pos, stride_cos, eps, D, QK_NORM, DT, BITS)
    if ROT:
        q1, q2 = _hadamard_halves(q1, q2, D, DT, BITS)
        k1, k2 = _hadamard_halves(k1, k2, D, DT, BITS)
    qo = QOUT + t * stride_qo + hq * D + d[None, :]
    tl.store(qo, q1.to(DT), mask=mq)
    tl.store(qo + HALF, q2.to(DT), mask=mq)
    v_row = k_row + HKV * D
    v1 = tl.load(v_row + hk * D + d[None, :], mask=mk, other=0.0)
    v2 = tl.load(v_row + hk * D + HALF + d[None, :], mask=mk, other=0.0)
    if KV4:
        at = b * stride_cb + hk * stride_ch + pos * stride_cl + d[None, :]
        sat = b * stride_sb + hk * stride_sh + pos
        kd1, kd2 = _kv4_store(k1, k2, KC, KS, KZ, at, sat, mk, clip, SYM)
        vd1, vd2 = _kv4_store(v1.to(tl.float32), v2.to(tl.float32), VC, VS, VZ, at, sat, mk, clip, SYM)
        if DEQ:  # the dequantized keys and values in DT, as methods.kvcache's simulation rounds them
            deq = b * stride_db + hk * stride_dh + pos * stride_dl + d[None, :]
            tl.store(KD + deq, rnd(kd1, DT, BITS).to(DT), mask=mk)
            tl.store(KD + deq + HALF, rnd(kd2, DT, BITS).to(DT), mask=mk)
            tl.store(VD + deq, rnd(vd1, DT, BITS).to(DT), mask=mk)
            tl.store(VD + deq + HALF, rnd(vd2, DT, BITS).to(DT), mask=mk)
    else:
        cache = b * stride_cb + hk * stride_ch + pos * stride_cl + d[None, :]
        tl.store(KC + cache, k1.to(DT), mask=mk)
        tl.store(KC + cache + HALF, k2.to(DT), mask=mk)
        tl.store(VC + cache, v1, mask=mk)
        tl.store(VC + cache + HALF, v2, mask=mk)


def _head_norm_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@dataclass(frozen=True)
class KVFormat:
    """How the decode kernels keep K/V: the subset of :class:`mosaicquant.methods.kvcache.KVQuantSpec` they run.

    Attributes:
        bits: 16 (the model's dtype) or 4 (packed, one group per head and token, :func:`kv4_quantize_reference`).
        symmetric, clip_ratio: the 4-bit grid (``methods.quant``'s conventions).
        rotate: q and k become ``apply_hadamard(x)`` after RoPE (``x @ H_D / √D``, Sylvester order: QuaRot's
            online Q/K rotation), rounded to the model's dtype, before k is quantized.
    """

    bits: int = 16
    symmetric: bool = False
    clip_ratio: float = 1.0
    rotate: bool = False

    def __post_init__(self):
        if self.bits not in (4, 16):
            raise UserInputError(f"kv bits={self.bits!r}: the decode kernels keep K/V in 4 or 16 bits")
        if not 0.0 < float(self.clip_ratio) <= 1.0:
            raise UserInputError(f"kv clip_ratio={self.clip_ratio!r} is out of range: allowed (0, 1]")

    @property
    def quantized(self) -> bool:
        return self.bits == 4


@dataclass(frozen=True)
class KVScales:
    """The fp32 ``[B, kv_heads, L]`` scales and zero points of a 4-bit KV cache's keys and values."""

    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor

    @staticmethod
    def empty(batch: int, kv_heads: int, length: int, device) -> "KVScales":
        def new():
            return torch.zeros(batch, kv_heads, length, dtype=torch.float32, device=device)
        return KVScales(new(), new(), new(), new())

    @property
    def nbytes(self) -> int:
        return sum(int(t.numel() * t.element_size()) for t in (self.k_scale, self.k_zero, self.v_scale, self.v_zero))


def kv4_quantize_reference(x: torch.Tensor, symmetric: bool, clip_ratio: float
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit quantization of ``x [..., D]`` with one group per row, packed two channels a byte.

    The integers and scales of :func:`mosaicquant.methods.quant.fake_quantize` (``group_size`` None):
    the same fp32 operations, so :func:`kv4_dequantize_reference` of the result equals
    ``fake_quantize(x, 4, symmetric=..., clip_ratio=...)`` bit for bit. Symmetric integers are stored
    offset by 8 with a zero point of 8, so both grids dequantize as ``(u - zero) · scale``.

    Returns:
        ``(packed uint8 [..., D/2], scale fp32 [...], zero fp32 [...])``: channel ``j`` in the low nibble
        of byte ``j``, channel ``j + D/2`` in its high nibble.
    """

    xg = x.to(torch.float32).unsqueeze(-2)
    scale, zero = _params(xg, 4, symmetric, clip_ratio, None)
    q = _apply(xg, scale, zero, 4, symmetric).squeeze(-2)
    scale = scale.squeeze(-1)
    if symmetric:
        q = q + 8
        zero = torch.full_like(scale, 8.0)
    else:
        zero = zero.squeeze(-1)
    u = q.to(torch.uint8)
    half = x.shape[-1] // 2
    return u[..., :half] | (u[..., half:] << 4), scale, zero


def kv4_dequantize_reference(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                             dtype: torch.dtype) -> torch.Tensor:
    """``(u - zero) · scale`` in fp32, rounded to ``dtype``: ``[..., D]`` from :func:`kv4_quantize_reference`'s
    bytes (what ``methods.kvcache`` simulates)."""
    u = torch.cat((packed & 0xF, packed >> 4), dim=-1).to(torch.float32)
    return ((u - zero.unsqueeze(-1)) * scale.unsqueeze(-1)).to(dtype)


def _rope_qkv_reference(qkv, positions, cos, sin, heads, kv_heads, d, q_norm, k_norm, eps, rotate):
    """q, k (RoPE'd, with ``rotate`` then Hadamard-rotated) and v ``[T, heads, D]`` of ``qkv``, as transformers and
    :mod:`mosaicquant.methods.kvcache` round them."""
    t = qkv.shape[0]
    q = qkv[:, :heads * d].reshape(t, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].reshape(t, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:(heads + 2 * kv_heads) * d].reshape(t, kv_heads, d)
    if q_norm is not None:
        q, k = _head_norm_reference(q, q_norm, eps), _head_norm_reference(k, k_norm, eps)
    pos = positions.long()
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]

    def rot(x):
        return torch.cat((-x[..., d // 2:], x[..., :d // 2]), dim=-1)

    q = (q * c) + (rot(q) * s)
    k = (k * c) + (rot(k) * s)
    if rotate:
        q, k = apply_hadamard(q), apply_hadamard(k)
    return q, k, v


def rope_kv_reference(qkv, positions, cos, sin, k_cache, v_cache, heads, kv_heads, tokens_per_seq,
                      q_norm=None, k_norm=None, eps=1e-6, kv: KVFormat | None = None, scales: KVScales | None = None,
                      dequant: tuple[torch.Tensor, torch.Tensor] | None = None):
    """PyTorch reference of :func:`rope_kv` (transformers' ops and roundings)."""
    d = qkv.shape[1] // (heads + 2 * kv_heads)
    q, k, v = _rope_qkv_reference(qkv, positions, cos, sin, heads, kv_heads, d, q_norm, k_norm, eps,
                                  kv is not None and kv.rotate)
    pos = positions.long()
    b = torch.arange(qkv.shape[0], device=qkv.device) // tokens_per_seq
    if kv is not None and kv.quantized:
        for x, cache, sc, zc, dq in ((k, k_cache, scales.k_scale, scales.k_zero, 0),
                                     (v, v_cache, scales.v_scale, scales.v_zero, 1)):
            packed, scale, zero = kv4_quantize_reference(x, kv.symmetric, kv.clip_ratio)
            cache[b, :, pos] = packed
            sc[b, :, pos] = scale
            zc[b, :, pos] = zero
            if dequant is not None:
                dequant[dq][b, :, pos] = kv4_dequantize_reference(packed, scale, zero, qkv.dtype)
        return q
    k_cache[b, :, pos] = k
    v_cache[b, :, pos] = v
    return q


def _check_kv(kv: KVFormat | None, scales: KVScales | None, k_cache: torch.Tensor, d: int) -> None:
    """The 4-bit cache's scales and the rotation against the caches ``[B, kv_heads, L, ·]``."""
    if kv is None:
        if scales is not None:
            raise UserInputError("scales are given without a kv format")
        return
    if not isinstance(kv, KVFormat):
        raise UserInputError(f"kv must be a KVFormat, got {type(kv).__name__}")
    if not kv.quantized:
        if scales is not None:
            raise UserInputError("scales are given for a 16-bit cache")
        return
    if not isinstance(scales, KVScales):
        raise UserInputError("a 4-bit cache needs its KVScales (scales=...)")
    shape = tuple(k_cache.shape[:3])
    for name in ("k_scale", "k_zero", "v_scale", "v_zero"):
        t = getattr(scales, name)
        check_tensor(f"scales.{name}", t, dtypes=(torch.float32,), shape=shape)
        if not t.is_contiguous():
            raise UserInputError(f"scales.{name} must be contiguous")
        check_same_device(k_cache=k_cache, **{f"scales.{name}": t})


def _check_rope_args(qkv, positions, cos, sin, k_cache, v_cache, heads, kv_heads, tokens_per_seq, q_norm,
                     k_norm, kv: KVFormat | None = None, scales: KVScales | None = None) -> tuple[int, int]:
    """:func:`rope_kv`'s argument checks; returns the batch and the head size."""
    check_tensor("qkv", qkv, dtypes=_HALF, dim=2)
    if kv is not None and not isinstance(kv, KVFormat):
        raise UserInputError(f"kv must be a KVFormat, got {type(kv).__name__}")
    packed = kv is not None and kv.quantized
    cache_dtype = torch.uint8 if packed else qkv.dtype
    check_tensor("k_cache", k_cache, dtypes=(cache_dtype,), dim=4)
    b, hkv, _, width = k_cache.shape
    d = 2 * width if packed else width
    if hkv != kv_heads or heads % kv_heads:
        raise UserInputError(f"k_cache has {hkv} heads; expected kv_heads={kv_heads} dividing heads={heads}")
    if d < 16 or d > 256 or d & (d - 1):
        raise UserInputError(f"head size {d} is not taken: the kernels need a power of two from 16 to 256")
    check_tensor("v_cache", v_cache, dtypes=(cache_dtype,), shape=tuple(k_cache.shape))
    if v_cache.stride() != k_cache.stride():
        raise UserInputError("k_cache and v_cache must have the same strides")
    t = qkv.shape[0]
    if qkv.shape[1] != (heads + 2 * kv_heads) * d:
        raise UserInputError(f"qkv has {qkv.shape[1]} columns; expected (heads + 2·kv_heads)·D = "
                             f"{(heads + 2 * kv_heads) * d}" + (" (the 4-bit caches hold D/2 bytes a row)" if packed
                                                                else ""))
    if tokens_per_seq < 1 or t != b * tokens_per_seq:
        raise UserInputError(f"qkv has {t} tokens; expected batch {b} × tokens_per_seq {tokens_per_seq}")
    check_tensor("positions", positions, dtypes=(torch.int32, torch.int64), shape=(t,))
    check_tensor("cos", cos, dtypes=(qkv.dtype,), dim=2)
    check_tensor("sin", sin, dtypes=(qkv.dtype,), shape=tuple(cos.shape))
    if cos.shape[1] != d:
        raise UserInputError(f"cos/sin tables have width {cos.shape[1]}; expected the head size {d}")
    if (q_norm is None) != (k_norm is None):
        raise UserInputError("q_norm and k_norm are given together or not at all")
    if q_norm is not None:
        check_tensor("q_norm", q_norm, dtypes=(qkv.dtype,), shape=(d,))
        check_tensor("k_norm", k_norm, dtypes=(qkv.dtype,), shape=(d,))
    check_same_device(qkv=qkv, positions=positions, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache,
                      q_norm=q_norm, k_norm=k_norm)
    _check_kv(kv, scales, k_cache, d)
    _check_cpu_range("positions", positions, 0, min(k_cache.shape[2], cos.shape[0]) - 1,
                     f"the cache holds {k_cache.shape[2]} slots, the cos/sin tables {cos.shape[0]} positions")
    return b, d


# Range checks of positions and lengths on the device. A host check of a device tensor would synchronise every
# decode step (and cannot run inside a captured CUDA graph), so the kernels check what they read: a value out of
# range sets its bit in a per-device fault word (one atomic OR, only then) and is clamped into range, so the launch
# reads and writes nothing outside the cache and the tables; its outputs are not valid. The check is a compare and
# a never-taken branch a program, so it is always on. The word is read lazily, by check_range_faults, where the
# caller synchronises anyway (FusedDecoder.check_ranges, which the speed suites call after each timed measurement).
RANGE_FAULTS = (
    ("rope_kv", "positions", "0..min(cache slots, cos/sin rows) - 1"),
    ("decode_attention", "lengths", "1..cache slots"),
    ("decode_rope_attention", "positions", "0..min(cache slots, cos/sin rows) - 1"),
)
_FAULT_ROPE_KV = tl.constexpr(1)
_FAULT_ATTN_LENGTHS = tl.constexpr(2)
_FAULT_ROPE_ATTN = tl.constexpr(4)


def range_fault_word(device: torch.device) -> torch.Tensor:
    """The device's fault word (``int32 [1]``, :func:`mosaicquant.kernels._tiles.persistent_zeros`): bit ``i`` set
    when a kernel read a value of :data:`RANGE_FAULTS` ``[i]`` out of range."""
    return persistent_zeros("range faults", 1, torch.int32, torch.device(device))


def check_range_faults(device: torch.device | str) -> None:
    """Raise if a kernel on ``device`` read a position or length out of range since the last call; clears the word.

    Reads the device's fault word: a synchronisation on a GPU, so call it where the caller waits for the device
    anyway (e.g. as it copies results back), not every step.

    Raises:
        UserInputError: naming the launcher and input, and the allowed span.
    """
    word = range_fault_word(torch.device(device))
    bits = int(word.item())
    if not bits:
        return
    word.zero_()
    bad = [f"{launcher} {name} (allowed {span})" for i, (launcher, name, span) in enumerate(RANGE_FAULTS)
           if bits >> i & 1]
    raise UserInputError(f"out-of-range values read on {device}: {'; '.join(bad)}; the launches clamped them into "
                         f"range, so their outputs are not valid")


@triton.jit
def _in_range_or_fault(v, lo, hi, FAULTS, BIT: tl.constexpr):
    """``v`` clamped into ``[lo, hi]``; out of range, ``BIT`` is set in the fault word at ``FAULTS``."""
    if (v < lo) | (v > hi):
        tl.atomic_or(FAULTS, BIT)
    return tl.minimum(tl.maximum(v, lo), hi)


def _check_cpu_range(name: str, values: torch.Tensor, lo: int, hi: int, why: str) -> None:
    """``lo <= values <= hi``, checked where the values are on the host (no device synchronisation).

    On a GPU the kernels read positions and lengths on the device and check them there (the fault word,
    :func:`check_range_faults`). The decode runtime builds them in range.

    Raises:
        UserInputError: naming the smallest and largest value and the allowed span.
    """
    if values.device.type != "cpu" or not values.numel():
        return
    got_lo, got_hi = int(values.min()), int(values.max())
    if got_lo < lo or got_hi > hi:
        raise UserInputError(f"{name} span {got_lo}..{got_hi}; allowed {lo}..{hi} ({why})")


def _kv_args(kv: KVFormat | None, scales: KVScales | None, fallback: torch.Tensor) -> dict:
    """The KV format's pointers, strides and flags of the RoPE kernels (``fallback`` for absent pointers)."""
    quantized = kv is not None and kv.quantized
    sc = scales if quantized else KVScales(fallback, fallback, fallback, fallback)
    return dict(KS=sc.k_scale, KZ=sc.k_zero, VS=sc.v_scale, VZ=sc.v_zero,
                clip=float(kv.clip_ratio) if kv is not None else 1.0,
                stride_sb=sc.k_scale.stride(0) if quantized else 0, stride_sh=sc.k_scale.stride(1) if quantized else 0,
                ROT=kv is not None and kv.rotate, KV4=quantized,
                SYM=bool(kv.symmetric) if kv is not None else True,
                # no fused multiply-adds: the grid's range is (max·clip) - (min·clip) of rounded products, as in
                # methods.quant (contracted into an fma it rounds once: other scales, on the GPU only)
                **({"enable_fp_fusion": False} if quantized and KV4_NO_FP_FUSION else {}))


def _kv4_loop_args(dtype: torch.dtype, packed: bool, device: torch.device) -> dict:
    """The 4-bit loop's variant flags (:attr:`~mosaicquant.kernels.tile_table.TileTable.attn_kv4_biased` and the rest); the byte-permute conversion only
    compiled (the interpreter runs no inline PTX) and for BF16; the stages only over a 4-bit cache."""
    stages = {} if ATTN_KV4_STAGES is None or not packed else {"num_stages": int(ATTN_KV4_STAGES)}
    return dict(KV4_BIASED=bool(table_for(device).attn_kv4_biased),
                KV4_ASM=bool(ATTN_KV4_ASM) and dtype == torch.bfloat16 and not triton_interpreting(), **stages)


def rope_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, kv_heads: int, tokens_per_seq: int,
            q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 1e-6,
            out: torch.Tensor | None = None, kernel: str | None = None, kv: KVFormat | None = None,
            scales: KVScales | None = None, dequant: tuple[torch.Tensor, torch.Tensor] | None = None
            ) -> torch.Tensor:
    """RoPE on q and k of stacked ``[q | k | v]`` rows; k and v written into the cache.

    Args:
        qkv: ``[T, (heads + 2·kv_heads)·D]`` projections of ``T = B · tokens_per_seq`` tokens,
            sequence-major (unit stride along the last dimension).
        positions: ``[T]`` integer position of each token (where its k/v go in the cache), in
            ``0..min(L, P) - 1``: checked where they are on the host; on a GPU by the kernel, which
            clamps a value out of range and sets the fault word (:func:`check_range_faults`; a host
            check would synchronise each step).
        cos, sin: ``[P, D]`` tables in the model's dtype (transformers' rotary embedding at
            positions ``0..P-1``; both halves equal).
        k_cache, v_cache: ``[B, kv_heads, L, D]`` (``L > max(positions)``); with a 4-bit ``kv``
            format, uint8 ``[B, kv_heads, L, D/2]`` (:func:`kv4_quantize_reference`'s bytes).
        heads, kv_heads: query and key/value heads.
        tokens_per_seq: tokens of each sequence in ``qkv``.
        q_norm, k_norm: optional ``[D]`` per-head RMSNorm weights applied before RoPE (Qwen3).
        eps: their epsilon.
        out: optional ``[T, heads, D]`` output for q.
        kernel: kernel preference.
        kv: the cache's format (default: 16-bit, no rotation); with ``kv.rotate`` the queries and
            keys are Hadamard-rotated after RoPE (the returned queries too).
        scales: a 4-bit cache's scales and zero points, written at the tokens' positions.
        dequant: optional ``[B, kv_heads, L', D]`` pair, 4-bit caches only: the new keys and values
            dequantized in the model's dtype (for a prefill's attention over the prompt).

    Returns:
        ``[T, heads, D]`` rotated queries.

    Raises:
        UserInputError: inconsistent shapes, a head size the kernel cannot take (a power of
            two from 16 to 256), dtypes that differ, tensors on different devices, scales that do
            not fit the format, or host positions outside the cache or the tables.
    """
    b, d = _check_rope_args(qkv, positions, cos, sin, k_cache, v_cache, heads, kv_heads, tokens_per_seq,
                            q_norm, k_norm, kv, scales)
    if dequant is not None:
        if kv is None or not kv.quantized:
            raise UserInputError("dequant is given for a 16-bit cache (it holds the 4-bit cache's values)")
        check_tensor("dequant[0]", dequant[0], dtypes=(qkv.dtype,), dim=4)
        check_tensor("dequant[1]", dequant[1], dtypes=(qkv.dtype,), shape=tuple(dequant[0].shape))
        if (dequant[0].shape[:2] != k_cache.shape[:2] or dequant[0].shape[3] != d
                or dequant[0].stride() != dequant[1].stride() or dequant[0].stride(-1) != 1):
            raise UserInputError(f"dequant tensors {list(dequant[0].shape)} must be [B, kv_heads, L, D] = "
                                 f"[{b}, {kv_heads}, L, {d}], alike and unit-strided along D")
        check_same_device(qkv=qkv, **{"dequant[0]": dequant[0], "dequant[1]": dequant[1]})
    t = qkv.shape[0]
    if resolve_kernel(kernel, qkv.device) == "torch":
        q = rope_kv_reference(qkv, positions, cos, sin, k_cache, v_cache, heads, kv_heads, tokens_per_seq,
                              q_norm, k_norm, eps, kv, scales, dequant)
        return q if out is None else out.copy_(q)
    check_triton_device(qkv.device)
    out = torch.empty(t, heads, d, dtype=qkv.dtype, device=qkv.device) if out is None else out
    check_tensor("out", out, dtypes=(qkv.dtype,), shape=(t, heads, d))
    check_same_device(qkv=qkv, out=out)
    if not out.is_contiguous() or k_cache.stride(-1) != 1 or cos.stride() != sin.stride():
        raise UserInputError("out must be contiguous, the caches unit-strided along D, cos and sin alike")
    if t:
        qn = q_norm if q_norm is not None else cos
        chain = chain_mode(qkv.device, t)
        kd, vd = dequant if dequant is not None else (cos, cos)
        _rope_kv_kernel[(t,)](
            qkv, positions, cos, sin, qn, k_norm if k_norm is not None else cos, out, k_cache, v_cache,
            KD=kd, VD=vd, FAULTS=range_fault_word(qkv.device), eps=float(eps), tokens_per_seq=tokens_per_seq,
            pos_max=min(k_cache.shape[2], cos.shape[0]) - 1, stride_t=qkv.stride(0),
            stride_cos=cos.stride(0), stride_qo=out.stride(0), stride_cb=k_cache.stride(0),
            stride_ch=k_cache.stride(1), stride_cl=k_cache.stride(2),
            stride_db=kd.stride(0) if dequant is not None else 0, stride_dh=kd.stride(1) if dequant is not None else 0,
            stride_dl=kd.stride(2) if dequant is not None else 0,
            HQ=heads, HKV=kv_heads, HQP=triton.next_power_of_2(heads), HKVP=triton.next_power_of_2(kv_heads), D=d,
            QK_NORM=q_norm is not None, DT=_tl_dtype(qkv.dtype), BITS=_bits(qkv.dtype), DEQ=dequant is not None,
            CHAIN=chain, num_warps=4, **_kv_args(kv, scales, cos), **chain_launch(chain))
    return out


# ---------------------------------------------------------------------------------------------- decode attention


@triton.jit
def _attend_chunk(q, KC, VC, base, start, end, stride_cl, scale_log2, GP: tl.constexpr, D: tl.constexpr,
                  BLOCK_N: tl.constexpr, DT: tl.constexpr, DOT_F32: tl.constexpr):
    """Online softmax of the queries ``q [GP, D]`` over the cached keys ``[start, end)`` of one KV head
    (``base``): fp32 row maxima (log2 units), sums and ``[GP, D]`` value sums."""
    d = tl.arange(0, D)
    m = tl.full([GP], float("-inf"), tl.float32)
    l_sum = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        valid = n < end
        off = base + n[:, None].to(tl.int64) * stride_cl + d[None, :]
        k = tl.load(KC + off, mask=valid[:, None], other=0.0)
        v = tl.load(VC + off, mask=valid[:, None], other=0.0)  # issued with the keys: one memory round trip
        if DOT_F32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        if DOT_F32:
            pv = tl.dot(_round_to_bf16(p) if DT == tl.bfloat16 else p.to(DT).to(tl.float32), v.to(tl.float32))
        else:
            pv = tl.dot(p.to(DT), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    return m, l_sum, acc


# The nibbles of a packed cache byte as BF16 ``128 + u`` (low nibble: channel j, high: j + D/2), four bytes a
# register: each nibble is placed under the byte 0x43 (BF16 128.0 is 0x4300, whose last 7 mantissa bits count
# units), two BF16 values a register by byte permutes. Eight instructions per eight values, against the
# compiler's element-wise u8 -> fp32 -> bf16 chain.
_ASM_NIB_BF16 = tl.constexpr("""{
.reg .b32 t, k;
mov.b32 k, 0x43434343;
and.b32 t, $4, 0x0F0F0F0F;
prmt.b32 $0, t, k, 0x4140;
prmt.b32 $1, t, k, 0x4342;
shr.u32 t, $4, 4;
and.b32 t, t, 0x0F0F0F0F;
prmt.b32 $2, t, k, 0x4140;
prmt.b32 $3, t, k, 0x4342;
}""")


@triton.jit
def _kv4_nibbles(packed, DT: tl.constexpr, BIASED: tl.constexpr, USE_ASM: tl.constexpr):
    """The low and high nibbles ``u`` of packed cache bytes as ``DT`` values: ``u`` itself, or with ``BIASED``
    ``128 + u`` (exact in BF16 and FP16; in BF16 on the GPU by :data:`_ASM_NIB_BF16`'s byte permutes)."""
    if BIASED and USE_ASM:
        return tl.inline_asm_elementwise(_ASM_NIB_BF16, "=r,=r,=r,=r,r", [packed], dtype=(tl.bfloat16, tl.bfloat16),
                                         is_pure=True, pack=4)
    if BIASED:
        return ((packed & 0xF).to(tl.float32) + 128.0).to(DT), ((packed >> 4).to(tl.float32) + 128.0).to(DT)
    return (packed & 0xF).to(DT), (packed >> 4).to(DT)


@triton.jit
def _attend_chunk_kv4(q1, q2, KC, VC, KS, KZ, VS, VZ, base, sbase, start, end, stride_cl, scale_log2,
                      GP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, DT: tl.constexpr,
                      BITS: tl.constexpr, DOT_F32: tl.constexpr, BIASED: tl.constexpr = False,
                      USE_ASM: tl.constexpr = False):
    """:func:`_attend_chunk` over a 4-bit cache (:func:`_kv4_quantize`'s bytes; scales and zeros at ``sbase``
    along the cache): the integers go into the dots as they are, each key's scale and zero apply to its
    scores, ``s·(q·u - z·Σq)``, and each value's to the probabilities, ``Σ_n (p·s)_n (u_n - z_n)`` with
    ``p·s`` rounded to ``DT`` for the dot. Returns the row maxima, sums and the value sums' two halves.

    ``BIASED``: the integers enter the dots as ``128 + u`` (:func:`_kv4_nibbles`) and the zero points as
    ``128 + z`` (exact values, and each product with a 16-bit query or probability exact in fp32; the sums
    round at 128 + u's scale, well inside the output's 16-bit tolerance).

    """
    HALF: tl.constexpr = D // 2
    dh = tl.arange(0, HALF)
    q1f = q1.to(tl.float32)
    q2f = q2.to(tl.float32)
    qsum = tl.sum(q1f, axis=1) + tl.sum(q2f, axis=1)
    if DOT_F32:  # Triton's interpreter computes 16-bit dots wrongly; the same products in fp32
        q1 = q1f
        q2 = q2f
    else:
        q1 = q1.to(DT)
        q2 = q2.to(DT)
    KD: tl.constexpr = tl.float32 if DOT_F32 else DT  # the integers' dtype in the dots
    bias = 128.0 if BIASED else 0.0
    m = tl.full([GP], float("-inf"), tl.float32)
    l_sum = tl.zeros([GP], tl.float32)
    acc1 = tl.zeros([GP, HALF], tl.float32)
    acc2 = tl.zeros([GP, HALF], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        valid = n < end
        off = base + n[:, None].to(tl.int64) * stride_cl + dh[None, :]
        kb = tl.load(KC + off, mask=valid[:, None], other=0)
        vb = tl.load(VC + off, mask=valid[:, None], other=0)
        sn = sbase + n
        ks = tl.load(KS + sn, mask=valid, other=0.0)
        kz = tl.load(KZ + sn, mask=valid, other=0.0) + bias
        vs = tl.load(VS + sn, mask=valid, other=0.0)
        vz = tl.load(VZ + sn, mask=valid, other=0.0) + bias
        k_lo, k_hi = _kv4_nibbles(kb, KD, BIASED, USE_ASM)
        v_lo, v_hi = _kv4_nibbles(vb, KD, BIASED, USE_ASM)
        raw = tl.dot(q1, tl.trans(k_lo)) + tl.dot(q2, tl.trans(k_hi))
        s = (raw - qsum[:, None] * kz[None, :]) * (ks * scale_log2)[None, :]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        pw = rnd(p * vs[None, :], DT, BITS)
        corr = tl.sum(pw * vz[None, :], axis=1)[:, None]
        acc1 = acc1 * alpha[:, None] + (tl.dot(pw.to(KD), v_lo) - corr)
        acc2 = acc2 * alpha[:, None] + (tl.dot(pw.to(KD), v_hi) - corr)
        m = m_new
    return m, l_sum, acc1, acc2


@triton.jit
def _store_partial(PM, PL, PACC, part0, m, l_sum, acc, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr):
    """A chunk's softmax state for its ``G`` query heads at partial rows ``part0 + [0, G)``."""
    g = tl.arange(0, GP)
    part = part0 + g
    real = g < G  # the rows padding the dot to 16 are never read
    tl.store(PM + part, m, mask=real)
    tl.store(PL + part, l_sum, mask=real)
    tl.store(PACC + part[:, None] * D + tl.arange(0, D)[None, :], acc, mask=real[:, None])


@triton.jit
def _combine_head(PM, PL, PACC, first, NSPLIT, SP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr):
    """fp32 ``[D]`` attention output of one query head from its ``NSPLIT`` chunks' partials (partial rows
    ``first + s·GP``), combined by their maxima."""
    sp = tl.arange(0, SP)
    d = tl.arange(0, D)
    part = first + sp.to(tl.int64) * GP
    ok = sp < NSPLIT
    m = tl.load(PM + part, mask=ok, other=float("-inf"))
    l_sum = tl.load(PL + part, mask=ok, other=0.0)
    m_all = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp2(m - m_all), 0.0)
    acc = tl.load(PACC + part[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    return tl.sum(acc * w[:, None], axis=0) / tl.sum(l_sum * w, axis=0)


@triton.jit
def _attn_split_kernel(Q, KC, VC, LENS, PM, PL, PACC, FAULTS, scale_log2, chunk, cache_len,
                       stride_qb, stride_qh, stride_cb, stride_ch, stride_cl,
                       HKV, NSPLIT, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                       BLOCK_N: tl.constexpr, DT: tl.constexpr, DOT_F32: tl.constexpr, CHAIN: tl.constexpr):
    chain_start(CHAIN)
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (bh // HKV).to(tl.int64)
    h = bh % HKV
    length = _in_range_or_fault(tl.load(LENS + b), 1, cache_len, FAULTS, _FAULT_ATTN_LENGTHS)
    start = split * chunk
    end = tl.minimum(start + chunk, length)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    q = tl.load(Q + b * stride_qb + (h * G + g)[:, None] * stride_qh + d[None, :], mask=(g < G)[:, None],
                other=0.0)
    if DOT_F32:  # Triton's interpreter computes 16-bit dots wrongly; the same products in fp32
        q = q.to(tl.float32)
    m, l_sum, acc = _attend_chunk(q, KC, VC, b * stride_cb + h * stride_ch, start, end, stride_cl, scale_log2,
                                  GP, D, BLOCK_N, DT, DOT_F32)
    _store_partial(PM, PL, PACC, (bh * NSPLIT + split).to(tl.int64) * GP, m, l_sum, acc, G, GP, D)


@triton.jit
def _attn_combine_kernel(PM, PL, PACC, OUT, stride_ob, HQ, NSPLIT, G: tl.constexpr, GP: tl.constexpr,
                         SP: tl.constexpr, D: tl.constexpr, DT: tl.constexpr, BITS: tl.constexpr,
                         CHAIN: tl.constexpr):
    chain_start(CHAIN)
    bq = tl.program_id(0)
    b = bq // HQ
    hq = bq % HQ
    bh = b * (HQ // G) + hq // G
    o = _combine_head(PM, PL, PACC, (bh * NSPLIT).to(tl.int64) * GP + hq % G, NSPLIT, SP, GP, D)
    tl.store(OUT + b.to(tl.int64) * stride_ob + hq * D + tl.arange(0, D), rnd(o, DT, BITS).to(DT))


@triton.jit
def _cat_halves(x1, x2):
    """``[R, H]`` and ``[R, H]`` side by side: ``[R, 2H]``."""
    R: tl.constexpr = x1.shape[0]
    H: tl.constexpr = x1.shape[1]
    return tl.reshape(tl.permute(tl.join(x1, x2), (0, 2, 1)), (R, 2 * H))


@triton.jit
def _rope_attn_kernel(QKV, POS, COS, SIN, QN, KN, KC, VC, PM, PL, PACC, OUT, KS, KZ, VS, VZ, FAULTS, eps,
                      scale_log2, clip, chunk, pos_max, stride_t, stride_cos, stride_cb, stride_ch, stride_cl,
                      stride_sb, stride_sh, stride_ob, HKV, NSPLIT,
                      G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                      QK_NORM: tl.constexpr, DT: tl.constexpr, BITS: tl.constexpr, DOT_F32: tl.constexpr,
                      DIRECT: tl.constexpr, ROT: tl.constexpr, KV4: tl.constexpr, SYM: tl.constexpr,
                      CHAIN: tl.constexpr, KV4_BIASED: tl.constexpr = False,
                      KV4_ASM: tl.constexpr = False, NEW_CACHED: tl.constexpr = False):
    # _attn_split_kernel's programs (a KV head of a sequence, a chunk of its cache), doing rope_kv's
    # work for their head too: the G queries and the new key rotated from the qkv row; the program
    # whose chunk holds the position writes the new key and value into the cache, and its loop reads
    # them back after a CTA barrier (NEW_CACHED), or adds them from registers after the loop (a tile
    # edited in registers is not loaded straight into the dot operands: 192 registers a thread and
    # 100 KB of shared memory against 94 and 70 KB).
    # ROT: QuaRot's Q/K Hadamard after RoPE; KV4: the cache is 4-bit (_kv4_quantize, _attend_chunk_kv4).
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (bh // HKV).to(tl.int64)
    h = bh % HKV
    # the new token's position (it attends to keys 0..pos), read before waiting for the kernel before us:
    # that is the qkv GEMM, which does not write it, and every kernel before it has finished (each one
    # waits for its predecessor before it lets the next start)
    pos = _in_range_or_fault(tl.load(POS + b).to(tl.int64), 0, pos_max, FAULTS, _FAULT_ROPE_ATTN)
    start = split * chunk
    end = tl.minimum(start + chunk, pos + 1)
    base = b * stride_cb + h * stride_ch
    chain_start(CHAIN)
    HALF: tl.constexpr = D // 2
    dh = tl.arange(0, HALF)[None, :]
    row = QKV + b * stride_t
    g = tl.arange(0, GP)[:, None]
    q1, q2, k1, k2 = _rotated_qk(row + (h * G + g) * D + dh, g < G, row + (HKV * G + h) * D + dh, dh >= 0, COS, SIN,
                                 QN, KN, pos, stride_cos, eps, D, QK_NORM, DT, BITS)
    d = tl.arange(0, D)
    owner = (start <= pos) & (pos < start + chunk)
    loop_end = end if NEW_CACHED else tl.minimum(end, pos)  # the new token read back by the loop, or added after it
    v_row = row + (HKV * (G + 1) + h) * D
    if ROT:
        q1, q2 = _hadamard_halves(q1, q2, D, DT, BITS)
    if KV4:
        sbase = b * stride_sb + h * stride_sh
        k1 = k1.to(tl.float32)
        k2 = k2.to(tl.float32)
        kd1 = tl.zeros([1, HALF], tl.float32)
        kd2 = tl.zeros([1, HALF], tl.float32)
        vd1 = tl.zeros([1, HALF], tl.float32)
        vd2 = tl.zeros([1, HALF], tl.float32)
        if owner:  # only the program whose chunk holds the position rotates, quantizes and stores the new key
            if ROT:
                k1, k2 = _hadamard_halves(k1, k2, D, DT, BITS)
            at = base + pos * stride_cl + dh
            sat = sbase + pos + tl.zeros([1, 1], tl.int64)
            mine = tl.zeros([1, 1], tl.int32) == 0
            kd1, kd2 = _kv4_store(k1, k2, KC, KS, KZ, at, sat, mine, clip, SYM)
            vd1, vd2 = _kv4_store(tl.load(v_row + dh).to(tl.float32), tl.load(v_row + HALF + dh).to(tl.float32), VC,
                                  VS, VZ, at, sat, mine, clip, SYM)
        if NEW_CACHED:  # the loop reads the new key and value back from the cache, after the CTA's barrier
            tl.debug_barrier()
        m, l_sum, acc1, acc2 = _attend_chunk_kv4(q1, q2, KC, VC, KS, KZ, VS, VZ, base, sbase, start, loop_end,
                                                 stride_cl, scale_log2, GP, D, BLOCK_N, DT, BITS, DOT_F32,
                                                 KV4_BIASED, KV4_ASM)
        if owner and not NEW_CACHED:  # the new key and value, dequantized in registers: one more softmax step
            s_new = (tl.sum(q1.to(tl.float32) * kd1, axis=1) + tl.sum(q2.to(tl.float32) * kd2, axis=1)) * scale_log2
            m_new = tl.maximum(m, s_new)
            p = tl.exp2(s_new - m_new)
            alpha = tl.exp2(m - m_new)
            l_sum = l_sum * alpha + p
            acc1 = acc1 * alpha[:, None] + rnd(p, DT, BITS)[:, None] * vd1
            acc2 = acc2 * alpha[:, None] + rnd(p, DT, BITS)[:, None] * vd2
            m = m_new
        acc = _cat_halves(acc1, acc2)
    else:
        if ROT:
            k1, k2 = _hadamard_halves(k1, k2, D, DT, BITS)
        q = _cat_halves(q1, q2)
        k_new = tl.reshape(_cat_halves(k1, k2), (D,))
        v_new = tl.load(v_row + d)
        new_at = base + pos * stride_cl + d
        tl.store(KC + new_at, k_new.to(DT), mask=owner & (d < D))
        tl.store(VC + new_at, v_new, mask=owner & (d < D))
        if DOT_F32:  # Triton's interpreter computes 16-bit dots wrongly; the same products in fp32
            q = q.to(tl.float32)
        else:
            q = q.to(DT)
        if NEW_CACHED:  # the loop reads the new key and value back from the cache, after the CTA's barrier
            tl.debug_barrier()
        # the keys cached before (and the new one, NEW_CACHED): the plain loop (loads straight into the dot operands)
        m, l_sum, acc = _attend_chunk(q, KC, VC, base, start, loop_end, stride_cl, scale_log2, GP, D, BLOCK_N, DT,
                                      DOT_F32)
        if owner and not NEW_CACHED:  # the new key and value, from registers: one more step of the online softmax
            s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale_log2
            m_new = tl.maximum(m, s_new)
            p = tl.exp2(s_new - m_new)
            alpha = tl.exp2(m - m_new)
            l_sum = l_sum * alpha + p
            acc = acc * alpha[:, None] + rnd(p, DT, BITS)[:, None] * v_new.to(tl.float32)[None, :]
            m = m_new
    if DIRECT:  # the head's only chunk: its output, as _combine_head gives it for one chunk (weight exp2(0) = 1)
        g1 = tl.arange(0, GP)
        o = acc / l_sum[:, None]
        tl.store(OUT + b * stride_ob + (h * G + g1)[:, None] * D + d[None, :], rnd(o, DT, BITS).to(DT),
                 mask=(g1 < G)[:, None])
    else:
        _store_partial(PM, PL, PACC, (bh * NSPLIT + split).to(tl.int64) * GP, m, l_sum, acc, G, GP, D)


def attention_splits(batch: int, kv_heads: int, cache_len: int, sms: int = 132, block_n: int = 64,
                     per_sm: int | None = None) -> int:
    """Keys per program of :func:`decode_attention`: a multiple of ``block_n`` giving ~``per_sm`` programs per SM
    (default :data:`ATTN_PROGRAMS_PER_SM`, doubled below :data:`ATTN_FEW_PAIRS` sequence × KV-head pairs; one
    chunk a head from :data:`ATTN_ONE_CHUNK_PAIRS_PER_SM` pairs an SM)."""
    if per_sm is None:
        if batch * kv_heads >= ATTN_ONE_CHUNK_PAIRS_PER_SM * sms:
            return max(block_n, math.ceil(cache_len / block_n) * block_n)
        per_sm = ATTN_PROGRAMS_PER_SM * (2 if batch * kv_heads < ATTN_FEW_PAIRS else 1)
    want = max(1, math.ceil(per_sm * sms / max(batch * kv_heads, 1)))
    return max(block_n, math.ceil(math.ceil(cache_len / want) / block_n) * block_n)


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """PyTorch reference of :func:`decode_attention` (fp32 softmax over each sequence's keys)."""
    b, hq, d = q.shape
    g = hq // k_cache.shape[1]
    out = torch.empty(b, hq * d, dtype=q.dtype, device=q.device)
    for i in range(b):
        n = int(lengths[i])
        k = k_cache[i, :, :n].float().repeat_interleave(g, dim=0)
        v = v_cache[i, :, :n].float().repeat_interleave(g, dim=0)
        s = torch.einsum("hd,hnd->hn", q[i].float(), k) * scale
        out[i] = torch.einsum("hn,hnd->hd", torch.softmax(s, dim=-1), v).reshape(-1).to(q.dtype)
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                     scale: float, chunk: int | None = None, out: torch.Tensor | None = None,
                     kernel: str | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over the first ``lengths[b]`` cached keys.

    Args:
        q: ``[B, heads, D]`` queries (unit stride along D).
        k_cache, v_cache: ``[B, kv_heads, L, D]``; ``heads`` a multiple of ``kv_heads`` (GQA).
        lengths: ``[B]`` int32 keys to attend per sequence, ``1..L`` (checked where they are on the
            host; on a GPU read on the device, unchecked).
        scale: softmax scale (``D^-0.5`` for these models).
        chunk: keys per program (a multiple of 64); default :func:`attention_splits`.
        out: optional ``[B, heads·D]`` output.
        kernel: kernel preference.

    Returns:
        ``[B, heads·D]`` in q's dtype.

    Raises:
        UserInputError: shapes, dtypes, head sizes or a chunk the kernel cannot take, tensors on
            different devices, or host lengths outside ``1..L``.
    """
    check_tensor("q", q, dtypes=_HALF, dim=3)
    b, hq, d = q.shape
    check_tensor("k_cache", k_cache, dtypes=(q.dtype,), dim=4)
    if k_cache.shape[0] != b or k_cache.shape[3] != d or hq % k_cache.shape[1]:
        raise UserInputError(f"k_cache shape {list(k_cache.shape)} does not fit q {list(q.shape)} "
                             "([B, kv_heads, L, D] with kv_heads dividing the query heads)")
    check_tensor("v_cache", v_cache, dtypes=(q.dtype,), shape=tuple(k_cache.shape))
    check_tensor("lengths", lengths, dtypes=(torch.int32,), shape=(b,))
    if d < 16 or d > 256 or d & (d - 1):
        raise UserInputError(f"head size {d} is not taken: the kernels need a power of two from 16 to 256")
    hkv, cache_len = k_cache.shape[1], k_cache.shape[2]
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, lengths=lengths, out=out)
    _check_cpu_range("lengths", lengths, 1, cache_len, f"the cache holds {cache_len} keys a sequence")
    if resolve_kernel(kernel, q.device) == "torch":
        y = decode_attention_reference(q, k_cache, v_cache, lengths, scale)
        return y if out is None else out.copy_(y)
    check_triton_device(q.device)
    if v_cache.stride() != k_cache.stride():
        raise UserInputError("k_cache and v_cache must have the same strides")
    p = _AttnPlan.make(q.device, b, hq, hkv, cache_len, d, chunk)
    out = torch.empty(b, hq * d, dtype=q.dtype, device=q.device) if out is None else out
    check_tensor("out", out, dtypes=(q.dtype,), shape=(b, hq * d))
    pm, pl, pacc = p.partials()
    chain = chain_mode(q.device, b)
    _attn_split_kernel[(b * hkv, p.nsplit)](
        q, k_cache, v_cache, lengths, pm, pl, pacc, range_fault_word(q.device), float(scale) * _LOG2E, p.chunk,
        cache_len,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        hkv, p.nsplit, G=p.g, GP=p.gp, D=d, BLOCK_N=ATTN_BLOCK_N, DT=_tl_dtype(q.dtype),
        DOT_F32=triton_interpreting(), CHAIN=chain, num_warps=4, **chain_launch(chain))
    _attn_combine_kernel[(b * hq,)](pm, pl, pacc, out, out.stride(0), hq, p.nsplit, G=p.g, GP=p.gp, SP=p.sp, D=d,
                                    DT=_tl_dtype(q.dtype), BITS=_bits(q.dtype), CHAIN=chain, num_warps=4,
                                    **chain_launch(chain))
    return out


@dataclass(frozen=True)
class _AttnPlan:
    """How :func:`decode_attention` and :func:`decode_rope_attention` cut the cache: ``nsplit`` chunks of
    ``chunk`` keys per (sequence, KV head), ``g`` query heads a KV head padded to ``gp`` dot rows."""

    device: torch.device
    rows: int  # partial rows: batch · kv_heads · nsplit · gp
    d: int
    chunk: int
    nsplit: int
    g: int
    gp: int

    @staticmethod
    def make(device, b, hq, hkv, cache_len, d, chunk, per_sm=None, block_n=None) -> "_AttnPlan":
        block_n = ATTN_BLOCK_N if block_n is None else block_n
        if chunk is None:
            sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
            chunk = attention_splits(b, hkv, cache_len, sms, block_n, per_sm)
        if chunk < block_n or chunk % block_n:
            raise UserInputError(f"chunk={chunk} must be a positive multiple of {block_n}")
        nsplit = math.ceil(cache_len / chunk)
        g = hq // hkv
        gp = max(16, triton.next_power_of_2(g))
        return _AttnPlan(device, b * hkv * nsplit * gp, d, chunk, nsplit, g, gp)

    @property
    def sp(self) -> int:
        return max(2, triton.next_power_of_2(self.nsplit))

    def partials(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp32 buffers of every chunk's row maxima, sums and ``[D]`` value sums."""
        pm = torch.empty(self.rows, dtype=torch.float32, device=self.device)
        return pm, torch.empty_like(pm), torch.empty(self.rows, self.d, dtype=torch.float32, device=self.device)


def decode_rope_attention_reference(qkv, positions, cos, sin, k_cache, v_cache, heads, kv_heads, scale,
                                    q_norm=None, k_norm=None, eps=1e-6, kv: KVFormat | None = None,
                                    scales: KVScales | None = None) -> torch.Tensor:
    """PyTorch reference of :func:`decode_rope_attention`: :func:`rope_kv_reference`, then
    :func:`decode_attention_reference` over positions ``0..positions[b]`` (of the dequantized cache
    where it is 4-bit)."""
    q = rope_kv_reference(qkv, positions, cos, sin, k_cache, v_cache, heads, kv_heads, 1, q_norm, k_norm, eps,
                          kv, scales)
    if kv is not None and kv.quantized:
        k_cache = kv4_dequantize_reference(k_cache, scales.k_scale, scales.k_zero, qkv.dtype)
        v_cache = kv4_dequantize_reference(v_cache, scales.v_scale, scales.v_zero, qkv.dtype)
    return decode_attention_reference(q, k_cache, v_cache, (positions + 1).to(torch.int32), scale)


def decode_rope_attention(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, kv_heads: int, scale: float,
                          q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 1e-6,
                          chunk: int | None = None, out: torch.Tensor | None = None,
                          kernel: str | None = None, kv: KVFormat | None = None,
                          scales: KVScales | None = None) -> torch.Tensor:
    """:func:`rope_kv` and :func:`decode_attention` of one new token per sequence: two kernels instead of three.

    Each program of the attention (a KV head of a sequence, a chunk of its cache) rotates its
    query heads and the head's new key itself (:func:`rope_kv`'s roundings); the program whose chunk
    holds the token's position writes the new key and value into the cache and, after a CTA
    barrier, reads them back in its loop as one more cached key (:attr:`~mosaicquant.kernels.tile_table.TileTable.attn_new_cached`; the loop
    loads straight into the dot operands, as :func:`decode_attention`'s does).
    :func:`decode_attention`'s kernel then combines the chunks; where the cache is one chunk, the
    programs write the output themselves instead (:attr:`~mosaicquant.kernels.tile_table.TileTable.attn_direct_one_chunk`). The cache ends up
    as :func:`rope_kv` leaves it; the output agrees with the two ops to attention's bf16 accuracy.

    Measured on the H200: also combining in the attention kernel (the
    last chunk of a head to finish, by a counter) and prefetching the chunk's cached keys into L2
    before waiting for the qkv GEMM were both slower in the decode step.

    Args:
        qkv: ``[B, (heads + 2·kv_heads)·D]`` projections of the new token of each sequence.
        positions: ``[B]`` position of each new token: its key and value go there, and it attends
            to keys ``0..positions[b]`` (read on the device).
        cos, sin, k_cache, v_cache, heads, kv_heads, q_norm, k_norm, eps: as in :func:`rope_kv`.
        scale, chunk: as in :func:`decode_attention`; over a 4-bit cache ``chunk`` is a multiple of
            :attr:`~mosaicquant.kernels.tile_table.TileTable.attn_kv4_block_n` (128).
        out: optional ``[B, heads·D]`` output (unit-strided along its last dimension).
        kernel: kernel preference.
        kv, scales: the cache's format and a 4-bit cache's scales, as in :func:`rope_kv`. Over a
            4-bit cache the integers go into the dots and each key's and value's scale and zero
            point apply outside them (:func:`_attend_chunk_kv4`); the output agrees with attention
            over the dequantized cache to attention's bf16 accuracy.

    Returns:
        ``[B, heads·D]`` in qkv's dtype.

    Raises:
        UserInputError: as :func:`rope_kv` and :func:`decode_attention`.
    """
    b, d = _check_rope_args(qkv, positions, cos, sin, k_cache, v_cache, heads, kv_heads, 1, q_norm, k_norm, kv,
                            scales)
    if resolve_kernel(kernel, qkv.device) == "torch":
        y = decode_rope_attention_reference(qkv, positions, cos, sin, k_cache, v_cache, heads, kv_heads, scale,
                                            q_norm, k_norm, eps, kv, scales)
        return y if out is None else out.copy_(y)
    check_triton_device(qkv.device)
    if k_cache.stride(-1) != 1 or cos.stride() != sin.stride() or cos.stride(-1) != 1 or qkv.stride(-1) != 1:
        raise UserInputError("qkv, the caches and cos/sin must be unit-strided along D, cos and sin alike")
    packed = kv is not None and kv.quantized
    per_sm = ATTN_KV4_PROGRAMS_PER_SM if packed else None  # not doubled below ATTN_FEW_PAIRS (measured, above)
    tiles = table_for(qkv.device)
    block_n = tiles.attn_kv4_block_n if packed else ATTN_BLOCK_N
    p = _AttnPlan.make(qkv.device, b, heads, kv_heads, k_cache.shape[2], d, chunk, per_sm, block_n)
    out = torch.empty(b, heads * d, dtype=qkv.dtype, device=qkv.device) if out is None else out
    check_tensor("out", out, dtypes=(qkv.dtype,), shape=(b, heads * d))
    check_same_device(qkv=qkv, out=out)
    if out.stride(-1) != 1:
        raise UserInputError("out must be unit-strided along its last dimension")
    pm, pl, pacc = p.partials()
    chain = chain_mode(qkv.device, b)
    qn = q_norm if q_norm is not None else cos
    direct = tiles.attn_direct_one_chunk and p.nsplit == 1
    _rope_attn_kernel[(b * kv_heads, p.nsplit)](
        qkv, positions, cos, sin, qn, k_norm if k_norm is not None else cos, k_cache, v_cache, pm, pl, pacc, out,
        FAULTS=range_fault_word(qkv.device), eps=float(eps), scale_log2=float(scale) * _LOG2E, chunk=p.chunk,
        pos_max=min(k_cache.shape[2], cos.shape[0]) - 1, stride_t=qkv.stride(0),
        stride_cos=cos.stride(0), stride_cb=k_cache.stride(0), stride_ch=k_cache.stride(1),
        stride_cl=k_cache.stride(2), stride_ob=out.stride(0), HKV=kv_heads, NSPLIT=p.nsplit, G=p.g, GP=p.gp, D=d,
        BLOCK_N=block_n, QK_NORM=q_norm is not None, DT=_tl_dtype(qkv.dtype), BITS=_bits(qkv.dtype),
        DOT_F32=triton_interpreting(),
        DIRECT=direct, CHAIN=chain, NEW_CACHED=bool(tiles.attn_new_cached),
        **_kv4_loop_args(qkv.dtype, packed, qkv.device),
        num_warps=ATTN_KV4_WARPS if packed else 4, **_kv_args(kv, scales, cos), **chain_launch(chain))
    if direct:
        return out
    _attn_combine_kernel[(b * heads,)](pm, pl, pacc, out, out.stride(0), heads, p.nsplit, G=p.g, GP=p.gp, SP=p.sp,
                                       D=d, DT=_tl_dtype(qkv.dtype), BITS=_bits(qkv.dtype), CHAIN=chain,
                                       num_warps=4, **chain_launch(chain))
    return out


# ---------------------------------------------------------------------------------------------- SiLU·mul


@triton.jit
def _silu_mul_kernel(GU, OUT, n, stride_g, stride_o, up_offset, BLOCK: tl.constexpr, DT: tl.constexpr,
                     CHAIN: tl.constexpr):
    chain_start(CHAIN)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(GU + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_g + up_offset + offs, mask=mask, other=0.0).to(tl.float32)
    # the same helper computes the gated inputs of act_quant / hadamard_quant (gated=True)
    tl.store(OUT + row * stride_o + offs, silu_mul_rounded(g, u, DT == tl.bfloat16).to(DT), mask=mask)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) · up`` of ``[T, 2I]`` stacked rows, in transformers' roundings."""
    i = gate_up.shape[-1] // 2
    return torch.nn.functional.silu(gate_up[:, :i]) * gate_up[:, i:]


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None, kernel: str | None = None) -> torch.Tensor:
    """``bf16(silu(gate)) · up`` of stacked ``[T, 2I]`` rows (gate first).

    Raises:
        UserInputError: an odd width, a dtype or stride the kernel cannot take.
    """
    check_tensor("gate_up", gate_up, dtypes=_HALF, dim=2)
    t, w = gate_up.shape
    if w % 2:
        raise UserInputError(f"gate_up has an odd width {w}; expected [gate | up] of equal widths")
    if resolve_kernel(kernel, gate_up.device) == "torch":
        y = silu_mul_reference(gate_up)
        return y if out is None else out.copy_(y)
    check_triton_device(gate_up.device)
    n = w // 2
    out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device) if out is None else out
    check_tensor("out", out, dtypes=(gate_up.dtype,), shape=(t, n))
    check_same_device(gate_up=gate_up, out=out)
    block = min(4096, triton.next_power_of_2(n))
    if t:
        chain = chain_mode(gate_up.device, t)
        _silu_mul_kernel[(t, triton.cdiv(n, block))](gate_up, out, n, gate_up.stride(0), out.stride(0), n,
                                                     BLOCK=block, DT=_tl_dtype(gate_up.dtype), CHAIN=chain,
                                                     num_warps=4, **chain_launch(chain))
    return out


# ---------------------------------------------------------------------------------------------- RMSNorm + 4-bit quant


@triton.jit
def _rmsnorm_quant_kernel(X, R, W, Q, SCALE, n, kp, eps, clip_ratio, stride_x, stride_r, stride_q,
                          HB: tl.constexpr, HAS_RES: tl.constexpr, DT: tl.constexpr, BITS: tl.constexpr,
                          SPLIT8: tl.constexpr, CHAIN: tl.constexpr):
    chain_start(CHAIN)  # the GEMM reading our output may start its prologue (it waits before reading)
    row = tl.program_id(0).to(tl.int64)
    norm_quant_row(X + row * stride_x, R + row * stride_r, W, Q + row * stride_q, SCALE + row, n, kp, eps, clip_ratio,
                   HB, HAS_RES, DT, BITS, SPLIT8)


def rmsnorm_quant_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                            clip_ratio: float, layout: str = "packed") -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rmsnorm_reference`, then the activation quantizer's reference (``layout`` as in act_quant)."""

    y = rmsnorm_reference(x, weight, eps, residual)
    packed, scale = quantize_activations_reference(y, clip_ratio)
    if layout == "split8":
        return split8_from_int(unpack_int4(packed, y.shape[1])), scale
    return packed, scale


def rmsnorm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                  clip_ratio: float = 1.0, layout: str = "packed",
                  kernel: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rmsnorm` and the 4-bit activation quantizer in one pass: the normalized row is never stored.

    Gives the integers and scales of ``quantize_activations(rmsnorm(x, ...))``
    (:mod:`mosaicquant.kernels.act_quant`, same layouts), for a GEMM that reads the norm's
    output directly (no online transform in between).

    Args:
        x, weight, eps, residual: as in :func:`rmsnorm` (``residual += x`` in place).
        clip_ratio: fraction of each token's absmax kept, in (0, 1].
        layout: ``"packed"`` (``uint8 [T, ceil(n/2)]``) or ``"split8"`` (``int8 [T, split8_width(n)]``).
        kernel: kernel preference.

    Returns:
        ``(q, scale)``: the quantized activations and ``float32 [T]`` scales.

    Raises:
        UserInputError: what :func:`rmsnorm` rejects, a clip ratio outside (0, 1], an unknown layout.
    """
    t, n = _check_norm_inputs(x, weight, residual)
    if layout not in LAYOUTS:
        raise UserInputError(f"layout={layout!r} is not allowed: choose one of {', '.join(LAYOUTS)}")
    if not isinstance(clip_ratio, (int, float)) or not 0.0 < float(clip_ratio) <= 1.0:
        raise UserInputError(f"clip_ratio={clip_ratio!r} is out of range: allowed (0, 1]")
    if resolve_kernel(kernel, x.device) == "torch":
        return rmsnorm_quant_reference(x, weight, eps, residual, clip_ratio, layout)
    check_triton_device(x.device)
    kp = (n + 1) // 2
    if layout == "split8":
        q = torch.empty(t, split8_width(n), dtype=torch.int8, device=x.device)
    else:
        q = torch.empty(t, kp, dtype=torch.uint8, device=x.device)
    scale = torch.empty(t, dtype=torch.float32, device=x.device)
    if t:
        hb = max(64, triton.next_power_of_2(kp))
        res = residual if residual is not None else x
        chain = chain_mode(x.device, t)
        _rmsnorm_quant_kernel[(t,)](
            x, res, weight, q.view(torch.int8), scale, n, kp, float(eps), float(clip_ratio), x.stride(0),
            res.stride(0), q.stride(0), HB=hb, HAS_RES=residual is not None, DT=_tl_dtype(x.dtype),
            BITS=_bits(x.dtype), SPLIT8=layout == "split8", CHAIN=chain, **chain_launch(chain),
            num_warps=4 if hb <= 1024 else (8 if hb <= 4096 else 16))  # act_quant's rule
    return q, scale
