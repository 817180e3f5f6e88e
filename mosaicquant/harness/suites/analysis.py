"""Analysis suite: how much output distortion each residual selection recovers (SPEC §1.8).

It analyses the *float* model's linears (run it with ``--methods fp16``) after the
configured transform: per analysed layer and linear, the fraction of exact output
distortion recovered on held-out calibration tokens, against budget, for every block score,
for channel allocation at equal budget, and for an across-layer allocation. Metrics are
named ``recovered/<score>/<budget>`` (mean over analysed linears), ``recovered_global/...``
(across-layer allocation) and ``layer/<i>/<linear>/<score>/<budget>`` (per linear); the
Δ-budget plot reads them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from mosaicquant.config import Config, check_choice, check_range, exact_number_text
from mosaicquant.errors import UserInputError
from mosaicquant.harness import data as data_mod
from mosaicquant.harness.results import Metric
from mosaicquant.methods.analysis import BLOCK_SCORES, AnalysisSpec, distortion_analysis, parse_layers
from mosaicquant.methods.calibration import decoder_layers
from mosaicquant.methods.format import block_shape_text, parse_block_shape
from mosaicquant.methods.mosaicquant import apply_transform
from mosaicquant.registry import register_suite

HELDOUT_SEED_OFFSET = 100_003


@dataclass(frozen=True)
class AnalysisConfig(Config):
    """Analysis options.

    Attributes:
        transform: rotation, smoothquant or none (as MosaicQuant's).
        base: dense base, rtn or gptq.
        block: block shape, ``B`` or ``BNxBK`` (kept as ``B`` when square).
        budgets: comma-separated fractions of blocks (kept in their shortest exact text: ``0.10`` is ``0.1``).
        scores: comma-separated block scores (hessian, delta, exact-greedy, frobenius, random); kept in
            that order, each once, however given.
        channel: also evaluate input/output channel allocation at equal budget.
        layers: ``all``, ``every:K`` or a comma list of layer indices (kept sorted, each once).
        online_o: with rotation, also rotate the o_proj input online.
    """

    description = "distortion recovered vs residual budget per score/allocation (analyses the float model)"
    list_options = ("budgets", "scores", "layers")

    transform: str = "rotation"
    base: str = "rtn"
    block: str = "64"
    budgets: str = "0.05,0.1,0.2,0.3"
    scores: str = "hessian,delta,exact-greedy,frobenius,random"
    channel: bool = True
    layers: str = "every:6"
    online_o: bool = True

    def validate(self):
        check_choice("transform", self.transform, ("rotation", "smoothquant", "none"))
        check_choice("base", self.base, ("rtn", "gptq"))
        try:
            self.set_canonical("block", block_shape_text(self.block))
        except ValueError as exc:
            raise UserInputError(f"analysis: {exc}") from None
        try:
            budgets = [float(b) for b in self.budgets.split(",")]
        except ValueError:
            raise UserInputError(f"budgets={self.budgets!r}: expected comma-separated fractions, "
                                 "e.g. 0.1,0.3") from None
        for b in budgets:
            check_range("budget", b, 0.0, 1.0)
        self.set_canonical("budgets", ",".join(exact_number_text(b) for b in budgets))
        scores = [s.strip() for s in str(self.scores).split(",")]
        for s in scores:
            check_choice("score", s, BLOCK_SCORES)
        # a set of scores, not a sequence: one order (BLOCK_SCORES', the default's), so one config, one cell
        self.set_canonical("scores", ",".join(s for s in BLOCK_SCORES if s in scores))
        self.set_canonical("layers", _layers_text(self.layers))


def _layers_text(layers: str) -> str:
    """The one text of a ``layers`` value: ``all``, ``every:K``, or the indices sorted, each once.

    Raises:
        UserInputError: not ``all``, ``every:K`` (K >= 1) or a comma list of integers.
    """
    text = str(layers).strip()
    try:
        if text == "all":
            return text
        if text.startswith("every:"):
            step = int(text.split(":", 1)[1])
            if step < 1:
                raise ValueError
            return f"every:{step}"
        return ",".join(str(i) for i in sorted({int(p) for p in text.replace(";", ",").split(",")}))
    except ValueError:
        raise UserInputError(f"layers={layers!r}: expected 'all', 'every:K' (K >= 1) or a comma list "
                             "of layer indices, e.g. 0,5") from None


@register_suite("analysis", config=AnalysisConfig, description=AnalysisConfig.description)
def analysis(model, config: AnalysisConfig, ctx):
    """Distortion-recovered curves on the float model of this cell."""
    if ctx.method_info.get("wbits", 16) != 16 or ctx.method_info.get("abits", 16) != 16:
        raise UserInputError("the analysis suite analyses the float model's linears: run it with --methods fp16")
    calib = ctx.calibration()
    heldout = data_mod.calibration_tokens(ctx.tokenizer, ctx.corpus, calib.shape[0], calib.shape[1],
                                          ctx.seed + HELDOUT_SEED_OFFSET)
    work = copy.deepcopy(model)
    transform_info = apply_transform(work, config.transform, calib, seed=ctx.seed, online_o=config.online_o)
    layers = parse_layers(config.layers, len(decoder_layers(work)))
    spec = AnalysisSpec(budgets=tuple(float(b) for b in config.budgets.split(",")),
                        scores=tuple(config.scores.split(",")), block_shape=parse_block_shape(config.block),
                        base=config.base, channel=config.channel, seed=ctx.seed)
    out = distortion_analysis(work, calib, heldout, layers, spec, log=ctx.log)
    ctx.method_info["analysis"] = {"layers": layers, "transform": transform_info.get("transform", config.transform)
                                   if isinstance(transform_info, dict) else config.transform}
    metrics = {}
    for (score, budget), value in out["mean"].items():
        metrics[f"recovered/{score}/{budget:g}"] = Metric(value, higher_is_better=True)
    for (score, budget), value in out["global"].items():
        metrics[f"recovered_global/{score}/{budget:g}"] = Metric(value, higher_is_better=True)
    for r in out["per_layer"]:
        metrics[f"layer/{r['layer']}/{r['linear']}/{r['score']}/{r['budget']:g}"] = Metric(
            r["recovered"], higher_is_better=True)
    return metrics
