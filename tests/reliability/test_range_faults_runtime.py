"""A position out of the KV cache read by the fused decoder's kernels: the decode runtime raises the UserInputError
where it synchronises (after the timed steps), the speed measurement returns no time, and the cell is recorded
failed.

On a GPU the kernels check positions on the device; on the host the launchers check them before any launch.
Here the host check is switched off, so that the interpreter (whose tensors are on the host) runs the GPU's path.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from mosaicquant.config import Config
from mosaicquant.errors import UserInputError
from mosaicquant.harness import shapes
from mosaicquant.harness.cli import main
from mosaicquant.harness.results import Metric, load_records
from mosaicquant.harness.runtime import FusedDecoder
from mosaicquant.harness.suites import speed
from mosaicquant.kernels import decoder
from mosaicquant.kernels._common import triton_interpreting
from mosaicquant.kernels.decoder import range_fault_word
from mosaicquant.registry import SUITES, register_suite

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


@dataclass(frozen=True)
class _DecodeTimingConfig(Config):
    context: int = 6


def _decode_timing_on_a_short_cache(model, config, ctx):
    """The throughput suite's fused decode measurement (without its GPU requirement), on a cache one slot
    short: its step decodes at position ``context``, just outside."""
    dec = FusedDecoder(model, kernel="triton")
    full = dec.new_cache
    dec.new_cache = lambda batch, length: full(batch, length - 8)
    t = speed.measure_decode(model, 2, config.context, ctx.device, replays=3, graphs=False, decoder=dec)
    return {"step_us": Metric(t.median_us, higher_is_better=False, unit="us")}


def test_a_range_fault_in_a_suite_records_the_cell_failed(tmp_path, tiny_llama_dir, tiny_corpus, monkeypatch):
    monkeypatch.setattr(decoder, "_check_cpu_range", lambda *args, **kwargs: None)
    range_fault_word(DEVICE).zero_()
    if "range-fault-test" not in SUITES._entries:
        register_suite("range-fault-test", config=_DecodeTimingConfig)(_decode_timing_on_a_short_cache)
    rc = main(["run", "--model", tiny_llama_dir, "--methods", "fp16", "--suites", "range-fault-test",
               "--corpus", tiny_corpus, "--dtype", "bfloat16", "--calib-samples", "2", "--calib-seqlen", "16",
               "--out", str(tmp_path)])
    assert rc == 1  # a failed cell: the sweep finished, the exit code says one cell failed
    (record,) = load_records(tmp_path)
    assert record["status"] == "failed" and record["stage"] == "suite" and record["metrics"] == {}
    assert record["error"]["type"] == "UserInputError", record["error"]
    assert "decode_rope_attention positions (allowed 0.." in record["error"]["message"], record["error"]
    assert int(range_fault_word(DEVICE).item()) == 0  # read and cleared by the check
