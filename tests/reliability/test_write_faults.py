"""A results directory that refuses a record (disk full, read-only): a clear error, nothing partial, nothing lost."""

import errno
import json
import os

import pytest

from mosaicquant.harness import results
from mosaicquant.harness.cli import main
from mosaicquant.harness.results import RecordWriteError, load_records, save_record
from mosaicquant.harness.runner import finished_record


def _leftovers(folder):
    return [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]


def _fail_after(monkeypatch, target, name, n_ok, exc):
    """Let ``target.name`` succeed ``n_ok`` times, then raise ``exc``."""
    real = getattr(target, name)
    calls = {"n": 0}

    def patched(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > n_ok:
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, patched)


@pytest.fixture
def unsaved(tmp_path, monkeypatch):
    folder = tmp_path / "tmpdir"
    folder.mkdir()
    monkeypatch.setattr(results.tempfile, "tempdir", str(folder))
    return folder / "mosaicquant-unsaved"


@pytest.mark.parametrize("fault", ["disk full", "read-only"])
def test_sweep_stops_with_the_folder_named_and_the_record_kept(tmp_path, tiny_llama_dir, tiny_corpus, rel,
                                                               monkeypatch, capsys, unsaved, fault):
    out = tmp_path / "res"
    out.mkdir()
    originals = (os.fsync, results.tempfile.mkstemp)
    if fault == "disk full":
        # the bytes reach the page cache, then fsync finds no space: a partial temporary file exists
        real_fsync = os.fsync
        calls = {"n": 0}

        def fsync(fd):
            if os.readlink(f"/proc/self/fd/{fd}").startswith(str(out)):  # only the results folder is full
                calls["n"] += 1
                if calls["n"] > 2:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_fsync(fd)

        monkeypatch.setattr(results.os, "fsync", fsync)
        reason = "No space left on device"
    else:
        # the folder turns read-only after two records: the temporary file cannot be created
        real = results.tempfile.mkstemp
        calls = {"n": 0}

        def mkstemp(*args, dir=None, prefix="", **kwargs):
            if dir is not None and os.path.samefile(dir, out) and prefix.endswith(".json."):  # a record's file
                calls["n"] += 1
                if calls["n"] > 2:
                    raise OSError(errno.EROFS, os.strerror(errno.EROFS))
            return real(*args, dir=dir, prefix=prefix, **kwargs)

        monkeypatch.setattr(results.tempfile, "mkstemp", mkstemp)
        reason = "Read-only file system"
    rc = main(rel.sweep_args(tiny_llama_dir, out))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, err
    assert err[-1].startswith("mosaicquant: error: cannot write record ") and \
        f"into results directory {str(out)!r}: {reason}" in err[-1], err
    kept = sorted(unsaved.glob("*.json"))
    assert len(kept) == 1 and f"the computed record was saved to {kept[0]}" in err[-1]
    assert json.loads(kept[0].read_text())["status"] == "ok"  # the lost cell's numbers, whole
    # in the results folder: the two records written before, nothing partial, nothing else counted
    assert _leftovers(out) == []
    assert len(load_records(out)) == 2 and not (out / kept[0].name).exists()
    # once the folder takes files again, the same command finishes the sweep
    monkeypatch.setattr(results.os, "fsync", originals[0])  # (undo() would also drop the tiny corpus)
    monkeypatch.setattr(results.tempfile, "mkstemp", originals[1])
    rc = main(rel.sweep_args(tiny_llama_dir, out))
    assert rc == 0 and len(load_records(out)) == 6


def test_record_is_printed_when_no_fallback_folder_takes_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(results.tempfile, "mkstemp",
                        lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
    record = {"schema": results.SCHEMA, "status": "ok", "metrics": {"ppl": {"value": 17.25}}}
    with pytest.raises(RecordWriteError, match="the computed record is printed above on standard error"):
        save_record(tmp_path / "res" / "cell.json", record)
    assert json.loads(capsys.readouterr().err) == record
    assert not (tmp_path / "res" / "cell.json").exists()


def test_a_partial_file_never_counts_as_finished(tmp_path, monkeypatch, unsaved):
    path = tmp_path / "res" / "m__rtn__memory__s0__0123456789.json"
    _fail_after(monkeypatch, results.os, "fsync", 0, OSError(errno.ENOSPC, "No space left on device"))
    record = {"schema": results.SCHEMA, "status": "ok", "model": {"name": "m"},
              "method": {"name": "rtn", "label": "rtn"}, "suite": {"name": "memory", "label": "memory"},
              "metrics": {}}
    with pytest.raises(RecordWriteError, match=r"cannot write record m__rtn__memory__s0__0123456789\.json"):
        save_record(path, record)
    assert not path.exists() and _leftovers(path.parent) == [] and finished_record(path) is None
