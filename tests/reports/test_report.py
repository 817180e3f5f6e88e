"""Reports from records: speed tables with speed-ups vs fp16, figures drawn only when their data exists."""

import math
import re

import pytest

from mosaicquant.harness.cli import main
from mosaicquant.harness.results import load_records
from mosaicquant.reports.cells import aggregate_cells
from mosaicquant.reports.plots import _label_points, _new_figure, budget_sweeps, decode_speedup, pareto_front, plot_budget_sweep
from mosaicquant.reports.tables import summary_table, write_tables

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ACC, SPEED = "smollm2-135m", "llama-3-8b-shapes"
#: decode tok/s per method at batch 4 and 8, and its perplexity on the accuracy model
DECODE = {"fp16": {4: 400.0, 8: 800.0}, "rtn": {4: 1000.0, 8: 1600.0}, "mosaicquant": {4: 800.0, 8: 1400.0}}
PPL = {"fp16": 13.9, "rtn": 900.0, "mosaicquant": 25.0}


def _pngs(folder):
    return sorted(p.name for p in folder.glob("*.png"))


def _assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5_000, (path, len(data))


def _embedded(report):
    """``{png file: caption}`` of the Markdown image links and the italic line that follows each."""
    return dict(re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)\n\n\*([^*\n]+)\*", report))


def _full_set(out, write_cell, speed_metrics):
    throughput, latency = speed_metrics
    budgets = {"mosaicquant:budget=0": 0.0, "mosaicquant": 0.1, "mosaicquant:budget=0.2": 0.2}
    for label, ppl in {**PPL, "mosaicquant:budget=0": 26.0, "mosaicquant:budget=0.2": 24.0}.items():
        config = {"budget": budgets[label], "block": "128"} if label in budgets else {}
        kind = "mosaicquant" if label in budgets else None
        write_cell(out, ACC, label, "accuracy", {"ppl": (ppl, False)}, config=config, method_name=kind)
        write_cell(out, ACC, label, "memory", {
            "base_values": (5e7 if label != "fp16" else 2e8, False, "bytes"), "base_scales": (3e5, False, "bytes"),
            "residual_values": (4e6 * budgets.get(label, 0), False, "bytes"),
            "total_quantized_linears": (5.1e7, False, "bytes"),
            "linear_weight_ratio_vs_bf16": (0.25 + budgets.get(label, 0), False)}, config=config, method_name=kind)
        decode = DECODE.get(label, {4: 700.0 - 1000 * budgets.get(label, 0), 8: 1300.0})
        write_cell(out, SPEED, label, "throughput", throughput(decode, prefill=5000.0), config=config,
                   method_name=kind)
        factor = 1.0 if label == "fp16" else 2.0
        write_cell(out, SPEED, label, "latency", latency({1: 10.0 / factor, 64: 20.0 / factor, 2048: 400.0 / factor}),
                   config=config, method_name=kind)


def test_every_figure_kind_drawn_and_embedded(tmp_path, write_cell, speed_metrics):
    out = tmp_path / "res"
    _full_set(out, write_cell, speed_metrics)
    write_cell(out, ACC, "spinquant", "accuracy", {"ppl": (30.0, False)})  # no speed record: named, not drawn
    write_cell(out, ACC, "quarot", "accuracy", {"ppl": (math.inf, False)})
    write_cell(out, SPEED, "quarot", "throughput", speed_metrics[0]({4: 900.0}))
    report = write_tables(out).read_text()
    pngs = _pngs(out)
    assert pngs == sorted([f"pareto__{ACC}__{SPEED}.png", f"speedup_vs_m__{SPEED}.png", f"memory__{ACC}.png",
                           f"accuracy__{ACC}.png", "budget_sweep.png", f"decode_throughput__{SPEED}.png"]), pngs
    for name in pngs:
        _assert_png(out / name)
        # each figure also as vector files for a paper, linked from the report
        pdf, svg = (out / name).with_suffix(".pdf"), (out / name).with_suffix(".svg")
        assert pdf.read_bytes()[:5] == b"%PDF-" and b"<svg" in svg.read_bytes()[:2000], name
        assert f"[PDF]({pdf.name}), [SVG]({svg.name})" in report
    captions = _embedded(report)
    assert sorted(captions) == pngs, captions
    pareto = captions[f"pareto__{ACC}__{SPEED}.png"]
    assert ACC in pareto and SPEED in pareto
    assert "Not drawn: quarot (perplexity inf), spinquant (no decode speed)." in pareto, pareto


def test_figures_only_when_their_data_exists(tmp_path, write_cell, speed_metrics):
    throughput, _ = speed_metrics
    out = tmp_path / "res"
    for label, ppl in PPL.items():
        write_cell(out, ACC, label, "accuracy", {"ppl": (ppl, False)})
    report = write_tables(out).read_text()
    # perplexity alone: the accuracy figure only
    assert _pngs(out) == [f"accuracy__{ACC}.png"] and list(_embedded(report)) == [f"accuracy__{ACC}.png"]
    (out / f"accuracy__{ACC}.png").unlink()

    # speed without an fp16 row: no speed-up, so no Pareto figure, and the report says why; tokens/s
    # need no fp16 row, so their figure is drawn
    for label in ("rtn", "mosaicquant"):
        write_cell(out, SPEED, label, "throughput", throughput(DECODE[label]))
    report = write_tables(out).read_text()
    assert _pngs(out) == [f"accuracy__{ACC}.png", f"decode_throughput__{SPEED}.png"]
    assert f"No `fp16` throughput row for {SPEED}" in report
    assert f"No `fp16` row for {SPEED} in this directory" in report
    assert "×)" not in report

    write_cell(out, SPEED, "fp16", "throughput", throughput(DECODE["fp16"]))
    report = write_tables(out).read_text()
    assert _pngs(out) == [f"accuracy__{ACC}.png", f"decode_throughput__{SPEED}.png", f"pareto__{ACC}__{SPEED}.png"]
    _assert_png(out / f"pareto__{ACC}__{SPEED}.png")
    assert f"pareto__{ACC}__{SPEED}.png" in _embedded(report)
    assert "No `fp16`" not in report


def test_speed_tables_rows_speedups_and_reasons(tmp_path, write_cell, speed_metrics):
    out = tmp_path / "res"
    _full_set(out, write_cell, speed_metrics)
    write_cell(out, SPEED, "trtllm", "throughput", status="unavailable", info={},
               error={"type": "unavailable", "message": "TensorRT-LLM is not installed on this machine"})
    write_cell(out, SPEED, "atom", "throughput", status="failed", info={},
               error={"type": "RuntimeError", "message": "kernel launch failed"})
    write_cell(out, SPEED, "quarot", "throughput", speed_metrics[0]({4: 600.0}),
               info={"wbits": 4, "abits": 4, "kv_bits": 4, "exec_path": "simulated (fake-quant)",
                     "exec_path_speed": "triton (dense W4A4)"})
    report = write_tables(out).read_text()
    section = report.split(f"### Throughput on {SPEED}")[1].split("###")[0]
    rows = {line.split(" | ")[0].strip("| "): line for line in section.splitlines() if line.startswith("| ")}
    # decode b4: rtn 1000 / fp16 400 = 2.50x; b8: 1600 / 800 = 2.00x
    assert "1,000 ±1 (2.50×)" in rows["rtn"] and "1,600 ±1 (2.00×)" in rows["rtn"], rows["rtn"]
    assert "(1.50×)" in rows["quarot"] and "| 4 | 4 | 4 | triton[^" in rows["quarot"]
    assert "| 4 | 4 | 16 | triton[^" in rows["mosaicquant"]
    assert "not available: TensorRT-LLM is not installed on this machine" in rows["trtllm"]
    assert "failed: RuntimeError: kernel launch failed" in rows["atom"]
    # latency is lower-is-better: half the time is a 2x speed-up
    latency = report.split(f"### Latency on {SPEED}")[1]
    rtn_qkv = next(line for line in latency.splitlines() if line.startswith("| rtn | qkv_proj |"))
    assert "5.00 (2.00×)" in rtn_qkv and "200.0 (2.00×)" in rtn_qkv, rtn_qkv
    # the summary keeps every method's row with its notes
    summary = report.split("## Summary")[1].split("## Speed")[0]
    assert f"| {SPEED} | trtllm |" in summary and "throughput not available: TensorRT-LLM" in summary
    # the long execution paths are short labels with the whole text as footnotes
    notes = dict(re.findall(r"^\[\^(\d+)\]: (.+)$", report.split("## Execution paths")[1], re.M))
    quarot = next(line for line in summary.splitlines() if line.startswith(f"| {SPEED} | quarot |"))
    marks = re.search(r"\| simulated\[\^(\d+)\]; speed: triton\[\^(\d+)\] \|", quarot)
    assert marks, quarot
    assert (notes[marks[1]], notes[marks[2]]) == ("simulated (fake-quant)", "triton (dense W4A4)")


def test_records_long_csv_has_spread_and_notes(tmp_path, write_cell, speed_metrics):
    import pandas as pd

    out = tmp_path / "res"
    write_cell(out, SPEED, "fp16", "throughput", speed_metrics[0]({4: 400.0}, spread=7.5))
    write_cell(out, SPEED, "trtllm", "throughput", status="unavailable", info={}, reason="no TensorRT-LLM")
    write_tables(out)
    df = pd.read_csv(out / "records_long.csv")
    assert df.loc[df.metric == "decode_tok_s/b4", "spread"].tolist() == [7.5]
    assert df.loc[df.method == "trtllm", "note"].tolist() == ["not available: no TensorRT-LLM"]


def test_report_cli_puts_figures_next_to_output(tmp_path, write_cell, speed_metrics, capsys):
    out = tmp_path / "res"
    _full_set(out, write_cell, speed_metrics)
    before = sorted(p.name for p in out.iterdir())
    target = tmp_path / "elsewhere" / "report.md"
    assert main(["report", str(out), "-o", str(target)]) == 0
    assert (target.parent / "budget_sweep.png").exists() and not (out / "budget_sweep.png").exists()
    assert "budget_sweep.png" in target.read_text()
    # every output goes next to the report file; the results directory is only read
    for name in ("summary.csv", "summary.tex", "records_long.csv"):
        assert (target.parent / name).stat().st_size > 0, name
    assert sorted(p.name for p in out.iterdir()) == before


def test_an_output_that_cannot_be_written_is_one_line_exit_2(tmp_path, write_cell, speed_metrics, capsys):
    out = tmp_path / "res"
    _full_set(out, write_cell, speed_metrics)
    before = sorted(p.name for p in out.iterdir())

    def one_line_error():
        captured = capsys.readouterr()
        err = captured.err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("mosaicquant: error: ") and "Traceback" not in captured.err, err
        return err[0]

    # -o naming an existing folder: refused before anything is written (figures would land beside it)
    folder = tmp_path / "folder"
    folder.mkdir()
    assert main(["report", str(out), "-o", str(folder)]) == 2
    assert f"report file '{folder}' is a directory" in one_line_error()
    assert not list(tmp_path.glob("*.png")) and not list(folder.iterdir())
    # a report folder that cannot be created (a file is in the way)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["report", str(out), "-o", str(blocker / "sub" / "report.md")]) == 2
    assert f"report folder '{blocker / 'sub'}' is not writable" in one_line_error()
    # a failure while writing (here a figure's file name is taken by a folder) names the path
    (out / "budget_sweep.png").mkdir()
    assert main(["report", str(out)]) == 2
    assert f"cannot write '{out / 'budget_sweep.png'}': Is a directory" in one_line_error()
    figure = (".png", ".pdf", ".svg")
    assert sorted(p.name for p in out.iterdir() if p.suffix not in figure) == sorted(
        n for n in before if not n.endswith(figure))


def test_report_of_a_directory_without_records_is_exit_2_and_writes_nothing(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.json").write_text('{"schema": "something else"}')
    assert main(["report", str(empty)]) == 2
    assert "holds no result records" in capsys.readouterr().err
    assert sorted(p.name for p in empty.iterdir()) == ["notes.json"]


def test_decode_speedup_is_geometric_mean_over_shared_batches(tmp_path, write_cell, speed_metrics):
    throughput, _ = speed_metrics
    write_cell(tmp_path, SPEED, "fp16", "throughput", throughput({4: 100.0, 8: 200.0, 16: 300.0}))
    write_cell(tmp_path, SPEED, "rtn", "throughput", throughput({4: 200.0, 8: 800.0, 32: 999.0}))
    cells = aggregate_cells(load_records(tmp_path))
    value, batches = decode_speedup(cells[(SPEED, "rtn", "throughput")], cells[(SPEED, "fp16", "throughput")])
    assert batches == [4, 8] and value == pytest.approx(math.sqrt(2.0 * 4.0))


def test_no_end_to_end_speedup_across_decoder_runtimes(tmp_path, write_cell, speed_metrics):
    # a method the fused decoder cannot run (e.g. a KV-cache quantizer) falls back to the eager code:
    # its tok/s are shown, but never divided by an fp16 row that ran on the other runtime
    throughput, _ = speed_metrics

    def info(runtime, kv=16):
        return {"wbits": 4, "abits": 4, "kv_bits": kv, "exec_path": "triton", "speed": {"runtime": runtime}}

    write_cell(tmp_path, SPEED, "fp16", "throughput", throughput({4: 800.0}, prefill=40000.0), info=info("fused"))
    write_cell(tmp_path, SPEED, "rtn", "throughput", throughput({4: 1400.0}, prefill=60000.0), info=info("fused"))
    write_cell(tmp_path, SPEED, "quarot", "throughput", throughput({4: 500.0}, prefill=30000.0),
               info=info("transformers", kv=4))
    cells = aggregate_cells(load_records(tmp_path))
    fp16 = cells[(SPEED, "fp16", "throughput")]
    assert decode_speedup(cells[(SPEED, "quarot", "throughput")], fp16) is None
    assert decode_speedup(cells[(SPEED, "rtn", "throughput")], fp16)[0] == pytest.approx(1.75)
    section = write_tables(tmp_path).read_text().split(f"### Throughput on {SPEED}")[1].split("###")[0]
    rows = {line.split(" | ")[0].strip("| "): line for line in section.splitlines() if line.startswith("| ")}
    assert "| fused |" in rows["rtn"] and "(1.75×)" in rows["rtn"] and "(1.50×)" in rows["rtn"]
    assert "| transformers |" in rows["quarot"] and "×" not in rows["quarot"].split("| transformers |")[1]
    assert "ran on the transformers runtime, the fp16 row on fused: no end-to-end speed-up shown" in rows["quarot"]


def test_seeds_aggregate_mean_and_spread(tmp_path, write_cell):
    for seed, value in ((0, 100.0), (1, 110.0)):
        write_cell(tmp_path, SPEED, "rtn", "throughput", {"decode_tok_s/b4": (value, True, "tok/s", 1.0)}, seed=seed)
    write_cell(tmp_path, SPEED, "rtn", "throughput", seed=2, status="failed", error={"message": "OOM"})
    cell = aggregate_cells(load_records(tmp_path))[(SPEED, "rtn", "throughput")]
    m = cell.metrics["decode_tok_s/b4"]
    # mean over the ok seeds; spread: the larger of the recorded spread (1) and the std across seeds (7.07)
    assert m.value == pytest.approx(105.0) and m.n == 2 and m.spread == pytest.approx(math.sqrt(50.0))
    assert cell.status == "failed" and "seed 2 failed: OOM" in cell.note


def test_pareto_front():
    # (2.1, 25.0) is beaten by (2.2, 22.0) and (1.5, 30.0) by everything faster and more accurate
    points = [(1.0, 14.0), (2.4, 25.6), (2.1, 25.0), (2.2, 22.0), (2.5, 900.0), (1.5, 30.0)]
    assert pareto_front(points) == [(2.5, 900.0), (2.4, 25.6), (2.2, 22.0), (1.0, 14.0)]


def test_budget_sweeps_group_by_config_without_budget(tmp_path, write_cell):
    for score in ("hessian", "delta"):
        for budget in (0.0, 0.1, 0.3):
            label = f"mosaicquant:budget={budget}:score={score}"
            write_cell(tmp_path, ACC, label, "accuracy", {"ppl": (20 + budget + (score == "delta"), False)},
                       config={"budget": budget, "score": score, "block": "128"}, method_name="mosaicquant")
    # one budget only: not a sweep
    write_cell(tmp_path, ACC, "mosaicquant:abits=16", "accuracy", {"ppl": (15.0, False)},
               config={"budget": 0.1, "score": "hessian", "block": "128", "abits": 16}, method_name="mosaicquant")
    cells = list(aggregate_cells(load_records(tmp_path)).values())
    assert sorted(budget_sweeps(cells).values()) == ["mosaicquant:score=delta", "mosaicquant:score=hessian"]
    assert plot_budget_sweep(cells, tmp_path) is not None and (tmp_path / "budget_sweep.png").stat().st_size > 5_000

    single = tmp_path / "single"
    write_cell(single, ACC, "mosaicquant", "accuracy", {"ppl": (25.0, False)}, config={"budget": 0.1},
               method_name="mosaicquant")
    assert plot_budget_sweep(list(aggregate_cells(load_records(single)).values()), single) is None
    assert not (single / "budget_sweep.png").exists()


def test_energy_table_only_for_records_with_an_energy_window(tmp_path, write_cell, speed_metrics):
    out = tmp_path / "res"

    def energy(j_per_tok, watts):
        metrics = speed_metrics[0]({4: 500.0})
        metrics["decode_energy_j_per_tok/b4"] = (j_per_tok, False, "J/tok", None)
        metrics["decode_power_w/b4"] = (watts, False, "W", None)
        return metrics

    write_cell(out, SPEED, "fp16", "throughput", energy(0.8, 360.0), suite_config={"energy_s": 2.0})
    write_cell(out, SPEED, "rtn", "throughput", energy(0.6, 330.0), suite_config={"energy_s": 2.0})
    report = write_tables(out).read_text()
    section = report.split("Decode energy per token")[1]
    assert "| rtn | 0.6 (0.75×) | 330 |" in section and "| fp16 | 0.8 (1.00×) | 360 |" in section
    # records from before the energy window (no energy_s): their counter readings are not shown
    old = tmp_path / "old"
    write_cell(old, SPEED, "fp16", "throughput", energy(0.8, 360.0))
    assert "Decode energy per token" not in write_tables(old).read_text()


def test_labels_of_nearby_points_do_not_overlap():
    fig, axes = _new_figure(1, 1, (6.4, 4.6))
    ax = axes[0][0]
    # SmolLM2's figure: a collapsed method puts the axis on a log scale and squeezes the others together
    points = [("mosaicquant", 0.86, 24.8), ("mosaicquant:budget=0", 0.91, 25.5), ("fp16", 1.0, 13.9),
              ("quarot", 0.45, 27.5), ("spinquant", 0.40, 25.2), ("atom", 0.45, 19.3), ("rtn", 0.99, 18975.0)]
    ax.scatter([x for _, x, _ in points], [y for _, _, y in points])
    ax.set_yscale("log")
    offsets = _label_points(ax, points)
    assert any(o != (4, 4) for o in offsets)  # crowded: some labels left the default spot
    assert [t.get_text() for t in ax.texts] == [label for label, _, _ in points]
    boxes = []
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for t in ax.texts:
        boxes.append(t.get_window_extent(renderer))
    overlaps = [(i, j) for i in range(len(boxes)) for j in range(i) if boxes[i].overlaps(boxes[j])]
    assert not overlaps, overlaps
    markers = [ax.transData.transform((x, y)) for _, x, y in points]
    covered = [(i, j) for i, b in enumerate(boxes) for j, (mx, my) in enumerate(markers)
               if i != j and b.contains(mx, my)]
    assert not covered, covered


def test_provenance_names_the_code_and_machine_of_each_record(tmp_path, write_cell, speed_metrics):
    throughput, _ = speed_metrics
    gpu = {"gpu": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0"}
    code = {"commit": "0123456789abcdef", "dirty": False, "source_sha256": "aaaabbbbccccdddd"}
    write_cell(tmp_path, "m", "fp16", "throughput", throughput({4: 100.0}), git=code, env=gpu)
    write_cell(tmp_path, "m", "rtn", "throughput", throughput({4: 180.0}), git=code, env=gpu)
    report = write_tables(tmp_path).read_text()
    section = report[report.index("## Provenance"):]
    assert "| 0123456789 | aaaabbbbccccdddd | NVIDIA H200 | 2.11.0 | 3.6.0 | 2 |" in section
    assert "more than one code version" not in section
    # a record of other code (uncommitted edits) and one written before records had these fields
    write_cell(tmp_path, "m", "quarot", "throughput", throughput({4: 170.0}),
               git={**code, "dirty": True, "source_sha256": "eeeeffff00001111"}, env=gpu)
    write_cell(tmp_path, "m", "mosaicquant", "throughput", throughput({4: 160.0}))
    section = write_tables(tmp_path).read_text().split("## Provenance")[1]
    assert "| 0123456789* | eeeeffff00001111 | NVIDIA H200 | 2.11.0 | 3.6.0 | 1 |" in section
    assert "| – | – | CPU | – | – | 1 |" in section
    assert "These records come from more than one code version or machine." in section


def test_unreadable_json_files_are_named_in_the_report(tmp_path, write_cell, speed_metrics, capsys):
    out = tmp_path / "res"
    write_cell(out, SPEED, "fp16", "throughput", speed_metrics[0]({4: 400.0}))
    rtn = write_cell(out, SPEED, "rtn", "throughput", speed_metrics[0]({4: 900.0}))
    rtn.write_bytes(rtn.read_text().encode("utf-16"))  # a record re-saved by an editor
    (out / "cut.json").write_text('{"schema": "mosaicquant.result/1", "metr')
    assert main(["report", str(out)]) == 0
    report = (out / "report.md").read_text()
    line = next(x for x in report.splitlines() if x.startswith("Skipped 2 *.json files"))
    assert f"{rtn.name} (not UTF-8 text)" in line and "cut.json (not valid JSON: " in line, line
    assert "| rtn |" not in report  # the unreadable record has no row: the line above says why


def test_a_nan_result_shows_as_nan_not_as_an_empty_cell(tmp_path, write_cell, speed_metrics):
    out = tmp_path / "res"
    write_cell(out, ACC, "fp16", "accuracy", {"ppl": (13.9, False)})
    write_cell(out, ACC, "rtn", "accuracy", {"ppl": (float("nan"), False)})
    write_cell(out, ACC, "quarot", "memory", {"total_quantized_linears": (5.1e7, False, "bytes"),
                                              "base_values": (5e7, False, "bytes")})
    report = write_tables(out).read_text()
    summary = report.split("## Summary")[1].split("## Figures")[0]
    header = next(x for x in summary.splitlines() if x.startswith("| model |")).split(" | ")
    ppl = header.index("perplexity ↓")
    cells = {x.split(" | ")[1]: x.split(" | ") for x in summary.splitlines() if x.startswith(f"| {ACC} |")}
    assert cells["rtn"][ppl] == "NaN" and cells["quarot"][ppl] == "" and cells["fp16"][ppl] == "13.90"


def test_a_nan_fp16_speed_gives_no_speedup_and_no_crash(tmp_path, write_cell, speed_metrics):
    throughput, latency = speed_metrics
    out = tmp_path / "res"
    for label, ppl in PPL.items():
        write_cell(out, ACC, label, "accuracy", {"ppl": (ppl, False)})
    nan = float("nan")
    write_cell(out, SPEED, "fp16", "throughput", throughput({4: nan, 8: 800.0}))
    write_cell(out, SPEED, "rtn", "throughput", throughput({4: 1000.0, 8: 1600.0}))
    write_cell(out, SPEED, "mosaicquant", "throughput", throughput({4: 800.0, 8: 1400.0}))
    write_cell(out, SPEED, "fp16", "latency", latency({1: nan, 64: 20.0}))
    write_cell(out, SPEED, "rtn", "latency", latency({1: 5.0, 64: 10.0}))
    cells = aggregate_cells(load_records(out))
    fp16 = cells[(SPEED, "fp16", "throughput")]
    # the speed-up is over the batches with a number on both sides
    assert decode_speedup(cells[(SPEED, "rtn", "throughput")], fp16) == (pytest.approx(2.0), [8])
    report = write_tables(out).read_text()
    assert "nan×" not in report.lower()
    rtn = next(x for x in report.split(f"### Throughput on {SPEED}")[1].splitlines() if x.startswith("| rtn |"))
    assert "| 1,000 ±1 | 1,600 ±1 (2.00×) |" in rtn, rtn
    qkv = next(x for x in report.split(f"### Latency on {SPEED}")[1].splitlines() if x.startswith("| rtn | qkv_proj"))
    assert "| 5.00 | 10.00 (2.00×) |" in qkv, qkv
    assert f"pareto__{ACC}__{SPEED}.png" in _embedded(report) and f"speedup_vs_m__{SPEED}.png" in _embedded(report)
    _assert_png(out / f"pareto__{ACC}__{SPEED}.png")

    # no batch with a number on both sides: no speed-up at all, so no Pareto figure (and no crash); the
    # tokens/s figure draws the one finite rate
    only = tmp_path / "only"
    write_cell(only, ACC, "fp16", "accuracy", {"ppl": (13.9, False)})
    write_cell(only, ACC, "rtn", "accuracy", {"ppl": (900.0, False)})
    write_cell(only, SPEED, "fp16", "throughput", throughput({4: nan}))
    write_cell(only, SPEED, "rtn", "throughput", throughput({4: 1000.0}))
    report = write_tables(only).read_text()
    assert _pngs(only) == [f"accuracy__{ACC}.png", f"decode_throughput__{SPEED}.png"]
    assert "nan×" not in report.lower()


def test_two_configurations_of_a_suite_are_never_averaged(tmp_path, write_cell):
    out = tmp_path / "res"
    for label, ppl in (("fp16", 13.91), ("rtn", 900.0)):
        write_cell(out, ACC, label, "accuracy:max_chunks=8", {"ppl": (ppl, False)}, suite_config={"max_chunks": 8})
        write_cell(out, ACC, label, "accuracy:seqlen=512", {"ppl": (3 * ppl, False)}, suite_config={"seqlen": 512})
    write_cell(out, ACC, "quarot", "accuracy:seqlen=512", {"ppl": (81.0, False)}, suite_config={"seqlen": 512})
    write_cell(out, ACC, "fp16", "memory", {"total_quantized_linears": (5.1e7, False, "bytes")})
    df = summary_table(load_records(out)).set_index("method")
    metric_cols = [c for c in df.columns if "/" in c]
    assert metric_cols == ["accuracy:max_chunks=8/ppl", "accuracy:seqlen=512/ppl", "memory/total_quantized_linears"]
    assert df.loc["fp16", "accuracy:max_chunks=8/ppl"] == pytest.approx(13.91)
    assert df.loc["fp16", "accuracy:seqlen=512/ppl"] == pytest.approx(41.73)
    assert df.loc["quarot", "accuracy:seqlen=512/ppl"] == pytest.approx(81.0)
    assert df.loc["fp16", "n_seeds"] == 1
    # one configuration per row: the plain suite/metric names of earlier reports
    one = tmp_path / "one"
    write_cell(one, ACC, "fp16", "accuracy:max_chunks=8", {"ppl": (13.91, False)})
    write_cell(one, ACC, "rtn", "accuracy:seqlen=512", {"ppl": (900.0, False)})
    assert [c for c in summary_table(load_records(one)).columns if "/" in c] == ["accuracy/ppl"]


def test_backend_cells_have_their_own_table_with_their_metrics(tmp_path, write_cell, speed_metrics):
    from dataclasses import replace
    from pathlib import Path

    from mosaicquant.harness.tensorrt_llm import parse_trtllm_bench

    fixtures = Path(__file__).parents[1] / "harness" / "fixtures"
    overview = parse_trtllm_bench((fixtures / "trtllm_bench_perf_overview.txt").read_text()).metrics
    legacy = parse_trtllm_bench((fixtures / "trtllm_bench_pytorch_legacy.txt").read_text()).metrics

    def faster(metrics, factor):
        # a method `factor` times as fast: rates up, times down; the workload's counts unchanged
        return {k: replace(m, value=m.value * factor if m.higher_is_better else m.value / factor)
                if m.unit not in (None, "tokens") else m for k, m in metrics.items()}

    out, trt = tmp_path / "res", "tensorrt-llm"
    write_cell(out, ACC, "fp16", "throughput", overview, backend=trt)
    write_cell(out, ACC, "modelopt:recipe=fp8", "throughput", faster(overview, 2.0), backend=trt,
               method_name="modelopt")
    write_cell(out, ACC, "modelopt", "throughput", status="unavailable", reason="no CUDA GPU", backend=trt)
    write_cell(out, ACC, "modelopt:recipe=fp8", "latency", faster(legacy, 1.25), backend=trt, method_name="modelopt")
    # in-process cells of the same model and suite keep their own table
    write_cell(out, ACC, "fp16", "throughput", speed_metrics[0]({4: 400.0}))
    write_cell(out, ACC, "rtn", "throughput", speed_metrics[0]({4: 1000.0}))
    report = write_tables(out).read_text()

    in_process = report.split(f"### Throughput on {ACC} (`throughput`)\n")[1].split("###")[0]
    assert "@tensorrt-llm" not in in_process and "No `fp16`" not in in_process and "(2.50×)" in in_process
    section = report.split(f"### Throughput on {ACC} (`throughput`), run by tensorrt-llm\n")[1].split("###")[0]
    rows = {x.split(" | ")[0].strip("| "): x for x in section.splitlines() if x.startswith("| ")}
    assert rows["metric"] == "| metric | unit | better | fp16@tensorrt-llm | modelopt:recipe=fp8@tensorrt-llm |"
    assert sorted(n for n in rows if n not in ("metric", "---|---|---|---|---|")) == sorted(overview)
    assert rows["output_throughput"] == "| output_throughput | tok/s | higher | 5,531 (1.00×) | 11,061 (2.00×) |"
    assert rows["ttft_p50_ms"] == "| ttft_p50_ms | ms | lower | 52,270 (1.00×) | 26,135 (2.00×) |"
    assert "- `modelopt@tensorrt-llm`: seed 0 not available: no CUDA GPU" in section
    # no fp16 run by the backend: values without speed-ups; the workload's counts have no direction
    latency = report.split(f"### Latency on {ACC} (`latency`), run by tensorrt-llm\n")[1].split("##")[0]
    assert f"No `fp16@tensorrt-llm` row for {ACC} in this directory" in latency
    assert "×)" not in latency.split("| metric |")[1]
    assert "| num_requests |  |  | 3,000 |" in latency and "| total_latency_ms | ms | lower | 14,851 |" in latency


def test_figures_of_models_with_the_same_last_name_do_not_overwrite_each_other(tmp_path, write_cell):
    out = tmp_path / "res"
    models = ("/ckpt/run1/model", "/ckpt/run2/model", "org1/X", "org2/X", "smollm2-135m")
    for i, model in enumerate(models):
        write_cell(out, model, "rtn", "memory", {"base_values": (1e6 * (i + 1), False, "bytes"),
                                                 "total_quantized_linears": (1e6 * (i + 1), False, "bytes")})
    report = write_tables(out).read_text()
    pngs = _pngs(out)
    assert len(pngs) == len(models) and sorted(_embedded(report)) == pngs, pngs
    assert "memory__smollm2-135m.png" in pngs  # a name no other model shares stays as it was
    assert sum(p.startswith("memory__model-") for p in pngs) == 2 and sum(p.startswith("memory__X-") for p in pngs) == 2
    captions = list(_embedded(report).values())
    for model in models:  # each figure's caption names its own model
        assert sum(c.startswith(f"Weight memory per method on {model},") for c in captions) == 1, model
