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

__all__ = ["Config", "WrongType", "check_choice", "check_range", "coerce_value", "exact_number_text",
           "parse_kv_pairs"]

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


class WrongType(UserInputError):
    """A value that is not of its option's type (:func:`coerce_value`); :class:`Config` adds the allowed span.

    Attributes:
        name: the option.
        raw: the value as given.
        kind: the type the option takes (``"an integer"``, ``"a number"``, ``"a boolean"``, ``"a string"``).
        allowed: what the option allows (its type and range where known, e.g. ``"integers 2..8 or 16"``).
    """

    def __init__(self, name: str, raw: Any, kind: str, allowed: str | None = None):
        self.name, self.raw, self.kind, self.allowed = name, raw, kind, allowed or kind
        super().__init__(f"{name}={raw!r} is not {kind}: allowed {self.allowed}")


def _unwrap_optional(tp):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return (args[0] if len(args) == 1 else tp), True
    return tp, False


def _from_text(name: str, raw: Any, convert, kind: str):
    """``convert(str(raw))`` (command-line text, NumPy scalars), or :class:`WrongType` naming ``kind``."""
    try:
        return convert(str(raw))
    except ValueError:
        raise WrongType(name, raw, kind) from None


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
        raise WrongType(name, raw, "a boolean", "true or false")
    if base is int:
        if isinstance(raw, bool):
            raise WrongType(name, raw, "an integer")
        if isinstance(raw, int):
            return raw
        if isinstance(raw, float) and raw.is_integer():
            return int(raw)
        return _from_text(name, raw, int, "an integer")
    if base is float:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
        return _from_text(name, raw, float, "a number")
    if base is str:
        if isinstance(raw, (dict, list, tuple, set)):
            raise WrongType(name, raw, "a string")
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
        wrong = None
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            try:
                coerced = coerce_value(f.name, value, hints.get(f.name, Any))
            except WrongType as exc:
                wrong = wrong or (exc, f.name, hints.get(f.name, Any))
                continue
            if coerced is not value:
                object.__setattr__(self, f.name, coerced)
        if wrong is not None:
            exc, name, tp = wrong
            raise WrongType(exc.name, exc.raw, exc.kind, self._allowed_span(name, tp) or exc.allowed) from None
        self.validate()

    def _allowed_span(self, name: str, tp) -> str | None:
        """What :meth:`validate` allows for the numeric field ``name`` (``"integers 2..8 or 16"``), or None.

        :meth:`validate` is the one statement of a field's range: it is run with NaN in the field (never in any
        range, :func:`check_range`) and its refusal of ``name`` read back, the other fields holding their given
        values, or their defaults where a given one is refused first.
        """
        base, optional = _unwrap_optional(tp)
        listed = typing.get_origin(base) in (tuple, list)
        if listed:
            args = typing.get_args(base)
            base, _ = _unwrap_optional(args[0] if args else str)
        if base not in (int, float):
            return None
        probe = (math.nan,) if listed else math.nan
        defaults = object.__new__(type(self))
        for f in dataclasses.fields(self):
            value = f.default
            if value is dataclasses.MISSING:
                value = getattr(self, f.name) if f.default_factory is dataclasses.MISSING else f.default_factory()
            object.__setattr__(defaults, f.name, value)
        for config in (self, defaults):
            object.__setattr__(config, name, probe)
            try:
                config.validate()
            except (UserInputError, ValueError, TypeError) as exc:  # only a refusal of `name` is read
                text = str(exc)
                if text.startswith(f"{name}=") and ": allowed " in text:
                    span = text.split(": allowed ", 1)[1]
                    span = f"a list of {span}" if listed else span
                    return f"{span} or none" if optional else span
        return None

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
        """Build from a mapping (values may be strings).

        Raises:
            UserInputError: ``data`` not a mapping, an unknown key, or a value of another type or out of range
                (naming the value, the option and what it allows).
        """
        if data is not None and not isinstance(data, dict):
            raise UserInputError(f"{cls.__name__} options must be a mapping of option to value, got "
                                 f"{type(data).__name__} {data!r}")
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
