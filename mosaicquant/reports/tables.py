"""Tables and the report of a results directory: one row per (model, method spec), metric columns per suite.

Reads only records (:func:`mosaicquant.harness.results.load_records`). Every record gets a
row — a failed cell shows ``failed: <error>`` instead of numbers, and a method that could
not run (``"status": "unavailable"``) shows its reason — so a report never hides a missing
result. :func:`write_tables` writes ``report.md`` with the summary, the speed tables
(:mod:`mosaicquant.reports.speed`) and the figures (:mod:`mosaicquant.reports.plots`)
embedded, plus ``summary.csv``, ``summary.tex`` and ``records_long.csv``, all in the folder of the
report file (the results directory unless told otherwise).
"""

from __future__ import annotations

import math
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import pandas as pd

from mosaicquant.errors import UserInputError
from mosaicquant.harness.results import ensure_writable_dir, load_records, skipped_note
from mosaicquant.reports.cells import (
    FP16_LABEL,
    MetricSummary,
    summarize_metrics,
    aggregate_cells,
    format_number,
    natural_key,
    record_note,
)
from mosaicquant.reports.headings import heading
from mosaicquant.reports.latex import render_latex
from mosaicquant.reports.markdown import render_markdown
from mosaicquant.reports.protocol import protocol_section

__all__ = ["records_frame", "summary_table", "paper_table", "render_markdown", "provenance_section", "write_tables",
           "short_path", "Footnotes"]

UP_DOWN_LEGEND = "↑: higher is better, ↓: lower is better."

#: an execution-path text longer than this is shown as its first words with the whole text as a footnote
SHORT_PATH_CHARS = 24

#: which metrics a summary shows per suite (names or globs; others stay in the CSV)
SUMMARY_METRICS = {
    "accuracy": ["ppl"],
    "throughput": ["prefill_tok_s", "decode_tok_s/*"],
    "latency": ["step_ms/*"],
    "memory": ["total_quantized_linears", "linear_weight_ratio_vs_bf16", "residual_overhead_vs_base",
               "residual_overhead_vs_model", "peak_device_bytes"],
    "analysis": ["recovered/hessian/0.1", "recovered/delta/0.1", "recovered/frobenius/0.1", "recovered/random/0.1",
                 "recovered/exact-greedy/0.1", "recovered/channel-in/0.1", "recovered/channel-out/0.1",
                 "recovered_global/hessian/0.1"],
}


def records_frame(records: list[dict[str, Any]]) -> pd.DataFrame:
    """Long format: one row per (record, metric)."""
    rows = []
    for rec in records:
        info = rec.get("method_info") or {}
        base = {
            "model": rec["model"]["name"],
            "method": rec["method"]["label"],
            "suite": rec["suite"]["label"],
            "seed": rec["seed"],
            "status": rec.get("status"),
            "wbits": info.get("wbits"),
            "abits": info.get("abits"),
            "kv_bits": info.get("kv_bits"),
            "exec_path": info.get("exec_path"),
            "exec_path_speed": info.get("exec_path_speed"),
            "note": None if rec.get("status") == "ok" else record_note(rec),
        }
        metrics = rec.get("metrics") or {}
        if not metrics:
            rows.append({**base, "metric": None, "value": None, "higher_is_better": None, "unit": None,
                         "spread": None})
        for name, m in metrics.items():
            rows.append({**base, "metric": name, "value": m["value"], "higher_is_better": m["higher_is_better"],
                         "unit": m.get("unit"), "spread": m.get("spread")})
    return pd.DataFrame(rows)


def _shown(suite: str, name: str) -> bool:
    if name.startswith("bits/"):  # every record's effective bits: the equal-bits section shows them once a row
        return False
    patterns = SUMMARY_METRICS.get(suite)
    return patterns is None or any(fnmatchcase(name, p) for p in patterns)


def _row_key(rec: dict[str, Any]) -> tuple[str, str]:
    """(model, method) of a record's summary row; an analysis config has a row of its own."""
    key = (rec["model"]["name"], rec["method"]["label"])
    if rec["suite"]["name"] == "analysis":
        # one row per analysis config: it analyses the float model, not the cell's method
        cfg = rec["suite"]["config"]
        key = (key[0], f"{key[1]} [analysis: {cfg.get('transform')}, {cfg.get('base')} base, block {cfg.get('block')}]")
    return key


def _split_suites(records: list[dict[str, Any]]) -> set[str]:
    """The suites that some row ran in more than one configuration (suite label)."""
    labels: dict[tuple[tuple[str, str], str], set[str]] = {}
    for rec in records:
        labels.setdefault((_row_key(rec), rec["suite"]["name"]), set()).add(rec["suite"]["label"])
    return {suite for (_, suite), seen in labels.items() if len(seen) > 1}


def summary_table(records: list[dict[str, Any]]) -> pd.DataFrame:
    """Wide table: model, method, bits, KV bits, execution path, one column per shown metric.

    Metrics are the mean over seeds; ``n_seeds`` says how many. A mean that is NaN is the string
    ``"NaN"``, so that it stays apart from a metric the row did not measure (an empty cell).

    Columns are ``suite/metric``; where a row ran a suite in more than one configuration (e.g.
    ``accuracy:max_chunks=8`` and ``accuracy:seqlen=512``), every column of that suite is named
    by the suite label instead (``accuracy:seqlen=512/ppl``): the numbers of two configurations
    are never averaged.
    """
    split = _split_suites(records)
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for rec in records:
        key = _row_key(rec)
        suite = rec["suite"]["name"]
        info = rec.get("method_info") or {}
        row = rows.setdefault(key, {"model": key[0], "method": key[1], "W": None, "A": None, "KV": None,
                                    "exec path": None, "_speed_path": None, "_vals": {}, "_fail": []})
        # a failed cell may carry no method info: take each field from the first record that has it
        for col, field in (("W", "wbits"), ("A", "abits"), ("KV", "kv_bits"), ("exec path", "exec_path"),
                           ("_speed_path", "exec_path_speed")):
            if row[col] is None and info.get(field) is not None:
                row[col] = str(info[field])  # bits may be "4/8" (mixed precision); keep one type per column
        if rec.get("status") != "ok":
            row["_fail"].append(f"{rec['suite']['label']} {record_note(rec)}"[:200])
            continue
        for name, m in (rec.get("metrics") or {}).items():
            if not _shown(suite, name):
                continue
            col = f"{rec['suite']['label'] if suite in split else suite}/{name}"
            row["_vals"].setdefault(col, []).append(m["value"])
    out = []
    for row in rows.values():
        vals = row.pop("_vals")
        fails = row.pop("_fail")
        speed_path = row.pop("_speed_path")
        if speed_path and speed_path != row["exec path"]:
            # the speed suites time a kernel path, the accuracy suite may simulate the method
            row["exec path"] = "; ".join(p for p in (row["exec path"], f"speed: {speed_path}") if p)
        for col, v in vals.items():
            mean = sum(v) / len(v)
            # a NaN result is shown as such (a string keeps it apart from an empty cell: not measured)
            row[col] = "NaN" if math.isnan(mean) else mean
            row["n_seeds"] = max(row.get("n_seeds", 0), len(v))
        row["notes"] = "; ".join(fails)
        out.append(row)
    df = pd.DataFrame(out)
    if not df.empty:
        metric_cols = sorted((c for c in df.columns if "/" in c), key=natural_key)
        front = ["model", "method", "W", "A", "KV", "exec path"]
        rest = [c for c in df.columns if c not in front + metric_cols]
        df = df[front + metric_cols + rest]
        if "n_seeds" in df:
            df["n_seeds"] = df["n_seeds"].astype("Int64")
    return df


def short_path(text: str) -> str:
    """The first words of an execution-path text: what comes before its first bracket, colon or semicolon.

    Example:
        >>> short_path("simulated (fake-quant of the packed W4 + residual format)")
        'simulated'
    """
    head = text
    for sep in (" (", ": ", "; ", ", "):
        head = head.split(sep)[0]
    head = head.strip() or text
    return head if len(head) <= SHORT_PATH_CHARS else head[:SHORT_PATH_CHARS - 1].rstrip() + "…"


class Footnotes:
    """Numbered footnotes of one report: each long execution-path text once, marked ``[^i]`` where it is shown."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def mark(self, text: str | None) -> str:
        """``text`` with each ``; speed: ``-separated part longer than its short label replaced by
        the label and a footnote mark (:func:`short_path`)."""
        if not isinstance(text, str) or not text:  # None, or pandas' NaN for a cell without one
            return ""
        parts = []
        for part in text.split("; speed: "):
            short = short_path(part)
            if short != part:
                if part not in self.texts:
                    self.texts.append(part)
                short += f"[^{self.texts.index(part) + 1}]"
            parts.append(short)
        return "; speed: ".join(parts)

    def markdown(self) -> list[str]:
        return [f"[^{i}]: {text}" for i, text in enumerate(self.texts, 1)]


def _shown_value(m: MetricSummary, scale: float) -> str:
    """``mean ± spread`` (the spread only where one exists), in the heading's unit."""
    if math.isnan(m.value):
        return "NaN"
    text = format_number(m.value * scale)
    if m.spread is not None and math.isfinite(m.spread) and m.spread > 0:
        text += f" ± {format_number(m.spread * scale)}"
    return text


def paper_table(records: list[dict[str, Any]],
                footnotes: Footnotes | None = None) -> tuple[pd.DataFrame, list[str]]:
    """The summary as a paper prints it: human headings with units and arrows, ``mean ± spread`` text.

    One row per (model, method label) as :func:`summary_table`, with the same metrics, shown by
    :func:`mosaicquant.reports.headings.heading` (bytes in MiB, fractions in %); a value is the mean
    over the row's ``ok`` seeds and its spread the larger of the recorded spreads and the standard
    deviation across seeds (:mod:`mosaicquant.reports.cells`). ``quantize (s)`` is the time the
    method took to quantize the model, mean over seeds. An execution-path text longer than
    :data:`SHORT_PATH_CHARS` is shown by its first words with a footnote mark; the footnotes hold
    the whole text. The unquantized ``fp16`` row of a run in float32 says so in its notes.

    Args:
        records: as :func:`mosaicquant.harness.results.load_records` returns them.
        footnotes: the report's footnotes, to number on from (a new set by default).

    Returns:
        ``(table of strings, footnote texts)``; footnote ``i`` (from 1) is marked ``[^i]`` in the table.
    """
    split = _split_suites(records)
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    notes_set = footnotes if footnotes is not None else Footnotes()
    mark = notes_set.mark

    for rec in records:
        key = _row_key(rec)
        info = rec.get("method_info") or {}
        row = rows.setdefault(key, {"W": None, "A": None, "KV": None, "path": None, "speed_path": None,
                                    "metrics": {}, "quantize": {}, "seeds": set(), "fail": [], "dtypes": set(),
                                    "once": set(), "seeded": set()})
        for col, name in (("W", "wbits"), ("A", "abits"), ("KV", "kv_bits"), ("path", "exec_path"),
                          ("speed_path", "exec_path_speed")):
            if row[col] is None and info.get(name) is not None:
                row[col] = str(info[name])
        row["dtypes"].add((rec.get("model") or {}).get("dtype"))
        quantize = (rec.get("timing") or {}).get("quantize_s")
        if quantize is not None and rec["suite"]["name"] != "analysis":
            row["quantize"].setdefault(rec.get("seed"), float(quantize))
        if rec.get("status") != "ok":
            row["fail"].append(f"{rec['suite']['label']} {record_note(rec)}"[:200])
            continue
        row["seeds"].add(rec.get("seed"))
        row["once" if rec.get("seed_independent") else "seeded"].add(rec["suite"]["label"])
        suite = rec["suite"]["name"]
        for name, m in (rec.get("metrics") or {}).items():
            if _shown(suite, name):
                col = (suite, rec["suite"]["label"] if suite in split else None, name)
                row["metrics"].setdefault(col, []).append(m)
    columns = sorted({c for row in rows.values() for c in row["metrics"]},
                     key=lambda c: (natural_key(c[1] or c[0]), natural_key(c[2])))
    out = []
    for (model, method), row in rows.items():
        summaries = summarize_metrics({c: ms for c, ms in row["metrics"].items()})
        path = row["path"]
        if row["speed_path"] and row["speed_path"] != path:
            path = "; speed: ".join(p for p in (path, row["speed_path"]) if p)
        shown: dict[str, Any] = {"model": model, "method": method, "W": row["W"] or "", "A": row["A"] or "",
                                 "KV": row["KV"] or "", "execution": mark(path)}
        times = list(row["quantize"].values())
        if times:
            shown["quantize (s)"] = _shown_value(summarize_metrics({"t": [{"value": t} for t in times]})["t"], 1.0)
        for col in columns:
            if col in summaries:
                suite, label, name = col
                m = summaries[col]
                h = heading(suite, name, m.higher_is_better, m.unit)
                title = h.title + (f" [{label}]" if label else "")
                shown[title] = _shown_value(m, h.scale)
        notes = list(row["fail"])
        if method.split(":")[0].split("@")[0] == FP16_LABEL and "float32" in row["dtypes"]:
            notes.insert(0, "unquantized reference ran in float32 (the run's dtype), not in BF16/FP16")
        shown["seeds"] = str(len(row["seeds"])) if row["seeds"] else "0"
        if row["once"] and not row["seeded"]:
            shown["seeds"] += " (seed-independent)"
        elif row["once"]:
            notes.append(f"seed-independent, run once: {', '.join(sorted(row['once']))}")
        shown["notes"] = "; ".join(notes)
        out.append(shown)
    df = pd.DataFrame(out).fillna("")
    if not df.empty:
        titles = []
        for suite, label, name in columns:
            probe = next((m for r in rows.values() for c, ms in r["metrics"].items() if c == (suite, label, name)
                          for m in ms), {})
            h = heading(suite, name, probe.get("higher_is_better"), probe.get("unit"))
            titles.append(h.title + (f" [{label}]" if label else ""))
        front = [c for c in ("model", "method", "W", "A", "KV", "execution", "quantize (s)") if c in df.columns]
        metric_cols = [t for t in dict.fromkeys(titles) if t in df.columns]
        df = df[front + metric_cols + ["seeds", "notes"]]
    return df, list(notes_set.texts)


def _speed_sections(records: list[dict[str, Any]], footnotes: Footnotes | None = None) -> list[str]:
    """Markdown of the throughput, per-layer latency and step-time tables, one set per (model, suite label),
    then one table per (model, backend, suite label) of the cells another backend ran. Long execution
    paths are short labels marked with ``footnotes`` (the report's)."""
    footnotes = footnotes if footnotes is not None else Footnotes()
    from mosaicquant.harness.backends import backend_label
    from mosaicquant.reports.speed import (
        backend_fp16_cell,
        backend_groups,
        backend_table,
        ceilings_text,
        energy_table,
        fp16_cell,
        latency_table,
        step_table,
        suite_groups,
        throughput_table,
    )

    cells = list(aggregate_cells(records).values())
    parts = []
    legend = ("Each value is the mean over seeds ± its spread (as recorded: half the interquartile range of the "
              "timed repeats), then in brackets the speed-up vs the `fp16` row of the same model in this "
              "directory (above 1× is faster).\n")
    for suite, title in (("throughput", "Throughput"), ("latency", "Latency")):
        for (model, label), group in suite_groups(cells, suite).items():
            parts.append(f"### {title} on {model} (`{label}`)\n")
            parts.append(legend)
            if fp16_cell(group) is None:
                parts.append(f"No `fp16` row for {model} in this directory: values are shown without speed-ups.\n")
            if suite == "throughput":
                parts.append("Tokens per second: prefill at batch 1, decode per batch size.\n")
                ceilings = ceilings_text(group)
                if ceilings:
                    parts.append("Beside each speed, its fraction of the floor: a decode step's bytes (weights as "
                                 "stored, output head, KV cache) over the copy bandwidth, a prefill's matrix flops "
                                 "over the tensor-core rate its linears use (100% is the physics). Ceilings "
                                 f"measured in this run: {ceilings}.\n")
                table = throughput_table(group)
                if "exec path" in table:
                    table["exec path"] = [footnotes.mark(v) for v in table["exec path"]]
                    table = table.rename(columns={"exec path": "execution"})
                parts.append(render_markdown(table))
                energy = energy_table(group)
                if not energy.empty:
                    parts.append("Decode energy per token (NVML energy counter over the `energy_s` window; in "
                                 "brackets the ratio to `fp16`, below 1× uses less) and mean power:\n")
                    parts.append(render_markdown(energy))
            else:
                steps = step_table(group)
                if not steps.empty:
                    parts.append("End-to-end step time (ms):\n")
                    parts.append(render_markdown(steps))
                parts.append("Linear layer time (µs) per number of tokens M, with the speed-up in brackets "
                             "(spreads are in `records_long.csv`):\n")
                parts.append(render_markdown(latency_table(group)))
    titles = {"throughput": "Throughput", "latency": "Latency"}
    order = list(titles)  # as above: throughput, then latency, then any other suite a backend ran
    groups = sorted(backend_groups(cells).items(), key=lambda kv: order.index(kv[1][0].suite_name)
                    if kv[1][0].suite_name in order else len(order))
    for (model, backend, label), group in groups:
        fp16 = backend_label(FP16_LABEL, backend)
        parts.append(f"### {titles.get(group[0].suite_name, group[0].suite_name)} on {model} (`{label}`), "
                     f"run by {backend}\n")
        table = backend_table(group)
        if not table.empty:
            parts.append(f"The metrics the {backend} backend recorded, as its engine measured them on its own "
                         "workload (not comparable with the in-process tables): each value is the mean over seeds "
                         f"(± its spread where recorded), then in brackets the speed-up vs the `{fp16}` row of the "
                         "same model in this directory (above 1× is faster), for times and rates; the other "
                         "values describe the workload.\n")
            if backend_fp16_cell(group) is None:
                parts.append(f"No `{fp16}` row for {model} in this directory: values are shown without "
                             "speed-ups.\n")
            parts.append(render_markdown(table))
        parts.extend(f"- `{c.method}`: {c.note or 'no metrics recorded'}" for c in group
                     if not c.metrics or c.note)
        if any(not c.metrics or c.note for c in group):
            parts.append("")
    if parts:
        parts.insert(0, "## Speed\n")
    return parts


def provenance_section(records: list[dict[str, Any]]) -> list[str]:
    """``## Provenance``: the code and machine behind the records, one row per distinct (commit, source
    fingerprint, GPU, torch, triton), with how many records each produced (empty without records).

    The commit is the checkout's (``*``: uncommitted changes to tracked files); the source fingerprint
    (:func:`mosaicquant.harness.results.source_fingerprint`) names the package's code even where the checkout's
    history does not; ``mosaicquant fingerprint REV`` gives a commit's.
    """
    counts: dict[tuple, int] = {}
    for r in records:
        git, env = r.get("git") or {}, r.get("env") or {}
        commit = (git.get("commit") or "")[:10] + ("*" if git.get("dirty") else "")
        key = (commit or "–", git.get("source_sha256") or "–", env.get("gpu") or "CPU", env.get("torch") or "–",
               env.get("triton") or "–")
        counts[key] = counts.get(key, 0) + 1
    if not counts:
        return []
    lines = ["## Provenance\n", "| commit | source fingerprint | GPU | torch | triton | records |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {' | '.join(key)} | {n} |" for key, n in sorted(counts.items())]
    if len(counts) > 1:
        lines.append("\nThese records come from more than one code version or machine.")
    return lines + [""]


def _check_output(out_path: Path) -> None:
    """Refuse an output that cannot be written before any work: a folder given as the report file,
    or a folder that cannot be created or written to.

    Raises:
        UserInputError: naming the path and the reason.
    """
    if out_path.is_dir():
        raise UserInputError(f"report file {str(out_path)!r} is a directory: give the Markdown file to write, "
                             f"e.g. {str(out_path / 'report.md')!r}")
    ensure_writable_dir(out_path.parent, what="report folder")


def write_tables(results_dir: str | Path, out_path: str | Path | None = None) -> Path:
    """Write ``report.md`` (tables and figures), ``summary.csv``, ``summary.tex`` and ``records_long.csv``.

    Every output goes into the folder of the Markdown file: the figures (PNG files, embedded
    by file name) and the tables. By default that is the results directory; with ``out_path``
    elsewhere, the results directory is only read.

    Args:
        results_dir: a results directory (one report per directory).
        out_path: the Markdown file (default ``results_dir/report.md``).

    Returns:
        The path of the Markdown report.

    Raises:
        UserInputError: the directory does not exist or holds no result records (a report of nothing is a wrong
            directory more often than not; no file is written), or an output cannot be written (naming it).
    """
    from mosaicquant.reports.bits import equal_bits_section
    from mosaicquant.reports.noise import noise_section
    from mosaicquant.reports.plots import draw_figures

    results_dir = Path(results_dir)
    skipped: list[tuple[str, str]] = []
    records = load_records(results_dir, required=True, skipped=skipped)
    out_path = Path(out_path) if out_path else results_dir / "report.md"
    _check_output(out_path)
    out_dir = out_path.parent
    df = summary_table(records)
    caveats = sorted({r["model"].get("caveat") for r in records if r["model"].get("caveat")})
    parts = [f"# MosaicQuant results: {results_dir}\n", f"{len(records)} records.\n"]
    if skipped:  # perhaps a damaged record: its cell would be missing without a word
        note = skipped_note(skipped)
        parts.append(f"{note[0].upper()}{note[1:]}.\n")
    parts.extend(protocol_section(records))
    for c in caveats:
        parts.append(f"> Caveat: {c}\n")
    notes = Footnotes()
    paper, footnotes = paper_table(records, notes)
    parts.append("## Summary\n")
    parts.append(f"Each value is the mean over seeds ± its spread (the larger of the recorded spread and the standard "
                 f"deviation across seeds; no ± where neither exists). {UP_DOWN_LEGEND}\n")
    if any(r.get("seed_independent") for r in records):
        parts.append("A cell whose method and suite do not depend on the seed (e.g. fp16 or RTN by perplexity) runs "
                     "once, at the sweep's first seed: its row says `seed-independent` and has no spread over seeds.\n")
    parts.append(render_markdown(paper))
    parts.extend(noise_section(records))
    parts.extend(_speed_sections(records, notes))
    if notes.texts:  # one list for the report: GitHub shows Markdown footnotes at its end anyway
        parts.append("## Execution paths\n")
        parts.extend(notes.markdown())
        parts.append("")
    try:
        figures, notes = draw_figures(records, out_dir)
        if figures or notes:
            parts.append("## Figures\n")
        parts.extend(f"- {note}" for note in notes)
        if notes:
            parts.append("")
        for fig in figures:
            parts.append(f"![{fig.path.stem}]({fig.path.name})\n")
            parts.append(f"*{fig.caption}*\n")
            vector = [p for p in fig.paths[1:] if p.exists()]
            if vector:
                parts.append("Vector: " + ", ".join(f"[{p.suffix[1:].upper()}]({p.name})" for p in vector) + "\n")
        parts.extend(equal_bits_section(records, out_dir))
        parts.extend(provenance_section(records))
        out_path.write_text("\n".join(parts))
        df.to_csv(out_dir / "summary.csv", index=False)
        records_frame(records).to_csv(out_dir / "records_long.csv", index=False)
        if not paper.empty:
            (out_dir / "summary.tex").write_text(render_latex(paper, footnotes))
    except OSError as exc:  # e.g. a full disk, or a figure's name taken by a folder
        raise UserInputError(f"cannot write {str(exc.filename or out_dir)!r}: {exc.strerror or exc}") from None
    return out_path
