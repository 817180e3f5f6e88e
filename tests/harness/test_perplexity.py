"""Tests of the perplexity protocol against a hand computation, plus one real-model check."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mosaicquant.errors import UserInputError
from mosaicquant.harness import data, models
from mosaicquant.harness.perplexity import NonFiniteLogitsError, evaluate_perplexity

# Same model, same chunks: only float summation order differs from the hand computation.
NLL_REL_TOL = 1e-5
# bf16 weights/activations move the NLL of a random tiny model by well under this.
BF16_NLL_REL_TOL = 0.02
# SmolLM2-135M on Wikipedia text: real models land in the tens; a broken pipeline does not.
SMOLLM2_PPL_RANGE = (5.0, 200.0)

VOCAB = 97
TOTAL_TOKENS = 500
SEQLEN = 67  # 7 full chunks, a 31-token tail that must be dropped


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, attention_dropout=0.5,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, VOCAB, (TOTAL_TOKENS,), generator=torch.Generator().manual_seed(1))


def _hand_nll(model, tokens, seqlen, n_chunks):
    """Explicit loop: mean over chunks of the mean cross-entropy of tokens 1..seqlen-1."""
    per_chunk = []
    with torch.no_grad():
        for index in range(n_chunks):
            chunk = tokens[index * seqlen:(index + 1) * seqlen]
            logits = model(chunk[None]).logits[0]
            per_chunk.append(F.cross_entropy(logits[:-1].float(), chunk[1:]).item())
    return sum(per_chunk) / len(per_chunk)


def test_matches_hand_computation_and_drops_the_tail(tiny_llama, tokens):
    result = evaluate_perplexity(tiny_llama, tokens, seqlen=SEQLEN)
    n_chunks = TOTAL_TOKENS // SEQLEN
    expected = _hand_nll(tiny_llama, tokens, SEQLEN, n_chunks)
    assert result["n_chunks"] == n_chunks
    assert result["n_tokens_scored"] == n_chunks * (SEQLEN - 1)
    assert result["seqlen"] == SEQLEN
    assert result["nll"] == pytest.approx(expected, rel=NLL_REL_TOL)
    assert result["ppl"] == pytest.approx(math.exp(expected), rel=NLL_REL_TOL)
    # The dropped tail must not matter: cutting it off gives the same number.
    trimmed = evaluate_perplexity(tiny_llama, tokens[: n_chunks * SEQLEN], seqlen=SEQLEN)
    assert trimmed["nll"] == pytest.approx(result["nll"], rel=NLL_REL_TOL)


def test_max_chunks_and_batching(tiny_llama, tokens):
    limited = evaluate_perplexity(tiny_llama, tokens, seqlen=SEQLEN, max_chunks=4)
    assert (limited["n_chunks"], limited["n_tokens_scored"]) == (4, 4 * (SEQLEN - 1))
    assert limited["nll"] == pytest.approx(_hand_nll(tiny_llama, tokens, SEQLEN, 4), rel=NLL_REL_TOL)
    batched = evaluate_perplexity(tiny_llama, tokens, seqlen=SEQLEN, batch_size=3)
    unbatched = evaluate_perplexity(tiny_llama, tokens, seqlen=SEQLEN, batch_size=1)
    assert batched["n_chunks"] == unbatched["n_chunks"]
    assert batched["nll"] == pytest.approx(unbatched["nll"], rel=NLL_REL_TOL)
    assert evaluate_perplexity(tiny_llama, tokens, seqlen=SEQLEN, max_chunks=10_000)["n_chunks"] == TOTAL_TOKENS // SEQLEN


def test_runs_in_eval_mode_and_restores_training_mode(tiny_llama, tokens):
    expected = evaluate_perplexity(tiny_llama, tokens, seqlen=SEQLEN, max_chunks=3)
    tiny_llama.train()
    try:
        got = evaluate_perplexity(tiny_llama, tokens, seqlen=SEQLEN, max_chunks=3)
        assert tiny_llama.training
    finally:
        tiny_llama.eval()
    assert got["nll"] == pytest.approx(expected["nll"], rel=NLL_REL_TOL)


def test_bf16_model_is_scored_in_float32(tiny_llama, tokens):
    import copy

    half = copy.deepcopy(tiny_llama).to(torch.bfloat16)
    reference = evaluate_perplexity(tiny_llama, tokens, seqlen=SEQLEN, max_chunks=4)
    result = evaluate_perplexity(half, tokens, seqlen=SEQLEN, max_chunks=4)
    assert math.isfinite(result["nll"])
    assert result["nll"] == pytest.approx(reference["nll"], rel=BF16_NLL_REL_TOL)


class _NaNOnCall(torch.nn.Module):
    """Returns random logits, with NaN on the call number ``bad_call`` (0-based)."""

    def __init__(self, bad_call):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(3))
        self.bad_call = bad_call
        self.calls = 0

    def forward(self, input_ids, use_cache=False):
        logits = torch.randn(*input_ids.shape, VOCAB)
        if self.calls == self.bad_call:
            logits[0, 5, 7] = float("nan")
        self.calls += 1
        return logits


def test_nan_logits_raise_naming_the_chunk(tokens):
    with pytest.raises(NonFiniteLogitsError, match=r"NaN logits on chunk\(s\) \[2\] of 5"):
        evaluate_perplexity(_NaNOnCall(bad_call=2), tokens, seqlen=SEQLEN, max_chunks=5)


@pytest.mark.parametrize(
    ("stream", "kwargs", "pattern"),
    [
        (torch.randint(0, VOCAB, (66,)), {"seqlen": SEQLEN}, "66 tokens, fewer than one chunk of seqlen=67"),
        (torch.randint(0, VOCAB, (2, 300)), {}, r"1-D integer tensor, got \(2, 300\)"),
        (torch.rand(300), {}, "1-D integer tensor"),
        (torch.randint(0, VOCAB, (300,)), {"seqlen": 1}, "seqlen must be an integer >= 2, got 1"),
        (torch.randint(0, VOCAB, (300,)), {"max_chunks": 0}, "max_chunks must be an integer >= 1, got 0"),
        (torch.randint(0, VOCAB, (300,)), {"batch_size": 0}, "batch_size must be an integer >= 1, got 0"),
    ],
)
def test_bad_input_is_rejected(tiny_llama, stream, kwargs, pattern):
    with pytest.raises(UserInputError, match=pattern):
        evaluate_perplexity(tiny_llama, stream, **{"seqlen": 64, **kwargs})


def test_smollm2_perplexity_on_a_wikipedia_slice_is_plausible():
    loaded = models.load_model("smollm2-135m")
    stream = data.test_tokens(loaded.tokenizer, "enwiki-sample")
    result = evaluate_perplexity(loaded.model, stream, seqlen=256, max_chunks=2)
    assert result["n_tokens_scored"] == 2 * 255
    low, high = SMOLLM2_PPL_RANGE
    assert low < result["ppl"] < high, f"ppl {result['ppl']:.2f} outside ({low}, {high})"
