"""Several programs per token for the activation quantizers at decode sizes: the rule and the barrier.

At decode sizes (a few tokens) the quantizers' one program per token leaves most SMs idle: at
batch 4 the fused Hadamard + quantizer of a 14336-wide row ran 17-18 µs on 4 of the H200's
132 SMs. Split over ``P`` programs ("programs per token"), each
program transforms and quantizes one slice of the row. The token's scale needs the absmax of
the whole row, so its ``P`` programs meet once, at a barrier in global memory
(:func:`row_absmax`). Each token has ``TOKEN_WORDS`` ``int64`` words in :func:`barrier_buffer`:

- word 0, the token's epoch: how many split launches it has been through (mod ``2**31``);
- word ``1 + s``, program ``s``'s slot: ``tag << 32 | bits``, with ``bits`` its slice's absmax
  (a non-negative fp32, as an integer) and ``tag`` the launch's epoch, ``epoch + 1``.

A program reads the epoch as it starts (the load's latency hides behind its own work), writes
its slot, and reads the token's ``P`` slots until every one carries its launch's tag; their
maximum is the row's absmax. Program 0 then writes the new epoch: every program of the launch
has read the old one by then (each slot holds a tag computed from it). Each slot is written in
one 64-bit store and read back whole, so its tag vouches for its value: the barrier needs no
fences and no reset, and costs about one round trip to L2. A slot is only ever written by its
own token, so a stale slot's tag is at most the epoch (it could alias only after ``2**31``
launches that leave that slot unused).

The spin is safe only if all ``P`` programs of a token are resident at once. Launchers split
only where ``M · P`` programs fit one per SM (:func:`check_programs_per_token`), with the grid
token-major (program ``token · P + s``), on one stream (launches on several streams at once
would share the words). Triton's interpreter runs programs one after another, so a waiting
program would wait for ever: there ``P`` is 1. With ``P = 1`` the kernels never touch the barrier.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mosaicquant.errors import UserInputError
from mosaicquant.kernels._common import triton_interpreting
from mosaicquant.kernels._tiles import _sm_count, persistent_zeros
from mosaicquant.kernels._tl import sym_scale

__all__ = ["SPLIT_MAX_M", "MAX_PROGRAMS_PER_TOKEN", "TOKEN_WORDS", "sm_count", "barrier_buffer",
           "default_programs_per_token", "check_programs_per_token", "resolve_programs_per_token", "check_num_warps",
           "barrier_tag", "row_absmax", "token_scale", "token_slice"]

# The default rule splits tokens only at decode sizes: larger calls already fill the GPU.
SPLIT_MAX_M = 32
# The most programs a token can have (one barrier slot each).
MAX_PROGRAMS_PER_TOKEN = 16
# int64 barrier words per token: the epoch, then one slot per program.
TOKEN_WORDS = 1 + MAX_PROGRAMS_PER_TOKEN
WARPS = (1, 2, 4, 8, 16, 32)
_TOKEN_WORDS = tl.constexpr(TOKEN_WORDS)

def sm_count(device: torch.device) -> int | None:
    """SMs of a CUDA ``device``; ``None`` where programs do not run side by side (CPU, the interpreter)."""
    if device.type != "cuda" or triton_interpreting():
        return None
    return _sm_count(device)


def barrier_buffer(device: torch.device) -> torch.Tensor:
    """The per-device barrier words: ``int64 [SMs · TOKEN_WORDS]`` (a split launch has fewer tokens than SMs).

    Zeroed once (:func:`mosaicquant.kernels._tiles.persistent_zeros`); the barrier needs no reset
    between launches.
    """
    return persistent_zeros("token barriers", _sm_count(device) * TOKEN_WORDS, torch.int64, device)


def default_programs_per_token(m: int, width: int, sms: int | None, min_width: int,
                               most: int = MAX_PROGRAMS_PER_TOKEN, min_row: int = 0) -> int:
    """Programs per token of a launch of ``m`` tokens of ``width`` values, by default.

    The largest power of two ``P <= most`` with ``m · P <= sms`` (every program on its own SM)
    and slices of at least ``min_width`` values (``width / P``); 1 for ``m > SPLIT_MAX_M``, for
    rows narrower than ``min_row`` (too short for the barrier to pay), and where ``sms`` is
    ``None`` (no GPU: the interpreter runs one program at a time).
    """
    if sms is None or m > SPLIT_MAX_M or width < min_row:
        return 1
    p = 1
    while 2 * p <= most and m * 2 * p <= sms and width // (2 * p) >= min_width:
        p *= 2
    return p


def check_programs_per_token(p: object, m: int, sms: int | None, most: int | None = None, why: str = "") -> int:
    """The caller's ``programs_per_token`` once checked; returns it.

    Args:
        p: the value given.
        m: tokens of the launch.
        sms: the GPU's SM count; ``None`` under the interpreter (or without a GPU), where only 1 runs.
        most: the kernel's own limit (``None``: none), with ``why`` it has it.

    Raises:
        UserInputError: naming the value and what is allowed.
    """
    if isinstance(p, bool) or not isinstance(p, int) or p < 1 or p & (p - 1):
        raise UserInputError(f"programs_per_token={p!r} is not allowed: choose a positive power of two (1, 2, 4, ...)")
    if p == 1:
        return 1
    if most is not None and p > most:
        raise UserInputError(f"programs_per_token={p} is too large for this input: at most {most} ({why})")
    if p > MAX_PROGRAMS_PER_TOKEN:
        raise UserInputError(f"programs_per_token={p} is too large: at most {MAX_PROGRAMS_PER_TOKEN} (one barrier "
                             f"slot each)")
    if sms is None:
        raise UserInputError(
            f"programs_per_token={p} needs a CUDA device: its programs wait for each other, and Triton's interpreter "
            f"runs them one after another; only 1 is allowed here")
    if m * p > sms:
        raise UserInputError(
            f"programs_per_token={p} with {m} tokens needs {m * p} programs running at once, more than the GPU's "
            f"{sms} SMs: allowed M · P <= {sms}, here P <= {max(1, sms // m)}")
    return p


def resolve_programs_per_token(p: int | None, m: int, device: torch.device, width: int, min_width: int,
                               most: int | None = None, why: str = "", min_row: int = 0) -> int:
    """``p`` once checked (:func:`check_programs_per_token`), or the default rule's choice when it is ``None``.

    ``width``, ``min_width``, ``min_row``: values per token, the default rule's least slice and
    least row (:func:`default_programs_per_token`); ``most``: the kernel's own limit on ``P``
    (``why``: the reason, for the error).
    """
    sms = sm_count(device)
    if p is None:
        cap = MAX_PROGRAMS_PER_TOKEN if most is None else min(most, MAX_PROGRAMS_PER_TOKEN)
        return default_programs_per_token(m, width, sms, min_width, cap, min_row)
    return check_programs_per_token(p, m, sms, most, why)


def check_num_warps(num_warps: object) -> None:
    """A caller's ``num_warps``: ``None`` or one of :data:`WARPS`.

    Raises:
        UserInputError: naming the value and what is allowed.
    """
    if num_warps is not None and (isinstance(num_warps, bool) or num_warps not in WARPS):
        raise UserInputError(f"num_warps={num_warps!r} is not allowed: choose one of {', '.join(map(str, WARPS))}")


@triton.jit
def barrier_tag(sync_ptr, row):
    """This launch's tag at token ``row``'s barrier: its epoch + 1, mod ``2**31``.

    Call it as the program starts; nothing waits on the load until :func:`row_absmax`.
    """
    return (tl.load(sync_ptr + row * _TOKEN_WORDS, volatile=True) + 1) & 0x7FFFFFFF


@triton.jit
def row_absmax(sync_ptr, row, local_max, s, tag, P: tl.constexpr):
    """The absmax of token ``row``'s row, from each of its ``P`` programs' ``local_max`` (fp32, >= 0).

    ``sync_ptr``: :func:`barrier_buffer`; ``s``: this program's index among the token's; ``tag``:
    :func:`barrier_tag`'s. Publishes ``local_max`` in slot ``s`` and waits until the ``P`` slots all
    carry ``tag`` (module docstring). The slot is written with a relaxed ``gpu``-scope exchange and
    read with volatile loads (from L2, never a stale L1 line); nothing else is read through the
    barrier, so no ordering is needed.
    """
    token_ptr = sync_ptr + row * _TOKEN_WORDS
    word = (tag.to(tl.int64) << 32) | local_max.to(tl.int32, bitcast=True).to(tl.int64)
    tl.atomic_xchg(token_ptr + 1 + s, word, sem="relaxed", scope="gpu")
    slots_ptr = token_ptr + 1 + tl.arange(0, P)
    slots = tl.load(slots_ptr, volatile=True)
    while tl.min(((slots >> 32) == tag).to(tl.int32), axis=0) == 0:
        slots = tl.load(slots_ptr, volatile=True)
    if s == 0:
        tl.atomic_xchg(token_ptr, tag.to(tl.int64), sem="relaxed", scope="gpu")
    return tl.max((slots & 0x7FFFFFFF).to(tl.int32), axis=0).to(tl.float32, bitcast=True)


@triton.jit
def token_scale(local_max, clip_ratio, sync_ptr, row, s, tag, P: tl.constexpr, SYNC: tl.constexpr):
    """Token ``row``'s quantization scale, ``absmax · clip / 7`` (IEEE division; 1 for an all-zero row, NaN for a
    row holding NaN or Inf: :func:`mosaicquant.kernels._tl.sym_scale`).

    ``local_max``: the absmax of this program's slice (NaN where it holds a NaN). With ``P > 1`` the row's absmax comes from
    :func:`row_absmax` (``SYNC``) or, without ``SYNC``, is read from ``sync_ptr[row]`` (given: the
    interpreter's tests, whose programs cannot wait for each other).
    """
    absmax = local_max
    if P > 1:
        if SYNC:
            absmax = row_absmax(sync_ptr, row, local_max, s, tag, P)
        else:
            absmax = tl.load(sync_ptr + row)
    return sym_scale(absmax, clip_ratio, 7.0)


@triton.jit
def token_slice(sync_ptr, P: tl.constexpr, SYNC: tl.constexpr):
    """``(row, s, tag)`` of this program (program ``row · P + s``): its token, its slice, and the
    :func:`barrier_tag` of the launch (0 where there is no barrier: ``P = 1`` or no ``SYNC``)."""
    pid = tl.program_id(0)
    tag = 0
    if P > 1:
        if SYNC:
            tag = barrier_tag(sync_ptr, (pid // P).to(tl.int64))
    return (pid // P).to(tl.int64), pid % P, tag
