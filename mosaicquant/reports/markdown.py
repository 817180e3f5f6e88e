"""Markdown tables from data frames (no external dependency)."""

from __future__ import annotations

import pandas as pd

from mosaicquant.reports.cells import format_number

__all__ = ["render_markdown"]


def _fmt(value: float) -> str:
    if value is None or pd.isna(value):
        return ""
    return format_number(float(value))


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
