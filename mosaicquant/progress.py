"""Progress bars with an ETA for the long loops: calibration batches, layers quantized, perplexity batches.

The bars are tqdm's, written to stderr only (never to a record or stdout). Which runs show them
is one of :data:`PROGRESS_MODES`: ``"auto"`` (the default: shown when stderr is a terminal, so
a CI log or a redirected run stays clean), ``"on"`` (shown on any stderr) or ``"off"``. The
mode in force is that of the innermost :func:`use` in the current thread or task (like
:mod:`mosaicquant.settings`); ``mosaicquant run --progress`` sets it for a sweep.

Example:
    >>> from mosaicquant import progress
    >>> with progress.use("off"):
    ...     sum(progress.bar(range(3), desc="demo", unit="step"))
    3
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

from tqdm import tqdm

from mosaicquant.config import check_choice

__all__ = ["PROGRESS_MODES", "use", "current", "shown", "bar"]

#: ``auto``: bars when stderr is a terminal; ``on``: always; ``off``: never
PROGRESS_MODES = ("auto", "on", "off")

_MODE: contextvars.ContextVar[str] = contextvars.ContextVar("mosaicquant_progress", default="auto")


def current() -> str:
    """The progress mode in force here (``"auto"`` outside any :func:`use`)."""
    return _MODE.get()


@contextlib.contextmanager
def use(mode: str) -> Iterator[str]:
    """Put progress mode ``mode`` in force for the block.

    Raises:
        UserInputError: ``mode`` is not one of :data:`PROGRESS_MODES`.
    """
    check_choice("progress", mode, PROGRESS_MODES)
    token = _MODE.set(mode)
    try:
        yield mode
    finally:
        _MODE.reset(token)


def shown(stream: TextIO | None = None) -> bool:
    """Whether bars are drawn on ``stream`` (default: stderr) under the mode in force."""
    mode = current()
    if mode != "auto":
        return mode == "on"
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def bar(iterable: Iterable[Any] | None = None, *, desc: str, unit: str, total: int | None = None) -> tqdm:
    """A tqdm bar on stderr (elapsed, rate, ETA), disabled where :func:`shown` says no.

    Args:
        iterable: what to iterate over (``None``: update the bar by hand with ``.update(n)``).
        desc: what the loop does, e.g. ``"perplexity"``.
        unit: one step, e.g. ``"chunk"``.
        total: the number of steps (default ``len(iterable)`` where it has one).

    Returns:
        The bar; iterate over it, or call ``update``, and ``close`` it (or use it as a context manager).
        A finished outermost bar keeps its last line (steps done, elapsed time); a finished bar
        nested inside another is cleared.
    """
    return tqdm(iterable, desc=f"[mosaicquant] {desc}", unit=unit, total=total, file=sys.stderr,
                disable=not shown(), leave=None, dynamic_ncols=True, mininterval=0.5)
