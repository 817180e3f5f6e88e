"""Result records: atomic writes, loading, cell paths, the code they ran."""

import json
import os
import shutil
import subprocess

import pytest

from mosaicquant.errors import UserInputError
from mosaicquant.harness.cli import main
from mosaicquant.harness.results import (
    SCHEMA, ensure_writable_dir, environment, git_info, load_records, record_path, skipped_note, source_fingerprint,
    write_record,
)


def _minimal_record(**extra):
    return {"schema": SCHEMA, "status": "ok", "model": {"name": "m"}, "method": {"name": "rtn", "label": "rtn"},
            "suite": {"name": "memory", "label": "memory"}, **extra}


def test_atomic_write_and_load(tmp_path):
    rec = _minimal_record(metrics={"ppl": {"value": 17.0}})
    p = write_record(tmp_path / "a.json", rec)
    assert json.loads(p.read_text())["metrics"]["ppl"]["value"] == 17.0
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    (tmp_path / "junk.json").write_text("{not json")
    (tmp_path / "other.json").write_text(json.dumps({"schema": "something-else"}))
    recs = load_records(tmp_path)
    assert len(recs) == 1 and recs[0]["_path"].endswith("a.json")


def test_unreadable_json_files_are_skipped_and_named(tmp_path):
    write_record(tmp_path / "a.json", _minimal_record(metrics={"x": {"value": 1.0, "higher_is_better": True}}))
    # a record saved as UTF-16 (e.g. by an editor) and one cut short (a full disk)
    (tmp_path / "b_utf16.json").write_bytes(json.dumps({"schema": SCHEMA}).encode("utf-16"))
    (tmp_path / "c_cut.json").write_text('{"schema": "%s", "status": "o' % SCHEMA)
    (tmp_path / "d_other.json").write_text(json.dumps({"schema": "something-else"}))
    # records of our schema that a reader would trip over: no model name, a metric without a number
    no_model = _minimal_record()
    del no_model["model"]
    write_record(tmp_path / "e_no_model.json", no_model)
    write_record(tmp_path / "f_bad_metric.json", _minimal_record(metrics={"x": {"value": "high"}}))
    skipped = []
    recs = load_records(tmp_path, skipped=skipped)
    assert [r["_path"].rsplit("/", 1)[1] for r in recs] == ["a.json"]
    assert [name for name, _ in skipped] == ["b_utf16.json", "c_cut.json", "e_no_model.json", "f_bad_metric.json"]
    assert skipped[0][1] == "not UTF-8 text" and skipped[1][1].startswith("not valid JSON: "), skipped
    assert skipped[2][1] == "a record without model.name", skipped
    assert skipped[3][1] == "a record whose metric 'x' is 'high', not {value: number, ...}", skipped
    assert skipped_note(skipped).startswith("skipped 4 *.json files that are not readable records: b_utf16.json (")
    assert skipped_note(skipped[:1]) == "skipped 1 *.json file that is not a readable record: b_utf16.json (not UTF-8 text)"
    # a directory of unreadable files only: the refusal names them
    (tmp_path / "a.json").unlink()
    with pytest.raises(UserInputError, match=r"holds no result records .*; skipped 4 \*\.json files"):
        load_records(tmp_path, required=True)


def test_failed_write_leaves_previous_record(tmp_path, monkeypatch):
    p = write_record(tmp_path / "a.json", {"schema": SCHEMA, "v": 1})

    class Boom:
        def to_dict(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        write_record(p, {"schema": SCHEMA, "v": Boom()})
    assert json.loads(p.read_text())["v"] == 1
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


@pytest.mark.parametrize("umask", [0o022, 0o007])
def test_record_has_the_mode_of_a_plainly_opened_file(tmp_path, umask):
    # the temporary file is private (0600); a record must be readable by whoever shares the directory
    from mosaicquant.harness import results

    old = os.umask(umask)
    results._file_mode.cache_clear()
    try:
        p = write_record(tmp_path / "a.json", {"schema": SCHEMA, "v": 1})
        with open(tmp_path / "plain.json", "w") as fh:
            fh.write("{}")
    finally:
        os.umask(old)
        results._file_mode.cache_clear()
    mode = p.stat().st_mode & 0o777
    assert mode == (tmp_path / "plain.json").stat().st_mode & 0o777 == 0o666 & ~umask, oct(mode)


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


def _git(root, *args):
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t"})


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_source_fingerprint_names_the_code_not_the_checkout(tmp_path):
    # a repository with a package: the files on disk and the commit holding them have one fingerprint; an edit
    # changes the tree's and not the commit's; caches and other files do not count
    pkg = tmp_path / "mosaicquant"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("x = 1\n")
    (pkg / "sub" / "m.py").write_text("y = 2\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-q", "-m", "one")
    first = source_fingerprint(root=tmp_path)
    assert len(first) == 16 and int(first, 16) >= 0
    assert source_fingerprint("HEAD", root=tmp_path) == first
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "m.cpython-311.py").write_text("cache")
    (pkg / "notes.txt").write_text("not code")
    assert source_fingerprint(root=tmp_path) == first
    (pkg / "sub" / "m.py").write_text("y = 3\n")
    edited = source_fingerprint(root=tmp_path)
    assert edited != first and source_fingerprint("HEAD", root=tmp_path) == first
    (pkg / "sub" / "m.py").rename(pkg / "m.py")  # the same bytes under another path
    assert source_fingerprint(root=tmp_path) not in (first, edited)
    with pytest.raises(UserInputError, match="'nosuch': not a revision holding mosaicquant/ sources"):
        source_fingerprint("nosuch", root=tmp_path)


def test_records_carry_the_source_fingerprint(capsys):
    info = git_info()
    assert info["source_sha256"] == source_fingerprint()
    assert set(info) == {"commit", "dirty", "source_sha256"}
    assert main(["fingerprint"]) == 0
    assert capsys.readouterr().out.strip() == info["source_sha256"]
    assert main(["fingerprint", "no-such-revision-here"]) == 2
    assert "not a revision holding mosaicquant/ sources" in capsys.readouterr().err


def test_source_fingerprint_of_a_commit_without_git_says_so(monkeypatch):
    def no_git(*args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", "git")

    monkeypatch.setattr(subprocess, "run", no_git)
    with pytest.raises(UserInputError, match="'HEAD': git could not read it"):
        source_fingerprint("HEAD")
    assert len(source_fingerprint()) == 16  # the files on disk need no git
