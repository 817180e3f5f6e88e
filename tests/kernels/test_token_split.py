"""The programs-per-token rule and checks of the activation quantizers (pure Python)."""

import pytest

from mosaicquant.errors import UserInputError
from mosaicquant.kernels._token_split import (
    MAX_PROGRAMS_PER_TOKEN,
    check_num_warps,
    check_programs_per_token,
    default_programs_per_token,
)

H200_SMS = 132


@pytest.mark.parametrize("m,width,sms,min_width,most,want", [
    (4, 14336, H200_SMS, 1024, 16, 8),     # 14336 / 16 = 896 values < 1024: 8
    (4, 14336, H200_SMS, 512, 16, 16),
    (4, 14336, H200_SMS, 512, 8, 8),       # the kernel's own limit (Hadamard: D / 16)
    (1, 4096, H200_SMS, 1024, 16, 4),
    (32, 14336, H200_SMS, 512, 16, 4),     # 32 · 4 = 128 <= 132 SMs, 32 · 8 does not fit
    (16, 14336, H200_SMS, 512, 16, 8),
    (33, 14336, H200_SMS, 512, 16, 1),     # past decode sizes: one program per token
    (4, 14336, None, 512, 16, 1),          # the interpreter: programs run one at a time
    (4, 14336, 4, 512, 16, 1),             # a GPU with 4 SMs
    (4, 14336, 8, 512, 16, 2),
    (1, 1000, H200_SMS, 1024, 16, 1),      # too narrow to split
    (1, 10**6, H200_SMS, 1024, 1000, 128), # a high cap: bound by the SMs
])
def test_default_rule(m, width, sms, min_width, most, want):
    assert default_programs_per_token(m, width, sms, min_width, most) == want


def test_default_rule_leaves_short_rows_whole():
    assert default_programs_per_token(4, 4096, H200_SMS, 1024, min_row=8192) == 1
    assert default_programs_per_token(4, 8192, H200_SMS, 1024, min_row=8192) == 8
    assert default_programs_per_token(4, 14336, H200_SMS, 1024, min_row=8192) == 8


def test_default_rule_never_exceeds_its_limits():
    for m in range(1, 40):
        for width in (576, 1536, 4096, 14336, 28672):
            p = default_programs_per_token(m, width, H200_SMS, 512)
            assert p & (p - 1) == 0 and p <= MAX_PROGRAMS_PER_TOKEN
            assert p == 1 or (m * p <= H200_SMS and width // p >= 512)


@pytest.mark.parametrize("p", [1, 2, 4, 16])
def test_allowed_values_come_back(p):
    assert check_programs_per_token(p, 4, H200_SMS) == p


@pytest.mark.parametrize("p,m,sms,most,match", [
    (0, 4, H200_SMS, None, r"programs_per_token=0 is not allowed: choose a positive power of two"),
    (3, 4, H200_SMS, None, r"programs_per_token=3 is not allowed"),
    (-2, 4, H200_SMS, None, r"programs_per_token=-2 is not allowed"),
    (2.0, 4, H200_SMS, None, r"programs_per_token=2.0 is not allowed"),
    (True, 4, H200_SMS, None, r"programs_per_token=True is not allowed"),
    (16, 4, H200_SMS, 8, r"programs_per_token=16 is too large for this input: at most 8 \(why\)"),
    (32, 1, H200_SMS, None, r"programs_per_token=32 is too large: at most 16 \(one barrier slot each\)"),
    (2, 4, None, None, r"programs_per_token=2 needs a CUDA device.*only 1 is allowed"),
    (8, 32, H200_SMS, None, r"programs_per_token=8 with 32 tokens needs 256 programs.*132 SMs.*P <= 4"),
])
def test_values_not_allowed_are_named(p, m, sms, most, match):
    with pytest.raises(UserInputError, match=match):
        check_programs_per_token(p, m, sms, most, "why")


def test_warps_are_checked():
    check_num_warps(None)
    check_num_warps(8)
    for bad in (3, 0, 64, True):
        with pytest.raises(UserInputError, match=f"num_warps={bad!r} is not allowed"):
            check_num_warps(bad)
