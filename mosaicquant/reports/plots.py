"""Figures from result records (matplotlib's Agg canvas, no display), each drawn only when the records hold its data.

- :func:`plot_pareto`: perplexity against decode speed-up vs fp16, one point per method
  label, the Pareto-optimal methods joined. Accuracy usually comes from a real small model
  and speed from random-weight model shapes, so there is one figure per (accuracy model,
  speed model) pair of the results directory; a method is a point when it has an ``ok``
  ``ppl`` on the accuracy model and ``ok`` decode throughput on the speed model. The
  speed-up is the geometric mean, over the batch sizes both it and fp16 measured, of
  ``decode_tok_s/b{B}`` / fp16's. Axis labels name both models.
- :func:`plot_decode_throughput`: decode tokens/s against batch size, one solid line per method
  (``throughput`` records: ``decode_tok_s/b{B}``, spreads as error bars), and beside it, dashed in
  the method's colour, the tokens/s of its byte floor: ``B`` over the time its recorded step bytes
  (``decode_bytes/b{B}``) take at the copy bandwidth measured in the same run
  (``method_info.speed.ceilings``). A method whose record holds no floor (a record written before
  the floor was, or without ceilings) has no dashed line, and the caption names it.
- :func:`plot_speedup_vs_m`: linear-layer speed-up vs fp16 against M (tokens), one panel
  per layer, one line per method (``latency`` records: ``linear_us/{layer}/m{M}``).
- :func:`plot_accuracy`: perplexity per method (with its spread as an error bar), beside the
  weight bytes vs BF16 of the same methods where the ``memory`` suite ran on that model.
- :func:`plot_memory`: weight bytes of the quantized linears per method, stacked by part
  (``memory`` records), and peak device memory where it was measured.
- :func:`plot_budget_sweep`: MosaicQuant's Δ-budget sweep — perplexity, decode speed-up and
  weight memory against the residual budget. A sweep is a set of ``mosaicquant`` cells
  whose method configs differ only in ``budget`` (read from the config), two budgets or more.
- :func:`plot_budget_curves`: fraction of output distortion recovered against residual
  budget, per selection score / allocation, one panel per analysis config
  (``analysis`` records: ``recovered/<score>/<budget>`` and ``recovered_global/<score>/<budget>``).

Speed-ups need the ``fp16`` cell of the same model and suite label; without one a figure is
not drawn and :func:`draw_figures` returns a note saying so.

Every figure is written three times, for print and for the web: PNG at :data:`DPI` dots per
inch (the report embeds it), PDF and SVG (vector, for a paper), named alike. Legends list only
what is drawn and sit where they cover no data (outside the axes for bar charts, matplotlib's
``best`` spot otherwise); spreads are drawn as error bars where the records hold them.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure as MplFigure

from mosaicquant.harness.results import _slug  # figure names read like record names
from mosaicquant.reports.cells import FP16_LABEL, Cell, MetricSummary, aggregate_cells
from mosaicquant.reports.speed import decode_floor_tok_s, decode_points, fp16_cell, linear_points, runtime_of, \
    same_runtime, speedup, suite_groups

__all__ = [
    "Figure",
    "draw_figures",
    "plot_pareto",
    "plot_decode_throughput",
    "draw_decode_throughput",
    "plot_speedup_vs_m",
    "plot_memory",
    "plot_accuracy",
    "plot_budget_sweep",
    "budget_curves",
    "plot_budget_curves",
    "decode_speedup",
    "pareto_front",
    "budget_sweeps",
]

#: parts of the quantized linears' weight bytes, bottom to top of the stacked bars
MEMORY_PARTS = ("base_values", "base_scales", "residual_values", "residual_scales", "residual_indices", "exec_operands")
MIB = 2**20
#: resolution of the PNG files (print quality); PDF and SVG are vector
DPI = 300
#: the formats each figure is written in, the first one embedded in the report
FORMATS = ("png", "pdf", "svg")


@dataclass(frozen=True)
class Figure:
    """A figure written next to the report (``path`` the PNG; the PDF and SVG beside it) and its caption."""

    path: Path
    caption: str

    @property
    def paths(self) -> list[Path]:
        """The figure's files, one per format of :data:`FORMATS`."""
        return [self.path.with_suffix(f".{fmt}") for fmt in FORMATS]


def _model_names(cells: list[Cell]) -> dict[str, str]:
    """File-name part of each model: the slug of its last path part (``org/X`` -> ``X``), with a short hash
    of the full name where two models would share it (``/a/run1/model`` and ``/a/run2/model``), so that
    no figure overwrites another's."""
    slugs = {c.model: _slug(Path(c.model).name or c.model) for c in cells}
    taken: dict[str, int] = {}
    for slug in slugs.values():
        taken[slug] = taken.get(slug, 0) + 1
    return {model: slug if taken[slug] == 1 else f"{slug}-{hashlib.sha256(model.encode()).hexdigest()[:6]}"
            for model, slug in slugs.items()}


def _name(names: dict[str, str], model: str, suite_label: str, suite_name: str) -> str:
    """File-name part of a (model, suite label): the suite label only when it has options."""
    return names[model] + ("" if suite_label == suite_name else f"_{_slug(suite_label)}")


def _new_figure(nrows: int, ncols: int, figsize: tuple[float, float], **kwargs):
    """A figure on its own Agg canvas (no pyplot, no global backend switch) and its axes grid."""
    fig = MplFigure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, squeeze=False, **kwargs)


def _save(fig, path: Path) -> Path:
    """Write ``fig`` as PNG (at :data:`DPI`), PDF and SVG next to ``path``; returns the PNG's path.

    The bounding box is the drawn content's, so a legend placed outside the axes is kept whole.
    """
    fig.tight_layout()
    path = path.with_suffix(".png")
    for fmt in FORMATS:
        fig.savefig(path.with_suffix(f".{fmt}"), dpi=DPI, bbox_inches="tight", metadata=_METADATA.get(fmt))
    return path


# no creation date in the vector files, so an unchanged report rewrites them byte for byte
_METADATA = {"pdf": {"CreationDate": None}, "svg": {"Date": None}}


def _ratio_spread(value: MetricSummary | None, ref: MetricSummary | None, ratio: float | None) -> float:
    """The spread of ``ratio = f(value, ref)`` by first-order propagation of the two relative spreads (0 if none)."""
    if ratio is None or value is None or ref is None:
        return 0.0
    rel = [(m.spread or 0.0) / m.value for m in (value, ref) if m.value and math.isfinite(m.value)
           and m.spread is not None and math.isfinite(m.spread)]
    return ratio * math.sqrt(sum(r * r for r in rel)) if rel else 0.0


def decode_speedup(cell: Cell, ref: Cell) -> tuple[float, list[int]] | None:
    """Geometric mean over shared batch sizes of the decode speed-up vs ``ref``, and those batches.

    ``None`` without shared batches, or when the two ran on different decoder runtimes.
    """
    if not same_runtime(cell, ref):
        return None
    mine, theirs = decode_points(cell), decode_points(ref)
    ratios = {b: speedup(mine[b], theirs[b]) for b in mine.keys() & theirs.keys()}
    ratios = {b: r for b, r in ratios.items() if r is not None}
    if not ratios:
        return None
    return math.exp(sum(math.log(r) for r in ratios.values()) / len(ratios)), sorted(ratios)


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points ``(speed-up, perplexity)`` no other point beats on both, fastest first.

    Example:
        >>> pareto_front([(1.0, 10.0), (2.0, 12.0), (1.5, 13.0), (2.5, 30.0)])
        [(2.5, 30.0), (2.0, 12.0), (1.0, 10.0)]
    """
    front, best = [], math.inf
    for x, y in sorted(points, key=lambda p: (-p[0], p[1])):
        if y < best:
            front.append((x, y))
            best = y
    return front


def _ppl_groups(cells: list[Cell]) -> dict[tuple[str, str], dict[str, float]]:
    """``{(model, accuracy suite label): {method label: ppl}}`` of the accuracy cells with a ppl (may be inf)."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    for c in cells:
        if c.suite_name == "accuracy" and "ppl" in c.metrics:
            out.setdefault((c.model, c.suite), {})[c.method] = c.metrics["ppl"].value
    return out


def _batches_text(batches: set[int]) -> str:
    return ", ".join(str(b) for b in sorted(batches))


# Label offsets tried in turn (points; text anchored left/right of the point), so that labels
# of nearby points do not overlap.
_LABEL_SPOTS = ((4, 4, "left"), (4, -11, "left"), (-4, 4, "right"), (-4, -11, "right"), (4, 14, "left"),
                (4, -21, "left"))


def _label_points(ax, points: list[tuple[str, float, float]], fontsize: float = 7.0) -> list[tuple[float, float]]:
    """Annotate each ``(label, x, y)`` at the first offset whose text box overlaps no earlier label and no marker.

    Boxes are estimated in display points (``0.6 * fontsize`` per character, ``fontsize`` high)
    after the axes' scales and limits are set; where every offset collides the first is used.

    Returns:
        The offsets chosen, in the order of ``points``.
    """
    ax.figure.canvas.draw()  # fixes the limits, so data → display positions are final
    to_pts = 72.0 / ax.figure.dpi
    at = [tuple(v * to_pts for v in ax.transData.transform((x, y))) for _, x, y in points]
    # the markers are obstacles too: a label never covers another point
    placed: list[tuple[float, float, float, float]] = [(px - 4, py - 4, px + 4, py + 4) for px, py in at]
    chosen = []
    for (label, x, y), (px, py) in zip(points, at):
        width, height = 0.6 * fontsize * len(label), fontsize
        pick = None
        for dx, dy, ha in _LABEL_SPOTS:
            x0 = px + dx if ha == "left" else px + dx - width
            box = (x0, py + dy, x0 + width, py + dy + height)
            if not any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in placed):
                pick = (dx, dy, ha, box)
                break
        if pick is None:
            dx, dy, ha = _LABEL_SPOTS[0]
            pick = (dx, dy, ha, (px + dx, py + dy, px + dx + width, py + dy + height))
        dx, dy, ha, box = pick
        placed.append(box)
        chosen.append((dx, dy))
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(dx, dy), fontsize=fontsize, ha=ha)
    return chosen


def plot_pareto(cells: list[Cell], out_dir: str | Path) -> tuple[list[Figure], list[str]]:
    """Perplexity against decode speed-up, one figure per (accuracy model, speed model) pair.

    Returns:
        The figures drawn and notes on what could not be drawn (no fp16 throughput row).
    """
    out_dir = Path(out_dir)
    figures, notes = [], []
    names = _model_names(cells)
    accuracy = _ppl_groups(cells)
    if not accuracy:
        return figures, notes
    for (speed_model, speed_suite), group in suite_groups(cells, "throughput").items():
        if not any(decode_points(c) for c in group):
            continue
        ref = fp16_cell(group)
        if ref is None or not decode_points(ref):
            notes.append(f"No `{FP16_LABEL}` throughput row for {speed_model} ({speed_suite}): "
                         "no decode speed-ups, so no accuracy-speed Pareto figure.")
            continue
        speed = {c.method: s for c in group if (s := decode_speedup(c, ref)) is not None}
        for (acc_model, acc_suite), ppl in accuracy.items():
            points = [(label, speed[label][0], ppl[label]) for label in ppl
                      if label in speed and math.isfinite(ppl[label])]
            left_out = [f"{label} ({'no decode speed' if label not in speed else 'perplexity inf'})"
                        for label in ppl if label not in speed or not math.isfinite(ppl[label])]
            if len(points) < 2:
                if len(ppl) >= 2 and len(speed) >= 2:
                    notes.append(f"Perplexity on {acc_model} and decode speed on {speed_model} share fewer than "
                                 "two method labels: no accuracy-speed Pareto figure for this pair.")
                continue
            batches = set().union(*(set(speed[label][1]) for label, _, _ in points))
            fig, axes = _new_figure(1, 1, (6.4, 4.6))
            ax = axes[0][0]
            for label, x, y in points:
                ax.scatter([x], [y], s=28, zorder=3, color="black" if label == FP16_LABEL else None)
            front = pareto_front([(x, y) for _, x, y in points])
            if len(front) >= 2:  # one optimal point draws no line: then the legend has nothing to name
                xs, ys = zip(*front)
                ax.step(xs, ys, where="post", color="grey", lw=1, alpha=0.7, label="Pareto front")
            values = [y for _, _, y in points]
            # a log axis needs positive values: a zero perplexity (a broken record) keeps it linear
            if min(values) > 0 and max(values) / min(values) > 10:
                ax.set_yscale("log")
            _label_points(ax, [(label, x, y) for label, x, y in points])
            ax.axvline(1.0, color="grey", lw=0.5, ls=":")
            ax.set_xlabel(f"decode speed-up vs fp16 on {speed_model} ({speed_suite}; "
                          f"geometric mean over batch {_batches_text(batches)})", fontsize=8)
            ax.set_ylabel(f"perplexity on {acc_model} ({acc_suite}), lower is better", fontsize=8)
            ax.grid(alpha=0.3)
            if len(front) >= 2:
                ax.legend(fontsize=7, loc="best")
            path = _save(fig, out_dir / f"pareto__{_name(names, acc_model, acc_suite, 'accuracy')}__"
                                        f"{_name(names, speed_model, speed_suite, 'throughput')}.png")
            caption = (f"Accuracy against decode speed: perplexity on {acc_model}, decode speed-up vs fp16 on "
                       f"{speed_model}" + ("; the grey line joins the Pareto-optimal methods." if len(front) >= 2
                                           else f"; {len(front)} Pareto-optimal method, so no front is drawn."))
            if left_out:
                caption += f" Not drawn: {', '.join(left_out)}."
            figures.append(Figure(path, caption))
    return figures, notes


#: line style of a method's byte floor in the decode-throughput figure (its measured line is solid)
FLOOR_STYLE = "--"


def draw_decode_throughput(ax, rows: list[Cell]) -> tuple[list[str], list[str]]:
    """Draw each cell's decode tok/s against batch on ``ax`` (solid, error bars from the spreads) and,
    dashed in the same colour with ``gid`` ``floor:<method>``, its byte floor where recorded.

    Only finite positive values are drawn (the axis is logarithmic).

    Returns:
        The methods drawn with a floor line, and those drawn without one.
    """
    # a record that does not say its runtime is no different one (as in the tables)
    runtimes = {runtime_of(c) for c in rows} - {None}
    with_floor, without_floor = [], []
    for cell in rows:
        pts = {b: v for b, v in decode_points(cell).items() if math.isfinite(v.value) and v.value > 0}
        if not pts:
            continue
        label = cell.method + (f" ({runtime_of(cell)})" if len(runtimes) > 1 and runtime_of(cell) else "")
        errs = [v.spread if v.spread is not None and math.isfinite(v.spread) else 0.0 for v in pts.values()]
        drawn = ax.errorbar(list(pts), [v.value for v in pts.values()], yerr=errs if any(errs) else None,
                            marker="o", ms=3, capsize=2, lw=1.2, label=label,
                            color="black" if cell.method == FP16_LABEL else None)
        floor = decode_floor_tok_s(cell)
        if floor:
            ax.plot(list(floor), list(floor.values()), FLOOR_STYLE, lw=1, color=drawn.lines[0].get_color(),
                    gid=f"floor:{cell.method}")
            with_floor.append(cell.method)
        else:
            without_floor.append(cell.method)
    if with_floor:  # one legend entry for every dashed line: they share a meaning, not a method
        ax.plot([], [], FLOOR_STYLE, lw=1, color="grey", label="byte floor (dashed, the method's colour)")
    return with_floor, without_floor


def plot_decode_throughput(cells: list[Cell], out_dir: str | Path) -> list[Figure]:
    """Per throughput group: decode tok/s against batch, one line per method, its byte floor dashed beside it.

    Tokens/s need no fp16 row, so the figure is drawn for every group with decode numbers. The
    floor line of a method (:func:`mosaicquant.reports.speed.decode_floor_tok_s`) is an upper bound
    on its tokens/s: the gap between the two lines is what the step loses to anything but its bytes.
    Where the methods ran on different decoder runtimes, each label names its runtime.
    """
    out_dir = Path(out_dir)
    figures = []
    names = _model_names(cells)
    for (model, suite), group in suite_groups(cells, "throughput").items():
        rows = [c for c in group if decode_points(c)]
        if not rows:
            continue
        fig, axes = _new_figure(1, 1, (6.4, 4.6))
        ax = axes[0][0]
        with_floor, without_floor = draw_decode_throughput(ax, rows)
        if not with_floor and not without_floor:  # no finite positive tok/s to draw
            continue
        ax.set_xscale("log", base=2)
        batches = sorted({b for c in rows for b in decode_points(c)})
        ax.set_xticks(batches, [str(b) for b in batches])  # batch sizes as numbers, not powers of two
        ax.set_yscale("log")
        ax.set_xlabel("decode batch size (sequences)")
        ax.set_ylabel(f"decode tokens/s on {model}, higher is better", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
        path = _save(fig, out_dir / f"decode_throughput__{_name(names, model, suite, 'throughput')}.png")
        caption = f"Decode tokens/s against batch size on {model} ({suite})"
        if with_floor:
            caption += ("; dashed: each method's byte floor, the tokens/s if its step's bytes streamed at the copy "
                        "bandwidth measured in the same run")
        caption += "."
        if without_floor:
            caption += f" No byte floor recorded for: {', '.join(without_floor)}."
        figures.append(Figure(path, caption))
    return figures


def plot_speedup_vs_m(cells: list[Cell], out_dir: str | Path) -> tuple[list[Figure], list[str]]:
    """Per latency group: one panel per linear layer, speed-up vs fp16 against M, one line per method."""
    out_dir = Path(out_dir)
    figures, notes = [], []
    names = _model_names(cells)
    for (model, suite), group in suite_groups(cells, "latency").items():
        methods = [c for c in group if c.method != FP16_LABEL and linear_points(c)]
        if not methods:
            continue
        ref = fp16_cell(group)
        ref_pts = linear_points(ref) if ref else {}
        if not ref_pts:
            notes.append(f"No `{FP16_LABEL}` latency row for {model} ({suite}): no per-layer speed-up figure.")
            continue
        layers = list(ref_pts)
        fig, axes = _new_figure(1, len(layers), (4.2 * len(layers), 3.8), sharey=True)
        for ax, layer in zip(axes[0], layers):
            for cell in methods:
                pts = linear_points(cell).get(layer, {})
                xy = [(m, r, _ratio_spread(v, ref_pts[layer].get(m), r)) for m, v in pts.items()
                      if (r := speedup(v, ref_pts[layer].get(m))) is not None]
                if xy:
                    xs, ys, errs = zip(*xy)
                    ax.errorbar(xs, ys, yerr=errs if any(errs) else None, marker="o", ms=3, capsize=2, lw=1,
                                label=cell.method)
            ax.axhline(1.0, color="black", lw=0.8, ls="--", label=FP16_LABEL)
            ax.set_xscale("log", base=2)
            ax.set_title(layer, fontsize=9)
            ax.set_xlabel("M (tokens)")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel(f"speed-up vs fp16 on {model}")
        axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
        path = _save(fig, out_dir / f"speedup_vs_m__{_name(names, model, suite, 'latency')}.png")
        figures.append(Figure(path, f"Linear-layer speed-up vs fp16 against the number of tokens M, per layer, "
                                    f"on {model} (above 1 is faster; error bars: the spread of the ratio from "
                                    "the recorded spreads)."))
    return figures, notes


def plot_memory(cells: list[Cell], out_dir: str | Path) -> list[Figure]:
    """Per memory group: stacked weight bytes by part per method, and peak device memory if measured."""
    out_dir = Path(out_dir)
    figures = []
    names = _model_names(cells)
    for (model, suite), group in suite_groups(cells, "memory").items():
        rows = [c for c in group if "total_quantized_linears" in c.metrics]
        if not rows:
            continue
        peaks = [c for c in rows if "peak_device_bytes" in c.metrics]
        fig, axes = _new_figure(1, 2 if peaks else 1, (11 if peaks else 6.5, 0.45 * len(rows) + 1.6))
        ax = axes[0][0]
        labels = [c.method for c in rows]
        left = [0.0] * len(rows)
        for part in MEMORY_PARTS:
            widths = [(c.metrics[part].value if part in c.metrics else 0.0) / MIB for c in rows]
            if any(widths):
                ax.barh(labels, widths, left=left, label=part.replace("_", " "))
                left = [a + b for a, b in zip(left, widths)]
        if any(left):
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
        else:  # no part recorded: the totals, one colour, and no legend to name nothing
            ax.barh(labels, [c.metrics["total_quantized_linears"].value / MIB for c in rows])
        ax.invert_yaxis()
        ax.set_xlabel(f"weight memory of the quantized linears on {model} (MiB)")
        ax.grid(axis="x", alpha=0.3)
        if peaks:
            ax2 = axes[0][1]
            ax2.barh([c.method for c in peaks], [c.metrics["peak_device_bytes"].value / MIB for c in peaks])
            ax2.invert_yaxis()
            ax2.set_xlabel("peak device memory of one forward pass (MiB)")
            ax2.grid(axis="x", alpha=0.3)
        path = _save(fig, out_dir / f"memory__{_name(names, model, suite, 'memory')}.png")
        figures.append(Figure(path, f"Weight memory per method on {model}, stacked by part"
                                    + (", and peak device memory." if peaks else ".")))
    return figures


def plot_accuracy(cells: list[Cell], out_dir: str | Path) -> list[Figure]:
    """Per accuracy group: perplexity per method (error bars where a spread exists), and beside it the
    weight bytes vs BF16 of the same methods where the model's ``memory`` suite recorded them.

    A method with an infinite or NaN perplexity (a collapsed model) has no bar; the caption names it.
    The perplexity axis is logarithmic where the values span more than a factor of 10.
    """
    out_dir = Path(out_dir)
    figures = []
    names = _model_names(cells)
    memory: dict[str, dict[str, float]] = {}
    for (model, _), group in suite_groups(cells, "memory").items():
        for c in group:
            if "linear_weight_ratio_vs_bf16" in c.metrics:
                memory.setdefault(model, {})[c.method] = c.metrics["linear_weight_ratio_vs_bf16"].value
    for (model, suite), group in suite_groups(cells, "accuracy").items():
        rows = [c for c in group if "ppl" in c.metrics and math.isfinite(c.metrics["ppl"].value)]
        left_out = [c.method for c in group if "ppl" in c.metrics and not math.isfinite(c.metrics["ppl"].value)]
        if not rows:
            continue
        ratios = memory.get(model, {})
        with_memory = [c for c in rows if c.method in ratios]
        fig, axes = _new_figure(1, 2 if with_memory else 1, (10 if with_memory else 6.0, 0.4 * len(rows) + 1.6))
        ax = axes[0][0]
        labels = [c.method for c in rows]
        values = [c.metrics["ppl"].value for c in rows]
        errs = [c.metrics["ppl"].spread or 0.0 for c in rows]
        colors = ["black" if c.method == FP16_LABEL else "tab:blue" for c in rows]
        ax.barh(labels, values, xerr=errs if any(errs) else None, color=colors, capsize=2)
        if max(values) / max(min(values), 1e-12) > 10:
            ax.set_xscale("log")
        ax.invert_yaxis()
        ax.set_xlabel(f"perplexity on {model}\n({suite}), lower is better", fontsize=8)
        ax.grid(axis="x", alpha=0.3)
        if with_memory:
            ax2 = axes[0][1]
            ax2.barh(labels, [ratios.get(c.method, 0.0) for c in rows], color="tab:orange")
            ax2.invert_yaxis()
            ax2.tick_params(labelleft=False)  # the rows are the left panel's, in its order
            for i, c in enumerate(rows):
                if c.method not in ratios:  # no bar would read as zero bytes
                    ax2.annotate("not measured", (0, i), xytext=(3, 0), textcoords="offset points", va="center",
                                 fontsize=7, color="grey")
            ax2.set_xlabel("weight bytes of the linears vs BF16\n(memory suite), lower is better", fontsize=8)
            ax2.grid(axis="x", alpha=0.3)
        path = _save(fig, out_dir / f"accuracy__{_name(names, model, suite, 'accuracy')}.png")
        caption = f"Perplexity per method on {model} ({suite}" + ("; fp16 in black)" if FP16_LABEL in labels else ")")
        caption += ", beside the linears' weight bytes vs BF16." if with_memory else "."
        if any(errs):
            caption += " Error bars: the spread over seeds."
        if left_out:
            caption += f" Not drawn (perplexity not finite): {', '.join(left_out)}."
        figures.append(Figure(path, caption))
    return figures


def _sweep_key(cell: Cell) -> str:
    rest = {k: v for k, v in cell.method_config.items() if k != "budget"}
    return json.dumps(rest, sort_keys=True, default=str)


def budget_sweeps(cells: list[Cell]) -> dict[str, str]:
    """``{sweep key: series name}`` of the MosaicQuant configs measured at two budgets or more.

    A series is named by the config options in which the sweeps differ from each other.
    """
    budgets: dict[str, set[float]] = {}
    configs: dict[str, dict[str, Any]] = {}
    for c in cells:
        if c.method_name == "mosaicquant" and c.metrics and "budget" in c.method_config:
            key = _sweep_key(c)
            budgets.setdefault(key, set()).add(float(c.method_config["budget"]))
            configs[key] = {k: v for k, v in c.method_config.items() if k != "budget"}
    keys = [k for k, b in budgets.items() if len(b) >= 2]
    differing = sorted({opt for k in keys for opt in configs[k]
                        if len({json.dumps(configs[j].get(opt), default=str) for j in keys}) > 1})
    return {k: "mosaicquant" + "".join(f":{opt}={configs[k].get(opt)}" for opt in differing) for k in keys}


def plot_budget_sweep(cells: list[Cell], out_dir: str | Path) -> Figure | None:
    """MosaicQuant's Δ-budget curve: ppl, decode speed-up and weight ratio against the budget."""
    sweeps = budget_sweeps(cells)
    if not sweeps:
        return None
    panels: list[tuple[str, dict[str, list[tuple[float, float]]], float | None]] = []
    for (model, suite), ppl in _ppl_groups(cells).items():
        series: dict[str, list[tuple[float, float]]] = {}
        for c in cells:
            finite = math.isfinite(ppl.get(c.method, math.nan))
            if (c.model, c.suite) == (model, suite) and _sweep_key(c) in sweeps and finite:
                series.setdefault(sweeps[_sweep_key(c)], []).append((float(c.method_config["budget"]), ppl[c.method]))
        if series:
            panels.append((f"perplexity on {model} ({suite})", series, ppl.get(FP16_LABEL)))
    for (model, suite), group in suite_groups(cells, "throughput").items():
        ref = fp16_cell(group)
        series = {}
        for c in group:
            if ref is not None and _sweep_key(c) in sweeps and (s := decode_speedup(c, ref)) is not None:
                series.setdefault(sweeps[_sweep_key(c)], []).append((float(c.method_config["budget"]), s[0]))
        if series:
            panels.append((f"decode speed-up vs fp16 on {model}", series, 1.0))
    for (model, suite), group in suite_groups(cells, "memory").items():
        series = {}
        for c in group:
            if _sweep_key(c) in sweeps and "linear_weight_ratio_vs_bf16" in c.metrics:
                series.setdefault(sweeps[_sweep_key(c)], []).append(
                    (float(c.method_config["budget"]), c.metrics["linear_weight_ratio_vs_bf16"].value))
        if series:
            panels.append((f"weight bytes / BF16 on {model}", series, None))
    panels = [p for p in panels if any(len(pts) >= 2 for pts in p[1].values())]
    if not panels:
        return None
    fig, axes = _new_figure(1, len(panels), (4.6 * len(panels), 3.8))
    for ax, (ylabel, series, reference) in zip(axes[0], panels):
        for name, pts in sorted(series.items()):
            xs, ys = zip(*sorted(pts))
            ax.plot([100 * x for x in xs], ys, marker="o", ms=3, label=name)
        if reference is not None:
            ax.axhline(reference, color="black", lw=0.8, ls="--", label=FP16_LABEL)
        ax.set_xlabel("residual budget (% of blocks)")
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    path = _save(fig, Path(out_dir) / "budget_sweep.png")
    return Figure(path, "MosaicQuant's Δ-budget sweep: " + ", ".join(p[0] for p in panels)
                  + " against the residual budget.")


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
    fig, axes = _new_figure(1, len(recs), (5.5 * len(recs), 4.2))
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
        ax.legend(fontsize=7, loc="best")
    return _save(fig, Path(out_path))


def draw_figures(records: list[dict[str, Any]], out_dir: str | Path) -> tuple[list[Figure], list[str]]:
    """Every figure the records hold data for, written as PNG, PDF and SVG files into ``out_dir``.

    Args:
        records: as :func:`mosaicquant.harness.results.load_records` returns them.
        out_dir: the folder of the report (figures are linked by file name).

    Returns:
        ``(figures, notes)``: the figures with their captions, and one line per figure that
        could not be drawn although data exists (e.g. no fp16 row for speed-ups).
    """
    out_dir = Path(out_dir)
    cells = list(aggregate_cells(records).values())
    figures, notes = plot_pareto(cells, out_dir)
    figures += plot_decode_throughput(cells, out_dir)
    latency_figures, latency_notes = plot_speedup_vs_m(cells, out_dir)
    figures += latency_figures
    notes += latency_notes
    figures += plot_accuracy(cells, out_dir)
    figures += plot_memory(cells, out_dir)
    sweep = plot_budget_sweep(cells, out_dir)
    if sweep is not None:
        figures.append(sweep)
    curves = plot_budget_curves(records, out_dir / "budget_curves.png")
    if curves is not None:
        figures.append(Figure(curves, "Output distortion recovered against residual budget, per selection score "
                                      "(analysis suite, held-out calibration tokens)."))
    return figures, notes
