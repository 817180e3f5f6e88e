"""Two runs into one results directory: the second stops at once, naming the directory and the holder."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from mosaicquant.harness.cli import main
from mosaicquant.errors import UserInputError
from mosaicquant.harness.results import LOCK_NAME, load_records, results_lock


def test_second_lock_on_a_held_directory_names_folder_pid_and_host(tmp_path):
    with results_lock(tmp_path / "res") as lock_file:
        holder = json.loads(lock_file.read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        with pytest.raises(UserInputError) as info:
            with results_lock(tmp_path / "res"):
                pass
        message = str(info.value)
        assert repr(str(tmp_path / "res")) in message
        assert f"pid {os.getpid()} on host {socket.gethostname()}" in message
        assert "use another --out" in message
    # released on exit: the lock is free again and holds no name
    with results_lock(tmp_path / "res") as lock_file:
        pass
    assert lock_file.read_text() == ""


def test_lock_of_a_killed_process_is_taken_over(tmp_path, rel):
    out = tmp_path / "res"
    code = ("import sys, time; from mosaicquant.harness.results import results_lock\n"
            f"with results_lock({str(out)!r}):\n    print('held', flush=True); time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=rel.child_env())
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(UserInputError, match=rf"pid {child.pid} on host "):
            with results_lock(out):
                pass
    finally:
        child.kill()
        child.wait()
    # the dead holder's name is still in the file, but the kernel dropped its lock: taken over, and said so
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == child.pid
    said = []
    with results_lock(out, said.append) as lock_file:
        assert json.loads(lock_file.read_text())["pid"] == os.getpid()
    assert len(said) == 1 and f"took over the lock of an ended run (pid {child.pid}" in said[0], said


def test_leftover_temporary_files_of_a_killed_writer_are_removed(tmp_path):
    out = tmp_path / "res"
    out.mkdir()
    leftover = out / ".m__fp16__memory__s0__0123456789.json.abc123.tmp"
    leftover.write_text('{"schema": "mosaicq')
    with results_lock(out):
        pass
    assert not leftover.exists()


def test_run_into_a_held_directory_exits_2_without_touching_it(tmp_path, tiny_llama_dir, tiny_corpus, capsys, rel):
    out = tmp_path / "res"
    with results_lock(out):
        rc = main(rel.sweep_args(tiny_llama_dir, out, methods="fp16", suites="memory"))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert f"results directory {str(out)!r} is in use by another run (pid {os.getpid()}" in err[0]
    assert rel.record_files(out) == []


def test_two_runs_with_other_dtypes_at_once_never_mix_records(tmp_path, tiny_llama_dir, tiny_corpus, rel, capsys):
    # before the lock both exited 0 and the bfloat16 records were overwritten by float32 ones
    out = tmp_path / "res"
    first = rel.start_child(rel.sweep_args(tiny_llama_dir, out))
    deadline = time.monotonic() + 60
    while not (out / LOCK_NAME).exists() or not (out / LOCK_NAME).read_text():
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.02)
    # the second run in this process: it reaches the lock in well under the first run's model load
    capsys.readouterr()
    rc = main(rel.sweep_args(tiny_llama_dir, out, extra=["--dtype", "bfloat16"]))
    err = capsys.readouterr().err
    first_out, first_err = first.communicate(timeout=120)
    assert first.returncode == 0, first_err[-2000:]
    assert rc == 2, err[-2000:]
    assert f"is in use by another run (pid {first.pid} on host {socket.gethostname()}" in err
    records = load_records(out)
    assert len(records) == 6 and {r["model"]["dtype"] for r in records} == {"float32"}
    # and the same bfloat16 command afterwards is refused by the finished records' settings, not mixed in
    rc = main(rel.sweep_args(tiny_llama_dir, out, extra=["--dtype", "bfloat16"]))
    assert rc == 2 and "has dtype='float32' (this run: 'bfloat16')" in capsys.readouterr().err
    assert {r["model"]["dtype"] for r in load_records(out)} == {"float32"}
