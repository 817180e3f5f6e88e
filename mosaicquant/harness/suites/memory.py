"""Memory suite: bytes of the quantized weights by part, and peak device memory on a GPU.

Weight bytes come from the layers' formats: packed 4-bit layers count base values, base
scales, residual values, residual scales and indices exactly as stored; other quantized
layers count ``wbits`` per weight plus FP16 scales; unquantized linears count BF16. The
16-bit parts every method keeps (embeddings, norms, output head) are reported separately. The
residual's overhead is given over the base (the quantized linears' values and scales) and over the
whole model without it (``residual_overhead_vs_model``: the 16-bit embeddings, norms and head included).
On a CUDA device, the model is first made executable (:func:`mosaicquant.harness.speedforms.executable`:
the kernel-backed layers) and one forward pass of ``seqlen`` tokens measures peak allocated
memory; a method with no fast path gets no peak figure (the record says why). That pass keeps no
KV cache (a method's KV quantizer runs there as its simulation); ``kv_cache_bytes_per_token`` says
what one token of context costs in the fused decoder's cache, as the speed suites run it (4-bit
layers: packed values and fp32 scales and zeros; see :mod:`mosaicquant.harness.runtime`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mosaicquant.config import Config, check_range
from mosaicquant.errors import Unavailable
from mosaicquant.harness.results import Metric
from mosaicquant.harness.runtime import kv_cache_bytes_per_token
from mosaicquant.harness.speedforms import executable
from mosaicquant.methods.qlinear import FakeQuantLinear, weight_memory
from mosaicquant.registry import register_suite


@dataclass(frozen=True)
class MemoryConfig(Config):
    """Memory options.

    Attributes:
        seqlen: tokens of the forward pass whose peak memory is measured (GPU only).
    """

    description = "weight bytes (base, scales, residual, indices) and peak device memory"

    seqlen: int = 2048

    def validate(self):
        check_range("seqlen", self.seqlen, 1, None, integer=True)


@register_suite("memory", config=MemoryConfig, description=MemoryConfig.description, seeded=False)
def memory(model, config: MemoryConfig, ctx):
    """Weight memory of the quantized linears, and peak memory of a forward pass on a GPU."""
    mem = weight_memory(model)
    if mem["linear_bf16_equivalent"] == 0 and ctx.method_info.get("wbits", 16) < 16:
        # quantized in a format this suite does not know (e.g. a library's tensor subclasses):
        # no weight bytes are claimed; a GPU still gets the measured peak memory
        ctx.method_info["weight_bytes_skipped"] = (
            f"the quantized layers' format is not one the memory suite can count "
            f"({ctx.method_info.get('exec_path') or 'unknown'})")
        if ctx.device.type != "cuda":
            raise Unavailable(f"memory: {ctx.method_info['weight_bytes_skipped']}; peak memory needs a CUDA GPU")
        return _peak_memory(model, config, ctx, {})
    if mem["linear_bf16_equivalent"] == 0:
        linear_params = sum(m.weight.numel() for n, m in model.named_modules()
                            if isinstance(m, torch.nn.Linear) and m is not model.get_output_embeddings())
        mem["linear_bf16_equivalent"] = 2 * linear_params
        mem["base_values"] = 2 * linear_params
        mem["total_quantized_linears"] = 2 * linear_params
    quantized = [m for m in model.modules() if isinstance(m, FakeQuantLinear) or hasattr(m, "weight_nbytes")]
    quantized_ids = {id(p) for m in quantized for p in m.parameters()}
    other = sum(2 * p.numel() for p in model.parameters() if id(p) not in quantized_ids)
    if not quantized:
        other -= mem["linear_bf16_equivalent"]
    metrics = {k: Metric(float(v), higher_is_better=False, unit="bytes") for k, v in mem.items()}
    metrics["other_params_bf16"] = Metric(float(other), higher_is_better=False, unit="bytes")
    metrics["linear_weight_ratio_vs_bf16"] = Metric(mem["total_quantized_linears"] / mem["linear_bf16_equivalent"],
                                                    higher_is_better=False)
    base = mem["base_values"] + mem["base_scales"]
    residual = mem["residual_values"] + mem["residual_scales"] + mem["residual_indices"]
    metrics["residual_overhead_vs_base"] = Metric(residual / base if base else 0.0, higher_is_better=False)
    # over the whole model without its residual (the 4-bit linears and the 16-bit embeddings, norms and head):
    # what "over the pure 4-bit model" (SPEC §1.6, the paper's ~8.5-9.5 %) may mean; it moves with the
    # embeddings' share (Llama-3's 128k vocabulary makes it smaller than Llama-2's 32k)
    metrics["residual_overhead_vs_model"] = Metric(residual / (base + other) if base + other else 0.0,
                                                   higher_is_better=False)

    kv = kv_cache_bytes_per_token(model)
    if kv is not None:
        metrics["kv_cache_bytes_per_token"] = Metric(float(kv), higher_is_better=False, unit="bytes")
    return _peak_memory(model, config, ctx, metrics)


def _peak_memory(model, config: MemoryConfig, ctx, metrics: dict) -> dict:
    """Add ``peak_device_bytes`` (one forward pass of the executable model) on a CUDA device."""
    if ctx.device.type == "cuda":
        try:
            executable(model, ctx.method_info)  # peak memory of what runs, not of the simulation
        except Unavailable as exc:
            ctx.method_info["peak_device_bytes_skipped"] = str(exc)
            return metrics
        if ctx.tokenizer is None:  # a random-weight shape model: token values do not matter
            tokens = torch.randint(0, model.config.vocab_size, (1, config.seqlen), device=ctx.device)
        else:
            tokens = ctx.test_tokens()[: config.seqlen].unsqueeze(0).to(ctx.device)
        torch.cuda.synchronize(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
        model(input_ids=tokens, use_cache=False)
        torch.cuda.synchronize(ctx.device)
        metrics["peak_device_bytes"] = Metric(float(torch.cuda.max_memory_allocated(ctx.device)),
                                              higher_is_better=False, unit="bytes")
    return metrics
