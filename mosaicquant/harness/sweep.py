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
    SweepResult, check_finished_settings, finished_record, plan_cells, plan_groups, validate_run,
)
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
            this process (see :mod:`mosaicquant.harness.backends`); ``None`` or ``"torch"`` for
            the in-process default. A backend is asked before any model is loaded.

    Returns:
        the paths written, skipped (already finished), failed and unavailable.

    Raises:
        UserInputError: bad spec, unknown backend, executor settings that do not fit it, or
            finished records made with other settings (:func:`~mosaicquant.harness.runner.check_finished_settings`).
    """
    settings = executor if executor is not None else ExecutorSettings()
    chosen = parse_backend_spec(backend)
    if chosen is not None:
        return run_backend_sweep(spec, chosen, log)
    validate_run(spec)
    cells = plan_cells(spec)
    result = SweepResult()
    pending = []
    finished = []
    for cell in cells:
        record = finished_record(cell.path)
        if record is not None:
            finished.append((cell, record))
            result.skipped.append(cell.path)
        else:
            pending.append(cell)
    check_finished_settings(spec, finished)
    runner = make_executor(settings, spec)
    log(f"[mosaicquant] {len(cells)} cells: {len(result.skipped)} finished, {len(pending)} to run")
    if not pending:
        return result
    tasks = plan_groups(spec, pending, device_map=settings.device_map)
    runner.run(tasks, result, log)
    return result
