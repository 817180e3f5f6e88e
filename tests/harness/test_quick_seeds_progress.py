"""The ``--quick`` preset, seed-independent cells run once, and the progress bars (stderr only)."""

import io
import json
import re
from pathlib import Path

import pytest
import torch

from mosaicquant import progress
from mosaicquant.errors import UserInputError
from mosaicquant.harness.cli import build_parser, main
from mosaicquant.harness.perplexity import evaluate_perplexity
from mosaicquant.harness.runner import plan_cells, seed_independent
from mosaicquant.harness.spec import PRESETS, load_run_spec
from mosaicquant.registry import get_method, get_suite

_OVERRIDE_KEYS = ("model", "methods", "suites", "seeds", "corpus", "calib_samples", "calib_seqlen", "max_chunks",
                  "out", "device", "dtype", "backend")


def _overrides(argv):
    args = build_parser().parse_args(["run", *argv])
    return args, {k: getattr(args, k) for k in _OVERRIDE_KEYS}


def test_quick_preset_fills_the_small_comparison():
    args, over = _overrides(["--quick"])
    spec = load_run_spec(None, over, preset="quick" if args.quick else None)
    quick = PRESETS["quick"]
    assert spec.preset == "quick"
    assert spec.model == quick["model"] == "smollm2-135m"
    assert [m.label for m in spec.methods] == quick["methods"].split(",")
    assert (spec.calib_samples, spec.calib_seqlen, spec.out) == (quick["calib_samples"], quick["calib_seqlen"],
                                                                quick["out"])
    (suite,) = spec.suites
    assert (suite.name, suite.config.seqlen, suite.config.max_chunks) == ("accuracy", 128, quick["max_chunks"])
    assert spec.to_dict()["preset"] == "quick"
    configs = {m.name: m.config for m in spec.methods}
    assert set(configs) == {"fp16", "rtn", "quarot", "mosaicquant"}
    # no GPTQ pass and no least-squares block fits: the costs a CPU minute cannot hold
    assert configs["quarot"].w_quant == "rtn" and not configs["quarot"].w_clip_search
    assert (configs["mosaicquant"].base, configs["mosaicquant"].score) == ("rtn", "delta")
    assert not configs["rtn"].w_clip_search


def test_options_beside_quick_override_the_preset():
    args, over = _overrides(["--quick", "--methods", "fp16,rtn:wbits=8:abits=8", "--max-chunks", "2",
                             "--calib-samples", "2", "--out", "elsewhere"])
    spec = load_run_spec(None, over, preset="quick")
    assert [m.label for m in spec.methods] == ["fp16", "rtn:wbits=8:abits=8"]
    assert spec.suites[0].config.max_chunks == 2 and spec.suites[0].config.seqlen == 128
    assert (spec.calib_samples, spec.calib_seqlen, spec.out) == (2, PRESETS["quick"]["calib_seqlen"], "elsewhere")


def test_a_spec_file_overrides_the_preset_and_the_command_line_overrides_both(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("methods: [fp16]\ncalib_samples: 3\n")
    spec = load_run_spec(str(path), {"calib_samples": 5}, preset="quick")
    assert [m.label for m in spec.methods] == ["fp16"]
    assert spec.calib_samples == 5 and spec.model == "smollm2-135m"


def test_an_unknown_preset_is_named_with_the_allowed_ones():
    with pytest.raises(UserInputError, match=r"preset='quik' is not allowed: choose one of 'quick'"):
        load_run_spec(None, {}, preset="quik")


def test_seed_independence_is_declared_on_the_registry():
    assert not get_method("fp16").seeded and not get_method("rtn").seeded
    assert get_method("quarot").seeded and get_method("mosaicquant").seeded
    assert not get_suite("accuracy").seeded and not get_suite("memory").seeded
    assert get_suite("zeroshot").seeded and get_suite("throughput").seeded


def test_plan_runs_seed_independent_cells_at_the_first_seed_only(tiny_llama_dir, tmp_path):
    spec = load_run_spec(None, {"model": tiny_llama_dir, "methods": "fp16,rtn,quarot", "suites": "accuracy",
                                "seeds": "3,1", "out": str(tmp_path)})
    planned = [(c.method.label, c.seed) for c in plan_cells(spec)]
    assert planned == [("fp16", 3), ("rtn", 3), ("quarot", 3), ("quarot", 1)]
    assert seed_independent(spec.methods[0], spec.suites[0]) and not seed_independent(spec.methods[2], spec.suites[0])


def test_two_seed_sweep_runs_fp16_once_resumes_and_reports(tiny_llama_dir, tiny_corpus, tmp_path, capsys):
    out = tmp_path / "res"
    argv = ["run", "--model", tiny_llama_dir, "--methods", "fp16,quarot", "--suites", "accuracy:seqlen=32",
            "--corpus", tiny_corpus, "--calib-samples", "2", "--calib-seqlen", "16", "--max-chunks", "2",
            "--seeds", "0,1", "--out", str(out), "--progress", "off"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.count("quantizing: fp16") == 1 and printed.count("quantizing: quarot") == 2
    records = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    by_method = {}
    for rec in records:
        by_method.setdefault(rec["method"]["label"], []).append(rec)
    assert [r["seed"] for r in by_method["fp16"]] == [0]
    assert by_method["fp16"][0]["seed_independent"] is True
    assert sorted(r["seed"] for r in by_method["quarot"]) == [0, 1]
    assert all(r["seed_independent"] is False for r in by_method["quarot"])

    assert main(argv) == 0  # resume: nothing to run, fp16 not planned at seed 1
    assert "3 cells: 3 finished, 0 to run" in capsys.readouterr().out

    assert main(["report", str(out)]) == 0
    report = (out / "report.md").read_text()
    rows = {}
    for line in report.split("## Summary")[1].splitlines():  # the summary table's rows come first
        if line.startswith("|") and line.split("|")[2].strip() in ("fp16", "quarot"):
            rows.setdefault(line.split("|")[2].strip(), line)
    assert "1 (seed-independent)" in rows["fp16"] and "±" not in rows["fp16"]
    assert "| 2 |" in rows["quarot"] and "seed-independent" not in rows["quarot"]
    assert "runs once, at the sweep's first seed" in report


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_modes_choose_where_bars_show(monkeypatch):
    assert progress.current() == "auto"
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert not progress.shown()  # auto: stderr is not a terminal
    monkeypatch.setattr("sys.stderr", _Terminal())
    assert progress.shown()
    with progress.use("off"):
        assert not progress.shown()
    with progress.use("on"):
        monkeypatch.setattr("sys.stderr", io.StringIO())
        assert progress.shown()
    with pytest.raises(UserInputError, match=r"progress='loud' is not allowed: choose one of 'auto', 'on', 'off'"):
        with progress.use("loud"):
            pass


def _tiny_lm(vocab=50):
    torch.manual_seed(0)

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, 16)
            self.head = torch.nn.Linear(16, vocab)

        def forward(self, input_ids, use_cache=False):
            return self.head(self.emb(input_ids))

    return LM()


def test_perplexity_bar_goes_to_stderr_with_an_eta_and_changes_nothing(monkeypatch, capsys):
    model = _tiny_lm()
    tokens = torch.randint(0, 50, (4 * 33,), generator=torch.Generator().manual_seed(1))
    with progress.use("off"):
        quiet = evaluate_perplexity(model, tokens, seqlen=33)
    assert capsys.readouterr().err == ""
    with progress.use("on"):
        shown = evaluate_perplexity(model, tokens, seqlen=33)
    captured = capsys.readouterr()
    assert shown == quiet
    assert "[mosaicquant] perplexity" in captured.err
    assert re.search(r"4/4 \[\d\d:\d\d<\d\d:\d\d", captured.err), captured.err  # done, elapsed<eta
    assert captured.out == ""


def test_calibration_and_layer_bars_show_in_a_sweep_and_stay_out_of_records(tiny_llama_dir, tiny_corpus, tmp_path,
                                                                            capsys):
    out = tmp_path / "res"
    assert main(["run", "--model", tiny_llama_dir, "--methods", "quarot,rtn", "--suites", "accuracy:seqlen=32",
                 "--corpus", tiny_corpus, "--calib-samples", "2", "--calib-seqlen", "16", "--max-chunks", "2",
                 "--out", str(out), "--progress", "on"]) == 0
    err = capsys.readouterr().err
    for bar in ("calibration inputs", "calibrate + quantize", "quantize", "perplexity"):
        assert f"[mosaicquant] {bar}" in err, bar
    assert "2/2 [" in err  # the tiny Llama's two layers
    for path in Path(out).glob("*.json"):
        assert "[mosaicquant]" not in path.read_text() and "it/s" not in path.read_text()
