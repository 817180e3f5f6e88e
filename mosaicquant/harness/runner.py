"""The sweep runner: every (method spec × seed) quantizes a fresh copy of the model once and
runs each pending suite on it; each (model, method spec, suite, seed) cell is one record.

- Validation first: every name, option and path is checked before any model is loaded.
- One run at a time per results directory (:func:`mosaicquant.harness.results.results_lock`):
  a second run into it stops at once, naming the run that holds it.
- Resume: a cell whose record is valid (:func:`mosaicquant.harness.results.record_problem`,
  the check ``report`` and ``compare`` apply) with ``"status": "ok"`` is skipped; a failed,
  missing or invalid one is (re)computed, an invalid one named with why. A finished record
  made with other run settings that its cell depends on (dtype; the corpus and calibration
  size it read) stops the sweep before any work
  (:func:`check_finished_settings`): it is neither reused nor overwritten.
- Isolation: an exception in a method fails every pending suite of that method spec (each
  recorded as failed with the error); an exception in a suite fails that cell only. The
  sweep goes on. A model that passed validation but does not load fails every cell (stage
  ``"load"``, the error naming the file), under either executor; it is loaded once.
  ``KeyboardInterrupt`` stops it; finished records stay. A record the results
  directory refuses (disk full, read-only) stops it too, the computed record kept elsewhere
  (:func:`mosaicquant.harness.results.save_record`).
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
from typing import Any

import torch

from mosaicquant.errors import Unavailable, UserInputError
from mosaicquant.harness import assets
from mosaicquant.harness import data as data_mod
from mosaicquant.harness import models as models_mod
from mosaicquant.harness import shapes as shapes_mod
from mosaicquant.harness.context import QuantContext, SuiteContext
from mosaicquant.harness.qcache import QuantCache, key_parts
from mosaicquant.harness.results import (
    SCHEMA, Metric, command_line, ensure_writable_dir, environment, git_info, now_iso, read_valid_record,
    record_path, save_record,
)
from mosaicquant.harness.spec import PluginSpec, RunSpec, check_model_fit
from mosaicquant.harness.speedforms import speed_form
from mosaicquant.registry import Supports

__all__ = [
    "Cell", "CellOutcome", "GroupTask", "SweepResult", "SweepState", "plan_cells", "seed_independent", "plan_groups",
    "validate_run", "run_group", "is_finished", "failure_record", "check_finished_settings", "settings_differences",
]


@dataclass(frozen=True)
class Cell:
    method: PluginSpec
    suite: PluginSpec
    seed: int
    path: Path
    seed_independent: bool = False


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
        supports: what the method can run (:class:`mosaicquant.registry.Supports`), checked on the loaded model.
        device_map: ``None`` (the float model is copied onto ``spec.device``) or ``"auto"``
            (the model is loaded spread over every GPU the process sees, see
            :func:`mosaicquant.harness.models.load_model`).
    """

    spec: RunSpec
    cells: tuple[Cell, ...]
    method_fn: Callable
    suite_fns: tuple[Callable, ...]
    supports: Supports | None = None
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


def seed_independent(method: PluginSpec, suite: PluginSpec) -> bool:
    """Whether a cell's result does not depend on its seed: neither its method nor its suite is
    registered ``seeded`` (fp16 or RTN measured by perplexity or memory)."""
    return not method.entry.seeded and not suite.entry.seeded


def plan_cells(spec: RunSpec) -> list[Cell]:
    """All cells of the sweep, in method-major order (a local model's records are keyed by its
    content fingerprint, see :func:`mosaicquant.harness.models.model_key`). A seed-independent
    cell (:func:`seed_independent`) is planned once, at the sweep's first seed."""
    model = models_mod.model_key(spec.model)
    name = models_mod.resolve_model(spec.model).name
    return [
        Cell(m, s, seed, record_path(spec.out, model, m.label, s.label, seed, name=name), seed_independent(m, s))
        for m in spec.methods for seed in spec.seeds for s in spec.suites
        if seed == spec.seeds[0] or not seed_independent(m, s)
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
                  suite_fns=tuple(cell.suite.entry.fn for cell in cells),
                  supports=cells[0].method.entry.supports_for(cells[0].method.config), device_map=device_map)
        for cells in groups.values()
    ]


def is_finished(path: Path) -> bool:
    return finished_record(path) is not None


def finished_record(path: Path) -> dict[str, Any] | None:
    """The record at ``path`` if it is valid (the check ``report`` and ``compare`` apply,
    :func:`mosaicquant.harness.results.record_problem`) and says ``"status": "ok"``, else ``None``."""
    record, _ = read_valid_record(path)
    return record if record is not None and record.get("status") == "ok" else None


def settings_differences(spec: RunSpec, record: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """The run settings a finished cell depends on that ``spec`` asks differently.

    What a cell computes is fixed by its key (model, method spec, suite spec, seed) and by the run
    settings the record stores: the dtype (always), the calibration set's corpus, sample count and
    length when its method or suite drew one (``calibration`` is ``None`` otherwise), and the
    corpus whose test split its suite read (``test_corpus``; a record from before that key is
    taken to have read ``corpus``). The device is not compared: it changes where a cell runs,
    not what it computes, and a sweep may be finished on another machine.

    Args:
        spec: this run.
        record: a finished record of one of its cells.

    Returns:
        ``(setting, recorded, requested)`` for each difference, in that order; empty if none.
    """
    out: list[tuple[str, Any, Any]] = []
    dtype = (record.get("model") or {}).get("dtype")
    if dtype is not None and dtype != spec.dtype:
        out.append(("dtype", dtype, spec.dtype))
    calibration = record.get("calibration")
    if isinstance(calibration, dict):
        for key, setting, requested in (("corpus", "corpus", spec.corpus), ("n_samples", "calib_samples",
                                        spec.calib_samples), ("seqlen", "calib_seqlen", spec.calib_seqlen)):
            if key in calibration and calibration[key] != requested:
                out.append((setting, calibration[key], requested))
    test_corpus = record["test_corpus"] if "test_corpus" in record else record.get("corpus")
    if test_corpus is not None and test_corpus != spec.corpus and all(d[0] != "corpus" for d in out):
        out.append(("corpus", test_corpus, spec.corpus))
    return out


def check_finished_settings(spec: RunSpec, finished: list[tuple[Cell, dict[str, Any]]]) -> None:
    """Refuse a run whose settings differ from those of finished records it would skip.

    Skipping such a record would report results this run did not ask for; recomputing it would
    overwrite results another run asked for. Neither happens: the user picks another ``--out``
    or removes the records.

    Args:
        spec: this run.
        finished: the cells whose records are finished, with their records.

    Raises:
        UserInputError: naming the first such cell, each setting with its recorded and requested
            value, and how many records differ.
    """
    differing = [(cell, diffs) for cell, record in finished if (diffs := settings_differences(spec, record))]
    if not differing:
        return
    cell, diffs = differing[0]
    shown = ", ".join(f"{setting}={recorded!r} (this run: {requested!r})" for setting, recorded, requested in diffs)
    more = f"; {len(differing)} finished records differ" if len(differing) > 1 else ""
    raise UserInputError(
        f"results directory {str(spec.out)!r} holds a finished record made with other settings: cell "
        f"{cell.method.label} / {cell.suite.label} / seed {cell.seed} ({cell.path.name}) has {shown}{more}; "
        "use another --out, or remove those records to recompute them")


def check_supported(spec: RunSpec, architecture: str | None) -> None:
    """Refuse a method that cannot run on the sweep's device, dtype or model architecture.

    Args:
        spec: the sweep.
        architecture: the model's class name, or None where not known yet (checked once loaded).

    Raises:
        UserInputError: naming the method, the value and what the method allows (its ``Supports``).
    """
    for method in spec.methods:
        method.entry.supports_for(method.config).check(method.name, spec.device, spec.dtype, architecture)


def validate_run(spec: RunSpec) -> None:
    """Check model (its files and the options that depend on its sizes, without loading it), corpus,
    cache and results directory (names and options, the kernels' settings among them, were checked
    at parse time).

    Raises:
        UserInputError: with one line naming the value and what is allowed.
    """
    spec.validate()
    assets.cache_dir()  # a cache variable naming a file fails here, not at the first write
    check_model_fit(spec, models_mod.model_dimensions(spec.model))  # also checks the model's files
    check_supported(spec, models_mod.model_architecture(spec.model))
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
        self._load_error: Exception | None = None
        self._spread: torch.nn.Module | None = None
        self._calibration: dict[int, torch.Tensor] = {}
        self._test: torch.Tensor | None = None
        self._corpus_summary: dict[str, Any] | None = None
        self._env: dict[str, Any] | None = None
        self._git: dict[str, Any] | None = None

    def loaded(self) -> models_mod.LoadedModel:
        """The float model on the CPU with its tokenizer (loaded on the first call).

        Raises:
            Exception: what loading raised; a failed load is not tried again by later calls.
        """
        if self._load_error is not None:
            raise self._load_error
        if self._loaded is None or self._loaded.model is None:
            t0 = time.perf_counter()
            try:
                self._loaded = models_mod.load_model(self.spec.model, dtype=getattr(torch, self.spec.dtype),
                                                     device=torch.device("cpu"))
            except Exception as exc:  # noqa: BLE001 - every task of the sweep records it
                self._load_error = exc
                raise
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

    def corpus_summary(self) -> dict[str, Any]:
        """The sweep's corpus: source, split rule, and each split's counts and text digest (read once)."""
        if self._corpus_summary is None:
            self._corpus_summary = data_mod.corpus_summary(self.spec.corpus)
        return self._corpus_summary

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


class _Tracked:
    """A shared input's getter (calibration or test tokens) that notes whether it was called, so a
    record says what its cell read."""

    def __init__(self, get: Callable[[], torch.Tensor]):
        self._get = get
        self.used = False

    def __call__(self) -> torch.Tensor:
        self.used = True
        return self._get()


def _record_head(spec: RunSpec, model_meta: dict[str, Any], cell: Cell, env: dict[str, Any],
                 git: dict[str, Any]) -> dict[str, Any]:
    method = cell.method
    return {
        "schema": SCHEMA,
        "model": {"spec": spec.model, **model_meta, "dtype": spec.dtype,
                  "fingerprint": models_mod.model_fingerprint(spec.model)},
        "method": {"name": method.name, "label": method.label, "config": method.config.to_dict()},
        "suite": {"name": cell.suite.name, "label": cell.suite.label, "config": cell.suite.config.to_dict()},
        "seed": cell.seed,
        "seed_independent": cell.seed_independent,
        "corpus": spec.corpus,
        "calibration": None,
        "test_corpus": None,
        "corpus_summary": None,
        "method_info": {},
        "env": env,
        "git": git,
        "date": now_iso(),
        "command": command_line(),
        "preset": spec.preset,
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
    try:
        meta = state.metadata(device, task.device_map)
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - a model that does not load fails its cells, each recorded
        return outcomes + _record_load_failure(task, [cell for cell, _ in todo], exc, state, log)
    label, seed, method = task.label, task.seed, task.method
    torch.manual_seed(seed)
    method_calibration = _Tracked(state.calibration_for(seed, meta.tokenizer))
    qctx = QuantContext(calibration=method_calibration, seed=seed, device=device, tokenizer=meta.tokenizer, log=log)
    cache = _quant_cache(task, log)
    t_q = time.perf_counter()
    model = None
    quant_error = None
    cached = None
    try:
        model = state.model_for_group(device, task.device_map)
        if task.supports is not None:
            task.supports.check(method.name, spec.device, spec.dtype, type(model).__name__)
        cached = cache.load(model, device) if cache is not None else None
        if cached is not None:
            model = cached.model
            qctx.info.update(cached.method_info)
            log(f"[mosaicquant] loaded quantized {label} (seed {seed}) from {cache.status['file']} "
                f"in {cached.load_s:.1f}s")
        else:
            log(f"[mosaicquant] quantizing: {label} (seed {seed})")
            if shapes_mod.is_shape_model(spec.model):
                model = speed_form(method.name, model, method.config, qctx)
            else:
                model = task.method_fn(model, method.config, qctx)
            model.eval()
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - recorded in the cell, the sweep goes on
        quant_error = exc
    quant_s = cached.quantize_s if cached is not None else time.perf_counter() - t_q
    method_calibration_record = (cached.calibration if cached is not None else
                                 state.calibration_record(seed) if method_calibration.used else None)
    if cache is not None and cached is None and quant_error is None:
        cache.store(model, state.loaded().model, round(quant_s, 3), dict(qctx.info), method_calibration_record)
    model_meta = {"name": meta.name, "source": meta.source, "caveat": meta.caveat}
    bits = _effective_bits(model, qctx.info) if quant_error is None else {}

    for cell, suite_fn in todo:
        record = _record_head(spec, model_meta, cell, state.env, state.git)
        record["method_info"] = dict(qctx.info)
        record["timing"] = {"quantize_s": round(quant_s, 3)}
        if cached is not None:
            record["timing"]["cache_load_s"] = round(cached.load_s, 3)
        if cache is not None:
            record["quantized_cache"] = dict(cache.status)
        record["calibration"] = method_calibration_record
        if method_calibration_record is not None:
            record["corpus_summary"] = state.corpus_summary()
        if quant_error is not None:
            status = "unavailable" if isinstance(quant_error, Unavailable) else "failed"
            record.update(status=status, stage="quantize", metrics={}, error=_error_dict(quant_error))
            save_record(cell.path, record)
            line = f"[mosaicquant]   {status.upper()} {label} / {cell.suite.label}: {type(quant_error).__name__}: {quant_error}"
            log(line)
            outcomes.append(CellOutcome(cell.path, status, line))
            continue
        suite_calibration = _Tracked(state.calibration_for(seed, meta.tokenizer))
        suite_test = _Tracked(state.test_tokens(meta.tokenizer))
        sctx = SuiteContext(model_name=spec.model, tokenizer=meta.tokenizer, corpus=spec.corpus,
                            test_tokens=suite_test, seed=seed, device=device,
                            method_info=qctx.info, calibration=suite_calibration, log=log)
        t_s = time.perf_counter()
        line = ""
        try:
            with torch.no_grad():
                metrics = suite_fn(model, cell.suite.config, sctx)
            metrics = {**metrics, **bits}
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
        # what the cell read, for a rerun to compare its settings with (the suite may draw calibration too)
        if suite_calibration.used:
            record["calibration"] = state.calibration_record(seed)
        record["test_corpus"] = spec.corpus if suite_test.used else None
        if method_calibration.used or suite_calibration.used or suite_test.used:
            record["corpus_summary"] = state.corpus_summary()
        save_record(cell.path, record)
        if record["status"] == "ok":
            shown = ", ".join(f"{k}={v['value']:.4g}" for k, v in list(record["metrics"].items())[:3])
            line = f"[mosaicquant]   {label} / {cell.suite.label}: {shown}"
            log(line)
        outcomes.append(CellOutcome(cell.path, record["status"], line))
    del model
    release_memory()
    return outcomes


def _quant_cache(task: GroupTask, log: Callable[[str], None]) -> QuantCache | None:
    """The results folder's cache place for ``task`` (:mod:`mosaicquant.harness.qcache`), or ``None`` where
    nothing is cached: a shape model (random weights built anew, its speed form needs no calibration) and a
    model spread over GPUs by a device map (no float copy to rebuild it on)."""
    if shapes_mod.is_shape_model(task.spec.model) or task.device_map is not None:
        return None
    return QuantCache(task.spec.out, key_parts(task.spec, task.method, task.seed), log)


def _record_load_failure(task: GroupTask, cells: list[Cell], exc: Exception, state: SweepState,
                         log: Callable[[str], None]) -> list[CellOutcome]:
    """Write a failed record (stage ``"load"``) for each of ``cells``: the model did not load."""
    source = models_mod.resolve_model(task.spec.model)
    meta = {"name": source.name, "source": source.description, "caveat": source.caveat}
    outcomes = []
    for cell in cells:
        record = _record_head(task.spec, meta, cell, state.env, state.git)
        record.update(status="failed", stage="load", metrics={}, error=_error_dict(exc), timing={})
        save_record(cell.path, record)
        line = (f"[mosaicquant]   FAILED {task.label} / {cell.suite.label}: the model did not load: "
                f"{type(exc).__name__}: {exc}")
        log(line)
        outcomes.append(CellOutcome(cell.path, "failed", line))
    return outcomes


def _effective_bits(model: torch.nn.Module, info: dict[str, Any]) -> dict[str, Metric]:
    """The quantized model's ``bits/*`` metrics (:mod:`mosaicquant.methods.bits`), counted once per method spec
    and seed, before any suite makes the model executable; a format the count does not know leaves them out and
    says why in ``method_info["bits_skipped"]``."""
    from mosaicquant.methods.bits import UnknownFormat, model_bits

    try:
        counted = model_bits(model).metrics()
    except UnknownFormat as exc:
        info["bits_skipped"] = str(exc)
        return {}
    return {name: Metric(value, higher_is_better=False, unit="bits") for name, value in counted.items()}


def release_memory() -> None:
    """Free a finished group's model before the next group builds its own (call after dropping the references).

    A model can sit in reference cycles (modules that point back at their model), which ``del`` does not free
    until the collector happens to run: it runs here, and the CUDA caching allocator returns what it holds, so the
    next group (a 32B model's BF16 weights are 64 GB) starts from what the process needs, not from what it held.
    """
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
