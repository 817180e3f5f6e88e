"""Self-describing result records: one JSON file per (model, method spec, suite, seed).

A record holds the metric values with their direction ("higher is better"), the full
configs, what the method reported about itself (bits, KV-cache bits, execution path,
memory), the calibration set, versions (torch, triton, transformers, CUDA, driver, GPU),
the git commit and a fingerprint of the package's source (:func:`source_fingerprint`: it names the code
even where the checkout's git history is not the code's, as on a machine that got a copy of the files),
the date and the seed. Records are written atomically (temporary file in
the same folder, fsync, rename), so an interrupted sweep never leaves a half-written one,
and a rerun skips every cell whose record is valid (:func:`record_problem`) and says ``"status": "ok"``.

One notion of a valid record serves every reader: ``run``'s finished check
(:func:`read_valid_record`), ``report`` and ``compare`` (:func:`load_records`) accept exactly the
records :func:`record_problem` finds nothing wrong with, and each names every file it cannot accept
(with the line of a JSON syntax error).

One run at a time writes into a results directory: :func:`results_lock` holds an exclusive
``flock`` on its lock file (:data:`LOCK_NAME`) for the whole run.

Reports (:mod:`mosaicquant.reports`) read only records.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import functools
import hashlib
import json
import os
import platform
import socket
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator
from typing import Any

from mosaicquant.errors import MosaicQuantError, UserInputError

__all__ = [
    "SCHEMA",
    "Metric",
    "record_path",
    "write_record",
    "read_record",
    "record_problem",
    "read_valid_record",
    "load_records",
    "save_record",
    "RecordWriteError",
    "results_lock",
    "LOCK_NAME",
    "skipped_note",
    "environment",
    "git_info",
    "source_fingerprint",
    "ensure_writable_dir",
    "command_line",
]

SCHEMA = "mosaicquant.result/1"
#: the record statuses a run writes
STATUSES = ("ok", "failed", "unavailable")
#: the lock file :func:`results_lock` keeps in a results directory (not a ``*.json``, so no reader takes it)
LOCK_NAME = ".mosaicquant.lock"


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


def record_path(out_dir: str | Path, model: str, method_label: str, suite_label: str, seed: int,
                name: str | None = None) -> Path:
    """File of the record for one cell: readable slug plus a hash of the full key.

    Args:
        out_dir: the results directory.
        model: the model's key (:func:`mosaicquant.harness.models.model_key`).
        method_label / suite_label / seed: the rest of the cell's key.
        name: the model's display name for the slug (default: from ``model``); not part of the hash.
    """
    key = json.dumps([model, method_label, suite_label, seed])
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    shown = name or Path(model).name or model
    name = f"{_slug(shown)}__{_slug(method_label)}__{_slug(suite_label)}__s{seed}__{digest}.json"
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


class RecordWriteError(MosaicQuantError):
    """A computed record could not be written into its results directory (disk full, read-only, ...)."""


def _unsaved_dir() -> Path:
    return Path(tempfile.gettempdir()) / "mosaicquant-unsaved"


def save_record(path: str | Path, record: dict[str, Any]) -> Path:
    """:func:`write_record`, and where the results directory refuses the file, keep the record elsewhere.

    A record that cannot be written (no space left, a read-only or removed folder) leaves no file in
    the results directory (the writer removes its temporary file), so nothing there counts as finished.
    The computed record is not lost: it is written to ``<temp dir>/mosaicquant-unsaved/<file name>``,
    or, where that fails too, printed as JSON to standard error; the error says which.

    Args:
        path: the record's file in the results directory.
        record: the record.

    Returns:
        ``path``.

    Raises:
        RecordWriteError: naming the file, the results directory, the reason, and where the record went.
    """
    path = Path(path)
    try:
        return write_record(path, record)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        try:
            kept = write_record(_unsaved_dir() / path.name, record)
            where = f"the computed record was saved to {kept}"
        except OSError:
            text = json.dumps(record, indent=2, sort_keys=True, default=_json_default)
            print(text, file=sys.stderr)
            where = "the computed record is printed above on standard error"
        raise RecordWriteError(
            f"cannot write record {path.name} into results directory {str(path.parent)!r}: {reason}; {where}; "
            "the sweep stops (free space or make the directory writable, then run the same command: finished "
            "records are kept)") from None


def _lock_holder(fd: int) -> dict[str, Any]:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 4096).decode("utf-8", "replace")
        holder = json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        holder = {}
    return holder if isinstance(holder, dict) else {}


@contextlib.contextmanager
def results_lock(out_dir: str | Path, log=None) -> Iterator[Path]:
    """Hold a results directory for one run: a second run into it stops at once.

    The lock is an exclusive, non-blocking ``flock`` on :data:`LOCK_NAME` in the directory, holding the
    holder's pid, host and start time. The kernel drops it when its process ends, however it ends, so
    the lock of a killed run is taken over by the next one (and named in ``log``). The second run
    stops instead of waiting: a sweep can take hours, and a run that waits silently looks hung;
    the message says who holds the folder. Leftover temporary files of a killed writer
    (``.<record>.json.*.tmp``) are removed once the lock is held.

    Args:
        out_dir: the results directory (created if needed).
        log: where to say that a dead run's lock was taken over (``None``: not said).

    Yields:
        The lock file's path.

    Raises:
        UserInputError: the directory is held by another run (naming the directory and that run's
            pid, host and start), or it is not writable.
    """
    folder = ensure_writable_dir(out_dir)
    lock_path = folder / LOCK_NAME
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, _file_mode())
    except OSError as exc:
        raise UserInputError(f"results directory {str(folder)!r}: cannot open its lock file {LOCK_NAME}: "
                             f"{exc.strerror or exc}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise UserInputError(f"results directory {str(folder)!r}: cannot lock {LOCK_NAME}: "
                                     f"{exc.strerror or exc}") from None
            holder = _lock_holder(fd)
            who = (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, since {holder.get('since', '?')}"
                   if holder else "a process that has not written its name yet")
            raise UserInputError(
                f"results directory {str(folder)!r} is in use by another run ({who}): two runs into one "
                "directory would overwrite each other's records; wait for it to end or use another --out") from None
        previous = _lock_holder(fd)
        if previous and log is not None:
            log(f"[mosaicquant] results directory {str(folder)!r}: took over the lock of an ended run "
                f"(pid {previous.get('pid', '?')} on host {previous.get('host', '?')})")
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": now_iso()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        for leftover in folder.glob(".*.json.*.tmp"):
            with contextlib.suppress(OSError):
                leftover.unlink()
        try:
            yield lock_path
        finally:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # an empty lock file: no run ended without releasing it
    finally:
        os.close(fd)


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
_SCHEMA_PREFIX = SCHEMA.rsplit("/", 1)[0] + "/"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def record_problem(rec: Any) -> str | None:
    """Why ``rec`` (a record's parsed JSON) is not a valid record, or ``None`` when it is one.

    A valid record has this package's schema (:data:`SCHEMA`; another version of it is named, not read),
    ``model.name``, ``method.name``, ``method.label``, ``suite.name`` and ``suite.label`` as strings,
    a ``status`` among :data:`STATUSES`, and ``metrics`` of the form
    ``{name: {"value": number, ...}}`` (a dict, possibly empty; an ``ok`` record needs it). A number
    may be NaN or infinite: that is what a run measured (a collapsed perplexity), and
    ``mosaicquant compare`` handles it; a string, a bool or a missing value is not a number.

    Example:
        >>> record_problem({"schema": "mosaicquant.result/0"})
        "schema 'mosaicquant.result/0' (this version reads 'mosaicquant.result/1')"
    """
    if not isinstance(rec, dict):
        return f"not a record (a JSON {type(rec).__name__}, not an object)"
    schema = rec.get("schema")
    if schema != SCHEMA:
        return f"schema {schema!r} (this version reads {SCHEMA!r})"
    for outer, inner in _REQUIRED_FIELDS:
        part = rec.get(outer)
        if not isinstance(part, dict) or not isinstance(part.get(inner), str):
            return f"a record without {outer}.{inner}"
    status = rec.get("status")
    if status not in STATUSES:
        return f"a record whose status is {status!r}, not one of {', '.join(STATUSES)}"
    metrics = rec.get("metrics")
    if metrics is None and status != "ok":
        return None
    if not isinstance(metrics, dict):
        return "a record whose metrics are not {name: {value: number, ...}}"
    for name, m in metrics.items():
        if not (isinstance(m, dict) and _is_number(m.get("value"))):
            shown = m.get("value") if isinstance(m, dict) else m
            return f"a record whose metric {name!r} is {shown!r}, not {{value: number, ...}}"
    return None


def read_valid_record(path: str | Path) -> tuple[dict[str, Any] | None, str | None]:
    """Read one record file and check it (:func:`record_problem`).

    Returns:
        ``(record, None)`` for a valid record, ``(None, why)`` for a file that is not one (the JSON
        syntax error's line and column, text that is not UTF-8, an unreadable file, or the record's
        problem), and ``(None, None)`` where no file is.
    """
    path = Path(path)
    try:
        rec = read_record(path)
    except FileNotFoundError:
        return None, None
    except UnicodeDecodeError:
        return None, "not UTF-8 text"
    except json.JSONDecodeError as exc:
        return None, f"not valid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})"
    except OSError as exc:
        return None, f"cannot be read: {exc.strerror or exc}"
    problem = record_problem(rec)
    return (None, problem) if problem is not None else (rec, None)


def _claims_record(path: Path) -> bool:
    """Whether a ``*.json`` file is named as :func:`record_path` names a record (``a__b__c__sN__hash.json``)."""
    return re.fullmatch(r".*__s-?\d+__[0-9a-f]{10}\.json", path.name) is not None


def load_records(out_dir: str | Path, required: bool = False,
                 skipped: list[tuple[str, str]] | None = None) -> list[dict[str, Any]]:
    """All valid records (:func:`record_problem`) in a results directory, sorted by file name.

    Every other ``*.json`` file that may be a record is left out and named: one that cannot be read
    as JSON (cut short: the line and column of the error; not UTF-8; unreadable), one with another
    version of this package's record schema, and one of our schema that :func:`record_problem`
    rejects. ``skipped``, when given, receives ``(file name, why)`` for each, for the caller to show
    (:func:`skipped_note`). JSON of another tool (no ``mosaicquant.result/`` schema, a file name
    that is not a record's) is left out silently: other tools' output may sit next to the records.

    A model is one model by its content: records with the same ``model.fingerprint`` (a local
    folder or ``.gguf`` file) are one model; a record without one (a built-in or hub model, or a
    record from before fingerprints) by its ``model.name``. Where one name stands for several
    models here, each record's ``model.name`` becomes ``name [first 8 hex digits]`` (``name [no
    fingerprint]`` for an older record), so reports show them as separate, distinguishable rows;
    records of one fingerprint all take the name of its first record. The name as recorded stays in
    ``model.recorded_name``.

    Raises:
        UserInputError: the directory does not exist, or (``required``) it holds no record.
    """
    p = Path(out_dir)
    if not p.is_dir():
        raise UserInputError(f"results directory {str(p)!r} does not exist")
    records = []
    unreadable: list[tuple[str, str]] = []
    for f in sorted(p.glob("*.json")):
        rec, why = read_valid_record(f)
        if rec is not None:
            rec["_path"] = str(f)
            records.append(rec)
            continue
        if why is None:
            continue  # removed while listing
        try:
            parsed = read_record(f)
        except (OSError, ValueError):
            parsed = None
        schema = parsed.get("schema") if isinstance(parsed, dict) else None
        ours = isinstance(schema, str) and schema.startswith(_SCHEMA_PREFIX)
        if parsed is None or ours or _claims_record(f):
            unreadable.append((f.name, why))
    _label_models(records)
    if skipped is not None:
        skipped.extend(unreadable)
    if required and not records:
        raise UserInputError(f"results directory {str(p)!r} holds no result records (JSON files with schema "
                             f"{SCHEMA!r})" + (f"; {skipped_note(unreadable)}" if unreadable else ""))
    return records


def _label_models(records: list[dict[str, Any]]) -> None:
    """Give every record of one model one ``model.name``, distinct from other models' (see :func:`load_records`)."""
    def identity(rec):
        fingerprint = rec["model"].get("fingerprint")
        return ("fingerprint", fingerprint) if isinstance(fingerprint, str) else ("name", rec["model"]["name"])

    first_name: dict[tuple[str, str], str] = {}
    for rec in records:
        first_name.setdefault(identity(rec), rec["model"]["name"])
    models_of_name: dict[str, set[tuple[str, str]]] = {}
    for ident, name in first_name.items():
        models_of_name.setdefault(name, set()).add(ident)
    for rec in records:
        ident = identity(rec)
        name = first_name[ident]
        if len(models_of_name[name]) > 1:
            name = f"{name} [{ident[1][:8] if ident[0] == 'fingerprint' else 'no fingerprint'}]"
        rec["model"]["recorded_name"] = rec["model"]["name"]
        rec["model"]["name"] = name


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
