"""The kernels' settings: one typed, validated object in place of environment variables.

:class:`KernelSettings` holds every choice of the kernels that is not fixed by the operands'
shapes and device: which backend runs (Triton or the PyTorch reference), programmatic dependent
launch (PDL) and how far its chain reaches, the L2 prefetch cap, and entries that replace the
device's tuned tile table. The launchers read the settings in force when
they are called; :func:`use` puts settings in force for a block of code (and only for it, in the
current thread or task), :func:`current` returns them.

Example:
    >>> from mosaicquant import settings
    >>> settings.current().pdl
    True
    >>> with settings.use(settings.KernelSettings(pdl=False, prefetch_mib=8)):
    ...     settings.current().prefetch_mib
    8.0
    >>> settings.current().prefetch_mib is None
    True

The speed suites take the user-facing fields as options (``throughput:pdl=false``,
``latency:prefetch_mib=8``) and run their timings inside :func:`use`; benchmarks and tests
choose variants the same way, never by assigning module constants.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re
from collections.abc import Iterator

from mosaicquant.config import Config, check_choice, check_range
from mosaicquant.errors import UserInputError

__all__ = ["KERNEL_PREFERENCES", "PDL_CHAINS", "KernelSettings", "current", "use", "use_tiles"]

#: backends a kernel call may prefer: ``auto`` (Triton where it can run, else the reference), ``triton``, ``torch``
KERNEL_PREFERENCES = ("auto", "triton", "torch")
#: how far programmatic dependent launch reaches in the decode step (``mosaicquant.kernels._common.chain_mode``)
PDL_CHAINS = ("off", "on")
_TILE_NAME = re.compile(r"[a-z][a-z0-9_]*")


@dataclasses.dataclass(frozen=True)
class KernelSettings(Config):
    """Choices of the kernels that shapes and device leave open.

    Attributes:
        kernel: ``"auto"`` (Triton on a CUDA device or under ``TRITON_INTERPRET=1``, else the
            PyTorch reference), ``"triton"`` or ``"torch"``; a kernel call's own ``kernel=``
            argument wins over it.
        pdl: programmatic dependent launch where the device has it (compiled Triton on sm_90+).
        pdl_chain: ``"on"`` (every kernel of a decode step of at most 8 tokens chained by PDL)
            or ``"off"`` (only the activation kernels let the GEMM after them start early).
        prefetch_mib: a cap (MiB) on what every PDL GEMM launch prefetches into L2, in place of
            each launcher's default; ``None``: the launchers' defaults; ``0``: no prefetch.
        tiles: entries ``name=value`` that replace those of the device's tile table
            (:class:`mosaicquant.kernels.tile_table.TileTable`, e.g. ``dense_gated_max_m=0``); a
            mapping is taken too. Empty: the device's row as tuned. Names are checked against the
            table at the first launch.

    Raises:
        UserInputError: a value outside its allowed set, naming the value and the set.
    """

    description = "kernel backend, programmatic dependent launch, L2 prefetch and tile-table entries"

    kernel: str = "auto"
    pdl: bool = True
    pdl_chain: str = "on"
    prefetch_mib: float | None = None
    tiles: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.tiles, dict):
            object.__setattr__(self, "tiles", tuple(f"{k}={v}" for k, v in self.tiles.items()))
        super().__post_init__()

    def validate(self) -> None:
        kernel = self.kernel.strip().lower()
        check_choice("kernel", kernel, KERNEL_PREFERENCES)
        self.set_canonical("kernel", kernel)
        chain = self.pdl_chain.strip().lower()
        check_choice("pdl_chain", chain, PDL_CHAINS)
        self.set_canonical("pdl_chain", chain)
        if self.prefetch_mib is not None:
            check_range("prefetch_mib", self.prefetch_mib, 0, None)
        entries = {}
        for item in self.tiles:
            name, sep, value = item.partition("=")
            name = name.strip().lower()
            if not sep or not _TILE_NAME.fullmatch(name) or not value.strip():
                raise UserInputError(f"tiles entry {item!r} is not allowed: write name=value, e.g. dense_gated_max_m=0")
            entries[name] = value.strip()
        self.set_canonical("tiles", tuple(f"{k}={v}" for k, v in sorted(entries.items())))


_DEFAULT = KernelSettings()
_CURRENT: contextvars.ContextVar[KernelSettings] = contextvars.ContextVar("mosaicquant_kernel_settings",
                                                                          default=_DEFAULT)


def current() -> KernelSettings:
    """The settings in force here: those of the innermost :func:`use`, else the defaults."""
    return _CURRENT.get()


@contextlib.contextmanager
def use(settings: KernelSettings | None = None, **changes) -> Iterator[KernelSettings]:
    """Put ``settings`` (default: those in force), with ``changes`` applied, in force for the block.

    Example: ``with use(pdl=False): ...`` runs the block's launches without PDL; the settings
    before come back when the block ends, also on an exception.

    Raises:
        UserInputError: ``settings`` not a :class:`KernelSettings`, or a change the settings refuse.
    """
    if settings is None:
        settings = current()
    elif not isinstance(settings, KernelSettings):
        raise UserInputError(f"settings must be a KernelSettings, got {type(settings).__name__}")
    if changes:
        settings = KernelSettings.from_dict({**settings.to_dict(), **changes})
    token = _CURRENT.set(settings)
    try:
        yield settings
    finally:
        _CURRENT.reset(token)


@contextlib.contextmanager
def use_tiles(**entries) -> Iterator[KernelSettings]:
    """Put tile-table entries (``name=value``, :class:`mosaicquant.kernels.tile_table.TileTable`'s fields)
    in force for the block, beside those already in force.

    Example: ``with use_tiles(dense_gated_max_m=0): ...`` runs SiLU·mul in its own kernel at every size.

    Raises:
        UserInputError: an entry the settings refuse.
    """
    merged = dict(item.split("=", 1) for item in current().tiles)
    merged.update({name.lower(): value for name, value in entries.items()})
    with use(tiles=merged) as chosen:
        yield chosen
