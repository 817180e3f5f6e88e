"""One notion of a valid record: run's finished check, report and compare accept the same records."""

import json
import math
import shutil
from pathlib import Path

import pytest

from mosaicquant.harness.cli import main
from mosaicquant.harness.results import SCHEMA, load_records, read_valid_record, record_problem, write_record
from mosaicquant.harness.runner import finished_record
from mosaicquant.reports.compare import compare_dirs
from mosaicquant.reports.tables import write_tables


def _truncate(path):
    text = path.read_text()
    path.write_text(text[: len(text) // 2])  # a writer cut off mid-file (not ours: ours rename whole files)


def _corrupt_middle_line(path):
    lines = path.read_text().splitlines()
    middle = len(lines) // 2
    lines[middle] = "%%% not json %%%"
    path.write_text("\n".join(lines) + "\n")
    return middle + 1


def _older_schema(path):
    rec = json.loads(path.read_text())
    rec["schema"] = "mosaicquant.result/0"
    path.write_text(json.dumps(rec, indent=2))


def _string_metric(path):
    rec = json.loads(path.read_text())
    name = next(iter(rec["metrics"]))
    rec["metrics"][name]["value"] = "12.5"
    path.write_text(json.dumps(rec, indent=2))


def _by_cell(out):
    return {(r["method"]["label"], r["suite"]["name"]): r for r in load_records(out)}


@pytest.fixture
def finished_sweep(tmp_path, tiny_llama_dir, tiny_corpus, rel, capsys):
    out = tmp_path / "res"
    args = rel.sweep_args(tiny_llama_dir, out, methods="fp16,rtn")
    assert main(args) == 0
    capsys.readouterr()
    return out, args


def test_damaged_records_are_named_recomputed_and_nothing_valid_is_dropped(finished_sweep, capsys, rel):
    out, args = finished_sweep
    before = _by_cell(out)
    files = {(r["method"]["label"], r["suite"]["name"]): r["_path"] for r in before.values()}
    damaged = {
        ("fp16", "memory"): _truncate,
        ("fp16", "accuracy"): _corrupt_middle_line,
        ("rtn", "memory"): _older_schema,
    }
    line = None
    for cell, damage in damaged.items():
        got = damage(Path(files[cell]))
        line = got if damage is _corrupt_middle_line else line
    untouched = {cell: Path(files[cell]).stat().st_mtime_ns for cell in files if cell not in damaged}

    skipped = []
    kept = load_records(out, skipped=skipped)
    assert [(r["method"]["label"], r["suite"]["name"]) for r in kept] == [("rtn", "accuracy")]
    why = {name: text for name, text in skipped}
    assert set(why) == {Path(files[c]).name for c in damaged}
    assert why[Path(files[("fp16", "accuracy")]).name].startswith(f"not valid JSON: Expecting") and \
        f"(line {line} column 1)" in why[Path(files[("fp16", "accuracy")]).name], why
    assert "line" in why[Path(files[("fp16", "memory")]).name]
    assert why[Path(files[("rtn", "memory")]).name] == (
        f"schema 'mosaicquant.result/0' (this version reads {SCHEMA!r})")
    # the run's finished check says the same: exactly the damaged cells are not finished
    for cell, path in files.items():
        assert (finished_record(Path(path)) is None) == (cell in damaged), cell

    # report still works and names the files; compare without a gate still works
    report = write_tables(out).read_text()
    assert "Skipped 3 *.json files that are not readable records" in report
    assert compare_dirs(out, out).exit_code == 0

    # run names each damaged record with why, recomputes it, and leaves the valid one alone
    assert main(args) == 0
    printed = capsys.readouterr().out
    for cell in damaged:
        assert f"warning: {files[cell]} is not a valid record (" in printed, printed
    assert "4 cells: 1 finished, 3 to run" in printed
    assert {cell: Path(files[cell]).stat().st_mtime_ns for cell in untouched} == untouched
    after = _by_cell(out)
    assert set(after) == set(before)
    for cell, rec in after.items():
        assert {k: m["value"] for k, m in rec["metrics"].items()} == \
            {k: m["value"] for k, m in before[cell]["metrics"].items()}, cell


@pytest.mark.parametrize("case, damage", [
    ("metric that is a string", lambda rec: rec["metrics"]["ppl"].update(value="12.5")),
    ("metric that is a bool", lambda rec: rec["metrics"]["ppl"].update(value=True)),
    ("metric without a value", lambda rec: rec["metrics"]["ppl"].pop("value")),
    ("status not a status", lambda rec: rec.update(status="done")),
    ("ok without metrics", lambda rec: rec.pop("metrics")),
    ("no suite label", lambda rec: rec["suite"].pop("label")),
    ("another schema version", lambda rec: rec.update(schema="mosaicquant.result/2")),
    ("not an object", None),
])
def test_finished_check_and_readers_agree_on_each_defect(tmp_path, case, damage):
    # before, run counted these as finished (status ok) while report and compare dropped them: a stuck cell
    rec = {"schema": SCHEMA, "status": "ok", "seed": 0, "model": {"name": "m"},
           "method": {"name": "rtn", "label": "rtn"}, "suite": {"name": "accuracy", "label": "accuracy"},
           "metrics": {"ppl": {"value": 12.5, "higher_is_better": False}}}
    path = tmp_path / "m__rtn__accuracy__s0__0123456789.json"
    write_record(path, rec)
    assert finished_record(path) is not None and len(load_records(tmp_path)) == 1
    if damage is None:
        path.write_text("[1, 2]")
    else:
        damage(rec)
        write_record(path, rec)
    skipped = []
    assert load_records(tmp_path, skipped=skipped) == [] and len(skipped) == 1, case
    assert finished_record(path) is None, case
    assert read_valid_record(path)[1] == skipped[0][1]


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_nan_or_infinite_metric_is_a_valid_measured_value(tmp_path, value):
    rec = {"schema": SCHEMA, "status": "ok", "model": {"name": "m"}, "method": {"name": "rtn", "label": "rtn"},
           "suite": {"name": "accuracy", "label": "accuracy"}, "metrics": {"ppl": {"value": value}}}
    assert record_problem(rec) is None
    path = write_record(tmp_path / "r.json", rec)
    assert finished_record(path) is not None and len(load_records(tmp_path)) == 1


def test_compare_fails_when_a_watched_base_record_is_unreadable(finished_sweep, tmp_path, capsys):
    out, _ = finished_sweep
    base = tmp_path / "base"
    shutil.copytree(out, base)
    assert main(["compare", str(base), str(out), "--fail-on", "ppl:5%"]) == 0
    capsys.readouterr()
    victim = next(p for p in sorted(base.glob("*.json")) if "__rtn__accuracy" in p.name)
    _truncate(victim)
    # before: the damaged cell dropped out of the gate and compare exited 0
    rc = main(["compare", str(base), str(out), "--fail-on", "ppl:5%", "--json", str(tmp_path / "c.json")])
    printed = capsys.readouterr().out
    assert rc == 1
    assert f"FAILED: 1 base file(s) are not valid records, so the watched cells they held cannot be checked: " \
           f"skipped 1 *.json file that is not a readable record: {victim.name} (not valid JSON" in printed, printed
    assert json.loads((tmp_path / "c.json").read_text())["exit_code"] == 1
    # without a gate nothing can fail, and the file is still named
    assert main(["compare", str(base), str(out)]) == 0
    assert victim.name in capsys.readouterr().out
