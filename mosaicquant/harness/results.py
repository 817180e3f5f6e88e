"""Self-describing result records: one JSON file per (model, method spec, suite, seed).

A record holds the metric values with their direction ("higher is better"), the full
configs, what the method reported about itself (bits, KV-cache bits, execution path,
memory), the calibration set, versions (torch, triton, transformers, CUDA, driver, GPU),
the git commit and a fingerprint of the package's source (:func:`source_fingerprint`: it names the code
even where the checkout's git history is not the code's, as on a machine that got a copy of the files),
the date and the seed. Records are written atomically (temporary file in
the same folder, fsync, rename), so an interrupted sweep never leaves a half-written one,
and a rerun skips every cell whose record says ``"status": "ok"``.

Reports (:mod:`mosaicquant.reports`) read only records.
"""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mosaicquant.harness.errors import UserInputError

__all__ = [
    "SCHEMA",
    "Metric",
    "record_path",
    "write_record",
    "read_record",
    "load_records",
    "skipped_note",
    "environment",
    "git_info",
    "source_fingerprint",
    "ensure_writable_dir",
    "command_line",
]

SCHEMA = "mosaicquant.result/1"


@dataclass(frozen=True)
class Metric:
    """One measured value.

    Attributes:
        value: the number.
        higher_is_better: direction, used by ``mosaicquant compare``.
        unit: e.g. ``"tok/s"``, ``"bytes"``, or ``None`` for a plain number.
        spread: optional measure of spread (e.g. the half interquartile range), same unit.
    """

    value: float
    higher_is_better: bool
    unit: str | None = None
    spread: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"value": self.value, "higher_is_better": self.higher_is_better, "unit": self.unit,
                "spread": self.spread}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", text).strip("_")[:80]


def record_path(out_dir: str | Path, model: str, method_label: str, suite_label: str, seed: int) -> Path:
    """File of the record for one cell: readable slug plus a hash of the full key."""
    key = json.dumps([model, method_label, suite_label, seed])
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    name = f"{_slug(Path(model).name or model)}__{_slug(method_label)}__{_slug(suite_label)}__s{seed}__{digest}.json"
    return Path(out_dir) / name


def ensure_writable_dir(path: str | Path, what: str = "results directory") -> Path:
    """Create ``path`` if needed and check a file can be written there.

    Args:
        path: the directory.
        what: how the error names it.

    Raises:
        UserInputError: naming the directory and the reason.
    """
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=p)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UserInputError(f"{what} {str(p)!r} is not writable: {exc.strerror or exc}") from None
    return p


@functools.lru_cache(maxsize=1)
def _file_mode() -> int:
    """The mode ``open()`` gives a new file here: ``0o666`` less the process's umask."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def write_record(path: str | Path, record: dict[str, Any]) -> Path:
    """Write ``record`` as JSON atomically (temp file, fsync, rename).

    The file gets the mode a plain ``open()`` would give it (``0o666`` less the umask), not the
    temporary file's private ``0o600``: others who share a results directory (the workers of a
    distributed sweep, the people who read the report) can read it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, _file_mode())
        with os.fdopen(fd, "w") as fh:
            json.dump(record, fh, indent=2, sort_keys=True, default=_json_default)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def _json_default(obj):
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    if isinstance(obj, Path):
        return str(obj)
    try:
        import torch

        if isinstance(obj, torch.Tensor):
            return obj.tolist()
        if isinstance(obj, (torch.dtype, torch.device)):
            return str(obj)
    except ImportError:
        pass
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


def read_record(path: str | Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


# what every reader of a record (report, compare) takes from it without asking
_REQUIRED_FIELDS = (("model", "name"), ("method", "name"), ("method", "label"), ("suite", "name"), ("suite", "label"))


def _record_defect(rec: dict[str, Any]) -> str | None:
    """Why a record of our schema cannot be read (a field its readers need is missing or malformed), else None."""
    for outer, inner in _REQUIRED_FIELDS:
        part = rec.get(outer)
        if not isinstance(part, dict) or not isinstance(part.get(inner), str):
            return f"a record without {outer}.{inner}"
    metrics = rec.get("metrics")
    if metrics is not None and not (isinstance(metrics, dict) and all(
            isinstance(m, dict) and isinstance(m.get("value"), (int, float)) for m in metrics.values())):
        return "a record whose metrics are not {name: {value: number, ...}}"
    return None


def load_records(out_dir: str | Path, required: bool = False,
                 skipped: list[tuple[str, str]] | None = None) -> list[dict[str, Any]]:
    """All records (``*.json`` with our schema) in a results directory, sorted by file name.

    A ``*.json`` file that cannot be read as JSON (cut short, not UTF-8 text, unreadable), or a
    record of our schema that lacks a field its readers need (``model.name``, ``method.label``,
    ...; metrics without a number), is left out, and so is JSON of another schema (other tools'
    output kept next to the records). The first two kinds may be damaged records, so they are not
    left out silently: ``skipped``, when
    given, receives ``(file name, why)`` for each such file, for the caller to show
    (:func:`skipped_note`).

    Raises:
        UserInputError: the directory does not exist, or (``required``) it holds no record.
    """
    p = Path(out_dir)
    if not p.is_dir():
        raise UserInputError(f"results directory {str(p)!r} does not exist")
    records = []
    unreadable: list[tuple[str, str]] = []
    for f in sorted(p.glob("*.json")):
        try:
            rec = read_record(f)
        except UnicodeDecodeError:
            unreadable.append((f.name, "not UTF-8 text"))
            continue
        except json.JSONDecodeError as exc:
            unreadable.append((f.name, f"not valid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})"))
            continue
        except OSError as exc:
            unreadable.append((f.name, f"cannot be read: {exc.strerror or exc}"))
            continue
        if isinstance(rec, dict) and rec.get("schema") == SCHEMA:
            defect = _record_defect(rec)
            if defect is not None:
                unreadable.append((f.name, defect))
                continue
            rec["_path"] = str(f)
            records.append(rec)
    if skipped is not None:
        skipped.extend(unreadable)
    if required and not records:
        raise UserInputError(f"results directory {str(p)!r} holds no result records (JSON files with schema "
                             f"{SCHEMA!r})" + (f"; {skipped_note(unreadable)}" if unreadable else ""))
    return records


def skipped_note(skipped: list[tuple[str, str]], shown: int = 5) -> str:
    """One line naming the files :func:`load_records` skipped as unreadable (the first ``shown``, then a count).

    Example:
        >>> skipped_note([("a.json", "not UTF-8 text")])
        'skipped 1 *.json file that is not a readable record: a.json (not UTF-8 text)'
    """
    n = len(skipped)
    names = ", ".join(f"{name} ({why})" for name, why in skipped[:shown])
    more = f", and {n - shown} more" if n > shown else ""
    return (f"skipped {n} *.json file{'s that are not readable records' if n != 1 else ' that is not a readable record'}: "
            f"{names}{more}")


def git_info() -> dict[str, Any]:
    """Commit and dirty flag of the source tree this package runs from (if it is a git checkout), and
    ``source_sha256``, the fingerprint of the package's source files (:func:`source_fingerprint`)."""
    root = Path(__file__).resolve().parents[2]
    info: dict[str, Any] = {"commit": None, "dirty": None, "source_sha256": source_fingerprint()}
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                                text=True, timeout=10)
        if commit.returncode != 0:
            return info
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10)
        info.update(commit=commit.stdout.strip(), dirty=bool(status.stdout.strip()))
    except (OSError, subprocess.SubprocessError):
        pass
    return info


_PACKAGE = "mosaicquant"


def source_fingerprint(commit: str | None = None, root: str | Path | None = None) -> str:
    """A 16-hex-digit SHA-256 of the package's Python sources: every ``mosaicquant/**/*.py`` file's path
    (relative to ``root``) and bytes, in path order.

    Two trees with the same sources have the same fingerprint, whatever their git state, so a record's
    ``git.source_sha256`` names the code it ran even where the checkout's history does not (a copy of the
    files on another machine, uncommitted edits). ``mosaicquant fingerprint REV`` gives a commit's, to
    find the one a record ran.

    Args:
        commit: a git revision of the repository at ``root``: the fingerprint of that commit's files
            (read with ``git``), instead of the files on disk.
        root: the repository root holding the ``mosaicquant`` folder (default: this package's parent).

    Raises:
        UserInputError: ``commit`` is not a revision of that repository, or it holds no package sources.
    """
    root = Path(root) if root is not None else Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    if commit is None:
        paths = sorted(p.relative_to(root).as_posix() for p in (root / _PACKAGE).rglob("*.py")
                       if "__pycache__" not in p.parts)
        for rel in paths:
            digest.update(rel.encode() + b"\0" + (root / rel).read_bytes() + b"\0")
        return digest.hexdigest()[:16]
    try:
        listing = subprocess.run(["git", "-C", str(root), "ls-tree", "-r", "--name-only", commit, "--", _PACKAGE],
                                 capture_output=True, text=True, timeout=30)
        paths = sorted(p for p in listing.stdout.splitlines() if p.endswith(".py") and "__pycache__" not in p)
        if listing.returncode != 0 or not paths:
            raise UserInputError(f"commit {commit!r}: not a revision holding {_PACKAGE}/ sources in the git "
                                 f"repository at {root}"
                                 + (f" ({listing.stderr.strip()})" if listing.stderr.strip() else ""))
        for rel in paths:
            blob = subprocess.run(["git", "-C", str(root), "show", f"{commit}:{rel}"], capture_output=True,
                                  timeout=30, check=True)
            digest.update(rel.encode() + b"\0" + blob.stdout + b"\0")
    except (OSError, subprocess.SubprocessError) as exc:
        raise UserInputError(f"commit {commit!r}: git could not read it at {root} ({exc})") from None
    return digest.hexdigest()[:16]


def _cpu_model() -> str | None:
    """The CPU's marketing name (``model name`` of ``/proc/cpuinfo``), or None where the system does not say."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, sep, value = line.partition(":")
                if sep and key.strip() in ("model name", "Model", "Hardware") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return None


def command_line(argv: list[str] | None = None) -> str:
    """The command that started this process, shell-quoted (``mosaicquant run ...`` for the console script).

    Example:
        >>> command_line(["/venv/bin/mosaicquant", "run", "--model", "my model"])
        "mosaicquant run --model 'my model'"
        >>> command_line(["/src/mosaicquant/__main__.py", "report", "out"])  # python -m mosaicquant
        'mosaicquant report out'
        >>> command_line(["/venv/lib/pytest/__main__.py", "-q"])
        '/venv/lib/pytest/__main__.py -q'

    """
    import shlex

    argv = list(sys.argv if argv is None else argv)
    if argv and (Path(argv[0]).name == "mosaicquant"
                 or (Path(argv[0]).name == "__main__.py" and Path(argv[0]).parent.name == "mosaicquant")):
        argv[0] = "mosaicquant"
    return shlex.join(argv)


def environment() -> dict[str, Any]:
    """Versions and hardware: python, torch, triton, transformers, CUDA, driver, GPU, CPU."""
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
    }
    from importlib.metadata import PackageNotFoundError, version

    for pkg in ("torch", "triton", "transformers", "mosaicquant", "lm_eval", "nvidia-modelopt", "torchao"):
        try:
            env[pkg] = version(pkg)
        except PackageNotFoundError:
            env[pkg] = None
    try:
        import torch

        env["cuda"] = torch.version.cuda
        env["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        env["torch_threads"] = torch.get_num_threads()
    except Exception as exc:  # noqa: BLE001 - recorded, never fatal for a record
        env["torch_error"] = repr(exc)
    env["driver"] = None
    if env.get("gpu"):
        try:
            import pynvml

            pynvml.nvmlInit()
            env["driver"] = pynvml.nvmlSystemGetDriverVersion()
            pynvml.nvmlShutdown()
        except Exception as exc:  # noqa: BLE001
            env["driver_error"] = repr(exc)
    return env


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
