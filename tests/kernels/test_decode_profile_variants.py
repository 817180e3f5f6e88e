"""``benchmarks/decode_profile.py``'s variants: the decoder constants they name are set for their block, in the
constant's own type (a named form keeps its text), and restored after, a failing block included."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import decode_profile as dp  # noqa: E402

from mosaicquant.kernels import decoder  # noqa: E402


def test_variant_constants_take_their_types_and_are_restored():
    label, env = dp.parse_variant("v:mosaicquant.kernels.decoder.ATTN_KV4_BLOCK_N=64,"
                                  "mosaicquant.kernels.decoder.ATTN_KV4_MINMAX=joined,"
                                  "mosaicquant.kernels.decoder.ATTN_NEW_CACHED=0")
    assert label == "v" and len(env) == 3
    before = (decoder.ATTN_KV4_BLOCK_N, decoder.ATTN_KV4_MINMAX, decoder.ATTN_NEW_CACHED)
    with pytest.raises(RuntimeError):
        with dp._Env(env):
            assert decoder.ATTN_KV4_BLOCK_N == 64 and type(decoder.ATTN_KV4_BLOCK_N) is int
            assert decoder.ATTN_KV4_MINMAX == "joined"
            assert decoder.ATTN_NEW_CACHED is False
            raise RuntimeError("a failed step")
    assert (decoder.ATTN_KV4_BLOCK_N, decoder.ATTN_KV4_MINMAX, decoder.ATTN_NEW_CACHED) == before


@pytest.mark.parametrize("text", ["x:A", "x:=1", ":A=1", "x:"])
def test_malformed_variants_are_refused(text):
    with pytest.raises(SystemExit, match="expected LABEL:VAR=VALUE"):
        dp.parse_variant(text)
