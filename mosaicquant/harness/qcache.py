"""The quantized-model cache: a quantized model saved once per (method config, model, calibration) and
reloaded by a later run into the same results folder, so that adding a suite does not quantize again.

Where: ``<results folder>/quantized/`` (:data:`CACHE_FOLDER`). The cache lives and goes with the records
made from it, and the results folder's lock (:func:`mosaicquant.harness.results.results_lock`) keeps two
runs from writing it at once.

Key: the SHA-256 of the canonical JSON of :func:`key_parts`: the method's name and canonical options
(``Config.to_dict``), the model's key and content fingerprint, the dtype, the device type the method ran on
(quantization on a GPU and on the CPU rounds differently), and the calibration settings (corpus, sample
count, length, seed, dtype). Any change to one of them is another entry. Code changes are not part of the
key, as they are not part of a record's: remove the folder after changing a method.

Format: one entry is two files.

- ``<key>.<digest>.safetensors``: every tensor of the quantized model that differs from the float model's
  tensor at the same place (the rest are taken from the float model on reload). No pickle. A simulated 4-bit
  linear (:class:`~mosaicquant.methods.qlinear.FakeQuantLinear` with a :class:`~mosaicquant.methods.format.PackedW4`)
  whose float weight is its packed weight's dequantization bit for bit is stored as the packed weight only (4-bit
  values two a byte, FP16 scales, residual blocks) and its weight is dequantized again on reload, so an entry is
  about the size of the 4-bit model (plus the float tensors a method changed, such as rotated embeddings).
- ``<key>.json``: written last, through a temp file and a rename, so an entry exists only once both are
  whole. It holds the key parts, the tensor file's name, size and SHA-256, the module tree
  (:class:`_Encoder`), the method's ``method_info``, its calibration record, the original quantization time
  and a probe digest: the SHA-256 of the quantized model's logits on :data:`PROBE_TOKENS` fixed tokens.

Module tree: each module of the quantized model is described by its class, its parameters and buffers (as
tensor references), its child modules, its other attributes and its forward hooks. A module of the same
(non-MosaicQuant) class as the float model's module at the same path is reused from a fresh float copy and
patched (an attribute the cache cannot encode that the float module holds too, such as transformers' kernel
table, is kept from the float copy); any other is built anew (``cls.__new__`` then ``nn.Module.__init__``)
and filled in. Values are JSON primitives, lists, tuples, dicts, sets, dtypes, devices, enums, tensors,
modules, dataclasses and other objects of MosaicQuant classes, and module-level functions or classes of
``mosaicquant``, ``torch`` or ``transformers``; the model's config is stored as its differences from the float config. Anything else
(a closure used as a hook, a tensor subclass, an object of another library) makes the model not cacheable:
the run quantizes as before and the record says why nothing was stored.

Reload: the JSON and the tensor file's size and SHA-256 are checked, the tree is rebuilt on a fresh float
copy and the probe is run again; its digest must match. Any failure is a damaged entry: it is removed, the
model is quantized again (and stored again), and the record carries the warning.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import hashlib
import importlib
import json
import math
import os
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mosaicquant.harness import assets
from mosaicquant.harness import models as models_mod
from mosaicquant.methods.format import PackedW4
from mosaicquant.methods.qlinear import FakeQuantLinear

__all__ = ["CACHE_FOLDER", "FORMAT", "PROBE_TOKENS", "NotCacheable", "DamagedEntry", "CacheEntry", "QuantCache",
           "key_parts", "cache_key", "probe_digest"]

#: the cache's folder inside a results folder
CACHE_FOLDER = "quantized"
#: version of the entry layout; part of the key, so a new layout never reads an old entry
FORMAT = 2
#: tokens of the probe whose logits a reloaded model must reproduce bit for bit
PROBE_TOKENS = 16
_ALLOWED_PREFIXES = ("mosaicquant.", "torch.", "transformers.")
_NEW_MODULE_INTERNALS = frozenset(nn.Module().__dict__)
_OTHER_HOOKS = ("_backward_pre_hooks", "_backward_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
                "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


class NotCacheable(Exception):
    """The quantized model holds something the cache cannot store faithfully (the message says what and where)."""


class DamagedEntry(Exception):
    """A cache entry that is incomplete, altered or does not reproduce its model (the message says how)."""


def key_parts(spec, method, seed: int) -> dict[str, Any]:
    """What a quantized model depends on, as JSON-able values (see the module docstring).

    Args:
        spec: the run (:class:`mosaicquant.harness.spec.RunSpec`).
        method: the method spec (:class:`mosaicquant.harness.spec.PluginSpec`).
        seed: the seed.
    """
    return {
        "format": FORMAT,
        "method": method.name,
        "config": method.config.to_dict(),
        "model": models_mod.model_key(spec.model),
        "fingerprint": models_mod.model_fingerprint(spec.model),
        "dtype": spec.dtype,
        "device": torch.device(spec.device).type,
        "calibration": {"corpus": spec.corpus, "n_samples": spec.calib_samples, "seqlen": spec.calib_seqlen,
                        "seed": seed, "dtype": spec.dtype},
    }


def cache_key(parts: dict[str, Any]) -> str:
    """The hex SHA-256 of the canonical JSON of ``parts`` (first 32 digits)."""
    canonical = json.dumps(parts, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def probe_digest(model: nn.Module) -> str:
    """SHA-256 of the model's float32 logits on :data:`PROBE_TOKENS` fixed token ids (on the model's device)."""
    device = next(model.parameters()).device
    vocab = int(model.config.vocab_size)
    ids = ((torch.arange(PROBE_TOKENS) * 7919 + 11) % vocab).unsqueeze(0).to(device)
    with torch.no_grad():
        out = model(input_ids=ids)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return hashlib.sha256(logits.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()


def _qualname(obj: Any) -> str:
    return f"{obj.__module__}:{obj.__qualname__}"


def _resolve(name: str) -> Any:
    module, _, qual = name.partition(":")
    if not (module + ".").startswith(_ALLOWED_PREFIXES):
        raise DamagedEntry(f"the entry names {name!r}, outside the allowed packages {_ALLOWED_PREFIXES}")
    found: Any = importlib.import_module(module)
    for part in qual.split("."):
        found = getattr(found, part)
    return found


def _importable(obj: Any) -> bool:
    module, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
    if not isinstance(module, str) or "<" in qual or not (module + ".").startswith(_ALLOWED_PREFIXES):
        return False
    try:
        return _resolve(_qualname(obj)) is obj
    except (ImportError, AttributeError, DamagedEntry):
        return False


def _own_class(obj: Any) -> bool:
    return type(obj).__module__.startswith("mosaicquant.")


def _packed_source(m: nn.Module) -> PackedW4 | None:
    """The packed weight a simulated 4-bit linear's float weight is the exact dequantization of, else ``None``."""
    if not isinstance(m, FakeQuantLinear) or not isinstance(m.packed, PackedW4):
        return None
    weight = m.weight.detach()
    rebuilt = m.packed.dequantize(weight.dtype)
    if rebuilt.shape != weight.shape or not torch.equal(rebuilt.to(weight.device), weight):
        return None
    return m.packed


class _Encoder:
    """Turns a quantized model into a JSON tree plus a dict of tensors, against the float model."""

    def __init__(self, float_model: nn.Module):
        self.float_model = float_model
        self.float_modules = dict(float_model.named_modules(remove_duplicate=False))
        self.float_tensors = {**dict(float_model.named_parameters(remove_duplicate=False)),
                              **dict(float_model.named_buffers(remove_duplicate=False))}
        self.tensors: dict[str, torch.Tensor] = {}
        self.objects: list[Any] = []
        self._memo: dict[int, int] = {}
        self._alive: list[Any] = []
        self._storages: set[int] = set()
        self.changed = False
        self.root_config: Any = None
        #: id of a simulated 4-bit layer's weight -> the packed weight it is the dequantization of
        self._dequantized_from: dict[int, PackedW4] = {}

    def encode_model(self, model: nn.Module) -> dict[str, Any]:
        self.root_config = getattr(model, "config", None)
        root = self.value(model, "", "model")
        config = self._config_changes(model)
        self.changed = self.changed or bool(config["changes"]) or config["attn_implementation"] is not None
        return {"root": root, "objects": self.objects, "config": config}

    def _config_changes(self, model: nn.Module) -> dict[str, Any]:
        new, old = getattr(model, "config", None), getattr(self.float_model, "config", None)
        if new is None or old is None:
            return {"changes": [], "attn_implementation": None}
        new_dict, old_dict = new.to_dict(), old.to_dict()
        changes = [[k, self.value(v, "", f"config.{k}")] for k, v in new_dict.items()
                   if k not in old_dict or old_dict[k] != v]
        attn = getattr(new, "_attn_implementation", None)
        return {"changes": changes,
                "attn_implementation": attn if attn != getattr(old, "_attn_implementation", None) else None}

    def _ref(self, obj: Any) -> tuple[int, bool]:
        if id(obj) in self._memo:
            return self._memo[id(obj)], False
        index = len(self.objects)
        self._memo[id(obj)] = index
        self._alive.append(obj)
        self.objects.append(None)
        return index, True

    def _mark(self) -> tuple[int, bool]:
        return len(self.objects), self.changed

    def _rewind(self, mark: tuple[int, bool]) -> None:
        """Forget what an attribute that turned out not cacheable had begun to encode."""
        count, self.changed = mark
        for key, index in list(self._memo.items()):
            if index >= count:
                del self._memo[key]
        for index in range(count, len(self.objects)):
            self.tensors.pop(f"t{index}", None)
        del self.objects[count:], self._alive[count:]

    def value(self, v: Any, path: str, where: str) -> Any:
        if v is None or isinstance(v, (bool, int, str)) and type(v) in (bool, int, str):
            return v
        if type(v) is float:
            return v if math.isfinite(v) else {"__nonfinite__": repr(v)}
        if type(v) is list:
            return [self.value(x, path, f"{where}[{i}]") for i, x in enumerate(v)]
        if type(v) is tuple:
            return {"__tuple__": [self.value(x, path, f"{where}[{i}]") for i, x in enumerate(v)]}
        if type(v) in (set, frozenset):
            return {"__set__": [self.value(x, path, where) for x in sorted(v, key=repr)],
                    "frozen": type(v) is frozenset}
        if type(v) in (dict, collections.OrderedDict):
            return {"__dict__": [[self.value(k, path, where), self.value(x, path, f"{where}[{k!r}]")]
                                 for k, x in v.items()]}
        if isinstance(v, torch.dtype):
            return {"__dtype__": str(v).removeprefix("torch.")}
        if isinstance(v, torch.device):
            return {"__device__": str(v)}
        if isinstance(v, torch.Tensor):
            return self._tensor(v, path, where)
        if isinstance(v, nn.Module):
            return self._module(v, path, where)
        if isinstance(v, enum.Enum) and _importable(type(v)):
            return {"__enum__": _qualname(type(v)), "name": v.name}
        if isinstance(v, (type, types.FunctionType, types.BuiltinFunctionType)):
            if _importable(v):
                return {"__function__": _qualname(v)}
            raise NotCacheable(f"{where}: {v!r} is not a module-level function or class of {_ALLOWED_PREFIXES}")
        if v is self.root_config and v is not None:
            return {"__config__": True}
        if _own_class(v) and hasattr(v, "__dict__") and _importable(type(v)):
            index, new = self._ref(v)
            if new:
                self.objects[index] = {"kind": "object", "class": _qualname(type(v)),
                                       "state": [[k, self.value(x, path, f"{where}.{k}")] for k, x in vars(v).items()]}
            return {"__ref__": index}
        raise NotCacheable(f"{where}: a value of type {type(v).__module__}.{type(v).__qualname__}")

    def _tensor(self, t: torch.Tensor, path: str, where: str) -> dict[str, Any]:
        if type(t) not in (torch.Tensor, nn.Parameter):
            raise NotCacheable(f"{where}: a tensor subclass {type(t).__qualname__}")
        index, new = self._ref(t)
        if new:
            entry: dict[str, Any] = {"kind": "tensor", "parameter": isinstance(t, nn.Parameter),
                                     "requires_grad": bool(t.requires_grad), "device": t.device.type}
            data = t.detach()
            original = self.float_tensors.get(path)
            packed = self._dequantized_from.get(id(t))
            if packed is not None:
                # stored as its packed 4-bit form, dequantized again on reload
                self.changed = True
                entry["dequantized"] = {"packed": self.value(packed, path, f"{where} (packed)"),
                                        "dtype": self.value(data.dtype, path, where)}
            elif (original is not None and original.shape == data.shape and original.dtype == data.dtype
                    and torch.equal(original.detach(), data.cpu())):
                entry["float"] = path
            else:
                self.changed = True
                cpu = data.to("cpu").contiguous()
                storage = cpu.untyped_storage()
                if (storage.data_ptr() in self._storages or storage.nbytes() != cpu.numel() * cpu.element_size()):
                    cpu = cpu.clone()
                self._storages.add(cpu.untyped_storage().data_ptr())
                key = f"t{index}"
                self.tensors[key] = cpu
                entry["key"] = key
            self.objects[index] = entry
        return {"__ref__": index}

    def _hooks(self, m: nn.Module, where: str) -> dict[str, Any]:
        def encode(hooks, kinds: dict[int, bool], label: str):
            out = []
            for handle_id, fn in hooks.items():
                if not _importable(fn):
                    raise NotCacheable(f"{where}: {label} {fn!r} is not a module-level function")
                out.append([_qualname(fn), bool(kinds.get(handle_id, False))])
            return out
        return {"pre": encode(m._forward_pre_hooks, m._forward_pre_hooks_with_kwargs, "forward pre-hook"),
                "post": encode(m._forward_hooks, m._forward_hooks_with_kwargs, "forward hook")}

    def _module(self, m: nn.Module, path: str, where: str) -> dict[str, Any]:
        index, new = self._ref(m)
        if not new:
            return {"__ref__": index}
        original = self.float_modules.get(path)
        reuse = original is not None and type(original) is type(m) and not _own_class(m)
        if not reuse:
            self.changed = True
            if not _importable(type(m)):
                raise NotCacheable(f"{where}: module class {type(m).__module__}.{type(m).__qualname__} "
                                   f"is not importable from {_ALLOWED_PREFIXES}")
            if any(getattr(m, name) for name in _OTHER_HOOKS):
                raise NotCacheable(f"{where}: {type(m).__qualname__} carries backward or state-dict hooks")
        prefix = f"{path}." if path else ""
        entry: dict[str, Any] = {"kind": "module", "class": _qualname(type(m)), "reuse": reuse, "path": path,
                                 "training": m.training}
        self.objects[index] = entry  # placed before the children, which may point back at it
        packed = _packed_source(m)
        if packed is not None:
            self._dequantized_from[id(m.weight)] = packed
        entry["parameters"] = [[n, None if p is None else self._tensor(p, prefix + n, f"{where}.{n}")]
                               for n, p in m._parameters.items()]
        entry["buffers"] = [[n, None if b is None else self._tensor(b, prefix + n, f"{where}.{n}")]
                            for n, b in m._buffers.items()]
        entry["non_persistent"] = sorted(m._non_persistent_buffers_set)
        entry["children"] = [[n, None if c is None else self._module(c, prefix + n, f"{where}.{n}")]
                             for n, c in m._modules.items()]
        entry["hooks"] = self._hooks(m, where)
        attrs, deleted, kept = [], [], []
        for k, v in m.__dict__.items():
            if k in _NEW_MODULE_INTERNALS:
                continue
            mark = self._mark()
            try:
                attrs.append([k, self.value(v, prefix + k, f"{where}.{k}")])
            except NotCacheable:
                self._rewind(mark)
                # a value the float module holds too (transformers' kernel table, a generation config) is taken
                # from the float copy on reload; the probe check catches a method that changed one
                if not (reuse and k in original.__dict__):
                    raise
                kept.append(k)
        if reuse:
            deleted = [k for k in original.__dict__ if k not in m.__dict__ and k not in _NEW_MODULE_INTERNALS]
            if deleted:
                self.changed = True
        entry["attrs"], entry["deleted"], entry["kept"] = attrs, deleted, kept
        return {"__ref__": index}


class _Decoder:
    """Rebuilds the quantized model from the JSON tree and the tensors on a fresh float copy (``skeleton``)."""

    def __init__(self, tree: dict[str, Any], tensors: dict[str, torch.Tensor], skeleton: nn.Module,
                 device: torch.device):
        self.tree, self.tensors, self.skeleton, self.device = tree, tensors, skeleton, device
        self.skeleton_modules = dict(skeleton.named_modules(remove_duplicate=False))
        self.skeleton_tensors = {**dict(skeleton.named_parameters(remove_duplicate=False)),
                                 **dict(skeleton.named_buffers(remove_duplicate=False))}
        self.done: dict[int, Any] = {}
        self._handed_out: set[int] = set()

    def model(self) -> nn.Module:
        model = self.value(self.tree["root"])
        config = self.tree["config"]
        for key, value in config["changes"]:
            setattr(model.config, key, self.value(value))
        if config["attn_implementation"] is not None:
            from mosaicquant.methods import kvcache

            if config["attn_implementation"] in kvcache.KV_ATTENTION_NAMES.values():
                kvcache.register_attention()
            model.set_attn_implementation(config["attn_implementation"])
        return model

    def value(self, v: Any) -> Any:
        if not isinstance(v, (dict, list)):
            return v
        if isinstance(v, list):
            return [self.value(x) for x in v]
        if "__ref__" in v:
            return self._object(v["__ref__"])
        if "__tuple__" in v:
            return tuple(self.value(x) for x in v["__tuple__"])
        if "__set__" in v:
            items = [self.value(x) for x in v["__set__"]]
            return frozenset(items) if v["frozen"] else set(items)
        if "__dict__" in v:
            return {self.value(k): self.value(x) for k, x in v["__dict__"]}
        if "__nonfinite__" in v:
            return float(v["__nonfinite__"])
        if "__dtype__" in v:
            return getattr(torch, v["__dtype__"])
        if "__device__" in v:
            return torch.device(v["__device__"])
        if "__enum__" in v:
            return _resolve(v["__enum__"])[v["name"]]
        if "__function__" in v:
            return _resolve(v["__function__"])
        if "__config__" in v:
            return self.skeleton.config
        raise DamagedEntry(f"unknown value in the module tree: {sorted(v)}")

    def _object(self, index: int) -> Any:
        if index in self.done:
            return self.done[index]
        entry = self.tree["objects"][index]
        kind = entry["kind"]
        if kind == "tensor":
            return self._tensor(index, entry)
        if kind == "object":
            cls = _resolve(entry["class"])
            obj = cls.__new__(cls)
            self.done[index] = obj
            for k, x in entry["state"]:
                object.__setattr__(obj, k, self.value(x))
            return obj
        return self._module(index, entry)

    def _tensor(self, index: int, entry: dict[str, Any]) -> torch.Tensor:
        if "float" in entry:
            found = self.skeleton_tensors[entry["float"]]
            if id(found) in self._handed_out:  # tied in the float model, untied in the quantized one
                found = nn.Parameter(found.detach().clone(), requires_grad=found.requires_grad) \
                    if isinstance(found, nn.Parameter) else found.clone()
            self._handed_out.add(id(found))
            tensor = found
        elif "dequantized" in entry:
            packed, dtype = self.value(entry["dequantized"]["packed"]), self.value(entry["dequantized"]["dtype"])
            if not isinstance(packed, PackedW4) or not isinstance(dtype, torch.dtype):
                raise DamagedEntry("a dequantized weight that names no packed weight or dtype")
            data = packed.dequantize(dtype)
            data = data.to(self.device) if entry["device"] != "cpu" else data.cpu()
            tensor = nn.Parameter(data, requires_grad=entry["requires_grad"]) if entry["parameter"] else data
        else:
            data = self.tensors[entry["key"]]
            data = data.to(self.device) if entry["device"] != "cpu" else data
            tensor = nn.Parameter(data, requires_grad=entry["requires_grad"]) if entry["parameter"] else data
        self.done[index] = tensor
        return tensor

    def _module(self, index: int, entry: dict[str, Any]) -> nn.Module:
        if entry["reuse"]:
            m = self.skeleton_modules[entry["path"]]
        else:
            cls = _resolve(entry["class"])
            m = cls.__new__(cls)
            nn.Module.__init__(m)
        self.done[index] = m
        m.training = entry["training"]
        m._parameters = {n: None if p is None else self.value(p) for n, p in entry["parameters"]}
        m._buffers = {n: None if b is None else self.value(b) for n, b in entry["buffers"]}
        m._non_persistent_buffers_set = set(entry["non_persistent"])
        m._modules = {n: None if c is None else self.value(c) for n, c in entry["children"]}
        for k in entry["deleted"]:
            m.__dict__.pop(k, None)
        for k, x in entry["attrs"]:
            m.__dict__[k] = self.value(x)
        m._forward_pre_hooks.clear()
        m._forward_pre_hooks_with_kwargs.clear()
        m._forward_hooks.clear()
        m._forward_hooks_with_kwargs.clear()
        for name, with_kwargs in entry["hooks"]["pre"]:
            m.register_forward_pre_hook(_resolve(name), with_kwargs=with_kwargs)
        for name, with_kwargs in entry["hooks"]["post"]:
            m.register_forward_hook(_resolve(name), with_kwargs=with_kwargs)
        return m


@dataclasses.dataclass
class CacheEntry:
    """A reloaded entry: the model and what the run that stored it recorded."""

    model: nn.Module
    method_info: dict[str, Any]
    calibration: dict[str, Any] | None
    quantize_s: float
    load_s: float


class QuantCache:
    """One (method spec, seed)'s place in a results folder's cache, and what became of it for the record.

    Args:
        out: the results folder.
        parts: :func:`key_parts` of the method spec and seed.
        log: progress printer.
    """

    def __init__(self, out: str | os.PathLike, parts: dict[str, Any], log=print):
        self.folder = Path(out) / CACHE_FOLDER
        self.parts = parts
        self.key = cache_key(parts)
        self.log = log
        self.status: dict[str, Any] = {"key": self.key, "hit": False, "stored": False, "warning": None,
                                       "not_cached": None, "file": None}

    @property
    def index_path(self) -> Path:
        return self.folder / f"{self.key}.json"

    def _damaged(self, why: str) -> None:
        warning = f"cache entry {self.index_path.name} is damaged ({why}): quantizing again"
        self.status["warning"] = warning
        self.log(f"[mosaicquant] warning: {warning}")
        for stale in self.folder.glob(f"{self.key}.*"):
            stale.unlink(missing_ok=True)

    def load(self, skeleton: nn.Module, device: torch.device) -> CacheEntry | None:
        """The cached quantized model rebuilt on ``skeleton`` (a fresh float copy on ``device``), or ``None``
        when there is no entry or it is damaged (then the warning is in :attr:`status` and the entry is gone)."""
        t0 = time.perf_counter()
        try:
            return self._load(skeleton, device, t0)
        except DamagedEntry as exc:
            self._damaged(str(exc))
            return None

    def _load(self, skeleton: nn.Module, device: torch.device, t0: float) -> CacheEntry | None:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        if not self.index_path.exists():
            if any(self.folder.glob(f"{self.key}.*.safetensors")):
                raise DamagedEntry("a tensor file without its index: an interrupted write")
            return None
        try:
            index = json.loads(self.index_path.read_text(encoding="utf-8"))
            tensor_path = self.folder / index["tensors"]["file"]
            expected_size, expected_sha = int(index["tensors"]["size"]), index["tensors"]["sha256"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DamagedEntry(f"unreadable index: {type(exc).__name__}: {exc}") from None
        if index.get("parts") != self.parts:
            raise DamagedEntry("its key parts differ from this cell's")
        if not tensor_path.is_file():
            raise DamagedEntry(f"tensor file {tensor_path.name} is missing")
        size = tensor_path.stat().st_size
        if size != expected_size:
            raise DamagedEntry(f"tensor file is {size} bytes, the index says {expected_size}")
        if assets.sha256_file(tensor_path) != expected_sha:
            raise DamagedEntry("tensor file's SHA-256 differs from the index's")
        try:
            tensors = load_file(str(tensor_path))
            model = _Decoder(index["tree"], tensors, skeleton, device).model()
        except (SafetensorError, OSError, KeyError, TypeError, ValueError, AttributeError, ImportError) as exc:
            raise DamagedEntry(f"cannot rebuild the model: {type(exc).__name__}: {exc}") from None
        model.eval()
        try:
            probe = probe_digest(model)
        except Exception as exc:  # noqa: BLE001 - a rebuilt model that does not run is a damaged entry
            raise DamagedEntry(f"the reloaded model's probe failed: {type(exc).__name__}: {exc}") from None
        if probe != index["probe"]:
            raise DamagedEntry("the reloaded model's probe logits differ from the quantized model's")
        self.status.update(hit=True, file=f"{CACHE_FOLDER}/{tensor_path.name}")
        return CacheEntry(model=model, method_info=index["method_info"], calibration=index["calibration"],
                          quantize_s=float(index["quantize_s"]), load_s=time.perf_counter() - t0)

    def store(self, model: nn.Module, float_model: nn.Module, quantize_s: float, method_info: dict[str, Any],
              calibration: dict[str, Any] | None) -> None:
        """Write the entry (tensors, then the index; each through a temp file and a rename). A model the cache
        cannot hold, or a folder that cannot be written, leaves the reason in :attr:`status` and no entry."""
        try:
            self._store(model, float_model, quantize_s, method_info, calibration)
        except NotCacheable as exc:
            self.status["not_cached"] = str(exc)
            self.log(f"[mosaicquant] quantized model not cached: {exc}")
        except OSError as exc:
            self.status["not_cached"] = f"cannot write {self.folder}: {exc.strerror or exc}"
            self.log(f"[mosaicquant] warning: quantized model not cached: {self.status['not_cached']}")

    def _store(self, model: nn.Module, float_model: nn.Module, quantize_s: float, method_info: dict[str, Any],
               calibration: dict[str, Any] | None) -> None:
        from safetensors.torch import save_file

        encoder = _Encoder(float_model)
        tree = encoder.encode_model(model)
        if not encoder.changed:
            raise NotCacheable("the method left the float model as it was: nothing to store")
        try:
            json.dumps(method_info, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise NotCacheable(f"method_info is not JSON: {exc}") from None
        try:
            probe = probe_digest(model)
        except Exception as exc:  # noqa: BLE001 - a model the probe cannot run is not stored, the run goes on
            raise NotCacheable(f"the probe forward failed: {type(exc).__name__}: {exc}") from None
        self.folder.mkdir(parents=True, exist_ok=True)
        handle, temp = tempfile.mkstemp(prefix=f".{self.key}.", suffix=".part", dir=self.folder)
        os.close(handle)
        try:
            save_file(encoder.tensors, temp, metadata={"format": "mosaicquant quantized model", "key": self.key})
            with open(temp, "rb") as written:
                os.fsync(written.fileno())
            digest = assets.sha256_file(temp)
            size = os.path.getsize(temp)
            name = f"{self.key}.{digest[:16]}.safetensors"
            os.replace(temp, self.folder / name)
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise
        index = {"format": FORMAT, "key": self.key, "parts": self.parts,
                 "tensors": {"file": name, "size": size, "sha256": digest, "count": len(encoder.tensors)},
                 "probe": probe, "quantize_s": quantize_s, "method_info": method_info, "calibration": calibration,
                 "tree": tree}
        assets.atomic_write_bytes(self.index_path, json.dumps(index, allow_nan=False).encode())
        self.status.update(stored=True, file=f"{CACHE_FOLDER}/{name}")
