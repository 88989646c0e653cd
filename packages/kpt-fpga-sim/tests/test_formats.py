"""Number formats: ap_fixed and ap_ufixed quantization/overflow against an independent rational
model, QKeras' quantizers against their own formula, FP8."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from kpt_fpga_sim.formats import (
    E4M3FN,
    E5M2,
    FLOAT32,
    O_MODES,
    Q_MODES,
    ap_fixed,
    ap_ufixed,
    parse_format,
    quantized_bits,
    quantized_relu,
)


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


def _unsigned_model(v: Fraction, w: int, o: str) -> int:
    """ap_ufixed overflow of the quantized integer ``v`` (the headers: WRAP modulo 2^w, SAT_ZERO
    0, SAT and SAT_SYM clamp)."""
    if 0 <= v < 1 << w:
        return v
    if o == "WRAP":
        return v % (1 << w)
    if o == "SAT_ZERO":
        return 0
    return 0 if v < 0 else (1 << w) - 1


UNSIGNED_O_MODES = tuple(o for o in O_MODES if o != "WRAP_SM")


@pytest.mark.parametrize("q", Q_MODES)
@pytest.mark.parametrize("o", UNSIGNED_O_MODES)
def test_unsigned_modes_match_the_rational_model(q: str, o: str) -> None:
    g = torch.Generator().manual_seed(hash((q, o, "u")) % 2**31)
    fmt = ap_ufixed(8, 3, q, o)
    grid = torch.randint(-400, 800, (300,), generator=g).double() / 64
    x = torch.cat([grid, grid + 1 / 128, torch.randn(300, generator=g, dtype=torch.float64) * 8])
    want = [float(Fraction(_unsigned_model(_round(Fraction(v) * 32, q), 8, o)) / 32) for v in x.tolist()]
    assert torch.equal(fmt.quantize(x), torch.tensor(want, dtype=torch.float64))
    # the integer path: raw integers of 2 more fractional bits (int64 and float64), dropped
    raw = torch.randint(-3000, 6000, (500,), generator=g)
    want_raw = [_unsigned_model(_round(Fraction(r, 4), q), 8, o) for r in raw.tolist()]
    for r in (raw, raw.double()):
        got, over = fmt.requantize(r, 2)
        assert got.tolist() == want_raw
        assert over.tolist() == [not 0 <= _round(Fraction(v, 4), q) < 256 for v in raw.tolist()]


def test_unsigned_format_basics() -> None:
    fmt = ap_ufixed(6, 0, "RND_CONV", "SAT")
    assert (fmt.min_raw, fmt.max_raw, fmt.container, str(fmt)) == (0, 63, (7, 1), "ap_ufixed<6,0,AP_RND_CONV,AP_SAT>")
    assert fmt.quantize(torch.tensor([-0.25, 0.5, 2.0])).tolist() == [0.0, 0.5, 63 / 64]
    with pytest.raises(ValueError, match="sign-magnitude"):
        ap_ufixed(8, 3, "TRN", "WRAP_SM")


def _qkeras_bits(x: torch.Tensor, bits: int, integer: int, keep_negative: bool) -> torch.Tensor:
    """QKeras' quantized_bits (alpha 1, not symmetric): ``m_i · clip(round(x · m / m_i), lo, m - 1) / m``
    with ``m = 2^(bits - keep_negative)``, ``m_i = 2^integer``, ``lo = -m`` or 0, tf.round ties to even."""
    m, m_i = 2.0 ** (bits - keep_negative), 2.0**integer
    return m_i * torch.clamp(torch.round(x * m / m_i), -m if keep_negative else 0.0, m - 1) / m


@pytest.mark.parametrize(("bits", "integer"), [(8, 3), (6, 0), (4, 2), (16, 6), (3, 5)])
def test_qkeras_quantizers_are_their_formula(bits: int, integer: int) -> None:
    g = torch.Generator().manual_seed(bits * 100 + integer)
    x = torch.cat([torch.randn(2000, generator=g, dtype=torch.float64) * 2.0 ** (integer + 1),
                   torch.randint(-300, 300, (300,), generator=g).double() / 2.0 ** (bits - integer)])
    for keep in (True, False):
        assert torch.equal(quantized_bits(bits, integer, keep).quantize(x), _qkeras_bits(x, bits, integer, keep))
    # quantized_relu: relu, then quantized_bits without the negative values
    assert torch.equal(quantized_relu(bits, integer).quantize(x), _qkeras_bits(x.clamp_min(0), bits, integer, False))


def test_parse_qkeras_quantizers() -> None:
    assert parse_format("quantized_bits(8,3)") == ap_fixed(8, 4, "RND_CONV", "SAT")
    assert parse_format("quantized_bits(6, 0, keep_negative=0, alpha=1)") == ap_ufixed(6, 0, "RND_CONV", "SAT")
    assert parse_format("quantized_bits(bits=6, integer=2, keep_negative=True)") == ap_fixed(6, 3, "RND_CONV", "SAT")
    assert parse_format(" quantized_relu(6, 0) ") == ap_ufixed(6, 0, "RND_CONV", "SAT")
    assert parse_format("quantized_relu(bits=4)") == ap_ufixed(4, 0, "RND_CONV", "SAT")
    for bad, why in (("quantized_bits(8, 3, alpha=0.5)", "alpha"), ("quantized_relu(8, 2, 1)", "each once"),
                     ("quantized_bits(8, bits=3)", "each once"), ("quantized_bits(8.5)", "integer"),
                     ("quantized_relu(x)", "not a number"), ("quantized_relu()", "bits is required"),
                     ("quantized_po2(4)", "expected")):
        with pytest.raises(ValueError, match=why):
            parse_format(bad)


@pytest.mark.parametrize("q", Q_MODES)
@pytest.mark.parametrize("o", O_MODES)
def test_float32_shortcut_agrees_with_the_exact_split(q: str, o: str) -> None:
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    x = torch.cat([torch.randn(2000, generator=g) * 7, torch.randint(-500, 500, (500,), generator=g) / 64.0])
    unsigned = (ap_ufixed(10, 4, q, o), ap_ufixed(24, 2, q, o)) if o != "WRAP_SM" else ()
    for fmt in (ap_fixed(10, 4, q, o), ap_fixed(24, 2, q, o), ap_fixed(6, 8, q, o), *unsigned):
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
    assert parse_format("ap_ufixed<8, 0, RND, SAT_SYM>") == ap_ufixed(8, 0, "RND", "SAT_SYM")
    for bad in ("ap_fixed<16>", "fixed16", "ap_fixed<16,6,RND,CLAMP>"):
        with pytest.raises(ValueError):
            parse_format(bad)
    with pytest.raises(ValueError):
        ap_fixed(0, 0)
