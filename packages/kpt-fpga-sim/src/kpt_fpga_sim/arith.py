"""The two number systems a kernel body computes in; a body is written once for both.

A body loads its inputs (``a.load``), computes with Python operators (``+ - * @``, ``.sum``,
``.amax``, indexing) and the function units of ``a`` (``a.exp``...), declares intermediate
types where an HLS design stores a value (``a.cast``) and reads results out (``a.out``).

* `Float32Arith`: values are float32 tensors; torch rounds after every operator, as HLS
  floating-point cores do. Function units are the float32 math library (about 1 ULP, the
  accuracy the HLS math library states for its single-precision functions). Accumulations run
  as partial sums combined in a tree, the order a design uses to keep II = 1.
* `FixedArith`: values are `kpt_fpga_sim.fixed.Fx` in the declared ``ap_fixed`` data format;
  operators keep full width, ``cast`` quantizes to the data format and counts overflows, the
  function units are the interpolated tables of `kpt_fpga_sim.nonlinear`.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from . import fixed
from .fixed import Fx, bits_for
from .formats import FLOAT32, ApFixed
from .nonlinear import GUARD_BITS, Table, bit_length, tables_for

CONST_BITS = 18
"""Constants are stored with 18 significant bits: one operand port of a DSP48 multiplier."""


class Float32Arith:
    """float32 mode: IEEE single precision, rounded after every operator."""

    format = FLOAT32
    wide = None

    def __init__(self) -> None:
        self.overflows: Counter[str] = Counter()

    def load(self, t: Tensor, name: str = "", fmt: object = None) -> Tensor:
        return t.to(torch.float32)

    def load_scale(self, t: Tensor) -> Tensor:
        return t.to(torch.float32)

    def const(self, c: float) -> Tensor:
        return torch.tensor(c, dtype=torch.float32)

    def count(self, n: Tensor) -> Tensor:
        return n.to(torch.float32)

    @property
    def lowest(self) -> Tensor:
        """Below every score: what a masked score is replaced by before a maximum."""
        return torch.tensor(-math.inf)

    def cast(self, v: Tensor, name: str = "", fmt: object = None) -> Tensor:
        return v

    def grown(self, n: int, fmt: object = None) -> None:
        return None

    def out(self, v: Tensor, dtype: torch.dtype) -> Tensor:
        """A new contiguous tensor of ``dtype`` (never an input or a view of one)."""
        return v.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)

    exp = staticmethod(torch.exp)
    log = staticmethod(torch.log)
    rsqrt = staticmethod(torch.rsqrt)
    recip = staticmethod(torch.reciprocal)
    sigmoid = staticmethod(torch.sigmoid)
    tanh = staticmethod(torch.tanh)
    erf = staticmethod(torch.erf)
    erfc = staticmethod(torch.erfc)
    where = staticmethod(torch.where)
    maximum = staticmethod(torch.maximum)
    cat = staticmethod(torch.cat)


class FixedArith:
    """``ap_fixed`` mode: integer-exact full-width arithmetic, declared types, table functions."""

    def __init__(self, fmt: ApFixed) -> None:
        self.format = fmt
        self.wide = ApFixed(fmt.w + GUARD_BITS, fmt.i, "RND", "SAT")
        """The data format with the function units' guard bits: statistics, normalized rows."""
        self.overflows: Counter[str] = Counter()
        self.tables: dict[str, Table] = tables_for(fmt.f)

    def _count(self, name: str, over: Tensor) -> None:
        n = int(over.sum())
        if n:
            self.overflows[name or "?"] += n

    def load(self, t: Tensor, name: str = "", fmt: ApFixed | None = None) -> Fx:
        """Quantize a float input to the data format or ``fmt`` (overflows counted under ``name``)."""
        fmt = fmt or self.format
        raw, over = fmt.from_float(t)
        self._count(name, over)
        return Fx(raw, *fmt.container)

    def load_scale(self, t: Tensor) -> Fx:
        """A saved float32 ``rstd`` read back as a pseudo-float with the rsqrt unit's mantissa
        (exact for the values the unit produced)."""
        f = self.tables["rsqrt"].f_out
        mant, e = torch.frexp(t.to(torch.float64))
        raw = torch.round(torch.ldexp(mant, torch.tensor(float(f), dtype=torch.float64)))
        return Fx(raw, f + 2, 2, e.to(torch.int64))

    def const(self, c: float) -> Fx:
        """A synthesis-time constant: 18 significant bits (RND), trailing zero bits dropped."""
        return _constant(c)

    def count(self, n: Tensor) -> Fx:
        """A runtime integer (a row count) as ``ap_fixed<33, 33>``."""
        return Fx(n.to(torch.int64), 33, 33)

    @property
    def lowest(self) -> Fx:
        """The most negative value of the wide format, below every score declared in it."""
        return Fx(torch.tensor(self.wide.min_raw), self.wide.w, self.wide.i)

    def grown(self, n: int, fmt: ApFixed | None = None) -> ApFixed:
        """The data format (or ``fmt``) widened by the growth of a sum of ``n`` terms (⌈log2 n⌉
        integer bits): the declared type of a reduction over rows (a parameter gradient, a summed
        loss) or of a dot product of unit-scale data (which grows like √n)."""
        fmt = fmt or self.format
        g = bits_for(n)
        return replace(fmt, w=fmt.w + g, i=fmt.i + g)

    def cast(self, v: Fx, name: str = "", fmt: ApFixed | None = None) -> Fx:
        """Assign ``v`` to a declared type (default: the data format), counting overflows."""
        fmt = fmt or self.format
        shift = v.f - fmt.f if v.shift is None else v.f - fmt.f - v.shift
        raw, over = fmt.requantize(v.raw, shift)
        self._count(name, over)
        return Fx(raw, *fmt.container)

    def out(self, v: Fx, dtype: torch.dtype) -> Tensor:
        if dtype == torch.float32 and v.w <= 24 and v.shift is None:
            # exact in float32 from the start; + 0 reads a -0 (a product with 0) out as +0
            return v.raw.to(dtype, memory_format=torch.contiguous_format, copy=True).mul_(v.lsb).add_(0.0)
        return v.to_float().to(dtype=dtype, memory_format=torch.contiguous_format)

    # -- function units -------------------------------------------------------------------

    def _table(self, name: str, v: Fx) -> Fx:
        table = self.tables[name]
        out = table.output_format
        if v.f <= table.f_in:
            # nothing to round: the unit's clamp to its domain includes the input format's saturation
            return Fx(table(v.aligned(v.f), v.f), out.w, out.i)
        # saturating at the table's input range is the function's own saturation, not an overflow
        x, _ = table.input_format.requantize(v.aligned(v.f), v.f - table.f_in)
        return Fx(table(x), out.w, out.i)

    def exp(self, v: Fx) -> Fx:
        """``exp`` of arguments ≤ 0 (max-subtracted); a positive argument is an overflow."""
        if v.raw.numel() and bool(v.raw.max() > 0):
            self._count("exp argument > 0", v.raw > 0)
        return self._table("exp", v)

    def sigmoid(self, v: Fx) -> Fx:
        return self._table("sigmoid", v)

    def tanh(self, v: Fx) -> Fx:
        return self._table("tanh", v)

    def erf(self, v: Fx) -> Fx:
        return self._table("erf", v)

    def erfc(self, v: Fx) -> Fx:
        return self.const(1.0) - self.erf(v)

    def _normalize(self, v: Fx, name: str, even: bool) -> tuple[Tensor, Tensor, Fx]:
        """``|v| = m · 2^e`` with ``m`` in [1, 2) ([1, 4) and even ``e`` when ``even``): the sign,
        ``e``, and the table of ``name`` applied to ``m``. A zero is an overflow (and gives m=1)."""
        v.aligned(v.f)  # refuses a pseudo-float operand
        self._count(f"{name} of 0", v.raw == 0)
        mag = v.raw.abs()
        top = bit_length(mag) - 1                      # position of the leading one
        e = top - v.f
        if even:
            odd = (e & 1) == 1
            e = e - odd.to(torch.int64)
        table = self.tables[name]
        m_raw, _ = table.input_format.requantize(mag, v.f + e - table.f_in)
        m_raw = torch.where(mag == 0, 1 << table.f_in, m_raw)
        m = Fx(table(m_raw), table.output_format.w, table.output_format.i)
        return v.raw < 0, torch.where(mag == 0, 0, e), m

    def rsqrt(self, v: Fx) -> Fx:
        """``rsqrt(v)`` for ``v > 0`` as a pseudo-float: the table's mantissa times ``2^(-e/2)``."""
        _, e, m = self._normalize(v, "rsqrt", even=True)
        return Fx(m.raw, m.w, m.i, -(e >> 1))

    def recip(self, v: Fx) -> Fx:
        """``1/v`` (v ≠ 0) as a pseudo-float: ``±(1/m) · 2^-e``."""
        neg, e, m = self._normalize(v, "recip", even=False)
        return Fx(torch.where(neg, -m.raw, m.raw), m.w + 1, m.i + 1, -e)

    def log(self, v: Fx) -> Fx:
        """``ln v`` for ``v > 0``: ``ln m + e · ln 2`` (full width)."""
        _, e, m = self._normalize(v, "log", even=False)
        return m + Fx(e, 8, 8) * self.const(math.log(2.0))

    where = staticmethod(fixed.where)
    maximum = staticmethod(fixed.maximum)
    cat = staticmethod(fixed.cat)


@functools.lru_cache(maxsize=1024)
def _constant(c: float) -> Fx:
    """`FixedArith.const`, made once per value (an ``Fx`` is never written to)."""
    if c == 0:
        return Fx(torch.tensor(0), 1, 1)
    i = math.frexp(abs(c))[1] + 1
    raw, _ = ApFixed(CONST_BITS, i, "RND", "SAT").from_float(torch.tensor(c, dtype=torch.float64))
    n = int(raw)
    zeros = (n & -n).bit_length() - 1
    n >>= zeros
    f = CONST_BITS - i - zeros
    w = (n if n >= 0 else ~n).bit_length() + 1
    return Fx(torch.tensor(n), w, w - f)


Arith = Float32Arith | FixedArith


def make_arith(fmt: Any) -> Arith:
    return FixedArith(fmt) if isinstance(fmt, ApFixed) else Float32Arith()

