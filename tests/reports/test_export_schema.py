"""The published record schema, the pandas loader and the MLflow file-store export."""

import copy
import json
import math
from pathlib import Path

import pytest

import mosaicquant
from mosaicquant.harness import data
from mosaicquant.harness.cli import main
from mosaicquant.harness.results import command_line, load_records
from mosaicquant.reports.schema import SCHEMA_PATH, record_schema, validate_dir, validate_record

ROOT = Path(__file__).resolve().parents[2]
QUICK_START = ROOT / "benchmarks" / "results" / "smollm2_main"  # the README's quick start, committed
ACC, SPEED = "smollm2-135m", "llama-3-8b-shapes"

MOSAIC = "mosaicquant:block=16:base=rtn"  # the seeded method of the run


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_llama_dir):
    """A real run of the harness on the tiny random Llama (fp16 and RTN, accuracy and memory, two seeds)."""
    from mosaicquant.harness import data
    from tests.conftest import TINY_TEXT

    docs = {"train": TINY_TEXT[: len(TINY_TEXT) // 2 + 6], "test": TINY_TEXT[len(TINY_TEXT) // 2:]}
    data.CORPORA["tiny-text-export"] = data.Corpus(name="tiny-text-export", description="test text", offline=True,
                                                   loader=lambda split: docs[split])
    out = tmp_path_factory.mktemp("tiny-run") / "res"
    try:
        assert main(["run", "--model", tiny_llama_dir, "--methods", "fp16,rtn,mosaicquant:block=16:base=rtn",
                     "--suites", "accuracy:seqlen=32,memory", "--corpus", "tiny-text-export", "--seeds", "0,1",
                     "--calib-samples", "2", "--calib-seqlen", "32", "--max-chunks", "2", "--out", str(out)]) == 0
    finally:
        del data.CORPORA["tiny-text-export"]
    return out


def test_records_of_a_real_run_validate_against_the_schema(tiny_run):
    from tests.conftest import TINY_TEXT

    records = load_records(tiny_run)
    # fp16 and RTN are seed-independent: one record a suite; MosaicQuant one a suite and seed
    assert len(records) == 8
    assert validate_dir(tiny_run) == {}
    # what the protocol block reads is in every record the runner writes
    for rec in records:
        assert rec["command"] == command_line()  # this process's own command line (pytest's here)
        assert "cpu_model" in rec["env"] and rec["model"]["dtype"] == "float32"
        assert rec["test_corpus"] == ("tiny-text-export" if rec["suite"]["name"] == "accuracy" else None)
        summary = rec["corpus_summary"]
        if rec["test_corpus"] is None and rec["calibration"] is None:
            assert summary is None  # the cell read no text
            continue
        assert summary["corpus"] == "tiny-text-export" and summary["split_rule"] == data.EVERY_FIFTH_RULE
        assert summary["test"]["sha256"] == data.documents_sha256(TINY_TEXT[len(TINY_TEXT) // 2:])
        assert summary["train"]["documents"] == len(TINY_TEXT[: len(TINY_TEXT) // 2 + 6])


def test_the_committed_quick_start_set_validates():
    assert len(list(QUICK_START.glob("*.json"))) == 16
    assert validate_dir(QUICK_START) == {}
    assert main(["export", str(QUICK_START), "--check-schema"]) == 0


def test_the_schema_names_every_top_level_field_the_writer_writes(tiny_run):
    fields = set(record_schema()["properties"])
    for rec in load_records(tiny_run):
        assert {k for k in rec if not k.startswith("_")} <= fields, set(rec) - fields


def test_broken_records_fail_with_a_message_naming_the_field(tiny_run):
    good = json.loads(next(tiny_run.glob("*accuracy*.json")).read_text())
    assert validate_record(good) == []
    cases = [
        (lambda r: r.pop("model"), "required field 'model' is missing"),
        (lambda r: r.update(status="done"), "status: 'done' is not one of ['ok', 'failed', 'unavailable']"),
        (lambda r: r.update(seed="0"), "seed: str '0' is not of type integer"),
        (lambda r: r["metrics"]["ppl"].update(value="13"), "metrics.ppl.value: str '13' is not of type number"),
        (lambda r: r["metrics"]["ppl"].update(typo=1), "metrics.ppl: field 'typo' is not allowed"),
        (lambda r: r["calibration"].update(n_samples=0) if r["calibration"] else r.update(calibration={"n_samples": 0}),
         "calibration.n_samples: 0 is below the minimum 1"),
        (lambda r: r.update(schema="mosaicquant.result/2"), "schema: 'mosaicquant.result/2' is not"),
        (lambda r: r["model"].update(dtype="float64"), "model.dtype: 'float64' is not one of"),
    ]
    for change, message in cases:
        rec = copy.deepcopy(good)
        change(rec)
        errors = validate_record(rec)
        assert any(e.startswith(message) for e in errors), (message, errors)
    bad = tiny_run.parent / "bad"
    bad.mkdir()
    rec = copy.deepcopy(good)
    rec["seed"] = "zero"
    (bad / "r.json").write_text(json.dumps(rec))
    assert main(["export", str(bad), "--check-schema"]) == 1


def test_jsonschema_agrees_where_it_is_installed(tiny_run):
    jsonschema = pytest.importorskip("jsonschema", reason="the jsonschema package is not installed")
    schema = json.loads(SCHEMA_PATH.read_text())
    for path in tiny_run.glob("*.json"):
        jsonschema.validate(json.loads(path.read_text()), schema)


def test_load_results_is_one_row_per_cell_with_flat_metrics(tiny_run):
    df = mosaicquant.load_results(tiny_run)
    assert len(df) == 6 and dict(zip(df["method"], df["n_seeds"])) == {"fp16": 1, "rtn": 1, MOSAIC: 2}
    row = df[(df["method"] == MOSAIC) & (df["suite_name"] == "accuracy")].iloc[0]
    ppl = [r["metrics"]["ppl"]["value"] for r in load_records(tiny_run)
           if r["method"]["label"] == MOSAIC and r["suite"]["name"] == "accuracy"]
    assert len(ppl) == 2 and row["ppl"] == pytest.approx(sum(ppl) / 2) and row["seeds"] == "0,1"
    assert row["status"] == "ok" and row["wbits"] == 4 and row["dtype"] == "float32" and row["device"] == "CPU"
    assert row["quantize_s"] >= 0
    memory = df[(df["method"] == "fp16") & (df["suite_name"] == "memory")].iloc[0]
    assert memory["total_quantized_linears"] > 0 and math.isnan(memory["ppl"])  # not measured: NaN
    assert "ppl.spread" in df.columns and df["ppl"].dtype == float
    cols = list(df.columns)
    assert cols[:5] == ["model", "method", "suite", "method_name", "suite_name"]


def test_load_results_of_a_missing_folder_is_one_line_error(tmp_path):
    from mosaicquant.errors import UserInputError

    with pytest.raises(UserInputError, match="does not exist"):
        mosaicquant.load_results(tmp_path / "nope")


def _read_store(store):
    """The runs of an MLflow file store, read back from its layout: {run name: (meta, params, metrics, tags)}."""
    runs = {}
    for meta in store.glob("*/*/meta.yaml"):
        run = meta.parent
        fields = dict(line.split(": ", 1) for line in meta.read_text().splitlines())

        def files(sub):
            return {str(p.relative_to(run / sub)): p.read_text() for p in (run / sub).rglob("*") if p.is_file()}

        tags = files("tags")
        runs[tags["mlflow.runName"]] = (fields, files("params"), files("metrics"), tags)
    return runs


def test_export_writes_an_mlflow_file_store(tmp_path, tiny_run, capsys):
    store = tmp_path / "mlruns"
    assert main(["export", str(tiny_run), "--mlflow", f"file://{store}", "--experiment", "tiny"]) == 0
    assert "6 MLflow run(s) written" in capsys.readouterr().out
    experiments = list(store.glob("*/meta.yaml"))
    assert len(experiments) == 1 and 'name: "tiny"' in experiments[0].read_text()
    assert "experiment_id: \"1\"" in experiments[0].read_text()
    runs = _read_store(store)
    assert len(runs) == 6, sorted(runs)
    rec = next(r for r in load_records(tiny_run) if r["method"]["label"] == MOSAIC and r["suite"]["name"] == "accuracy")
    model, acc_label = rec["model"]["name"], rec["suite"]["label"]
    meta, params, metrics, tags = runs[f"{model} | {MOSAIC} | {acc_label}"]
    assert meta["status"] == "3" and meta["experiment_id"] == '"1"' and meta["run_id"] == meta["run_uuid"]
    assert params["method"] == MOSAIC and params["suite.seqlen"] == "32" and params["dtype"] == "float32"
    assert params["seeds"] == "0,1" and params["device"] == "CPU"
    stamp, value, step = metrics["ppl"].split()
    df = mosaicquant.load_results(tiny_run).set_index(["method", "suite"])
    assert float(value) == pytest.approx(df.loc[(MOSAIC, acc_label), "ppl"]) and step == "0"
    assert int(stamp) > 1_600_000_000_000 and tags["mosaicquant.status"] == "ok"
    mem = runs[f"{model} | rtn | memory"][2]
    assert "total_quantized_linears" in mem
    # a second export of the same folder replaces its runs (same ids), into the same experiment
    before = sorted(p.name for p in store.glob("*/*") if p.is_dir())
    assert main(["export", str(tiny_run), "--mlflow", str(store), "--experiment", "tiny"]) == 0
    assert sorted(p.name for p in store.glob("*/*") if p.is_dir()) == before
    # another experiment name gets its own id
    assert main(["export", str(tiny_run), "--mlflow", str(store), "--experiment", "other"]) == 0
    assert sorted(p.parent.name for p in store.glob("*/meta.yaml")) == ["1", "2"]


def test_export_refuses_a_remote_store_and_nothing_to_do(tmp_path, tiny_run, capsys):
    assert main(["export", str(tiny_run), "--mlflow", "http://localhost:5000"]) == 2
    assert "is not a local folder" in capsys.readouterr().err
    assert main(["export", str(tiny_run)]) == 2
    assert "nothing to do" in capsys.readouterr().err


def test_metric_keys_outside_mlflows_characters_are_replaced(tmp_path, write_cell):
    from mosaicquant.reports.export import export_mlflow

    out = tmp_path / "res"
    write_cell(out, ACC, "fp16", "zeroshot", {"piqa/acc_norm": (0.6, True, None, 0.01), "odd:key*": (1.0, True)})
    export_mlflow(out, tmp_path / "store")
    _, _, metrics, _ = next(iter(_read_store(tmp_path / "store").values()))
    assert set(metrics) == {"piqa/acc_norm", "piqa/acc_norm.spread", "odd_key_"}
