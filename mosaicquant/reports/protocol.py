"""The protocol behind a result set: what was measured, on what, with which settings.

Two readers use it:

- the report's ``## Protocol`` block (:func:`protocol_section`), which states for the whole
  results directory the perplexity corpus, the tokens scored (sequence length x chunks), the
  calibration set (corpus, samples x length, seeds), the dtype, the devices (GPU and CPU
  models, driver, CUDA), the library versions and the command lines, each taken from what
  the records hold; a field no record holds reads ``not recorded``, never a guess;
- the guard of ``mosaicquant compare`` (:func:`protocol_differences`), which lists the
  fields in which the base and new records of the same cell differ.

The fields of one record (:func:`record_protocol`) are flat ``name -> value`` pairs:

==========================  ==============================================================
``test_corpus``             corpus whose test split the suite read (``None``: none read)
``suite.<option>``          every option of the suite config (``suite.seqlen``, ``suite.max_chunks``, ...)
``calibration.<field>``     ``corpus``, ``n_samples``, ``seqlen``, ``seed``, ``tokens_sha256``
``dtype``                   the run's model dtype
``device``                  the GPU's name, or ``CPU`` where none ran
``driver`` / ``cuda``       the NVIDIA driver and CUDA versions (GPU runs)
``cpu``                     the CPU's model name where recorded, else its architecture
==========================  ==============================================================
"""

from __future__ import annotations

from typing import Any, Iterable

__all__ = ["NOT_RECORDED", "record_protocol", "protocol_differences", "protocol_section", "perplexity_corpora"]

NOT_RECORDED = "not recorded"

#: suites whose numbers come from a text corpus (the others time or count random-weight shapes)
TEXT_SUITES = ("accuracy", "zeroshot", "analysis")


def _test_corpus(rec: dict[str, Any]) -> str | None:
    """The corpus whose test split the record's suite read; older records without ``test_corpus`` are
    taken at their run's corpus only for the suites that read text."""
    if "test_corpus" in rec:
        return rec.get("test_corpus")
    return rec.get("corpus") if rec["suite"]["name"] in TEXT_SUITES else None


def record_protocol(rec: dict[str, Any]) -> dict[str, Any]:
    """The protocol fields of one record (see the module docstring); a field the record lacks is ``None``."""
    env = rec.get("env") or {}
    out: dict[str, Any] = {"test_corpus": _test_corpus(rec)}
    for key, value in sorted((rec["suite"].get("config") or {}).items()):
        out[f"suite.{key}"] = value
    calibration = rec.get("calibration") or {}
    for key in ("corpus", "n_samples", "seqlen", "seed", "tokens_sha256"):
        out[f"calibration.{key}"] = calibration.get(key)
    out["dtype"] = (rec.get("model") or {}).get("dtype")
    out["device"] = env.get("gpu") or ("CPU" if env else None)
    out["driver"] = env.get("driver")
    out["cuda"] = env.get("cuda")
    out["cpu"] = env.get("cpu_model") or env.get("cpu")
    return out


def _values(records: Iterable[dict[str, Any]]) -> dict[str, set[str]]:
    seen: dict[str, set[str]] = {}
    for rec in records:
        for key, value in record_protocol(rec).items():
            if value is not None:
                seen.setdefault(key, set()).add(str(value))
    return seen


def protocol_differences(base: Iterable[dict[str, Any]],
                         new: Iterable[dict[str, Any]]) -> list[tuple[str, list[str], list[str]]]:
    """The protocol fields in which two sets of records (of one cell) differ.

    A field counts only where both sides recorded it: a record from before a field existed says
    nothing about it, so it cannot be told apart from the same value. The calibration seed is left
    out: seeds are the repeated measurements of a cell, matched by ``compare`` itself.

    Returns:
        ``[(field, base values, new values)]``, values sorted, fields in the module docstring's order.

    Example:
        >>> base = [{"suite": {"name": "memory", "config": {}}, "model": {"dtype": "float32"}, "env": {}}]
        >>> new = [{"suite": {"name": "memory", "config": {}}, "model": {"dtype": "bfloat16"}, "env": {}}]
        >>> protocol_differences(base, new)
        [('dtype', ['float32'], ['bfloat16'])]
    """
    mine, theirs = _values(base), _values(new)
    out = []
    for key in dict.fromkeys([*mine, *theirs]):
        if key == "calibration.seed" or key not in mine or key not in theirs:
            continue
        if mine[key] != theirs[key]:
            out.append((key, sorted(mine[key]), sorted(theirs[key])))
    return out


def perplexity_corpora(records: list[dict[str, Any]]) -> list[str]:
    """The corpora whose test split some ``ok`` record read (empty for a speed-only result set)."""
    return sorted({c for r in records if r.get("status") == "ok" and (c := _test_corpus(r))})


def _counted(values: list[str]) -> str:
    """``a`` or ``a (3 records), b (1 record)`` for the distinct values of a field."""
    counts: dict[str, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{v} ({n} record{'s' if n != 1 else ''})" for v, n in sorted(counts.items()))


def _tokens(rec: dict[str, Any]) -> str:
    cfg = rec["suite"].get("config") or {}
    metrics = rec.get("metrics") or {}
    seqlen = cfg.get("seqlen")
    chunks = (metrics.get("n_chunks") or {}).get("value")
    scored = (metrics.get("n_tokens_scored") or {}).get("value")
    if seqlen is None or chunks is None:
        return NOT_RECORDED
    text = f"{seqlen} x {int(chunks)} chunks"
    return text + (f" ({int(scored):,} tokens scored)" if scored is not None else "")


def _calibration(rec: dict[str, Any]) -> str | None:
    cal = rec.get("calibration")
    if not cal:
        return None
    size = (f"{cal.get('n_samples')} x {cal.get('seqlen')} tokens"
            if cal.get("n_samples") is not None and cal.get("seqlen") is not None else f"size {NOT_RECORDED}")
    return f"{cal.get('corpus') or 'corpus ' + NOT_RECORDED}, {size}"


def _device(env: dict[str, Any]) -> str:
    if not env:
        return NOT_RECORDED
    cpu = env.get("cpu_model") or env.get("cpu") or NOT_RECORDED
    cores = f", {env['cpu_count']} cores" if env.get("cpu_count") else ""
    if env.get("gpu"):
        return (f"GPU {env['gpu']} (driver {env.get('driver') or NOT_RECORDED}, CUDA {env.get('cuda') or NOT_RECORDED})"
                f"; CPU {cpu}{cores}")
    return f"CPU {cpu}{cores} (no GPU)"


def _versions(env: dict[str, Any]) -> str:
    if not env:
        return NOT_RECORDED
    parts = [f"{pkg} {env[pkg]}" for pkg in ("mosaicquant", "python", "torch", "triton", "transformers", "lm_eval",
                                              "torchao", "nvidia-modelopt") if env.get(pkg)]
    return ", ".join(parts) or NOT_RECORDED


def protocol_section(records: list[dict[str, Any]]) -> list[str]:
    """``## Protocol``: the measurement settings of a result set, from its records (Markdown lines).

    Every line states what the records hold; a field that no record of the kind holds reads
    ``not recorded``. Perplexity lines appear only where a record read a test corpus, so a
    speed-only result set on random weights claims no corpus.
    """
    if not records:
        return []
    lines = ["## Protocol\n"]
    presets = sorted({r["preset"] for r in records if r.get("preset")})
    if presets:
        lines.append(f"- **Preset**: {', '.join(presets)} (a small smoke comparison: few chunks, short sequences, "
                     "little calibration; its numbers are not comparable with full-protocol runs)")
    # a text suite's record without its corpus is "not recorded"; a speed suite reads no text at all
    text = [r for r in records if r.get("status") == "ok" and (_test_corpus(r) or r["suite"]["name"] in TEXT_SUITES)]
    ppl = [r for r in text if r["suite"]["name"] == "accuracy"]
    if text:
        corpora = [_test_corpus(r) or NOT_RECORDED for r in text]
        lines.append(f"- **Perplexity corpus (test split)**: {_counted(corpora)}")
    else:
        lines.append("- **Perplexity corpus**: none (no record read a test corpus)")
    if ppl:
        lines.append(f"- **Tokens per perplexity (sequence length x chunks)**: {_counted([_tokens(r) for r in ppl])}")
    quantized = [r for r in records if r["method"]["name"] != "fp16"]
    calibrated = [c for r in quantized if (c := _calibration(r))]
    if calibrated:
        seeds = sorted({r["calibration"].get("seed") for r in quantized if r.get("calibration")}, key=str)
        uncal = len(quantized) - len(calibrated)
        lines.append(f"- **Calibration (train split)**: {_counted(calibrated)}; seed(s) "
                     f"{', '.join(str(s) for s in seeds)}"
                     + (f"; {uncal} quantized record(s) drew no calibration data" if uncal else ""))
    elif quantized:
        lines.append("- **Calibration**: none drawn by any record")
    seeds = sorted({r.get("seed") for r in records}, key=str)
    lines.append(f"- **Seeds**: {', '.join(str(s) for s in seeds)}")
    lines.append(f"- **dtype**: {_counted([(r.get('model') or {}).get('dtype') or NOT_RECORDED for r in records])}")
    lines.append(f"- **Device**: {_counted([_device(r.get('env') or {}) for r in records])}")
    lines.append(f"- **Versions**: {_counted([_versions(r.get('env') or {}) for r in records])}")
    commands = sorted({r.get("command") or NOT_RECORDED for r in records})
    if commands == [NOT_RECORDED]:
        lines.append(f"- **Command**: {NOT_RECORDED}")
    else:
        lines.append("- **Command**" + ("s" if len(commands) > 1 else "") + ":")
        lines.extend(f"  - `{c}`" if c != NOT_RECORDED else f"  - {NOT_RECORDED} (some records)" for c in commands)
    return lines + [""]

