"""Tile configurations of the 4-bit GEMM kernels and the heuristic that picks one.

Sizes are in *packed* K: ``block_kp`` bytes of a row hold ``2 * block_kp`` K elements.
The heuristic is a small table by M (the kernels are memory-bound at small M and
tensor-core-bound at large M); ``benchmarks/kernels/zipper.py`` measures the choices, and the
comments beside each rule give the measurements behind it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from mosaicquant.errors import UserInputError
from mosaicquant import settings
from mosaicquant.kernels.tile_table import table_for

__all__ = ["TileConfig", "pick_config", "LOCK_SLOTS", "PREFETCH_MAX_M", "SWAP_MIN_M", "SWAP_MIN_TILES_PER_SM",
           "SWAP_DECODE_M", "GEMV_ROUTE_MAX_M", "DP4A_WALK_MAX_M", "PARALLEL_MIN_M", "PARALLEL_MAX_SPLIT", "PARALLEL_MAX_BLOCKS_PER_ROW", "SWAP_DECODE_BLOCK_KP",
           "SWAP_DECODE_STAGES", "DECODE_SPLIT_MIN_STEPS", "DENSE_PREFETCH_MIB", "ZIPPER_PREFETCH_MIB",
           "TAIL_WIDE_K_MIN_M", "TAIL_WIDE_K_MAX_M", "walk_stages",
           "wide_decode",
           "parallel_mode", "parallel_residual",
           "pdl_default", "pdl_launch", "prefetch_default", "prefetch_row_bytes", "swapped_decode_config",
           "swapped_prefill", "swapped_mid_config", "SWAP_MID_TILES"]

# Size of the per-device split-K counter buffer (int32 slots, one per output tile).
LOCK_SLOTS = 1 << 16
# With programmatic dependent launch, GEMMs of up to this many rows prefetch their weights into
# L2 before waiting for their inputs (decode sizes; larger M re-reads each weight tile anyway).
PREFETCH_MAX_M = 256
# Where launches use programmatic dependent launch by default, and where they also prefetch their
# weights into L2 while they wait. Measured on the H200 against the same launches without PDL
#: PDL alone gains 3-11% at M <= 4 on every Llama-3 / Qwen3
# linear, and at M = 8 on weights of up to 32 MiB packed (the 48-56 MiB gate/up lost 0-13% there);
# at M >= 16 it loses up to 16%. The L2 prefetch on top gains a further ~5% on the long-K
# down_proj rows (K >= 8192, 24-28 MiB), loses 3-7% on K = 4096 weights, and 15-26% once the
# weights outgrow what L2 keeps (prefetched lines are evicted before use).
PDL_MAX_M = 8
PDL_ANY_SIZE_MAX_M = 4
PDL_MAX_WEIGHT_BYTES = 32 * 2**20
PREFETCH_MIN_KP = 4096
# The dense W4A4 GEMM's default cap. In the decode step with every kernel chained by PDL
#, an 8 MiB prefetch on every launch took RTN's Llama-3-8B step
# 4.0 / 3.3 % and QuaRot's 1.4 / 3.9 % down at batch 4 / 8 against prefetch_default's rule
# (16 and 32 MiB gained less; ZipperEngine's launches were 2 % slower with it at batch 4 and
# keep the rule).
DENSE_PREFETCH_MIB = 8.0
# ZipperEngine's default cap (its residual blocks are prefetched whole as well while the prefetch is on).
# In MosaicQuant's decode step (Llama-3-8B shapes, CUDA graph, medians of 3 interleaved rounds, us at
# batch 4 / 8 / 16): 8 MiB 2,874 / 3,071 / 3,429 against prefetch_default's rule 2,942 / 3,127 / 3,429, no
# prefetch 2,899 / 3,077 / 3,426 and 16 MiB 2,909 / 3,101 / 3,428 (before the parallel modes' row
# walk and gated fix-up, had found 8 MiB 2 % slower at batch 4).
ZIPPER_PREFETCH_MIB = 8.0


def pdl_default(m: int, n: int, kp: int) -> bool:
    """Whether an ``[m, 2*kp] x [n, 2*kp]^T`` GEMM uses programmatic dependent launch by default."""
    return m <= PDL_ANY_SIZE_MAX_M or (m <= PDL_MAX_M and n * kp <= PDL_MAX_WEIGHT_BYTES)


def prefetch_default(n: int, kp: int) -> bool:
    """Whether a PDL launch over ``[n, 2*kp]`` weights prefetches them into L2 by default (long rows that fit L2)."""
    return kp >= PREFETCH_MIN_KP and n * kp <= PDL_MAX_WEIGHT_BYTES


# Calls of at least this many tokens may run the operand-swapped prefill GEMM (QuantLinear), when
# its 128 x 128 output tiles fill the GPU (swapped_prefill). Measured against the packed-activation
# GEMM on every Llama-3 / Qwen3 linear at M = 128 ... 8192 in one run: with 96 or more tiles
# (0.7 per SM of the H200) the dense swapped GEMM was 1.07-1.63x faster, with 64 or fewer 0.55-0.97x;
# with residual blocks in its tail it needs 192 or more (1.03-1.30x faster; 0.48-0.87x at <= 128).
# From 65 tokens: only the wide layers (gate/up) have that many tiles below 128 tokens, where the packed
# kernel's two 64-row token tiles read their 48-56 MiB of weights twice (Llama-3-8B gate/up at 96 tokens
# 1.10x BF16 against 1.69x at 64 and 1.72x at 128).
SWAP_MIN_M = 65
SWAP_MIN_TILES_PER_SM = {"dense": 0.7, "residual": 1.2}
# Dense layers (no residual) also run calls of this many tokens on the swapped GEMM, at decode
# tiles (swapped_decode_config): measured against the packed kernel with the same unpacking on
# every Llama-3 / Qwen3 linear in one run: 1.12-1.19x faster on gate/up, 1.02-1.06x on
# down_proj, 0.99-1.03x on q/k/v and o_proj at M = 16 and 32; at M <= 8 no tile of it was faster
# on every shape.
SWAP_DECODE_M = (16, 32)
# ... except calls of TileTable.wide_k_decode_min_m to 16 tokens (one 16-row tile; 0: none), which stay on the packed
# kernel: gate/up on its wide tiles, and 64-channel layers (q/k/v, o, down) on 256-byte K steps at a quarter
# of the 64-byte tiles' split (as many steps a program, four times the bytes a step; layers without residual
# blocks only: ZipperEngine's tail walk deals a block row's kept blocks over the splits). GEMM alone at M = 16
# (Llama-3-8B, us): q/k/v 7.48, o 6.84, down 12.36, gate/up 20.25 against 8.47 / 7.77 / 13.85 / - on the
# 64-byte tiles and 8.49 / 7.84 / 13.89 / 21.16 on the swapped GEMM; at M = 12 7.38 / 6.73 / 12.32 against
# 7.97 / 7.27 / 13.36; at M = 8 within -0.4 / +9 %, at M = 4 slower. In the decode step at batch 16:
# QuaRot 3,140 -> 3,025 us, RTN 2,952 -> 2,826.
# ZipperEngine's tail walk on 64-channel tiles split K at least 8 ways (o, down) takes 128-byte K steps at
# the same split for calls of TAIL_WIDE_K_MIN_M to 16 tokens (0: never; below it the dp4a walk, which was
# slower with them). GEMM alone (Llama-3-8B, M = 8 / 12 / 16, M = 16 in another run, us): down_proj
# 15.64 / 14.72 / 15.05 against 17.06 / 16.14 / 16.19; o_proj 8.85 / 8.25 / 8.55 against 8.81 / 8.58 / 8.59.
# MosaicQuant's decode step at batch 8 / 16: 3,048 / 3,411 -> 3,039 / 3,366 us.
TAIL_WIDE_K_MIN_M = 5
# ... up to this many tokens (16 at least). At M = 32 (32-row tiles) the 128-byte steps were slower: down
# 23.90 us against 20.03, o 14.49 against 12.30; MosaicQuant's batch-32 step 4,487 -> 4,695 us.
TAIL_WIDE_K_MAX_M = 16
# Split-K at decode doubles the split while the programs cover the SMs less than twice and each program would keep
# at least this many K steps: the swapped GEMM's decode tiles (256 K values a step), the packed kernel's calls of
# 17-64 tokens (128 a step) and its other calls (DECODE_SPLIT_MIN_STEPS: its splits measured fastest at 1-16
# tokens; in the decode step at batch 4 / 8 / 16, 8 was level and 16 4-9 % slower for RTN, QuaRot and MosaicQuant). On the
# Llama-3-8B linears at 17-32 tokens, 8 rather than 2 takes the swapped GEMM's q/k/v from split 4 to 2, o from 8 to
# 2 and down from 8 to 4; 8 rather than 4 takes ZipperEngine's o from split 8 to 4 (its q/k/v, down and gate/up keep
# theirs). Decode step (CUDA graph, 2 interleaved rounds, us at batch 17 / 24 / 32): QuaRot 3,522 / 3,570 /
# 3,456 at 2, 3,450 / 3,483 / 3,382 at 4, 3,296 / 3,302 / 3,280 at 8; MosaicQuant 3,569 / 3,695 / 3,900 at 4,
# 3,503 / 3,626 / 3,815 at 8.
DECODE_SPLIT_MIN_STEPS = 4
# Mid-sized calls, between the decode tiles and the swapped prefill GEMM's 128 x 128 tiles: a call of at least
# TileTable.swap_mid_min_m tokens (a dense layer, ahead of swapped_prefill) or TileTable.swap_mid_residual_min_m (residual blocks with
# power-of-two scales, the shared walk, where swapped_prefill does not take it; 0: never) runs the swapped GEMM on
# the tiles of swapped_mid_config where the layer is short of output tiles (fewer than SWAP_MID_TILES' max_tiles_per_sm a SM);
# the other calls keep the packed kernels. Chosen from a grid of tiles and splits timed on every Llama-3 / Qwen3
# linear at M = 64 / 128 / 256 / 512 / 1024, benchmarks/prototypes/mid_m.py), where the packed
# kernels had left q/k/v, o and down_proj at 0.73-0.98x BF16 (dense, 64-256 tokens) and 0.50-0.73x (10 %
# residual, 128-512). Against the routes before, on the same linears at 40-1024 tokens: 0.68-0.97x the time
# (dense), 0.65-1.01x (residual).
# Dense layers' calls of at least this many tokens take the mid route's wide tier (128 weight rows x 64 tokens; 0:
# never), ahead of the prefill tiles, where it gives fewer than its max_tiles_per_sm. Grid at 160-768 tokens (
# GEMM alone, against the prefill tiles' 128 x 128): down_proj at 320 / 384 tokens 49.4 / 52.0 us (split 2) against
# 72.9 / 74.4, q/k/v at 320 22.3 against 27.7, o at 320-768 3-8 % less; at 1024 tokens (512 tiles) o and down
# were 1.45-1.56x slower on it, hence the bound.
# Per kind of layer: the tiles' weight rows, packed K bytes a step, warps and stages; the output tiles per SM from
# which a call keeps its other route; the programs per SM that split-K aims at; the K steps a program keeps.
SWAP_MID_TILES = {
    "dense": {"block_n": 64, "block_kp": 128, "num_warps": 4, "num_stages": 4, "max_tiles_per_sm": 2.9,
              "cover": 1.5, "min_steps": 16},
    "dense_wide": {"block_n": 128, "block_kp": 64, "num_warps": 8, "num_stages": 3, "max_tiles_per_sm": 3.0,
                   "cover": 1.5, "min_steps": 16},
    "residual": {"block_n": 128, "block_kp": 64, "num_warps": 8, "num_stages": 3, "max_tiles_per_sm": 1.0,
                 "cover": 1.0, "min_steps": 8},
}


def swapped_mid_config(m: int, n: int, kp: int, device: torch.device, residual: bool) -> dict | None:
    """Tiles (keyword arguments of ``w4a4_gemm_swapped_triton``) of a mid-sized swapped GEMM, or ``None`` where
    the call keeps its other route (too few tokens, or enough output tiles for the packed kernels).

    Dense layers: 64 weight rows x 32 tokens (up to 64 tokens) or 64, 256 K values a step, 4 warps, 4 stages; from
    :attr:`~mosaicquant.kernels.tile_table.TileTable.swap_mid_wide_min_m` tokens 128 weight rows x 64 tokens, 128 K values a step, 8 warps, 3 stages.
    Layers with residual blocks (the shared walk): 128 weight rows x 64 tokens (up to 256) or 128, 128 K values
    a step, 8 warps, 3 stages. K split while the programs cover the SMs less than ``cover`` times and each keeps
    ``min_steps`` K steps.
    """
    table = table_for(device)
    min_m = table.swap_mid_residual_min_m if residual else table.swap_mid_min_m
    if not 0 < min_m <= m:
        return None
    if residual:
        kind, block_m = "residual", 64 if m <= 256 else 128
    elif 0 < table.swap_mid_wide_min_m <= m:
        kind, block_m = "dense_wide", 64
    else:
        kind, block_m = "dense", 32 if m <= 64 else 64
    t = SWAP_MID_TILES[kind]
    tiles = -(-n // t["block_n"]) * -(-m // block_m)
    sms = _sm_count(device)
    if tiles >= t["max_tiles_per_sm"] * sms:
        return None
    split = _decode_split(tiles, -(-kp // t["block_kp"]), device, t["min_steps"], cover=t["cover"], max_split=8)
    return {"block_n": t["block_n"], "block_m": block_m, "block_kp": t["block_kp"], "split_k": split,
            "num_warps": t["num_warps"], "num_stages": t["num_stages"]}


# A swapped GEMM call on the prefill or mid tiles whose tokens leave a remainder of at most TileTable.swap_tail_max_fraction of a
# token tile over a whole number of tiles (at least one), where full-size tiles would pad the call by at least
# TileTable.swap_tail_min_padding of their tokens, runs its last token tile narrower (w4a4_gemm_swapped_triton's block_m_tail:
# the remainder rounded up to a power of two, at least 16; TileTable.swap_tail_max_fraction 0: never). At 160 tokens on
# 128-token tiles the second tile's programs would otherwise multiply 96 padding rows (Llama-3-8B gate/up: 1.11x
# BF16 at 160 tokens against 1.72x at 128). QuantLinear with and without it on the six Llama-3 / Qwen3 linears at
# 40-800 tokens: 0.87-1.00x the time where it applies, dense and with the 10 % residual
# (gate/up at 144-160 tokens 0.87-0.93x, down_proj's mid tiles at 80 0.87-0.94x), the other calls 0.99-1.01x. Where
# full tiles pad only 4-11 % a tail was mixed (q/k/v at 800 tokens 1.05x, gate/up at 2080 1.05-1.18x): hence the bound.


def swapped_tail(m: int, block_m: int, *, device: torch.device) -> int | None:
    """``block_m_tail`` of a swapped GEMM call of ``m`` tokens on ``block_m``-token tiles, or ``None`` (every token
    tile ``block_m``): see :attr:`~mosaicquant.kernels.tile_table.TileTable.swap_tail_max_fraction`."""
    table = table_for(device)
    r = m % block_m
    if not table.swap_tail_max_fraction or m < block_m or r == 0:
        return None
    if (block_m - r) < table.swap_tail_min_padding * (m - r + block_m):
        return None  # full-size tiles pad the call by little
    tail = max(16, 1 << (r - 1).bit_length())
    return tail if tail < block_m and tail <= table.swap_tail_max_fraction * block_m else None


# The swapped GEMM's decode tiles: packed K bytes a step and software-pipeline stages. With the 8-step split, RTN's and
# QuaRot's step at batch 24 / 32 (2 interleaved rounds, us): 128 bytes and 4 stages 3,077 / 3,150 and 3,336 /
# 3,296; 3 or 5 stages 1-3 % slower; 64 bytes (16 steps) 11-13 % slower; 256 bytes (4 steps) level to 1.5 % slower,
# with 3 stages level.
SWAP_DECODE_BLOCK_KP = 128
SWAP_DECODE_STAGES = 4
# A layer of at least this many 64-channel tiles per SM runs its calls of 2-16 tokens (one 16-row
# tile) on 128 x 128-byte tiles, 8 warps, 3 stages, unsplit. Measured against the default tiles (64 x 64
# bytes, 4 warps, 4 stages, split-K to two programs per SM) on o, gate/up and down at M = 4 and 8 in one
# run: 1.15x faster on gate/up (28672 x 4096, 448 tiles); no faster on o or down, where split-K is
# what fills the GPU. ZipperEngine takes them too since its tail walk steps through the blocks on its
# own (128-byte dense steps over 64-byte block columns): 1.08-1.14x faster on gate/up with 10 % of
# 128 x 128 blocks at M = 2-16; cut to 64-byte steps to nest in the blocks they had been
# 1.10-1.20x slower.
WIDE_DECODE_TILES_PER_SM = 2
# The wide tiles' software-pipelining depth and K step (packed bytes of a weight row a step), and the 64-channel
# decode tiles' depth (calls of at most 64 tokens on the packed kernels); read when a call picks its tiles. More bytes
# in flight did not pay (benchmarks/kernels/decode_depth.py: QuantLinear on the Llama-3-8B linears at M = 4-32, dense and
# with 10 % kept blocks, 3 interleaved rounds, time / the defaults; the layers whose kernels a variant leaves alone
# read 0.98-1.04): on gate/up 4 wide stages 0.96-0.99 dense and 0.99-1.03 with the blocks, 5 stages 0.99-1.02 and
# 1.00-1.10, 256-byte steps 0.99-1.01 and 1.10-1.16; on q/k/v, o and down a 64-channel depth of 3 0.93-1.08, of 6
# 0.99-1.12. Every variant gave the defaults' bits.
# ZipperEngine's layers (residual blocks) take the wide tiles for calls of 17 to this many tokens too, on
# 32-row tiles (dense layers run those calls on the swapped GEMM). Llama-3-8B gate/up at M = 32 (GEMM
# alone): 29.79 us against 32.83 on the 64-channel tiles; MosaicQuant's batch-32 step 4,487 -> 4,407 us.
# Dense layers (no residual blocks) take them for calls of 17 to TileTable.dense_wide_max_m tokens (16: none; those calls then
# run the swapped GEMM at decode tiles, SWAP_DECODE_M) where the layer has at least TileTable.dense_wide_min_tiles_per_sm of the
# wide tiles' 128 channels a SM. GEMM alone (32-row wide tiles against the swapped GEMM, M = 17 / 24 / 32, us):
# Llama-3-8B gate/up (28672 channels, 1.70 tiles a SM) 21.73 / 21.89 / 22.87 against 28.63 / 24.69 / 25.51, Qwen3-8B
# gate/up (24576, 1.45) 21.10 / 21.21 / 21.46 against 24.10 / 20.80 / 21.06. Decode step (CUDA graph, 3 interleaved
# rounds, batch 17 / 24 / 32, us): Llama-3-8B QuaRot 3,272 / 3,307 / 3,287 -> 3,178 / 3,226 / 3,265 and RTN 2,986 /
# 3,076 / 3,149 -> 2,906 / 2,971 / 3,111; Qwen3-8B QuaRot 3,531 / 3,542 / 3,566 -> 3,545 / 3,571 / 3,634 and RTN
# 3,202 / 3,261 / 3,337 -> 3,180 / 3,268 / 3,417, hence the bound between the two layers. And at most
# TileTable.dense_wide_max_tiles_per_sm of them a SM: two of these 8-warp programs share an SM (128 registers a thread), so
# above two tiles a SM the last ones run in a second wave. GEMM alone (M = 17 / 24 / 32, us): Qwen3-14B gate/up
# (34816 x 5120, 2.06 tiles a SM) 40.68 / 40.70 / 39.79 wide against 33.94 / 33.86 / 33.67 swapped, Qwen3-32B gate/up
# (51200 x 5120, 3.03) 48.50 / 48.67 / 51.25 against 44.90 / 49.17 / 46.99.
# Since the swapped GEMM multiplies a K step in one dot (w4a4_gemm.JOINED_DOT) the bound is 16 (the wide tiles
# for no dense call above 16 tokens): QuaRot's Llama-3-8B decode step at batch 24 / 32 ran 3,191 / 3,241 us with
# gate/up on the wide tiles and 3,146 / 3,176 on the swapped GEMM (2 interleaved rounds); the swapped GEMM alone took
# 20.1 / 21.5 us at 24 / 32 tokens there. The only SPEC layer inside the bounds below is Llama-3-8B's gate/up (1.70
# tiles a SM); Qwen3-8B and Qwen3-14B steps were level under both bounds (their gate/up lie outside them).
# Calls of up to this many tokens run the decode GEMV (CUDA-core dp4a, mosaicquant.kernels.gemv)
# instead of the tensor-core GEMMs. Measured on every Llama-3 / Qwen3 linear in one run: at
# M = 1 it was 1.77-3.05x BF16 against the tensor-core kernel's 1.64-2.30x; at M = 4 its dp4a work
# (two instructions a word per token) made it slower on every shape but gate/up.
GEMV_ROUTE_MAX_M = 1
# ZipperEngine's tail walks its residual blocks on dp4a (mosaicquant.kernels.gemv.residual_dp4a) up to
# this many tokens, on int8 tensor-core dots above. Measured against each other on every Llama-3 / Qwen3
# linear in one run: the dp4a walk was 1.01-1.14x faster at M = 1, 0.97-1.05x at M = 2, 0.99-1.08x
# at M = 4 (the gain on the gate/up shapes), and 0.92-1.02x at M = 8.
DP4A_WALK_MAX_M = 4


# Software-pipelining depth of ZipperEngine's walks over a block row's kept blocks on tensor-core dots (the
# tail walk, the parallel mode's row walk; ``tl.range(num_stages=...)``; 0: the launch's num_stages), for
# calls of TileTable.walk_stages_min_m tokens or more. A block's column comes from a load, so its activation tile
# hangs on a load chain: compiled for sm_90 (the row walk on gate/up's wide tiles, 8 warps, 3 stages) up to
# 4 stages leave its tiles in one buffer, and a block's loads start only after the block before was
# multiplied; from 5 two buffers let the next block load during the product. MosaicQuant's decode step
# (Llama-3-8B shapes, CUDA graph, 3 interleaved rounds, us, at batch 4 / 8 / 16 / 32):
# the default 2,723 / 2,916 / 3,163 / 4,104, 4 stages 2,723 / 2,918 / 3,148 / 4,087, 5 stages
# 2,715 / 2,938 / 3,152 / 3,999: -2.6 % at 32 (its 32-row tiles walk on every layer), +0.8 % at 8. From 17
# tokens only (another run, batch 8 / 24 / 32): 2,931 / 3,883 / 4,090 with none, 2,929 / 3,793 / 3,990 with
# 5 stages, 2,930 / 3,783 / 3,988 with 6.
# ZipperEngine's tail walk on tensor-core dots loads the first kept block a program walks (its coordinates, integers,
# scales and activation tile) before the dense loop in calls of at most this many tokens (0: never), where a block is
# one step of the walk (read at each launch; the same bits). Under programmatic dependent launch all but the
# activation tile load before the wait on the kernel before. MosaicQuant's decode step (Llama-3-8B shapes, CUDA graph,
# 3 interleaved rounds, us): at batch 4 / 8 / 16 2,744 / 2,905 / 3,164 without, 2,733 /
# 2,845 / 3,163 up to 8 tokens, 2,742 / 2,849 / 3,173 up to 16; at every size (another run) batch 32 3,812 -> 4,126
# (gate/up's 8-warp tiles at 32 tokens: 128 -> 172 registers a thread, two waves). Its tail calls at 5-8 tokens are
# o_proj and down_proj. GEMM alone, without PDL, it was level to 5 % slower at 8-32 tokens.

# ZipperEngine's "auto" mode runs the kept blocks in programs of their own ("parallel": one per block
# and 64- or 128-row slice, summed into the dense tiles' counted fix-up) for calls of PARALLEL_MIN_M to
# TileTable.parallel_max_m tokens in one tile of tokens, on layers whose tiles split K at most PARALLEL_MAX_SPLIT
# ways. Measured against the tail walk on the Llama-3-8B linears at M = 1-16 in one run: q/k/v
# (split 4) 1.03-1.08x faster at M = 4-16, gate/up (unsplit, wide tiles) 1.03-1.06x; o_proj 1.08-1.14x
# and down_proj 1.24-1.30x slower (split 8: 8 dense partials and ~3 / ~11 block partials a tile to
# sum); at M = 2 the dp4a tail walk was 1.10x faster on gate/up.
# With K split 4 ways (tiles given explicitly), o_proj's parallel mode ran level with the
# default tail walk (split 8) at M = 4 and 1.14x faster at M = 8, down_proj's 1.47-1.75x slower at
# M = 2-8: its tiles sum ~11 block partials (14336 / 128 block columns at 10 %), o's ~3; hence also
# at most PARALLEL_MAX_BLOCKS_PER_ROW kept blocks per block row on average.
# At 32 tokens (GEMM alone) the parallel modes were slower than the tail walk on every layer (q/k/v
# 13.36 / 12.51 against 11.69 us, o 15.63 / 13.62 against 12.23, gate/up 36.81 / 32.88 against 32.18).
PARALLEL_MIN_M = 4
PARALLEL_MAX_SPLIT = 4
PARALLEL_MAX_BLOCKS_PER_ROW = 6.0
# Which parallel mode "auto" runs: one program per block row walking its kept blocks ("parallel_rows")
# on tiles that split K at most TileTable.parallel_rows_max_split ways, else one program per kept block
# ("parallel"). GEMM alone (M = 2-16): on gate/up (unsplit) the row walk was 1.00-1.06x faster,
# on q/k/v (split 4) 1.17-1.25x slower; in the decode step with the row walk on gate/up only,
# MosaicQuant's batch-4 / 8 / 16 step 3,109 / 3,244 / 3,546 -> 2,994 / 3,225 / 3,503 us.


# A layer without residual blocks writes SiLU·mul of a stacked [gate | up] call of 2 to this many tokens
# from its dense GEMM's counted fix-up of each gate tile and its up tile, as ZipperEngine's parallel modes
# do (QuantLinear.writes_gated; the fused decoder, BF16; 0: never, the SiLU·mul kernel runs), on the
# packed kernel even where the swapped GEMM would take the call (SWAP_DECODE_M). GEMM alone, Llama-3-8B
# gate/up: 21.07 / 21.60 us at M = 4 / 16 against 22.53 / 23.98 for the GEMM and the SiLU·mul
# kernel, and the swapped GEMM's 20.83 at M = 16 before its SiLU·mul kernel. QuaRot's decode step (CUDA
# graph, 3 interleaved rounds, batch 4 / 8 / 16, us): 2,551 / 2,788 / 3,205 without, 2,474 / 2,712 / 3,098
# with it up to 16 tokens (3,195 at batch 16 up to 15 tokens, the swapped GEMM then taking 16).
# The swapped GEMM's prefill and mid calls of a layer with residual blocks (unsplit, tiles a block row high) run its
# weight-row tiles in QuantLinear's row_tile_order, the block rows that keep the most blocks first, so that the last
# wave holds the light ones (w4a4_gemm.row_tile_order). Measured (benchmarks/prototypes/row_order.py, Llama-3-8B / Qwen3-8B /
# Qwen3-14B linears, 10 % random blocks on the shared walk, two runs): time ordered ÷
# grouped 0.96-0.97 on Llama-3-8B's q/k/v and o at 2048 tokens, 0.93 on Qwen3-8B gate/up and 0.95 on Qwen3-14B
# down at 512; 0.93-1.04 over every cell, median 0.99; MosaicQuant's 2048-token prefill 35,907 -> 35,539 µs.


def swapped_row_order(tiles: dict, block_rows: int, *, device: torch.device) -> bool:
    """Whether a swapped-GEMM call on ``tiles`` (its keyword arguments; ``{}``: the prefill defaults) runs its
    weight-row tiles in ``row_tile_order`` for a residual of ``block_rows``-row blocks (:attr:`~mosaicquant.kernels.tile_table.TileTable.swap_row_order`):
    unsplit, on tiles a block row high."""
    return table_for(device).swap_row_order and tiles.get("split_k", 1) == 1 and tiles.get("block_n", 128) == block_rows


def walk_stages(m: int, *, device: torch.device) -> int | None:
    """The ``WALK_STAGES`` constexpr of a ZipperEngine call of ``m`` tokens (``None``: the launch's ``num_stages``)."""
    table = table_for(device)
    return (table.walk_stages or None) if m >= table.walk_stages_min_m else None


def parallel_mode(cfg: "TileConfig", *, device: torch.device) -> str:
    """The parallel mode ``"auto"`` runs on ``cfg``'s tiles where :func:`parallel_residual` says so."""
    return "parallel_rows" if cfg.split_k <= table_for(device).parallel_rows_max_split else "parallel"


def parallel_residual(m: int, cfg: "TileConfig", blocks_per_row: float = 0.0, *, device: torch.device) -> bool:
    """Whether ZipperEngine's ``"auto"`` mode runs a call of ``m`` tokens on ``cfg``'s tiles in the parallel mode.

    ``blocks_per_row``: the layer's kept blocks over its block rows.
    """
    return (PARALLEL_MIN_M <= m <= min(cfg.block_m, table_for(device).parallel_max_m) and cfg.use_dot
            and cfg.split_k <= PARALLEL_MAX_SPLIT and blocks_per_row <= PARALLEL_MAX_BLOCKS_PER_ROW)


def swapped_prefill(m: int, n: int, device: torch.device, residual: bool, min_m: int = SWAP_MIN_M,
                    min_tiles_per_sm: float | None = None) -> bool:
    """Whether an ``[m, K] x [n, K]^T`` 4-bit GEMM of ``m >= min_m`` tokens runs the swapped prefill GEMM.

    ``min_tiles_per_sm``: 128 x 128 output tiles per SM it needs (default: :data:`SWAP_MIN_TILES_PER_SM`
    for a dense layer or one with residual blocks).
    """
    if m < min_m:
        return False
    if min_tiles_per_sm is None:
        min_tiles_per_sm = SWAP_MIN_TILES_PER_SM["residual" if residual else "dense"]
    return -(-n // 128) * -(-m // 128) >= min_tiles_per_sm * _sm_count(device)


# The swapped prefill GEMM's last wave split over K ("remainder split", swapped_rem_split). Its 128 x 128 tiles run
# two programs an SM (8 warps, 116 registers a thread, 64 KiB of shared memory; offline sm_90 compile), 264 at once on
# the H200. Where the tiles are a few whole waves and a short last one, the last wave's tiles run split over K, up to
# this many programs a tile (1: never), so that wave takes a fraction of the time.
# Why: Qwen3-14B's o / down (640 tiles at 2048 tokens: 2.42 waves) and q/k/v (896: 3.39) ran 1.16 / 1.16 / 1.25x
# BF16 against Llama-3-8B's 1.36 / 1.39 / 1.47x (512 and 768 tiles: 1.94 and 2.91 waves), gate/up level (16.5 and
# 13.6 waves). The bounds below are from benchmarks/prototypes/wave_split.py: every
# GEMM they pick (a last wave under half full after one or two whole waves, >= 24 K steps = 3,072 K values a split:
# down_proj, and Qwen3-32B's o_proj of K = 8,192) ran 3-28 % faster split, dense and with a 10 % residual (one
# launch); with more whole waves the last one is too small a share to gain, and shorter splits (q/k/v and o at
# K <= 5,120) gained or lost a few % by the fill.
SWAP_REM_SPLIT_MAX = 4
# ... where the last wave fills less than this share of the programs that run at once
SWAP_REM_SPLIT_MAX_FILL = 0.5
# ... after at most this many whole waves
SWAP_REM_SPLIT_MAX_WAVES = 2
# ... and each split keeps at least this many K steps
SWAP_REM_SPLIT_MIN_STEPS = 24
# programs of the prefill tiles an SM runs at once (see above)
SWAP_PREFILL_PROGRAMS_PER_SM = 2
# The whole tiles in the split tiles' launch (True) or in a launch of their own before it, as the unsplit kernel
# (False). Measured: a kernel holding both kinds of tile ran whole ones up to 11 % slower where there are
# many waves (which the rule leaves whole), but where the rule splits one launch was faster on 15 of 18 GEMMs (its
# split programs start as the last whole wave's end), and level or faster on the prefill (Qwen3-14B / Qwen3-4B at
# 2048 tokens, same run, ms, off / two launches / one: QuaRot 67.8 / 67.8 / 67.1 and 26.1 / 25.5 / 25.5,
# MosaicQuant 72.6 / 71.9 / 71.8 and 27.5 / 27.0 / 26.9).
# A register cap for the launch of the split tiles (0: none). Offline sm_90 compile (dense): with the whole tiles in
# it 202 registers a thread uncapped (one program an SM), 128 capped with no spill; the split tiles alone
# (Qwen3-14B's down_proj at 2048 tokens) 132 uncapped, 128 capped with 8 bytes of stack. The shared walk is capped
# at 128 anyway (SHARED_TAIL_MAX_REGS).
SWAP_REM_MAXNREG = 128


def _prefill_slots(device: torch.device) -> int:
    """Programs of the swapped GEMM's prefill tiles that run at once on ``device``."""
    return SWAP_PREFILL_PROGRAMS_PER_SM * _sm_count(device)


def swapped_rem_split(tiles: int, k_steps: int, device: torch.device, most: int | None = None) -> int:
    """Programs a tile for the last wave of a swapped prefill GEMM of ``tiles`` output tiles and ``k_steps`` K steps
    (1: no split; see :data:`SWAP_REM_SPLIT_MAX`).

    With ``S`` programs at once (:data:`SWAP_PREFILL_PROGRAMS_PER_SM` an SM), ``W = tiles // S`` whole waves and
    ``r = tiles - W·S`` tiles left: where ``1 <= W <=`` :data:`SWAP_REM_SPLIT_MAX_WAVES` and ``r / S`` is below
    :data:`SWAP_REM_SPLIT_MAX_FILL`, the largest power of two ``F <= most`` (default :data:`SWAP_REM_SPLIT_MAX`) with
    ``r·F <= S`` and ``k_steps / F`` at least :data:`SWAP_REM_SPLIT_MIN_STEPS`.

    Example: 640 tiles (Qwen3-14B's o_proj at 2048 tokens) over 264 programs are 2 waves and 112 tiles (42 %); split
    2 ways those 112 run as 224 programs, each half as long. The rule leaves it whole: 40 K steps a tile are 20 a
    split; it splits down_proj's 640 tiles (136 K steps) 2 ways.
    """
    most = SWAP_REM_SPLIT_MAX if most is None else most
    slots = _prefill_slots(device)
    waves, rest = divmod(tiles, slots)
    if (most < 2 or not 1 <= waves <= SWAP_REM_SPLIT_MAX_WAVES or rest == 0
            or rest >= SWAP_REM_SPLIT_MAX_FILL * slots):
        return 1
    f = 1
    while 2 * f <= most and rest * 2 * f <= slots and k_steps // (2 * f) >= SWAP_REM_SPLIT_MIN_STEPS:
        f *= 2
    return f


def swapped_rem_plan(tiles: int, k_steps: int, device: torch.device, rem_split: int | None = None) -> tuple[int, int]:
    """``(F, r)``: the last ``r`` of an unsplit swapped launch's ``tiles`` run split over K, ``F`` programs a tile
    (``(1, 0)``: none). ``r`` is the tiles past the last whole wave (none below one wave); ``F`` is ``rem_split``,
    or :func:`swapped_rem_split`'s where it is ``None``."""
    f = swapped_rem_split(tiles, k_steps, device) if rem_split is None else rem_split
    slots = _prefill_slots(device)
    r = tiles % slots if tiles >= slots else 0
    return (f, r) if f > 1 and r else (1, 0)


def swapped_decode_config(m: int, n: int, kp: int, device: torch.device, block_kp: int | None = None) -> dict:
    """Tiles (keyword arguments of ``w4a4_gemm_swapped_triton``) for a decode-sized swapped GEMM.

    64 weight rows (one warpgroup's ``wgmma`` M) x 16 or 32 tokens, :data:`SWAP_DECODE_BLOCK_KP` packed bytes
    a step (128: 256 K values), :data:`SWAP_DECODE_STAGES` stages, K split until every SM has about two
    programs, each keeping at least :attr:`~mosaicquant.kernels.tile_table.TileTable.swap_decode_split_min_steps` K steps (``block_kp``: other steps).
    """
    block_kp = block_kp or SWAP_DECODE_BLOCK_KP
    block_m = 16 if m <= 16 else 32
    tiles = -(-n // 64) * -(-m // block_m)
    split = _decode_split(tiles, -(-kp // block_kp), device, table_for(device).swap_decode_split_min_steps)
    return {"block_n": 64, "block_m": block_m, "block_kp": block_kp, "split_k": split, "num_warps": 4,
            "num_stages": SWAP_DECODE_STAGES, "pdl": pdl_default(m, n, kp)}


def _decode_split(tiles: int, k_steps: int, device: torch.device, min_steps: int, cover: float = 2.0,
                  max_split: int = 16) -> int:
    """Split-K of a decode-sized GEMM: doubled (up to ``max_split``) while ``tiles`` programs a split cover the SMs
    less than ``cover`` times and each program would keep at least ``min_steps`` of the ``k_steps`` K steps."""
    sms = _sm_count(device)
    split = 1
    while tiles * split < cover * sms and k_steps // (2 * split) >= min_steps and split < max_split:
        split *= 2
    return split


def prefetch_row_bytes(n: int, kp: int, split: int, prefetch_mib: float | None,
                       default_mib: float | None = None) -> int:
    """Bytes of each weight row that one program of a PDL launch prefetches into L2.

    Args:
        n, kp: the weights' rows and packed bytes per row.
        split: programs sharing a row along K (split-K).
        prefetch_mib: ``None``: the settings' ``prefetch_mib`` (:mod:`mosaicquant.settings`) if
            that is set, else ``default_mib``; a number: a cap on the whole launch's prefetch
            (MiB), shared evenly by rows and splits (``0``: no prefetch).
        default_mib: the launcher's default cap; ``None``: each program's whole slice where
            :func:`prefetch_default` says so, else nothing.

    Raises:
        UserInputError: a negative or non-numeric cap.
    """
    if prefetch_mib is None:
        prefetch_mib = settings.current().prefetch_mib
        if prefetch_mib is None:
            prefetch_mib = default_mib
        if prefetch_mib is None:
            return kp if prefetch_default(n, kp) else 0
    if not prefetch_mib >= 0:
        raise UserInputError(f"prefetch_mib={prefetch_mib!r} must be >= 0 (MiB prefetched per launch) or None")
    return min(kp, int(prefetch_mib * 2**20) // max(1, n * split))


def pdl_launch(pdl: bool) -> dict:
    """Launch options of a GEMM that uses programmatic dependent launch (none without it)."""
    return {"launch_pdl": True} if pdl else {}


@dataclass(frozen=True)
class TileConfig:
    """Launch parameters of one GEMM launch.

    Attributes:
        block_m: rows of X per program.
        block_n: output channels per program.
        block_kp: packed K bytes per step (``2 * block_kp`` K elements).
        split_k: number of programs sharing one output tile along K (fp32 partials, fixed-order sum).
        num_warps: warps per program.
        num_stages: software-pipelining depth of the K loop.
        group_m: program-id swizzle (M tiles per group) for L2 reuse of weight tiles.
        use_dot: tensor-core int8 dots (``block_m >= 16``) or CUDA-core multiply-adds
            (a handful of rows; any power-of-two ``block_m``).
    """

    block_m: int
    block_n: int
    block_kp: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8
    use_dot: bool = True

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_kp"):
            v = getattr(self, name)
            if name == "block_m" and not self.use_dot and v >= 1 and not v & (v - 1):
                continue
            if v < 16 or v & (v - 1):
                raise UserInputError(f"TileConfig.{name}={v} must be a power of two >= 16 (tl.dot tiles)")
        if self.split_k < 1:
            raise UserInputError(f"TileConfig.split_k={self.split_k} must be >= 1")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise UserInputError(f"TileConfig.num_warps={self.num_warps} must be one of 1, 2, 4, 8, 16")
        if self.num_stages < 1 or self.group_m < 1:
            raise UserInputError("TileConfig.num_stages and group_m must be >= 1")


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def wide_decode(m: int, n: int, device: torch.device, residual: bool) -> bool:
    """Whether a call of ``m`` tokens on a layer of ``n`` channels (with residual blocks, or ``residual=False``
    dense) runs the packed kernels' wide decode tiles (:data:`WIDE_DECODE_TILES_PER_SM`)."""
    table = table_for(device)
    max_m = max(16, table.wide_decode_max_m if residual else table.dense_wide_max_m)
    if device.type != "cuda" or m > max_m:
        return False
    sms = _sm_count(device)
    if -(-n // 64) < WIDE_DECODE_TILES_PER_SM * sms:
        return False
    return (residual or m <= 16
            or table.dense_wide_min_tiles_per_sm * sms <= -(-n // 128) <= table.dense_wide_max_tiles_per_sm * sms)


def pick_config(
    m: int,
    n: int,
    kp: int,
    device: torch.device,
    residual_block: tuple[int, int] | None = None,
) -> TileConfig:
    """Choose tiles for an ``[m, 2*kp] x [n, 2*kp]^T`` 4-bit GEMM.

    Args:
        m, n, kp: GEMM sizes (``kp`` in packed bytes).
        device: where it runs (CPU means Triton's interpreter: few, large programs).
        residual_block: ``(Bn, Bk)`` of fused residual blocks; tiles must then nest in
            block rows (``block_n`` divides ``Bn``; ZipperEngine's inline mode also shrinks
            ``block_kp`` to nest in block columns).

    Returns:
        A :class:`TileConfig`.

    Raises:
        UserInputError: a residual block shape the kernels cannot tile (``Bn`` not a
            multiple of 16 or ``Bk`` not a multiple of 32).
    """
    table = table_for(device)
    wide = wide_decode(m, n, device, residual_block is not None)
    if device.type != "cuda":
        cfg = TileConfig(block_m=64 if m > 16 else 16, block_n=64, block_kp=64, num_warps=4, num_stages=1)
    elif wide:
        # a wide dense layer (gate/up): enough tiles without split-K, and longer steps per tile
        cfg = TileConfig(block_m=16 if m <= 16 else 32, block_n=128, block_kp=table.wide_decode_block_kp, num_warps=8,
                         num_stages=table.wide_decode_stages)
    elif m <= 16:
        cfg = TileConfig(block_m=16, block_n=64, block_kp=64, num_warps=4, num_stages=table.decode_stages)
    elif m <= 64:
        cfg = TileConfig(block_m=max(16, triton_next_pow2(m)), block_n=64, block_kp=64, num_warps=4,
                         num_stages=table.decode_stages)
    elif m <= 256:
        cfg = TileConfig(block_m=64, block_n=64, block_kp=64, num_warps=4, num_stages=4)
    elif m < 2048:
        cfg = TileConfig(block_m=128, block_n=128, block_kp=64, num_warps=8, num_stages=3)
    else:
        cfg = TileConfig(block_m=256, block_n=128, block_kp=64, num_warps=8, num_stages=3)
    if residual_block is not None:
        cfg = fit_to_blocks(cfg, residual_block, nest_k=False)
    narrow = device.type == "cuda" and not wide and cfg.block_n == 64
    wide_k = narrow and residual_block is None and 0 < table.wide_k_decode_min_m <= m <= 16
    if device.type == "cuda" and m <= 256 and not wide:
        tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
        min_steps = table.decode_split_min_steps_17 if 16 < m <= 64 else DECODE_SPLIT_MIN_STEPS
        cfg = replace(cfg, split_k=_decode_split(tiles, -(-kp // cfg.block_kp), device, min_steps))
    if wide_k:  # as many K steps a program, four times the bytes a step
        cfg = replace(cfg, block_kp=4 * cfg.block_kp, split_k=max(1, cfg.split_k // 4))
    elif (narrow and residual_block is not None and 0 < TAIL_WIDE_K_MIN_M <= m <= max(16, TAIL_WIDE_K_MAX_M)
          and cfg.split_k >= 8):
        cfg = replace(cfg, block_kp=2 * cfg.block_kp)  # the tail walk's tiles: half the steps, same split
    return cfg


def fit_to_blocks(cfg: TileConfig, residual_block: tuple[int, int], nest_k: bool = True) -> TileConfig:
    """Shrink ``block_n``/``block_kp`` so that program tiles nest inside residual blocks.

    ``nest_k=False`` leaves ``block_kp`` as it is (ZipperEngine's tail walk steps through a block
    on its own; only the tile's channels must lie in one block row).

    Raises:
        UserInputError: ``Bn`` not a multiple of 16 or ``Bk`` not a multiple of 64.
    """
    bn_res, bk_res = residual_block
    if bn_res % 16 or bk_res % 64:
        # a block column of Bk values is Bk/2 packed bytes; the int8 tensor-core dots of the
        # compiled kernels take K >= 32 per step, so Bk/2 must be a multiple of 32
        raise UserInputError(
            f"residual block {bn_res}x{bk_res} cannot be tiled by the kernels: rows must be a multiple "
            f"of 16 and columns a multiple of 64"
        )
    block_n = cfg.block_n
    while bn_res % block_n:
        block_n //= 2
    block_kp = cfg.block_kp
    while nest_k and (bk_res // 2) % block_kp:
        block_kp //= 2
    if block_n < 16 or block_kp < 32:
        raise UserInputError(f"residual block {bn_res}x{bk_res} has no tile of 16-multiples that divides it")
    return replace(cfg, block_n=block_n, block_kp=block_kp)


def triton_next_pow2(x: int) -> int:
    """Smallest power of two >= x (x >= 1)."""
    return 1 << (max(1, x) - 1).bit_length()


_PERSISTENT: dict[tuple[str, str], torch.Tensor] = {}


def persistent_zeros(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The device's buffer ``name``: zeroed when first asked for, then never reallocated.

    Kernels keep state in it across launches (counters, barriers), and captured CUDA graphs keep
    pointing at it. Launches that share one must run on one stream.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" name one buffer
        device = torch.device("cuda", torch.cuda.current_device())
    key = (name, str(device))
    if key not in _PERSISTENT:
        _PERSISTENT[key] = torch.zeros(numel, dtype=dtype, device=device)
    return _PERSISTENT[key]


def lock_buffer(device: torch.device) -> torch.Tensor:
    """The per-device split-K counters (zero between launches: the last split resets its slot;
    :func:`persistent_zeros`)."""
    return persistent_zeros("split-k locks", LOCK_SLOTS, torch.int32, device)
