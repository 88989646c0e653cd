"""`Fx`: a tensor of fixed-point values with the full-width typing of C++ ``ap_fixed`` arithmetic.

An ``Fx`` holds ``raw`` integers and a static type ``<w, i>`` (``f = w - i`` fractional bits); its
value is ``raw · 2^-f``. The integers are float64 for a type of at most 53 bits, int64 beyond
(`kpt_fpga_sim.formats.raw_dtype`): each operator converts its operands to the dtype of its
result's type first, so every sum and product is exact. Results keep every bit, as ``ap_fixed``
operators do:

    a + b, a - b : <max(Ia, Ib) + 1 + max(Fa, Fb), max(Ia, Ib) + 1>
    a * b        : <Wa + Wb, Ia + Ib>
    -a           : <Wa + 1, Ia + 1>
    Σ over n     : <W + ⌈log2 n⌉, I + ⌈log2 n⌉>        (an accumulator that cannot overflow)
    a @ b        : the products, then Σ over K

Where a full-width result would exceed the 64 bits of the simulation (and of the widest
accumulator a design uses), its operands are first declared narrower, by a static rule on the
types alone (so a C++ design can declare the same): each operand keeps its integer bits and is
rounded (RND, SAT) to fewer fractional bits, a multiplier operand to at most 32 bits, an adder
operand to the fractional bits that still fit. The pseudo-float outputs of the normalizing units
(reciprocal, rsqrt) carry a per-element power of two ``shift`` (value ``raw · 2^(shift - f)``);
such a value may only be multiplied, cast or read out.

Matrix products are exact: the integer operands go through float64 BLAS, in limbs small enough
that every partial sum is an integer below 2^53 where the result is wider than that, so no
rounding can happen, then recombine in int64 (the SIMD-friendly way to get an exact int64 GEMM
on a CPU).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .formats import EXACT_BITS, ApFixed, as_raw

MAX_BITS = 64
_ZERO = torch.zeros((), dtype=torch.float64)


class FixedWidthError(ValueError):
    """A full-width fixed-point result would need more than 64 bits."""


def bits_for(n: int) -> int:
    """Extra integer bits a sum of ``n`` terms needs: ``⌈log2 n⌉``."""
    return max(n - 1, 0).bit_length()


def check_width(w: int, i: int) -> None:
    if w > MAX_BITS:
        raise FixedWidthError(
            f"full-width fixed-point result ap_fixed<{w},{i}> needs more than {MAX_BITS} bits; "
            "declare a narrower type (a cast) before this operator")


class Fx:
    """Fixed-point tensor ``raw · 2^(shift - f)`` of C++ type ``ap_fixed<w, i>`` (see module doc)."""

    __slots__ = ("raw", "w", "i", "shift")

    def __init__(self, raw: Tensor, w: int, i: int, shift: Tensor | None = None) -> None:
        check_width(w, i)
        self.raw = as_raw(raw, w)
        self.w = w
        self.i = i
        self.shift = shift

    @property
    def f(self) -> int:
        return self.w - self.i

    @property
    def lsb(self) -> float:
        return 2.0**-self.f

    @property
    def shape(self) -> torch.Size:
        return self.raw.shape

    def __repr__(self) -> str:
        kind = "pseudo-float " if self.shift is not None else ""
        return f"Fx({kind}ap_fixed<{self.w},{self.i}>, shape={tuple(self.shape)})"

    def to_float(self) -> Tensor:
        """The exact values as float64 (exact while the raw integers have at most 53 bits)."""
        if self.shift is not None:
            return torch.ldexp(self.raw.to(torch.float64), (self.shift - self.f).to(torch.float64))
        # 0 + raw · 2^-f: a float64 raw may hold -0 (a product with 0), read out as +0
        return torch.add(_ZERO, self.raw.to(torch.float64), alpha=self.lsb)

    # -- shape operations (no arithmetic: the type is unchanged) ---------------------------

    def _reshaped(self, fn: Any) -> Fx:
        shift = None if self.shift is None else fn(self.shift.expand_as(self.raw))
        return Fx(fn(self.raw), self.w, self.i, shift)

    def __getitem__(self, idx: Any) -> Fx:
        return self._reshaped(lambda t: t[idx])

    def reshape(self, *shape: Any) -> Fx:
        return self._reshaped(lambda t: t.reshape(*shape))

    def unsqueeze(self, d: int) -> Fx:
        return self._reshaped(lambda t: t.unsqueeze(d))

    def transpose(self, a: int, b: int) -> Fx:
        return self._reshaped(lambda t: t.transpose(a, b))

    @property
    def mT(self) -> Fx:  # noqa: N802 - mirrors torch.Tensor.mT
        return self.transpose(-2, -1)

    def index_select(self, dim: int, index: Tensor) -> Fx:
        return self._reshaped(lambda t: t.index_select(dim, index))

    def gather(self, dim: int, index: Tensor) -> Fx:
        return self._reshaped(lambda t: t.gather(dim, index))

    # -- arithmetic -------------------------------------------------------------------------

    def _plain(self, op: str) -> None:
        if self.shift is not None:
            raise TypeError(f"{op} of a pseudo-float (normalized) value: cast it to a fixed type first")

    def aligned(self, f: int, w: int | None = None) -> Tensor:
        """Raw integers at ``f`` fractional bits (``f >= self.f``: appends zeros), in the dtype of
        a ``w``-bit type (default: just wide enough)."""
        self._plain("alignment")
        raw = as_raw(self.raw, self.w + f - self.f if w is None else w)
        if f == self.f:
            return raw
        return raw * 2.0 ** (f - self.f) if raw.is_floating_point() else raw << (f - self.f)

    def __add__(self, other: Fx) -> Fx:
        a, b, w, i = _fit_sum(self, other)
        return Fx(a.aligned(w - i, w) + b.aligned(w - i, w), w, i)

    def __sub__(self, other: Fx) -> Fx:
        a, b, w, i = _fit_sum(self, other)
        return Fx(a.aligned(w - i, w) - b.aligned(w - i, w), w, i)

    def __neg__(self) -> Fx:
        self._plain("negation")
        return Fx(-self.aligned(self.f, self.w + 1), self.w + 1, self.i + 1)

    def __mul__(self, other: Fx) -> Fx:
        a, b = _fit_product(self, other, MAX_BITS)
        shift = a.shift if b.shift is None else (b.shift if a.shift is None else a.shift + b.shift)
        w = a.w + b.w
        return Fx(as_raw(a.raw, w) * as_raw(b.raw, w), w, a.i + b.i, shift)

    def sum(self, dim: int | Sequence[int], keepdim: bool = False) -> Fx:
        self._plain("accumulation")
        dims = [dim] if isinstance(dim, int) else list(dim)
        extra = bits_for(math.prod(self.raw.shape[d] for d in dims))
        v = declare(self, MAX_BITS - extra)
        # every partial sum is bounded by the total's type, so a float64 sum is exact too
        return Fx(as_raw(v.raw, v.w + extra).sum(dims, keepdim=keepdim), v.w + extra, v.i + extra)

    def amax(self, dim: int, keepdim: bool = False) -> Fx:
        self._plain("max")
        return Fx(self.raw.amax(dim, keepdim=keepdim), self.w, self.i)

    def __matmul__(self, other: Fx) -> Fx:
        self._plain("matmul")
        other._plain("matmul")
        extra = bits_for(self.raw.shape[-1])
        a, b = _fit_product(self, other, MAX_BITS - extra)
        return Fx(exact_matmul(a.raw, b.raw, a.w, b.w), a.w + b.w + extra, a.i + b.i + extra)

    def __gt__(self, other: Fx) -> Tensor:  # type: ignore[override]
        w, i = common(self, other)
        return self.aligned(w - i, w) > other.aligned(w - i, w)



def declare(v: Fx, w: int) -> Fx:
    """``v`` declared as ``ap_fixed<w, I, RND, SAT>``: its integer bits, fewer fractional bits."""
    if v.w <= w:
        return v
    raw, _ = ApFixed(w, v.i, "RND", "SAT").requantize(v.raw, v.w - w)
    return Fx(raw, w, v.i, v.shift)


def _fit_product(a: Fx, b: Fx, limit: int) -> tuple[Fx, Fx]:
    """Operands whose product fits ``limit`` bits: the wider one narrowed first."""
    if a.w + b.w <= limit:
        return a, b
    half = limit // 2
    if a.w >= b.w:
        a = declare(a, max(limit - b.w, half))
    else:
        b = declare(b, max(limit - a.w, half))
    if a.w + b.w > limit:
        a = declare(a, half)
        b = declare(b, limit - a.w)
    return a, b


def _fit_sum(a: Fx, b: Fx) -> tuple[Fx, Fx, int, int]:
    """Operands of a sum that fits 64 bits, and the sum's ``(w, i)``."""
    i = max(a.i, b.i) + 1
    f_max = MAX_BITS - i
    a, b = declare(a, a.i + f_max), declare(b, b.i + f_max)
    return a, b, i + max(a.f, b.f), i


def common(*values: Fx) -> tuple[int, int]:
    """``(w, i)`` of a type that holds each of ``values`` exactly."""
    f = max(v.f for v in values)
    i = max(v.i for v in values)
    return i + f, i


def where(cond: Tensor, a: Fx, b: Fx) -> Fx:
    w, i = common(a, b)
    return Fx(torch.where(cond, a.aligned(w - i, w), b.aligned(w - i, w)), w, i)


def maximum(a: Fx, b: Fx) -> Fx:
    w, i = common(a, b)
    return Fx(torch.maximum(a.aligned(w - i, w), b.aligned(w - i, w)), w, i)


def cat(values: Sequence[Fx], dim: int) -> Fx:
    w, i = common(*values)
    return Fx(torch.cat([v.aligned(w - i, w) for v in values], dim), w, i)


def exact_matmul(a: Tensor, b: Tensor, wa: int, wb: int) -> Tensor:
    """``a @ b`` of integer tensors whose entries fit ``wa`` and ``wb`` signed bits, exactly:
    float64 (exact integers) when every partial sum fits 53 bits, else int64.

    Otherwise each operand is cut into limbs (low limbs unsigned, the top one signed) so that a
    limb product summed over K stays below 2^53; float64 BLAS then computes every partial
    product exactly and the limbs recombine in int64.
    """
    k = a.shape[-1]
    budget = EXACT_BITS - bits_for(k) - 1
    if wa + wb - 1 <= budget:
        return torch.matmul(a.to(torch.float64), b.to(torch.float64))
    if budget < 2:
        raise FixedWidthError(f"exact matmul with K={k} needs limbs below 1 bit")
    a, b = a.to(torch.int64), b.to(torch.int64)
    la = min(wa, budget // 2)
    lb = min(wb, budget - la)
    out = torch.zeros(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]),
                      dtype=torch.int64)
    for pa, limb_a in _limbs(a, wa, la):
        for pb, limb_b in _limbs(b, wb, lb):
            part = torch.matmul(limb_a.to(torch.float64), limb_b.to(torch.float64)).to(torch.int64)
            out += part << (pa + pb)
    return out


def _limbs(t: Tensor, width: int, size: int) -> list[tuple[int, Tensor]]:
    """``t = Σ limb << pos``: unsigned low limbs of ``size`` bits and a signed top limb."""
    limbs = []
    pos = 0
    while pos + size < width:
        limbs.append((pos, (t >> pos) & ((1 << size) - 1)))
        pos += size
    limbs.append((pos, t >> pos))
    return limbs
