"""A local model is one model by its content: same name, other weights -> two rows; other path, same files -> no rerun."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mosaicquant.harness import assets, fingerprints
from mosaicquant.harness.cli import main
from mosaicquant.harness.models import model_fingerprint, model_key
from mosaicquant.harness.results import load_records
from mosaicquant.reports.tables import summary_table


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(fingerprints, "_memory", {})


def _other_weights(folder):
    weights = next(Path(folder).glob("*.safetensors"))
    tensors = load_file(weights)
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 0.01
    save_file(tensors, weights, metadata={"format": "pt"})


def _run(model, out, capsys):
    capsys.readouterr()
    rc = main(["run", "--model", str(model), "--methods", "fp16", "--suites", "memory", "--corpus", "tiny-text",
               "--out", str(out)])
    assert rc == 0
    return capsys.readouterr().out


def test_two_models_named_model_are_two_rows(tmp_path, tiny_llama_dir, tiny_corpus, capsys):
    first, second = tmp_path / "a" / "model", tmp_path / "b" / "model"
    shutil.copytree(tiny_llama_dir, first)
    shutil.copytree(tiny_llama_dir, second)
    _other_weights(second)
    assert model_fingerprint(str(first)) != model_fingerprint(str(second))
    out = tmp_path / "res"
    _run(first, out, capsys)
    _run(second, out, capsys)
    records = load_records(out)
    assert len(records) == 2 and {r["model"]["recorded_name"] for r in records} == {"model"}
    names = {r["model"]["name"] for r in records}
    assert names == {f"model [{model_fingerprint(str(p))[:8]}]" for p in (first, second)}
    # before, both grouped as one "model" cell: one row with two records averaged as if seeds
    table = summary_table(records)
    assert sorted(table["model"]) == sorted(names)


def test_one_model_by_another_path_is_not_recomputed(tmp_path, tiny_llama_dir, tiny_corpus, capsys, monkeypatch):
    original = tmp_path / "models" / "tiny"
    shutil.copytree(tiny_llama_dir, original)
    out = tmp_path / "res"
    assert "1 cells: 0 finished, 1 to run" in _run(original, out, capsys)
    files = sorted(out.glob("*.json"))
    link = tmp_path / "link-to-tiny"
    link.symlink_to(original)
    copy = tmp_path / "elsewhere" / "tiny"
    shutil.copytree(original, copy)
    monkeypatch.chdir(tmp_path / "models")
    for written in ("tiny", "./tiny/", str(link), str(copy)):
        assert "1 cells: 1 finished, 0 to run" in _run(written, out, capsys), written
    assert sorted(out.glob("*.json")) == files
    rec = load_records(out)[0]
    assert rec["model"]["fingerprint"] == model_fingerprint(str(original))
    assert model_key(str(copy)) == f"fingerprint:{rec['model']['fingerprint']}"
    # other weights at the same path are another model: computed, not taken for the finished one
    _other_weights(original)
    assert "1 cells: 0 finished, 1 to run" in _run(original, out, capsys)


def test_builtin_and_hub_names_keep_their_keys():
    assert model_key("smollm2-135m") == "smollm2-135m" and model_fingerprint("smollm2-135m") is None
    assert model_key("org/some-model") == "org/some-model"


def test_a_file_is_hashed_once_per_size_and_mtime(tmp_path, tiny_llama_dir, monkeypatch):
    folder = tmp_path / "tiny"
    shutil.copytree(tiny_llama_dir, folder)
    hashed = []
    real = assets.sha256_file
    monkeypatch.setattr(assets, "sha256_file", lambda p: hashed.append(Path(p).name) or real(p))
    first = model_fingerprint(str(folder))
    assert sorted(hashed) == sorted(p.name for p in folder.iterdir() if p.name != "generation_config.json")
    monkeypatch.setattr(fingerprints, "_memory", {})  # a new process: the cache on disk answers
    hashed.clear()
    assert model_fingerprint(str(folder)) == first and hashed == []
    (folder / "README.md").write_text("notes")  # not part of the model
    assert model_fingerprint(str(folder)) == first
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (folder / "config.json").write_text(json.dumps(cfg))
    assert model_fingerprint(str(folder)) != first and hashed == ["config.json"]


def test_a_gguf_file_is_keyed_by_its_bytes(tmp_path):
    a, b = tmp_path / "x" / "m.gguf", tmp_path / "y" / "m.gguf"
    for path, payload in ((a, b"GGUF" + os.urandom(64)), (b, b"GGUF" + os.urandom(64))):
        path.parent.mkdir()
        path.write_bytes(payload)
    assert model_fingerprint(str(a)) != model_fingerprint(str(b))
    shutil.copy(a, tmp_path / "copy.gguf")
    assert model_key(str(tmp_path / "copy.gguf")) == model_key(str(a))


def test_records_from_before_fingerprints_are_read_and_told_apart(tmp_path, tiny_llama_dir, tiny_corpus, capsys):
    out = tmp_path / "res"
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, folder)
    _run(folder, out, capsys)
    path = next(out.glob("*.json"))
    old = json.loads(path.read_text())
    del old["model"]["fingerprint"]
    old["method"]["label"] = "fp16-old"
    (out / path.name.replace("__fp16__", "__fp16-old__")).write_text(json.dumps(old))
    records = {r["method"]["label"]: r for r in load_records(out)}
    assert set(records) == {"fp16", "fp16-old"}
    fp = model_fingerprint(str(folder))
    assert records["fp16-old"]["model"]["name"] == "model [no fingerprint]"
    assert records["fp16"]["model"]["name"] == f"model [{fp[:8]}]"
    # alone in a folder, an older record keeps its recorded name
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / path.name).write_text(json.dumps(old))
    assert load_records(alone)[0]["model"]["name"] == "model"
