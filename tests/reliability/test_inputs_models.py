"""Damaged model files: named in one line with exit 2 when the cheap header checks find them, a failed
record per cell (stage ``load``) when only the loader does (the same on a Dask worker), and a damaged
converted cache found and rebuilt or named."""

import json
import shutil
import struct

import pytest
import torch

from mosaicquant.harness import assets, models
from mosaicquant.harness.cli import main
from mosaicquant.errors import AssetError, UserInputError
from mosaicquant.harness.results import load_records


def _safetensors(path, tensors=None):
    from safetensors.torch import save_file

    save_file(tensors or {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8)}, str(path))
    return path


def _folder(tmp_path, name="m"):
    """A model folder that passes the header checks (config.json and one safetensors file)."""
    folder = tmp_path / name
    folder.mkdir()
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
              "max_position_embeddings": 256}
    (folder / "config.json").write_text(json.dumps(config))
    _safetensors(folder / "model.safetensors")
    return folder


def _gguf(path):
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.embedding_length", 64)
    writer.add_uint32("llama.context_length", 256)
    writer.add_tensor("w", torch.ones(32, 32).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _truncate(path, keep):
    data = path.read_bytes()
    path.write_bytes(data[:keep if keep >= 0 else len(data) + keep])
    return path


def _damage(tmp_path, case):
    """Build the damaged model of ``case``; returns (model spec, the file the message must name)."""
    if case.startswith("gguf"):
        path = tmp_path / "model.gguf"
        if case == "gguf-empty":
            path.write_bytes(b"")
        elif case == "gguf-random":
            path.write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0))
                             .to(torch.uint8).numpy().tobytes())
        elif case == "gguf-truncated-header":
            path.write_bytes(b"GGUF\x03\x00")
        elif case == "gguf-bad-version":
            _gguf(path)
            data = bytearray(path.read_bytes())
            data[4:8] = struct.pack("<I", 99)
            path.write_bytes(bytes(data))
        elif case == "gguf-truncated":
            _truncate(_gguf(path), -1000)
        return str(path), path
    folder = _folder(tmp_path)
    config, weights = folder / "config.json", folder / "model.safetensors"
    if case == "config-not-json":
        config.write_text('{"model_type": "llama",')
        return str(folder), config
    if case == "config-not-utf8":
        config.write_bytes(b'{"model_type": "ll\xffama"}')
        return str(folder), config
    if case == "config-not-object":
        config.write_text("[1, 2]")
        return str(folder), config
    if case == "config-missing":
        config.unlink()
        return str(folder), folder
    if case == "safetensors-empty":
        weights.write_bytes(b"")
    elif case == "safetensors-truncated":
        _truncate(weights, -17)
    elif case == "safetensors-header-truncated":
        _truncate(weights, 20)
    elif case == "safetensors-garbage":
        weights.write_bytes(struct.pack("<Q", 12) + b"not json!!!!" + b"\0" * 64)
    elif case == "safetensors-huge-length":
        weights.write_bytes(struct.pack("<Q", 2**62) + b"\0" * 64)
    elif case == "index-missing-shard":
        weights.rename(folder / "model-00001-of-00002.safetensors")
        index = {"weight_map": {"w": "model-00001-of-00002.safetensors", "v": "model-00002-of-00002.safetensors"}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        return str(folder), folder / "model.safetensors.index.json"
    elif case == "no-weights":
        weights.unlink()
        return str(folder), folder
    return str(folder), weights


DAMAGE_CASES = [
    ("gguf-empty", "is damaged: the file is empty"),
    ("gguf-random", "does not start with the GGUF magic b'GGUF'"),
    ("gguf-truncated-header", "fewer than the 24-byte GGUF header: truncated"),
    ("gguf-bad-version", "GGUF version 99 is not readable (readable: 2, 3)"),
    ("gguf-truncated", "its metadata or tensor table cannot be read"),
    ("config-not-json", "is damaged: it is not valid JSON (Expecting"),
    ("config-not-utf8", "is damaged: it is not UTF-8 text (byte 0xff at offset 18)"),
    ("config-not-object", "is damaged: it is not a JSON object of settings"),
    ("config-missing", "has no config.json"),
    ("safetensors-empty", "fewer than the 8-byte header length: empty or truncated"),
    ("safetensors-truncated", "bytes of tensor data but the file holds"),
    ("safetensors-header-truncated", "after the length field: truncated"),
    ("safetensors-garbage", "its header is not JSON"),
    ("safetensors-huge-length", "its header length field reads 4611686018427387904 bytes: not a safetensors file"),
    ("index-missing-shard", "it lists shard(s) the folder does not hold: model-00002-of-00002.safetensors"),
    ("no-weights", "it holds no weights (*.safetensors or pytorch_model*.bin)"),
]


@pytest.mark.parametrize("case, message", DAMAGE_CASES, ids=[c[0] for c in DAMAGE_CASES])
def test_damaged_model_file_is_named_exit_2_before_any_load(case, message, tmp_path, monkeypatch, capsys):
    loads = []
    monkeypatch.setattr(models, "load_model", lambda *a, **k: loads.append(a))
    spec, named = _damage(tmp_path, case)
    rc = main(["run", "--model", spec, "--methods", "fp16", "--suites", "accuracy:seqlen=32",
               "--out", str(tmp_path / "res")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and err[0].startswith("mosaicquant: error:"), err
    assert str(named) in err[0] and message in err[0], err[0]
    assert not loads and not list(tmp_path.glob("res/**/*.json"))


def test_sound_files_pass_the_checks_and_give_the_dimensions(tmp_path):
    folder = _folder(tmp_path)
    assert models.check_model_files(str(folder)).kind == "folder"
    assert models.model_dimensions(str(folder)) == {"hidden_size": 64, "intermediate_size": 96,
                                                    "num_attention_heads": 4, "head_dim": 16,
                                                    "max_position_embeddings": 256}
    gguf = _gguf(tmp_path / "ok.gguf")
    assert models.check_model_files(str(gguf)).kind == "gguf"
    assert models.model_dimensions(str(gguf)) == {"hidden_size": 64, "max_position_embeddings": 256}


def test_load_model_refuses_a_damaged_file_too(tmp_path):
    spec, named = _damage(tmp_path, "safetensors-truncated")
    with pytest.raises(UserInputError, match="is damaged: its header describes"):
        models.load_model(spec)


def _load_time_broken(tiny_llama_dir, tmp_path):
    """A folder whose files pass the header checks but that transformers cannot load."""
    folder = tmp_path / "broken-llama"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "no-such-architecture"
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_model_failing_at_load_time_records_each_cell_failed(tmp_path, tiny_llama_dir, tiny_corpus, monkeypatch,
                                                            capsys):
    folder = _load_time_broken(tiny_llama_dir, tmp_path)
    calls = []
    real = models.load_model
    monkeypatch.setattr(models, "load_model", lambda *a, **k: calls.append(a) or real(*a, **k))
    rc = main(["run", "--model", str(folder), "--methods", "fp16,rtn", "--suites", "accuracy:seqlen=32",
               "--corpus", tiny_corpus, "--calib-samples", "2", "--calib-seqlen", "32", "--out", str(tmp_path / "res")])
    captured = capsys.readouterr()
    assert rc == 1, captured.err
    assert "Traceback" not in captured.err
    records = load_records(tmp_path / "res")
    assert sorted(r["method"]["label"] for r in records) == ["fp16", "rtn"]
    for record in records:
        assert record["status"] == "failed" and record["stage"] == "load", record
        assert record["error"]["type"] == "ModelLoadError"
        assert record["error"]["message"].startswith(f"Could not load the model folder {folder}: ")
        assert "no-such-architecture" in record["error"]["message"]
    assert len(calls) == 1  # the failed load is not tried again for the second method
    assert "0 written, 0 already finished, 2 failed" in captured.out


def test_model_failing_at_load_time_on_a_dask_worker_records_the_same(tmp_path, tiny_llama_dir, tiny_corpus):
    """The worker's task body, run in this process: the same failed records as the local executor writes."""
    cloudpickle = pytest.importorskip("cloudpickle")
    from mosaicquant.harness import executors
    from mosaicquant.harness.runner import plan_cells, plan_groups
    from mosaicquant.harness.spec import load_run_spec

    folder = _load_time_broken(tiny_llama_dir, tmp_path)
    spec = load_run_spec(None, {"model": str(folder), "methods": "fp16", "suites": "accuracy:seqlen=32",
                                "corpus": tiny_corpus, "out": str(tmp_path / "res")})
    (task,) = plan_groups(spec, plan_cells(spec))
    executors._WORKER_STATES.clear()
    outcomes, lines = executors._run_on_worker(cloudpickle.dumps(task))
    executors._WORKER_STATES.clear()
    assert [o.status for o in outcomes] == ["failed"]
    (record,) = load_records(tmp_path / "res")
    assert record["stage"] == "load" and record["error"]["type"] == "ModelLoadError"
    assert str(folder) in record["error"]["message"]
    assert any("the model did not load" in line for line in lines)


def _fake_conversion(tmp_path, monkeypatch):
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path / "cache"))
    builtin = models.BUILTIN_MODELS["smollm2-135m"]
    folder = models.converted_builtin_folder(builtin)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    _safetensors(folder / "model.safetensors")
    stamp = {"version": models._CONVERSION_VERSION, "gguf_sha256": builtin.asset.member_sha256}
    (folder / models._COMPLETE_MARKER).write_text(json.dumps(stamp))
    return builtin, folder


def test_sound_converted_cache_is_used_as_is(tmp_path, monkeypatch):
    builtin, folder = _fake_conversion(tmp_path, monkeypatch)
    monkeypatch.setattr(type(builtin.asset), "fetch", lambda self: pytest.fail("a sound cache was rebuilt"))
    assert models._convert_builtin(builtin) == folder


def test_damaged_converted_cache_is_rebuilt(tmp_path, monkeypatch):
    builtin, folder = _fake_conversion(tmp_path, monkeypatch)
    _truncate(folder / "model.safetensors", -10)
    rebuilt = []

    def fetch(self):
        rebuilt.append(True)
        raise AssetError("stop here: the rebuild began")

    monkeypatch.setattr(type(builtin.asset), "fetch", fetch)
    with pytest.raises(AssetError) as info:
        models._convert_builtin(builtin)
    assert rebuilt == [True]
    message = str(info.value)
    assert message.startswith(f"The converted model in {folder} is damaged (model.safetensors: its header "
                              "describes 256 bytes of tensor data but the file holds 246: truncated) and cannot "
                              "be rebuilt: stop here"), message


def test_damaged_converted_cache_offline_is_named(tmp_path, monkeypatch):
    builtin, folder = _fake_conversion(tmp_path, monkeypatch)
    (folder / "config.json").write_text("{")
    monkeypatch.setenv(assets.OFFLINE_ENV, "1")
    with pytest.raises(AssetError, match=r"config.json: it is not valid JSON .*cannot be rebuilt: Could not fetch"):
        models._convert_builtin(builtin)
