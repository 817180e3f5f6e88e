"""Paper-ready reports: the protocol block, human headings, mean ± spread, footnotes, LaTeX that compiles,
figures in three formats whose legends name only what is drawn."""

import re
import shutil
import subprocess

import pytest

from mosaicquant.harness.results import command_line, load_records
from mosaicquant.reports import plots
from mosaicquant.reports.cells import aggregate_cells
from mosaicquant.reports.headings import heading
from mosaicquant.reports.latex import escape_latex, render_latex
from mosaicquant.reports.protocol import protocol_section
from mosaicquant.reports.tables import paper_table, write_tables

ACC, SPEED = "smollm2-135m", "llama-3-8b-shapes"
ENV = {"gpu": None, "cpu": "x86_64", "cpu_model": "AMD EPYC 9654 96-Core Processor", "cpu_count": 2,
       "torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0", "mosaicquant": "0.1.0", "python": "3.12.1"}
CALIB = {"corpus": "enwiki-sample", "n_samples": 16, "seqlen": 1024, "seed": 0, "tokens_sha256": "f8d5f9ff08b77946"}
COMMAND = "mosaicquant run --model smollm2-135m --methods fp16,rtn --suites accuracy,memory"


def _set_fields(path, **fields):
    """Add top-level or ``model`` fields to a written record (the conftest writer sets the common ones)."""
    import json

    rec = json.loads(path.read_text())
    model = fields.pop("model", None)
    if model:
        rec["model"].update(model)
    rec.update(fields)
    path.write_text(json.dumps(rec))


def _quick_start_like(out, write_cell, seeds=(0,)):
    """An accuracy + memory result set with what a run of today records (env, calibration, command, timing)."""
    for seed in seeds:
        for label, ppl in (("fp16", 13.91), ("rtn", 18512.3), ("mosaicquant", 25.0 + seed)):
            calib = None if label in ("fp16", "rtn") else {**CALIB, "seed": seed}
            info = {"wbits": 16 if label == "fp16" else 4, "abits": 16 if label == "fp16" else 4, "kv_bits": 16,
                    "exec_path": "float (as loaded)" if label == "fp16"
                    else "simulated (fake-quant of the packed W4 + residual format)"}
            acc = write_cell(out, ACC, label, "accuracy:max_chunks=8", {
                "ppl": (ppl, False), "n_chunks": (8.0, True), "n_tokens_scored": (16376.0, True)}, seed=seed,
                info=info, env=ENV, suite_config={"seqlen": 2048, "max_chunks": 8, "batch_size": 1})
            mem = write_cell(out, ACC, label, "memory", {
                "total_quantized_linears": ((212336640.0 if label == "fp16" else 53395200.0), False, "bytes"),
                "linear_weight_ratio_vs_bf16": ((1.0 if label == "fp16" else 0.2515), False)}, seed=seed,
                info=info, env=ENV)
            for path in (acc, mem):
                _set_fields(path, calibration=calib, command=COMMAND, corpus="enwiki-sample",
                            test_corpus="enwiki-sample" if path == acc else None,
                            timing={"quantize_s": 300.0 + 10 * seed if label != "fp16" else 1.0},
                            model={"dtype": "float32"})


def test_protocol_block_states_what_the_records_hold(tmp_path, write_cell):
    out = tmp_path / "res"
    _quick_start_like(out, write_cell, seeds=(0, 1))
    report = write_tables(out).read_text()
    protocol = report.split("## Protocol")[1].split("## Summary")[0]
    assert "**Perplexity corpus (test split)**: enwiki-sample" in protocol
    assert "2048 x 8 chunks (16,376 tokens scored)" in protocol
    assert "**Calibration (train split)**: enwiki-sample, 16 x 1024 tokens; seed(s) 0, 1" in protocol
    assert "**dtype**: float32" in protocol
    assert "CPU AMD EPYC 9654 96-Core Processor, 2 cores (no GPU)" in protocol
    assert "torch 2.11.0, triton 3.6.0, transformers 5.17.0" in protocol
    assert f"`{COMMAND}`" in protocol
    assert report.index("## Protocol") < report.index("## Summary")


def test_a_field_no_record_holds_reads_not_recorded(tmp_path, write_cell):
    out = tmp_path / "res"
    write_cell(out, ACC, "fp16", "accuracy", {"ppl": (13.9, False)})  # no env, command, dtype, calibration
    write_cell(out, ACC, "rtn", "accuracy", {"ppl": (900.0, False)})
    lines = protocol_section(load_records(out))
    text = "\n".join(lines)
    for field in ("Perplexity corpus (test split)", "dtype", "Device", "Versions", "Command"):
        assert f"**{field}**: not recorded" in text, (field, text)
    # an accuracy record with its suite config but no chunk count says so instead of guessing a token count
    assert "(sequence length x chunks)**: not recorded" in text


def test_a_speed_only_report_on_random_weights_claims_no_corpus(tmp_path, write_cell, speed_metrics):
    throughput, _ = speed_metrics
    out = tmp_path / "res"
    for label, tok in (("fp16", 400.0), ("rtn", 900.0)):
        path = write_cell(out, SPEED, label, "throughput", throughput({4: tok}), env={**ENV, "gpu": "NVIDIA H100",
                                                                                     "driver": "580.1", "cuda": "13.0"})
        _set_fields(path, corpus="enwiki-sample", test_corpus=None)  # the run's default corpus, never read
    report = write_tables(out).read_text()
    assert "enwiki" not in report
    assert "**Perplexity corpus**: none (no record read a test corpus)" in report
    assert "GPU NVIDIA H100 (driver 580.1, CUDA 13.0); CPU AMD EPYC" in report
    # an older record without test_corpus: the speed suites never read text, so still no corpus
    older = tmp_path / "older"
    path = write_cell(older, SPEED, "fp16", "throughput", throughput({4: 400.0}))
    _set_fields(path, corpus="enwiki-sample")
    assert "enwiki" not in write_tables(older).read_text()


def test_summary_has_human_headings_units_arrows_and_spread(tmp_path, write_cell):
    out = tmp_path / "res"
    _quick_start_like(out, write_cell, seeds=(0, 1))
    table, footnotes = paper_table(load_records(out))
    cols = list(table.columns)
    assert cols == ["model", "method", "W", "A", "KV", "execution", "quantize (s)", "perplexity ↓",
                    "weight bytes vs BF16 (×) ↓", "quantized linear weights (MiB) ↓", "seeds", "notes"], cols
    rows = table.set_index("method")
    # two seeds 25 and 26: mean 25.50, standard deviation 0.707
    assert rows.loc["mosaicquant", "perplexity ↓"] == "25.50 ± 0.707"
    assert rows.loc["rtn", "perplexity ↓"] == "18,512"  # no spread recorded and equal seeds: no ±
    assert rows.loc["fp16", "quantized linear weights (MiB) ↓"] == "202.5"  # bytes shown in MiB
    assert rows.loc["mosaicquant", "quantize (s)"] == "305.0 ± 7.07" and rows.loc["mosaicquant", "seeds"] == "2"
    assert "ran in float32" in rows.loc["fp16", "notes"] and rows.loc["rtn", "notes"] == ""
    # long execution paths: a short label and a footnote holding the whole text, numbered once each
    assert rows.loc["mosaicquant", "execution"] == rows.loc["rtn", "execution"] == "simulated[^2]"
    assert footnotes == ["float (as loaded)", "simulated (fake-quant of the packed W4 + residual format)"]
    report = write_tables(out).read_text()
    summary = report.split("## Summary")[1].split("## Figures")[0]
    assert "accuracy/ppl" not in summary and "total_quantized_linears" not in summary
    assert "[^2]: simulated (fake-quant of the packed W4 + residual format)" in summary


@pytest.mark.parametrize(("suite", "name", "hib", "unit", "title"), [
    ("accuracy", "ppl", False, None, "perplexity ↓"),
    ("throughput", "decode_tok_s/b4", True, "tok/s", "decode tok/s (batch 4) ↑"),
    ("throughput", "prefill_tok_s", True, "tok/s", "prefill tok/s (batch 1) ↑"),
    ("latency", "linear_us/down_proj/m16", False, "us", "down linear, M = 16 (µs) ↓"),
    ("memory", "linear_weight_ratio_vs_bf16", False, None, "weight bytes vs BF16 (×) ↓"),
    ("memory", "residual_overhead_vs_base", False, None, "residual vs 4-bit base (%) ↓"),
    ("analysis", "recovered/hessian/0.1", True, None, "distortion recovered, hessian at 10% budget (%) ↑"),
    ("zeroshot", "piqa/acc_norm", True, None, "piqa acc_norm ↑"),
    ("mystery", "my_metric", True, "widgets", "mystery: my metric (widgets) ↑"),
])
def test_headings(suite, name, hib, unit, title):
    assert heading(suite, name, hib, unit).title == title


def _check_tabular(tex):
    """A LaTeX checker for what summary.tex uses: balanced braces, math shifts paired, no unescaped special,
    ASCII only, and every row of the tabular with as many cells as its column spec."""
    assert tex.isascii(), [c for c in tex if not c.isascii()]
    depth = 0
    for i, ch in enumerate(tex):
        if ch in "{}" and (i == 0 or tex[i - 1] != "\\"):
            depth += 1 if ch == "{" else -1
            assert depth >= 0, tex[max(0, i - 40):i + 1]
    assert depth == 0
    body = re.sub(r"\\[\\{}$&#_%]", "", tex)  # escaped characters and row ends
    assert body.count("$") % 2 == 0
    assert not re.search(r"(?<!\\)[_%#]", re.sub(r"\\[a-zA-Z]+", "", body)), "unescaped special"
    spec = re.search(r"\\begin\{tabular\}\{([lrc]+)\}", tex).group(1)
    rows = tex.split(r"\begin{tabular}")[1].split(r"\end{tabular}")[0].split("\n")[1:]
    data = [r for r in rows if r.strip() and r.strip() != r"\hline"]
    assert data, tex
    for row in data:
        assert row.endswith(r" \\"), row
        cells = re.split(r"(?<!\\)&", row[:-3])
        assert len(cells) == len(spec), (len(cells), len(spec), row)
    assert not re.search(r"\d\.\d+e[+-]\d", tex), "exponent notation"


def test_summary_tex_compiles_or_parses(tmp_path, write_cell):
    out = tmp_path / "res"
    _quick_start_like(out, write_cell)
    write_cell(out, ACC, "odd_name&100%#", "accuracy:max_chunks=8", {"ppl": (1.8234e4, False)},
               info={"wbits": 4, "abits": 4, "kv_bits": 16, "exec_path": "x_y {z} ~ $ ^ \\ Δ"})
    write_tables(out)
    tex = (out / "summary.tex").read_text()
    _check_tabular(tex)
    assert r"odd\_name\&100\%\#" in tex and "18,234" in tex and r"perplexity $\downarrow$" in tex
    assert r"\textsuperscript{1}" in tex  # the footnote marks of the execution paths
    if shutil.which("pdflatex"):
        doc = tmp_path / "doc.tex"
        doc.write_text("\\documentclass{article}\\begin{document}\\input{" + str(out / "summary.tex")
                       + "}\\end{document}\n")
        run = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", doc.name], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stdout[-3000:]
        assert (tmp_path / "doc.pdf").exists()


def test_the_tabular_checker_catches_what_breaks_latex():
    good = render_latex(__import__("pandas").DataFrame([{"method": "a_b", "x": "1"}]))
    _check_tabular(good)
    for bad in (good.replace(r"a\_b", "a_b"), good.replace(r"\\", "", 1).replace("& x", "& x & y"),
                good.replace("{lr}", "{lrr}"), good.replace(r"\{", "{", 1) + "{"):
        with pytest.raises(AssertionError):
            _check_tabular(bad)
    assert escape_latex("50% of a_b & {c}") == r"50\% of a\_b \& \{c\}"


def test_command_line_names_the_console_script():
    assert command_line(["/x/.venv/bin/mosaicquant", "run", "--model", "a b"]) == "mosaicquant run --model 'a b'"
    assert command_line(["bench.py", "--n", "3"]) == "bench.py --n 3"


@pytest.fixture
def drawn(monkeypatch):
    """The matplotlib figures the plots save, by file stem (saving still happens)."""
    figs = {}
    save = plots._save

    def keep(fig, path):
        figs[path.stem] = fig
        return save(fig, path)

    monkeypatch.setattr(plots, "_save", keep)
    return figs


def test_legends_name_only_what_is_drawn_and_spreads_are_error_bars(tmp_path, write_cell, speed_metrics, drawn):
    throughput, latency = speed_metrics
    out = tmp_path / "res"
    # rtn is both faster and more accurate than mosaicquant: the front is one point, so no line and no legend
    for label, ppl, tok in (("fp16", 13.9, 400.0), ("rtn", 12.0, 1000.0), ("mosaicquant", 25.0, 800.0)):
        write_cell(out, ACC, label, "accuracy", {"ppl": (ppl, False, None, 0.5)})
        write_cell(out, SPEED, label, "throughput", throughput({4: tok}))
        write_cell(out, SPEED, label, "latency", latency({1: 10.0 if label == "fp16" else 5.0, 64: 20.0}, spread=0.5))
        write_cell(out, ACC, label, "memory", {"base_values": (5e7, False, "bytes"),
                                               "total_quantized_linears": (5e7, False, "bytes"),
                                               "linear_weight_ratio_vs_bf16": (0.25, False)})
    report = write_tables(out).read_text()
    pareto = drawn[f"pareto__{ACC}__{SPEED}"].axes[0]
    assert pareto.get_legend() is None and not pareto.get_lines()[:-1]  # only the x = 1 guide line
    assert "so no front is drawn" in report
    # speed-up vs M: one error-bar series per method, with bars (the recorded spreads)
    speed_axes = drawn[f"speedup_vs_m__{SPEED}"].axes
    bars = [c for c in speed_axes[0].containers if c.has_yerr]
    assert len(bars) == 2, speed_axes[0].containers
    # bar charts put their legend outside the axes, where it covers no bar
    memory = drawn[f"memory__{ACC}"].axes[0].get_legend()
    anchor = memory.get_bbox_to_anchor().transformed(drawn[f"memory__{ACC}"].axes[0].transAxes.inverted())
    assert anchor.x0 > 1.0
    # the accuracy figure: perplexity bars with error bars, beside the weight bytes vs BF16
    acc = drawn[f"accuracy__{ACC}"].axes
    assert len(acc) == 2 and "perplexity" in acc[0].get_xlabel() and "BF16" in acc[1].get_xlabel()
    assert [t.get_text() for t in acc[0].get_yticklabels()] == ["fp16", "mosaicquant", "rtn"]
    assert any(getattr(c, "errorbar", None) is not None for c in acc[0].containers)
    assert plots.DPI >= 300


def test_aggregate_of_the_quick_start_like_set(tmp_path, write_cell):
    out = tmp_path / "res"
    _quick_start_like(out, write_cell, seeds=(0, 1))
    cell = aggregate_cells(load_records(out))[(ACC, "mosaicquant", "accuracy:max_chunks=8")]
    assert cell.metrics["ppl"].value == pytest.approx(25.5) and cell.metrics["ppl"].n == 2
