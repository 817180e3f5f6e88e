"""Compare two result sets for CI regression tracking (``mosaicquant compare BASE NEW``).

Rules:

- Cells are matched by (model, method label, suite label). Seeds aggregate as in
  :mod:`mosaicquant.reports.cells`: the mean over a cell's ``ok`` seeds, with a spread that is
  the larger of the recorded spreads (root mean square) and the standard deviation across seeds.
- ``--fail-on METRIC:PCT[,METRIC:PCT...]`` picks the watched metrics. ``METRIC`` is an exact
  metric name, a glob (``decode_tok_s/*``, ``linear_us/*/m1``), or a name family: ``decode_tok_s``
  also covers ``decode_tok_s/b4`` and every other ``decode_tok_s/...``. A metric takes the
  threshold of the entry naming it exactly, else of the first entry that matches it. An
  entry that matches no metric of either set is an input error.
- Change is ``(new - base) / |base|``; its bad direction is the metric's own: down for a
  higher-is-better metric (tok/s), up for a lower-is-better one (µs, perplexity).
- A watched metric is a **regression** when its change in the bad direction is beyond PCT
  *and* ``|new - base|`` is beyond the combined spread ``sqrt(s_base² + s_new²)`` (a missing
  spread counts as 0). Beyond PCT but within the spread is reported as ``within spread``.
- A watched metric whose base cell is ``ok`` but whose new cell has a failed or unavailable
  record (any seed) is a regression too: the number CI tracks is gone or incomplete.
- So is a watched metric of a base cell that has no counterpart in the new set, whether the
  metric is gone from the cell or the whole cell is (not run, or its record unreadable:
  :func:`compare_dirs` names the files it could not read): ``missing in new``.
- A metric that is NaN in the new set (a number in base) is printed as ``not a number in new``,
  a regression when watched; NaN in base is printed as not compared (there is nothing to hold
  the new value to). From an infinite base (a collapsed perplexity) a finite value is a ±100%
  change.
- Cells present in only one set, cells whose base has no numbers, and cells with a failed or
  unavailable record in the new set (with its error or reason) are listed, never dropped.
- With ``--fail-on``, a BASE ``*.json`` file that is not a valid record (cut short, damaged, another
  schema version: :func:`mosaicquant.harness.results.record_problem`) fails the comparison too:
  the cell it held cannot be named, so whether a watched number is gone cannot be told.
- Without ``--fail-on`` every metric of the matched base cells is compared (one the new cell
  lacks is printed as ``missing in new``) and nothing fails.
- **Speed as ratios.** Raw tok/s and µs move with the machine; a speed-up does much less. Every
  speed metric of a ``throughput`` or ``latency`` cell (``decode_tok_s/b{B}``, ``prefill_tok_s``,
  ``linear_us/...``, ``step_ms/...``) is also compared as its speed-up against the ``fp16`` cell
  (the BF16 reference) of the same model and suite label *in the same result set*, named
  ``vs_fp16/<metric>`` (higher is better, above 1 is faster than BF16), with the two recorded
  spreads propagated into the ratio's. Watch them like any metric: ``--fail-on 'vs_fp16/*:5%'``.
- **Protocol guard.** Matched cells are compared only where they measured the same thing. The
  protocol fields of :func:`mosaicquant.reports.protocol.record_protocol` (test corpus, the
  suite's options such as sequence length and chunks, the calibration corpus, size, length and
  data hash, the dtype, the device, its driver and CUDA, the CPU) are checked between the base and
  new records of every matched cell; a field counts where both sides recorded it. A difference is
  a warning printed above the table (``--format github``: a ``::warning``) by default, and a
  refusal with ``strict=True`` (``--strict``): exit 3, a ``::error`` annotation and a failing JUnit
  case, with the differing fields named (field, base values, new values, cells).

Exit codes (see :func:`mosaicquant.harness.cli.main`): 0 no regression, 1 a regression,
2 bad input, 3 refused (``--strict``: base and new differ in protocol).

For CI, :meth:`Comparison.github_annotations` gives GitHub Actions workflow commands
(``::error file=...::``) and :func:`write_junit` a JUnit XML file (one test case per watched
metric, one for the protocol).
"""

from __future__ import annotations

import difflib
import json
import math
from dataclasses import asdict, dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import pandas as pd

from mosaicquant.errors import UserInputError
from mosaicquant.harness.results import load_records, skipped_note
from mosaicquant.reports.cells import FP16_LABEL, Cell, MetricSummary, aggregate_cells, format_number, natural_key
from mosaicquant.reports.protocol import protocol_differences
from mosaicquant.reports.speed import DECODE_RE, LINEAR_RE, PREFILL, STEP_RE, runtime_of, same_runtime, speedup

__all__ = ["Threshold", "ComparedMetric", "Comparison", "ProtocolDifference", "parse_fail_on", "compare_records",
           "compare_dirs", "code_versions", "write_json", "write_junit", "speed_ratios", "RATIO_PREFIX",
           "REFUSED_EXIT"]

#: name prefix of a speed metric compared as its speed-up vs the fp16 cell of the same result set
RATIO_PREFIX = "vs_fp16/"
#: exit code of a comparison refused because base and new differ in protocol (``--strict``)
REFUSED_EXIT = 3

FAIL_ON_EXAMPLE = "e.g. decode_tok_s:5% or 'decode_tok_s/*:5%,linear_us/*:10%'"


@dataclass(frozen=True)
class Threshold:
    """One ``--fail-on`` entry: a metric name, glob or name family, and the allowed change in percent."""

    pattern: str
    percent: float

    def matches(self, name: str) -> bool:
        return name == self.pattern or name.startswith(self.pattern + "/") or fnmatchcase(name, self.pattern)


def parse_fail_on(text: str) -> list[Threshold]:
    """Parse ``METRIC:PCT[,METRIC:PCT...]`` (PCT as ``5%`` or ``5``, a number >= 0).

    Raises:
        UserInputError: an entry that is not ``METRIC:PCT`` or a percentage that is not a number >= 0.

    Example:
        >>> parse_fail_on("decode_tok_s/*:5%,linear_us/*:10")
        [Threshold(pattern='decode_tok_s/*', percent=5.0), Threshold(pattern='linear_us/*', percent=10.0)]
    """
    thresholds = []
    for item in text.split(","):
        item = item.strip()
        metric, sep, pct = item.rpartition(":")
        metric = metric.strip()
        if not sep or not metric:
            raise UserInputError(f"--fail-on entry {item!r} is not METRIC:PCT: expected {FAIL_ON_EXAMPLE}")
        try:
            value = float(pct.strip().removesuffix("%"))
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0:
            raise UserInputError(f"--fail-on threshold {pct!r} in {item!r} is not a percentage: "
                                 f"allowed a number >= 0 with an optional %, {FAIL_ON_EXAMPLE}")
        thresholds.append(Threshold(metric, value))
    return thresholds


def _threshold_for(name: str, thresholds: list[Threshold]) -> Threshold | None:
    exact = next((t for t in thresholds if t.pattern == name), None)
    return exact or next((t for t in thresholds if t.matches(name)), None)


@dataclass
class ComparedMetric:
    """One metric of one matched cell.

    Attributes:
        change: relative change ``(new - base) / |base|`` (a fraction), None without both values.
        threshold: the percent it is held to, None when not watched.
        noise: the combined spread ``sqrt(s_base² + s_new²)``.
        verdict: ``REGRESSION``, ``within spread``, ``improved``, ``ok``, ``FAILED in new``
            (or ``UNAVAILABLE in new``), ``missing in new``, ``new metric``, ``not a number in new``
            (``REGRESSION: not a number in new`` when watched), ``not compared: not a number in base``,
            or ``""`` (not watched).
    """

    model: str
    method: str
    suite: str
    metric: str
    base: float | None
    new: float | None
    higher_is_better: bool
    unit: str | None
    change: float | None
    threshold: float | None
    noise: float | None
    seeds: str
    verdict: str
    regression: bool
    note: str = ""


@dataclass(frozen=True)
class ProtocolDifference:
    """One protocol field in which the base and new records of matched cells differ.

    Attributes:
        field: e.g. ``calibration.n_samples``, ``suite.seqlen``, ``device``, ``dtype``.
        base / new: the values each side recorded (sorted, as text).
        cells: the matched cells that differ in it, as ``model | method | suite``.
    """

    field: str
    base: tuple[str, ...]
    new: tuple[str, ...]
    cells: tuple[str, ...]

    def text(self) -> str:
        shown = ", ".join(self.cells[:3]) + (f", ... ({len(self.cells)} cells)" if len(self.cells) > 3 else "")
        return f"{self.field}: base {', '.join(self.base)}; new {', '.join(self.new)} (in {shown})"


@dataclass
class Comparison:
    """Everything ``mosaicquant compare`` prints and writes."""

    base_dir: str
    new_dir: str
    thresholds: list[Threshold]
    rows: list[ComparedMetric] = field(default_factory=list)
    only_in_base: list[tuple[str, str, str]] = field(default_factory=list)
    only_in_new: list[tuple[str, str, str]] = field(default_factory=list)
    not_compared: list[tuple[str, str, str, str]] = field(default_factory=list)
    failed_in_new: list[tuple[str, str, str, str, str]] = field(default_factory=list)
    base_code: list[str] = field(default_factory=list)
    new_code: list[str] = field(default_factory=list)
    base_skipped: list[tuple[str, str]] = field(default_factory=list)
    new_skipped: list[tuple[str, str]] = field(default_factory=list)
    protocol: list[ProtocolDifference] = field(default_factory=list)
    strict: bool = False
    paths: dict[tuple[str, str, str], str] = field(default_factory=dict)

    @property
    def regressions(self) -> list[ComparedMetric]:
        return [r for r in self.rows if r.regression]

    @property
    def unchecked_base(self) -> list[tuple[str, str]]:
        """The BASE files that are not valid records while metrics are watched: cells CI cannot check."""
        return list(self.base_skipped) if self.thresholds else []

    @property
    def refused(self) -> bool:
        """Whether the comparison is refused: ``strict`` and a protocol difference."""
        return self.strict and bool(self.protocol)

    @property
    def exit_code(self) -> int:
        if self.refused:
            return REFUSED_EXIT
        return 1 if self.regressions or self.unchecked_base else 0

    def protocol_message(self) -> str:
        """One line naming the differing protocol fields (empty when there are none)."""
        if not self.protocol:
            return ""
        verdict = "REFUSED (--strict)" if self.strict else "WARNING"
        return (f"{verdict}: base and new differ in protocol, so their numbers measure different things: "
                + " | ".join(d.text() for d in self.protocol))

    def table(self) -> pd.DataFrame:
        """The compared metrics as printed: base, new, change, threshold, noise, verdict."""
        return pd.DataFrame([{
            "model": r.model, "method": r.method, "suite": r.suite, "metric": r.metric,
            "base": format_number(r.base), "new": format_number(r.new),
            "change": "" if r.change is None else f"{100 * r.change:+.2f}%",
            "threshold": "" if r.threshold is None else f"{r.threshold:g}%",
            "noise": "" if r.noise is None else f"±{format_number(r.noise)}",
            "seeds": r.seeds, "verdict": r.verdict + (f" ({r.note})" if r.note else ""),
        } for r in self.rows])

    def render(self) -> str:
        """Human-readable text: header, table, unmatched cells, summary line."""
        from mosaicquant.reports.markdown import render_markdown

        lines = []
        for side, folder, code, skipped in (("base: ", self.base_dir, self.base_code, self.base_skipped),
                                            ("new:  ", self.new_dir, self.new_code, self.new_skipped)):
            lines.append(side + folder + (f" (code: {', '.join(code)})" if code else ""))
            if skipped:  # perhaps a damaged record, whose cell is then missing on that side
                lines.append(f"      {skipped_note(skipped)}")
        lines.append("")
        if self.protocol:
            lines.append(self.protocol_message())
            lines.append("")
        if self.rows:
            lines.append(render_markdown(self.table()))
        else:
            lines.append("(no metric compared)\n")
        for title, keys in (("Cells only in base", self.only_in_base), ("Cells only in new", self.only_in_new)):
            if keys:
                lines.append(f"{title} ({len(keys)}):")
                lines.extend(f"  - {m} | {meth} | {s}" for m, meth, s in keys)
        if self.not_compared:
            lines.append(f"Cells not compared ({len(self.not_compared)}):")
            lines.extend(f"  - {m} | {meth} | {s}: {why}" for m, meth, s, why in self.not_compared)
        if self.failed_in_new:
            lines.append(f"Cells failed or unavailable in new ({len(self.failed_in_new)}):")
            lines.extend(f"  - {m} | {meth} | {s}: {why}" for m, meth, s, _, why in self.failed_in_new)
        watched = [r for r in self.rows if r.threshold is not None]
        rule = ", ".join(f"{t.pattern}:{t.percent:g}%" for t in self.thresholds) or "none (nothing can fail)"
        lines.append(f"{len(self.regressions)} regression(s) in {len(watched)} watched of {len(self.rows)} "
                     f"compared metrics; --fail-on {rule}."
                     + (f" Refused: {len(self.protocol)} protocol field(s) differ (--strict)." if self.refused else ""))
        if self.unchecked_base:
            lines.append(f"FAILED: {len(self.unchecked_base)} base file(s) are not valid records, so the watched "
                         f"cells they held cannot be checked: {skipped_note(self.unchecked_base)}.")
        return "\n".join(lines)

    def _cell_path(self, row: ComparedMetric) -> str:
        return self.paths.get((row.model, row.method, row.suite), self.new_dir)

    def github_annotations(self) -> list[str]:
        """GitHub Actions workflow commands: ``::error`` per regression (on the new record's file) and for a
        refused protocol, ``::warning`` for a protocol difference that is only warned about."""
        out = []
        if self.protocol:
            level = "error" if self.refused else "warning"
            for d in self.protocol:
                out.append(f"::{level} title={_gh_property('protocol differs: ' + d.field)}::"
                           f"{_gh_data(d.text())}")
        for r in self.regressions:
            change = "" if r.change is None else f" ({100 * r.change:+.2f}%)"
            limit = "" if r.threshold is None else f", allowed {r.threshold:g}%"
            msg = (f"{r.model} | {r.method} | {r.suite} | {r.metric}: {r.verdict}{change}{limit}; "
                   f"base {format_number(r.base) or '-'}, new {format_number(r.new) or '-'}"
                   + (f" ({r.note})" if r.note else ""))
            out.append(f"::error file={_gh_property(self._cell_path(r))},"
                       f"title={_gh_property('regression: ' + r.metric)}::{_gh_data(msg)}")
        return out

    def to_json(self) -> dict[str, Any]:
        """A dict that is strict JSON: a non-finite change becomes None, and any other NaN or infinity
        (a ``base`` or ``new`` value) the string ``"NaN"``, ``"inf"`` or ``"-inf"`` (JSON has no such numbers)."""
        rows = []
        for r in self.rows:
            d = asdict(r)
            d["change_percent"] = None if r.change is None or not math.isfinite(r.change) else 100 * r.change
            del d["change"]
            rows.append(d)
        return _strict_json({
            "schema": "mosaicquant.compare/1", "base": self.base_dir, "new": self.new_dir,
            "base_code": self.base_code, "new_code": self.new_code,
            "base_skipped": [{"file": f, "why": w} for f, w in self.base_skipped],
            "new_skipped": [{"file": f, "why": w} for f, w in self.new_skipped],
            "fail_on": [asdict(t) for t in self.thresholds], "rows": rows,
            "only_in_base": [list(k) for k in self.only_in_base], "only_in_new": [list(k) for k in self.only_in_new],
            "not_compared": [{"cell": list(k[:3]), "why": k[3]} for k in self.not_compared],
            "failed_in_new": [{"cell": list(k[:3]), "status": k[3], "why": k[4]} for k in self.failed_in_new],
            "protocol_differences": [asdict(d) for d in self.protocol], "strict": self.strict,
            "refused": self.refused,
            "regressions": len(self.regressions), "exit_code": self.exit_code,
        })


def _gh_data(text: str) -> str:
    """A workflow command's message, escaped as GitHub Actions reads it."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _gh_property(text: str) -> str:
    """A workflow command's property value (``file=``, ``title=``), escaped."""
    return _gh_data(text).replace(":", "%3A").replace(",", "%2C")


def _strict_json(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float replaced by ``"NaN"``, ``"inf"`` or ``"-inf"``."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "NaN" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict_json(v) for v in obj]
    return obj


def _families(names: set[str]) -> list[str]:
    return sorted({n.split("/")[0] + "/*" if "/" in n else n for n in names})


def _check_thresholds(thresholds: list[Threshold], names: set[str], base_dir: str, new_dir: str) -> None:
    for t in thresholds:
        if any(t.matches(n) for n in names):
            continue
        families = _families(names)
        close = difflib.get_close_matches(t.pattern, sorted(names | set(families)), n=3, cutoff=0.5)
        hint = f" Did you mean: {', '.join(close)}?" if close else ""
        shown = ", ".join(families[:15]) + (f", ... ({len(families)} in all)" if len(families) > 15 else "")
        raise UserInputError(f"--fail-on metric {t.pattern!r} matches no metric in {base_dir!r} or {new_dir!r}."
                             f"{hint} Available: {shown or '(none)'}")


def _compare_metric(cell: Cell, name: str, base: MetricSummary | None, new: MetricSummary | None,
                    threshold: Threshold | None, seeds: str) -> ComparedMetric:
    ref = base or new
    row = ComparedMetric(model=cell.model, method=cell.method, suite=cell.suite, metric=name,
                         base=base.value if base else None, new=new.value if new else None,
                         higher_is_better=ref.higher_is_better, unit=ref.unit, change=None,
                         threshold=threshold.percent if threshold else None, noise=None, seeds=seeds,
                         verdict="", regression=False)
    if base is None or new is None:
        row.verdict = "new metric" if base is None else "missing in new"
        row.regression = new is None and threshold is not None  # the number CI holds is gone
        return row
    # every comparison with NaN is false: without these, a NaN would pass as "ok"
    if math.isnan(base.value):
        row.verdict = "not compared: not a number in base" + (" and new" if math.isnan(new.value) else "")
        return row
    if math.isnan(new.value):
        row.regression = threshold is not None
        row.verdict = ("REGRESSION: " if row.regression else "") + "not a number in new"
        return row
    delta = 0.0 if new.value == base.value else new.value - base.value  # inf - inf is NaN
    if math.isinf(base.value):
        # from an infinite base (e.g. a collapsed perplexity) the relative change tends to ±100%
        row.change = 0.0 if delta == 0 else math.copysign(1.0, delta)
    elif base.value != 0:
        row.change = delta / abs(base.value)
    else:
        row.change = 0.0 if delta == 0 else math.copysign(math.inf, delta)
    row.noise = math.sqrt((base.spread or 0.0) ** 2 + (new.spread or 0.0) ** 2)
    if threshold is None:
        return row
    bad = -row.change if base.higher_is_better else row.change
    beyond_noise = abs(delta) > row.noise
    if 100 * bad > threshold.percent:
        row.regression = beyond_noise
        row.verdict = "REGRESSION" if beyond_noise else "within spread"
    elif -100 * bad > threshold.percent and beyond_noise:
        row.verdict = "improved"
    else:
        row.verdict = "ok"
    return row


def _is_speed_metric(name: str) -> bool:
    return name == PREFILL or any(p.match(name) for p in (DECODE_RE, LINEAR_RE, STEP_RE))


def _ratio_summary(value: MetricSummary, ref: MetricSummary) -> MetricSummary | None:
    ratio = speedup(value, ref)
    if ratio is None:
        return None
    rel = [(m.spread or 0.0) / m.value for m in (value, ref) if m.spread is not None and math.isfinite(m.spread)]
    spread = ratio * math.sqrt(sum(r * r for r in rel)) if rel else None
    return MetricSummary(value=ratio, spread=spread, higher_is_better=True, unit="x", n=min(value.n, ref.n))


def speed_ratios(cells: dict[tuple[str, str, str], Cell]) -> dict[tuple[str, str, str], dict[str, MetricSummary]]:
    """``{cell key: {"vs_fp16/<metric>": speed-up}}`` of every in-process speed cell against the ``fp16`` cell of
    the same model and suite label in the same set (none for the fp16 cell itself, or without one)."""
    out: dict[tuple[str, str, str], dict[str, MetricSummary]] = {}
    for key, cell in cells.items():
        if cell.suite_name not in ("throughput", "latency") or cell.backend is not None or cell.method == FP16_LABEL:
            continue
        ref = cells.get((cell.model, FP16_LABEL, cell.suite))
        if ref is None or not ref.metrics:
            continue
        ratios = {}
        for name, m in cell.metrics.items():
            if _is_speed_metric(name) and name in ref.metrics:
                if not name.startswith("linear_us/") and not same_runtime(cell, ref):
                    continue  # an end-to-end step on another decoder runtime is no speed-up of the method
                if (r := _ratio_summary(m, ref.metrics[name])) is not None:
                    ratios[RATIO_PREFIX + name] = r
        if ratios:
            out[key] = ratios
    return out


def _by_cell(records: list[dict[str, Any]]) -> dict[tuple[str, str, str], list[dict[str, Any]]]:
    out: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for rec in records:
        out.setdefault((rec["model"]["name"], rec["method"]["label"], rec["suite"]["label"]), []).append(rec)
    return out


def _protocol(base_records: list[dict[str, Any]], new_records: list[dict[str, Any]]) -> list[ProtocolDifference]:
    """The protocol fields in which the records of the matched cells differ, merged over cells."""
    base, new = _by_cell(base_records), _by_cell(new_records)
    merged: dict[str, tuple[set[str], set[str], list[str]]] = {}
    for key, recs in base.items():
        if key not in new:
            continue
        for name, mine, theirs in protocol_differences(recs, new[key]):
            entry = merged.setdefault(name, (set(), set(), []))
            entry[0].update(mine)
            entry[1].update(theirs)
            entry[2].append(" | ".join(key))
    return [ProtocolDifference(name, tuple(sorted(b)), tuple(sorted(n)), tuple(cells))
            for name, (b, n, cells) in merged.items()]


def compare_records(base_records: list[dict[str, Any]], new_records: list[dict[str, Any]],
                    fail_on: list[Threshold] | None = None, base_dir: str = "BASE",
                    new_dir: str = "NEW", strict: bool = False) -> Comparison:
    """Compare two lists of records (see the module docstring for the rules).

    Args:
        base_records / new_records: as :func:`mosaicquant.harness.results.load_records` returns them.
        fail_on: the watched metrics and thresholds; None compares every shared metric, failing none.
        base_dir / new_dir: names used in messages.
        strict: refuse (exit code :data:`REFUSED_EXIT`) when base and new differ in protocol; otherwise the
            differences are a warning.

    Returns:
        The :class:`Comparison`; its ``exit_code`` is 1 when a watched metric regressed, 3 when refused.

    Raises:
        UserInputError: a ``fail_on`` entry that matches no metric of either set.
    """
    thresholds = list(fail_on or [])
    base_cells, new_cells = aggregate_cells(base_records), aggregate_cells(new_records)
    names = {n for r in base_records + new_records for n in (r.get("metrics") or {})}
    for cells in (base_cells, new_cells):
        for key, ratios in speed_ratios(cells).items():
            cells[key].metrics.update(ratios)
            names.update(ratios)
    _check_thresholds(thresholds, names, base_dir, new_dir)
    result = Comparison(base_dir=base_dir, new_dir=new_dir, thresholds=thresholds,
                        base_code=code_versions(base_records), new_code=code_versions(new_records),
                        protocol=_protocol(base_records, new_records), strict=strict)
    for records in (base_records, new_records):  # the new record's file where it has one
        for key, recs in _by_cell(records).items():
            if recs[0].get("_path"):
                result.paths[key] = recs[0]["_path"]
    result.only_in_base = [k for k in base_cells if k not in new_cells]
    result.only_in_new = [k for k in new_cells if k not in base_cells]
    for key, base in base_cells.items():
        new = new_cells.get(key)
        if new is None:
            # listed under "only in base"; a watched number it held is gone, which CI must not pass
            for name in sorted(base.metrics, key=natural_key):
                threshold = _threshold_for(name, thresholds)
                if threshold is not None:
                    result.rows.append(_compare_metric(base, name, base.metrics[name], None, threshold,
                                                       f"{len(base.ok_seeds)}/0"))
                    result.rows[-1].note = "no such cell in new"
            continue
        if not base.metrics:
            why = f"base has no numbers ({base.note or 'no metrics'})"
            result.not_compared.append((*key, why + (f"; new: {new.note}" if new.note else "")))
            continue
        if new.status != "ok":
            result.failed_in_new.append((*key, new.status, new.note))
        if thresholds:
            shown = [n for n in dict.fromkeys([*base.metrics, *new.metrics]) if _threshold_for(n, thresholds)]
        elif new.metrics:
            shown = list(base.metrics)
        else:
            shown = []  # no numbers at all in new: the cell is listed with its error instead
        shown.sort(key=natural_key)
        seeds = f"{len(base.ok_seeds)}/{len(new.ok_seeds)}"
        new_broken = new.status != "ok" and base.status == "ok"
        # end-to-end speed moves with the decoder code around the linears: say so where it changed
        runtimes = (runtime_of(base), runtime_of(new))
        runtime_note = ("decoder runtime changed: base {}, new {}".format(*(r or "not recorded" for r in runtimes))
                        if runtimes[0] != runtimes[1] else "")
        for name in shown:
            threshold = _threshold_for(name, thresholds)
            if new_broken and threshold is not None and name in base.metrics:
                m = base.metrics[name]
                result.rows.append(ComparedMetric(
                    model=key[0], method=key[1], suite=key[2], metric=name, base=m.value, new=None,
                    higher_is_better=m.higher_is_better, unit=m.unit, change=None, threshold=threshold.percent,
                    noise=None, seeds=seeds, verdict=f"{new.status.upper()} in new", regression=True,
                    note=new.note))
                continue
            row = _compare_metric(base, name, base.metrics.get(name), new.metrics.get(name), threshold, seeds)
            if runtime_note and not name.removeprefix(RATIO_PREFIX).startswith("linear_us/"):
                row.note = runtime_note
            result.rows.append(row)
    return result


def code_versions(records: list[dict[str, Any]]) -> list[str]:
    """The distinct code versions behind ``records``, as ``commit[*]/source fingerprint`` (``*``: uncommitted
    changes; ``?`` where a record predates the field), sorted."""
    seen = []
    for r in records:
        git = r.get("git") or {}
        commit = (git.get("commit") or "?")[:10] + ("*" if git.get("dirty") else "")
        label = f"{commit}/{git.get('source_sha256') or '?'}"
        if label not in seen:
            seen.append(label)
    return sorted(seen)


def compare_dirs(base_dir: str | Path, new_dir: str | Path, fail_on: str | None = None,
                 strict: bool = False) -> Comparison:
    """Compare two results directories.

    Args:
        base_dir: the reference results.
        new_dir: the results to check.
        fail_on: ``METRIC:PCT[,METRIC:PCT...]`` or None.
        strict: refuse when base and new differ in protocol (see the module docstring).

    Raises:
        UserInputError: bad ``fail_on`` syntax, a missing or empty directory, or a ``fail_on``
            metric that matches nothing in either set.

    Example:
        >>> result = compare_dirs("results/main", "results/pr", "decode_tok_s:5%")  # doctest: +SKIP
        >>> result.exit_code  # doctest: +SKIP
        0
    """
    thresholds = parse_fail_on(fail_on) if fail_on is not None else None
    base_skipped: list[tuple[str, str]] = []
    new_skipped: list[tuple[str, str]] = []
    base_records = load_records(base_dir, required=True, skipped=base_skipped)
    new_records = load_records(new_dir, required=True, skipped=new_skipped)
    result = compare_records(base_records, new_records, thresholds, str(base_dir), str(new_dir), strict=strict)
    result.base_skipped, result.new_skipped = base_skipped, new_skipped
    return result


def write_json(result: Comparison, path: str | Path) -> Path:
    """Write :meth:`Comparison.to_json` to ``path``.

    Raises:
        UserInputError: the file cannot be written.
    """
    path = Path(path)
    try:
        path.write_text(json.dumps(result.to_json(), indent=2, allow_nan=False) + "\n")
    except OSError as exc:
        raise UserInputError(f"cannot write --json file {str(path)!r}: {exc.strerror or exc}") from None
    return path


def write_junit(result: Comparison, path: str | Path) -> Path:
    """Write the comparison as JUnit XML for CI test reports.

    One ``<testcase>`` per watched metric (every compared metric when nothing is watched), named by
    the metric, its class ``model.method.suite``; a regression is a ``<failure>``. One more case,
    ``protocol``, fails when the comparison is refused (``strict``) and carries a warning in its
    ``<system-out>`` otherwise.

    Raises:
        UserInputError: the file cannot be written.
    """
    from xml.etree import ElementTree as ET

    watched = [r for r in result.rows if r.threshold is not None] or result.rows
    suite = ET.Element("testsuite", name="mosaicquant compare", tests=str(len(watched) + 1))
    failures = 0
    for r in watched:
        case = ET.SubElement(suite, "testcase", classname=f"{r.model}.{r.method}.{r.suite}", name=r.metric,
                             file=result._cell_path(r))
        change = "" if r.change is None else f"{100 * r.change:+.2f}%"
        detail = (f"base {format_number(r.base) or '-'}, new {format_number(r.new) or '-'}, change {change or '-'}, "
                  f"threshold {'-' if r.threshold is None else f'{r.threshold:g}%'}, "
                  f"noise {'-' if r.noise is None else format_number(r.noise)}, seeds {r.seeds}"
                  + (f"; {r.note}" if r.note else ""))
        if r.regression:
            failures += 1
            ET.SubElement(case, "failure", message=f"{r.verdict}: {r.metric} {change}".strip()).text = detail
        else:
            ET.SubElement(case, "system-out").text = f"{r.verdict or 'compared'}: {detail}"
    case = ET.SubElement(suite, "testcase", classname="mosaicquant.compare", name="protocol")
    if result.refused:
        failures += 1
        ET.SubElement(case, "failure", message="base and new differ in protocol").text = result.protocol_message()
    elif result.protocol:
        ET.SubElement(case, "system-out").text = result.protocol_message()
    suite.set("failures", str(failures))
    suite.set("errors", "0")
    root = ET.Element("testsuites", name="mosaicquant compare", tests=suite.get("tests"), failures=str(failures))
    root.append(suite)
    ET.indent(root)
    path = Path(path)
    try:
        path.write_bytes(ET.tostring(root, encoding="utf-8", xml_declaration=True) + b"\n")
    except OSError as exc:
        raise UserInputError(f"cannot write --junit file {str(path)!r}: {exc.strerror or exc}") from None
    return path
