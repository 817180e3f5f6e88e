"""The equal-bits view of a results directory: accuracy against effective bits.

Every record carries the effective bits of its quantized model (``bits/weight``,
``bits/activation``, ``bits/kv``: :mod:`mosaicquant.methods.bits`), so methods can be compared at
equal cost instead of by name. From the records only, this module builds

- :func:`bits_points`: one point per (model, method label): its effective bits, its perplexity
  (the ``accuracy`` cell; where a model ran several accuracy configurations, the one most of its
  methods ran) and its zero-shot mean (the ``zeroshot`` cell: the mean of the tasks' headline
  metrics, :data:`ZERO_SHOT_HEADLINE`, over the tasks every method of that model measured);
- :func:`equal_bits_table`: each method with its nearest-cost rivals, nearest by the larger of the
  weight-bits and activation-bits gaps, both gaps shown; rivals within :data:`EQUAL_BITS_TOLERANCE`
  of a bit on both axes are marked as at equal bits (``=``);
- :func:`plot_equal_bits`: per model, perplexity against effective weight bits and against
  effective activation bits (log scale), the Pareto-optimal methods (no other method has fewer bits
  and a lower perplexity) joined, the float reference as a line and a collapsed method (W4A4 RTN's
  thousands) at the top edge;
- :func:`equal_bits_section`: the report's Markdown section with both (``mosaicquant report``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure as MplFigure

from mosaicquant.harness.results import _slug  # figure names read like record names
from mosaicquant.reports.cells import Cell, aggregate_cells, format_number
from mosaicquant.reports.plots import Figure

__all__ = ["ZERO_SHOT_HEADLINE", "EQUAL_BITS_TOLERANCE", "BitsPoint", "bits_points", "nearest_rivals",
           "bits_pareto_front", "equal_bits_table", "plot_equal_bits", "equal_bits_section"]

#: the metric of each zero-shot task that its mean takes (acc_norm where length bias makes acc misleading)
ZERO_SHOT_HEADLINE = {"piqa": "acc", "arc_easy": "acc", "arc_challenge": "acc_norm", "hellaswag": "acc_norm",
                      "winogrande": "acc", "lambada": "acc"}
#: two methods are at equal bits when both their weight and activation bits are this close
EQUAL_BITS_TOLERANCE = 0.1
#: rivals listed per method
RIVALS = 2
#: perplexities above this multiple of the unquantized reference's sit at the figure's top edge
CLIP_ABOVE_REFERENCE = 4.0
DPI = 120


@dataclass(frozen=True)
class BitsPoint:
    """One method label of one model in bits and accuracy.

    Attributes:
        model / method: the model name and the method label.
        weight / activation / kv: effective bits (``kv`` ``None`` where not recorded).
        ppl / ppl_spread: perplexity (mean over seeds) and its spread, ``None`` if not measured.
        zeroshot: zero-shot mean over ``tasks``, ``None`` if not measured.
        tasks: the zero-shot tasks the mean is over.
    """

    model: str
    method: str
    weight: float
    activation: float
    kv: float | None = None
    ppl: float | None = None
    ppl_spread: float | None = None
    zeroshot: float | None = None
    tasks: tuple[str, ...] = ()


def _bits_of(cells: list[Cell]) -> dict[str, float] | None:
    for cell in cells:
        if "bits/weight" in cell.metrics and "bits/activation" in cell.metrics:
            return {name: cell.metrics[name].value for name in ("bits/weight", "bits/activation", "bits/kv")
                    if name in cell.metrics}
    return None


def _zeroshot_tasks(cells: list[Cell]) -> tuple[str, ...]:
    """The headline tasks every zero-shot cell of these cells measured, in :data:`ZERO_SHOT_HEADLINE` order."""
    measured = [{task for task, metric in ZERO_SHOT_HEADLINE.items() if f"{task}/{metric}" in c.metrics}
                for c in cells]
    common = set.intersection(*measured) if measured else set()
    return tuple(task for task in ZERO_SHOT_HEADLINE if task in common)


def bits_points(records: list[dict[str, Any]]) -> list[BitsPoint]:
    """One :class:`BitsPoint` per (model, method label) whose records carry effective bits.

    Args:
        records: as :func:`mosaicquant.harness.results.load_records` returns them.

    Returns:
        The points in the order their methods were first seen.
    """
    cells = list(aggregate_cells(records).values())
    by_method: dict[tuple[str, str], list[Cell]] = {}
    for cell in cells:
        if cell.backend is None:
            by_method.setdefault((cell.model, cell.method), []).append(cell)
    points = []
    for model in dict.fromkeys(m for m, _ in by_method):
        accuracy = [c for c in cells if c.model == model and c.suite_name == "accuracy" and "ppl" in c.metrics]
        labels = [c.suite for c in accuracy]
        label = max(dict.fromkeys(labels), key=labels.count) if labels else None
        zeroshot = [c for c in cells if c.model == model and c.suite_name == "zeroshot" and c.metrics]
        tasks = _zeroshot_tasks(zeroshot)
        for (m, method), group in by_method.items():
            if m != model or (bits := _bits_of(group)) is None:
                continue
            ppl = next((c.metrics["ppl"] for c in accuracy if c.method == method and c.suite == label), None)
            zs = next((c for c in zeroshot if c.method == method), None)
            mean = (sum(zs.metrics[f"{t}/{ZERO_SHOT_HEADLINE[t]}"].value for t in tasks) / len(tasks)
                    if zs is not None and tasks else None)
            points.append(BitsPoint(model, method, bits["bits/weight"], bits["bits/activation"], bits.get("bits/kv"),
                                    None if ppl is None else ppl.value, None if ppl is None else ppl.spread,
                                    mean, tasks if mean is not None else ()))
    return points


def _gap(a: BitsPoint, b: BitsPoint) -> float:
    return max(abs(a.weight - b.weight), abs(a.activation - b.activation))


def nearest_rivals(point: BitsPoint, points: list[BitsPoint], count: int = RIVALS) -> list[BitsPoint]:
    """The ``count`` other methods of ``point``'s model nearest in cost (the larger of the weight and
    activation gaps; ties by the smaller sum of gaps, then by label).

    Example:
        >>> a, b, c = BitsPoint("m", "a", 4.0, 4.0), BitsPoint("m", "b", 4.5, 4.0), BitsPoint("m", "c", 4.1, 4.9)
        >>> [p.method for p in nearest_rivals(a, [a, b, c], 1)]
        ['b']
    """
    others = [p for p in points if p.model == point.model and p.method != point.method]
    return sorted(others, key=lambda p: (_gap(point, p), abs(point.weight - p.weight)
                                         + abs(point.activation - p.activation), p.method))[:count]


def bits_pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points ``(bits, perplexity)`` that no other point beats on both (fewer bits and lower
    perplexity), fewest bits first.

    Example:
        >>> bits_pareto_front([(4.0, 30.0), (4.5, 20.0), (4.2, 40.0), (16.0, 14.0)])
        [(4.0, 30.0), (4.5, 20.0), (16.0, 14.0)]
    """
    front, best = [], math.inf
    for x, y in sorted(points, key=lambda p: (p[0], p[1])):
        if y < best:
            front.append((x, y))
            best = y
    return front


def _bits_text(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def _signed(value: float) -> str:
    return "0.00" if abs(value) < 0.005 else f"{value:+.2f}"


def _rival_text(point: BitsPoint, rival: BitsPoint) -> str:
    equal = "= " if _gap(point, rival) <= EQUAL_BITS_TOLERANCE + 1e-9 else ""
    accuracy = [f"ppl {format_number(rival.ppl)}" if rival.ppl is not None else "",
                f"0-shot {rival.zeroshot:.3f}" if rival.zeroshot is not None else ""]
    shown = ", ".join(a for a in accuracy if a)
    return (f"{equal}`{rival.method}` (W {_signed(rival.weight - point.weight)}, "
            f"A {_signed(rival.activation - point.activation)}){': ' + shown if shown else ''}")


def equal_bits_table(points: list[BitsPoint]) -> pd.DataFrame:
    """One row per point, fewest weight bits first within a model: bits, accuracy and nearest rivals.

    Columns: model, method, ``W bits``, ``A bits``, ``KV bits``, ``ppl``, ``zero-shot`` (when any
    point has one), ``nearest rivals`` (their bit gaps relative to the row; ``=`` marks a rival
    within :data:`EQUAL_BITS_TOLERANCE` on both axes; then its accuracy).
    """
    rows = []
    with_zeroshot = any(p.zeroshot is not None for p in points)
    for p in sorted(points, key=lambda q: (q.model, q.weight, q.activation, q.method)):
        row = {"model": p.model, "method": p.method, "W bits": _bits_text(p.weight),
               "A bits": _bits_text(p.activation), "KV bits": _bits_text(p.kv),
               "ppl": "" if p.ppl is None else format_number(p.ppl)}
        if with_zeroshot:
            row["zero-shot"] = "" if p.zeroshot is None else f"{p.zeroshot:.3f}"
        row["nearest rivals"] = "; ".join(_rival_text(p, r) for r in nearest_rivals(p, points))
        rows.append(row)
    return pd.DataFrame(rows)


#: markers cycled with the colours, so that up to 40 methods stay apart in the legend
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*")


def plot_equal_bits(points: list[BitsPoint], out_dir: str | Path) -> list[Figure]:
    """Per model with two or more quantized perplexities: perplexity against weight bits and against
    activation bits, one colour and marker per method (the legend names them).

    Unquantized methods (16 bits on both axes) are a dashed reference line, not a point, so the
    axis spans the quantized methods. A perplexity above ``CLIP_ABOVE_REFERENCE`` times the
    reference's (a collapsed method) is drawn at the top edge as an open marker, its value in the
    legend.

    Returns:
        The figures written (``equal_bits__<model>.png``), with their captions.
    """
    out = []
    for model in dict.fromkeys(p.model for p in points):
        mine = [p for p in points if p.model == model and p.ppl is not None and math.isfinite(p.ppl) and p.ppl > 0]
        floats = [p for p in mine if p.weight >= 16 and p.activation >= 16]
        quantized = [p for p in mine if p not in floats]
        if len(quantized) < 2:
            continue
        reference = min((p.ppl for p in floats), default=None)
        ppls = sorted(p.ppl for p in quantized)
        top = ppls[-1] if reference is None else min(ppls[-1], CLIP_ABOVE_REFERENCE * reference)
        fig = MplFigure(figsize=(13, 5.5))
        FigureCanvasAgg(fig)
        axes = fig.subplots(1, 2, squeeze=False)[0]
        colours = [f"C{i % 10}" for i in range(len(quantized))]
        for ax, axis in ((axes[0], "weight"), (axes[1], "activation")):
            for i, (p, colour) in enumerate(zip(quantized, colours)):
                clipped = p.ppl > top * (1 + 1e-9)
                label = p.method + (f" (ppl {format_number(p.ppl)}, off the scale)" if clipped else "")
                ax.scatter([getattr(p, axis)], [min(p.ppl, top)], s=36, zorder=3, label=label,
                           marker=_MARKERS[(i // 10) % len(_MARKERS)],
                           facecolors="none" if clipped else colour, edgecolors=colour)
            front = bits_pareto_front([(getattr(p, axis), p.ppl) for p in quantized])
            ax.plot([x for x, _ in front], [min(y, top) for _, y in front], "-", color="grey", lw=1, zorder=2,
                    label="Pareto front (fewer bits, lower perplexity)")
            if reference is not None:
                ax.axhline(reference, color="black", ls="--", lw=0.8,
                           label=f"{', '.join(p.method for p in floats)} (16 bits): ppl {format_number(reference)}")
            ax.set_yscale("log")
            ax.set_xlabel(f"effective {axis} bits (bits/{axis})")
            ax.set_ylabel(f"perplexity ({model})")
            ax.grid(alpha=0.3, which="both")
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="center right", fontsize=7, frameon=False)
        fig.tight_layout(rect=(0, 0, 0.74, 1))
        path = Path(out_dir) / f"equal_bits__{_slug(model)}.png"
        fig.savefig(path, dpi=DPI)
        out.append(Figure(path, f"Perplexity on {model} against effective weight bits (left) and effective "
                                "activation bits (right), from the records' bits/* metrics; the grey line joins "
                                "the Pareto-optimal methods."))
    return out


def equal_bits_section(records: list[dict[str, Any]], out_dir: str | Path) -> list[str]:
    """The report's ``## Equal bits`` section (Markdown lines; figures written into ``out_dir``), or
    ``[]`` when no record carries effective bits.

    Raises:
        OSError: a figure cannot be written.
    """
    points = bits_points(records)
    if not points:
        return []
    parts = ["## Equal bits\n",
             "Effective bits per weight (values, scales, zero points, residual values and indices, high-precision "
             "shares), per activation element (outlier channels at their own width) and per KV-cache element "
             "(scales included), counted from each quantized model's stored format (`bits/*` in the records). "
             f"Rivals are the other methods nearest in cost (the larger of the two gaps); `=` marks a rival within "
             f"{EQUAL_BITS_TOLERANCE} bit per weight and per activation.\n"]
    table = equal_bits_table(points)
    from mosaicquant.reports.markdown import render_markdown

    parts.append(render_markdown(table))
    tasks = sorted({t for p in points for t in p.tasks}, key=list(ZERO_SHOT_HEADLINE).index)
    if tasks:
        parts.append("Zero-shot: the mean of " + ", ".join(f"{t} {ZERO_SHOT_HEADLINE[t]}" for t in tasks) + ".\n")
    for fig in plot_equal_bits(points, out_dir):
        parts.append(f"![{fig.path.stem}]({fig.path.name})\n")
        parts.append(f"*{fig.caption}*\n")
    return parts
