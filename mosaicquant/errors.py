"""Errors the harness raises for bad input: the CLI prints them as one line and exits 2."""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Iterable

__all__ = [
    "MosaicQuantError", "UserInputError", "AssetError", "Unavailable", "NotAvailableError", "import_optional",
    "unknown_name",
]


class MosaicQuantError(Exception):
    """Base class of the errors that carry a message meant for the user."""


class UserInputError(MosaicQuantError, ValueError):
    """A value the user gave is not allowed (unknown name, out-of-range option, bad spec)."""


class AssetError(MosaicQuantError):
    """A model or data asset is missing and cannot be fetched (no network, bad hash, ...)."""


class Unavailable(MosaicQuantError):
    """A cell that cannot run here, for a stated reason (no fast path, no GPU, an engine not
    installed). The runner records it as ``"status": "unavailable"`` with the reason; it is
    never replaced by a stand-in measurement."""


class NotAvailableError(Unavailable, RuntimeError):
    """What a cell needs (a package, a device, an engine) is not available where it runs.

    Raised by a method before any long work (e.g. torchao's int4 kernel on a CPU); the runner
    records the cell as ``unavailable`` with this message, never a stand-in result.
    """


def import_optional(module: str, method: str, what: str, hint: str):
    """Import ``module`` for ``method``; returns ``(module, version of its top-level package)``.

    Raises:
        NotAvailableError: the package is not importable, naming ``what`` and how to install it.
    """
    try:
        imported = importlib.import_module(module)
        version = importlib.import_module(module.split(".")[0]).__version__
    except ImportError as exc:
        raise NotAvailableError(
            f"method '{method}' needs {what}, which is not importable here ({exc}): {hint}"
        ) from exc
    return imported, version


def unknown_name(kind: str, name: str, available: Iterable[str]) -> UserInputError:
    """Build the "Unknown method 'qaurot'. Did you mean: quarot? Available: ..." error."""
    names = sorted(available)
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    return UserInputError(f"Unknown {kind} '{name}'.{hint} Available: {', '.join(names) or '(none)'}")
