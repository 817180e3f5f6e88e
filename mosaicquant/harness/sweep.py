"""One call that runs a sweep: the backend it names, or the executor's tasks in this process or others.

:mod:`mosaicquant.harness.runner` plans cells and runs one task; :mod:`~mosaicquant.harness.executors`
spreads the tasks; :mod:`~mosaicquant.harness.backends` hands cells to another engine. This module
sits above the three and picks between them.
"""

from __future__ import annotations

from collections.abc import Callable

from mosaicquant.harness.backends import parse_backend_spec, run_backend_sweep
from mosaicquant.harness.executors import ExecutorSettings, make_executor
from mosaicquant.harness.runner import (
    SweepResult, check_finished_settings, plan_cells, plan_groups, validate_run,
)
from mosaicquant.harness.results import read_valid_record, results_lock
from mosaicquant.harness.spec import RunSpec

__all__ = ["run_sweep"]


def run_sweep(spec: RunSpec, log: Callable[[str], None] = print,
              executor: ExecutorSettings | None = None, backend: str | None = None) -> SweepResult:
    """Run every pending cell of ``spec`` and write its record.

    Args:
        spec: the sweep.
        log: progress printer.
        executor: where the tasks run (default: ``local``, in this process); see
            :mod:`mosaicquant.harness.executors`.
        backend: ``name[:key=value...]`` of a registered backend that runs the cells instead of
            this process (see :mod:`mosaicquant.harness.backends`); ``"torch"`` for the in-process
            default; ``None``: the spec's ``backend``. A backend is asked before any model is loaded.

    Returns:
        the paths written, skipped (already finished), failed and unavailable.

    Raises:
        UserInputError: bad spec, unknown backend, executor settings that do not fit it, or
            finished records made with other settings (:func:`~mosaicquant.harness.runner.check_finished_settings`),
            or a results directory another run holds (:func:`mosaicquant.harness.results.results_lock`).
        RecordWriteError: a record could not be written (the sweep stops; the record is kept elsewhere).
    """
    settings = executor if executor is not None else ExecutorSettings()
    chosen = parse_backend_spec(backend if backend is not None else spec.backend)
    if chosen is not None:
        with results_lock(spec.out, log):
            return run_backend_sweep(spec, chosen, log)
    validate_run(spec)
    with results_lock(spec.out, log):
        return _run_locked(spec, settings, log)


def _run_locked(spec: RunSpec, settings: ExecutorSettings, log: Callable[[str], None]) -> SweepResult:
    cells = plan_cells(spec)
    result = SweepResult()
    pending = []
    finished = []
    invalid = []
    for cell in cells:
        record, why = read_valid_record(cell.path)
        if record is not None and record.get("status") == "ok":
            finished.append((cell, record))
            result.skipped.append(cell.path)
        else:
            pending.append(cell)
            if why is not None:
                invalid.append((cell, why))
    check_finished_settings(spec, finished)
    for cell, why in invalid:
        log(f"[mosaicquant] warning: {cell.path} is not a valid record ({why}): recomputing "
            f"{cell.method.label} / {cell.suite.label} / seed {cell.seed}")
    runner = make_executor(settings, spec)
    log(f"[mosaicquant] {len(cells)} cells: {len(result.skipped)} finished, {len(pending)} to run")
    if not pending:
        return result
    tasks = plan_groups(spec, pending, device_map=settings.device_map)
    runner.run(tasks, result, log)
    return result
