"""Results as data: a pandas table of cells, and an export to an MLflow tracking folder.

- :func:`load_results` (also ``mosaicquant.load_results``): one row per cell (model, method
  label, suite label), its metrics flattened into columns, the mean over the cell's ``ok``
  seeds with the spread beside it (:mod:`mosaicquant.reports.cells`).
- :func:`export_mlflow` (``mosaicquant export DIR --mlflow PATH``): one MLflow run per cell in
  an MLflow *file store* (the ``mlruns`` folder ``mlflow ui --backend-store-uri PATH`` reads),
  written directly in the store's layout, so no MLflow installation is needed and nothing
  leaves the machine::

      PATH/<experiment id>/meta.yaml                 the experiment (name, id, artifact location)
      PATH/<experiment id>/<run id>/meta.yaml        the run (name, status FINISHED, start/end time)
      PATH/<experiment id>/<run id>/params/<key>     one value per file (the configs, the protocol)
      PATH/<experiment id>/<run id>/metrics/<key>    "<timestamp ms> <value> <step>" lines
      PATH/<experiment id>/<run id>/tags/<key>       mlflow.runName, mosaicquant.* tags

  A run's id is derived from the results folder and the cell, so exporting the same folder again
  replaces its runs instead of adding copies. Nothing is exported unless asked: a sweep never
  writes to a tracker by itself.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import time
from pathlib import Path
from typing import Any

import pandas as pd

from mosaicquant.errors import UserInputError
from mosaicquant.harness.results import ensure_writable_dir, load_records
from mosaicquant.reports.cells import aggregate_cells
from mosaicquant.reports.protocol import record_protocol

__all__ = ["load_results", "export_mlflow", "SPREAD_SUFFIX"]

#: column (and MLflow metric) suffix of a metric's spread
SPREAD_SUFFIX = ".spread"
#: the characters MLflow accepts in a metric, parameter or tag key
_KEY_OK = re.compile(r"[^A-Za-z0-9_\-. /]")
_MAX_PARAM = 6000


def _first(records: list[dict[str, Any]], *path: str) -> Any:
    for rec in records:
        value: Any = rec
        for part in path:
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None:
            return value
    return None


def load_results(path: str | Path) -> pd.DataFrame:
    """The cells of a results directory as a table, one row per (model, method label, suite label).

    Columns: ``model``, ``method``, ``suite``, ``method_name``, ``suite_name``, ``backend``,
    ``status`` (``ok`` when every seed is), ``n_seeds`` (ok seeds), ``seeds``, ``note`` (why a
    seed has no numbers), ``wbits``, ``abits``, ``kv_bits``, ``exec_path``, ``dtype``, ``device``,
    ``quantize_s`` (mean over seeds), then one column per metric (the mean over ok seeds) with its
    spread in ``<metric>.spread`` (``NaN`` where none exists). A metric a cell did not measure is
    ``NaN``. Metric columns are sorted by name.

    Args:
        path: a results directory.

    Returns:
        A :class:`pandas.DataFrame`.

    Raises:
        UserInputError: the directory does not exist or holds no records.

    Example:
        >>> import mosaicquant
        >>> df = mosaicquant.load_results("results/smollm2")  # doctest: +SKIP
        >>> df[df.suite_name == "accuracy"][["method", "ppl", "ppl.spread"]]  # doctest: +SKIP
    """
    records = load_records(path, required=True)
    by_cell: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for rec in records:
        by_cell.setdefault((rec["model"]["name"], rec["method"]["label"], rec["suite"]["label"]), []).append(rec)
    rows = []
    metric_names: set[str] = set()
    for key, cell in aggregate_cells(records).items():
        recs = by_cell[key]
        times = {r.get("seed"): (r.get("timing") or {}).get("quantize_s") for r in recs}
        times = [t for t in times.values() if t is not None]
        row: dict[str, Any] = {
            "model": cell.model, "method": cell.method, "suite": cell.suite, "method_name": cell.method_name,
            "suite_name": cell.suite_name, "backend": cell.backend, "status": cell.status,
            "n_seeds": len(cell.ok_seeds), "seeds": ",".join(str(r.get("seed")) for r in recs),
            "note": cell.note or None, "wbits": cell.method_info.get("wbits"), "abits": cell.method_info.get("abits"),
            "kv_bits": cell.method_info.get("kv_bits"), "exec_path": cell.method_info.get("exec_path"),
            "dtype": _first(recs, "model", "dtype"), "device": record_protocol(recs[0])["device"],
            "quantize_s": sum(times) / len(times) if times else None,
        }
        for name, m in cell.metrics.items():
            row[name] = m.value
            row[name + SPREAD_SUFFIX] = m.spread
            metric_names.add(name)
        rows.append(row)
    df = pd.DataFrame(rows)
    fixed = [c for c in df.columns if c not in metric_names and not c.endswith(SPREAD_SUFFIX)]
    metrics = [c for name in sorted(metric_names) for c in (name, name + SPREAD_SUFFIX)]
    df = df.reindex(columns=fixed + metrics)
    for c in metrics:
        df[c] = pd.to_numeric(df[c], errors="coerce").astype(float)
    return df


def _key(text: str) -> str:
    """A key MLflow accepts: its character set, no ``..`` or leading ``/`` (the file store makes files of keys)."""
    key = _KEY_OK.sub("_", text).replace("..", "_").strip("/ ") or "_"
    return key[:250]


def _yaml(fields: dict[str, Any]) -> str:
    """A flat YAML mapping of strings and integers, as MLflow's meta.yaml files hold."""
    lines = []
    for k, v in fields.items():
        lines.append(f"{k}: {v}" if isinstance(v, int) else f"{k}: {json.dumps(str(v))}")
    return "\n".join(lines) + "\n"


def _experiment(store: Path, name: str) -> tuple[str, Path]:
    """The id and folder of the experiment called ``name`` in the store, created when missing."""
    ids = []
    for meta in store.glob("*/meta.yaml"):
        text = meta.read_text(errors="replace")
        ids.append(meta.parent.name)
        m = re.search(r"^name: (.+)$", text, re.M)
        if m and m.group(1).strip().strip("'\"") == name:
            return meta.parent.name, meta.parent
    numeric = [int(i) for i in ids if i.isdigit()]
    exp_id = str(max(numeric, default=0) + 1)  # 0 is MLflow's own Default experiment
    folder = store / exp_id
    folder.mkdir(parents=True)
    now = int(time.time() * 1000)
    (folder / "meta.yaml").write_text(_yaml({
        "artifact_location": folder.resolve().as_uri(), "creation_time": now, "experiment_id": exp_id,
        "last_update_time": now, "lifecycle_stage": "active", "name": name}))
    return exp_id, folder


def _write_values(folder: Path, values: dict[str, str]) -> None:
    for key, value in values.items():
        target = folder / _key(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(value)


def export_mlflow(results_dir: str | Path, store: str | Path, experiment: str = "mosaicquant") -> list[str]:
    """Write every cell of a results directory as a finished MLflow run into an MLflow file store.

    Each run holds: params ``model``, ``method``, ``suite``, ``method.<option>``, ``suite.<option>``,
    the protocol fields (``calibration.*``, ``dtype``, ``device``, ...), ``seeds``; metrics, the mean
    over ok seeds at step 0 (``<metric>.spread`` beside it where a spread exists; a NaN is kept as
    NaN); tags ``mlflow.runName`` (``model | method | suite``), ``mosaicquant.status``,
    ``mosaicquant.commit``, ``mosaicquant.results_dir``. Keys outside MLflow's character set get
    ``_`` for each other character.

    Args:
        results_dir: the results directory (only read).
        store: the file store: a folder, or a ``file:`` URI. Created when missing.
        experiment: the experiment's name (found in the store or created).

    Returns:
        The ids of the runs written.

    Raises:
        UserInputError: no records, a store that is not a local folder (``http://...``: log there with
            MLflow's own client from the :func:`load_results` table), or one that cannot be written.
    """
    text = str(store)
    if text.startswith("file:"):
        text = re.sub(r"^file:(//)?", "", text)
    elif re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", text):
        raise UserInputError(f"--mlflow {str(store)!r} is not a local folder: allowed a path or a file: URI (the "
                             "export writes MLflow's file store; for a tracking server, use MLflow's client)")
    folder = Path(text)
    results_dir = Path(results_dir)
    records = load_records(results_dir, required=True)
    ensure_writable_dir(folder, what="MLflow store")
    by_cell: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for rec in records:
        by_cell.setdefault((rec["model"]["name"], rec["method"]["label"], rec["suite"]["label"]), []).append(rec)
    try:
        exp_id, exp_dir = _experiment(folder, experiment)
        run_ids = []
        now = int(time.time() * 1000)
        for key, cell in aggregate_cells(records).items():
            recs = by_cell[key]
            run_id = hashlib.sha256(json.dumps([str(results_dir.resolve()), *key]).encode()).hexdigest()[:32]
            run = exp_dir / run_id
            if run.exists():
                shutil.rmtree(run)
            params = {"model": cell.model, "method": cell.method, "suite": cell.suite,
                      "seeds": ",".join(str(r.get("seed")) for r in recs)}
            params.update({f"method.{k}": json.dumps(v) if not isinstance(v, str) else v
                           for k, v in sorted(cell.method_config.items())})
            params.update({k: str(v) for k, v in record_protocol(recs[0]).items() if v is not None})
            metrics = {}
            for name, m in cell.metrics.items():
                metrics[name] = m.value
                if m.spread is not None:
                    metrics[name + SPREAD_SUFFIX] = m.spread
            commit = _first(recs, "git", "commit")
            tags = {"mlflow.runName": " | ".join(key), "mosaicquant.status": cell.status,
                    "mosaicquant.results_dir": str(results_dir.resolve()), "mosaicquant.commit": commit or "",
                    "mosaicquant.note": cell.note}
            run.mkdir()
            (run / "artifacts").mkdir()
            (run / "meta.yaml").write_text(_yaml({
                "artifact_uri": (run / "artifacts").resolve().as_uri(), "end_time": now, "entry_point_name": "",
                "experiment_id": exp_id, "lifecycle_stage": "active", "run_id": run_id, "run_name": " | ".join(key),
                "run_uuid": run_id, "source_name": "", "source_type": 4, "source_version": commit or "",
                "start_time": now, "status": 3, "user_id": "mosaicquant"}))
            _write_values(run / "params", {k: v[:_MAX_PARAM] for k, v in params.items()})
            _write_values(run / "metrics", {k: f"{now} {'nan' if math.isnan(v) else repr(float(v))} 0\n"
                                            for k, v in metrics.items()})
            _write_values(run / "tags", {k: v for k, v in tags.items() if v})
            run_ids.append(run_id)
    except OSError as exc:
        raise UserInputError(f"cannot write the MLflow store {str(exc.filename or folder)!r}: "
                             f"{exc.strerror or exc}") from None
    return run_ids
