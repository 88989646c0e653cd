"""Non-linear functions the way HLS designs compute them in fixed point: interpolated tables.

A `Table` holds ``fn`` on ``[lo, hi]`` as linear segments of width ``h = 2^-s``, in ROM, domains
chosen so that outside them ``fn`` is within ½ LSB of its limit (the unit saturates there):

    x in ap_fixed<I_in + F_in, I_in, RND, SAT>, clamped to [lo, hi]
    u = x - lo;   k = u >> (F_in - s);   t = low (F_in - s) bits of u, read as a fraction in [0, 1)
    y = c0[k] + c1[k] · t                 c0[k] = fn(lo + k·h), c1[k] = c0[k+1] - c0[k]
    result: ap_fixed<F_out + 2, 2, RND, SAT>

built only from a subtraction, shifts, one multiply and one add. Stated error bound, in LSBs of
the output (2^-F_out, F_out = F + 4 for a data format with F fractional bits):

    chord h²·max|fn''|/8 ≤ ¼ (``s`` is chosen so)  +  knot rounding ⅛  +  output rounding ½  =  ⅞

for an argument on the table's input grid; `Table.max_error` measures it over that grid (every
code up to 2^20 of them) and the unit tests hold every table to it. Rounding the argument to
the grid (½ LSB of F + 2 bits) adds |fn'| times that.

Functions of unbounded range go through a normalizing shifter first (leading-one detection,
`bit_length`): ``v = m · 2^e`` with ``m`` in [1, 2) (or [1, 4) for rsqrt, so that ``e`` is even),

    1/v = (1/m) · 2^-e,   rsqrt(v) = rsqrt(m) · 2^(-e/2),   ln v = ln m + e · ln 2

so their tables only cover the mantissa. Which tables a format gets is `tables_for`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .fixed import bits_for
from .formats import ApFixed

GUARD_BITS = 4
"""Fractional bits the function units keep beyond the data format (F_out = F + 4)."""

_ENUMERABLE = 1 << 20
"""Input codes of a unit whose every output is precomputed (its ROM of results, one lookup per
argument instead of the interpolation's dozen tensor passes) and whose error is measured on
every code; above this many, the unit interpolates and its error is measured on an evenly
strided subset."""


def _pow2(x: float) -> int:
    return 1 << bits_for(math.ceil(x))


@dataclass(frozen=True)
class FunctionSpec:
    """A function of the library: its domain and the bound of |fn''| on it."""

    name: str
    lo: float
    hi: float
    curvature: float


def _ref(name: str) -> Callable[[Tensor], Tensor]:
    return {
        "exp": torch.exp, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "erf": torch.erf,
        "rsqrt": torch.rsqrt, "recip": torch.reciprocal, "log": torch.log,
    }[name]


def function_spec(name: str, f_out: int) -> FunctionSpec:
    """Domains chosen so that outside them the function is within ½ LSB of its limit."""
    lsb_bits = f_out + 1
    ln2 = math.log(2.0)
    if name == "exp":
        return FunctionSpec(name, -_pow2(lsb_bits * ln2), 0, 1.0)
    if name == "sigmoid":
        r = _pow2(lsb_bits * ln2)
        return FunctionSpec(name, -r, r, 0.0963)
    if name == "tanh":
        r = _pow2((lsb_bits + 1) * ln2 / 2)
        return FunctionSpec(name, -r, r, 0.7699)
    if name == "erf":
        r = _pow2(math.sqrt(lsb_bits * ln2))
        return FunctionSpec(name, -r, r, 0.9679)
    if name == "rsqrt":
        return FunctionSpec(name, 1, 4, 0.75)
    if name == "recip":
        return FunctionSpec(name, 1, 2, 2.0)
    if name == "log":
        return FunctionSpec(name, 1, 2, 1.0)
    raise KeyError(name)


@dataclass(frozen=True)
class Table:
    """``fn`` on ``[lo, hi]`` in linear segments (see the module docstring)."""

    name: str
    lo: int
    hi: int
    f_in: int
    f_out: int
    seg_bits: int

    @property
    def input_format(self) -> ApFixed:
        i_in = max(abs(self.lo), abs(self.hi)).bit_length() + 1
        return ApFixed(i_in + self.f_in, i_in, "RND", "SAT")

    @property
    def output_format(self) -> ApFixed:
        return ApFixed(self.f_out + 2, 2, "RND", "SAT")

    @property
    def f_coef(self) -> int:
        return self.f_out + 2

    @property
    def t_bits(self) -> int:
        return self.f_in - self.seg_bits

    @property
    def entries(self) -> int:
        return ((self.hi - self.lo) << self.seg_bits) + 1

    @functools.cached_property
    def coefficients(self) -> tuple[Tensor, Tensor]:
        """``(c0, c1)`` as int64 at ``f_coef`` fractional bits (the ROM contents)."""
        knots = torch.arange(self.entries + 1, dtype=torch.float64) / (1 << self.seg_bits) + self.lo
        values = _ref(self.name)(knots)
        c = torch.round(torch.ldexp(values, torch.tensor(float(self.f_coef)))).to(torch.int64)
        return c[:-1], c[1:] - c[:-1]

    @property
    def rom_bits(self) -> int:
        c0, c1 = self.coefficients
        width = int(c0.abs().max()).bit_length() + int(c1.abs().max()).bit_length() + 2
        return self.entries * width

    @property
    def codes(self) -> int:
        """Input codes of the domain."""
        return ((self.hi - self.lo) << self.f_in) + 1

    @functools.cached_property
    def results(self) -> Tensor | None:
        """The unit's output for every input code (`_ENUMERABLE` codes at most, else None)."""
        return self._interpolate(torch.arange(self.codes)) if self.codes <= _ENUMERABLE else None

    def __call__(self, x: Tensor, f: int | None = None) -> Tensor:
        """Output raw integers for input raw integers ``x`` at ``f <= f_in`` fractional bits
        (default ``f_in``: the input format's), clamped to the domain."""
        first = self.lo << self.f_in
        u = x.to(torch.int64, copy=True)
        if f is not None and f < self.f_in:
            u <<= self.f_in - f
        u = u.clamp_(first, self.hi << self.f_in).sub_(first)
        return self._interpolate(u) if self.results is None else torch.take(self.results, u)

    def _interpolate(self, u: Tensor) -> Tensor:
        """The unit's arithmetic on int64 offsets ``u`` from the start of the domain."""
        k = u >> self.t_bits
        t = u & ((1 << self.t_bits) - 1)
        c0, c1 = self.coefficients
        acc = (c0[k] << self.t_bits) + c1[k] * t
        out, _ = self.output_format.requantize(acc, self.t_bits + self.f_coef - self.f_out)
        return out

    @functools.cached_property
    def max_error(self) -> float:
        """The largest |table − fn| over the table's input grid (every code up to 2^20, else strided)."""
        first, last = self.lo << self.f_in, self.hi << self.f_in
        step = max(1, self.codes // _ENUMERABLE)
        codes = torch.arange(first, last + 1, step, dtype=torch.int64)
        got = torch.ldexp(self(codes).to(torch.float64), torch.tensor(float(-self.f_out)))
        want = _ref(self.name)(torch.ldexp(codes.to(torch.float64), torch.tensor(float(-self.f_in))))
        return float((got - want).abs().max())

    @property
    def max_error_lsb(self) -> float:
        return self.max_error * 2.0 ** self.f_out


@functools.cache
def make_table(name: str, f_in: int, f_out: int) -> Table:
    spec = function_spec(name, f_out)
    # smallest segment exponent whose chord error h²·|fn''|/8 is below ¼ LSB of the output
    s = math.ceil((f_out - 1 + math.log2(spec.curvature)) / 2)
    s = min(max(s, 0), f_in)
    return Table(name, int(spec.lo), int(spec.hi), f_in, f_out, s)


NORMALIZED = ("rsqrt", "recip", "log")


def tables_for(f_data: int) -> dict[str, Table]:
    """The function units of a design whose data format has ``f_data`` fractional bits."""
    f_out = f_data + GUARD_BITS
    return {
        name: make_table(name, f_out + 2 if name in NORMALIZED else f_data + 2, f_out)
        for name in ("exp", "sigmoid", "tanh", "erf", *NORMALIZED)
    }


def bit_length(x: Tensor) -> Tensor:
    """Bits of the non-negative integers ``x`` (0 for 0), as int64: a leading-one detector."""
    n = torch.frexp(x.to(torch.float64))[1].to(torch.int64)      # x = m · 2^n, m in [0.5, 1)
    if x.is_floating_point():
        return n
    # an int64 above 2^53 may round up to the next power of two on its way to float64
    return torch.where((x > 0) & ((x >> (n - 1).clamp_min(0)) == 0), n - 1, n)
