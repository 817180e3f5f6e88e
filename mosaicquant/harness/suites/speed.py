"""Speed suites: ``throughput`` and ``latency`` on a CUDA GPU (SPEC §4).

Both time the model's *executable* form (:func:`mosaicquant.harness.speedforms.executable`):
quantized layers run on the Triton W4A4 kernels (dense GEMM, or ZipperEngine with the fused
residual), float models on cuBLAS BF16. A method whose quantized layers have no kernel path
is recorded as unavailable with the reason, never timed on a stand-in. The record's
``method_info.exec_path_speed`` says which path ran.

``throughput``
    * ``prefill_tok_s``: ``prefill_batch × prefill_len`` tokens through the model (logits for
      the last position only, as a server computes them), captured in a CUDA graph and
      replayed, median of ``replays`` passes. Eager launches (``cuda_graphs=false``) put the
      host's Python launch overhead into the number: on the Triton paths it varied 15k–28k
      tok/s for one cell between runs while BF16 stayed within 1%.
    * ``decode_tok_s/b{B}`` for each batch ``B``: one decode step with a static KV cache
      holding ``context`` tokens, captured in a CUDA graph and replayed (launch overhead
      excluded, as in CUDA-graph serving); tokens/s = ``B`` / median step time.
    * both run on the ``runtime`` decoder (:mod:`mosaicquant.harness.runtime`): ``fused``
      (single-kernel norms, RoPE + KV write, split-KV attention, SiLU·mul, for every method
      alike), ``transformers`` (the eager code), or ``auto`` (fused where the model allows,
      else transformers); the record's ``method_info.speed.runtime`` says which ran and why.
    * with ``nvidia-ml-py`` on the GPU: ``decode_energy_j_per_tok/b{B}`` (energy counter over
      ``energy_s`` seconds of replays after the timed ones), ``decode_power_w/b{B}`` (mean power
      of that window) and ``decode_sm_clock_mhz/b{B}`` (sampled at
      the end of the window).
    * the floor (:mod:`mosaicquant.harness.floor`): the card's copy bandwidth and BF16 / INT8
      tensor-core rates, measured in the same run (``method_info.speed.ceilings``);
      ``decode_bytes/b{B}``, the bytes a decode step must read (weights as stored, output head,
      KV cache), ``decode_floor_frac/b{B}`` = (bytes / copy bandwidth) / step time, and
      ``prefill_floor_frac`` = (matrix flops / tensor-core rate) / prefill time.
    * a ``compiled`` form (``method_info.speed.form``, e.g. ``torchao:compile=true``): each timed
      call is made once before timing, which compiles it for its shapes; those seconds are
      recorded per measurement in ``method_info.speed.compile_s`` (``prefill``, ``decode_b{B}``),
      never in the timings.

``latency``
    * ``linear_us/{group}/m{M}``: one linear group of a decoder layer (``qkv_proj`` = q, k and
      v projections in turn, ``o_proj``, ``gate_up_proj`` = gate and up, ``down_proj``) on
      ``M`` tokens, its online transform and activation quantization included, cycled over
      as many decoder layers as it takes to move more than ``rotate_mb`` of weights (more
      than the L2 cache), CUDA graphs, median per call.
    * ``step_ms/prefill`` and ``step_ms/decode_b{B}``: the same measurements as
      ``throughput`` as step times.

Both take the kernels' user-facing settings as options (:class:`mosaicquant.settings.KernelSettings`):
``pdl`` (programmatic dependent launch, default on), ``pdl_chain`` (``on`` / ``off``) and
``prefetch_mib`` (the L2 prefetch cap of PDL GEMM launches; default: each launcher's own), for
example ``--suites throughput:pdl=false``; the timings run with them in force.

Spreads are half the interquartile range of the replays. Token values are random (speed
does not depend on them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from mosaicquant import settings
from mosaicquant.config import Config, check_range
from mosaicquant.errors import Unavailable, UserInputError
from mosaicquant.harness.floor import byte_floor_us, decode_bytes, floor_fraction, measure_ceilings, module_bytes, \
    prefill_flops, prefill_floor_rate, quantized_linears
from mosaicquant.harness.results import Metric
from mosaicquant.harness.runtime import RUNTIMES, FusedDecoder, resolve_runtime
from mosaicquant.harness.speedforms import executable
from mosaicquant.harness.telemetry import Telemetry
from mosaicquant.harness.timing import time_calls
from mosaicquant.registry import register_suite

__all__ = ["ThroughputConfig", "LatencyConfig", "throughput", "latency", "LINEAR_GROUPS", "measure_prefill",
           "decode_step", "fused_decode_step", "measure_decode", "first_call_s", "measure_linear_group", "SPEED_SUITES"]

SPEED_SUITES = ("throughput", "latency")

#: linear groups of a decoder layer, as the papers' per-layer tables name them
LINEAR_GROUPS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
}
DEFAULT_MS = (1, 4, 8, 16, 32, 64, 128, 512, 2048, 8192)


def _check_ints(name: str, values, minimum: int = 1) -> None:
    if not isinstance(values, tuple) or not values:
        raise ValueError(f"{name} must be a non-empty list of integers, got {values!r}")
    for v in values:
        check_range(name, v, minimum, None, integer=True)


def _check_runtime(runtime: str) -> None:
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime: {runtime!r} is not allowed: choose from {', '.join(RUNTIMES)}")


@dataclass(frozen=True)
class ThroughputConfig(Config):
    """Throughput options.

    Attributes:
        prefill_len: tokens per sequence in the prefill measurement.
        prefill_batch: sequences per prefill.
        batches: decode batch sizes (the paper's range 4–32).
        context: tokens already in the KV cache during decode.
        replays: timed repetitions (median and spread over them).
        cuda_graphs: capture the prefill and the decode steps in CUDA graphs (else eager
            launches timed with CUDA events, for models whose layers cannot be captured).
        energy_s: seconds of decode steps replayed in one NVML window per batch size (energy per
            token, mean power), after the timed replays.
        runtime: decoder code around the linears: ``auto``, ``fused`` or ``transformers``
            (:data:`mosaicquant.harness.runtime.RUNTIMES`).
        pdl, pdl_chain, prefetch_mib: the kernels' settings of these names in force while timing
            (:class:`mosaicquant.settings.KernelSettings`).
    """

    description = "prefill tokens/s and CUDA-graph decode tokens/s at batch 4-32, with NVML energy (GPU)"

    prefill_len: int = 2048
    prefill_batch: int = 1
    batches: tuple[int, ...] = (4, 8, 16, 32)
    context: int = 512
    replays: int = 11
    cuda_graphs: bool = True
    energy_s: float = 2.0
    runtime: str = "auto"
    pdl: bool = True
    pdl_chain: str = "on"
    prefetch_mib: float | None = None

    def validate(self):
        _check_runtime(self.runtime)
        self.set_canonical("pdl_chain", kernel_settings(self).pdl_chain)
        check_range("energy_s", self.energy_s, 0.1, 600.0)
        check_range("prefill_len", self.prefill_len, 1, None, integer=True)
        check_range("prefill_batch", self.prefill_batch, 1, None, integer=True)
        _check_ints("batches", self.batches)
        check_range("context", self.context, 1, None, integer=True)
        check_range("replays", self.replays, 3, None, integer=True)


@dataclass(frozen=True)
class LatencyConfig(Config):
    """Latency options.

    Attributes:
        ms: token counts M of the per-layer measurement.
        groups: linear groups to time (keys of ``LINEAR_GROUPS``).
        rotate_mb: weights cycled per measurement exceed this many MiB (beyond L2).
        steps: also time the end-to-end prefill and decode steps.
        prefill_len, batches, context: as in ``throughput`` (end-to-end steps).
        replays: timed repetitions.
        runtime: decoder code of the end-to-end steps, as in ``throughput``.
        pdl, pdl_chain, prefetch_mib: the kernels' settings, as in ``throughput``.
    """

    description = "per-linear-layer latency over M = 1..8192 and end-to-end step latency (GPU, CUDA graphs)"

    ms: tuple[int, ...] = DEFAULT_MS
    groups: tuple[str, ...] = tuple(LINEAR_GROUPS)
    rotate_mb: int = 180
    steps: bool = True
    prefill_len: int = 2048
    batches: tuple[int, ...] = (4, 8, 16, 32)
    context: int = 512
    replays: int = 11
    runtime: str = "auto"
    pdl: bool = True
    pdl_chain: str = "on"
    prefetch_mib: float | None = None

    def validate(self):
        _check_runtime(self.runtime)
        self.set_canonical("pdl_chain", kernel_settings(self).pdl_chain)
        _check_ints("ms", self.ms)
        for g in self.groups:
            if g not in LINEAR_GROUPS:
                raise ValueError(f"groups: {g!r} is not allowed: choose from {', '.join(LINEAR_GROUPS)}")
        check_range("rotate_mb", self.rotate_mb, 0, None, integer=True)
        check_range("prefill_len", self.prefill_len, 1, None, integer=True)
        _check_ints("batches", self.batches)
        check_range("context", self.context, 1, None, integer=True)
        check_range("replays", self.replays, 3, None, integer=True)


def kernel_settings(config: ThroughputConfig | LatencyConfig) -> settings.KernelSettings:
    """The kernel settings a speed suite's options name (the others as in force).

    Raises:
        UserInputError: a value the settings refuse (naming it and the allowed values).
    """
    return settings.KernelSettings.from_dict({**settings.current().to_dict(), "pdl": config.pdl,
                                              "pdl_chain": config.pdl_chain, "prefetch_mib": config.prefetch_mib})


def _require_cuda(device: torch.device, suite: str) -> None:
    if device.type != "cuda" or not torch.cuda.is_available():
        raise Unavailable(f"the {suite} suite times GPU kernels and needs a CUDA GPU (device={device})")


def _decoder_layers(model) -> list:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise Unavailable(f"{type(model).__name__} has no model.layers: the speed suites time decoder-only "
                          "transformers (Llama, Qwen, Mistral layouts)")
    return list(layers)


def _vocab(model) -> int:
    return int(model.config.vocab_size)


def _dtype(model) -> torch.dtype:
    emb = model.get_input_embeddings()
    return emb.weight.dtype


def first_call_s(call, compile_s: dict | None, key: str) -> None:
    """Where ``compile_s`` is a dict (a compiled form), make ``call`` once and store its wall seconds
    under ``key``: the compile of its shapes, kept out of the timings that follow."""
    if compile_s is None:
        return
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    call()
    sync()
    compile_s[key] = time.perf_counter() - start


def measure_prefill(model, batch: int, length: int, device, replays: int = 11, graphs: bool = True,
                    decoder: FusedDecoder | None = None, compile_s: dict | None = None):
    """Median µs of a prefill of ``batch × length`` random tokens (last-position logits only).

    ``graphs``: replay one captured CUDA graph of the forward (else eager launches).
    ``decoder``: run on this :class:`~mosaicquant.harness.runtime.FusedDecoder` (else transformers' code).
    ``compile_s``: a compiled form's first-call seconds go there (:func:`first_call_s`, key ``prefill``).
    """
    ids = torch.randint(0, _vocab(model), (batch, length), device=device)

    def call():
        if decoder is not None:
            decoder.prefill(ids)
        else:
            model(input_ids=ids, use_cache=False, logits_to_keep=1)

    first_call_s(call, compile_s, "prefill")
    return _checked(time_calls([call], min_us=0.0, replays=replays, graphs=graphs), decoder)


def _checked(timing, decoder: FusedDecoder | None):
    """``timing``, once the fused decoder's kernels are known to have read no position or length out of range
    (:meth:`~mosaicquant.harness.runtime.FusedDecoder.check_ranges`: after the timing synchronised).

    Raises:
        UserInputError: a fault the kernels recorded; the cell fails rather than report a time of clamped steps.
    """
    if decoder is not None:
        decoder.check_ranges()
    return timing


def _static_cache(model, batch: int, max_len: int, device, dtype):
    from transformers import StaticCache

    try:
        return StaticCache(config=model.config, max_cache_len=max_len)
    except TypeError:  # transformers 4.x takes the batch, device and dtype up front
        return StaticCache(config=model.config, max_batch_size=batch, max_cache_len=max_len, device=device,
                           dtype=dtype)


def fused_decode_step(decoder: FusedDecoder, batch: int, context: int):
    """Like :func:`decode_step`, on the fused decoder: its cache filled by a random prompt, then
    every call decodes the token at position ``context`` (lengths live on the device)."""
    cache = decoder.new_cache(batch, context + 8)
    vocab = _vocab(decoder.model)
    device = decoder.device
    decoder.prefill(torch.randint(0, vocab, (batch, context), device=device), cache)
    step_ids = torch.randint(0, vocab, (batch, 1), device=device)
    positions = torch.full((batch,), context, dtype=torch.int64, device=device)
    lengths = (positions + 1).to(torch.int32)

    def step():
        return decoder.decode(step_ids, positions, cache, lengths)

    step.input_ids = step_ids
    return step


def decode_step(model, batch: int, context: int, device):
    """A closure running one decode step at ``batch`` with ``context`` cached tokens; returns the logits.

    The static KV cache is filled with a random prompt of ``context`` tokens first. Every call
    decodes the token at position ``context`` again: transformers' static cache layers keep
    a device-side write counter that each update advances, so the step first sets those
    counters back to ``context`` (two multi-tensor ops, captured with the step), keeping
    the cache in bounds and every replay the same step.
    """
    cache = _static_cache(model, batch, context + 8, device, _dtype(model))
    vocab = _vocab(model)
    prompt = torch.randint(0, vocab, (batch, context), device=device)
    model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1,
          cache_position=torch.arange(context, device=device))
    counters = [layer.cumulative_length for layer in getattr(cache, "layers", [])
                if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)]
    step_ids = torch.randint(0, vocab, (batch, 1), device=device)
    position = torch.tensor([context], device=device)

    def step():
        if counters:
            torch._foreach_zero_(counters)
            torch._foreach_add_(counters, context)
        return model(input_ids=step_ids, past_key_values=cache, cache_position=position, use_cache=True).logits

    step.input_ids = step_ids
    return step


def measure_decode(model, batch: int, context: int, device, replays: int = 11, graphs: bool = True,
                   telemetry: Telemetry | None = None, telemetry_s: float = 2.0, decoder: FusedDecoder | None = None,
                   compile_s: dict | None = None):
    """Median µs of one decode step at ``batch`` with ``context`` cached tokens (static KV cache).

    ``compile_s``: a compiled form's first-call seconds of the step go there (key ``decode_b{batch}``).
    """
    step = fused_decode_step(decoder, batch, context) if decoder is not None else decode_step(model, batch, context,
                                                                                               device)
    first_call_s(step, compile_s, f"decode_b{batch}")
    return _checked(time_calls([step], min_us=50_000.0, replays=replays, graphs=graphs, telemetry=telemetry,
                               telemetry_s=telemetry_s), decoder)


def measure_linear_group(model, group: str, m: int, device, rotate_mb: int = 180, replays: int = 11,
                         graphs: bool = True):
    """Median µs of one linear group on ``m`` tokens, cycled over layers beyond ``rotate_mb``."""
    layers = _decoder_layers(model)
    modules = [[layer.get_submodule(name) for name in LINEAR_GROUPS[group]] for layer in layers]
    seen: set[int] = set()
    per_layer = sum(module_bytes(mod, seen) for mod in modules[0])
    count = max(1, min(len(layers), -(-rotate_mb * 2**20 // max(per_layer, 1)) + 1))
    k = _in_features(modules[0][0])
    x = torch.randn(m, k, device=device, dtype=_dtype(model))
    calls = []
    for mods in modules[:count]:
        def call(mods=mods):
            for mod in mods:
                mod(x)
        calls.append(call)
    return time_calls(calls, min_us=400.0, replays=replays, graphs=graphs)


def _in_features(module) -> int:
    if hasattr(module, "in_features"):
        return int(module.in_features)
    if hasattr(module, "shape"):
        return int(module.shape[1])
    return int(module.weight.shape[1])


def _tok_s(tokens: int, t) -> Metric:
    value = tokens / (t.median_us * 1e-6)
    spread = tokens * t.spread_us * 1e-6 / (t.median_us * 1e-6) ** 2
    return Metric(value, higher_is_better=True, unit="tok/s", spread=spread)


def _prepare(model, ctx, suite: str, graphs: bool = True, runtime: str | None = "auto"):
    """Checks, the executable form, and the decoder runtime (a FusedDecoder, or ``None`` for
    transformers' code or when ``runtime`` is ``None``: no end-to-end step is timed)."""
    _require_cuda(ctx.device, suite)
    _decoder_layers(model)
    if _dtype(model) not in (torch.bfloat16, torch.float16):
        raise Unavailable(f"the {suite} suite times a 16-bit model (the BF16 baseline and the kernels' BF16 "
                          f"in/out); this model is {_dtype(model)}: run with --dtype bfloat16")
    path = executable(model, ctx.method_info)
    ctx.method_info.setdefault("speed", {}).update(
        gpu=torch.cuda.get_device_name(ctx.device), exec_path=path,
        timing="CUDA graphs (prefill, decode, per-layer)" if graphs else "eager launches, CUDA events (prefill, decode)")
    if runtime is None:
        return None
    try:
        name, description = resolve_runtime(runtime, model)
    except UserInputError as err:
        raise Unavailable(str(err)) from err
    ctx.method_info["speed"].update(runtime=name, runtime_description=description)
    return FusedDecoder(model) if name == "fused" else None


def _compile_seconds(ctx) -> dict | None:
    """The dict a compiled form's first-call seconds go into (``method_info.speed.compile_s``), else None."""
    speed = ctx.method_info.setdefault("speed", {})
    return speed.setdefault("compile_s", {}) if speed.get("form") == "compiled" else None


@register_suite("throughput", config=ThroughputConfig, description=ThroughputConfig.description)
def throughput(model, config: ThroughputConfig, ctx):
    """Prefill and decode tokens/s of the executable model on the GPU."""
    with settings.use(kernel_settings(config)):
        return _throughput(model, config, ctx)


def _throughput(model, config: ThroughputConfig, ctx):
    decoder = _prepare(model, ctx, "throughput", config.cuda_graphs, config.runtime)
    device = ctx.device
    metrics: dict[str, Metric] = {}
    ceilings = measure_ceilings(device)
    ctx.method_info["speed"]["ceilings"] = ceilings.as_dict()
    compile_s = _compile_seconds(ctx)
    t = measure_prefill(model, config.prefill_batch, config.prefill_len, device, config.replays, config.cuda_graphs,
                        decoder, compile_s)
    metrics["prefill_tok_s"] = _tok_s(config.prefill_batch * config.prefill_len, t)
    rate, rate_text = prefill_floor_rate(ceilings, quantized_linears(model))
    ctx.method_info["speed"]["prefill_floor_rate"] = rate_text
    if rate is not None:
        flops = prefill_flops(model, config.prefill_batch, config.prefill_len)
        metrics["prefill_floor_frac"] = Metric(floor_fraction(flops / (rate * 1e12) * 1e6, t.median_us),
                                               higher_is_better=True, unit="of floor")
    telemetry = Telemetry(device)
    if not telemetry.active:
        ctx.method_info.setdefault("speed", {})["telemetry"] = f"none: {telemetry.reason}"
    for b in config.batches:
        t = measure_decode(model, b, config.context, device, config.replays, config.cuda_graphs, telemetry,
                           config.energy_s, decoder, compile_s)
        metrics[f"decode_tok_s/b{b}"] = _tok_s(b, t)
        nbytes = decode_bytes(model, b, config.context, decoder)
        metrics[f"decode_bytes/b{b}"] = Metric(float(nbytes), higher_is_better=False, unit="B")
        metrics[f"decode_floor_frac/b{b}"] = Metric(
            floor_fraction(byte_floor_us(nbytes, ceilings.copy_gb_s), t.median_us), higher_is_better=True,
            unit="of floor")
        w = t.window
        if w is not None:
            if w.energy_j is not None and t.window_calls:
                metrics[f"decode_energy_j_per_tok/b{b}"] = Metric(w.energy_j / (t.window_calls * b),
                                                                  higher_is_better=False, unit="J/tok")
            if w.power_w is not None:
                metrics[f"decode_power_w/b{b}"] = Metric(w.power_w, higher_is_better=False, unit="W")
            if w.sm_clock_mhz is not None:
                metrics[f"decode_sm_clock_mhz/b{b}"] = Metric(w.sm_clock_mhz, higher_is_better=True, unit="MHz")
        ctx.log(f"[mosaicquant]     decode b{b}: {metrics[f'decode_tok_s/b{b}'].value:,.0f} tok/s")
    return metrics


@register_suite("latency", config=LatencyConfig, description=LatencyConfig.description)
def latency(model, config: LatencyConfig, ctx):
    """Per-linear-layer latency over M and end-to-end step latency on the GPU."""
    with settings.use(kernel_settings(config)):
        return _latency(model, config, ctx)


def _latency(model, config: LatencyConfig, ctx):
    decoder = _prepare(model, ctx, "latency", runtime=config.runtime if config.steps else None)
    device = ctx.device
    metrics: dict[str, Metric] = {}
    for group in config.groups:
        for m in config.ms:
            t = measure_linear_group(model, group, m, device, config.rotate_mb, config.replays)
            metrics[f"linear_us/{group}/m{m}"] = Metric(t.median_us, higher_is_better=False, unit="us",
                                                        spread=t.spread_us)
    if config.steps:
        compile_s = _compile_seconds(ctx)
        t = measure_prefill(model, 1, config.prefill_len, device, config.replays, decoder=decoder, compile_s=compile_s)
        metrics["step_ms/prefill"] = Metric(t.median_us / 1e3, higher_is_better=False, unit="ms",
                                            spread=t.spread_us / 1e3)
        for b in config.batches:
            t = measure_decode(model, b, config.context, device, config.replays, decoder=decoder, compile_s=compile_s)
            metrics[f"step_ms/decode_b{b}"] = Metric(t.median_us / 1e3, higher_is_better=False, unit="ms",
                                                     spread=t.spread_us / 1e3)
    return metrics
