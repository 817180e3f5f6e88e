"""Run specifications: which model, which methods (each with its config), which suites, seeds.

Grammar (command line and YAML alike): a method or suite is ``name[:key=value[:key=value…]]``;
``--methods`` takes a comma-separated list, so one sweep can hold several configs of one
method (``fp16,rtn:wbits=8:abits=8,rtn``). Each cell is labelled by its canonical spec: the
name followed by the options that differ from the defaults, in the config's field order
(``rtn:abits=8:wbits=8`` and ``rtn:wbits=8:abits=8`` are one cell, labelled the latter).

A YAML run spec looks like::

    model: smollm2-135m
    methods: [fp16, "rtn:wbits=8:abits=8", {name: rtn, wbits: 4}]
    suites: [accuracy]
    seeds: [0]
    corpus: enwiki-sample
    calib_samples: 16
    calib_seqlen: 1024
    max_chunks: 8
    out: results/smollm2
    backend: torch        # or a registered backend, as --backend

Command-line options override the file's values. The file is read as UTF-8 through YAML's
safe loader: a tag that builds a Python object (``!!python/object``) is refused like any
other invalid YAML.
"""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mosaicquant.config import Config, check_range, exact_number_text, parse_kv_pairs
from mosaicquant.errors import UserInputError
from mosaicquant.registry import Entry, METHODS, SUITES, get_method, get_suite

__all__ = ["PRESETS", "PluginSpec", "RunSpec", "parse_plugin_spec", "parse_plugin_list", "load_run_spec",
           "check_model_fit"]


@dataclass(frozen=True)
class PluginSpec:
    """A method or suite with its validated config."""

    name: str
    config: Config
    kind: str

    @property
    def label(self) -> str:
        over = self.config.overrides()
        return ":".join([self.name] + [f"{k}={_fmt(v)}" for k, v in over.items()])

    @property
    def entry(self) -> Entry:
        return get_method(self.name) if self.kind == "method" else get_suite(self.name)


def _fmt(value: Any) -> str:
    """A label's text of an option value; distinct values get distinct text (see :func:`exact_number_text`)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    if isinstance(value, float):
        return exact_number_text(value)
    return str(value)


def parse_plugin_spec(item: str | dict, kind: str) -> PluginSpec:
    """Parse ``"name:k=v:k=v"`` (or ``{"name": ..., k: v}``) into a validated :class:`PluginSpec`.

    Raises:
        UserInputError: unknown name (with a did-you-mean), unknown option, bad value.
    """
    if isinstance(item, dict):
        data = dict(item)
        if "name" not in data:
            raise UserInputError(f"{kind} entry {item!r} needs a 'name'")
        name = str(data.pop("name"))
        options = data
    else:
        text = str(item).strip()
        if not text:
            raise UserInputError(f"empty {kind} name")
        name, _, rest = text.partition(":")
        options = parse_kv_pairs(rest)
    entry = get_method(name) if kind == "method" else get_suite(name)
    try:
        config = entry.config.from_dict(options)
    except UserInputError as exc:
        raise UserInputError(f"{kind} {name!r}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise UserInputError(f"{kind} {name!r}: {exc}") from None
    return PluginSpec(name=name, config=config, kind=kind)


def parse_plugin_list(text: str | list, kind: str) -> list[PluginSpec]:
    """Parse a comma-separated list (or a YAML list) of plugin specs; duplicates are merged."""
    items = text if isinstance(text, list) else [t for t in _split_top(text, kind) if t.strip()]
    out = _merge_duplicates([parse_plugin_spec(item, kind) for item in items])
    if not out:
        raise UserInputError(f"no {kind}s given")
    return out


def _merge_duplicates(specs: list[PluginSpec]) -> list[PluginSpec]:
    """``specs`` with each label once, in first-seen order (one config is one cell)."""
    out: list[PluginSpec] = []
    seen = set()
    for spec in specs:
        if spec.label not in seen:
            seen.add(spec.label)
            out.append(spec)
    return out


_LIST_ELEMENT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|\d+[xX]\d+")


def _split_top(text: str, kind: str) -> list[str]:
    """Split a comma-separated list of ``name[:key=value...]`` items.

    A value may itself hold commas (``analysis:budgets=0.1,0.3``, ``zeroshot:tasks=piqa,lambada``):
    a comma-separated piece continues the previous item's last value when that item has options,
    the piece does not start with a registered name, and either the piece starts with what looks
    like an element of a list (a number or a shape such as ``64x128``) or that option holds a list
    (see :meth:`Config.list_option_names`). Anything else starts a new item, so a misspelt name
    after an option (``rtn:wbits=8,fp17``) is reported as an unknown name, not as a bad value.
    """

    names = set((METHODS if kind == "method" else SUITES).names())
    out: list[str] = []
    for piece in str(text).split(","):
        head = piece.strip().split(":", 1)[0]
        if out and "=" in out[-1] and head not in names and (
                _LIST_ELEMENT.fullmatch(head.strip()) or _last_option_is_list(out[-1], kind)):
            out[-1] = out[-1] + "," + piece.strip()
        else:
            out.append(piece.strip())
    return out


def _last_option_is_list(item: str, kind: str) -> bool:
    """Whether the last ``key=value`` of ``item`` (``name:...:key=value``) sets a list option."""
    name, _, rest = item.partition(":")
    key = rest.rsplit(":", 1)[-1].partition("=")[0].strip().replace("-", "_")
    try:
        entry = get_method(name) if kind == "method" else get_suite(name)
    except UserInputError:
        return False  # an unknown name is reported when the item is parsed
    return key in entry.config.list_option_names()


@dataclass
class RunSpec:
    """Everything a sweep needs, validated before any long work starts."""

    model: str
    methods: list[PluginSpec]
    suites: list[PluginSpec]
    seeds: list[int] = field(default_factory=lambda: [0])
    corpus: str = "enwiki-sample"
    calib_samples: int = 128
    calib_seqlen: int = 2048
    out: str = "results"
    device: str = "cpu"
    dtype: str = "float32"
    #: what runs the cells: None (the in-process default) or a backend spec ``name[:key=value...]``
    backend: str | None = None
    #: the preset the run started from (a key of :data:`PRESETS`), or None
    preset: str | None = None

    def validate(self) -> None:
        check_range("calib_samples", self.calib_samples, 1, None, integer=True)
        check_range("calib_seqlen", self.calib_seqlen, 2, None, integer=True)
        if not self.seeds:
            raise UserInputError(f"no seeds given: allowed integers 0..{_MAX_SEED}, e.g. --seeds 0,1")
        for s in self.seeds:
            check_range("seed", s, 0, _MAX_SEED, integer=True)
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise UserInputError(f"dtype={self.dtype!r} is not allowed: choose one of 'float32', 'bfloat16', 'float16'")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise UserInputError(f"device={self.device!r} is not allowed: use 'cpu', 'cuda' or 'cuda:N'")

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "methods": [m.label for m in self.methods],
            "suites": [s.label for s in self.suites],
            "seeds": list(self.seeds),
            "corpus": self.corpus,
            "calib_samples": self.calib_samples,
            "calib_seqlen": self.calib_seqlen,
            "out": self.out,
            "device": self.device,
            "dtype": self.dtype,
            "preset": self.preset,
        }


_RUN_KEYS = {"model", "methods", "suites", "seeds", "corpus", "calib_samples", "calib_seqlen", "out",
             "device", "dtype", "max_chunks", "backend"}

#: integer keys of a run spec and their smallest allowed value
_INT_KEYS = {"calib_samples": 1, "calib_seqlen": 2, "max_chunks": 1}
#: string keys of a run spec and what each allows
_STR_KEYS = {
    "model": "a built-in name, a local model folder, a .gguf file or a hub id",
    "corpus": "a corpus name (see 'mosaicquant ls corpora')",
    "out": "a results directory",
    "device": "'cpu', 'cuda' or 'cuda:N'",
    "dtype": "'float32', 'bfloat16' or 'float16'",
    "backend": "'torch' or a registered backend name[:key=value...] (see 'mosaicquant ls backends')",
}
_MAX_SEED = 2**31 - 1

#: named starting points of a run: each fills the run-spec keys it names; a spec file's keys and the
#: command line's options override them. ``quick``: a real, small comparison on the built-in SmolLM2-135M
#: (fp16; RTN and QuaRot-RTN without the weight clipping search; MosaicQuant with an RTN base and the
#: paper's diagonal Δ-score; 4 perplexity chunks of 128 tokens, 4 calibration sequences of 128 tokens); no
#: GPTQ pass and no least-squares block fits. Its numbers are a smoke check of the methods' ordering, not
#: paper numbers.
PRESETS: dict[str, dict[str, Any]] = {
    "quick": {
        "model": "smollm2-135m",
        "methods": "fp16,rtn:w_clip_search=false,quarot:w_quant=rtn:w_clip_search=false,mosaicquant:score=delta:base=rtn",
        "suites": "accuracy:seqlen=128",
        "max_chunks": 4,
        "calib_samples": 4,
        "calib_seqlen": 128,
        "out": "results/quick",
    },
}


def _yaml_error_line(exc: yaml.YAMLError) -> str:
    """PyYAML's error (several lines with a context excerpt) as one line: the problem and where."""
    problem = getattr(exc, "problem", None)
    mark = getattr(exc, "problem_mark", None)
    if problem and mark is not None:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(exc).split())


def _check_int(key: str, value: Any) -> int:
    """``value`` of integer key ``key``, or a one-line error saying what is allowed."""
    lo = _INT_KEYS[key]
    if value is None:
        raise UserInputError(f"{key} is empty: allowed integers >= {lo}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserInputError(f"{key}={value!r} is not an integer: allowed integers >= {lo}")
    check_range(key, value, lo, None, integer=True)
    return value


def _check_str(key: str, value: Any) -> str:
    """``value`` of string key ``key``, or a one-line error saying what is allowed."""
    if value is None or (isinstance(value, str) and not value.strip()):
        raise UserInputError(f"{key} is empty: give {_STR_KEYS[key]}")
    if not isinstance(value, str):
        raise UserInputError(f"{key}={value!r} is not a string: give {_STR_KEYS[key]} (quote it in YAML)")
    return value


def _parse_seeds(value: Any) -> list[int]:
    """Seeds from ``"0,1"``, ``[0, 1]`` or ``0``: integers in 0..2**31-1, duplicates merged (first order kept).

    Raises:
        UserInputError: no seed, or a seed that is not an integer (``1.7``, ``true``, ``'abc'``) or out of range.
    """
    allowed = f"allowed integers 0..{_MAX_SEED}, e.g. --seeds 0,1 or 'seeds: [0, 1]'"
    if isinstance(value, str):
        items: list[Any] = []
        for text in value.split(","):
            if not text.strip():
                continue
            try:
                items.append(int(text))
            except ValueError:
                raise UserInputError(f"seed {text.strip()!r} in seeds={value!r} is not an integer: {allowed}") from None
    elif isinstance(value, list):
        items = value
    elif value is None:
        items = []
    else:
        items = [value]
    if not items:
        raise UserInputError(f"no seeds given: {allowed}")
    seeds: list[int] = []
    for seed in items:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise UserInputError(f"seed {seed!r} is not an integer: {allowed}")
        check_range("seed", seed, 0, _MAX_SEED, integer=True)
        if seed not in seeds:
            seeds.append(seed)
    return seeds


def load_run_spec(path: str | None, overrides: dict[str, Any], preset: str | None = None) -> RunSpec:
    """Merge a preset (optional), a YAML run spec (optional) and command-line overrides (``None`` = not
    given), each overriding the one before.

    ``max_chunks`` given at the top level is passed to every suite that has that option (the
    ``accuracy`` suite); suites that become equal by it are merged. Every key is type-checked:
    integers must be integers (not ``true``, not ``1.5``), strings non-empty strings; repeated
    seeds are merged.

    Raises:
        UserInputError: unreadable file or invalid YAML (one line), unknown keys, missing
            model/methods/suites, no seeds, a value of the wrong type or out of range.
    """
    if preset is not None and preset not in PRESETS:
        raise UserInputError(f"preset={preset!r} is not allowed: choose one of {', '.join(map(repr, PRESETS))}")
    data: dict[str, Any] = dict(PRESETS[preset]) if preset is not None else {}
    if path:
        try:
            data = yaml.safe_load(Path(path).read_bytes().decode("utf-8")) or {}
        except OSError as exc:
            raise UserInputError(f"run spec {path!r} cannot be read: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            line = exc.object[:exc.start].count(b"\n") + 1
            raise UserInputError(f"run spec {path!r} is not UTF-8 text: byte {exc.object[exc.start]:#04x} at line "
                                 f"{line} (offset {exc.start}) cannot be decoded; save the file as UTF-8") from None
        except yaml.YAMLError as exc:
            raise UserInputError(f"run spec {path!r} is not valid YAML: {_yaml_error_line(exc)}") from None
        if not isinstance(data, dict):
            raise UserInputError(f"run spec {path!r} must be a mapping of keys to values")
        unknown = sorted(set(data) - _RUN_KEYS, key=str)
        if unknown:
            raise UserInputError(f"run spec {path!r} has unknown keys {unknown}: allowed {sorted(_RUN_KEYS)}")
        if preset is not None:
            data = {**PRESETS[preset], **data}
    for key, value in overrides.items():
        if value is not None:
            data[key] = value
    for key in ("model", "methods", "suites"):
        if not data.get(key):
            raise UserInputError(f"no {key} given: use --{key} (or '{key}:' in the run spec)")
    for key in ("methods", "suites"):
        if not isinstance(data[key], (str, list)):
            raise UserInputError(f"{key}={data[key]!r}: expected a comma-separated string or a list of "
                                 f"name[:key=value...] specs")
    given = {key: _check_str(key, data[key]) for key in _STR_KEYS if key in data}
    ints = {key: _check_int(key, data[key]) for key in _INT_KEYS if key in data
            if not (key == "max_chunks" and data[key] is None)}
    seeds = _parse_seeds(data["seeds"]) if "seeds" in data else [0]
    methods = parse_plugin_list(data["methods"], "method")
    suites = parse_plugin_list(data["suites"], "suite")
    if "max_chunks" in ints:
        suites = _merge_duplicates([
            PluginSpec(s.name, s.config.replace(max_chunks=ints["max_chunks"]), "suite")
            if "max_chunks" in s.config.field_names() else s
            for s in suites
        ])
    spec = RunSpec(
        model=given["model"],
        methods=methods,
        suites=suites,
        seeds=seeds,
        corpus=given.get("corpus", "enwiki-sample"),
        calib_samples=ints.get("calib_samples", 128),
        calib_seqlen=ints.get("calib_seqlen", 2048),
        out=given.get("out", "results"),
        device=given.get("device", "cpu"),
        dtype=given.get("dtype", "float32"),
        backend=given.get("backend"),
        preset=preset,
    )
    spec.validate()
    return spec


#: the tokens a suite's option puts through the model at once, as (suite, option, extra positions, only on a
#: GPU): the accuracy suite's ``seqlen`` is one forward pass, the memory suite's one on a GPU (its peak memory);
#: the speed suites' ``prefill_len`` one prefill, and their decode step reads ``context`` cached tokens and
#: writes one more
_CONTEXT_BOUND = (("accuracy", "seqlen", 0, False), ("memory", "seqlen", 0, True),
                  ("throughput", "prefill_len", 0, True), ("latency", "prefill_len", 0, True),
                  ("throughput", "context", 1, True), ("latency", "context", 1, True))


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _kv_group(method: PluginSpec, head_dim: int) -> int | None:
    """The K/V group the method's KV-cache quantizer would use on heads of ``head_dim`` (None: one a head, or no
    K/V quantization)."""
    kv_spec = getattr(method.config, "kv_spec", None)
    if kv_spec is None:
        return None
    try:
        spec = kv_spec(head_dim) if inspect.signature(kv_spec).parameters else kv_spec()
    except UserInputError:  # a config that checks the head itself refuses its group: named with the model below
        return method.config.kv_group_size
    return spec.group_size if spec.enabled else None


def check_model_fit(spec: RunSpec, dims: dict[str, int]) -> None:
    """Check the options that depend on the model's sizes against its config, before it loads.

    A method's ``w_group_size`` groups each linear layer's input features, so it must divide
    every input size: ``hidden_size`` (attention and MLP inputs), ``num_attention_heads *
    head_dim`` (attention output) and ``intermediate_size`` (MLP down projection). A method's
    K/V groups (``kv_group_size``) split each head, so they must divide ``head_dim``. The tokens
    a suite puts through the model at once are at most ``max_position_embeddings``: the
    ``accuracy`` suite's ``seqlen``, and on a GPU the ``memory`` suite's ``seqlen`` (its peak-memory
    pass), the speed suites' ``prefill_len``, and their ``context`` plus the decoded token. A size
    the config does not state is not checked.

    Args:
        spec: the sweep.
        dims: the model's sizes (:func:`mosaicquant.harness.models.model_dimensions`).

    Raises:
        UserInputError: naming the option, the model's sizes and the allowed values.
    """
    inputs = {key: dims[key] for key in ("hidden_size", "intermediate_size") if key in dims}
    if "num_attention_heads" in dims and "head_dim" in dims:
        inputs["num_attention_heads*head_dim"] = dims["num_attention_heads"] * dims["head_dim"]
    for method in spec.methods:
        group = getattr(method.config, "w_group_size", None)
        if group is None or not inputs or all(size % group == 0 for size in inputs.values()):
            continue
        common = math.gcd(*inputs.values())
        sizes = ", ".join(f"{key} {size}" for key, size in inputs.items())
        raise UserInputError(
            f"method {method.label!r}: w_group_size={group} does not divide the input size of every linear layer "
            f"of model {spec.model!r} ({sizes}): allowed the divisors of {common}: {_divisors(common)}")
    head_dim = dims.get("head_dim")
    for method in spec.methods:
        group = _kv_group(method, head_dim) if head_dim is not None else None
        if group is not None and head_dim % group:
            raise UserInputError(
                f"method {method.label!r}: kv_group_size={group} does not divide the head dimension of model "
                f"{spec.model!r} (head_dim {head_dim}): allowed the divisors of {head_dim}: {_divisors(head_dim)}")
    context = dims.get("max_position_embeddings")
    for suite in spec.suites:
        for name, option, extra, gpu_only in _CONTEXT_BOUND:
            used = suite.name == name and (str(spec.device).startswith("cuda") or not gpu_only)
            value = getattr(suite.config, option, None) if used else None
            if context is not None and value is not None and value + extra > context:
                lo = 2 if (name, option) == ("accuracy", "seqlen") else 1
                more = " plus the decoded token" if extra else ""
                raise UserInputError(
                    f"suite {suite.label!r}: {option}={value}{more} is longer than model {spec.model!r} reads at "
                    f"once (max_position_embeddings {context}): allowed integers {lo}..{context - extra}")
