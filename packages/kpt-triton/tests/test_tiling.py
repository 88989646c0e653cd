"""The launchers' plain-Python size helpers agree with Triton's own."""

from __future__ import annotations

import triton

from kpt_triton.tiling import cdiv, next_pow2


def test_cdiv_matches_triton() -> None:
    for a in range(0, 300):
        for b in (1, 2, 3, 7, 16, 128, 1000):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_next_pow2_matches_triton() -> None:
    for n in [*range(1, 600), 4097, 65535, 65536, 128256, 2**31 - 1]:
        assert next_pow2(n) == triton.next_power_of_2(n), n
    # where Triton's gives 0, a block size of 1 is returned: a block never has size 0
    assert next_pow2(0) == 1
