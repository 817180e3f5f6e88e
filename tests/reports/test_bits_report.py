"""The report's equal-bits view on synthetic records: points, nearest rivals, table, figures, section."""

from __future__ import annotations

import pytest

from mosaicquant.harness.cli import main
from mosaicquant.harness.results import load_records
from mosaicquant.reports.bits import (
    BitsPoint,
    bits_pareto_front,
    bits_points,
    equal_bits_section,
    equal_bits_table,
    nearest_rivals,
    plot_equal_bits,
)

MODEL = "tiny-model"

#: method label -> (bits/weight, bits/activation, bits/kv, ppl); made-up values of plausible shape
METHODS = {
    "fp16": (16.0, 16.0, 16.0, 14.0),
    "rtn": (4.02, 4.0, 16.0, 15000.0),
    "resq": (4.42, 4.35, 4.5, 18.0),
    "resq:high_bits=4": (4.04, 4.0, 4.5, 23.0),
    "mosaicquant:budget=0": (4.02, 4.0, 16.0, 25.5),
    "mosaicquant:budget=0.0833": (4.43, 4.0, 16.0, 25.4),
}


def _bits(weight, activation, kv):
    return {"bits/weight": (weight, False, "bits"), "bits/activation": (activation, False, "bits"),
            "bits/kv": (kv, False, "bits")}


def _write_sweep(out, write_cell, zeroshot=None):
    for label, (w, a, kv, ppl) in METHODS.items():
        write_cell(out, MODEL, label, "accuracy", {"ppl": (ppl, False), **_bits(w, a, kv)})
        write_cell(out, MODEL, label, "memory", {"total_quantized_linears": (1e6, False, "bytes"), **_bits(w, a, kv)})
        if zeroshot and label in zeroshot:
            write_cell(out, MODEL, label, "zeroshot", {**{k: (v, True) for k, v in zeroshot[label].items()},
                                                       **_bits(w, a, kv)})


def test_points_take_bits_and_accuracy_from_the_records(tmp_path, write_cell):
    zeroshot = {"resq": {"piqa/acc": 0.6, "piqa/acc_norm": 0.9, "hellaswag/acc_norm": 0.4, "lambada/acc": 0.2},
                "rtn": {"piqa/acc": 0.5, "hellaswag/acc_norm": 0.3}}
    _write_sweep(tmp_path, write_cell, zeroshot)
    points = {p.method: p for p in bits_points(load_records(tmp_path))}
    assert set(points) == set(METHODS)
    resq = points["resq"]
    assert (resq.weight, resq.activation, resq.kv, resq.ppl) == (4.42, 4.35, 4.5, 18.0)
    # the mean is over the headline metrics of the tasks both zero-shot cells measured (lambada: resq only)
    assert resq.tasks == ("piqa", "hellaswag") and resq.zeroshot == pytest.approx((0.6 + 0.4) / 2)
    assert points["rtn"].zeroshot == pytest.approx(0.4) and points["fp16"].zeroshot is None


def test_a_method_without_bits_is_no_point(tmp_path, write_cell):
    write_cell(tmp_path, MODEL, "old", "accuracy", {"ppl": (20.0, False)})
    write_cell(tmp_path, MODEL, "new", "accuracy", {"ppl": (21.0, False), **_bits(4.1, 4.0, 16.0)})
    assert [p.method for p in bits_points(load_records(tmp_path))] == ["new"]
    assert equal_bits_section(load_records(tmp_path)[:0], tmp_path) == []


def test_nearest_rivals_go_by_the_larger_gap():
    points = [BitsPoint(MODEL, label, w, a, kv, ppl) for label, (w, a, kv, ppl) in METHODS.items()]
    by = {p.method: p for p in points}
    # resq's weights match mosaicquant at 0.0833 (0.01 apart) but its activations are 0.35 bits wider
    rivals = [p.method for p in nearest_rivals(by["resq"], points)]
    assert rivals == ["mosaicquant:budget=0.0833", "resq:high_bits=4"]
    assert [p.method for p in nearest_rivals(by["mosaicquant:budget=0"], points, 1)] == ["rtn"]
    other_model = BitsPoint("another", "x", 4.02, 4.0)
    assert other_model not in nearest_rivals(by["rtn"], points + [other_model], 10)


def test_table_marks_equal_bits_and_shows_both_gaps():
    points = [BitsPoint(MODEL, label, w, a, kv, ppl) for label, (w, a, kv, ppl) in METHODS.items()]
    table = equal_bits_table(points)
    assert list(table["method"])[:2] == ["mosaicquant:budget=0", "rtn"]  # fewest weight bits first, then label
    assert list(table.columns) == ["model", "method", "W bits", "A bits", "KV bits", "ppl", "nearest rivals"]
    row = table.set_index("method").loc["resq"]
    assert row["W bits"] == "4.42" and row["A bits"] == "4.35" and row["ppl"] == "18.00"
    assert row["nearest rivals"].startswith("`mosaicquant:budget=0.0833` (W +0.01, A -0.35): ppl 25.40")
    mq = table.set_index("method").loc["mosaicquant:budget=0"]["nearest rivals"]
    assert mq.startswith("= `rtn` (W 0.00, A 0.00): ppl 15,000; = `resq:high_bits=4` (W +0.02, A 0.00)"), mq


def test_pareto_front_prefers_fewer_bits_and_lower_perplexity():
    assert bits_pareto_front([(4.0, 30.0), (4.5, 20.0), (4.2, 40.0), (16.0, 14.0), (4.5, 25.0)]) == [
        (4.0, 30.0), (4.5, 20.0), (16.0, 14.0)]
    assert bits_pareto_front([]) == []


def test_figures_one_per_model_with_two_quantized_perplexities(tmp_path):
    points = [BitsPoint(MODEL, label, w, a, kv, ppl) for label, (w, a, kv, ppl) in METHODS.items()]
    points += [BitsPoint("lonely", "rtn", 4.0, 4.0, None, 30.0), BitsPoint("lonely", "fp16", 16.0, 16.0, None, 9.0)]
    figures = plot_equal_bits(points, tmp_path)
    assert [f.path.name for f in figures] == ["equal_bits__tiny-model.png"]
    assert figures[0].path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and figures[0].path.stat().st_size > 10_000


def test_report_has_the_equal_bits_section_and_keeps_bits_out_of_the_summary(tmp_path, write_cell):
    _write_sweep(tmp_path, write_cell)
    assert main(["report", str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text()
    section = report[report.index("## Equal bits"):report.index("## Provenance")]
    assert "| tiny-model | resq | 4.42 | 4.35 | 4.50 | 18.00 |" in section
    assert "![equal_bits__tiny-model](equal_bits__tiny-model.png)" in section
    assert (tmp_path / "equal_bits__tiny-model.png").exists()
    summary = report[report.index("## Summary"):report.index("## Equal bits")]
    assert "bits/" not in summary  # once per method in its own section, not once per suite
