"""``benchmarks/persistent_barrier.py``: its phases compute what its float64 reference says, and its check catches
a wrong value (the persistent kernel's grid barrier needs a GPU: the interpreter runs programs one by one)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import persistent_barrier as pb  # noqa: E402

SMALL = (("a", 1024, 1024), ("b", 2048, 1024), ("c", 1024, 2048))


def _chain(device):
    chain = pb.Chain(5, 2, 64, 512, 2, device, layer=SMALL)
    return chain, pb.reference(chain.x[0].clone(), chain.ws)


def test_separate_phases_equal_the_reference_and_a_wrong_value_is_caught():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    chain, expect = _chain(device)
    # the padding rows stay zero; the real rows are mostly inside the clamp (the check compares values, not bounds)
    assert all(e[5:].eq(0).all() and ((e[:5] > -8) & (e[:5] < 7)).float().mean() > 0.5 for e in expect)
    chain.x[1:].fill_(99)
    chain.run_sep(False, False)
    chain.check(expect)
    chain.x[3, 2, 7] += 1
    with pytest.raises(AssertionError, match=r"phase 2 \(c\)"):
        chain.check(expect)


def test_phases_that_do_not_chain_are_refused():
    with pytest.raises(ValueError, match="reads 2048 columns, but a before it writes 1024"):
        pb.phases(1, (("a", 1024, 1024), ("b", 1024, 2048)))
    with pytest.raises(ValueError, match="multiples of 1024"):
        pb.Chain(4, 1, 16, 512, 2, torch.device("cpu"), layer=(("a", 1000, 1024),))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a grid barrier needs every program resident (a GPU)")
def test_persistent_chain_equals_the_reference():
    chain, expect = _chain(torch.device("cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for pf in (False, True):
        chain.x[1:].fill_(99)
        chain.run_pers(sms, pf)
        torch.cuda.synchronize()
        chain.check(expect)
