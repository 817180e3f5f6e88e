"""Positions and lengths out of range, read on the device: the kernels clamp them and set the fault word.

On the host, the launchers refuse them before any launch (``test_decoder``). Device tensors are checked by
the kernels themselves; here the host check is switched off so that the interpreter, whose tensors are on
the host, runs the same device-side path the GPU does.
"""

from __future__ import annotations

import pytest
import torch

from mosaicquant.errors import UserInputError
from mosaicquant.kernels import decoder
from mosaicquant.kernels.decoder import (
    check_range_faults,
    decode_attention,
    decode_rope_attention,
    range_fault_word,
    rope_kv,
)

from ._helpers import DEVICE, needs_triton

BF16 = torch.bfloat16
HEADS, KV_HEADS, D, B, SLOTS = 4, 2, 32, 2, 16


@pytest.fixture
def device_checks_only(monkeypatch):
    """The launchers' host check off; the fault word clear before and after."""
    monkeypatch.setattr(decoder, "_check_cpu_range", lambda *args, **kwargs: None)
    range_fault_word(DEVICE).zero_()
    yield
    range_fault_word(DEVICE).zero_()


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, (HEADS + 2 * KV_HEADS) * D, generator=g).to(BF16).to(DEVICE)
    angles = torch.rand(SLOTS, D, generator=g) * 6.0
    cos, sin = angles.cos().to(BF16).to(DEVICE), angles.sin().to(BF16).to(DEVICE)
    kc = torch.randn(B, KV_HEADS, SLOTS, D, generator=g).to(BF16).to(DEVICE)
    vc = torch.randn(B, KV_HEADS, SLOTS, D, generator=g).to(BF16).to(DEVICE)
    return qkv, cos, sin, kc, vc


@needs_triton()
def test_in_range_launches_leave_no_fault(device_checks_only):
    qkv, cos, sin, kc, vc = _inputs(0)
    pos = torch.tensor([0, SLOTS - 1], device=DEVICE)
    q = rope_kv(qkv, pos, cos, sin, kc, vc, HEADS, KV_HEADS, 1, kernel="triton")
    decode_attention(q, kc, vc, torch.tensor([1, SLOTS], dtype=torch.int32, device=DEVICE), D ** -0.5,
                     kernel="triton")
    decode_rope_attention(qkv, pos, cos, sin, kc, vc, HEADS, KV_HEADS, D ** -0.5, kernel="triton")
    check_range_faults(DEVICE)  # nothing to raise
    assert int(range_fault_word(DEVICE).item()) == 0


@needs_triton()
@pytest.mark.parametrize("bad", [SLOTS, -1])
def test_rope_kv_position_out_of_range_is_reported(device_checks_only, bad):
    qkv, cos, sin, kc, vc = _inputs(1)
    pos = torch.tensor([3, bad], device=DEVICE)
    before = kc.clone()
    rope_kv(qkv, pos, cos, sin, kc, vc, HEADS, KV_HEADS, 1, kernel="triton")
    # the clamped write stays inside the cache: the slot at the edge, nothing else of that sequence
    edge = SLOTS - 1 if bad > 0 else 0
    changed = (kc[1] != before[1]).any(dim=-1).any(dim=0).nonzero().flatten().tolist()
    assert changed == [edge], changed
    allowed = r"\(allowed 0\.\.min\(cache slots, cos/sin rows\) - 1\)"
    with pytest.raises(UserInputError, match=r"rope_kv positions " + allowed):
        check_range_faults(DEVICE)
    check_range_faults(DEVICE)  # the word was cleared


@needs_triton()
@pytest.mark.parametrize("bad", [0, SLOTS + 1])
def test_decode_attention_length_out_of_range_is_reported(device_checks_only, bad):
    qkv, cos, sin, kc, vc = _inputs(2)
    q = qkv[:, :HEADS * D].reshape(B, HEADS, D)
    y = decode_attention(q, kc, vc, torch.tensor([bad, 5], dtype=torch.int32, device=DEVICE), D ** -0.5,
                         kernel="triton")
    assert torch.isfinite(y.float()).all()  # clamped to 1 or SLOTS keys: no read past the cache
    with pytest.raises(UserInputError, match=r"decode_attention lengths \(allowed 1\.\.cache slots\)"):
        check_range_faults(DEVICE)


@needs_triton()
def test_decode_rope_attention_position_out_of_range_is_reported(device_checks_only):
    qkv, cos, sin, kc, vc = _inputs(3)
    pos = torch.tensor([2, SLOTS + 4], device=DEVICE)
    decode_rope_attention(qkv, pos, cos, sin, kc, vc, HEADS, KV_HEADS, D ** -0.5, kernel="triton")
    with pytest.raises(UserInputError, match=r"decode_rope_attention positions") as err:
        check_range_faults(DEVICE)
    assert "rope_kv" not in str(err.value) and "lengths" not in str(err.value)
