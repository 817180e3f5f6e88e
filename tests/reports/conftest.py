"""Synthetic result records for the report and comparison tests (values made up, records real)."""

import pytest

from mosaicquant.harness.backends import backend_label, backend_record_path
from mosaicquant.harness.results import SCHEMA, Metric, record_path, write_record

DEFAULT_INFO = {"wbits": 4, "abits": 4, "kv_bits": 16, "exec_path": "triton (ZipperEngine)"}


def _write(out_dir, model, method, suite, metrics=None, *, seed=0, status="ok", config=None, info=None,
           error=None, reason=None, method_name=None, suite_config=None, git=None, env=None, backend=None,
           fields=None):
    """Write one record; ``metrics`` maps a name to ``Metric`` arguments ``(value, higher_is_better, unit, spread)``
    or to a ``Metric``; ``fields`` are further top-level fields of the record (``calibration``, ``command``, ...).

    With ``backend``, the record is the one :func:`mosaicquant.harness.backends.run_backend_cells` writes for
    the method spec ``method`` run by that backend (label ``method@backend``, its own file).
    """
    label = backend_label(method, backend) if backend else method
    record = {
        "schema": SCHEMA,
        "model": {"name": model, "spec": model},
        "method": {"name": method_name or method.split(":")[0], "label": label, "config": config or {}},
        "suite": {"name": suite.split(":")[0], "label": suite, "config": suite_config or {}},
        "seed": seed,
        "status": status,
        "method_info": DEFAULT_INFO if info is None else info,
        "metrics": {name: (args if isinstance(args, Metric) else Metric(*args)).to_dict()
                    for name, args in (metrics or {}).items()},
        "error": error,
    }
    if backend:
        record["method"].update(spec_label=method, backend=backend)
        record["backend"] = {"name": backend, "config": {}, "reason": reason, "commands": []}
        record["stage"] = None if status == "ok" else "backend"
        if status != "ok" and error is None:
            record["error"] = {"type": status, "message": reason}
        return write_record(backend_record_path(out_dir, model, method, suite, seed, backend), record)
    if reason is not None:
        record["reason"] = reason
    if git is not None:
        record["git"] = git
    if env is not None:
        record["env"] = env
    record.update(fields or {})
    return write_record(record_path(out_dir, model, method, suite, seed), record)


@pytest.fixture
def write_cell():
    """``write_cell(out_dir, model, method label, suite label, metrics, **fields)`` writes one record."""
    return _write


def throughput_metrics(decode, prefill=None, spread=1.0):
    """Throughput-suite metrics from ``{batch: tok/s}``."""
    metrics = {f"decode_tok_s/b{b}": (v, True, "tok/s", spread) for b, v in decode.items()}
    if prefill is not None:
        metrics["prefill_tok_s"] = (prefill, True, "tok/s", spread)
    return metrics


def latency_metrics(per_m, layers=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), spread=0.1):
    """Latency-suite metrics from ``{M: µs}``, the same for every layer."""
    return {f"linear_us/{layer}/m{m}": (v, False, "us", spread) for layer in layers for m, v in per_m.items()}


@pytest.fixture
def speed_metrics():
    return throughput_metrics, latency_metrics
