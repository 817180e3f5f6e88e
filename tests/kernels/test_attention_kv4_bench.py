"""``benchmarks/attention_kv4.py``: the bytes it divides by are the bytes of the caches it builds; its prologue forms
name the decoder's constants and are undone after their calls."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import attention_kv4 as ak  # noqa: E402


@pytest.mark.parametrize("bits", [16, 4])
def test_cache_bytes_are_the_built_caches_bytes_a_token(bits):
    b, context = 3, 40
    _, _, _, _, kc, vc, sc = ak._inputs(b, context, torch.device("cpu"), bits, torch.Generator().manual_seed(0))
    length = kc.shape[2]
    built = kc.numel() * kc.element_size() + vc.numel() * vc.element_size() + (sc.nbytes if sc is not None else 0)
    assert built % length == 0
    assert ak.cache_bytes(b, context, bits) == built // length * context
    # 72 bytes a head and token for a 4-bit key or value against 256 at 16 bits (D = 128)
    assert ak.cache_bytes(1, 1, bits) == ak.KV_HEADS * 2 * (72 if bits == 4 else 256)


def test_forms_set_decoder_constants_and_restore_them():
    from mosaicquant.kernels import decoder

    for name, flags in ak.FORMS.items():
        for k, v in flags.items():
            assert type(getattr(decoder, k)) is type(v), (name, k)
            if k == "ATTN_KV4_MINMAX":
                assert v in decoder.KV4_MINMAX_FORMS, (name, v)
            if k == "ATTN_KV4_BLOCK_N":  # a loop step the kernel takes (a power of two, at least tl.dot's 16)
                assert v >= 16 and v & (v - 1) == 0, (name, v)
    assert set(ak.FORMS_16) <= set(ak.FORMS)
    before = {k: getattr(decoder, k) for k in ("ATTN_NEW_CACHED", "ATTN_KV4_MINMAX", "ATTN_KV4_BLOCK_N")}
    other = next(f for f in decoder.KV4_MINMAX_FORMS if f != before["ATTN_KV4_MINMAX"])
    flags = {"ATTN_NEW_CACHED": not before["ATTN_NEW_CACHED"], "ATTN_KV4_MINMAX": other}
    with pytest.raises(RuntimeError):
        with ak._settings(64, flags):
            assert decoder.ATTN_KV4_BLOCK_N == 64
            assert all(getattr(decoder, k) == v for k, v in flags.items())
            raise RuntimeError("a failed call")
    assert {k: getattr(decoder, k) for k in before} == before


@pytest.mark.parametrize("argv,named", [(["--rounds", "0"], "--rounds"), (["--forms", "v42,nope"], "nope")])
def test_bad_arguments_are_refused_before_any_work(argv, named, capsys):
    with pytest.raises(SystemExit) as exc:
        ak.main(argv)
    assert exc.value.code == 2 and named in capsys.readouterr().err
