"""The guarded compare: protocol differences warn or refuse, speed compared as ratios to the set's own fp16
row, and the CI outputs (GitHub annotations, JUnit XML)."""

import json
from xml.etree import ElementTree as ET

import pytest

from mosaicquant.harness.cli import main
from mosaicquant.reports.compare import REFUSED_EXIT, compare_dirs

ACC, SPEED = "smollm2-135m", "llama-3-8b-shapes"
CPU = {"gpu": None, "cpu": "x86_64", "cpu_model": "AMD EPYC 9654", "cpu_count": 2, "cuda": None, "driver": None}
H100 = {**CPU, "gpu": "NVIDIA H100 80GB HBM3", "driver": "580.65", "cuda": "13.0"}
CALIB = {"corpus": "enwiki-sample", "n_samples": 16, "seqlen": 1024, "seed": 0, "tokens_sha256": "f8d5f9ff08b77946"}


def _accuracy_set(out, write_cell, *, calib=CALIB, env=CPU, dtype="float32", seqlen=2048, ppl=25.0):
    for label, value in (("fp16", 13.9), ("mosaicquant", ppl)):
        path = write_cell(out, ACC, label, "accuracy", {"ppl": (value, False)}, env=env,
                          suite_config={"seqlen": seqlen, "max_chunks": 8},
                          fields={"calibration": None if label == "fp16" else calib, "test_corpus": "enwiki-sample"})
        rec = json.loads(path.read_text())
        rec["model"]["dtype"] = dtype
        path.write_text(json.dumps(rec))


def test_the_same_protocol_gives_no_warning(tmp_path, write_cell):
    _accuracy_set(tmp_path / "a", write_cell)
    _accuracy_set(tmp_path / "b", write_cell, ppl=25.1)
    result = compare_dirs(tmp_path / "a", tmp_path / "b", "ppl:5%", strict=True)
    assert result.protocol == [] and result.exit_code == 0 and "differ in protocol" not in result.render()


def test_other_calibration_settings_warn_by_default_and_refuse_with_strict(tmp_path, write_cell, capsys):
    _accuracy_set(tmp_path / "a", write_cell)
    _accuracy_set(tmp_path / "b", write_cell, calib={**CALIB, "n_samples": 8, "tokens_sha256": "0123456789abcdef"})
    warned = compare_dirs(tmp_path / "a", tmp_path / "b", "ppl:5%")
    fields = {d.field: (d.base, d.new, d.cells) for d in warned.protocol}
    assert fields == {"calibration.n_samples": (("16",), ("8",), (f"{ACC} | mosaicquant | accuracy",)),
                      "calibration.tokens_sha256": (("f8d5f9ff08b77946",), ("0123456789abcdef",),
                                                    (f"{ACC} | mosaicquant | accuracy",))}
    assert warned.exit_code == 0 and not warned.refused
    assert "WARNING: base and new differ in protocol" in warned.render()
    assert "calibration.n_samples: base 16; new 8" in warned.render()
    # --strict: refused, exit 3, the message names the field on stderr too
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--strict"]) == REFUSED_EXIT
    captured = capsys.readouterr()
    assert "REFUSED (--strict)" in captured.out and "calibration.n_samples: base 16; new 8" in captured.err
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0


@pytest.mark.parametrize(("change", "fields"), [
    ({"env": H100}, {"device"}),  # a CPU run records no driver or CUDA: only the device differs
    ({"env": {**H100, "driver": "590.10", "gpu": "NVIDIA H200"}}, {"device", "driver"}),
    ({"dtype": "bfloat16"}, {"dtype"}),
    ({"seqlen": 512}, {"suite.seqlen"}),
])
def test_device_dtype_and_protocol_differences_are_named(tmp_path, write_cell, change, fields):
    _accuracy_set(tmp_path / "a", write_cell, env=H100 if "driver" in fields else CPU)
    _accuracy_set(tmp_path / "b", write_cell, **change)
    result = compare_dirs(tmp_path / "a", tmp_path / "b", strict=True)
    assert {d.field for d in result.protocol} == fields and result.exit_code == REFUSED_EXIT
    for name in fields:
        assert f"{name}: base " in result.protocol_message()
    assert json.loads(json.dumps(result.to_json()))["refused"] is True


def test_a_field_one_side_did_not_record_is_no_difference(tmp_path, write_cell):
    _accuracy_set(tmp_path / "a", write_cell, env={})  # an older record: no environment at all
    _accuracy_set(tmp_path / "b", write_cell, env=H100)
    assert compare_dirs(tmp_path / "a", tmp_path / "b", strict=True).protocol == []


def _speed_set(out, write_cell, speed_metrics, fp16, rtn, env=CPU):
    throughput, latency = speed_metrics
    write_cell(out, SPEED, "fp16", "throughput", throughput({4: fp16}, spread=0.0), env=env)
    write_cell(out, SPEED, "rtn", "throughput", throughput({4: rtn}, spread=0.0), env=env)
    write_cell(out, SPEED, "fp16", "latency", latency({1: 1e6 / fp16}, layers=("down_proj",), spread=0.0), env=env)
    write_cell(out, SPEED, "rtn", "latency", latency({1: 1e6 / rtn}, layers=("down_proj",), spread=0.0), env=env)


def test_speed_is_compared_as_ratios_to_the_fp16_row_of_the_same_run(tmp_path, write_cell, speed_metrics):
    # a machine twice as fast: every raw number doubles, the speed-ups vs fp16 stay 2.5x
    _speed_set(tmp_path / "a", write_cell, speed_metrics, fp16=400.0, rtn=1000.0)
    _speed_set(tmp_path / "b", write_cell, speed_metrics, fp16=800.0, rtn=2000.0)
    result = compare_dirs(tmp_path / "a", tmp_path / "b", "vs_fp16/*:5%")
    rows = {(r.method, r.metric): r for r in result.rows}
    assert set(rows) == {("rtn", "vs_fp16/decode_tok_s/b4"), ("rtn", "vs_fp16/linear_us/down_proj/m1")}
    ratio = rows[("rtn", "vs_fp16/decode_tok_s/b4")]
    assert ratio.base == pytest.approx(2.5) and ratio.new == pytest.approx(2.5) and ratio.verdict == "ok"
    assert rows[("rtn", "vs_fp16/linear_us/down_proj/m1")].base == pytest.approx(2.5)
    assert result.exit_code == 0
    # the raw numbers would have "improved" by 100%: the ratios are what is held
    raw = {r.metric: r for r in compare_dirs(tmp_path / "a", tmp_path / "b", "decode_tok_s:5%").rows}
    assert raw["decode_tok_s/b4"].change == pytest.approx(1.0)
    # the method lost ground against BF16 on the new machine: 2.0x instead of 2.5x is a regression
    _speed_set(tmp_path / "c", write_cell, speed_metrics, fp16=800.0, rtn=1600.0)
    worse = compare_dirs(tmp_path / "a", tmp_path / "c", "vs_fp16/*:5%")
    assert {r.metric for r in worse.regressions} == {"vs_fp16/decode_tok_s/b4", "vs_fp16/linear_us/down_proj/m1"}
    assert worse.exit_code == 1


def test_github_annotations_and_junit_xml(tmp_path, write_cell, speed_metrics, capsys):
    _speed_set(tmp_path / "a", write_cell, speed_metrics, fp16=400.0, rtn=1000.0)
    _speed_set(tmp_path / "b", write_cell, speed_metrics, fp16=400.0, rtn=700.0, env=H100)
    junit = tmp_path / "compare.xml"
    code = main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--fail-on", "vs_fp16/decode_tok_s:5%",
                 "--format", "github", "--junit", str(junit)])
    assert code == 1
    lines = capsys.readouterr().out.splitlines()
    errors = [x for x in lines if x.startswith("::error ")]
    warnings = [x for x in lines if x.startswith("::warning ")]
    rtn_file = next(p for p in (tmp_path / "b").glob(f"{SPEED}__rtn__throughput*.json"))
    assert len(errors) == 1, lines
    assert errors[0].startswith(f"::error file={rtn_file},title=regression%3A vs_fp16/decode_tok_s/b4::"), errors[0]
    assert "REGRESSION (-30.00%25), allowed 5%25; base 2.50, new 1.75" in errors[0]  # % escaped for GitHub
    assert [w.split("::")[1] for w in warnings] == ["warning title=protocol differs%3A device"], warnings
    tree = ET.parse(junit).getroot()
    suite = tree.find("testsuite")
    cases = suite.findall("testcase")
    assert [(c.get("classname"), c.get("name")) for c in cases] == [
        (f"{SPEED}.rtn.throughput", "vs_fp16/decode_tok_s/b4"), ("mosaicquant.compare", "protocol")]
    assert cases[0].find("failure") is not None and "base 2.50, new 1.75" in cases[0].find("failure").text
    assert cases[1].find("failure") is None and "WARNING" in cases[1].find("system-out").text
    assert suite.get("failures") == "1" and suite.get("tests") == "2"
    # --strict: the protocol case fails too, and the exit code says refused
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--strict", "--format", "github",
                 "--junit", str(junit)]) == REFUSED_EXIT
    out = capsys.readouterr().out
    assert "::error title=protocol differs%3A device::" in out
    protocol = [c for c in ET.parse(junit).getroot().iter("testcase") if c.get("name") == "protocol"][0]
    assert "NVIDIA H100" in protocol.find("failure").text


def test_annotation_text_is_escaped(tmp_path, write_cell):
    from mosaicquant.reports.compare import _gh_data, _gh_property

    assert _gh_data("50%\nnext") == "50%25%0Anext"
    assert _gh_property("a:b,c") == "a%3Ab%2Cc"
