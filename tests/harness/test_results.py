"""Result records: atomic writes, loading, cell paths."""

import json
import os

import pytest

from mosaicquant.harness.errors import UserInputError
from mosaicquant.harness.results import (
    SCHEMA, ensure_writable_dir, environment, load_records, record_path, write_record,
)


def test_atomic_write_and_load(tmp_path):
    rec = {"schema": SCHEMA, "status": "ok", "metrics": {"ppl": {"value": 17.0}}}
    p = write_record(tmp_path / "a.json", rec)
    assert json.loads(p.read_text())["metrics"]["ppl"]["value"] == 17.0
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    (tmp_path / "junk.json").write_text("{not json")
    (tmp_path / "other.json").write_text(json.dumps({"schema": "something-else"}))
    recs = load_records(tmp_path)
    assert len(recs) == 1 and recs[0]["_path"].endswith("a.json")


def test_failed_write_leaves_previous_record(tmp_path, monkeypatch):
    p = write_record(tmp_path / "a.json", {"schema": SCHEMA, "v": 1})

    class Boom:
        def to_dict(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        write_record(p, {"schema": SCHEMA, "v": Boom()})
    assert json.loads(p.read_text())["v"] == 1
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_record_paths_distinct_per_cell(tmp_path):
    a = record_path(tmp_path, "smollm2-135m", "rtn:wbits=8:abits=8", "accuracy", 0)
    b = record_path(tmp_path, "smollm2-135m", "rtn", "accuracy", 0)
    c = record_path(tmp_path, "smollm2-135m", "rtn", "accuracy", 1)
    assert len({a, b, c}) == 3 and a.name.startswith("smollm2-135m__rtn_wbits=8_abits=8__accuracy__s0__")


def test_unwritable_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserInputError, match="is not writable"):
        ensure_writable_dir(blocker / "sub")
    with pytest.raises(UserInputError, match="does not exist"):
        load_records(tmp_path / "missing")


def test_environment_has_versions():
    env = environment()
    assert env["torch"] and env["python"]
    assert "gpu" in env and "cuda" in env and "driver" in env
