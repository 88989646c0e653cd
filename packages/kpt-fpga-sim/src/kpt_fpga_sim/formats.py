"""Number formats of the simulator: IEEE ``float32``, ``ap_fixed<W,I,Q,O>`` and FP8 minifloats.

``ap_fixed<W, I, Q, O>`` follows Vitis HLS (UG1399): a signed two's-complement number of ``W`` bits,
``I`` of them (sign included) left of the binary point, so ``F = W - I`` fractional bits and one
LSB is ``2^-F``. A value ``v`` is stored as the integer ``raw = v · 2^F`` in
``[-2^(W-1), 2^(W-1) - 1]``. Assigning a wider value first quantizes (``Q``), then handles
overflow (``O``) of the quantized integer ``q``:

    Q: TRN floor · TRN_ZERO toward 0 · RND ties to +inf · RND_ZERO ties to 0 ·
       RND_MIN_INF ties to -inf · RND_INF ties away from 0 · RND_CONV ties to even
    O: WRAP keep the low W bits · SAT clamp · SAT_ZERO 0 on overflow ·
       SAT_SYM clamp to ±(2^(W-1) - 1) · WRAP_SM wrap, then flip the bits when the sign the
       wrap produced differs from the first dropped bit (sign-magnitude wrap)

Everything here is integer arithmetic on int64 tensors. A float input is split exactly into
``mantissa · 2^exponent`` (`torch.frexp`, 53-bit mantissa); float32/16 inputs of moderate size
take a shortcut through float64 steps that are exact for them (scaling by 2^F, floor,
remainder). No float rounding ever happens.

FP8 minifloats (`Minifloat`: ``e4m3fn``, ``e5m2``) round to nearest even and saturate.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import Tensor

Q_MODES = ("RND", "RND_ZERO", "RND_MIN_INF", "RND_INF", "RND_CONV", "TRN", "TRN_ZERO")
O_MODES = ("SAT", "SAT_ZERO", "SAT_SYM", "WRAP", "WRAP_SM")
MAX_WIDTH = 63
"""Widest format the int64 simulation quantizes into (the sign needs the 64th bit)."""
_NARROW_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Float32:
    """IEEE single precision with rounding after every operator, as HLS floating-point cores do."""

    name = "float32"

    def quantize(self, x: Tensor) -> Tensor:
        """The float32 values nearest to ``x`` (round to nearest even)."""
        return x.to(torch.float32)

    def __str__(self) -> str:
        return self.name


FLOAT32 = Float32()


@dataclass(frozen=True)
class ApFixed:
    """``ap_fixed<w, i, AP_q, AP_o>``; build it with `ap_fixed`."""

    w: int
    i: int
    q: str = "TRN"
    o: str = "WRAP"

    def __post_init__(self) -> None:
        if not 1 <= self.w <= MAX_WIDTH:
            raise ValueError(f"ap_fixed width W={self.w}: expected 1..{MAX_WIDTH}")
        if self.q not in Q_MODES:
            raise ValueError(f"ap_fixed quantization mode {self.q!r}: expected one of {Q_MODES}")
        if self.o not in O_MODES:
            raise ValueError(f"ap_fixed overflow mode {self.o!r}: expected one of {O_MODES}")

    @property
    def f(self) -> int:
        """Fractional bits."""
        return self.w - self.i

    @property
    def lsb(self) -> float:
        return 2.0 ** -self.f

    @property
    def max_raw(self) -> int:
        return (1 << (self.w - 1)) - 1

    @property
    def min_raw(self) -> int:
        return -(1 << (self.w - 1))

    @property
    def rounds(self) -> bool:
        """True for the RND modes (error at most ½ LSB), False for TRN modes (under 1 LSB)."""
        return self.q.startswith("RND")

    @property
    def name(self) -> str:
        return str(self)

    def __str__(self) -> str:
        return f"ap_fixed<{self.w},{self.i},AP_{self.q},AP_{self.o}>"

    def cpp(self) -> str:
        """The C++ type of this format."""
        return str(self)

    # -- conversions ----------------------------------------------------------------------

    def quantize(self, x: Tensor) -> Tensor:
        """The values (float64) this format stores for ``x``: ``ap_fixed<...> v = x``."""
        raw, _ = self.from_float(x)
        return self.to_float(raw)

    def from_float(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(raw, overflowed)`` for float input ``x``; NaN becomes 0 and counts as an overflow."""
        if x.dtype in _NARROW_FLOATS:
            # x · 2^F, its floor and the remainder are exact in float64 for these inputs below
            # 2^52 (at most 24 significant bits, none below 2^-149): the common case, cheaply
            scale = torch.tensor(float(self.f), dtype=torch.float64)
            scaled = torch.ldexp(x.detach().to(torch.float64), scale)
            low, high = torch.aminmax(scaled) if scaled.numel() else (scaled.new_zeros(()),) * 2
            if bool(low > -(2.0**52)) and bool(high < 2.0**52):
                floor = torch.floor(scaled)
                whole = floor.to(torch.int64)
                neg = scaled < 0
                return self._saturate(self._rounded(whole, scaled - floor, 0.5, neg), whole, neg)
        xd = x.detach().to(torch.float64)
        nan = torch.isnan(xd)
        # an infinity behaves as the largest double: it overflows every format the same way
        mant, exp = torch.frexp(torch.nan_to_num(xd, nan=0.0))
        # x = mant · 2^exp exactly, mant in ±[0.5, 1): a 53-bit integer times 2^(exp - 53)
        m = torch.ldexp(mant, torch.full_like(exp, 53)).to(torch.int64)
        raw, over = self.requantize(m, 53 - exp.to(torch.int64) - self.f)
        return raw, over | nan

    def to_float(self, raw: Tensor) -> Tensor:
        """Exact float64 values of raw integers of this format."""
        return torch.ldexp(raw.to(torch.float64), torch.tensor(-self.f, dtype=torch.float64))

    def requantize(self, raw: Tensor, shift: Tensor | int) -> tuple[Tensor, Tensor]:
        """Assign ``raw · 2^-shift`` (in LSBs of this format) to this format: ``(raw, overflowed)``.

        ``shift > 0`` drops bits (quantization mode), ``shift < 0`` appends zeros; ``shift`` may
        be a tensor (one shift per element, as a normalizing shifter has; then the raw integers
        have at most 53 significant bits where the shift exceeds 62).
        """
        raw = raw.to(torch.int64)
        neg = raw < 0
        if isinstance(shift, Tensor):
            least, most = (int(v) for v in torch.aminmax(shift)) if shift.numel() else (0, 0)
        else:
            least = most = shift
        if 0 < least and most <= 62:
            floor = raw >> shift
            rem = raw - (floor << shift)
            half = (1 << (shift - 1)) if isinstance(shift, int) else torch.ones_like(shift) << (shift - 1)
            return self._saturate(self._rounded(floor, rem, half, neg), floor, neg)
        if -62 <= least and most <= 0:
            # appending k zeros leaves int64 unless the bits above 63 - k are all sign bits
            top = raw >> (63 + shift)
            q = raw << -shift
            return self._saturate(q, q, neg, (top != 0) & (top != -1))
        s = torch.as_tensor(shift, dtype=torch.int64)
        right = s.clamp(0, 62)   # for s >= 55 any 53-bit input is below ¼ LSB: 62 decides alike
        left = (-s).clamp(0, 63)
        floor = raw >> right
        rem = raw - (floor << right)
        # without dropped bits rem is 0: a half of 1 keeps every mode from rounding up
        half = torch.where(right > 0, (torch.ones_like(right) << right) >> 1, 1)
        q = self._rounded(floor, rem, half, neg)
        shifted = torch.where(left >= 63, torch.zeros_like(q), q << left)
        huge = (left > 0) & ((shifted >> left) != q) & (q != 0)
        dropped = torch.where(left >= 63, torch.zeros_like(floor), floor << left)
        return self._saturate(shifted, dropped, neg, huge)

    def _rounded(self, floor: Tensor, rem: Tensor, half: Tensor | float, neg: Tensor) -> Tensor:
        """``floor`` plus the quantization mode's increment: ``rem`` is the dropped part (in the
        units where ½ LSB is ``half``), ``neg`` the sign of the value."""
        q = self.q
        if q == "TRN":
            return floor
        if q == "TRN_ZERO":
            inc = neg & (rem != 0)
        elif q == "RND":
            inc = rem >= half
        elif q == "RND_MIN_INF":
            inc = rem > half
        elif q == "RND_ZERO":
            inc = torch.where(neg, rem >= half, rem > half)
        elif q == "RND_INF":
            inc = torch.where(neg, rem > half, rem >= half)
        else:  # RND_CONV: ties to even
            inc = (rem > half) | ((rem == half) & ((floor & 1) == 1))
        return floor + inc

    def _saturate(self, q: Tensor, floor: Tensor, neg: Tensor,
                  huge: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The overflow mode applied to the quantized integers ``q`` (``floor``: before the
        rounding increment; ``huge``: values known to lie beyond int64)."""
        lo, hi = self.min_raw, self.max_raw
        low, high = torch.aminmax(q) if q.numel() else (lo + 1, hi)
        if huge is None and lo < low and high <= hi:
            return q, torch.zeros(q.shape, dtype=torch.bool)
        over = (q > hi) | (q < lo)
        if huge is not None:
            over = over | huge
        if self.o == "SAT_SYM":
            over = over | (q == lo)
        if self.o == "SAT":
            out = torch.where(neg, lo, hi)
        elif self.o == "SAT_SYM":
            out = torch.where(neg, -hi, hi)
        elif self.o == "SAT_ZERO":
            out = torch.zeros_like(q)
        else:
            out = self._wrap(q)
            if self.o == "WRAP_SM":
                # the first dropped bit, taken before the rounding increment (as ap_fixed does)
                ld = ((floor >> self.w) & 1).to(torch.bool)
                flip = ld != (out < 0)
                mag = (~out) & hi
                out = torch.where(flip, mag - ld.to(torch.int64) * (hi + 1), out)
        return torch.where(over, out, q), over

    def _wrap(self, q: Tensor) -> Tensor:
        """The low ``w`` bits of ``q`` read as a signed number."""
        half = 1 << (self.w - 1)
        return ((q + half) & ((1 << self.w) - 1)) - half


def ap_fixed(w: int, i: int, q: str = "TRN", o: str = "WRAP") -> ApFixed:
    """The format ``ap_fixed<w, i, AP_q, AP_o>`` (``q``/``o`` with or without the ``AP_`` prefix).

    >>> float(ap_fixed(3, 2, "RND").quantize(torch.tensor(1.25)))
    1.5
    """
    return ApFixed(w, i, q.upper().removeprefix("AP_"), o.upper().removeprefix("AP_"))


@dataclass(frozen=True)
class Minifloat:
    """An FP8 format: ``exp_bits`` exponent bits, ``man_bits`` mantissa bits, saturating RNE."""

    name: str
    exp_bits: int
    man_bits: int
    max: float
    dtype: torch.dtype

    @property
    def min_exponent(self) -> int:
        """Exponent of the smallest normal number (subnormals share its quantum)."""
        return 2 - (1 << (self.exp_bits - 1))

    def quantize(self, x: Tensor) -> Tensor:
        """Round ``x`` to this format (nearest, ties to even), saturating at ``±max``.

        Works in x's precision (float32 at least): scaling by a power of two and rounding to an
        integer are exact there, so the only rounding is the format's own.
        """
        xd = x if x.dtype in (torch.float32, torch.float64) else x.to(torch.float32)
        _, e = torch.frexp(xd)
        quantum = torch.clamp(e - 1, min=self.min_exponent) - self.man_bits
        q = torch.ldexp(torch.round(torch.ldexp(xd, -quantum)), quantum)
        return q.clamp(-self.max, self.max)


E4M3FN = Minifloat("float8_e4m3fn", 4, 3, 448.0, torch.float8_e4m3fn)
E5M2 = Minifloat("float8_e5m2", 5, 2, 57344.0, torch.float8_e5m2)
MINIFLOATS = {f.dtype: f for f in (E4M3FN, E5M2)}

Format = Float32 | ApFixed

_FORMAT_TEXT = re.compile(r"ap_fixed\s*<\s*(\d+)\s*,\s*(-?\d+)\s*(?:,\s*(\w+)\s*)?(?:,\s*(\w+)\s*)?>")


def parse_format(text: str) -> Format:
    """``"float32"`` or ``"ap_fixed<16,6>"`` / ``"ap_fixed<16,6,RND,SAT>"`` (AP_ prefixes optional)."""
    text = text.strip()
    if text == "float32":
        return FLOAT32
    m = _FORMAT_TEXT.fullmatch(text)
    if not m:
        raise ValueError(f"number format {text!r}: expected 'float32' or 'ap_fixed<W,I[,Q[,O]]>'")
    return ap_fixed(int(m[1]), int(m[2]), m[3] or "TRN", m[4] or "WRAP")
