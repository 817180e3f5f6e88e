"""Cells: the records of one (model, method label, suite label), aggregated over seeds.

Reports and ``mosaicquant compare`` look at cells, not single records. Seeds are repeated
measurements of the same configuration, so a cell's metric is the mean over the seeds whose
record is ``ok``, and its spread is the larger of

- the recorded spreads, combined as their root mean square (the typical spread of one run),
- the standard deviation across seeds (when there are two or more),

or ``None`` when neither exists. A cell also keeps every record that is not ``ok``
(``failed`` with its error, ``unavailable`` with its reason), so no result is ever hidden.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MetricSummary", "Cell", "aggregate_cells", "record_note", "format_number", "natural_key",
           "summarize_metrics", "FP16_LABEL"]

#: the method label every speed-up is relative to
FP16_LABEL = "fp16"


@dataclass(frozen=True)
class MetricSummary:
    """One metric of a cell, over its ``ok`` seeds.

    Attributes:
        value: mean over seeds.
        spread: see the module docstring; ``None`` when nothing measures it.
        higher_is_better: the metric's direction (from the records).
        unit: e.g. ``"tok/s"``.
        n: number of seeds the mean is over.
    """

    value: float
    spread: float | None
    higher_is_better: bool
    unit: str | None
    n: int


@dataclass
class Cell:
    """The records of one (model, method label, suite label).

    ``backend`` names the engine that ran the cell (``mosaicquant run --backend``, e.g.
    ``tensorrt-llm``; its label is then ``spec@backend``), ``None`` for the in-process default.
    """

    model: str
    method: str
    suite: str
    method_name: str
    suite_name: str
    backend: str | None = None
    method_config: dict[str, Any] = field(default_factory=dict)
    suite_config: dict[str, Any] = field(default_factory=dict)
    method_info: dict[str, Any] = field(default_factory=dict)
    ok_seeds: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    statuses: list[str] = field(default_factory=list)
    metrics: dict[str, MetricSummary] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.model, self.method, self.suite)

    @property
    def status(self) -> str:
        """``ok`` when every record is ok, otherwise the first other status (``failed``, ``unavailable``)."""
        return next((s for s in self.statuses if s != "ok"), "ok")

    @property
    def note(self) -> str:
        """The problems of the cell's records, joined (empty when all are ok)."""
        return "; ".join(self.problems)


def format_number(value: float | None) -> str:
    """Three significant digits in fixed notation (no exponent), thousands separators from 1000 up, ``NaN`` for a NaN,
    empty for a missing value.

    Example:
        >>> [format_number(v) for v in (18512.3, 13.914, 0.2834, 1.2e-05, 0.0)]
        ['18,512', '13.91', '0.283', '0.0000120', '0']
    """
    if value is None:
        return ""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 100:
        return f"{value:.1f}"
    if value == 0 or abs(value) >= 1:
        return f"{value:.2f}" if value else "0"
    # three significant digits in fixed notation: never 1.2e-05, which a table (and LaTeX) prints badly
    return f"{value:.{min(12, 2 - math.floor(math.log10(abs(value))))}f}"


def natural_key(name: str) -> list[tuple[int, int, str]]:
    """Sort key that orders the numbers inside names by value (``b4`` before ``b16``)."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name)]


def record_note(record: dict[str, Any]) -> str:
    """Why a record has no numbers: ``"failed: Type: message"``, ``"not available: reason"``.

    The reason is the record's ``reason`` field, else its error message, else its backend's
    ``reason``; an error type that only repeats the status is left out.
    """
    status = record.get("status") or "unknown"
    error = record.get("error") or {}
    reason = record.get("reason") or error.get("message") or (record.get("backend") or {}).get("reason")
    if status == "ok":
        return status
    kind = error.get("type")
    if status == "unavailable":
        return f"not available: {reason or 'no reason recorded'}"
    prefix = f"{kind}: " if kind and kind != status else ""
    return f"{status}: {prefix}{reason or 'no reason recorded'}"


def _merge_info(target: dict[str, Any], source: dict[str, Any]) -> None:
    for k, v in (source or {}).items():
        if target.get(k) is None and v is not None:
            target[k] = v


def summarize_metrics(values: dict[Any, list[dict[str, Any]]]) -> dict[Any, MetricSummary]:
    """``{key: MetricSummary}`` of ``{key: [recorded metric dicts, one per seed]}`` (see the module docstring)."""
    out = {}
    for name, ms in values.items():
        nums = [float(m["value"]) for m in ms if m.get("value") is not None]
        if not nums:
            continue
        mean = sum(nums) / len(nums)
        candidates = []
        # a NaN spread says nothing about the spread: left out, so it cannot hide a change
        recorded = [float(m["spread"]) for m in ms if m.get("spread") is not None and not math.isnan(m["spread"])]
        if recorded:
            candidates.append(math.sqrt(sum(s * s for s in recorded) / len(recorded)))
        if len(nums) >= 2:
            candidates.append(math.sqrt(sum((x - mean) ** 2 for x in nums) / (len(nums) - 1)))
        out[name] = MetricSummary(value=mean, spread=max(candidates) if candidates else None,
                                  higher_is_better=bool(ms[0].get("higher_is_better")), unit=ms[0].get("unit"),
                                  n=len(nums))
    return out


def aggregate_cells(records: list[dict[str, Any]]) -> dict[tuple[str, str, str], Cell]:
    """Group records by (model, method label, suite label) and aggregate their seeds.

    Args:
        records: as :func:`mosaicquant.harness.results.load_records` returns them.

    Returns:
        ``{(model, method label, suite label): Cell}`` in the order first seen.

    Example:
        >>> cells = aggregate_cells(load_records("results/smollm2"))  # doctest: +SKIP
        >>> cells[("smollm2-135m", "rtn", "accuracy")].metrics["ppl"].value  # doctest: +SKIP
    """
    cells: dict[tuple[str, str, str], Cell] = {}
    values: dict[tuple[str, str, str], dict[str, list[dict[str, Any]]]] = {}
    for rec in records:
        key = (rec["model"]["name"], rec["method"]["label"], rec["suite"]["label"])
        cell = cells.get(key)
        if cell is None:
            cell = cells[key] = Cell(model=key[0], method=key[1], suite=key[2], method_name=rec["method"]["name"],
                                     suite_name=rec["suite"]["name"], backend=rec["method"].get("backend"),
                                     method_config=dict(rec["method"].get("config") or {}),
                                     suite_config=dict(rec["suite"].get("config") or {}))
            values[key] = {}
        _merge_info(cell.method_info, rec.get("method_info") or {})
        status = rec.get("status") or "unknown"
        cell.statuses.append(status)
        if status != "ok":
            cell.problems.append(f"seed {rec.get('seed')} {record_note(rec)}")
            continue
        cell.ok_seeds.append(rec.get("seed"))
        for name, m in (rec.get("metrics") or {}).items():
            values[key].setdefault(name, []).append(m)
    for key, cell in cells.items():
        cell.metrics = summarize_metrics(values[key])
    return cells
