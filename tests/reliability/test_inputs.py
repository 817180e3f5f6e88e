"""Bad inputs to ``mosaicquant run`` (every option, every run-spec key, the environment): each one is a
single line ``mosaicquant: error: ...`` naming the value and what is allowed, exit code 2, and neither a
model load nor a record happens. docs/reliability.md lists the cases with their messages."""

import json
import time

import pytest

from mosaicquant.harness import models
from mosaicquant.harness.cli import main

SAFE_MODEL = "smollm2-135m"  # resolved from its built-in config; nothing is fetched or loaded before the error


@pytest.fixture
def no_load(monkeypatch):
    """Make any model load fail the test: validation must stop the run first."""
    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise AssertionError(f"a model was loaded: {args}")

    monkeypatch.setattr(models, "load_model", refuse)
    monkeypatch.setattr(models, "_convert_builtin", refuse)
    return calls


def _run(tmp_path, changes, *, drop=()):
    options = {"--model": SAFE_MODEL, "--methods": "fp16", "--suites": "accuracy", "--out": str(tmp_path / "res")}
    options.update(changes)
    argv = ["run"]
    for key, value in options.items():
        if key not in drop:
            argv += [key, value] if value is not None else [key]
    return main(argv)


def _one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("mosaicquant: error:"), err
    return err[0]


def _assert_nothing_written(tmp_path):
    assert not list(tmp_path.glob("res/**/*.json")), "a record was written"


RUN_OPTION_CASES = [
    # names
    ("method-unknown", {"--methods": "qaurot"}, "Unknown method 'qaurot'. Did you mean: quarot?"),
    ("method-option-unknown", {"--methods": "rtn:foo=1"}, "RTNConfig has no option 'foo': allowed wbits, abits"),
    ("suite-unknown", {"--suites": "acuracy"}, "Unknown suite 'acuracy'. Did you mean: accuracy?"),
    ("suite-option-unknown", {"--suites": "accuracy:chunks=3"}, "has no option 'chunks': allowed seqlen"),
    ("model-unknown", {"--model": "smollm2-13m"}, "Unknown model 'smollm2-13m'. Did you mean: smollm2-135m?"),
    ("corpus-unknown", {"--corpus": "enwiki"}, "Unknown corpus 'enwiki'."),
    ("backend-unknown", {"--backend": "tensorrt-lm"}, "Unknown backend 'tensorrt-lm'. Did you mean: tensorrt-llm?"),
    ("backend-torch-options", {"--backend": "torch:x=1"}, "backend 'torch' takes no options, got 'x=1'"),
    ("executor-unknown", {"--executor": "daks"}, "Unknown executor 'daks'. Did you mean: dask?"),
    # ranges
    ("wbits-high", {"--methods": "rtn:wbits=9"}, "wbits=9 is out of range: allowed integers 2..8 or 16"),
    ("abits-low", {"--methods": "rtn:abits=1"}, "abits=1 is out of range: allowed integers 2..8 or 16"),
    ("budget-high", {"--methods": "mosaicquant:budget=1.5"}, "budget=1.5 is out of range: allowed numbers 0.0..1.0"),
    ("budget-negative", {"--methods": "mosaicquant:budget=-0.1"}, "budget=-0.1 is out of range"),
    ("group-size-zero", {"--methods": "rtn:w_group_size=0"}, "w_group_size=0 is out of range: allowed integers >= 1"),
    ("group-size-not-divisor", {"--methods": "rtn:w_group_size=7"},
     "w_group_size=7 does not divide the input size of every linear layer of model 'smollm2-135m' (hidden_size "
     "576, intermediate_size 1536, num_attention_heads*head_dim 576): allowed the divisors of 192: 1, 2, 3"),
    ("group-size-not-divisor-quarot", {"--methods": "quarot:w_group_size=100"}, "w_group_size=100 does not divide"),
    ("seqlen-absurd", {"--suites": "accuracy:seqlen=1000000000"},
     "seqlen=1000000000 is longer than model 'smollm2-135m' reads at once (max_position_embeddings 8192): "
     "allowed integers 2..8192"),
    ("seqlen-low", {"--suites": "accuracy:seqlen=1"}, "seqlen=1 is out of range: allowed integers >= 2"),
    ("kv-group-not-divisor-quarot", {"--methods": "quarot:kv_group_size=48"},
     "method 'quarot:kv_group_size=48': kv_group_size=48 does not divide the head dimension of model "
     "'smollm2-135m' (head_dim 64): allowed the divisors of 64: 1, 2, 4, 8, 16, 32, 64"),
    ("kv-group-above-head-resq", {"--methods": "resq:kv_group_size=128"},
     "kv_group_size=128 does not divide the head dimension of model 'smollm2-135m' (head_dim 64)"),
    ("kv-group-not-divisor-spinquant", {"--methods": "spinquant:kv_group_size=48"},
     "method 'spinquant:kv_group_size=48': kv_group_size=48 does not divide the head dimension"),
    ("kv-group-zero", {"--methods": "quarot:kv_group_size=0"},
     "kv_group_size=0 is out of range: allowed integers >= 1"),
    ("memory-seqlen-absurd", {"--suites": "memory:seqlen=9000", "--device": "cuda"},
     "suite 'memory:seqlen=9000': seqlen=9000 is longer than model 'smollm2-135m' reads at once "
     "(max_position_embeddings 8192): allowed integers 1..8192"),
    ("memory-seqlen-zero", {"--suites": "memory:seqlen=0"}, "seqlen=0 is out of range: allowed integers >= 1"),
    ("memory-seqlen-not-int", {"--suites": "memory:seqlen=long"},
     "seqlen='long' is not an integer: allowed integers >= 1"),
    ("latency-prefill-absurd", {"--suites": "latency:prefill_len=9000", "--device": "cuda"},
     "prefill_len=9000 is longer than model 'smollm2-135m' reads at once (max_position_embeddings 8192): "
     "allowed integers 1..8192"),
    ("latency-context-at-limit", {"--suites": "latency:context=8192", "--device": "cuda"},
     "context=8192 plus the decoded token is longer than model 'smollm2-135m' reads at once "
     "(max_position_embeddings 8192): allowed integers 1..8191"),
    ("throughput-context-absurd", {"--suites": "throughput:context=100000", "--device": "cuda"},
     "context=100000 plus the decoded token is longer"),
    ("latency-prefill-zero", {"--suites": "latency:prefill_len=0"},
     "prefill_len=0 is out of range: allowed integers >= 1"),
    ("batch-size-zero", {"--suites": "accuracy:batch_size=0"}, "batch_size=0 is out of range: allowed integers >= 1"),
    ("max-chunks-zero", {"--max-chunks": "0"}, "max_chunks=0 is out of range: allowed integers >= 1"),
    ("calib-samples-zero", {"--calib-samples": "0"}, "calib_samples=0 is out of range: allowed integers >= 1"),
    ("calib-seqlen-one", {"--calib-seqlen": "1"}, "calib_seqlen=1 is out of range: allowed integers >= 2"),
    ("seed-negative", {"--seeds": "-1"}, "seed=-1 is out of range: allowed integers 0..2147483647"),
    ("seed-too-large", {"--seeds": str(2**31)}, "seed=2147483648 is out of range"),
    ("workers-zero", {"--executor": "dask", "--workers": "0"}, "workers=0 is not allowed: use an integer >= 1"),
    ("gpus-per-cell-zero", {"--gpus-per-cell": "0"}, "gpus_per_cell=0 is not allowed: use an integer >= 1"),
    # types
    ("wbits-not-int", {"--methods": "rtn:wbits=x"}, "wbits='x' is not an integer: allowed integers 2..8 or 16"),
    ("budget-not-number", {"--methods": "mosaicquant:budget=most"},
     "budget='most' is not a number: allowed numbers 0.0..1.0"),
    ("bool-not-bool", {"--methods": "rtn:w_clip_search=maybe"},
     "w_clip_search='maybe' is not a boolean: allowed true or false"),
    ("seed-not-int", {"--seeds": "1.5"}, "seed '1.5' in seeds='1.5' is not an integer"),
    ("calib-samples-not-int", {"--calib-samples": "abc"}, "argument --calib-samples: invalid int value: 'abc'"),
    ("workers-not-int", {"--workers": "two"}, "argument --workers: invalid int value: 'two'"),
    ("device-unknown", {"--device": "tpu"}, "device='tpu' is not allowed: use 'cpu', 'cuda' or 'cuda:N'"),
    ("dtype-unknown", {"--dtype": "float8"}, "dtype='float8' is not allowed: choose one of 'float32'"),
    ("option-unknown", {"--bits": "4"}, "unrecognized arguments: --bits 4"),
    # combinations and places
    ("workers-with-local", {"--workers": "2"}, "workers=2 only apply to executor 'dask'"),
    ("scheduler-malformed", {"--executor": "dask", "--scheduler": "tcp//host"},
     "scheduler='tcp//host' is not a Dask scheduler address: use [protocol://]host[:port]"),
    ("scheduler-protocol", {"--executor": "dask", "--scheduler": "http://host:8786"}, "unknown protocol 'http'"),
    ("scheduler-port", {"--executor": "dask", "--scheduler": "tcp://host:99999"},
     "port 99999 is out of range: allowed 1..65535"),
    ("out-unwritable", {"--out": "/proc/forbidden/results"}, "is not writable"),
    ("model-missing-path", {"--model": "./no/such/folder"}, "does not exist"),
]


@pytest.mark.parametrize("changes, message", [c[1:] for c in RUN_OPTION_CASES], ids=[c[0] for c in RUN_OPTION_CASES])
def test_bad_run_option_is_one_line_exit_2_before_any_load(changes, message, tmp_path, no_load, capsys):
    assert _run(tmp_path, changes) == 2
    line = _one_error_line(capsys)
    assert message in line, line
    assert not no_load
    _assert_nothing_written(tmp_path)


def test_unreachable_scheduler_fails_within_seconds_naming_it(tmp_path, no_load, capsys):
    # port 1 on this machine: nothing listens, the connection is refused at once (was 180 s of waiting)
    t0 = time.perf_counter()
    assert _run(tmp_path, {"--executor": "dask", "--scheduler": "tcp://127.0.0.1:1"}) == 2
    elapsed = time.perf_counter() - t0
    line = _one_error_line(capsys)
    assert "scheduler='tcp://127.0.0.1:1': no Dask scheduler reachable at 127.0.0.1:1 within 5 s" in line, line
    assert elapsed < 30, elapsed
    assert not no_load


def _spec_file(tmp_path, text: str | bytes) -> str:
    path = tmp_path / "spec.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return str(path)


SPEC_BASE = "model: smollm2-135m\nmethods: [fp16]\nsuites: [accuracy]\n"
SPEC_CASES = [
    ("spec-missing-file", None, "cannot be read: No such file or directory"),
    ("spec-not-utf8", SPEC_BASE.encode() + b"out: r\xe9sultats\n",
     "is not UTF-8 text: byte 0xe9 at line 4 (offset 61) cannot be decoded; save the file as UTF-8"),
    ("spec-unknown-key", SPEC_BASE + "calib_sample: 4\n", "has unknown keys ['calib_sample']: allowed ["),
    ("spec-unsafe-tag", SPEC_BASE + "out: !!python/object/apply:os.system ['echo hacked']\n",
     "is not valid YAML: could not determine a constructor for the tag "
     "'tag:yaml.org,2002:python/object/apply:os.system'"),
    ("spec-python-name-tag", "model: !!python/name:os.system\nmethods: [fp16]\nsuites: [accuracy]\n",
     "could not determine a constructor for the tag 'tag:yaml.org,2002:python/name:os.system'"),
    ("spec-invalid-yaml", "model: [smollm2\n", "is not valid YAML:"),
    ("spec-not-mapping", "- fp16\n- rtn\n", "must be a mapping of keys to values"),
    ("spec-int-wrong-type", SPEC_BASE + "calib_samples: many\n",
     "calib_samples='many' is not an integer: allowed integers >= 1"),
    ("spec-int-bool", SPEC_BASE + "calib_seqlen: true\n", "calib_seqlen=True is not an integer"),
    ("spec-int-float", SPEC_BASE + "max_chunks: 1.5\n", "max_chunks=1.5 is not an integer"),
    ("spec-str-wrong-type", SPEC_BASE + "device: 0\n", "device=0 is not a string: give 'cpu', 'cuda' or 'cuda:N'"),
    ("spec-methods-wrong-type", "model: smollm2-135m\nmethods: 5\nsuites: [accuracy]\n",
     "methods=5: expected a comma-separated string or a list"),
    ("spec-method-entry-no-name", "model: smollm2-135m\nmethods: [{wbits: 4}]\nsuites: [accuracy]\n",
     "needs a 'name'"),
    ("spec-method-option-range", "model: smollm2-135m\nmethods: [{name: rtn, wbits: 1}]\nsuites: [accuracy]\n",
     "wbits=1 is out of range"),
    ("spec-seeds-wrong-type", SPEC_BASE + "seeds: [0, abc]\n", "seed 'abc' is not an integer"),
    ("spec-backend-unknown", SPEC_BASE + "backend: tensorrt-lm\n",
     "Unknown backend 'tensorrt-lm'. Did you mean: tensorrt-llm?"),
    ("spec-backend-wrong-type", SPEC_BASE + "backend: 3\n", "backend=3 is not a string"),
    ("spec-no-model", "methods: [fp16]\nsuites: [accuracy]\n", "no model given: use --model"),
]


@pytest.mark.parametrize("text, message", [c[1:] for c in SPEC_CASES], ids=[c[0] for c in SPEC_CASES])
def test_bad_run_spec_is_one_line_exit_2_before_any_load(text, message, tmp_path, no_load, capsys):
    spec = str(tmp_path / "missing.yaml") if text is None else _spec_file(tmp_path, text)
    rc = main(["run", "--spec", spec, "--out", str(tmp_path / "res")])
    line = _one_error_line(capsys)
    assert rc == 2 and message in line, line
    assert not no_load
    _assert_nothing_written(tmp_path)
    if "unsafe" in message or "python/" in message:
        assert "hacked" not in capsys.readouterr().out


def test_backend_is_a_run_spec_key(tmp_path, monkeypatch):
    """``backend:`` in the file reaches the sweep as --backend does; the command line overrides it."""
    import mosaicquant.harness.runner as runner
    from mosaicquant.harness.spec import load_run_spec

    spec = load_run_spec(_spec_file(tmp_path, SPEC_BASE + "backend: tensorrt-llm\n"), {})
    assert spec.backend == "tensorrt-llm"
    assert load_run_spec(_spec_file(tmp_path, SPEC_BASE + "backend: tensorrt-llm\n"), {"backend": "torch"}).backend \
        == "torch"
    seen = []
    from mosaicquant.harness import sweep

    monkeypatch.setattr(sweep, "run_backend_sweep",
                        lambda spec, chosen, log: seen.append(chosen[0].name) or runner.SweepResult())
    spec.out = str(tmp_path / "res")
    sweep.run_sweep(spec)
    assert seen == ["tensorrt-llm"]


def test_cache_variable_naming_a_file_is_exit_2(tmp_path, monkeypatch, no_load, capsys):
    blocker = tmp_path / "cache-file"
    blocker.write_text("not a folder")
    for value, shown in ((str(blocker), "is not a folder"), (str(blocker / "sub"), f"({blocker} is a file)")):
        monkeypatch.setenv("MOSAICQUANT_CACHE", value)
        assert _run(tmp_path, {}) == 2
        line = _one_error_line(capsys)
        assert f"MOSAICQUANT_CACHE={value!r} is not a folder" in line and shown in line, line
    assert not no_load


def test_mistyped_relative_path_with_one_slash_is_named_at_once(tmp_path, monkeypatch, no_load, capsys):
    """``models/foo`` where ``models/`` exists is a typo, not a hub id (the hub client retried for ~51 s)."""
    (tmp_path / "models" / "tiny-llama").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    t0 = time.perf_counter()
    assert _run(tmp_path, {"--model": "models/tiny-lama"}) == 2
    line = _one_error_line(capsys)
    assert "Model 'models/tiny-lama': no such local path" in line and "(it holds: tiny-llama)" in line, line
    assert time.perf_counter() - t0 < 20
    assert not no_load


@pytest.mark.parametrize("variable", ["MOSAICQUANT_OFFLINE", "HF_HUB_OFFLINE"])
def test_hub_id_offline_is_exit_2_before_any_load(variable, tmp_path, monkeypatch, no_load, capsys):
    monkeypatch.setenv(variable, "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    monkeypatch.chdir(tmp_path)
    assert _run(tmp_path, {"--model": "someorg/some-model"}) == 2
    line = _one_error_line(capsys)
    assert "Model 'someorg/some-model': no such local path and not a known hub id (offline: " + variable in line
    assert not no_load


@pytest.mark.parametrize("argv, message", [
    (["report", "/nonexistent/results"], "results directory '/nonexistent/results' does not exist"),
    (["compare", "/nonexistent/a", "/nonexistent/b"], "results directory '/nonexistent/a' does not exist"),
    (["ls", "bogus"], "argument what: invalid choice: 'bogus'"),
    (["bogus"], "argument command: invalid choice: 'bogus'"),
    (["fingerprint", "no-such-rev-123"], "commit 'no-such-rev-123': not a revision"),
])
def test_other_commands_bad_input_is_one_line_exit_2(argv, message, capsys):
    assert main(argv) == 2
    line = _one_error_line(capsys)
    assert message in line, line


def test_compare_bad_fail_on_is_one_line_exit_2(tmp_path, capsys):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--fail-on", "ppl:abc"]) == 2
    line = _one_error_line(capsys)
    assert "--fail-on threshold 'abc' in 'ppl:abc' is not a percentage" in line, line


def test_spec_json_round_trip_keeps_backend(tmp_path):
    from mosaicquant.harness.spec import load_run_spec

    spec = load_run_spec(None, {"model": SAFE_MODEL, "methods": "fp16", "suites": "accuracy", "backend": "torch"})
    assert json.loads(json.dumps(spec.to_dict()))["model"] == SAFE_MODEL and spec.backend == "torch"
