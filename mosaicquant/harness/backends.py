"""Execution backends other than the in-process PyTorch one (``mosaicquant run --backend NAME``).

The default backend runs every cell in this process (quantize with the method, then run the
suite on the model). A registered backend runs a cell with another engine instead, e.g.
``tensorrt-llm`` (:mod:`mosaicquant.harness.tensorrt_llm`). It is asked first whether it can
run here; where it cannot, the cell's record says ``"status": "unavailable"`` with the reason
and the exact commands a user with the engine would run, and it never holds numbers.

A backend is registered with ``@register_backend(name, config=...)`` on a function
``fn(request: BackendRequest, config) -> BackendOutcome``; it is called once per cell, before
any model is loaded, so an unavailable backend costs no model load.

Example:
    >>> outcome = BackendOutcome.unavailable("no CUDA GPU", commands=["trtllm-bench ..."])
    >>> outcome.status, outcome.reason
    ('unavailable', 'no CUDA GPU')
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mosaicquant.config import Config, parse_kv_pairs
from mosaicquant.errors import UserInputError, unknown_name
from mosaicquant.harness import data as data_mod
from mosaicquant.harness import models as models_mod
from mosaicquant.harness.results import (
    Metric, ensure_writable_dir, environment, git_info, record_path, write_record,
)
from mosaicquant.harness.runner import (
    Cell, CellOutcome, SweepResult, _error_dict, _record_head, is_finished, seed_independent,
)
from mosaicquant.harness.spec import RunSpec
from mosaicquant.registry import BACKENDS, Entry

__all__ = [
    "DEFAULT_BACKEND", "BackendRequest", "BackendOutcome", "backend_label", "backend_record_path",
    "parse_backend_spec", "run_backend_cells", "run_backend_sweep",
]

#: the in-process PyTorch backend: methods and suites run in this process
DEFAULT_BACKEND = "torch"


@dataclass(frozen=True)
class BackendRequest:
    """One cell as a backend sees it.

    Attributes:
        model: the model spec string.
        method_name / method_label / method_config: the method spec of the cell.
        suite_name / suite_label / suite_config: the suite spec of the cell.
        seed: the cell's seed.
        out_dir: the sweep's results directory (a backend may keep its files below it).
        calib_samples / calib_seqlen / corpus: the sweep's calibration settings.
    """

    model: str
    method_name: str
    method_label: str
    method_config: dict[str, Any]
    suite_name: str
    suite_label: str
    suite_config: dict[str, Any]
    seed: int
    out_dir: str
    calib_samples: int
    calib_seqlen: int
    corpus: str


@dataclass(frozen=True)
class BackendOutcome:
    """What a backend made of one cell.

    Attributes:
        status: ``"ok"`` (metrics measured by the engine), ``"unavailable"`` (the engine
            cannot run here or cannot run this cell; ``reason`` says why) or ``"failed"``.
        reason: why the cell is unavailable or failed.
        commands: the exact commands that run (or would run) the cell with the engine.
        metrics: measured values (only with ``"ok"``).
        details: anything else worth keeping in the record (versions, what was checked).
        method_info: what the cell's method is (bits, KV bits, execution path), as a method
            reports it in ``ctx.info``; copied into the record's ``method_info``.
    """

    status: str
    reason: str | None = None
    commands: tuple[str, ...] = ()
    metrics: dict[str, Metric] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    method_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.status not in ("ok", "unavailable", "failed"):
            raise ValueError(f"status={self.status!r} is not allowed: choose one of 'ok', 'unavailable', 'failed'")
        if self.status != "ok" and self.metrics:
            raise ValueError(f"a {self.status!r} outcome carries no metrics")
        if self.status != "ok" and not self.reason:
            raise ValueError(f"a {self.status!r} outcome needs a reason")

    @classmethod
    def unavailable(cls, reason: str, commands=(), details: dict[str, Any] | None = None,
                    method_info: dict[str, Any] | None = None) -> BackendOutcome:
        return cls("unavailable", reason=reason, commands=tuple(commands), details=dict(details or {}),
                   method_info=dict(method_info or {}))


def backend_label(method_label: str, backend: str) -> str:
    """Label of a method spec run by ``backend`` (``modelopt:recipe=int4_awq@tensorrt-llm``).

    A report row and a record file of their own: the same spec run in-process is another cell.
    """
    return f"{method_label}@{backend}"


def backend_record_path(out_dir: str | Path, model: str, method_label: str, suite_label: str, seed: int,
                        backend: str) -> Path:
    """Record file of a cell run by ``backend``: distinct from the in-process cell of the same spec."""
    return record_path(out_dir, model, backend_label(method_label, backend), suite_label, seed)


def run_backend_cells(spec: RunSpec, cells: list[Cell], backend: Entry, backend_config,
                      log: Callable[[str], None] = print) -> list[CellOutcome]:
    """Run each cell with ``backend`` and write its record (no model is loaded here).

    Args:
        spec: the sweep.
        cells: the cells to run (their ``path`` is the backend's record path).
        backend: the registry entry of the backend.
        backend_config: its validated config.
        log: progress printer.

    Returns:
        One :class:`~mosaicquant.harness.runner.CellOutcome` per cell; an unavailable cell has
        status ``"unavailable"``.
    """
    source = models_mod.resolve_model(spec.model)
    model_meta = {"name": source.name, "source": source.description, "caveat": source.caveat}
    env, git = environment(), git_info()
    outcomes = []
    for cell in cells:
        request = BackendRequest(
            model=spec.model, method_name=cell.method.name, method_label=cell.method.label,
            method_config=cell.method.config.to_dict(), suite_name=cell.suite.name, suite_label=cell.suite.label,
            suite_config=cell.suite.config.to_dict(), seed=cell.seed, out_dir=str(spec.out),
            calib_samples=spec.calib_samples, calib_seqlen=spec.calib_seqlen, corpus=spec.corpus)
        t0 = time.perf_counter()
        try:
            outcome = backend.fn(request, backend_config)
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # noqa: BLE001 - recorded in the cell, the sweep goes on
            outcome = BackendOutcome("failed", reason=f"{type(exc).__name__}: {exc}")
            error = _error_dict(exc)
        else:
            error = None if outcome.status == "ok" else {"type": outcome.status, "message": outcome.reason}
        # the in-process record's head (seed_independent, preset, command, ...), with the backend's method label
        record = {
            **_record_head(spec, model_meta, cell, env, git),
            "method": {"name": cell.method.name, "label": backend_label(cell.method.label, backend.name),
                       "spec_label": cell.method.label, "backend": backend.name,
                       "config": cell.method.config.to_dict()},
            "method_info": dict(outcome.method_info),
            "backend": {"name": backend.name, "config": backend_config.to_dict(), "reason": outcome.reason,
                        "commands": list(outcome.commands), **outcome.details},
            "status": outcome.status,
            "stage": None if outcome.status == "ok" else "backend",
            "metrics": {k: v.to_dict() for k, v in outcome.metrics.items()},
            "error": error,
            "timing": {"backend_s": round(time.perf_counter() - t0, 3)},
        }
        write_record(cell.path, record)
        label = f"{backend_label(cell.method.label, backend.name)} / {cell.suite.label}"
        if outcome.status == "ok":
            shown = ", ".join(f"{k}={v.value:.4g}" for k, v in list(outcome.metrics.items())[:3])
            line = f"[mosaicquant]   {label}: {shown}"
        elif outcome.status == "unavailable":
            line = f"[mosaicquant]   {label}: not available: {outcome.reason}"
        else:
            line = f"[mosaicquant]   FAILED {label}: {outcome.reason}"
        log(line)
        outcomes.append(CellOutcome(cell.path, outcome.status, line))
    return outcomes


def parse_backend_spec(text: str | None) -> tuple[Entry, Config] | None:
    """Parse ``--backend name[:key=value...]``; ``None`` for the default in-process backend.

    Raises:
        UserInputError: unknown backend (with a did-you-mean) or a bad option.
    """
    if text is None or not str(text).strip():
        return None
    name, _, rest = str(text).strip().partition(":")
    if name == DEFAULT_BACKEND:
        if rest:
            raise UserInputError(f"backend {DEFAULT_BACKEND!r} takes no options, got {rest!r}")
        return None
    if name not in BACKENDS.names():
        raise unknown_name("backend", name, [DEFAULT_BACKEND, *BACKENDS.names()])
    entry = BACKENDS.get(name)
    try:
        config = entry.config.from_dict(parse_kv_pairs(rest))
    except (TypeError, ValueError) as exc:
        raise UserInputError(f"backend {name!r}: {exc}") from None
    return entry, config


def run_backend_sweep(spec: RunSpec, backend: tuple[Entry, Config], log: Callable[[str], None] = print) -> SweepResult:
    """Run every pending cell of ``spec`` with ``backend`` (resume as in-process: ``ok`` cells are kept).

    The sweep is checked as :func:`~mosaicquant.harness.runner.validate_run` checks it, less the
    device: where the cells run is the backend's to say.

    Raises:
        UserInputError: bad spec, model, corpus or results directory.
    """
    spec.validate()
    models_mod.resolve_model(spec.model)
    data_mod.resolve_corpus(spec.corpus)
    ensure_writable_dir(spec.out)
    entry, config = backend
    result = SweepResult()
    pending = []
    model = models_mod.model_key(spec.model)
    for method in spec.methods:
        for seed in spec.seeds:
            for suite in spec.suites:
                once = seed_independent(method, suite)
                if once and seed != spec.seeds[0]:
                    continue  # as in-process: a seed-independent cell runs at the first seed only
                path = backend_record_path(spec.out, model, method.label, suite.label, seed, entry.name)
                cell = Cell(method, suite, seed, path, once)
                if is_finished(path):
                    result.skipped.append(path)
                else:
                    pending.append(cell)
    total = len(pending) + len(result.skipped)
    log(f"[mosaicquant] {total} cells on backend {entry.name}: {len(result.skipped)} finished, {len(pending)} to run")
    for outcome in run_backend_cells(spec, pending, entry, config, log):
        result.add(outcome)
    return result
