"""Shared pieces of the fault-matrix tests: the tiny sweep, in this process or in a child process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("sweep_driver.py")

#: the quickest sweep that still quantizes and measures: 3 method specs x 2 suites on the tiny Llama
TINY_METHODS = "fp16,rtn,rtn:wbits=8:abits=8"
TINY_SUITES = "memory,accuracy:seqlen=32"


def sweep_args(model, out, methods=TINY_METHODS, suites=TINY_SUITES, extra=()):
    """``mosaicquant run`` arguments of the tiny sweep (the corpus ``tiny-text``)."""
    return ["run", "--model", str(model), "--methods", methods, "--suites", suites, "--corpus", "tiny-text",
            "--calib-samples", "2", "--calib-seqlen", "16", "--max-chunks", "2", "--out", str(out), *extra]


def child_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TRITON_INTERPRET", "1")
    env["TQDM_DISABLE"] = "1"
    return env


def start_child(args, **kwargs):
    """``mosaicquant ARGS`` in a child process (the tiny corpus registered), stdout and stderr piped."""
    return subprocess.Popen([sys.executable, str(DRIVER), *args], env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def run_child(args, timeout=120):
    proc = start_child(args)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def record_files(out):
    return sorted(p for p in Path(out).glob("*.json"))


def read_json(path):
    return json.loads(Path(path).read_text())


@pytest.fixture(scope="session")
def reference_sweep(tiny_llama_dir, tmp_path_factory):
    """The tiny sweep run once, uninterrupted, in a child process: ``(results dir, {file name: record})``."""
    out = tmp_path_factory.mktemp("reference") / "res"
    rc, stdout, stderr = run_child(sweep_args(tiny_llama_dir, out))
    assert rc == 0, stderr[-3000:]
    return out, {p.name: read_json(p) for p in record_files(out)}


@pytest.fixture
def rel():
    """The helpers above, for the test modules (imported by importlib, they cannot import this file)."""
    from types import SimpleNamespace

    return SimpleNamespace(sweep_args=sweep_args, start_child=start_child, run_child=run_child,
                           record_files=record_files, read_json=read_json, child_env=child_env,
                           TINY_METHODS=TINY_METHODS, TINY_SUITES=TINY_SUITES)
