"""Micro-benchmarks of the hot CPU-side paths; each also checks what it timed.

Run: ``python -m pytest benchmarks/micro --benchmark-only [--benchmark-json OUT.json]``
(see ``benchmarks/micro/README.md`` for comparing two runs in CI).

Inputs are fresh seeded random tensors of real layer shapes (SmolLM2-135M: hidden 576,
intermediate 1536), never zeros.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from mosaicquant.harness.perplexity import evaluate_perplexity
from mosaicquant.kernels.act_quant import quantize_activations_reference
from mosaicquant.methods.format import PackedW4, pack_int4, unpack_int4
from mosaicquant.methods.quant import quantize, quantize_with_clip_search
from mosaicquant.methods.residual import delta_scores, select_residual

#: the gate/up projection of SmolLM2-135M: out 1536, in 576
WEIGHT_SHAPE = (1536, 576)
#: a prefill chunk entering down_proj: 2048 tokens × 1536 channels
ACT_SHAPE = (2048, 1536)
#: down_proj of SmolLM2-135M (out 576, in 1536) with 128×128 blocks: 5 × 12 blocks, the last block row ragged
RESIDUAL_SHAPE, RESIDUAL_BLOCK, RESIDUAL_BUDGET = (576, 1536), (128, 128), 0.1
#: relative slack on the round-to-nearest bound |x - q·s| <= s/2 for float rounding and FP16 scales
ROUNDING_SLACK = 1e-3


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _weight() -> torch.Tensor:
    return torch.randn(*WEIGHT_SHAPE, generator=_gen(1)) * 0.02


@pytest.mark.benchmark(group="quantizer")
def test_quantize_weight(benchmark):
    w = _weight()
    qt = benchmark(quantize, w, 4)
    assert qt.q.dtype == torch.int8 and qt.q.shape == WEIGHT_SHAPE and qt.scale.shape == (WEIGHT_SHAPE[0], 1)
    assert int(qt.q.min()) >= -8 and int(qt.q.max()) <= 7
    err = (qt.dequantize() - w).abs()
    assert (err <= qt.scale * (0.5 + ROUNDING_SLACK)).all(), float((err / qt.scale).max())


@pytest.mark.benchmark(group="quantizer")
def test_quantize_with_clip_search(benchmark):
    w = _weight()
    qt = benchmark.pedantic(quantize_with_clip_search, args=(w, 4), rounds=5, iterations=1, warmup_rounds=1)
    assert qt.q.dtype == torch.int8 and qt.q.shape == WEIGHT_SHAPE
    # the search tries the full range first, so per row it is never worse than plain RTN (its norm is 2.4)
    searched = ((qt.dequantize() - w).abs() ** 2.4).sum(dim=1)
    plain = ((quantize(w, 4).dequantize() - w).abs() ** 2.4).sum(dim=1)
    assert (searched <= plain * (1 + 1e-5)).all()
    assert (searched < plain).float().mean() > 0.5  # and clipping helps most rows of a Gaussian weight


@pytest.mark.benchmark(group="packing")
def test_pack_int4(benchmark):
    q = torch.randint(-8, 8, WEIGHT_SHAPE, generator=_gen(2), dtype=torch.int8)
    packed = benchmark(pack_int4, q)
    assert packed.dtype == torch.uint8 and packed.shape == (WEIGHT_SHAPE[0], WEIGHT_SHAPE[1] // 2)
    # element 2j in the low nibble, 2j + 1 in the high nibble, two's complement
    assert int(packed[0, 0]) == (int(q[0, 0]) & 0xF) | ((int(q[0, 1]) & 0xF) << 4)
    assert torch.equal(unpack_int4(packed, WEIGHT_SHAPE[1]), q)


@pytest.mark.benchmark(group="packing")
def test_packed_w4_from_quantized(benchmark):
    qt = quantize(_weight(), 4)
    packed = benchmark(PackedW4.from_quantized, qt)
    assert packed.shape == WEIGHT_SHAPE and packed.scales.dtype == torch.float16
    assert torch.equal(packed.int_weight(), qt.q)
    assert packed.nbytes()["base_values"] == WEIGHT_SHAPE[0] * WEIGHT_SHAPE[1] // 2


@pytest.mark.benchmark(group="activations")
def test_activation_quantizer_reference(benchmark):
    x = torch.randn(*ACT_SHAPE, generator=_gen(3))
    x[:, :8] *= 20  # a few outlier channels, as real activations have
    x = x.to(torch.bfloat16)
    packed, scale = benchmark(quantize_activations_reference, x)
    assert packed.dtype == torch.uint8 and packed.shape == (ACT_SHAPE[0], ACT_SHAPE[1] // 2)
    assert scale.dtype == torch.float32 and scale.shape == (ACT_SHAPE[0],)
    xf = x.float()
    assert torch.allclose(scale, xf.abs().amax(dim=1) / 7)
    err = (unpack_int4(packed, ACT_SHAPE[1]).float() * scale[:, None] - xf).abs()
    assert (err <= scale[:, None] * (0.5 + ROUNDING_SLACK)).all()


def _block_bound_holds(residual, coords, q, scales) -> bool:
    bn, bk = RESIDUAL_BLOCK
    for (i, j), qb, sb in zip(coords.tolist(), q, scales):
        block = residual[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
        rows, cols = block.shape
        approx = qb[:rows, :cols].float() * sb[:rows, None]
        slack = ROUNDING_SLACK * block.abs().amax(dim=1, keepdim=True)
        if not ((approx - block).abs() <= sb[:rows, None] * 0.5 + slack).all():
            return False
    return True


@pytest.mark.benchmark(group="residual")
@pytest.mark.parametrize("score", ["delta", "frobenius"])
def test_select_residual(benchmark, score):
    g = _gen(4)
    residual = torch.randn(*RESIDUAL_SHAPE, generator=g) * 0.002
    residual[:, 300:310] *= 8  # a few hard input channels, so some blocks matter more
    h_diag = torch.rand(RESIDUAL_SHAPE[1], generator=g) + 0.1
    coords, q, scales = benchmark(select_residual, score, residual, RESIDUAL_BLOCK, RESIDUAL_BUDGET, h_diag=h_diag)
    n_blocks = math.ceil(RESIDUAL_SHAPE[0] / 128) * math.ceil(RESIDUAL_SHAPE[1] / 128)
    kept = math.floor(RESIDUAL_BUDGET * n_blocks + 0.5)
    assert coords.shape == (kept, 2) and q.shape == (kept, *RESIDUAL_BLOCK) and scales.shape == (kept, 128)
    if score == "frobenius":
        padded = F.pad(residual.double(), (0, 0, 0, 5 * 128 - RESIDUAL_SHAPE[0]))
        scores = (padded ** 2).reshape(5, 128, 12, 128).sum(dim=(1, 3))
    else:
        scores = delta_scores(residual, h_diag, RESIDUAL_BLOCK)
    chosen = scores[coords[:, 0], coords[:, 1]]
    mask = torch.ones_like(scores, dtype=torch.bool)
    mask[coords[:, 0], coords[:, 1]] = False
    assert chosen.min() >= scores[mask].max(), "a block outside the selection scores higher"
    assert set(coords[:, 1].tolist()) >= {2}, coords  # column block 2 holds the hard channels 300..309
    assert _block_bound_holds(residual, coords, q, scales)


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.benchmark(group="perplexity")
def test_perplexity_nll_loop(benchmark, tiny_llama):
    seqlen, chunks = 128, 4
    tokens = torch.randint(0, tiny_llama.config.vocab_size, (chunks * seqlen + 37,), generator=_gen(5))
    result = benchmark(evaluate_perplexity, tiny_llama, tokens, seqlen=seqlen)
    assert result["n_chunks"] == chunks and result["n_tokens_scored"] == chunks * (seqlen - 1)
    assert result["ppl"] == pytest.approx(math.exp(result["nll"]))
    # same NLL computed directly from the logits of all chunks at once
    batch = tokens[: chunks * seqlen].reshape(chunks, seqlen)
    with torch.inference_mode():
        logits = tiny_llama(input_ids=batch, use_cache=False).logits
    direct = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).double(), batch[:, 1:].reshape(-1))
    assert result["nll"] == pytest.approx(float(direct), rel=1e-5)
    # a random-initialised model is close to uniform over its vocabulary
    assert 0.5 * tiny_llama.config.vocab_size < result["ppl"] < 2 * tiny_llama.config.vocab_size
