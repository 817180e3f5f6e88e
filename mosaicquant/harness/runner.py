"""The sweep runner: every (method spec × seed) quantizes a fresh copy of the model once and
runs each pending suite on it; each (model, method spec, suite, seed) cell is one record.

- Validation first: every name, option and path is checked before any model is loaded.
- Resume: a cell whose record exists with ``"status": "ok"`` is skipped; a failed or
  missing one is (re)computed.
- Isolation: an exception in a method fails every pending suite of that method spec (each
  recorded as failed with the error); an exception in a suite fails that cell only. The
  sweep goes on. ``KeyboardInterrupt`` stops it; finished records stay.
- Sharing: the calibration tokens are drawn once per seed and used by every method; the
  test tokens once per sweep.
"""

from __future__ import annotations

import copy
import hashlib
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mosaicquant.harness import data as data_mod
from mosaicquant.harness import models as models_mod
from mosaicquant.harness.context import QuantContext, SuiteContext
from mosaicquant.harness.errors import UserInputError
from mosaicquant.harness.results import (
    SCHEMA, Metric, ensure_writable_dir, environment, git_info, now_iso, read_record, record_path, write_record,
)
from mosaicquant.harness.spec import PluginSpec, RunSpec

__all__ = ["Cell", "plan_cells", "validate_run", "run_sweep"]


@dataclass(frozen=True)
class Cell:
    method: PluginSpec
    suite: PluginSpec
    seed: int
    path: Path


def plan_cells(spec: RunSpec) -> list[Cell]:
    """All cells of the sweep, in method-major order."""
    return [
        Cell(m, s, seed, record_path(spec.out, spec.model, m.label, s.label, seed))
        for m in spec.methods for seed in spec.seeds for s in spec.suites
    ]


def is_finished(path: Path) -> bool:
    if not path.exists():
        return False
    try:
        return read_record(path).get("status") == "ok"
    except (OSError, ValueError):
        return False


def validate_run(spec: RunSpec) -> None:
    """Check model, corpus and results directory (names and options were checked at parse time).

    Raises:
        UserInputError: with one line naming the value and what is allowed.
    """
    spec.validate()
    models_mod.resolve_model(spec.model)
    if spec.corpus not in data_mod.CORPORA:
        from mosaicquant.harness.errors import unknown_name

        raise unknown_name("corpus", spec.corpus, data_mod.CORPORA)
    ensure_writable_dir(spec.out)
    if spec.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserInputError(f"device={spec.device!r} but no CUDA GPU is available here: use --device cpu")


def _error_dict(exc: BaseException) -> dict[str, Any]:
    return {"type": type(exc).__name__, "message": str(exc),
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-8000:]}


@dataclass
class SweepResult:
    written: list[Path] = field(default_factory=list)
    skipped: list[Path] = field(default_factory=list)
    failed: list[Path] = field(default_factory=list)


def run_sweep(spec: RunSpec, log: Callable[[str], None] = print) -> SweepResult:
    """Run every pending cell of ``spec`` and write its record.

    Returns:
        the paths written, skipped (already finished) and failed.
    """
    validate_run(spec)
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

    dtype = getattr(torch, spec.dtype)
    device = torch.device(spec.device)
    t0 = time.perf_counter()
    # the float model stays on the CPU; each method quantizes a fresh copy on the device
    loaded = models_mod.load_model(spec.model, dtype=dtype, device=torch.device("cpu"))
    log(f"[mosaicquant] loaded {spec.model} in {time.perf_counter() - t0:.1f}s")
    base_state = loaded.model
    env = environment()
    git = git_info()

    calib_cache: dict[int, torch.Tensor] = {}
    test_cache: dict[str, torch.Tensor] = {}

    def calibration_for(seed: int) -> Callable[[], torch.Tensor]:
        def get() -> torch.Tensor:
            if seed not in calib_cache:
                calib_cache[seed] = data_mod.calibration_tokens(
                    loaded.tokenizer, spec.corpus, spec.calib_samples, spec.calib_seqlen, seed)
            return calib_cache[seed]
        return get

    def test_tokens() -> torch.Tensor:
        if spec.corpus not in test_cache:
            test_cache[spec.corpus] = data_mod.test_tokens(loaded.tokenizer, spec.corpus)
        return test_cache[spec.corpus]

    groups: dict[tuple[str, int], list[Cell]] = {}
    for cell in pending:
        groups.setdefault((cell.method.label, cell.seed), []).append(cell)

    for (label, seed), group in groups.items():
        method = group[0].method
        torch.manual_seed(seed)
        qctx = QuantContext(calibration=calibration_for(seed), seed=seed, device=device,
                            tokenizer=loaded.tokenizer, log=log)
        log(f"[mosaicquant] quantizing: {label} (seed {seed})")
        t_q = time.perf_counter()
        model = None
        quant_error = None
        try:
            model = copy.deepcopy(base_state).to(device)
            model = method.entry.fn(model, method.config, qctx)
            model.eval()
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # noqa: BLE001 - recorded in the cell, the sweep goes on
            quant_error = exc
        quant_s = time.perf_counter() - t_q

        for cell in group:
            record: dict[str, Any] = {
                "schema": SCHEMA,
                "model": {"spec": spec.model, "name": loaded.name, "source": loaded.source,
                          "caveat": loaded.caveat, "dtype": spec.dtype},
                "method": {"name": method.name, "label": method.label, "config": method.config.to_dict()},
                "suite": {"name": cell.suite.name, "label": cell.suite.label, "config": cell.suite.config.to_dict()},
                "seed": seed,
                "corpus": spec.corpus,
                "calibration": None,
                "method_info": dict(qctx.info),
                "env": env,
                "git": git,
                "date": now_iso(),
                "timing": {"quantize_s": round(quant_s, 3)},
            }
            if seed in calib_cache:
                tok = calib_cache[seed]
                record["calibration"] = {
                    "corpus": spec.corpus, "n_samples": spec.calib_samples, "seqlen": spec.calib_seqlen,
                    "seed": seed, "tokens_sha256": hashlib.sha256(tok.numpy().tobytes()).hexdigest()[:16]}
            if quant_error is not None:
                record.update(status="failed", stage="quantize", metrics={}, error=_error_dict(quant_error))
                write_record(cell.path, record)
                result.failed.append(cell.path)
                log(f"[mosaicquant]   FAILED {label} / {cell.suite.label}: {type(quant_error).__name__}: {quant_error}")
                continue
            sctx = SuiteContext(model_name=spec.model, tokenizer=loaded.tokenizer, corpus=spec.corpus,
                                test_tokens=test_tokens, seed=seed, device=device, method_info=qctx.info,
                                calibration=calibration_for(seed), log=log)
            t_s = time.perf_counter()
            try:
                with torch.no_grad():
                    metrics = cell.suite.entry.fn(model, cell.suite.config, sctx)
                record["metrics"] = {k: (v.to_dict() if isinstance(v, Metric) else v) for k, v in metrics.items()}
                record["status"] = "ok"
                record["error"] = None
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # noqa: BLE001
                record.update(status="failed", stage="suite", metrics={}, error=_error_dict(exc))
                log(f"[mosaicquant]   FAILED {label} / {cell.suite.label}: {type(exc).__name__}: {exc}")
            record["timing"]["suite_s"] = round(time.perf_counter() - t_s, 3)
            record["method_info"] = dict(qctx.info)
            write_record(cell.path, record)
            (result.written if record["status"] == "ok" else result.failed).append(cell.path)
            if record["status"] == "ok":
                shown = ", ".join(f"{k}={v['value']:.4g}" for k, v in list(record["metrics"].items())[:3])
                log(f"[mosaicquant]   {label} / {cell.suite.label}: {shown}")
        del model
    return result
