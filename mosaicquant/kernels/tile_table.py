"""The kernels' tuned tile bounds and forms, as data: one row per device, a default row for the rest.

:class:`TileTable` holds the launch choices that were tuned on a device (token bounds of each route,
pipeline depths, K steps, which kernel form runs) rather than derived from the operands. The
launchers read the row of the device they launch on through :func:`table_for`: the row of
:data:`DEVICE_TABLES` whose key is the device's name (``torch.cuda.get_device_name``), else its
compute capability (``"sm_90"``), else ``"default"``, chosen once per device; then the
``tiles`` field of the kernel settings in force (:class:`mosaicquant.settings.KernelSettings`)
replaces single entries, which is how tests and benchmarks choose a variant::

    with settings.use(tiles={"dense_gated_max_m": 0}):
        ...  # SiLU·mul in its own kernel at every size

Only the default row exists: every device runs the same values. The comments beside each rule in
:mod:`mosaicquant.kernels._tiles` give the measurements behind it.
"""

from __future__ import annotations

import dataclasses
import functools
import typing

import torch

from mosaicquant import settings
from mosaicquant.config import coerce_value
from mosaicquant.errors import UserInputError

__all__ = ["TileTable", "DEVICE_TABLES", "table_for", "device_key"]


@dataclasses.dataclass(frozen=True)
class TileTable:
    """Tuned bounds of the kernels' routes (token counts are the calls' ``M``).

    Attributes:
        dense_gated_max_m: dense gate/up calls of at most this many tokens fuse SiLU·mul into the GEMM.
        parallel_max_m: ZipperEngine's parallel modes run up to this many tokens.
        parallel_rows_max_split: the row-parallel mode's largest K split.
        walk_stages_min_m: the tail walk is software-pipelined from this many tokens.
        walk_stages: the pipelined tail walk's depth.
        walk_preload_max_m: the tail walk preloads its first kept block up to this many tokens.
        dense_wide_max_m: dense layers keep the wide decode tiles up to this many tokens.
        dense_wide_min_tiles_per_sm, dense_wide_max_tiles_per_sm: the grid (wide tiles a SM) where they do.
        wide_decode_max_m: layers with residual blocks keep the wide decode tiles up to this many tokens.
        wide_decode_stages, wide_decode_block_kp: the wide decode tiles' pipeline depth and K step (bytes).
        decode_stages: the other decode tiles' pipeline depth.
        wide_k_decode_min_m: dense calls from this many tokens to 16 run the swapped GEMM's wide-K tiles.
        swap_decode_split_min_steps: the swapped decode GEMM splits K where each split keeps this many steps.
        decode_split_min_steps_17: the same for the packed decode tiles at 17-64 tokens.
        swap_row_order: the swapped prefill GEMM walks its tiles in row order.
        swap_tail_max_fraction, swap_tail_min_padding: where the last token tile runs narrower.
        swap_mid_min_m, swap_mid_residual_min_m, swap_mid_wide_min_m: where mid-sized calls (dense,
            with residual blocks, the dense wide tier) take the mid tiles.
        swap_rem_one_launch: the last wave's split tiles run in the same launch as the whole ones.
        attn_direct_one_chunk: decode attention of one chunk writes its output without a combine pass.
        attn_new_cached: the step's new key and value are read back from the cache.
        attn_kv4_biased: the 4-bit-cache attention keeps its zero points as a bias.
        attn_kv4_block_n: keys a step of the 4-bit-cache attention.
        merged_walk: QuantLinear runs the merged residual walk where the blocks' shifts allow.
        silu_in_hadamard_min_m, silu_in_hadamard_max_m: the fused decoder's calls of this many tokens run
            SiLU·mul inside down_proj's fused online Hadamard + quantizer (``mosaicquant.harness.runtime``).
        silu_in_gate_up: the fused decoder lets gate/up's GEMM write SiLU·mul where it can.
        fused_rope_attention: the fused decoder runs a decode step's RoPE and KV write inside the attention's
            kernel for layers whose KV cache is not simulated.
        prefill_sdpa_gqa: the fused decoder's prefill attention of grouped-query models reads each KV head for
            its group of query heads (SDPA's ``enable_gqa``) rather than copies of the keys and values.
    """

    dense_gated_max_m: int = 16
    parallel_max_m: int = 16
    parallel_rows_max_split: int = 1
    walk_stages_min_m: int = 17
    walk_stages: int = 5
    walk_preload_max_m: int = 8
    dense_wide_max_m: int = 16
    dense_wide_min_tiles_per_sm: float = 1.6
    dense_wide_max_tiles_per_sm: float = 2.0
    wide_decode_max_m: int = 32
    wide_decode_stages: int = 3
    wide_decode_block_kp: int = 128
    decode_stages: int = 4
    wide_k_decode_min_m: int = 12
    swap_decode_split_min_steps: int = 8
    decode_split_min_steps_17: int = 8
    swap_row_order: bool = True
    swap_tail_max_fraction: float = 0.5
    swap_tail_min_padding: float = 0.125
    swap_mid_min_m: int = 33
    swap_mid_residual_min_m: int = 65
    swap_mid_wide_min_m: int = 257
    swap_rem_one_launch: bool = True
    attn_direct_one_chunk: bool = True
    attn_new_cached: bool = True
    attn_kv4_biased: bool = True
    attn_kv4_block_n: int = 128
    merged_walk: bool = True
    silu_in_hadamard_min_m: int = 17
    silu_in_hadamard_max_m: int = 32
    silu_in_gate_up: bool = True
    fused_rope_attention: bool = True
    prefill_sdpa_gqa: bool = True


#: the rows: a device name or compute capability (``"sm_90"``) -> its table; ``"default"`` for the rest
DEVICE_TABLES: dict[str, TileTable] = {"default": TileTable()}

_HINTS = typing.get_type_hints(TileTable)


@functools.lru_cache(maxsize=None)
def _device_names(device_type: str, index: int | None) -> tuple[str, ...]:
    if device_type != "cuda" or not torch.cuda.is_available():
        return ()
    major, minor = torch.cuda.get_device_capability(index)
    return torch.cuda.get_device_name(index), f"sm_{major}{minor}"


def device_key(device: torch.device | str) -> str:
    """The key of :data:`DEVICE_TABLES` whose row ``device`` runs with (chosen once per device)."""
    device = torch.device(device)
    return next((n for n in _device_names(device.type, device.index) if n in DEVICE_TABLES), "default")


@functools.lru_cache(maxsize=None)
def _resolve(key: str, tiles: tuple[str, ...]) -> TileTable:
    row = DEVICE_TABLES[key]
    if not tiles:
        return row
    allowed = [f.name for f in dataclasses.fields(TileTable)]
    changes = {}
    for item in tiles:
        name, _, raw = item.partition("=")
        if name not in allowed:
            raise UserInputError(f"KernelSettings.tiles: unknown entry {name!r}; allowed: {', '.join(allowed)}")
        changes[name] = coerce_value(f"tiles.{name}", raw, _HINTS[name])
    return dataclasses.replace(row, **changes)


def table_for(device: torch.device | str) -> TileTable:
    """The tile table a launch on ``device`` uses: the device's row with the settings' ``tiles`` applied.

    Raises:
        UserInputError: a ``tiles`` entry that names no field of :class:`TileTable`, or a value of the
            wrong type (naming the entry and the allowed names).
    """
    return _resolve(device_key(device), settings.current().tiles)
