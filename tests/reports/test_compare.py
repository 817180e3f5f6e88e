"""``mosaicquant compare BASE NEW --fail-on ...``: regressions by direction, threshold and spread; bad input."""

import json

import pytest

from mosaicquant.errors import UserInputError
from mosaicquant.harness.cli import main
from mosaicquant.reports.compare import Threshold, compare_dirs, parse_fail_on

MODEL = "llama-3-8b-shapes"


def _sets(tmp_path, write_cell, speed_metrics, *, new_decode=900.0, spread=2.0, new_us=10.0, new_m8_us=20.0):
    """BASE and NEW with fp16 and rtn throughput + latency; only rtn's numbers move."""
    throughput, latency = speed_metrics
    base, new = tmp_path / "base", tmp_path / "new"
    for folder, decode, us, m8 in ((base, 1000.0, 10.0, 20.0), (new, new_decode, new_us, new_m8_us)):
        write_cell(folder, MODEL, "fp16", "throughput", throughput({4: 400.0, 8: 700.0}, 3000.0, spread))
        write_cell(folder, MODEL, "rtn", "throughput", throughput({4: decode, 8: 1500.0}, 3000.0, spread))
        write_cell(folder, MODEL, "fp16", "latency", latency({1: 30.0, 8: 40.0}))
        write_cell(folder, MODEL, "rtn", "latency", latency({1: us, 8: m8}, layers=("qkv_proj",)))
    return str(base), str(new)


def _row(out, method, metric):
    return next(line for line in out.splitlines() if f"| {method} |" in line and f"| {metric} |" in line)


def test_ten_percent_decode_drop_fails_at_five_percent(tmp_path, write_cell, speed_metrics, capsys):
    base, new = _sets(tmp_path, write_cell, speed_metrics, new_decode=900.0)
    assert main(["compare", base, new, "--fail-on", "decode_tok_s/b4:5%"]) == 1
    out = capsys.readouterr().out
    row = _row(out, "rtn", "decode_tok_s/b4")
    assert "| 1,000 | 900.0 | -10.00% | 5% |" in row and row.rstrip(" |").endswith("REGRESSION"), row
    assert "REGRESSION" not in _row(out, "fp16", "decode_tok_s/b4")
    assert "1 regression(s)" in out
    # the same drop passes a 15% threshold
    assert main(["compare", base, new, "--fail-on", "decode_tok_s/b4:15%"]) == 0


def test_change_within_the_recorded_spread_is_not_a_regression(tmp_path, write_cell, speed_metrics, capsys):
    # 10% down (100 tok/s) but each run's spread is 80: combined sqrt(80² + 80²) = 113 > 100
    base, new = _sets(tmp_path, write_cell, speed_metrics, new_decode=900.0, spread=80.0)
    assert main(["compare", base, new, "--fail-on", "decode_tok_s/b4:5%"]) == 0
    row = _row(capsys.readouterr().out, "rtn", "decode_tok_s/b4")
    assert "within spread" in row and "±113" in row, row
    # a spread of 60 (combined 85) no longer hides it
    base, new = _sets(tmp_path / "tight", write_cell, speed_metrics, new_decode=900.0, spread=60.0)
    assert main(["compare", base, new, "--fail-on", "decode_tok_s/b4:5%"]) == 1


def test_direction_lower_is_better(tmp_path, write_cell, speed_metrics, capsys):
    slower_base, slower = _sets(tmp_path / "slower", write_cell, speed_metrics, new_decode=1000.0, new_us=11.0)
    assert main(["compare", slower_base, slower, "--fail-on", "linear_us/qkv_proj/m1:5%"]) == 1
    assert "REGRESSION" in _row(capsys.readouterr().out, "rtn", "linear_us/qkv_proj/m1")
    faster_base, faster = _sets(tmp_path / "faster", write_cell, speed_metrics, new_decode=1000.0, new_us=9.0)
    assert main(["compare", faster_base, faster, "--fail-on", "linear_us/qkv_proj/m1:5%"]) == 0
    assert "improved" in _row(capsys.readouterr().out, "rtn", "linear_us/qkv_proj/m1")
    # and higher is better: decode up 10% is an improvement, not a regression
    up_base, up = _sets(tmp_path / "up", write_cell, speed_metrics, new_decode=1100.0)
    assert main(["compare", up_base, up, "--fail-on", "decode_tok_s:5%"]) == 0


def test_globs_and_name_families(tmp_path, write_cell, speed_metrics, capsys):
    # only M=8 got slower (+50%)
    base, new = _sets(tmp_path, write_cell, speed_metrics, new_decode=1000.0, new_m8_us=30.0)
    assert main(["compare", base, new, "--fail-on", "linear_us/*/m1:5%"]) == 0
    out = capsys.readouterr().out
    assert "linear_us/qkv_proj/m8" not in out and "| linear_us/qkv_proj/m1 |" in out
    assert main(["compare", base, new, "--fail-on", "linear_us/*:5%"]) == 1
    capsys.readouterr()
    # a name family: decode_tok_s covers decode_tok_s/b4 and /b8
    base2, new2 = _sets(tmp_path / "family", write_cell, speed_metrics, new_decode=900.0)
    assert main(["compare", base2, new2, "--fail-on", "decode_tok_s:5%"]) == 1
    out = capsys.readouterr().out
    assert "| decode_tok_s/b4 |" in out and "| decode_tok_s/b8 |" in out and "prefill" not in out


def test_exact_name_takes_its_own_threshold():
    t = parse_fail_on("decode_tok_s/*:5%, decode_tok_s/b32:20")
    assert t == [Threshold("decode_tok_s/*", 5.0), Threshold("decode_tok_s/b32", 20.0)]
    from mosaicquant.reports.compare import _threshold_for

    assert _threshold_for("decode_tok_s/b32", t).percent == 20.0
    assert _threshold_for("decode_tok_s/b4", t).percent == 5.0
    assert _threshold_for("prefill_tok_s", t) is None


def test_unmatched_and_failed_cells_are_listed_and_json(tmp_path, write_cell, speed_metrics, capsys):
    throughput, _ = speed_metrics
    base, new = _sets(tmp_path, write_cell, speed_metrics, new_decode=1000.0)
    write_cell(base, MODEL, "quarot", "throughput", throughput({4: 800.0}))
    write_cell(new, MODEL, "spinquant", "throughput", throughput({4: 800.0}))
    write_cell(base, MODEL, "atom", "throughput", throughput({4: 800.0}))
    write_cell(new, MODEL, "atom", "throughput", status="failed", error={"type": "RuntimeError", "message": "boom"})
    report = tmp_path / "cmp.json"
    assert main(["compare", base, new, "--fail-on", "decode_tok_s:5%", "--json", str(report)]) == 1
    out = capsys.readouterr().out
    assert "Cells only in base (1):\n  - llama-3-8b-shapes | quarot | throughput" in out
    assert "Cells only in new (1):\n  - llama-3-8b-shapes | spinquant | throughput" in out
    assert "FAILED in new (seed 0 failed: RuntimeError: boom)" in _row(out, "atom", "decode_tok_s/b4")
    # the watched number of the cell that is gone from new regresses too
    assert "missing in new (no such cell in new)" in _row(out, "quarot", "decode_tok_s/b4")
    data = json.loads(report.read_text())
    assert data["exit_code"] == 1 and data["regressions"] == 2
    assert data["only_in_base"] == [[MODEL, "quarot", "throughput"]]
    failed = [r for r in data["rows"] if r["regression"]]
    assert [(r["method"], r["metric"]) for r in failed] == [("atom", "decode_tok_s/b4"), ("quarot", "decode_tok_s/b4")]


def test_without_fail_on_everything_shared_is_compared_and_nothing_fails(tmp_path, write_cell, speed_metrics,
                                                                         capsys):
    base, new = _sets(tmp_path, write_cell, speed_metrics, new_decode=500.0)
    assert main(["compare", base, new]) == 0
    out = capsys.readouterr().out
    assert "-50.00%" in _row(out, "rtn", "decode_tok_s/b4") and "| linear_us/o_proj/m8 |" in out


@pytest.mark.parametrize(
    "fail_on, message",
    [
        ("decode_tok_s", "--fail-on entry 'decode_tok_s' is not METRIC:PCT"),
        (":5%", "--fail-on entry ':5%' is not METRIC:PCT"),
        ("decode_tok_s:fast", "--fail-on threshold 'fast' in 'decode_tok_s:fast' is not a percentage"),
        ("decode_tok_s:-5%", "is not a percentage: allowed a number >= 0"),
        ("decode_tok_s:5%,", "--fail-on entry '' is not METRIC:PCT"),
        ("decode_toks/*:5%", "--fail-on metric 'decode_toks/*' matches no metric in"),
    ],
)
def test_bad_fail_on_is_one_line_exit_2(tmp_path, write_cell, speed_metrics, capsys, fail_on, message):
    base, new = _sets(tmp_path, write_cell, speed_metrics)
    assert main(["compare", base, new, "--fail-on", fail_on]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mosaicquant: error:") and message in err[0], err
    assert captured.out == ""


def test_unknown_metric_names_what_exists(tmp_path, write_cell, speed_metrics, capsys):
    base, new = _sets(tmp_path, write_cell, speed_metrics)
    assert main(["compare", base, new, "--fail-on", "decode_tok/b4:5%"]) == 2
    err = capsys.readouterr().err
    assert "Did you mean: decode_tok_s/b4" in err, err
    assert "Available: decode_tok_s/*, linear_us/*, prefill_tok_s" in err, err


def test_missing_or_empty_directory_is_exit_2(tmp_path, write_cell, speed_metrics, capsys):
    base, _ = _sets(tmp_path, write_cell, speed_metrics)
    assert main(["compare", base, str(tmp_path / "missing"), "--fail-on", "decode_tok_s:5%"]) == 2
    assert "results directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["compare", str(tmp_path / "empty"), base]) == 2
    assert "holds no result records" in capsys.readouterr().err
    with pytest.raises(UserInputError, match="does not exist"):
        compare_dirs(tmp_path / "missing", base)


def test_a_changed_decoder_runtime_is_named_next_to_the_verdict(tmp_path, write_cell, speed_metrics, capsys):
    throughput, latency = speed_metrics
    info = {"wbits": 4, "abits": 4, "kv_bits": 16, "exec_path": "triton"}
    base, new = tmp_path / "base", tmp_path / "new"
    write_cell(base, MODEL, "rtn", "throughput", throughput({4: 600.0}), info=info)
    write_cell(new, MODEL, "rtn", "throughput", throughput({4: 1500.0}),
               info={**info, "speed": {"runtime": "fused"}})
    write_cell(base, MODEL, "rtn", "latency", latency({1: 10.0}), info=info)
    write_cell(new, MODEL, "rtn", "latency", latency({1: 10.0}), info={**info, "speed": {"runtime": "fused"}})
    assert main(["compare", str(base), str(new), "--fail-on", "decode_tok_s/b4:5%,linear_us/*:5%"]) == 0
    out = capsys.readouterr().out
    assert "improved (decoder runtime changed: base not recorded, new fused)" in _row(out, "rtn", "decode_tok_s/b4")
    # per-layer latency does not depend on the decoder runtime
    assert "runtime" not in _row(out, "rtn", "linear_us/qkv_proj/m1")


def test_each_side_names_the_code_its_records_ran(tmp_path, write_cell, speed_metrics, capsys):
    throughput, _ = speed_metrics
    base, new = tmp_path / "base", tmp_path / "new"
    old = {"commit": "aaaaaaaaaaaaaaaa", "dirty": False, "source_sha256": "1111222233334444"}
    write_cell(base, MODEL, "rtn", "throughput", throughput({4: 1000.0}), git=old)
    write_cell(new, MODEL, "rtn", "throughput", throughput({4: 990.0}),
               git={"commit": "bbbbbbbbbbbbbbbb", "dirty": True, "source_sha256": "5555666677778888"})
    write_cell(new, MODEL, "fp16", "throughput", throughput({4: 400.0}))  # a record from before the field
    assert main(["compare", str(base), str(new), "--json", str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out
    assert f"base: {base} (code: aaaaaaaaaa/1111222233334444)" in out
    assert f"new:  {new} (code: ?/?, bbbbbbbbbb*/5555666677778888)" in out
    saved = json.loads((tmp_path / "c.json").read_text())
    assert saved["base_code"] == ["aaaaaaaaaa/1111222233334444"]
    assert saved["new_code"] == ["?/?", "bbbbbbbbbb*/5555666677778888"]


def test_unreadable_files_are_named_per_side(tmp_path, write_cell, speed_metrics, capsys):
    base, new = _sets(tmp_path, write_cell, speed_metrics)
    (tmp_path / "new" / "cut.json").write_text('{"schema": "mosaicquant.result/1", "metr')
    (tmp_path / "new" / "utf16.json").write_bytes('{"schema": "mosaicquant.result/1"}'.encode("utf-16"))
    assert main(["compare", base, new, "--json", str(tmp_path / "c.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("base: ") and lines[1].startswith("new:  ")
    assert lines[2].strip().startswith("skipped 2 *.json files that are not readable records: cut.json (not valid JSON")
    assert "utf16.json (not UTF-8 text)" in lines[2]
    saved = json.loads((tmp_path / "c.json").read_text())
    assert saved["base_skipped"] == [] and [s["file"] for s in saved["new_skipped"]] == ["cut.json", "utf16.json"]


def test_a_nan_is_never_ok(tmp_path, write_cell, capsys):
    acc = "smollm2-135m"
    base, new = tmp_path / "base", tmp_path / "new"
    for folder, rtn, quarot in ((base, 900.0, float("nan")), (new, float("nan"), 27.0)):
        write_cell(folder, acc, "fp16", "accuracy", {"ppl": (13.9, False)})
        write_cell(folder, acc, "rtn", "accuracy", {"ppl": (rtn, False)})
        write_cell(folder, acc, "quarot", "accuracy", {"ppl": (quarot, False)})
    assert main(["compare", str(base), str(new), "--fail-on", "ppl:5%"]) == 1
    out = capsys.readouterr().out
    assert "| 900.0 | NaN |  | 5% |" in _row(out, "rtn", "ppl"), out
    assert _row(out, "rtn", "ppl").rstrip(" |").endswith("REGRESSION: not a number in new")
    # NaN in base: nothing to hold the new value to
    assert _row(out, "quarot", "ppl").rstrip(" |").endswith("not compared: not a number in base")
    assert "1 regression(s) in 3 watched" in out
    # not watched: printed as such, and nothing fails
    assert main(["compare", str(base), str(new)]) == 0
    assert _row(capsys.readouterr().out, "rtn", "ppl").rstrip(" |").endswith("| not a number in new")


def test_from_an_infinite_base_the_direction_decides(tmp_path, write_cell, capsys):
    acc = "smollm2-135m"
    base, new = tmp_path / "base", tmp_path / "new"
    write_cell(base, acc, "rtn", "accuracy", {"ppl": (float("inf"), False)})
    write_cell(new, acc, "rtn", "accuracy", {"ppl": (25.0, False)})
    write_cell(base, acc, "quarot", "accuracy", {"ppl": (float("inf"), False)})
    write_cell(new, acc, "quarot", "accuracy", {"ppl": (float("inf"), False)})
    assert main(["compare", str(base), str(new), "--fail-on", "ppl:5%"]) == 0
    out = capsys.readouterr().out
    assert "| inf | 25.00 | -100.00% | 5% |" in _row(out, "rtn", "ppl") and "improved" in _row(out, "rtn", "ppl")
    assert "| inf | inf | +0.00% | 5% |" in _row(out, "quarot", "ppl") and "| ok |" in _row(out, "quarot", "ppl")
    assert main(["compare", str(new), str(base), "--fail-on", "ppl:5%"]) == 1  # collapsing is a regression


def test_without_fail_on_failed_cells_and_missing_metrics_are_listed(tmp_path, write_cell, speed_metrics, capsys):
    throughput, _ = speed_metrics
    base, new = _sets(tmp_path, write_cell, speed_metrics)
    write_cell(base, MODEL, "atom", "throughput", throughput({4: 800.0}))
    write_cell(new, MODEL, "atom", "throughput", status="failed", error={"type": "RuntimeError", "message": "boom"})
    write_cell(base, MODEL, "quarot", "throughput", throughput({4: 800.0}))
    write_cell(new, MODEL, "quarot", "throughput", status="unavailable", reason="needs CUDA")
    write_cell(base, MODEL, "spinquant", "throughput", throughput({4: 800.0, 8: 1500.0}))
    write_cell(new, MODEL, "spinquant", "throughput", throughput({4: 800.0}))  # b8 no longer measured
    assert main(["compare", base, new, "--json", str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out
    assert ("Cells failed or unavailable in new (2):\n"
            f"  - {MODEL} | atom | throughput: seed 0 failed: RuntimeError: boom\n"
            f"  - {MODEL} | quarot | throughput: seed 0 not available: needs CUDA") in out, out
    assert _row(out, "spinquant", "decode_tok_s/b8").rstrip(" |").endswith("| missing in new")
    assert "0 regression(s)" in out
    saved = json.loads((tmp_path / "c.json").read_text())
    assert saved["failed_in_new"] == [
        {"cell": [MODEL, "atom", "throughput"], "status": "failed", "why": "seed 0 failed: RuntimeError: boom"},
        {"cell": [MODEL, "quarot", "throughput"], "status": "unavailable", "why": "seed 0 not available: needs CUDA"}]
    assert [(r["method"], r["verdict"]) for r in saved["rows"] if r["metric"] == "decode_tok_s/b8"] == [
        ("fp16", ""), ("rtn", ""), ("spinquant", "missing in new")]


def test_watched_numbers_gone_from_new_are_regressions(tmp_path, write_cell, speed_metrics, capsys):
    acc = "smollm2-135m"
    base, new = _sets(tmp_path, write_cell, speed_metrics)
    for label, ppl in (("fp16", 13.9), ("rtn", 900.0)):
        write_cell(base, acc, label, "accuracy", {"ppl": (ppl, False)})
    # NEW ran no accuracy cell at all: every watched perplexity is gone
    assert main(["compare", base, new, "--fail-on", "ppl:1%"]) == 1
    out = capsys.readouterr().out
    assert _row(out, "rtn", "ppl").rstrip(" |").endswith("| missing in new (no such cell in new)")
    assert "2 regression(s) in 2 watched of 2 compared metrics" in out
    # NEW's rtn record is cut short (unreadable): its cell is gone, and the file is named
    for label, ppl in (("fp16", 13.9), ("rtn", 2000.0)):
        path = write_cell(new, acc, label, "accuracy", {"ppl": (ppl, False)})
    path.write_text(path.read_text()[:100])
    assert main(["compare", base, new, "--fail-on", "ppl:1%"]) == 1
    out = capsys.readouterr().out
    assert "missing in new (no such cell in new)" in _row(out, "rtn", "ppl") and "| ok |" in _row(out, "fp16", "ppl")
    assert f"skipped 1 *.json file that is not a readable record: {path.name}" in out
    # a watched metric gone from a cell that is still there
    write_cell(new, acc, "rtn", "accuracy", {"ppl_wikitext": (20.0, False)})
    assert main(["compare", base, new, "--fail-on", "ppl:1%"]) == 1
    assert _row(capsys.readouterr().out, "rtn", "ppl").rstrip(" |").endswith("| missing in new")
    # a --fail-on metric that matches nothing in either set is still bad input
    assert main(["compare", base, new, "--fail-on", "ppl_c4:1%"]) == 2


def test_json_is_strict_with_nan_and_infinite_values(tmp_path, write_cell, capsys):
    acc = "smollm2-135m"
    base, new = tmp_path / "base", tmp_path / "new"
    write_cell(base, acc, "rtn", "accuracy", {"ppl": (900.0, False, None, float("inf"))})
    write_cell(new, acc, "rtn", "accuracy", {"ppl": (float("nan"), False)})
    write_cell(base, acc, "quarot", "accuracy", {"ppl": (float("inf"), False)})
    write_cell(new, acc, "quarot", "accuracy", {"ppl": (25.0, False)})
    assert main(["compare", str(base), str(new), "--fail-on", "ppl:5%", "--json", str(tmp_path / "c.json")]) == 1

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    saved = json.loads((tmp_path / "c.json").read_text(), parse_constant=refuse)
    rows = {r["method"]: r for r in saved["rows"]}
    assert (rows["rtn"]["base"], rows["rtn"]["new"], rows["rtn"]["regression"]) == (900.0, "NaN", True)
    assert (rows["quarot"]["base"], rows["quarot"]["new"], rows["quarot"]["change_percent"]) == ("inf", 25.0, -100.0)
