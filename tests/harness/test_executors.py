"""Executors: a sweep on a Dask LocalCluster (2 worker processes, 1 thread each) writes the
same records as the local executor, and a worker killed mid-sweep loses only its cell,
which a rerun redoes. Plus the settings' validation, the GPU grouping and the ``file:`` corpus."""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from mosaicquant.config import Config
from mosaicquant.errors import UserInputError
from mosaicquant.harness import data
from mosaicquant.harness.cli import main
from mosaicquant.harness.executors import ExecutorSettings, gpu_groups, make_executor, task_resources
from mosaicquant.harness.results import load_records
from mosaicquant.harness.spec import load_run_spec
from mosaicquant.registry import METHODS, register_method

# Workers run torch with one thread, the local sweep with this process's threads: float sums
# may be ordered differently, so metric values agree to this relative tolerance, not bit for bit.
METRIC_RTOL = 1e-5
DASK_WORKERS = "2"

# Ragged documents (uneven lengths, a line break inside some) so the split and windows are not regular.
CORPUS_DOCS = [
    "The quick brown fox jumps over the lazy dog, twice over and then once more.",
    "Quantization maps real numbers onto a small grid of integers;\nfour bits hold sixteen levels.",
    "Rotations spread outliers across channels.",
    "Calibration text is drawn from the training split, perplexity from the test split, never the reverse.",
    "Hadamard matrices are orthogonal\nand their entries are plus or minus one.",
    "Block sparse residuals correct the largest errors of a dense four-bit base at a small memory cost.",
    "A stitch in time saves nine.",
] * 5


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory) -> str:
    """A ``file:`` corpus that worker processes can read (an in-process registration they would not see)."""
    path = tmp_path_factory.mktemp("corpus") / "docs.txt"
    path.write_text("\n\n".join(CORPUS_DOCS) + "\n")
    return f"file:{path}"


@dataclass(frozen=True)
class _DieOnceConfig(Config):
    marker: str = ""


def _die_once(model, config, ctx):
    """Kill the process running it the first time (the marker file remembers); then a no-op."""
    marker = Path(config.marker)
    if not marker.exists():
        marker.write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    ctx.info.update(wbits=16, abits=16, kv_bits=16)
    return model


@pytest.fixture(scope="module", autouse=True)
def _die_once_method():
    # the method is defined in this test module, which worker processes cannot import: ship it by value
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    if "die-once-test" not in METHODS._entries:
        register_method("die-once-test", config=_DieOnceConfig)(_die_once)
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def _sweep(model, corpus, methods, out, extra=()):
    return main(["run", "--model", model, "--methods", methods, "--suites", "accuracy:seqlen=24,memory",
                 "--corpus", corpus, "--calib-samples", "3", "--calib-seqlen", "24", "--max-chunks", "3",
                 "--out", str(out), *extra])


def _by_cell(out):
    return {(r["method"]["label"], r["suite"]["label"]): r for r in load_records(out)}


def test_dask_sweep_equals_local_and_lost_worker_fails_only_its_cell(tmp_path, tiny_llama_dir, corpus_file, capsys):
    methods = "fp16,rtn:wbits=8:abits=8,mosaicquant:block=16:budget=0.25:base=rtn"
    assert _sweep(tiny_llama_dir, corpus_file, methods, tmp_path / "local") == 0
    # the same sweep through the engine, plus a method whose worker process is killed while it runs
    marker = tmp_path / "killed-once"
    killer = f"die-once-test:marker={marker}"
    out = tmp_path / "dask"
    dask_args = ["--executor", "dask", "--workers", DASK_WORKERS]
    assert _sweep(tiny_llama_dir, corpus_file, f"{methods},{killer}", out, dask_args) == 1
    assert marker.exists()
    local, dask = _by_cell(tmp_path / "local"), _by_cell(out)
    assert len(local) == 6 and len(dask) == 8 and set(local) < set(dask)
    for cell, rec in local.items():
        other = dask[cell]
        assert rec["status"] == other["status"] == "ok", cell
        assert rec["metrics"].keys() == other["metrics"].keys(), cell
        for name, metric in rec["metrics"].items():
            assert other["metrics"][name]["value"] == pytest.approx(metric["value"], rel=METRIC_RTOL), (cell, name)
        assert rec["calibration"] == other["calibration"], cell  # same tokens (sha256) drawn on the worker
        without_timing = [{k: v for k, v in r["method_info"].items() if k != "timing"} for r in (rec, other)]
        assert without_timing[0] == without_timing[1], cell
    ppl = {cell[0]: rec["metrics"]["ppl"]["value"] for cell, rec in local.items() if cell[1].startswith("accuracy")}
    assert len(set(ppl.values())) == 3, ppl  # the methods differ: the comparison is not between copies of one number
    # the killed worker's cells are recorded as failed, saying so; the other cells finished
    dead = [rec for cell, rec in dask.items() if cell not in local]
    assert len(dead) == 2 and all(r["status"] == "failed" and r["stage"] == "worker" for r in dead)
    assert all("worker running this cell died" in r["error"]["message"] for r in dead), dead[0]["error"]

    # the rerun redoes only the lost cells; finished records are not written again
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("*.json") if "die-once" not in p.name}
    capsys.readouterr()
    assert _sweep(tiny_llama_dir, corpus_file, f"{methods},{killer}", out, dask_args) == 0
    assert "8 cells: 6 finished, 2 to run" in capsys.readouterr().out
    assert kept == {p.name: p.stat().st_mtime_ns for p in out.glob("*.json") if "die-once" not in p.name}
    assert len(load_records(out)) == 8 and all(r["status"] == "ok" for r in load_records(out))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--executor", "dsak"], "Unknown executor 'dsak'. Did you mean: dask?"),
        (["--workers", "2"], "only apply to executor 'dask'"),
        (["--executor", "dask", "--workers", "0"], "workers=0 is not allowed: use an integer >= 1"),
        (["--executor", "dask", "--gpus", "2"], "gpus=2 starts GPU workers: it needs device 'cuda'"),
        (["--executor", "dask", "--gpus-per-cell", "2"], "gpus_per_cell=2 spreads a model over several GPUs"),
        (["--executor", "dask", "--scheduler", "tcp://h:8786", "--workers", "2"], "give one or the other"),
    ],
)
def test_bad_executor_settings_are_one_line_exit_2(args, message, tmp_path, tiny_llama_dir, corpus_file, capsys):
    rc = main(["run", "--model", tiny_llama_dir, "--methods", "fp16", "--suites", "accuracy", "--corpus", corpus_file,
               "--out", str(tmp_path / "r"), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0], err
    assert not list((tmp_path / "r").glob("*.json"))


def test_task_resources_and_gpu_groups(tiny_llama_dir, corpus_file):
    spec = load_run_spec(None, {"model": tiny_llama_dir, "methods": "fp16", "suites": "accuracy",
                                "corpus": corpus_file})
    assert task_resources(spec, ExecutorSettings(kind="dask")) == {"CPU": 1}
    spec.device = "cuda"
    assert task_resources(spec, ExecutorSettings(kind="dask", gpus_per_cell=3)) == {"GPU": 3}
    assert ExecutorSettings(kind="dask", gpus_per_cell=3).device_map == "auto"
    assert ExecutorSettings(kind="dask").device_map is None
    devices = ["3", "1", "2", "0", "5", "4", "7"]
    assert gpu_groups(devices, 6, 3) == [["3", "1", "2"], ["0", "5", "4"]]
    assert gpu_groups(devices, 7, 1) == [[d] for d in devices]
    with pytest.raises(UserInputError, match="not a multiple of gpus_per_cell=2"):
        gpu_groups(devices, 5, 2)
    with pytest.raises(UserInputError, match="shows 7 GPU"):
        gpu_groups(devices, 8, 1)
    spec.device = "cuda:1"
    with pytest.raises(UserInputError, match="use device 'cuda'"):
        make_executor(ExecutorSettings(kind="dask", scheduler="tcp://h:8786"), spec)


def test_file_corpus_split_and_errors(tmp_path):
    docs = ["first doc,\nsecond line", "b", "third  one", "d d", "e is test", "f", "g", "h", "i", "j is test", "k"]
    path = tmp_path / "docs.txt"
    # blank lines with stray whitespace and CRLF line ends separate documents too
    path.write_bytes(("\n \t\n\n".join(docs[:6]) + "\r\n\r\n" + "\n\n".join(docs[6:]) + "\n").encode())
    name = f"file:{path}"
    assert data.load_corpus(name, "test") == ["e is test", "j is test"]
    assert data.load_corpus(name, "train") == [d for d in docs if not d.endswith("is test")]
    assert data.resolve_corpus(name).offline
    with pytest.raises(UserInputError, match="is not a file"):
        data.resolve_corpus(f"file:{tmp_path / 'missing.txt'}")
    short = tmp_path / "short.txt"
    short.write_text("one\n\ntwo\n\nthree\n")
    with pytest.raises(UserInputError, match="holds 3 documents"):
        data.load_corpus(f"file:{short}", "test")
    with pytest.raises(UserInputError, match="Unknown corpus 'enwik-sample'"):
        data.resolve_corpus("enwik-sample")
