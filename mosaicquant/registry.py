"""Registries of methods, suites and backends.

Built-ins are listed in-source (:data:`BUILTIN_MODULES`) and imported on first lookup, so
they work from a plain checkout. Third-party plugins register through the entry-point
groups ``mosaicquant.methods``, ``mosaicquant.suites`` and ``mosaicquant.backends``: the
entry point's name is the plugin's name and loading it must register that name (usually
by importing a module whose functions carry ``@register_method(...)``), e.g. in a plugin's
``pyproject.toml``::

    [project.entry-points."mosaicquant.methods"]
    mymethod = "my_package.my_method"

A method is ``fn(model, config, ctx) -> model`` (see :class:`QuantContext`), registered with
its speed form where it has one: ``speed_form(model, config, ctx) -> (quantized linears, notes)``
builds the method's format on a random-weight model without calibration data (round-to-nearest
integers, the method's transforms and formats), which the speed suites time on a model's shapes
(:mod:`mosaicquant.harness.speedforms`); ``data_free=True`` says the method needs no calibration
data and runs on such a model as it is. A method with neither has no speed row on a shape model.
A method also says what it can run (:class:`Supports`: devices, dtypes, model architectures); the
harness refuses any other combination before it loads the model.
A suite is
``fn(model, config, ctx) -> dict[str, Metric]`` (see :mod:`mosaicquant.harness.suites`).

Example:
    >>> from dataclasses import dataclass
    >>> from mosaicquant.config import Config
    >>> @dataclass(frozen=True)
    ... class NoopConfig(Config):
    ...     pass
    >>> @register_method("noop-demo", config=NoopConfig)
    ... def noop(model, config, ctx):
    ...     return model
    >>> get_method("noop-demo").config is NoopConfig
    True
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mosaicquant.config import Config
from mosaicquant.errors import UserInputError, unknown_name

__all__ = [
    "Supports",
    "DEVICE_KINDS",
    "DTYPES",
    "Entry",
    "Registry",
    "METHODS",
    "SUITES",
    "BACKENDS",
    "BUILTIN_MODULES",
    "register_method",
    "register_suite",
    "register_backend",
    "get_method",
    "get_suite",
    "get_backend",
]

#: modules whose import registers the built-in plugins, per registry kind
BUILTIN_MODULES: dict[str, list[str]] = {
    "method": [
        "mosaicquant.baselines.fp16",
        "mosaicquant.baselines.rtn",
        "mosaicquant.baselines.quarot",
        "mosaicquant.baselines.spinquant",
        "mosaicquant.baselines.smoothquant",
        "mosaicquant.baselines.resq",
        "mosaicquant.baselines.atom",
        "mosaicquant.baselines.modelopt",
        "mosaicquant.baselines.torchao",
        "mosaicquant.methods.mosaicquant",
    ],
    "suite": [
        "mosaicquant.harness.suites.accuracy",
        "mosaicquant.harness.suites.memory",
        "mosaicquant.harness.suites.analysis",
        "mosaicquant.harness.suites.zeroshot",
        "mosaicquant.harness.suites.speed",
    ],
    "backend": ["mosaicquant.harness.tensorrt_llm"],
}


#: device kinds a method can name (``cuda:N`` is of kind ``cuda``)
DEVICE_KINDS = ("cpu", "cuda")
#: model dtypes a method can name
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Supports:
    """What a method can run: device kinds, model dtypes and model architectures.

    Attributes:
        devices: device kinds, a subset of :data:`DEVICE_KINDS`.
        dtypes: model dtypes, a subset of :data:`DTYPES`.
        architectures: model class names (``type(model).__name__``, e.g. ``"LlamaForCausalLM"``)
            the method's transforms handle, or ``None``: any causal LM, since the method only
            replaces linear layers.

    Raises:
        ValueError: a device or dtype outside the allowed sets, or an empty tuple.

    Example:
        >>> Supports(architectures=("LlamaForCausalLM",)).refusal("cuda:0", "bfloat16", "Qwen3ForCausalLM")
        "model architecture 'Qwen3ForCausalLM' is not supported: allowed 'LlamaForCausalLM'"
    """

    devices: tuple[str, ...] = DEVICE_KINDS
    dtypes: tuple[str, ...] = DTYPES
    architectures: tuple[str, ...] | None = None

    def __post_init__(self):
        for field_name, values, allowed in (("devices", self.devices, DEVICE_KINDS), ("dtypes", self.dtypes, DTYPES)):
            if not isinstance(values, tuple) or not values:
                raise ValueError(f"Supports.{field_name}={values!r}: give a non-empty tuple of {allowed}")
            bad = [v for v in values if v not in allowed]
            if bad:
                raise ValueError(f"Supports.{field_name}: {bad[0]!r} is not allowed: choose from {allowed}")
        if self.architectures is not None and (not isinstance(self.architectures, tuple) or not self.architectures
                                               or not all(isinstance(a, str) and a for a in self.architectures)):
            raise ValueError(f"Supports.architectures={self.architectures!r}: give None (any) or a non-empty "
                             "tuple of model class names")

    def refusal(self, device: str, dtype: str, architecture: str | None) -> str | None:
        """Why ``(device, dtype, architecture)`` cannot run, or None where it can.

        ``architecture`` None (not known before loading) is not checked here.
        """
        kind = device.split(":", 1)[0]
        if kind not in self.devices:
            return f"device {device!r} is not supported: allowed {', '.join(map(repr, self.devices))}"
        if dtype not in self.dtypes:
            return f"dtype {dtype!r} is not supported: allowed {', '.join(map(repr, self.dtypes))}"
        if architecture is not None and self.architectures is not None and architecture not in self.architectures:
            return (f"model architecture {architecture!r} is not supported: allowed "
                    f"{', '.join(map(repr, self.architectures))}")
        return None

    def check(self, method: str, device: str, dtype: str, architecture: str | None) -> None:
        """Raise where :meth:`refusal` gives a reason.

        Raises:
            UserInputError: naming the method, the value and what the method allows.
        """
        reason = self.refusal(device, dtype, architecture)
        if reason is not None:
            raise UserInputError(f"method {method!r}: {reason}")


@dataclass(frozen=True)
class Entry:
    """One registered plugin."""

    name: str
    fn: Callable[..., Any]
    config: type[Config]
    kind: str
    source: str
    description: str
    #: a method's data-free speed form, ``fn(model, config, ctx) -> (quantized linears, notes)``, or None
    speed_form: Callable[..., Any] | None = None
    #: a method that needs no calibration data: its own ``fn`` is its speed form
    data_free: bool = False
    #: what the method can run (methods only): a :class:`Supports`, or ``fn(config) -> Supports`` where
    #: the method's options change it
    supports: Supports | Callable[[Config], Supports] = Supports()
    #: whether the result depends on the run's seed (calibration draw, rotations, random choices, timing
    #: repeats); a cell whose method and suite are both unseeded runs once per sweep, whatever the seeds
    seeded: bool = True

    def supports_for(self, config: Config | None = None) -> Supports:
        """What the method can run with ``config`` (default: its default config)."""
        if isinstance(self.supports, Supports):
            return self.supports
        found = self.supports(config if config is not None else self.config())
        if not isinstance(found, Supports):
            raise TypeError(f"{self.kind} {self.name!r}: its supports function returned {found!r}, not a Supports")
        return found


class Registry:
    """Name → plugin map for one kind (method, suite or backend)."""

    def __init__(self, kind: str, group: str):
        self.kind = kind
        self.group = group
        self._entries: dict[str, Entry] = {}
        self._builtins_loaded = False
        self._loading_source = "direct registration"

    def register(self, name: str, fn: Callable[..., Any], config: type[Config], description: str = "",
                 speed_form: Callable[..., Any] | None = None, data_free: bool = False,
                 supports: Supports | Callable[[Config], Supports] | None = None,
                 seeded: bool = True) -> Entry:
        """Add ``name``; a second registration of the same name is an error."""
        if not name or name != name.strip() or ":" in name or "," in name:
            raise ValueError(f"{self.kind} name {name!r} must be non-empty and contain no ':' or ','")
        if not (isinstance(config, type) and issubclass(config, Config)):
            raise TypeError(f"{self.kind} {name!r}: config must be a Config subclass, got {config!r}")
        if speed_form is not None and not callable(speed_form):
            raise TypeError(f"{self.kind} {name!r}: speed_form must be a function, got {speed_form!r}")
        if speed_form is not None and data_free:
            raise ValueError(f"{self.kind} {name!r}: a data-free method is its own speed form; give speed_form "
                             "or data_free=True, not both")
        if supports is not None and not (isinstance(supports, Supports) or callable(supports)):
            raise TypeError(f"{self.kind} {name!r}: supports must be a Supports or fn(config) -> Supports, "
                            f"got {supports!r}")
        if name in self._entries:
            raise ValueError(
                f"duplicate {self.kind} name {name!r}: already registered by {self._entries[name].source}"
            )
        doc = description or (fn.__doc__ or "").strip().splitlines()[0:1]
        entry = Entry(name, fn, config, self.kind, self._loading_source,
                      doc if isinstance(doc, str) else (doc[0] if doc else ""), speed_form, data_free,
                      supports if supports is not None else Supports(), seeded)
        self._entries[name] = entry
        return entry

    def _load_builtins(self) -> None:
        if self._builtins_loaded:
            return
        self._loading_source = "builtin"
        try:
            for module in BUILTIN_MODULES.get(self.kind, []):
                importlib.import_module(module)
        finally:
            self._loading_source = "direct registration"
        self._builtins_loaded = True

    def _entry_points(self) -> dict[str, importlib.metadata.EntryPoint]:
        return {ep.name: ep for ep in importlib.metadata.entry_points(group=self.group)}

    def names(self) -> list[str]:
        """Names of built-ins, registered plugins and (not yet loaded) entry points."""
        self._load_builtins()
        return sorted(set(self._entries) | set(self._entry_points()))

    def get(self, name: str) -> Entry:
        """Look ``name`` up, loading its entry point if needed.

        Raises:
            UserInputError: unknown name, with a did-you-mean and the list of names.
        """
        self._load_builtins()
        if name in self._entries:
            return self._entries[name]
        eps = self._entry_points()
        if name in eps:
            self._loading_source = f"entry point {eps[name].value}"
            try:
                eps[name].load()
            except Exception as exc:
                raise UserInputError(
                    f"{self.kind} plugin {name!r} ({eps[name].value}) failed to load: {type(exc).__name__}: {exc}"
                ) from exc
            finally:
                self._loading_source = "direct registration"
            if name not in self._entries:
                raise UserInputError(
                    f"{self.kind} plugin {name!r} ({eps[name].value}) loaded but registered no {self.kind} named {name!r}"
                )
            return self._entries[name]
        raise unknown_name(self.kind, name, self.names())

    def registered(self) -> list[Entry]:
        """The entries registered so far, built-ins included, by name (entry points not yet loaded are not)."""
        self._load_builtins()
        return [self._entries[n] for n in sorted(self._entries)]

    def entries(self) -> list[Entry]:
        return [self.get(n) for n in self.names()]


METHODS = Registry("method", "mosaicquant.methods")
SUITES = Registry("suite", "mosaicquant.suites")
BACKENDS = Registry("backend", "mosaicquant.backends")


def _decorator(registry: Registry, name: str, config: type[Config], description: str, **extra):
    def wrap(fn):
        registry.register(name, fn, config, description, **extra)
        return fn

    return wrap


def register_method(name: str, *, config: type[Config], description: str = "",
                    speed_form: Callable[..., Any] | None = None, data_free: bool = False,
                    supports: Supports | Callable[[Config], Supports] | None = None, seeded: bool = True):
    """Decorator: register ``fn(model, config, ctx) -> model`` as method ``name``.

    Args:
        name: the method's name on the command line.
        config: its :class:`~mosaicquant.config.Config` subclass.
        description: one line for ``mosaicquant ls`` (default: the function's first docstring line).
        speed_form: ``fn(model, config, ctx) -> (quantized linears, notes)``: the method's format on a
            random-weight model without calibration data, for the speed suites; None: no such form.
        data_free: the method needs no calibration data; on a random-weight model it runs as it is.
        supports: the devices, dtypes and architectures it can run (default: any of each), or
            ``fn(config) -> Supports`` where its options change them.
        seeded: its result depends on the seed (calibration draw, rotations, random choices); ``False``
            (fp16, RTN) lets a sweep over several seeds run its cells once (see ``seeded`` of a suite).
    """
    return _decorator(METHODS, name, config, description, speed_form=speed_form, data_free=data_free,
                      supports=supports, seeded=seeded)


def register_suite(name: str, *, config: type[Config], description: str = "", seeded: bool = True):
    """Decorator: register ``fn(model, config, ctx) -> metrics`` as suite ``name``.

    Args:
        seeded: its result depends on the seed (few-shot draws, held-out calibration, timing repeats);
            ``False`` (perplexity on the fixed test split, counted memory): a cell of it and of an unseeded
            method runs once per sweep, at the sweep's first seed.
    """
    return _decorator(SUITES, name, config, description, seeded=seeded)


def register_backend(name: str, *, config: type[Config], description: str = ""):
    """Decorator: register an execution backend ``name``."""
    return _decorator(BACKENDS, name, config, description)


def get_method(name: str) -> Entry:
    return METHODS.get(name)


def get_suite(name: str) -> Entry:
    return SUITES.get(name)


def get_backend(name: str) -> Entry:
    return BACKENDS.get(name)
