"""Tables from result records: one row per (model, method spec), metric columns per suite.

Reads only records (:func:`mosaicquant.harness.results.load_records`). Every record gets a
row — a failed cell shows ``failed: <error>`` instead of numbers, and a method that could
not run says why — so a report never hides a missing result.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from mosaicquant.harness.results import load_records

__all__ = ["records_frame", "summary_table", "render_markdown", "write_tables"]

#: which metrics a summary shows per suite (others stay in the CSV)
SUMMARY_METRICS = {
    "accuracy": ["ppl"],
    "memory": ["total_quantized_linears", "linear_weight_ratio_vs_bf16", "residual_overhead_vs_base",
               "peak_device_bytes"],
    "analysis": ["recovered/hessian/0.1", "recovered/delta/0.1", "recovered/frobenius/0.1", "recovered/random/0.1",
                 "recovered/exact-greedy/0.1", "recovered/channel-in/0.1", "recovered/channel-out/0.1",
                 "recovered_global/hessian/0.1"],
}


def records_frame(records: list[dict[str, Any]]) -> pd.DataFrame:
    """Long format: one row per (record, metric)."""
    rows = []
    for rec in records:
        base = {
            "model": rec["model"]["name"],
            "method": rec["method"]["label"],
            "suite": rec["suite"]["label"],
            "seed": rec["seed"],
            "status": rec.get("status"),
            "wbits": rec.get("method_info", {}).get("wbits"),
            "abits": rec.get("method_info", {}).get("abits"),
            "kv_bits": rec.get("method_info", {}).get("kv_bits"),
            "exec_path": rec.get("method_info", {}).get("exec_path"),
            "error": (rec.get("error") or {}).get("message"),
        }
        metrics = rec.get("metrics") or {}
        if not metrics:
            rows.append({**base, "metric": None, "value": None, "higher_is_better": None})
        for name, m in metrics.items():
            rows.append({**base, "metric": name, "value": m["value"], "higher_is_better": m["higher_is_better"]})
    return pd.DataFrame(rows)


def _fmt(value: float) -> str:
    if value is None or pd.isna(value):
        return ""
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 100:
        return f"{value:.1f}"
    return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"


def summary_table(records: list[dict[str, Any]]) -> pd.DataFrame:
    """Wide table: model, method, bits, KV bits, execution path, one column per shown metric.

    Metrics are the mean over seeds; ``n_seeds`` says how many.
    """
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for rec in records:
        key = (rec["model"]["name"], rec["method"]["label"])
        suite = rec["suite"]["name"]
        if suite == "analysis":
            # one row per analysis config: it analyses the float model, not the cell's method
            cfg = rec["suite"]["config"]
            key = (key[0], f"{key[1]} [analysis: {cfg.get('transform')}, {cfg.get('base')} base, block {cfg.get('block')}]")
        info = rec.get("method_info", {})
        row = rows.setdefault(key, {"model": key[0], "method": key[1], "W": info.get("wbits"),
                                    "A": info.get("abits"), "KV": info.get("kv_bits"),
                                    "exec path": info.get("exec_path"), "_vals": {}, "_fail": []})
        if rec.get("status") != "ok":
            err = rec.get("error") or {}
            row["_fail"].append(f"{rec['suite']['label']} failed: {err.get('type', '')}: {err.get('message', '')}"[:200])
            continue
        shown = SUMMARY_METRICS.get(suite)
        for name, m in (rec.get("metrics") or {}).items():
            if shown is not None and name not in shown:
                continue
            col = f"{suite}/{name}"
            row["_vals"].setdefault(col, []).append(m["value"])
    out = []
    for row in rows.values():
        vals = row.pop("_vals")
        fails = row.pop("_fail")
        for col, v in vals.items():
            row[col] = sum(v) / len(v)
            row["n_seeds"] = max(row.get("n_seeds", 0), len(v))
        row["notes"] = "; ".join(fails)
        out.append(row)
    df = pd.DataFrame(out)
    if not df.empty:
        metric_cols = sorted(c for c in df.columns if "/" in c)
        front = ["model", "method", "W", "A", "KV", "exec path"]
        rest = [c for c in df.columns if c not in front + metric_cols]
        df = df[front + metric_cols + rest]
    return df


def render_markdown(df: pd.DataFrame) -> str:
    """A Markdown table (no external dependency)."""
    if df.empty:
        return "_no records_\n"
    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for _, row in df.iterrows():
        cells = []
        for c in cols:
            v = row[c]
            if isinstance(v, float):
                cells.append(_fmt(v))
            elif v is None or (not isinstance(v, str) and pd.isna(v)):
                cells.append("")
            else:
                cells.append(str(v).replace("|", "\\|"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_tables(results_dir: str | Path, out_path: str | Path | None = None) -> Path:
    """Write ``report.md``, ``summary.csv``, ``summary.tex`` and ``records_long.csv`` next to the records."""
    results_dir = Path(results_dir)
    records = load_records(results_dir)
    df = summary_table(records)
    caveats = sorted({r["model"].get("caveat") for r in records if r["model"].get("caveat")})
    out_path = Path(out_path) if out_path else results_dir / "report.md"
    parts = [f"# MosaicQuant results: {results_dir}\n", f"{len(records)} records.\n"]
    corpora = sorted({r.get("corpus") for r in records if r.get("corpus")})
    if corpora:
        parts.append(f"Perplexity corpus: {', '.join(corpora)}.\n")
    for c in caveats:
        parts.append(f"> Caveat: {c}\n")
    parts.append("## Summary\n")
    parts.append(render_markdown(df))
    from mosaicquant.reports.plots import plot_budget_curves

    fig = plot_budget_curves(records, results_dir / "budget_curves.png")
    if fig is not None:
        parts.append("## Distortion recovered against residual budget\n")
        parts.append(f"![budget curves]({fig.name})\n")
    out_path.write_text("\n".join(parts))
    df.to_csv(results_dir / "summary.csv", index=False)
    records_frame(records).to_csv(results_dir / "records_long.csv", index=False)
    if not df.empty:
        (results_dir / "summary.tex").write_text(df.to_latex(index=False, float_format="%.3g", na_rep=""))
    return out_path
