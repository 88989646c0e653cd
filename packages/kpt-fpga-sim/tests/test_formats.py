"""Number formats: ap_fixed quantization/overflow against an independent rational model, FP8."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from kpt_fpga_sim.formats import E4M3FN, E5M2, FLOAT32, O_MODES, Q_MODES, ap_fixed, parse_format


def test_ug1399_worked_cases() -> None:
    rnd = ap_fixed(3, 2, "RND")
    assert float(rnd.quantize(torch.tensor(1.25))) == 1.5
    assert float(rnd.quantize(torch.tensor(-1.25))) == -1.0
    assert float(ap_fixed(8, 4).quantize(torch.tensor(9.3))) == -6.75


def _round(v: Fraction, q: str) -> int:
    """An independent statement of the seven quantization modes on exact rationals."""
    fl = math.floor(v)
    rem = v - fl
    tie, above = rem == Fraction(1, 2), rem > Fraction(1, 2)
    if q == "TRN":
        return fl
    if q == "TRN_ZERO":
        return math.trunc(v)
    if above:
        return fl + 1
    if not tie:
        return fl
    return {"RND": fl + 1, "RND_ZERO": fl + (v < 0), "RND_MIN_INF": fl, "RND_INF": fl + (v > 0),
            "RND_CONV": fl + (fl % 2)}[q]


def _overflow(q: int, w: int, o: str, dropped_bit: int) -> int:
    lo, hi = -(1 << (w - 1)), (1 << (w - 1)) - 1
    in_range = lo <= q <= hi and not (o == "SAT_SYM" and q == lo)
    if in_range:
        return q
    if o == "SAT":
        return hi if q > 0 else lo
    if o == "SAT_SYM":
        return hi if q > 0 else -hi
    if o == "SAT_ZERO":
        return 0
    wrapped = ((q - lo) % (1 << w)) + lo
    if o == "WRAP" or dropped_bit == (wrapped < 0):
        return wrapped
    # WRAP_SM: invert the bits, then the sign bit becomes the first dropped bit
    return ((~wrapped) & hi) - dropped_bit * (hi + 1)


def _model(x: float, w: int, i: int, q: str, o: str) -> Fraction:
    scaled = Fraction(x) * Fraction(2) ** (w - i)
    raw = _round(scaled, q)
    dropped = (math.floor(scaled) >> w) & 1
    return Fraction(_overflow(raw, w, o, dropped)) / Fraction(2) ** (w - i)


@pytest.mark.parametrize("q", Q_MODES)
@pytest.mark.parametrize("o", O_MODES)
def test_every_mode_matches_the_rational_model(q: str, o: str) -> None:
    g = torch.Generator().manual_seed(hash((q, o)) % 2**31)
    fmt = ap_fixed(8, 3, q, o)
    # values on, between and beyond the grid: ties, near-ties, overflows of both signs
    grid = torch.randint(-400, 400, (300,), generator=g).double() / 64
    x = torch.cat([grid, grid + 1 / 128, torch.randn(300, generator=g, dtype=torch.float64) * 6])
    got = fmt.quantize(x)
    want = torch.tensor([float(_model(v, 8, 3, q, o)) for v in x.tolist()], dtype=torch.float64)
    assert torch.equal(got, want), (x[got != want][:5], got[got != want][:5], want[got != want][:5])


@pytest.mark.parametrize("q", Q_MODES)
@pytest.mark.parametrize("o", O_MODES)
def test_float32_shortcut_agrees_with_the_exact_split(q: str, o: str) -> None:
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    x = torch.cat([torch.randn(2000, generator=g) * 7, torch.randint(-500, 500, (500,), generator=g) / 64.0])
    for fmt in (ap_fixed(10, 4, q, o), ap_fixed(24, 2, q, o), ap_fixed(6, 8, q, o)):
        fast, over_fast = fmt.from_float(x)
        exact, over_exact = fmt.from_float(x.double())
        assert torch.equal(fast, exact) and torch.equal(over_fast, over_exact), str(fmt)


def test_overflow_flags_and_non_finite_inputs() -> None:
    fmt = ap_fixed(8, 3, "RND", "SAT")
    raw, over = fmt.from_float(torch.tensor([1.0, 3.99, 100.0, -100.0, float("inf"), float("nan")]))
    assert over.tolist() == [False, True, True, True, True, True]
    assert raw.tolist()[:4] == [32, 127, 127, -128]
    assert raw[5] == 0


def test_quantize_is_idempotent_and_on_the_grid() -> None:
    fmt = ap_fixed(12, 4, "RND_CONV", "SAT")
    x = torch.randn(1000, dtype=torch.float64) * 3
    once = fmt.quantize(x)
    assert torch.equal(fmt.quantize(once), once)
    assert torch.equal(once * 2**fmt.f, torch.round(once * 2**fmt.f))
    assert float(once.max()) <= fmt.max_raw * fmt.lsb


@pytest.mark.parametrize("fmt", [E4M3FN, E5M2])
def test_minifloats_round_like_torch(fmt) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.randn(20000, generator=g) * fmt.max / 4,
                   torch.randn(2000, generator=g) * 2.0 ** (fmt.min_exponent - 1),   # subnormals
                   torch.tensor([fmt.max * 2, -fmt.max * 3, 0.0])])
    got = fmt.quantize(x)
    assert torch.equal(got, x.clamp(-fmt.max, fmt.max).to(fmt.dtype).float())


def test_parse_format() -> None:
    assert parse_format("float32") is FLOAT32
    assert parse_format("ap_fixed<16,6>") == ap_fixed(16, 6)
    assert parse_format("ap_fixed<16, 6, AP_RND_CONV, AP_SAT>") == ap_fixed(16, 6, "RND_CONV", "SAT")
    assert str(ap_fixed(16, 6, "RND", "SAT")) == "ap_fixed<16,6,AP_RND,AP_SAT>"
    for bad in ("ap_fixed<16>", "fixed16", "ap_fixed<16,6,RND,CLAMP>"):
        with pytest.raises(ValueError):
            parse_format(bad)
    with pytest.raises(ValueError):
        ap_fixed(0, 0)
