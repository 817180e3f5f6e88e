"""A NaN or an infinity in the activations of the fused decoder (the speed suites' runtime): the logits of that
sequence are NaN, never finite numbers; the other sequences of the batch are unchanged.

The activation quantizers inside the fused kernels (the norm's, SiLU·mul's, the online Hadamard's) give a token
holding NaN or Inf a NaN scale; here the whole runtime is run on a W4A4 model, the bad value planted in one
token's embedding row.
"""

from __future__ import annotations

import math

import pytest
import torch

from mosaicquant.harness import shapes
from mosaicquant.harness.context import QuantContext
from mosaicquant.harness.runtime import FusedDecoder
from mosaicquant.harness.speedforms import executable, speed_form
from mosaicquant.kernels._common import triton_interpreting
from mosaicquant.registry import get_method

TINY = shapes.ShapeModel("tiny-llama-shapes", "llama", 64, 128, 2, 4, 2, 16, 256, False)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BAD_TOKEN = 7

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or triton_interpreting()),
                                reason="the fused decoder's kernels need CUDA or TRITON_INTERPRET=1")


@pytest.mark.parametrize("method, options", [("rtn", {}), ("quarot", {"kvbits": 16})])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_nonfinite_activation_gives_nan_logits_for_its_sequence_only(monkeypatch, method, options, value):
    monkeypatch.setitem(shapes.SHAPE_MODELS, TINY.name, TINY)
    torch.manual_seed(0)
    model = shapes.build_shape_model(TINY.name, dtype=torch.bfloat16, device=DEVICE).eval()
    ctx = QuantContext(calibration=lambda: None, seed=0, device=DEVICE)
    speed_form(method, model, get_method(method).config(**options), ctx)
    executable(model, ctx.info)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(BAD_TOKEN + 1, 256, (2, 9), generator=g).to(DEVICE)
    step = torch.randint(BAD_TOKEN + 1, 256, (2, 1), generator=g).to(DEVICE)
    dec = FusedDecoder(model)
    cache = dec.new_cache(2, 16)
    clean = [dec.prefill(prompt, cache), dec.decode(step, torch.full((2,), 9, device=DEVICE), cache)]
    with torch.no_grad():
        model.model.embed_tokens.weight[BAD_TOKEN, 5] = value
    prompt[0, 3] = BAD_TOKEN  # sequence 0 reads the bad row at position 3; sequence 1 never does
    cache = dec.new_cache(2, 16)
    for what, out, ref in (("prefill", dec.prefill(prompt, cache), clean[0]),
                           ("decode", dec.decode(step, torch.full((2,), 9, device=DEVICE), cache), clean[1])):
        assert torch.isnan(out[0].float()).all(), f"{method} {what}: {value} gave finite logits " \
                                                   f"({torch.isfinite(out[0].float()).sum()} of {out.shape[1]})"
        assert torch.equal(out[1], ref[1]), f"{method} {what}: the clean sequence changed"
