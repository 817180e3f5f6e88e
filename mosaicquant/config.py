"""Frozen, validated configs that round-trip through dicts, JSON, YAML and ``key=value`` text.

Every method and suite config subclasses :class:`Config` (a frozen dataclass). Validation
runs in ``__post_init__`` through :meth:`Config.validate` and raises
:class:`~mosaicquant.errors.UserInputError` naming the bad value and what is allowed.

Example:
    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True)
    ... class DemoConfig(Config):
    ...     bits: int = 4
    ...     def validate(self):
    ...         check_range("bits", self.bits, 2, 8)
    >>> DemoConfig.from_dict({"bits": "8"}).bits
    8
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from typing import Any, ClassVar, TypeVar

import yaml

from mosaicquant.errors import UserInputError

__all__ = ["Config", "check_choice", "check_range", "coerce_value", "exact_number_text", "parse_kv_pairs"]

C = TypeVar("C", bound="Config")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def exact_number_text(value: float) -> str:
    """Short text of a number that reads back as the same number.

    ``f"{v:g}"`` (``0.1``, ``1e-05``, ``1``) where it round-trips, else ``repr`` (``0.1234567``): two
    different values never get the same text, so labels built from it name one config each.
    """
    if isinstance(value, float):
        short = f"{value:g}"
        return short if float(short) == value else repr(value)
    return str(value)


def check_choice(name: str, value: Any, allowed) -> None:
    """Raise unless ``value`` is one of ``allowed``."""
    allowed = list(allowed)
    if value not in allowed:
        raise UserInputError(f"{name}={value!r} is not allowed: choose one of {', '.join(map(repr, allowed))}")


def check_range(name: str, value, lo=None, hi=None, *, integer: bool = False, extra=()) -> None:
    """Raise unless ``lo <= value <= hi`` (bounds optional) or ``value in extra``.

    NaN and the infinities are never in range (a comparison with NaN is false, so NaN would pass
    any bound), whether or not a bound is given.
    """
    if value in extra and not isinstance(value, bool):
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and not math.isfinite(value):
        ok = False
    if ok and integer:
        ok = float(value).is_integer()
    if ok and lo is not None and value < lo:
        ok = False
    if ok and hi is not None and value > hi:
        ok = False
    if not ok:
        kind = "integers" if integer else "numbers"
        if lo is not None and hi is not None:
            span = f"{lo}..{hi}"
        elif lo is not None:
            span = f">= {lo}"
        elif hi is not None:
            span = f"<= {hi}"
        else:
            span = "of any size"
        more = f" or {', '.join(map(str, extra))}" if extra else ""
        raise UserInputError(f"{name}={value!r} is out of range: allowed {kind} {span}{more}")


def _unwrap_optional(tp):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return (args[0] if len(args) == 1 else tp), True
    return tp, False


def coerce_value(name: str, raw: Any, tp) -> Any:
    """Convert ``raw`` (often a string from the command line) to the annotated type ``tp``."""
    base, optional = _unwrap_optional(tp)
    if raw is None or (optional and isinstance(raw, str) and raw.lower() in {"none", "null", ""}):
        if optional or raw is None:
            return None
    if base is Any:
        return raw
    origin = typing.get_origin(base)
    if origin is typing.Literal:
        choices = typing.get_args(base)
        value = raw
        if isinstance(raw, str) and choices and not isinstance(choices[0], str):
            value = coerce_value(name, raw, type(choices[0]))
        check_choice(name, value, choices)
        return value
    if origin in (tuple, list):
        items = raw.split(",") if isinstance(raw, str) else list(raw)
        args = typing.get_args(base)
        item_tp = args[0] if args else str
        out = [coerce_value(name, item, item_tp) for item in items]
        return tuple(out) if origin is tuple else out
    if base is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in _TRUE | _FALSE:
            return raw.lower() in _TRUE
        raise UserInputError(f"{name}={raw!r} is not a boolean: use true/false")
    if base is int:
        if isinstance(raw, bool):
            raise UserInputError(f"{name}={raw!r} is not an integer")
        if isinstance(raw, int):
            return raw
        if isinstance(raw, float) and raw.is_integer():
            return int(raw)
        try:
            return int(str(raw))
        except ValueError:
            raise UserInputError(f"{name}={raw!r} is not an integer") from None
    if base is float:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
        try:
            return float(str(raw))
        except ValueError:
            raise UserInputError(f"{name}={raw!r} is not a number") from None
    if base is str:
        return str(raw)
    return raw


def parse_kv_pairs(text: str, sep: str = ":") -> dict[str, str]:
    """Parse ``"a=1:b=x"`` into ``{"a": "1", "b": "x"}``.

    Raises:
        UserInputError: an item without ``=`` or a repeated key.
    """
    out: dict[str, str] = {}
    if not text:
        return out
    for item in text.split(sep):
        if "=" not in item:
            raise UserInputError(f"option {item!r} must look like key=value")
        key, value = item.split("=", 1)
        key = key.strip().replace("-", "_")
        if not key:
            raise UserInputError(f"option {item!r} has an empty key")
        if key in out:
            raise UserInputError(f"option {key!r} given twice")
        out[key] = value.strip()
    return out


@dataclasses.dataclass(frozen=True)
class Config:
    """Base of every config: frozen, validated on construction, serialisable."""

    #: one-line description shown by ``mosaicquant ls``
    description: ClassVar[str] = ""
    #: ``str`` options whose value is a comma-separated list (tuple and list options are lists anyway)
    list_options: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            coerced = coerce_value(f.name, value, hints.get(f.name, Any))
            if coerced is not value:
                object.__setattr__(self, f.name, coerced)
        self.validate()

    def validate(self) -> None:
        """Check field values; subclasses raise :class:`UserInputError`."""

    def set_canonical(self, name: str, value: Any) -> None:
        """Store ``value``, the one text of field ``name``'s value (called from :meth:`validate`).

        A value that can be written several ways (a block shape ``16`` or ``16x16``, a number list
        ``0.1,0.3`` or ``0.10,0.30``) is kept in one form, so configs that mean the same compare
        equal, match the defaults and get one label (one cell, one record).
        """
        object.__setattr__(self, name, value)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def list_option_names(cls) -> list[str]:
        """Options whose value is a comma-separated list: tuple or list fields, and :attr:`list_options`.

        On the command line a comma inside a method or suite item continues such a value
        (``zeroshot:tasks=piqa,lambada``) instead of starting the next item.
        """
        hints = typing.get_type_hints(cls)
        out = []
        for name in cls.field_names():
            base, _ = _unwrap_optional(hints.get(name, Any))
            if name in cls.list_options or typing.get_origin(base) in (tuple, list):
                out.append(name)
        return out

    @classmethod
    def from_dict(cls: type[C], data: dict[str, Any] | None) -> C:
        """Build from a mapping (values may be strings); unknown keys are an error."""
        data = dict(data or {})
        names = cls.field_names()
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise UserInputError(
                f"{cls.__name__} has no option {', '.join(map(repr, unknown))}: "
                f"allowed {', '.join(names) or '(none)'}"
            )
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls: type[C], text: str) -> C:
        return cls.from_dict(json.loads(text))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=True)

    @classmethod
    def from_yaml(cls: type[C], text: str) -> C:
        return cls.from_dict(yaml.safe_load(text) or {})

    def replace(self: C, **changes) -> C:
        return dataclasses.replace(self, **changes)

    def overrides(self) -> dict[str, Any]:
        """The fields that differ from the defaults (what a label shows)."""
        default = type(self)()
        return {k: v for k, v in self.to_dict().items() if getattr(default, k) != getattr(self, k)}
