"""Speed results from cells: decode throughput per batch, linear-layer latency per M, speed-ups.

Metric names read here (written by the ``throughput`` and ``latency`` suites):

- ``throughput``: ``prefill_tok_s``, ``decode_tok_s/b{B}`` (tok/s, higher is better);
  ``decode_floor_frac/b{B}`` and ``prefill_floor_frac`` (the step's byte / flop floor over its
  measured time, :mod:`mosaicquant.harness.floor`), with the card's ceilings measured in the same
  run in ``method_info.speed.ceilings`` (:func:`ceilings_of`);
  with NVML, ``decode_energy_j_per_tok/b{B}`` (J/tok, lower is better) and
  ``decode_power_w/b{B}`` (mean W over the energy window).
- ``latency``: ``linear_us/{layer}/m{M}`` (µs, lower is better), ``step_ms/prefill`` and
  ``step_ms/decode_b{B}`` (ms, lower is better).

A speed-up is relative to the ``fp16`` cell of the same model and suite label (same results
directory): ``method / fp16`` for a higher-is-better metric, ``fp16 / method`` for a
lower-is-better one, so above 1 is always faster. Without an ``fp16`` cell there is no
speed-up, and the report says so.

Cells run by another engine (``mosaicquant run --backend``, e.g. ``tensorrt-llm``) record that
engine's own metrics (``output_throughput``, ``request_latency_p50_ms``, ...), measured on its
own workload: they are kept out of the groups above and shown per backend
(:func:`backend_groups`, :func:`backend_table`), with speed-ups against the same backend's
``fp16`` cell (``fp16@tensorrt-llm``).
"""

from __future__ import annotations

import math
import re
from typing import Iterable

import pandas as pd

from mosaicquant.harness.backends import backend_label
from mosaicquant.harness.floor import byte_floor_us
from mosaicquant.reports.cells import FP16_LABEL, Cell, MetricSummary, format_number, natural_key

__all__ = [
    "DECODE_RE",
    "LINEAR_RE",
    "STEP_RE",
    "suite_groups",
    "fp16_cell",
    "decode_points",
    "linear_points",
    "step_points",
    "speedup",
    "throughput_table",
    "floor_points",
    "decode_floor_tok_s",
    "form_of",
    "ceilings_of",
    "ceilings_text",
    "energy_table",
    "latency_table",
    "step_table",
    "backend_groups",
    "backend_fp16_cell",
    "backend_table",
]

DECODE_RE = re.compile(r"^decode_tok_s/b(\d+)$")
FLOOR_RE = re.compile(r"^decode_floor_frac/b(\d+)$")
BYTES_RE = re.compile(r"^decode_bytes/b(\d+)$")
PREFILL_FLOOR = "prefill_floor_frac"
ENERGY_RE = re.compile(r"^decode_energy_j_per_tok/b(\d+)$")
POWER_RE = re.compile(r"^decode_power_w/b(\d+)$")
LINEAR_RE = re.compile(r"^linear_us/([^/]+)/m(\d+)$")
STEP_RE = re.compile(r"^step_ms/(prefill|decode_b(\d+))$")
PREFILL = "prefill_tok_s"
#: linear layers in the order of a decoder block (latency tables and figures)
LAYER_ORDER = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def suite_groups(cells: Iterable[Cell], suite_name: str) -> dict[tuple[str, str], list[Cell]]:
    """``{(model, suite label): [cells]}`` of one suite run in-process, ``fp16`` first, then in record order.

    Cells run by another backend are left out (see :func:`backend_groups`).
    """
    groups: dict[tuple[str, str], list[Cell]] = {}
    for cell in cells:
        if cell.suite_name == suite_name and cell.backend is None:
            groups.setdefault((cell.model, cell.suite), []).append(cell)
    return {k: sorted(v, key=lambda c: c.method != FP16_LABEL) for k, v in groups.items()}


def fp16_cell(group: list[Cell]) -> Cell | None:
    """The ``fp16`` cell of a group, if it has one with numbers."""
    return next((c for c in group if c.method == FP16_LABEL and c.metrics), None)


def decode_points(cell: Cell) -> dict[int, MetricSummary]:
    """``{batch: decode tok/s}``, sorted by batch."""
    found = {int(m.group(1)): v for name, v in cell.metrics.items() if (m := DECODE_RE.match(name))}
    return dict(sorted(found.items()))


def floor_points(cell: Cell) -> dict[int, MetricSummary]:
    """``{batch: fraction of the decode byte floor}``, sorted by batch (empty for records without floors)."""
    found = {int(m.group(1)): v for name, v in cell.metrics.items() if (m := FLOOR_RE.match(name))}
    return dict(sorted(found.items()))


def decode_floor_tok_s(cell: Cell) -> dict[int, float]:
    """``{batch: tok/s at the decode byte floor}``: ``B`` over the time the step's recorded bytes
    (``decode_bytes/b{B}``) take at the copy bandwidth the run measured (``method_info.speed.ceilings``).

    Empty where either is not recorded (records of CPU runs, or written before the floor was).
    """
    copy = (ceilings_of(cell) or {}).get("copy_gb_s")
    if not isinstance(copy, (int, float)) or not (math.isfinite(copy) and copy > 0):
        return {}
    found = {int(m.group(1)): v.value for name, v in cell.metrics.items() if (m := BYTES_RE.match(name))}
    return {b: b / (byte_floor_us(n, copy) * 1e-6) for b, n in sorted(found.items())
            if math.isfinite(n) and n > 0}


def form_of(cell: Cell) -> str | None:
    """The form a speed cell timed (``method_info.speed.form``: ``bf16``, ``kernels``, ``torchao``,
    ``compiled``), ``None`` for records that do not say."""
    return (cell.method_info.get("speed") or {}).get("form")


def ceilings_of(cell: Cell) -> dict | None:
    """The card's copy bandwidth and tensor-core rates measured in the cell's run, ``None`` if not recorded."""
    return (cell.method_info.get("speed") or {}).get("ceilings")


def ceilings_text(group: list[Cell]) -> str | None:
    """One sentence per distinct set of ceilings in ``group`` (one card, one run: usually one), or None."""
    seen: list[dict] = []
    for cell in group:
        c = ceilings_of(cell)
        if c and c not in seen:
            seen.append(c)
    if not seen:
        return None
    texts = []
    for c in seen:
        int8 = c.get("int8_tflop_s")
        texts.append(f"{c.get('gpu', 'the GPU')}: copy {c['copy_gb_s']:,.0f} GB/s (read + write), BF16 "
                     f"{c['bf16_tflop_s']:,.0f} TFLOP/s, INT8 "
                     + (f"{int8:,.0f} TOP/s" if int8 is not None else "not measured (no int8 matrix product)"))
    return "; ".join(texts)


def _fraction_text(value: MetricSummary | None) -> str:
    if value is None or not math.isfinite(value.value):
        return ""
    return f"{100 * value.value:.0f}%"


def _layer_order(layer: str) -> tuple[int, str]:
    return (LAYER_ORDER.index(layer) if layer in LAYER_ORDER else len(LAYER_ORDER), layer)


def linear_points(cell: Cell) -> dict[str, dict[int, MetricSummary]]:
    """``{layer: {M: µs}}``, layers in the order of a decoder block (then by name), M sorted."""
    found: dict[str, dict[int, MetricSummary]] = {}
    for name, v in cell.metrics.items():
        if m := LINEAR_RE.match(name):
            found.setdefault(m.group(1), {})[int(m.group(2))] = v
    return {layer: dict(sorted(found[layer].items())) for layer in sorted(found, key=_layer_order)}


def step_points(cell: Cell) -> dict[str, MetricSummary]:
    """``{"prefill" | "decode_b{B}": ms}``, prefill first, then by batch."""
    found = {m.group(1): v for name, v in cell.metrics.items() if (m := STEP_RE.match(name))}
    return dict(sorted(found.items(), key=lambda kv: _step_order(kv[0])))


def _step_order(name: str) -> tuple[int, int]:
    return (0, 0) if name == "prefill" else (1, int(name.removeprefix("decode_b")))


def runtime_of(cell: Cell) -> str | None:
    """The decoder runtime a speed cell ran on (``fused`` / ``transformers``), ``None`` for older records."""
    return (cell.method_info.get("speed") or {}).get("runtime")


def same_runtime(cell: Cell, ref: Cell | None) -> bool:
    """Whether end-to-end numbers of ``cell`` and ``ref`` may be divided: not when their runtimes differ.

    A method the fused decoder cannot run (e.g. a KV-cache quantizer) runs transformers' eager
    code, whose steps are 2-4× slower for reasons that have nothing to do with the method.
    """
    return ref is not None and (runtime_of(cell) is None or runtime_of(ref) is None
                                or runtime_of(cell) == runtime_of(ref))


def _runtime_note(cell: Cell, ref: Cell | None) -> str | None:
    if ref is None or same_runtime(cell, ref):
        return None
    return (f"ran on the {runtime_of(cell)} runtime, the fp16 row on {runtime_of(ref)}: "
            "no end-to-end speed-up shown")


def _ratio_of(value: float, ref: float) -> float | None:
    """``value / ref`` for two finite positive numbers, else None (a NaN, an infinity or a zero has no ratio)."""
    if not (math.isfinite(value) and math.isfinite(ref) and value > 0 and ref > 0):
        return None
    return value / ref


def speedup(method: MetricSummary | None, fp16: MetricSummary | None) -> float | None:
    """How many times faster than fp16 (above 1 is faster), or None without two finite positive values.

    A NaN, infinite or zero value (a broken measurement) gives no speed-up rather than a
    ``nan×`` in a table or a point a log-scaled figure cannot draw.
    """
    if method is None or fp16 is None:
        return None
    if method.higher_is_better:
        return _ratio_of(method.value, fp16.value)
    return _ratio_of(fp16.value, method.value)


def _cell_text(value: MetricSummary | None, ratio: float | None, with_spread: bool = True) -> str:
    if value is None:
        return ""
    text = format_number(value.value)
    if with_spread and value.spread is not None and not math.isnan(value.spread):
        spread = f"{value.spread:.2g}"
        # two significant digits, but never in exponent notation (±1.6e+02 reads badly in a table)
        text += f" ±{spread if 'e' not in spread and abs(value.spread) < 1000 else format_number(value.spread)}"
    if ratio is not None:
        text += f" ({ratio:.2f}×)"
    return text


def _info_columns(cell: Cell) -> dict[str, object]:
    info = cell.method_info

    def text(field: str) -> str | None:
        return None if info.get(field) is None else str(info[field])

    # speed suites record the path that was timed (a kernel) next to the method's own
    return {"method": cell.method, "form": form_of(cell) or "", "W": text("wbits"), "A": text("abits"),
            "KV": text("kv_bits"), "exec path": text("exec_path_speed") or text("exec_path")}


def throughput_table(group: list[Cell]) -> pd.DataFrame:
    """One row per method: prefill and decode tok/s per batch, each with ±spread and (speed-up×),
    each beside its fraction of the floor (prefill: flop floor; decode: byte floor) where recorded.

    Every cell of the group has a row; one without numbers says why in ``notes``.
    """
    ref = fp16_cell(group)
    batches = sorted({b for c in group for b in decode_points(c)})
    floors = any(floor_points(c) or PREFILL_FLOOR in c.metrics for c in group)
    rows = []
    for cell in group:
        row = _info_columns(cell)
        # the decoder code around the linears (mosaicquant.harness.runtime); older records do not say
        row["runtime"] = runtime_of(cell) or ""
        comparable = same_runtime(cell, ref)
        pre = cell.metrics.get(PREFILL)
        row["prefill tok/s (batch 1) ↑"] = _cell_text(pre, speedup(pre, ref.metrics.get(PREFILL))
                                                      if comparable and ref is not None else None)
        if floors:
            row["prefill: of flop floor"] = _fraction_text(cell.metrics.get(PREFILL_FLOOR))
        dec, ref_dec = decode_points(cell), decode_points(ref) if comparable and ref is not None else {}
        floor = floor_points(cell)
        for b in batches:
            row[f"decode tok/s (batch {b}) ↑"] = _cell_text(dec.get(b), speedup(dec.get(b), ref_dec.get(b)))
            if floors:
                row[f"batch {b}: of byte floor"] = _fraction_text(floor.get(b))
        row["notes"] = "; ".join(n for n in (cell.note, _runtime_note(cell, ref)) if n) or None
        rows.append(row)
    return pd.DataFrame(rows)


def _batch_points(cell: Cell, pattern: re.Pattern) -> dict[int, MetricSummary]:
    return dict(sorted((int(m.group(1)), v) for name, v in cell.metrics.items() if (m := pattern.match(name))))


def energy_table(group: list[Cell]) -> pd.DataFrame:
    """One row per method with NVML numbers: J per decode token (ratio to fp16: below 1 uses less) and mean W.

    Only cells that measured energy over a set window (suite option ``energy_s``) are shown;
    earlier records read the counter over the sub-second timed replays, which is noise. Empty
    when no such cell is in the group.
    """
    group = [c for c in group if "energy_s" in c.suite_config and _batch_points(c, ENERGY_RE)]
    if not group:
        return pd.DataFrame()
    ref = fp16_cell(group)
    ref_energy = _batch_points(ref, ENERGY_RE) if ref else {}
    batches = sorted({b for c in group for b in _batch_points(c, ENERGY_RE)})
    rows = []
    for cell in group:
        energy, power = _batch_points(cell, ENERGY_RE), _batch_points(cell, POWER_RE)
        row = {"method": cell.method}
        for b in batches:
            e, r = energy.get(b), ref_energy.get(b)
            text = "" if e is None else (f"{e.value:.3g}" if math.isfinite(e.value) else format_number(e.value))
            ratio = None if e is None or r is None else _ratio_of(e.value, r.value)
            if ratio is not None:
                text += f" ({ratio:.2f}×)"
            row[f"batch {b}: J/token ↓"] = text
            row[f"batch {b}: W"] = "" if power.get(b) is None else f"{power[b].value:.0f}"
        rows.append(row)
    return pd.DataFrame(rows)


def latency_table(group: list[Cell]) -> pd.DataFrame:
    """One row per (method, layer): µs ±spread (speed-up×) per M; methods without numbers say why."""
    ref = fp16_cell(group)
    ref_pts = linear_points(ref) if ref else {}
    layers: set[str] = set()
    ms: set[int] = set()
    for cell in group:
        for layer, pts in linear_points(cell).items():
            layers.add(layer)
            ms.update(pts)
    rows = []
    for cell in group:
        pts = linear_points(cell)
        if not pts:
            rows.append({"method": cell.method, "layer": "", "notes": cell.note or "no linear-layer latency"})
            continue
        for layer in sorted(layers, key=_layer_order):
            row = {"method": cell.method, "layer": layer}
            for m in sorted(ms):
                value = pts.get(layer, {}).get(m)
                row[f"M = {m} (µs) ↓"] = _cell_text(value, speedup(value, ref_pts.get(layer, {}).get(m)), with_spread=False)
            row["notes"] = cell.note
            rows.append(row)
    return pd.DataFrame(rows)


def step_table(group: list[Cell]) -> pd.DataFrame:
    """One row per method: end-to-end step time (ms ±spread, speed-up×) for prefill and decode."""
    ref = fp16_cell(group)
    ref_steps = step_points(ref) if ref else {}
    names: list[str] = []
    for cell in group:
        names.extend(n for n in step_points(cell) if n not in names)
    if not names:
        return pd.DataFrame()
    names.sort(key=_step_order)
    rows = []
    for cell in group:
        steps = step_points(cell)
        row = {"method": cell.method}
        comparable = same_runtime(cell, ref)
        for n in names:
            row[f"{'prefill' if n == 'prefill' else 'decode, batch ' + n.removeprefix('decode_b')} (ms) ↓"] = _cell_text(steps.get(n), speedup(steps.get(n), ref_steps.get(n)) if comparable else None)
        row["notes"] = "; ".join(n for n in (cell.note, _runtime_note(cell, ref)) if n) or None
        rows.append(row)
    return pd.DataFrame(rows)


def backend_groups(cells: Iterable[Cell]) -> dict[tuple[str, str, str], list[Cell]]:
    """``{(model, backend, suite label): [cells]}`` of the cells another backend ran, the backend's
    ``fp16`` first, then in record order."""
    groups: dict[tuple[str, str, str], list[Cell]] = {}
    for cell in cells:
        if cell.backend is not None:
            groups.setdefault((cell.model, cell.backend, cell.suite), []).append(cell)
    return {k: sorted(v, key=lambda c: c.method != backend_label(FP16_LABEL, k[1])) for k, v in groups.items()}


def backend_fp16_cell(group: list[Cell]) -> Cell | None:
    """The cell of a backend group whose method is ``fp16`` run by that backend, if it has numbers."""
    return next((c for c in group if c.backend and c.method == backend_label(FP16_LABEL, c.backend) and c.metrics),
                None)


def _is_speed_unit(unit: str | None) -> bool:
    """A time or a rate: what a speed-up can be taken of (not a count or length describing the workload)."""
    return bool(unit) and (unit in ("s", "ms", "us", "µs") or "/s" in unit)


def backend_table(group: list[Cell]) -> pd.DataFrame:
    """One row per metric the group's records hold, one column per method with numbers.

    Units and directions are the records'. Each value is the mean ±spread (where recorded), with
    the speed-up vs the backend's ``fp16`` cell in brackets for times and rates; a metric of
    another unit (a request count, a token length) describes the workload and has neither a
    direction nor a speed-up. Cells without numbers are not columns: their notes say why.
    """
    measured = [c for c in group if c.metrics]
    if not measured:
        return pd.DataFrame()
    ref = backend_fp16_cell(group)
    names = sorted({n for c in measured for n in c.metrics}, key=natural_key)
    rows = []
    for name in names:
        first = next(c.metrics[name] for c in measured if name in c.metrics)
        speed = _is_speed_unit(first.unit)
        row = {"metric": name, "unit": first.unit or "", "better": ("higher" if first.higher_is_better else "lower")
               if speed else ""}
        for cell in measured:
            value = cell.metrics.get(name)
            ratio = speedup(value, ref.metrics.get(name)) if speed and ref is not None else None
            row[cell.method] = _cell_text(value, ratio)
        rows.append(row)
    return pd.DataFrame(rows)
