"""Column headings a reader understands: human words, the unit, and which way is better.

``heading("accuracy", "ppl", False)`` is ``perplexity ↓``; ``heading("throughput",
"decode_tok_s/b4", True)`` is ``decode tok/s (batch 4) ↑``; ``heading("memory",
"total_quantized_linears", False, "bytes")`` is ``quantized linear weights (MiB) ↓`` with its
values shown in MiB. The arrow is the record's own direction (``↑`` higher is better, ``↓``
lower is better). A metric without a rule here keeps its name, spaced, with the record's unit.

The raw keys stay in ``summary.csv`` and ``records_long.csv``, for programs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Heading", "heading", "UP", "DOWN"]

UP, DOWN = "↑", "↓"
MIB = 2**20

_LAYER = {"qkv_proj": "QKV", "o_proj": "O", "gate_up_proj": "gate/up", "down_proj": "down"}


@dataclass(frozen=True)
class Heading:
    """How one metric is shown.

    Attributes:
        text: human words (``decode tok/s (batch 4)``).
        unit: the unit of the shown values, ``None`` where the words already say it.
        scale: shown value = recorded value x scale (bytes -> MiB, fraction -> %).
        higher_is_better: the metric's direction, ``None`` when unknown.
    """

    text: str
    unit: str | None = None
    scale: float = 1.0
    higher_is_better: bool | None = None

    @property
    def title(self) -> str:
        arrow = "" if self.higher_is_better is None else f" {UP if self.higher_is_better else DOWN}"
        return f"{self.text}{f' ({self.unit})' if self.unit else ''}{arrow}"


def _rule(suite: str, name: str, unit: str | None) -> tuple[str, str | None, float] | None:
    if suite == "accuracy":
        return {"ppl": ("perplexity", None, 1.0), "nll": ("NLL", "nats/token", 1.0),
                "n_chunks": ("chunks scored", None, 1.0), "n_tokens_scored": ("tokens scored", None, 1.0)}.get(name)
    if suite == "throughput":
        if name == "prefill_tok_s":
            return "prefill tok/s (batch 1)", None, 1.0
        for pattern, words in ((r"decode_tok_s/b(\d+)", "decode tok/s"), (r"decode_energy_j_per_tok/b(\d+)",
                               "decode energy, J/token"), (r"decode_power_w/b(\d+)", "decode power, W"),
                               (r"decode_sm_clock_mhz/b(\d+)", "decode SM clock, MHz")):
            if m := re.fullmatch(pattern, name):
                return f"{words} (batch {m.group(1)})", None, 1.0
    if suite == "latency":
        if name == "step_ms/prefill":
            return "prefill step", "ms", 1.0
        if m := re.fullmatch(r"step_ms/decode_b(\d+)", name):
            return f"decode step, batch {m.group(1)}", "ms", 1.0
        if m := re.fullmatch(r"linear_us/([^/]+)/m(\d+)", name):
            return f"{_LAYER.get(m.group(1), m.group(1))} linear, M = {m.group(2)}", "µs", 1.0
    if suite == "memory":
        words = {"total_quantized_linears": "quantized linear weights", "peak_device_bytes": "peak device memory",
                 "other_params_bf16": "other parameters (BF16)", "kv_cache_bytes_per_token": "KV cache per token"}
        if name == "linear_weight_ratio_vs_bf16":
            return "weight bytes vs BF16", "×", 1.0
        if name == "residual_overhead_vs_base":
            return "residual vs 4-bit base", "%", 100.0
        if name == "residual_overhead_vs_model":
            return "residual vs model", "%", 100.0
        if name == "kv_cache_bytes_per_token":
            return words[name], "bytes", 1.0
        if unit == "bytes":
            return words.get(name, name.replace("_", " ")), "MiB", 1.0 / MIB
    if suite == "analysis":
        if m := re.fullmatch(r"(recovered|recovered_global)/([^/]+)/([0-9.eE+-]+)", name):
            scope = ", across layers" if m.group(1) == "recovered_global" else ""
            return (f"distortion recovered, {m.group(2)} at {100 * float(m.group(3)):g}% budget{scope}", "%", 100.0)
    if suite == "zeroshot" and "/" in name:
        task, metric = name.split("/", 1)
        return f"{task} {metric}", None, 1.0
    return None


def heading(suite: str, name: str, higher_is_better: bool | None = None, unit: str | None = None) -> Heading:
    """The :class:`Heading` of metric ``name`` of suite ``suite`` (a suite name, not a label).

    Example:
        >>> heading("throughput", "decode_tok_s/b4", True).title
        'decode tok/s (batch 4) ↑'
        >>> heading("memory", "linear_weight_ratio_vs_bf16", False).title
        'weight bytes vs BF16 (×) ↓'
    """
    rule = _rule(suite, name, unit)
    if rule is None:
        return Heading(f"{suite}: {name.replace('_', ' ')}", unit, 1.0, higher_is_better)
    text, shown_unit, scale = rule
    return Heading(text, shown_unit, scale, higher_is_better)
