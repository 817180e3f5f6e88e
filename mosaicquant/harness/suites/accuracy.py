"""Accuracy suite: perplexity by the protocol every baseline uses (SPEC §4).

The test split joined with ``"\\n\\n"``, tokenized once, cut into non-overlapping chunks of
``seqlen`` tokens (tail dropped); mean next-token NLL over positions 1..seqlen-1; ``exp`` of
it. ``max_chunks`` evaluates only the first chunks, to bound the cost on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from mosaicquant.config import Config, check_range
from mosaicquant.harness.perplexity import evaluate_perplexity
from mosaicquant.harness.results import Metric
from mosaicquant.registry import register_suite


@dataclass(frozen=True)
class AccuracyConfig(Config):
    """Perplexity options.

    Attributes:
        seqlen: chunk length in tokens (2048 in the papers).
        max_chunks: evaluate at most this many chunks (None = all).
        batch_size: chunks per forward pass.
    """

    description = "perplexity (non-overlapping 2048-token chunks of the test split)"

    seqlen: int = 2048
    max_chunks: int | None = None
    batch_size: int = 1

    def validate(self):
        check_range("seqlen", self.seqlen, 2, None, integer=True)
        if self.max_chunks is not None:
            check_range("max_chunks", self.max_chunks, 1, None, integer=True)
        check_range("batch_size", self.batch_size, 1, None, integer=True)


@register_suite("accuracy", config=AccuracyConfig, description=AccuracyConfig.description, seeded=False)
def accuracy(model, config: AccuracyConfig, ctx):
    """Perplexity of ``model`` on the corpus's test split."""
    out = evaluate_perplexity(model, ctx.test_tokens(), seqlen=config.seqlen, max_chunks=config.max_chunks,
                              batch_size=config.batch_size, device=ctx.device)
    return {
        "ppl": Metric(float(out["ppl"]), higher_is_better=False),
        "nll": Metric(float(out["nll"]), higher_is_better=False, unit="nats/token"),
        "n_chunks": Metric(float(out["n_chunks"]), higher_is_better=True),
        "n_tokens_scored": Metric(float(out["n_tokens_scored"]), higher_is_better=True),
    }
