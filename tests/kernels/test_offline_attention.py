"""``benchmarks/offline_attention.py``'s reading of a compiled kernel: the loop it counts is the widest backward
branch's span of the SASS, and ``--set`` names decoder constants only."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import offline_attention as oa  # noqa: E402

from mosaicquant.kernels import decoder  # noqa: E402

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                 /* 0x00000a0000017a02 */
        /*0010*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;          /* 0x0000000000007b1d */
        /*0020*/                   LDS R2, [R3] ;                         /* 0x0000000003027984 */
        /*0030*/              @!P0 BRA 0x20 ;                             /* 0xfffffffc00008947 */
        /*0040*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;  /* 0x0000000c0804723c */
        /*0050*/                   LDSM.16.M88.4 R8, [R2] ;               /* 0x000000000208783b */
        /*0060*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;          /* 0x0000000000007b1d */
        /*0070*/               @P1 BRA 0x40 ;                             /* 0xfffffff000001947 */
        /*0080*/                   BRA 0x90 ;                             /* 0xfffffff000001947 */
        /*0090*/                   EXIT ;                                 /* 0x000000000000794d */
"""


def test_loop_counts_read_the_widest_backward_branch():
    n, ops = oa.loop_counts(SASS)
    # 0x40..0x70: the HMMA, the LDSM (counted as a shared load), the barrier and the branch; not the earlier loop
    assert n == 4
    assert (ops["HMMA"], ops["LDS"], ops["BAR"], ops["BRA"], ops["MOV"]) == (1, 1, 1, 1, 0)


def test_loop_counts_refuse_straight_code():
    with pytest.raises(ValueError, match="no backward branch"):
        oa.loop_counts(SASS.replace("BRA 0x20", "BRA 0x90").replace("BRA 0x40", "BRA 0x90"))


def test_set_takes_the_constants_type_and_refuses_other_names(monkeypatch):
    for name in ("ATTN_KV4_BLOCK_N", "ATTN_KV4_MINMAX", "ATTN_NEW_CACHED", "ATTN_KV4_ZDOT"):
        monkeypatch.setattr(decoder, name, getattr(decoder, name))  # restored after the test
    oa._set(decoder, "ATTN_KV4_BLOCK_N=64")
    oa._set(decoder, "ATTN_KV4_ZDOT=1")
    oa._set(decoder, "ATTN_KV4_MINMAX=joined")
    oa._set(decoder, "ATTN_NEW_CACHED=0")
    assert (decoder.ATTN_KV4_BLOCK_N, decoder.ATTN_KV4_MINMAX, decoder.ATTN_NEW_CACHED, decoder.ATTN_KV4_ZDOT) == (
        64, "joined", False, True)
    for bad in ("NOT_A_CONSTANT=1", "ATTN_KV4_ZDOT"):
        with pytest.raises(SystemExit, match="expected NAME=VALUE"):
            oa._set(decoder, bad)
    with pytest.raises(SystemExit, match="ATTN_KV4_BLOCK_N takes a number, got 'x'"):
        oa._set(decoder, "ATTN_KV4_BLOCK_N=x")
