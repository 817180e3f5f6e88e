"""Figures from result records (matplotlib, headless).

- :func:`plot_budget_curves`: fraction of output distortion recovered against residual
  budget, one line per selection score / allocation, one panel per analysis config
  (reads ``analysis`` records: ``recovered/<score>/<budget>`` and
  ``recovered_global/<score>/<budget>``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["budget_curves", "plot_budget_curves"]


def budget_curves(record: dict[str, Any]) -> dict[str, list[tuple[float, float]]]:
    """``{series: [(budget, recovered), ...]}`` from one analysis record, sorted by budget."""
    series: dict[str, list[tuple[float, float]]] = {}
    for name, m in (record.get("metrics") or {}).items():
        parts = name.split("/")
        if len(parts) != 3 or parts[0] not in ("recovered", "recovered_global"):
            continue
        label = parts[1] + (" (across layers)" if parts[0] == "recovered_global" else "")
        series.setdefault(label, []).append((float(parts[2]), float(m["value"])))
    return {k: sorted(v) for k, v in sorted(series.items())}


def plot_budget_curves(records: list[dict[str, Any]], out_path: str | Path) -> Path | None:
    """One panel per analysis record; returns the PNG path, or None without analysis records."""
    recs = [r for r in records if r.get("suite", {}).get("name") == "analysis" and r.get("status") == "ok"]
    if not recs:
        return None
    fig, axes = plt.subplots(1, len(recs), figsize=(5.5 * len(recs), 4.2), squeeze=False)
    for ax, rec in zip(axes[0], recs):
        for label, pts in budget_curves(rec).items():
            xs, ys = zip(*pts)
            style = "--" if "across" in label else ("-" if not label.startswith("channel") else ":")
            ax.plot([100 * x for x in xs], [100 * y for y in ys], style, marker="o", ms=3, label=label)
        cfg = rec["suite"]["config"]
        ax.set_title(f"{rec['model']['name']}: {cfg.get('transform')} + {cfg.get('base')} base, "
                     f"block {cfg.get('block')}", fontsize=9)
        ax.set_xlabel("residual budget (% of blocks / stored elements)")
        ax.set_ylabel("output distortion recovered (%, held-out)")
        ax.axhline(50, color="grey", lw=0.5)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out_path = Path(out_path)
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return out_path
