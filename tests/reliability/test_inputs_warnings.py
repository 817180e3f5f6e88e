"""Runs that do not use an optional library print none of its warnings (torchao, ModelOpt, TensorRT-LLM):
``--help`` and a tiny float run, each in a fresh interpreter, since a library is imported once per process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import mosaicquant

REPO = Path(mosaicquant.__file__).parent.parent
#: what the optional libraries' import-time messages contain
FOREIGN = ("torchao", "_pytree", "modelopt", "tensorrt_llm", "tensorrt-llm", "register_constant")
TEXT = ("Quantization maps real numbers onto a small grid of integers; four bits hold sixteen levels. "
        "Rotations spread outliers across channels so that a uniform grid loses less information. ") * 40


def _mosaicquant(args, cwd):
    env = {**os.environ, "PYTHONPATH": str(REPO), "MOSAICQUANT_OFFLINE": "1", "PYTHONWARNINGS": "default"}
    return subprocess.run([sys.executable, "-m", "mosaicquant", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def _foreign_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if any(word in line for word in FOREIGN)]


def test_help_prints_no_optional_library_warning(tmp_path):
    done = _mosaicquant(["--help"], tmp_path)
    assert done.returncode == 0 and "run a sweep" in done.stdout
    assert not _foreign_lines(done.stderr), done.stderr


def test_float_run_prints_no_optional_library_warning(tmp_path, tiny_llama_dir):
    (tmp_path / "docs.txt").write_text("\n\n".join([TEXT] * 10))
    done = _mosaicquant(["run", "--model", tiny_llama_dir, "--methods", "fp16", "--suites",
                         "accuracy:seqlen=32:max_chunks=2", "--corpus", "file:docs.txt", "--out", "res"], tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (record,) = [json.loads(p.read_text()) for p in (tmp_path / "res").rglob("*.json")]
    assert record["status"] == "ok" and record["metrics"]["ppl"]["value"] > 1
    assert not _foreign_lines(done.stderr), done.stderr
