"""TensorRT-LLM as a speed backend: the ModelOpt checkpoint, ``trtllm-bench``, and its report parsed.

TensorRT-LLM is the engine NVIDIA users deploy on Hopper. Its speed numbers come from its own
benchmark tool, ``trtllm-bench``, run on a checkpoint NVIDIA ModelOpt exports. A cell run with
``mosaicquant run ... --backend tensorrt-llm`` goes through these steps, the exact commands of
which are kept in the cell's record:

1. quantize with ModelOpt and export the checkpoint TensorRT-LLM loads (a Hugging Face folder with
   ``hf_quant_config.json``, written by ``modelopt.torch.export.export_hf_checkpoint``), with the
   sweep's calibration set: ``python -c "from mosaicquant.harness.tensorrt_llm import
   export_for_trtllm; export_for_trtllm(...)"`` (:func:`export_for_trtllm`; this step runs
   anywhere ModelOpt does, the CPU included);
2. ``trtllm-bench --model DIR prepare-dataset --output DATASET token-norm-dist ...``: a synthetic
   dataset of fixed input/output lengths;
3. ``trtllm-bench --model DIR throughput --dataset DATASET --backend pytorch --max_batch_size B``
   (suite ``throughput``) or ``trtllm-bench --model DIR latency --dataset DATASET --backend
   pytorch`` (suite ``latency``);
4. the report ``trtllm-bench`` prints is parsed into metrics (:func:`parse_trtllm_bench`): the
   ``PERFORMANCE OVERVIEW`` block documented in TensorRT-LLM's
   ``docs/source/developer-guide/perf-benchmarking.md`` and ``perf-overview.md``.

Where TensorRT-LLM cannot run (``tensorrt_llm`` not importable, ``trtllm-bench`` not on PATH, no
CUDA GPU), the cell's record has ``"status": "unavailable"`` with each reason and the commands
above, and the report says ``not available: <reason>``; nothing is simulated. The suites it runs
are the speed suites (``throughput``, ``latency``); a method must be ``modelopt`` (a recipe
TensorRT-LLM runs) or ``fp16``; any other cell is unavailable with that reason.

Which ModelOpt recipes a given TensorRT-LLM release runs in its PyTorch backend is that release's
matter: its docs list FP8 and NVFP4 as the modes ``trtllm-bench`` configures itself, and it reads
the others (``W4A16_AWQ``, ``W4A8_AWQ``, ``W8A8_SQ_PER_CHANNEL``) from ``hf_quant_config.json``.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mosaicquant.config import Config, check_range
from mosaicquant.errors import UserInputError
from mosaicquant.harness import data as data_mod
from mosaicquant.harness import models as models_mod
from mosaicquant.harness import shapes
from mosaicquant.harness.backends import BackendOutcome, BackendRequest
from mosaicquant.harness.context import QuantContext
from mosaicquant.harness.results import Metric
from mosaicquant.harness.spec import parse_plugin_spec
from mosaicquant.methods.modelopt_recipes import DEFAULT_RECIPE, RECIPES, import_modelopt
from mosaicquant.registry import register_backend

__all__ = [
    "TensorRTLLMConfig", "Availability", "TrtllmBenchReport", "SPEED_SUITES", "TRTLLM_METHODS",
    "check_availability", "checkpoint_dir", "plan_commands", "parse_trtllm_bench", "export_checkpoint",
    "export_for_trtllm", "tensorrt_llm_backend",
]

#: our suite name -> the ``trtllm-bench`` subcommand that measures it
SPEED_SUITES = {"throughput": "throughput", "latency": "latency"}
#: methods whose model TensorRT-LLM can load (ModelOpt checkpoints, or the float model)
TRTLLM_METHODS = ("modelopt", "fp16")


@dataclass(frozen=True)
class TensorRTLLMConfig(Config):
    """``trtllm-bench`` settings (``--backend tensorrt-llm:input_len=1024:output_len=128``).

    Attributes:
        input_len / output_len: tokens per request of the synthetic dataset (fixed, stdev 0).
        num_requests: requests in the dataset.
        max_batch_size: ``throughput``'s ``--max_batch_size`` (the paper's decode range is 4-32).
        export_device: where step 1 calibrates (``cuda`` on the GPU machine, ``cpu`` works too).
        timeout_s: limit for each ``trtllm-bench`` command.
    """

    description = "NVIDIA TensorRT-LLM through trtllm-bench on a ModelOpt checkpoint (speed suites)"

    input_len: int = 128
    output_len: int = 128
    num_requests: int = 512
    max_batch_size: int = 32
    export_device: str = "cuda"
    timeout_s: int = 3600

    def validate(self):
        check_range("input_len", self.input_len, 1, None, integer=True)
        check_range("output_len", self.output_len, 1, None, integer=True)
        check_range("num_requests", self.num_requests, 1, None, integer=True)
        check_range("max_batch_size", self.max_batch_size, 1, None, integer=True)
        check_range("timeout_s", self.timeout_s, 1, None, integer=True)
        if not (self.export_device == "cpu" or self.export_device.startswith("cuda")):
            raise UserInputError(f"export_device={self.export_device!r} is not allowed: use 'cpu', 'cuda' or 'cuda:N'")


@dataclass(frozen=True)
class Availability:
    """Whether TensorRT-LLM can run here, and each reason it cannot.

    Attributes:
        tensorrt_llm_version: the importable package's version, or None.
        trtllm_bench: the path of ``trtllm-bench``, or None.
        gpu: the CUDA GPU's name, or None.
        reasons: one line per missing piece; empty when available.
    """

    tensorrt_llm_version: str | None
    trtllm_bench: str | None
    gpu: str | None
    reasons: tuple[str, ...]

    @property
    def available(self) -> bool:
        return not self.reasons

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)

    def to_dict(self) -> dict[str, Any]:
        return {"tensorrt_llm_version": self.tensorrt_llm_version, "trtllm_bench": self.trtllm_bench,
                "gpu": self.gpu, "reasons": list(self.reasons)}


def _tensorrt_llm_version() -> tuple[str | None, str | None]:
    if importlib.util.find_spec("tensorrt_llm") is None:
        return None, "tensorrt_llm is not importable (TensorRT-LLM is not installed)"
    # imported in a child process: importing it initialises CUDA and MPI, which this process must not inherit
    probe = subprocess.run([sys.executable, "-c", "import tensorrt_llm; print(tensorrt_llm.__version__)"],
                           capture_output=True, text=True, timeout=600)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["(no message)"])[-1]
        return None, f"tensorrt_llm is installed but its import fails: {last}"
    return probe.stdout.strip().splitlines()[-1], None


@functools.lru_cache(maxsize=1)
def check_availability() -> Availability:
    """Check ``import tensorrt_llm``, ``trtllm-bench`` on PATH and a CUDA GPU (once per process)."""
    reasons = []
    version, problem = _tensorrt_llm_version()
    if problem:
        reasons.append(problem)
    bench = shutil.which("trtllm-bench")
    if bench is None:
        reasons.append("trtllm-bench is not on PATH")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    if gpu is None:
        reasons.append("no CUDA GPU")
    return Availability(version, bench, gpu, tuple(reasons))


def checkpoint_dir(out_dir: str | Path, model: str, method_label: str) -> Path:
    """Folder of the exported checkpoint (and the dataset and logs) of one model × method spec."""
    slug = re.sub(r"[^A-Za-z0-9_.=-]+", "_", f"{Path(model).name or model}__{method_label}").strip("_")
    return Path(out_dir) / "tensorrt-llm" / slug


def _dataset_path(ckpt: Path, config: TensorRTLLMConfig) -> Path:
    return ckpt / f"synthetic_isl{config.input_len}_osl{config.output_len}_n{config.num_requests}.jsonl"


def plan_commands(request: BackendRequest, config: TensorRTLLMConfig) -> list[list[str]]:
    """The argv of each step for ``request``'s cell: export, dataset, benchmark (see the module doc).

    Returns:
        Three argument lists; ``shlex.join`` renders each as the command a user runs.
    """
    ckpt = checkpoint_dir(request.out_dir, request.model, request.method_label)
    dataset = _dataset_path(ckpt, config)
    text = json.dumps  # a double-quoted literal: the shell command then needs no nested quoting
    export_call = (
        "from mosaicquant.harness.tensorrt_llm import export_for_trtllm; "
        f"export_for_trtllm({text(request.model)}, {text(request.method_label)}, {text(str(ckpt))}, "
        f"corpus={text(request.corpus)}, calib_samples={request.calib_samples}, calib_seqlen={request.calib_seqlen}, "
        f"seed={request.seed}, device={text(config.export_device)})"
    )
    prepare = ["trtllm-bench", "--model", str(ckpt), "prepare-dataset", "--output", str(dataset), "token-norm-dist",
               "--num-requests", str(config.num_requests), "--input-mean", str(config.input_len),
               "--output-mean", str(config.output_len), "--input-stdev", "0", "--output-stdev", "0"]
    bench = ["trtllm-bench", "--model", str(ckpt), SPEED_SUITES[request.suite_name], "--dataset", str(dataset),
             "--backend", "pytorch"]
    if request.suite_name == "throughput":
        bench += ["--max_batch_size", str(config.max_batch_size)]
    return [["python", "-c", export_call], prepare, bench]


# ---------------------------------------------------------------------------------------------
# the report trtllm-bench prints

@dataclass(frozen=True)
class TrtllmBenchReport:
    """What :func:`parse_trtllm_bench` reads from a ``trtllm-bench`` report.

    Attributes:
        metrics: the ``PERFORMANCE OVERVIEW`` values, by our metric names.
        info: every other ``Key: value`` line, as ``"SECTION/Key"`` -> text (engine, world, dataset).
        unrecognised: overview lines that map to no metric (kept, never guessed at).
    """

    metrics: dict[str, Metric]
    info: dict[str, str] = field(default_factory=dict)
    unrecognised: dict[str, str] = field(default_factory=dict)


# label printed by trtllm-bench -> (metric name, unit, higher is better); the labels of the
# current and the earlier report layout (the latter says "Token Throughput", see the fixtures)
_OVERVIEW = {
    "Request Throughput (req/sec)": ("request_throughput", "req/s", True),
    "Total Output Throughput (tokens/sec)": ("output_throughput", "tok/s", True),
    "Token Throughput (tokens/sec)": ("token_throughput", "tok/s", True),
    "Total Token Throughput (tokens/sec)": ("total_token_throughput", "tok/s", True),
    "Per User Output Throughput (tokens/sec/user)": ("per_user_output_throughput", "tok/s/user", True),
    "Per User Output Throughput [w/ ctx] (tps/user)": ("per_user_output_throughput", "tok/s/user", True),
    "Per GPU Output Throughput (tokens/sec/gpu)": ("per_gpu_output_throughput", "tok/s/gpu", True),
    "Per GPU Output Throughput (tps/gpu)": ("per_gpu_output_throughput", "tok/s/gpu", True),
    "Per User Output Speed [1/TPOT] (tokens/sec/user)": ("per_user_output_speed", "tok/s/user", True),
    "Per User Output Speed (tps/user)": ("per_user_output_speed", "tok/s/user", True),
    "Total Latency (ms)": ("total_latency_ms", "ms", False),
    "Average request latency (ms)": ("request_latency_avg_ms", "ms", False),
    "Average time-to-first-token [TTFT] (ms)": ("ttft_avg_ms", "ms", False),
    "Average time-per-output-token [TPOT] (ms)": ("tpot_avg_ms", "ms", False),
    "Number of requests": ("num_requests", None, True),
    "Number of concurrent requests": ("concurrent_requests", None, True),
    "Average Input Length (tokens)": ("input_len_avg", "tokens", True),
    "Average Output Length (tokens)": ("output_len_avg", "tokens", True),
}
# "[Latency] P50    : 3936.3022": per-request breakdowns -> (prefix, unit, higher is better)
_BREAKDOWN = {
    "Latency": ("request_latency", "ms", False),
    "TTFT": ("ttft", "ms", False),
    "TPOT": ("tpot", "ms", False),
    "GTPS": ("gen_tps", "tok/s/user", True),
}
_STAT = {"MINIMUM": "min", "MAXIMUM": "max", "AVERAGE": "avg", "P50": "p50", "P90": "p90", "P95": "p95",
         "P99": "p99"}
# whose value is a count or length describing the workload, not a speed: kept, direction irrelevant
_WORKLOAD = {"num_requests", "concurrent_requests", "input_len_avg", "output_len_avg"}

_RULE = re.compile(r"^=+\s*$")
_SECTION = re.compile(r"^=\s+(?P<name>\S.*?)\s*$")
_STAT_LINE = re.compile(r"^\[(?P<group>[A-Za-z]+)\]\s*(?P<stat>[A-Z0-9]+)\s*:\s*(?P<value>[-+0-9.eE]+)\s*$")
_KEY_VALUE = re.compile(r"^(?P<key>[A-Za-z][^:]*?)\s*:\s*(?P<value>\S.*?)\s*$")
_NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?$")


def parse_trtllm_bench(text: str) -> TrtllmBenchReport:
    """Parse the report ``trtllm-bench throughput|latency`` prints.

    The report is a run of sections, each a ``===`` rule, a ``= NAME`` line, a rule, then
    ``Key: value`` lines; ``PERFORMANCE OVERVIEW`` holds the speed values and the
    ``[Latency] P50 : value`` breakdowns. Log lines outside the sections are ignored.

    Args:
        text: the command's standard output (log lines around the report are fine).

    Returns:
        The metrics (``output_throughput`` in tok/s, ``request_latency_p50_ms``, ...) and the rest.

    Raises:
        ValueError: no ``PERFORMANCE OVERVIEW`` section with a number in it (the tool printed no
            report, as its docs say happens when the benchmark runs out of memory).

    Example:
        >>> rep = parse_trtllm_bench("=====\\n= PERFORMANCE OVERVIEW\\n=====\\nRequest Throughput (req/sec):  2.5\\n")
        >>> rep.metrics["request_throughput"].value
        2.5
    """
    metrics: dict[str, Metric] = {}
    info: dict[str, str] = {}
    unrecognised: dict[str, str] = {}
    section: str | None = None
    after_header = False
    lines = text.splitlines()
    for i, raw in enumerate(lines):
        line = raw.strip()
        if _RULE.match(line):
            following = lines[i + 1].strip() if i + 1 < len(lines) else ""
            if not after_header and not _SECTION.match(following):
                section = None  # a closing rule: what follows is log output until the next header
            after_header = False
            continue
        header = _SECTION.match(line)
        after_header = bool(header)
        if header:
            section = header.group("name").upper()
            continue
        if section is None or not line:
            continue
        stat = _STAT_LINE.match(line)
        if stat and section == "PERFORMANCE OVERVIEW":
            group = _BREAKDOWN.get(stat.group("group"))
            suffix = _STAT.get(stat.group("stat"))
            if group and suffix:
                prefix, unit, higher = group
                name = f"{prefix}_{suffix}" + ("_ms" if unit == "ms" else "")
                metrics[name] = Metric(float(stat.group("value")), higher, unit)
            else:
                unrecognised[line.split(":")[0].strip()] = stat.group("value")
            continue
        kv = _KEY_VALUE.match(line)
        if not kv:
            continue
        key, value = kv.group("key"), kv.group("value")
        if section == "PERFORMANCE OVERVIEW" and _NUMBER.match(value):
            known = _OVERVIEW.get(key)
            if known:
                name, unit, higher = known
                metrics[name] = Metric(float(value), higher, unit)
            else:
                unrecognised[key] = value
        else:
            info[f"{section}/{key}"] = value
    if not any(name not in _WORKLOAD for name in metrics):
        raise ValueError("no PERFORMANCE OVERVIEW values in the trtllm-bench output (the tool prints none when the "
                         "benchmark fails, e.g. out of memory)")
    return TrtllmBenchReport(metrics, info, unrecognised)


# ---------------------------------------------------------------------------------------------
# step 1: the checkpoint

def export_checkpoint(model: torch.nn.Module, tokenizer: Any, export_dir: str | Path,
                      dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """Write ``model`` (float, or quantized by ModelOpt) as the checkpoint TensorRT-LLM loads.

    Args:
        model: a Hugging Face causal LM, after ``mtq.quantize`` or unquantized.
        tokenizer: its tokenizer (saved next to the weights: ``trtllm-bench`` tokenizes with it).
        export_dir: the folder to write.
        dtype: of the unquantized tensors (TensorRT-LLM runs bfloat16 / float16).

    Returns:
        The ``quantization`` block of ``hf_quant_config.json`` (``{}`` for an unquantized model).
    """
    import_modelopt()
    from modelopt.torch.export import export_hf_checkpoint

    export_dir = Path(export_dir)
    export_dir.mkdir(parents=True, exist_ok=True)
    if not getattr(model.config, "architectures", None):
        # ModelOpt's exporter reads the architecture name from the config
        model.config.architectures = [type(model).__name__]
    with torch.inference_mode():
        export_hf_checkpoint(model, dtype=dtype, export_dir=export_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(export_dir)
    quant_config = export_dir / "hf_quant_config.json"
    return json.loads(quant_config.read_text()).get("quantization", {}) if quant_config.exists() else {}


def export_for_trtllm(model: str, method: str, export_dir: str | Path, *, corpus: str = "enwiki-sample",
                      calib_samples: int = 128, calib_seqlen: int = 2048, seed: int = 0,
                      device: str = "cuda") -> Path:
    """Load ``model``, quantize it with ``method`` on the sweep's calibration set, export it (step 1).

    Args:
        model: a model spec (built-in name, folder, ``.gguf`` file or hub id).
        method: ``modelopt[:recipe=...]`` or ``fp16``.
        export_dir: the folder to write.
        corpus / calib_samples / calib_seqlen / seed: the calibration set, as in ``mosaicquant run``.
        device: where to calibrate.

    Returns:
        ``export_dir``.

    Raises:
        UserInputError: a method TensorRT-LLM has no format for.
    """
    spec = parse_plugin_spec(method, "method")
    if spec.name not in TRTLLM_METHODS:
        raise UserInputError(
            f"method {spec.name!r} has no TensorRT-LLM checkpoint: use one of {', '.join(TRTLLM_METHODS)}")
    target = torch.device(device)
    loaded = models_mod.load_model(model, dtype=torch.float32, device=target)
    torch.manual_seed(seed)
    ctx = QuantContext(
        calibration=lambda: data_mod.calibration_tokens(loaded.tokenizer, corpus, calib_samples, calib_seqlen, seed),
        seed=seed, device=target, tokenizer=loaded.tokenizer)
    quantized = spec.entry.fn(loaded.model, spec.config, ctx)
    export_checkpoint(quantized, loaded.tokenizer, export_dir)
    (Path(export_dir) / "mosaicquant_export.json").write_text(json.dumps(
        {"model": model, "method": spec.label, "method_info": ctx.info, "corpus": corpus,
         "calib_samples": calib_samples, "calib_seqlen": calib_seqlen, "seed": seed}, indent=2, default=str))
    return Path(export_dir)


# ---------------------------------------------------------------------------------------------
# the backend

def _run_step(argv: list[str], log_path: Path, timeout_s: int) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    log_path.write_text(result.stdout + ("\n--- stderr ---\n" + result.stderr if result.stderr else ""))
    if result.returncode != 0:
        tail = (result.stderr.strip() or result.stdout.strip()).splitlines()[-5:]
        raise RuntimeError(f"{shlex.join(argv[:4])} ... exited {result.returncode}: {' | '.join(tail)}")
    return result.stdout


@register_backend("tensorrt-llm", config=TensorRTLLMConfig, description=TensorRTLLMConfig.description)
def tensorrt_llm_backend(request: BackendRequest, config: TensorRTLLMConfig) -> BackendOutcome:
    """Run one speed cell with ``trtllm-bench``, or say exactly why it cannot run here."""
    if request.suite_name not in SPEED_SUITES:
        return BackendOutcome.unavailable(
            f"the tensorrt-llm backend runs the speed suites ({', '.join(sorted(SPEED_SUITES))}); "
            f"suite {request.suite_name!r} runs in-process (the default backend)")
    if request.method_name not in TRTLLM_METHODS:
        return BackendOutcome.unavailable(
            f"TensorRT-LLM runs ModelOpt checkpoints: method {request.method_name!r} has no TensorRT-LLM format "
            f"(use one of {', '.join(TRTLLM_METHODS)})")
    if shapes.is_shape_model(request.model):
        return BackendOutcome.unavailable(
            f"TensorRT-LLM benchmarks a checkpoint with its tokenizer; the random-weight shape model "
            f"{request.model!r} has no tokenizer: use a real model (built-in name, folder or hub id)")
    steps = plan_commands(request, config)
    commands = [shlex.join(argv) for argv in steps]
    method_info = _planned_method_info(request)
    availability = check_availability()
    details = {"availability": availability.to_dict()}
    reasons = list(availability.reasons)
    group_problem = _int4_group_problem(request)
    if group_problem:
        reasons.append(group_problem)
    if reasons:
        return BackendOutcome.unavailable("; ".join(reasons), commands, details, method_info)

    ckpt = checkpoint_dir(request.out_dir, request.model, request.method_label)
    ckpt.mkdir(parents=True, exist_ok=True)
    export, prepare, bench = steps
    if not (ckpt / "mosaicquant_export.json").exists():  # throughput and latency share one checkpoint
        _run_step([sys.executable, *export[1:]], ckpt / "export.log", config.timeout_s)
    if not _dataset_path(ckpt, config).exists():
        _run_step(prepare, ckpt / "prepare-dataset.log", config.timeout_s)
    stdout = _run_step(bench, ckpt / f"{request.suite_name}.log", config.timeout_s)
    report = parse_trtllm_bench(stdout)
    export_info = json.loads((ckpt / "mosaicquant_export.json").read_text())
    details.update(report_info=report.info, unrecognised=report.unrecognised, checkpoint=str(ckpt),
                   export=export_info)
    method_info.update({k: v for k, v in export_info.get("method_info", {}).items() if k != "exec_path"})
    return BackendOutcome("ok", commands=tuple(commands), metrics=report.metrics, details=details,
                          method_info=method_info)


#: ModelOpt packs int4 weights for TensorRT-LLM in whole groups of this many input channels
INT4_GROUP = 128


def _model_dims(model: str) -> dict[str, int] | None:
    """Hidden and intermediate sizes from the model's config, without loading weights (None if unknown)."""
    source = models_mod.resolve_model(model)
    if source.kind == "builtin":
        config = models_mod.BUILTIN_MODELS[source.location].expected_config
    elif source.kind == "folder":
        config = json.loads((Path(source.location) / "config.json").read_text())
    else:
        return None
    return {k: int(config[k]) for k in ("hidden_size", "intermediate_size") if k in config}


def _int4_group_problem(request: BackendRequest) -> str | None:
    """Why step 1 cannot export an int4 recipe of this model, if it cannot.

    ModelOpt 0.47's export refuses a partial int4 group ("partial blocks are not supported"),
    so every linear's input size must be a multiple of 128 (SmolLM2's hidden size 576 is not).
    """
    if request.method_name != "modelopt" or request.method_config.get("recipe", DEFAULT_RECIPE) not in ("int4_awq",
                                                                                                   "w4a8_awq"):
        return None
    dims = _model_dims(request.model) or {}
    bad = {k: v for k, v in dims.items() if v % INT4_GROUP}
    if not bad:
        return None
    shown = ", ".join(f"{k} {v}" for k, v in bad.items())
    return f"ModelOpt's int4 export needs input sizes that are multiples of {INT4_GROUP} ({request.model}: {shown})"


def _planned_method_info(request: BackendRequest) -> dict[str, Any]:
    """Bits and execution path of the cell's method, from its config (nothing is run for this)."""
    info: dict[str, Any] = {"exec_path": "TensorRT-LLM (trtllm-bench, PyTorch backend)"}
    if request.method_name == "modelopt":
        name = request.method_config.get("recipe", DEFAULT_RECIPE)
        recipe = RECIPES[name]
        info.update(wbits=recipe.wbits, abits=recipe.abits, kv_bits=16, recipe=name,
                    modelopt_config=recipe.config_name, trtllm_quant_algo=recipe.trtllm_quant_algo)
    else:
        info.update(wbits=16, abits=16, kv_bits=16)
    return info
