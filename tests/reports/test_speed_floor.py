"""The throughput table shows each method's fraction of its floor beside its ratio to BF16, and the
ceilings the run measured (synthetic records: values made up, records real)."""

import pytest

from mosaicquant.harness.results import load_records
from mosaicquant.reports.cells import aggregate_cells
from mosaicquant.reports.plots import _new_figure, draw_decode_throughput, plot_decode_throughput
from mosaicquant.reports.speed import decode_floor_tok_s, decode_points, floor_points, suite_groups, throughput_table
from mosaicquant.reports.tables import write_tables

SPEED = "llama-3-8b-shapes"
CEILINGS = {"copy_gb_s": 2900.0, "bf16_tflop_s": 700.0, "int8_tflop_s": 1300.0, "gpu": "NVIDIA H100 80GB HBM3"}


def _speed_info(form, wbits):
    return {"wbits": wbits, "abits": wbits, "kv_bits": 16, "exec_path_speed": f"{form} path",
            "speed": {"runtime": "fused", "form": form, "ceilings": CEILINGS}}


def _write(out, write_cell, speed_metrics, label, decode, floors, prefill_floor, form, wbits):
    metrics = speed_metrics[0](decode, prefill=40000.0)
    metrics.update({f"decode_floor_frac/b{b}": (f, True, "of floor") for b, f in floors.items()})
    metrics["prefill_floor_frac"] = (prefill_floor, True, "of floor")
    write_cell(out, SPEED, label, "throughput", metrics, info=_speed_info(form, wbits))


def test_floor_fractions_sit_beside_the_ratios_and_the_ceilings_are_stated(tmp_path, write_cell, speed_metrics):
    out = tmp_path / "res"
    _write(out, write_cell, speed_metrics, "fp16", {4: 600.0, 32: 4000.0}, {4: 0.82, 32: 0.8}, 0.61, "bf16", 16)
    _write(out, write_cell, speed_metrics, "rtn", {4: 1200.0, 32: 6000.0}, {4: 0.55, 32: 0.43}, 0.3, "kernels", 4)
    # a record of an older run: no floors, no form
    write_cell(out, SPEED, "quarot", "throughput", speed_metrics[0]({4: 900.0}))
    group = suite_groups(aggregate_cells(load_records(out)).values(), "throughput")[(SPEED, "throughput")]
    table = throughput_table(group).set_index("method")
    assert table.loc["rtn", "decode tok/s (batch 4) ↑"].endswith("(2.00×)")
    assert table.loc["rtn", "batch 4: of byte floor"] == "55%" and table.loc["rtn", "batch 32: of byte floor"] == "43%"
    assert table.loc["fp16", "batch 4: of byte floor"] == "82%"
    assert table.loc["rtn", "prefill: of flop floor"] == "30%"
    assert table.loc["rtn", "form"] == "kernels" and table.loc["fp16", "form"] == "bf16"
    assert table.loc["quarot", "batch 4: of byte floor"] == "" and table.loc["quarot", "form"] == ""
    report = write_tables(out).read_text()
    assert "Ceilings measured in this run: NVIDIA H100 80GB HBM3: copy 2,900 GB/s (read + write), BF16 700 " \
           "TFLOP/s, INT8 1,300 TOP/s." in report
    assert "of byte floor" in report and "| form |" in report


def test_without_floors_the_table_has_no_floor_columns(tmp_path, write_cell, speed_metrics):
    out = tmp_path / "res"
    write_cell(out, SPEED, "fp16", "throughput", speed_metrics[0]({4: 600.0}))
    group = suite_groups(aggregate_cells(load_records(out)).values(), "throughput")[(SPEED, "throughput")]
    assert not [c for c in throughput_table(group).columns if "floor" in c]
    assert "Ceilings measured" not in write_tables(out).read_text()


def aggregate_cells_of(out):
    return list(aggregate_cells(load_records(out)).values())


def _group(out):
    return suite_groups(aggregate_cells_of(out), "throughput")[(SPEED, "throughput")]


def _floor_lines(ax):
    return {line.get_gid().removeprefix("floor:"): line for line in ax.get_lines()
            if (line.get_gid() or "").startswith("floor:")}


def test_the_decode_figure_draws_each_methods_byte_floor_in_its_colour(tmp_path, write_cell, speed_metrics):
    out = tmp_path / "res"
    step_bytes = {"fp16": {4: 16.1e9, 32: 16.9e9}, "rtn": {4: 4.3e9, 32: 5.1e9}}
    for label, decode, form, wbits in (("fp16", {4: 150.0, 32: 1100.0}, "bf16", 16),
                                       ("rtn", {4: 400.0, 32: 2600.0}, "kernels", 4)):
        metrics = speed_metrics[0](decode)
        metrics.update({f"decode_bytes/b{b}": (n, False, "B") for b, n in step_bytes[label].items()})
        write_cell(out, SPEED, label, "throughput", metrics, info=_speed_info(form, wbits))
    # a record without bytes or ceilings: drawn, but with no floor
    write_cell(out, SPEED, "quarot", "throughput", speed_metrics[0]({4: 300.0, 32: 2000.0}))

    _, axes = _new_figure(1, 1, (4, 3))
    ax = axes[0][0]
    with_floor, without_floor = draw_decode_throughput(ax, _group(out))
    assert with_floor == ["fp16", "rtn"] and without_floor == ["quarot"]
    lines = _floor_lines(ax)
    assert sorted(lines) == ["fp16", "rtn"]
    measured = {bars.get_label(): bars.lines[0] for bars in ax.containers}
    assert sorted(measured) == ["fp16", "quarot", "rtn"]
    for label, line in lines.items():
        assert list(line.get_xdata()) == [4, 32] and line.get_linestyle() == "--"
        # B sequences over the bytes' time at the copy bandwidth the run measured
        expected = [b * CEILINGS["copy_gb_s"] * 1e9 / step_bytes[label][b] for b in (4, 32)]
        assert list(line.get_ydata()) == pytest.approx(expected, rel=1e-12), (label, line.get_ydata())
        assert line.get_color() == measured[label].get_color()
    assert "byte floor (dashed, the method's colour)" in [t.get_text() for t in ax.legend().get_texts()]

    figures = plot_decode_throughput(aggregate_cells_of(out), out)
    assert [f.path.name for f in figures] == [f"decode_throughput__{SPEED}.png"]
    caption = figures[0].caption
    assert "dashed: each method's byte floor" in caption and caption.endswith("No byte floor recorded for: quarot.")


def test_without_floor_data_the_decode_figure_has_no_floor_line(tmp_path, write_cell, speed_metrics):
    out = tmp_path / "res"
    # bytes recorded but no ceilings (so no bandwidth to divide by), and a record with neither
    write_cell(out, SPEED, "fp16", "throughput", {**speed_metrics[0]({4: 150.0, 8: 300.0}),
                                                  "decode_bytes/b4": (16.1e9, False, "B")},
               info={"wbits": 16, "abits": 16, "kv_bits": 16, "speed": {"runtime": "fused", "form": "bf16"}})
    write_cell(out, SPEED, "rtn", "throughput", speed_metrics[0]({4: 400.0, 8: 700.0}))

    _, axes = _new_figure(1, 1, (4, 3))
    ax = axes[0][0]
    assert draw_decode_throughput(ax, _group(out)) == ([], ["fp16", "rtn"])
    assert not _floor_lines(ax)
    assert all("floor" not in t.get_text() for t in ax.legend().get_texts())
    caption = plot_decode_throughput(aggregate_cells_of(out), out)[0].caption
    assert "dashed" not in caption and "No byte floor recorded for: fp16, rtn." in caption


def test_the_drawn_floor_agrees_with_the_fraction_the_suite_recorded():
    # an H100 run's records: the figure's floor, from bytes and the copy bandwidth, is the table's fraction
    from pathlib import Path

    out = Path(__file__).resolve().parents[2] / "benchmarks/results/llama3_8b_shapes_layout_ab/new"
    cells = [c for c in aggregate_cells_of(out) if c.suite_name == "throughput"]
    assert sorted(c.method for c in cells) == ["fp16", "mosaicquant", "quarot"]
    for cell in cells:
        floor, measured, fraction = decode_floor_tok_s(cell), decode_points(cell), floor_points(cell)
        assert sorted(floor) == sorted(fraction) == [4, 8, 16, 32], cell.method
        for b in floor:
            assert measured[b].value / floor[b] == pytest.approx(fraction[b].value, rel=1e-9), (cell.method, b)
