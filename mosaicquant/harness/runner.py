"""The sweep runner: every (method spec × seed) quantizes a fresh copy of the model once and
runs each pending suite on it; each (model, method spec, suite, seed) cell is one record.

- Validation first: every name, option and path is checked before any model is loaded.
- Resume: a cell whose record exists with ``"status": "ok"`` is skipped; a failed or
  missing one is (re)computed.
- Isolation: an exception in a method fails every pending suite of that method spec (each
  recorded as failed with the error); an exception in a suite fails that cell only. The
  sweep goes on. ``KeyboardInterrupt`` stops it; finished records stay.
- Sharing: the calibration tokens are drawn once per seed and used by every method; the
  test tokens once per sweep (per worker process under a distributed executor).

The unit of work is a :class:`GroupTask`: one method spec × seed with its pending cells and
the method and suite functions already resolved, so it pickles and runs in another process
or on another machine (:mod:`mosaicquant.harness.executors`). :func:`run_group` runs one
task against a :class:`SweepState`, the per-process cache of model, tokenizer and token
streams. The ``local`` executor runs every task in this process against one state, in plan
order; that is the whole sweep on one machine.
"""

from __future__ import annotations

import copy
import gc
import hashlib
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mosaicquant.harness import data as data_mod
from mosaicquant.harness import models as models_mod
from mosaicquant.harness import shapes as shapes_mod
from mosaicquant.harness.context import QuantContext, SuiteContext
from mosaicquant.harness.errors import Unavailable, UserInputError
from mosaicquant.harness.results import (
    SCHEMA, Metric, ensure_writable_dir, environment, git_info, now_iso, read_record, record_path, write_record,
)
from mosaicquant.harness.spec import PluginSpec, RunSpec
from mosaicquant.harness.speedforms import speed_form
from mosaicquant.kernels._common import check_kernel_environment

if TYPE_CHECKING:
    from mosaicquant.harness.executors import ExecutorSettings

__all__ = [
    "Cell", "CellOutcome", "GroupTask", "SweepResult", "SweepState", "plan_cells", "plan_groups", "validate_run",
    "run_group", "run_sweep", "is_finished", "failure_record",
]


@dataclass(frozen=True)
class Cell:
    method: PluginSpec
    suite: PluginSpec
    seed: int
    path: Path


@dataclass(frozen=True)
class CellOutcome:
    """What became of one cell: its record path, ``"ok"`` or ``"failed"``, and a log line."""

    path: Path
    status: str
    line: str


@dataclass(frozen=True)
class GroupTask:
    """One method spec × seed with its pending cells: what an executor runs as one task.

    The method's and suites' functions are resolved from the registry where the sweep is
    planned and travel with the task, so a worker needs no registration of its own.

    Attributes:
        spec: the sweep.
        cells: the pending cells of this method spec and seed, in plan order.
        method_fn: ``fn(model, config, QuantContext) -> model``.
        suite_fns: one ``fn(model, config, SuiteContext) -> metrics`` per cell.
        device_map: ``None`` (the float model is copied onto ``spec.device``) or ``"auto"``
            (the model is loaded spread over every GPU the process sees, see
            :func:`mosaicquant.harness.models.load_model`).
    """

    spec: RunSpec
    cells: tuple[Cell, ...]
    method_fn: Callable
    suite_fns: tuple[Callable, ...]
    device_map: str | None = None

    @property
    def method(self) -> PluginSpec:
        return self.cells[0].method

    @property
    def seed(self) -> int:
        return self.cells[0].seed

    @property
    def label(self) -> str:
        return self.method.label


def plan_cells(spec: RunSpec) -> list[Cell]:
    """All cells of the sweep, in method-major order (a local model's records are keyed by its
    resolved path, see :func:`mosaicquant.harness.models.model_key`)."""
    model = models_mod.model_key(spec.model)
    return [
        Cell(m, s, seed, record_path(spec.out, model, m.label, s.label, seed))
        for m in spec.methods for seed in spec.seeds for s in spec.suites
    ]


def plan_groups(spec: RunSpec, pending: list[Cell], device_map: str | None = None) -> list[GroupTask]:
    """Group pending cells by (method label, seed), keeping plan order, into tasks.

    Args:
        spec: the sweep.
        pending: the cells to compute.
        device_map: passed to every task (see :class:`GroupTask`).

    Returns:
        One :class:`GroupTask` per method spec × seed that has pending cells.
    """
    groups: dict[tuple[str, int], list[Cell]] = {}
    for cell in pending:
        groups.setdefault((cell.method.label, cell.seed), []).append(cell)
    return [
        GroupTask(spec=spec, cells=tuple(cells), method_fn=cells[0].method.entry.fn,
                  suite_fns=tuple(cell.suite.entry.fn for cell in cells), device_map=device_map)
        for cells in groups.values()
    ]


def is_finished(path: Path) -> bool:
    if not path.exists():
        return False
    try:
        return read_record(path).get("status") == "ok"
    except (OSError, ValueError):
        return False


def validate_run(spec: RunSpec) -> None:
    """Check model, corpus, results directory and the kernels' environment variables (names and
    options were checked at parse time).

    Raises:
        UserInputError: with one line naming the value and what is allowed.
    """
    spec.validate()
    check_kernel_environment()
    models_mod.resolve_model(spec.model)
    data_mod.resolve_corpus(spec.corpus)
    ensure_writable_dir(spec.out)
    if spec.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserInputError(f"device={spec.device!r} but no CUDA GPU is available here: use --device cpu")
    suites = [s.name for s in spec.suites]
    if shapes_mod.is_shape_model(spec.model):
        text = [s for s in suites if s in shapes_mod.TEXT_SUITES]
        if text:
            raise UserInputError(f"model {spec.model!r} has random weights: suite(s) {', '.join(text)} need a real "
                                 "model; with a shape model use throughput, latency or memory")
    speed = [s for s in suites if s in ("throughput", "latency")]
    if speed and not spec.device.startswith("cuda"):
        raise UserInputError(f"suite(s) {', '.join(speed)} time GPU kernels: they need --device cuda "
                             f"(got device={spec.device!r})")


def _error_dict(exc: BaseException) -> dict[str, Any]:
    return {"type": type(exc).__name__, "message": str(exc),
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-8000:]}


@dataclass
class SweepResult:
    written: list[Path] = field(default_factory=list)
    skipped: list[Path] = field(default_factory=list)
    failed: list[Path] = field(default_factory=list)
    #: cells a backend cannot run here (recorded with the reason; not failures)
    unavailable: list[Path] = field(default_factory=list)

    def add(self, outcome: CellOutcome) -> None:
        target = {"ok": self.written, "unavailable": self.unavailable}.get(outcome.status, self.failed)
        target.append(outcome.path)


class SweepState:
    """Per-process cache of what every task of a sweep shares: model, tokenizer, token streams.

    The float model is loaded once on the CPU (on first use) and every task quantizes a deep
    copy of it on the device; calibration tokens are drawn once per seed, test tokens once.

    Args:
        spec: the sweep (only model, dtype, corpus and calibration settings are used).
        log: progress printer.
    """

    def __init__(self, spec: RunSpec, log: Callable[[str], None] = print):
        self.spec = spec
        self.log = log
        self._loaded: models_mod.LoadedModel | None = None
        self._spread: torch.nn.Module | None = None
        self._calibration: dict[int, torch.Tensor] = {}
        self._test: torch.Tensor | None = None
        self._env: dict[str, Any] | None = None
        self._git: dict[str, Any] | None = None

    def loaded(self) -> models_mod.LoadedModel:
        """The float model on the CPU with its tokenizer (loaded on the first call)."""
        if self._loaded is None or self._loaded.model is None:
            t0 = time.perf_counter()
            self._loaded = models_mod.load_model(self.spec.model, dtype=getattr(torch, self.spec.dtype),
                                                 device=torch.device("cpu"))
            self.log(f"[mosaicquant] loaded {self.spec.model} in {time.perf_counter() - t0:.1f}s")
        return self._loaded

    def model_for_group(self, device: torch.device, device_map: str | None) -> torch.nn.Module:
        """A fresh float model for one task: a copy on ``device``, or a new load over the GPUs
        (a random-weight shape model is built anew on ``device``)."""
        if shapes_mod.is_shape_model(self.spec.model):
            return shapes_mod.build_shape_model(self.spec.model, dtype=getattr(torch, self.spec.dtype), device=device)
        if device_map is None:
            return copy.deepcopy(self.loaded().model).to(device)
        if self._spread is not None:
            model, self._spread = self._spread, None
            return model
        return self._load_spread(device, device_map)

    def _load_spread(self, device: torch.device, device_map: str) -> torch.nn.Module:
        # too large to keep a float copy per task in memory: each task loads it again, spread by the map
        fresh = models_mod.load_model(self.spec.model, dtype=getattr(torch, self.spec.dtype), device=device,
                                      device_map=device_map)
        if self._loaded is None:
            self._loaded = models_mod.LoadedModel(model=None, tokenizer=fresh.tokenizer, name=fresh.name,
                                                  source=fresh.source, caveat=fresh.caveat)
        return fresh.model

    def metadata(self, device: torch.device, device_map: str | None) -> models_mod.LoadedModel:
        """Tokenizer, name, source and caveat of the model (under a device map, without a CPU copy)."""
        if shapes_mod.is_shape_model(self.spec.model):
            source = models_mod.resolve_model(self.spec.model)
            return models_mod.LoadedModel(model=None, tokenizer=None, name=source.name, source=source.description,
                                          caveat=source.caveat)
        if device_map is None:
            return self.loaded()
        if self._loaded is None:
            # the first load over the GPUs brings the tokenizer; its model serves the next task
            self._spread = self._load_spread(device, device_map)
        return self._loaded

    def calibration_for(self, seed: int, tokenizer: Any) -> Callable[[], torch.Tensor]:
        def get() -> torch.Tensor:
            if seed not in self._calibration:
                self._calibration[seed] = data_mod.calibration_tokens(
                    tokenizer, self.spec.corpus, self.spec.calib_samples, self.spec.calib_seqlen, seed)
            return self._calibration[seed]
        return get

    def test_tokens(self, tokenizer: Any) -> Callable[[], torch.Tensor]:
        def get() -> torch.Tensor:
            if self._test is None:
                self._test = data_mod.test_tokens(tokenizer, self.spec.corpus)
            return self._test
        return get

    def calibration_record(self, seed: int) -> dict[str, Any] | None:
        if seed not in self._calibration:
            return None
        tok = self._calibration[seed]
        return {"corpus": self.spec.corpus, "n_samples": self.spec.calib_samples, "seqlen": self.spec.calib_seqlen,
                "seed": seed, "tokens_sha256": hashlib.sha256(tok.numpy().tobytes()).hexdigest()[:16]}

    @property
    def env(self) -> dict[str, Any]:
        if self._env is None:
            self._env = environment()
        return self._env

    @property
    def git(self) -> dict[str, Any]:
        if self._git is None:
            self._git = git_info()
        return self._git


def _record_head(spec: RunSpec, model_meta: dict[str, Any], cell: Cell, env: dict[str, Any],
                 git: dict[str, Any]) -> dict[str, Any]:
    method = cell.method
    return {
        "schema": SCHEMA,
        "model": {"spec": spec.model, **model_meta, "dtype": spec.dtype},
        "method": {"name": method.name, "label": method.label, "config": method.config.to_dict()},
        "suite": {"name": cell.suite.name, "label": cell.suite.label, "config": cell.suite.config.to_dict()},
        "seed": cell.seed,
        "corpus": spec.corpus,
        "calibration": None,
        "method_info": {},
        "env": env,
        "git": git,
        "date": now_iso(),
    }


def failure_record(spec: RunSpec, cell: Cell, stage: str, exc: BaseException,
                   message: str | None = None) -> dict[str, Any]:
    """A failed record for a cell whose task never reported back (e.g. its worker died).

    Built where the sweep is driven, without the model: the model's name, source and caveat
    come from :func:`mosaicquant.harness.models.resolve_model`.

    Args:
        spec: the sweep.
        cell: the cell.
        stage: where it failed (``"worker"``).
        exc: the exception the executor reported.
        message: the error message to record (default ``str(exc)``).

    Returns:
        The record, ``"status": "failed"``.
    """
    source = models_mod.resolve_model(spec.model)
    record = _record_head(spec, {"name": source.name, "source": source.description, "caveat": source.caveat},
                          cell, environment(), git_info())
    error = _error_dict(exc)
    if message is not None:
        error["message"] = message
    record.update(status="failed", stage=stage, metrics={}, error=error, timing={})
    return record


def run_group(task: GroupTask, state: SweepState, log: Callable[[str], None] = print) -> list[CellOutcome]:
    """Quantize once for ``task`` and run each of its pending suites, writing each record.

    A cell whose record is already ``ok`` when the task starts (a task recomputed after its
    worker was lost) is not computed or written again.

    Args:
        task: the method spec × seed and its cells.
        state: the process's cache of model and tokens for this sweep.
        log: progress printer.

    Returns:
        One :class:`CellOutcome` per cell of the task, in order.
    """
    spec = task.spec
    todo = [(cell, fn) for cell, fn in zip(task.cells, task.suite_fns) if not is_finished(cell.path)]
    outcomes = [CellOutcome(cell.path, "ok", f"[mosaicquant]   {task.label} / {cell.suite.label}: already finished")
                for cell in task.cells if is_finished(cell.path)]
    if not todo:
        return outcomes
    device = torch.device(spec.device)
    meta = state.metadata(device, task.device_map)
    label, seed, method = task.label, task.seed, task.method
    torch.manual_seed(seed)
    qctx = QuantContext(calibration=state.calibration_for(seed, meta.tokenizer), seed=seed, device=device,
                        tokenizer=meta.tokenizer, log=log)
    log(f"[mosaicquant] quantizing: {label} (seed {seed})")
    t_q = time.perf_counter()
    model = None
    quant_error = None
    try:
        model = state.model_for_group(device, task.device_map)
        if shapes_mod.is_shape_model(spec.model):
            model = speed_form(method.name, model, method.config, qctx)
        else:
            model = task.method_fn(model, method.config, qctx)
        model.eval()
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - recorded in the cell, the sweep goes on
        quant_error = exc
    quant_s = time.perf_counter() - t_q
    model_meta = {"name": meta.name, "source": meta.source, "caveat": meta.caveat}

    for cell, suite_fn in todo:
        record = _record_head(spec, model_meta, cell, state.env, state.git)
        record["method_info"] = dict(qctx.info)
        record["timing"] = {"quantize_s": round(quant_s, 3)}
        record["calibration"] = state.calibration_record(seed)
        if quant_error is not None:
            status = "unavailable" if isinstance(quant_error, Unavailable) else "failed"
            record.update(status=status, stage="quantize", metrics={}, error=_error_dict(quant_error))
            write_record(cell.path, record)
            line = f"[mosaicquant]   {status.upper()} {label} / {cell.suite.label}: {type(quant_error).__name__}: {quant_error}"
            log(line)
            outcomes.append(CellOutcome(cell.path, status, line))
            continue
        sctx = SuiteContext(model_name=spec.model, tokenizer=meta.tokenizer, corpus=spec.corpus,
                            test_tokens=state.test_tokens(meta.tokenizer), seed=seed, device=device,
                            method_info=qctx.info, calibration=state.calibration_for(seed, meta.tokenizer), log=log)
        t_s = time.perf_counter()
        line = ""
        try:
            with torch.no_grad():
                metrics = suite_fn(model, cell.suite.config, sctx)
            record["metrics"] = {k: (v.to_dict() if isinstance(v, Metric) else v) for k, v in metrics.items()}
            record["status"] = "ok"
            record["error"] = None
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # noqa: BLE001
            status = "unavailable" if isinstance(exc, Unavailable) else "failed"
            record.update(status=status, stage="suite", metrics={}, error=_error_dict(exc))
            line = f"[mosaicquant]   {status.upper()} {label} / {cell.suite.label}: {type(exc).__name__}: {exc}"
            log(line)
        record["timing"]["suite_s"] = round(time.perf_counter() - t_s, 3)
        record["method_info"] = dict(qctx.info)
        write_record(cell.path, record)
        if record["status"] == "ok":
            shown = ", ".join(f"{k}={v['value']:.4g}" for k, v in list(record["metrics"].items())[:3])
            line = f"[mosaicquant]   {label} / {cell.suite.label}: {shown}"
            log(line)
        outcomes.append(CellOutcome(cell.path, record["status"], line))
    del model
    release_memory()
    return outcomes


def release_memory() -> None:
    """Free a finished group's model before the next group builds its own (call after dropping the references).

    A model can sit in reference cycles (modules that point back at their model), which ``del`` does not free
    until the collector happens to run: it runs here, and the CUDA caching allocator returns what it holds, so the
    next group (a 32B model's BF16 weights are 64 GB) starts from what the process needs, not from what it held.
    """
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_sweep(spec: RunSpec, log: Callable[[str], None] = print,
              executor: ExecutorSettings | None = None, backend: str | None = None) -> SweepResult:
    """Run every pending cell of ``spec`` and write its record.

    Args:
        spec: the sweep.
        log: progress printer.
        executor: where the tasks run (default: ``local``, in this process); see
            :mod:`mosaicquant.harness.executors`.
        backend: ``name[:key=value...]`` of a registered backend that runs the cells instead of
            this process (see :mod:`mosaicquant.harness.backends`); ``None`` or ``"torch"`` for
            the in-process default. A backend is asked before any model is loaded.

    Returns:
        the paths written, skipped (already finished), failed and unavailable.

    Raises:
        UserInputError: bad spec, unknown backend, or executor settings that do not fit it.
    """
    from mosaicquant.harness.backends import parse_backend_spec, run_backend_sweep
    from mosaicquant.harness.executors import ExecutorSettings, make_executor

    settings = executor if executor is not None else ExecutorSettings()
    chosen = parse_backend_spec(backend)
    if chosen is not None:
        return run_backend_sweep(spec, chosen, log)
    validate_run(spec)
    runner = make_executor(settings, spec)
    cells = plan_cells(spec)
    result = SweepResult()
    pending = []
    for cell in cells:
        if is_finished(cell.path):
            result.skipped.append(cell.path)
        else:
            pending.append(cell)
    log(f"[mosaicquant] {len(cells)} cells: {len(result.skipped)} finished, {len(pending)} to run")
    if not pending:
        return result
    tasks = plan_groups(spec, pending, device_map=settings.device_map)
    runner.run(tasks, result, log)
    return result
