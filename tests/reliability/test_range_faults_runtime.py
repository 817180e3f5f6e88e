"""A position out of the KV cache read by the fused decoder's kernels: the decode runtime raises the UserInputError
where it synchronises (after the timed steps), and the speed measurement returns no time.

On a GPU the kernels check positions on the device; on the host the launchers check them before any launch.
Here the host check is switched off, so that the interpreter (whose tensors are on the host) runs the GPU's path.
"""

from __future__ import annotations

import pytest
import torch

from mosaicquant.errors import UserInputError
from mosaicquant.harness import shapes
from mosaicquant.harness.runtime import FusedDecoder
from mosaicquant.harness.suites import speed
from mosaicquant.kernels import decoder
from mosaicquant.kernels._common import triton_interpreting
from mosaicquant.kernels.decoder import range_fault_word

TINY = shapes.ShapeModel("tiny-llama-shapes", "llama", 64, 128, 2, 4, 2, 16, 256, False)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or triton_interpreting()),
                                reason="the kernels' device-side check needs CUDA or TRITON_INTERPRET=1")


@pytest.fixture
def fused(monkeypatch):
    """The tiny decoder on the Triton kernels, the launchers' host check off, the fault word clear."""
    monkeypatch.setitem(shapes.SHAPE_MODELS, TINY.name, TINY)
    monkeypatch.setattr(decoder, "_check_cpu_range", lambda *args, **kwargs: None)
    range_fault_word(DEVICE).zero_()
    torch.manual_seed(0)
    model = shapes.build_shape_model(TINY.name, dtype=torch.bfloat16, device=DEVICE).eval()
    yield FusedDecoder(model, kernel="triton")
    range_fault_word(DEVICE).zero_()


def test_decode_at_a_position_past_the_cache_raises_at_the_check(fused):
    cache = fused.new_cache(2, 8)
    fused.prefill(torch.randint(0, 256, (2, 4), device=DEVICE), cache)
    ids = torch.randint(0, 256, (2, 1), device=DEVICE)
    fused.decode(ids, torch.tensor([4, 5], device=DEVICE), cache)
    fused.check_ranges()  # in range: nothing to raise
    fused.decode(ids, torch.tensor([4, cache.length + 3], device=DEVICE), cache)
    with pytest.raises(UserInputError, match=r"decode_rope_attention positions \(allowed 0\.\.") as err:
        fused.check_ranges()
    assert "not valid" in str(err.value)
    fused.check_ranges()  # the word was cleared: the next steps start clean


def test_timed_decode_with_a_position_past_the_cache_gives_no_time(fused, monkeypatch):
    # the suite's step decodes at position `context`; a cache one slot short puts it just outside
    short = fused.new_cache
    monkeypatch.setattr(fused, "new_cache", lambda batch, length: short(batch, length - 8))
    with pytest.raises(UserInputError, match="decode_rope_attention positions"):
        speed.measure_decode(fused.model, 2, 6, DEVICE, replays=3, graphs=False, decoder=fused)
    monkeypatch.setattr(fused, "new_cache", short)
    assert speed.measure_decode(fused.model, 2, 6, DEVICE, replays=3, graphs=False, decoder=fused).median_us > 0
