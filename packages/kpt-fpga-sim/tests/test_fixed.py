"""Full-width fixed-point arithmetic, exact matrix products, the table function units."""

from __future__ import annotations

import math

import pytest
import torch

from kpt_fpga_sim.arith import FixedArith
from kpt_fpga_sim.fixed import Fx, exact_matmul
from kpt_fpga_sim.formats import ap_fixed
from kpt_fpga_sim.nonlinear import bit_length, tables_for


def _fx(values, w: int, i: int) -> Fx:
    raw, over = ap_fixed(w, i, "RND", "SAT").from_float(torch.as_tensor(values, dtype=torch.float64))
    assert not over.any()
    return Fx(raw, w, i)


def test_full_width_types_follow_ap_fixed() -> None:
    a, b = _fx([1.5, -3.25], 16, 6), _fx([2.125, 0.5], 8, 3)
    prod, total = a * b, a + b
    assert (prod.w, prod.i) == (24, 9)
    assert (total.w, total.i) == (17, 7)
    assert prod.to_float().tolist() == [1.5 * 2.125, -3.25 * 0.5]
    assert total.to_float().tolist() == [3.625, -2.75]
    s = _fx(torch.ones(1000), 16, 6).sum(0)
    assert (s.w, s.i) == (26, 16) and float(s.to_float()) == 1000.0


def test_wide_operands_are_declared_narrower_not_overflowed() -> None:
    a = _fx([1.0 / 3.0], 40, 4)
    p = a * a
    assert p.w <= 64
    assert abs(float(p.to_float()) - 1.0 / 9.0) < 2.0 ** -26


def test_exact_matmul_matches_python_integers() -> None:
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    # limbs in every case; the exact sums stay within int64 (|sum| < 2^(wa+wb-2) · k < 2^63)
    for wa, wb, k in ((16, 16, 300), (30, 31, 7), (24, 24, 4097)):
        a = torch.randint(-(1 << (wa - 1)), 1 << (wa - 1), (5, k), generator=g)
        b = torch.randint(-(1 << (wb - 1)), 1 << (wb - 1), (k, 3), generator=g)
        got = exact_matmul(a, b, wa, wb)
        want = [[sum(int(a[i, t]) * int(b[t, j]) for t in range(k)) for j in range(3)] for i in range(5)]
        assert got.tolist() == want


def test_bit_length() -> None:
    x = torch.tensor([0, 1, 2, 3, 255, 256, (1 << 62) + 5, (1 << 63) - 1])
    assert bit_length(x).tolist() == [v.bit_length() for v in x.tolist()]


@pytest.mark.parametrize("f_data", [6, 10])
def test_tables_meet_their_stated_bound(f_data: int) -> None:
    for name, table in tables_for(f_data).items():
        assert table.max_error_lsb <= 7 / 8, (name, table.max_error_lsb)
        assert table.entries <= (1 << 14) + 1


def test_function_units_against_float64() -> None:
    a = FixedArith(ap_fixed(16, 6, "RND", "SAT"))
    x = torch.randn(4000, dtype=torch.float64) * 3
    v = a.load(x)
    xq = v.to_float()
    lsb_out = 2.0 ** -(a.format.f + 4)
    # table error (< 1 LSB of F+4 bits) plus the rounding of the argument to the table's grid
    units = (("sigmoid", torch.sigmoid, 0.25), ("tanh", torch.tanh, 1.0), ("erf", torch.erf, 1.13))
    for fn, ref, slope in units:
        err = (getattr(a, fn)(v).to_float() - ref(xq)).abs().max()
        assert err <= lsb_out + slope * 2.0 ** -(a.format.f + 3), fn
    neg = a.load(-x.abs())
    assert (a.exp(neg).to_float() - torch.exp(neg.to_float())).abs().max() <= 2 * lsb_out
    pos = a.load(x.abs() + 0.01)
    for fn, ref in (("rsqrt", torch.rsqrt), ("recip", torch.reciprocal)):
        rel = (getattr(a, fn)(pos).to_float() / ref(pos.to_float()) - 1).abs().max()
        assert rel < 4 * lsb_out, fn
    assert (a.log(pos).to_float() - torch.log(pos.to_float())).abs().max() < 4 * lsb_out
    assert not a.overflows


def test_constants_keep_eighteen_significant_bits() -> None:
    a = FixedArith(ap_fixed(16, 6))
    for c in (1.0 / 4097, 1e-6, math.log(2.0), -0.5, 1.0, 4096.0):
        v = a.const(c)
        assert abs(float(v.to_float()) - c) <= abs(c) * 2.0 ** -17
    assert (a.const(0.5).w, a.const(0.5).f) == (2, 1)
