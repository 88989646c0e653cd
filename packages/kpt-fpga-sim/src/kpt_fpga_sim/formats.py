"""Number formats of the simulator: IEEE ``float32``, ``ap_fixed<W,I,Q,O>``, ``ap_ufixed<W,I,Q,O>``,
QKeras' quantizers as the ap types they stand for, and FP8 minifloats.

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

``ap_ufixed<W, I, Q, O>`` is the unsigned twin: ``raw`` in ``[0, 2^W - 1]``, ``I`` integer bits
(no sign). Quantization is the same; on overflow WRAP keeps the low W bits (modulo 2^W), SAT_ZERO
gives 0, SAT and SAT_SYM clamp to ``[0, 2^W - 1]``; WRAP_SM is refused (as the ap_types headers
refuse it).

QKeras' quantizers name the same formats (`parse_format`), with the rounding (to nearest, ties
to even: ``tf.round``) and clipping they apply:
``quantized_bits(bits, integer, keep_negative=1, alpha=1)`` is
``ap_fixed<bits, integer + 1, AP_RND_CONV, AP_SAT>`` (``integer`` bits besides the sign), or with
``keep_negative=0`` ``ap_ufixed<bits, integer, AP_RND_CONV, AP_SAT>``;
``quantized_relu(bits, integer)`` is ``ap_ufixed<bits, integer, AP_RND_CONV, AP_SAT>``. These are
the types hls4ml's ``config_from_keras_model`` gives QKeras activations, except that hls4ml
types an unsigned ``quantized_bits`` as signed ``ap_fixed<bits, integer + 1>`` (one fractional
bit fewer than QKeras keeps); here it keeps QKeras' values.

Raw integers are exact: a format of at most 53 bits keeps them in float64 tensors (every
integer below 2^53 is a float64, and the operators the simulator uses on them -- sums, products,
scaling by powers of two, floor, remainder -- are exact there, in one vectorized pass each); a
wider format keeps them in int64 (`raw_dtype`). Quantizing a value is computing, exactly, the
value in LSBs of the format (``raw · 2^-shift``, or a float input times ``2^F``), its floor and
the dropped fraction. No float rounding ever happens.

FP8 minifloats (`Minifloat`: ``e4m3fn``, ``e5m2``) round to nearest even and saturate.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

Q_MODES = ("RND", "RND_ZERO", "RND_MIN_INF", "RND_INF", "RND_CONV", "TRN", "TRN_ZERO")
O_MODES = ("SAT", "SAT_ZERO", "SAT_SYM", "WRAP", "WRAP_SM")
MAX_WIDTH = 63
"""Widest format the int64 simulation quantizes into (the sign needs the 64th bit)."""
EXACT_BITS = 53
"""Widest integers float64 holds exactly (its significand)."""
_NARROW_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def raw_dtype(w: int) -> torch.dtype:
    """The dtype of the raw integers of a ``w``-bit type: float64 up to 53 bits, else int64."""
    return torch.float64 if w <= EXACT_BITS else torch.int64


def as_raw(t: Tensor, w: int) -> Tensor:
    """The integers ``t`` in the `raw_dtype` of a ``w``-bit type (``t`` itself if they are)."""
    dtype = raw_dtype(w)
    return t if t.dtype == dtype else t.to(dtype)


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
    """``ap_fixed<w, i, AP_q, AP_o>`` or, with ``signed=False``, ``ap_ufixed<w, i, AP_q, AP_o>``;
    build it with `ap_fixed` or `ap_ufixed`."""

    w: int
    i: int
    q: str = "TRN"
    o: str = "WRAP"
    signed: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.w <= MAX_WIDTH:
            raise ValueError(f"{self.kind} width W={self.w}: expected 1..{MAX_WIDTH}")
        if self.q not in Q_MODES:
            raise ValueError(f"{self.kind} quantization mode {self.q!r}: expected one of {Q_MODES}")
        if self.o not in O_MODES:
            raise ValueError(f"{self.kind} overflow mode {self.o!r}: expected one of {O_MODES}")
        if not self.signed and self.o == "WRAP_SM":
            raise ValueError(f"{self}: an unsigned type has no sign-magnitude wrap (the ap_types headers refuse it)")

    @property
    def kind(self) -> str:
        """``ap_fixed`` or ``ap_ufixed``."""
        return "ap_fixed" if self.signed else "ap_ufixed"

    @property
    def overflow(self) -> str:
        """The overflow mode as the headers apply it: SAT_SYM of an unsigned type is SAT."""
        return "SAT" if not self.signed and self.o == "SAT_SYM" else self.o

    @property
    def container(self) -> tuple[int, int]:
        """``(w, i)`` of the narrowest signed type holding every value: this one's, or one bit
        wider for an unsigned type (as C++ widens an ``ap_ufixed`` operand of signed arithmetic)."""
        return (self.w, self.i) if self.signed else (self.w + 1, self.i + 1)

    @property
    def f(self) -> int:
        """Fractional bits."""
        return self.w - self.i

    @property
    def lsb(self) -> float:
        return 2.0 ** -self.f

    @property
    def max_raw(self) -> int:
        return (1 << (self.w - self.signed)) - 1

    @property
    def min_raw(self) -> int:
        return -(1 << (self.w - 1)) if self.signed else 0

    @property
    def rounds(self) -> bool:
        """True for the RND modes (error at most ½ LSB), False for TRN modes (under 1 LSB)."""
        return self.q.startswith("RND")

    @property
    def name(self) -> str:
        return str(self)

    def __str__(self) -> str:
        return f"{self.kind}<{self.w},{self.i},AP_{self.q},AP_{self.o}>"

    def cpp(self) -> str:
        """The C++ type of this format."""
        return str(self)

    # -- conversions ----------------------------------------------------------------------

    def quantize(self, x: Tensor) -> Tensor:
        """The values (float64) this format stores for ``x``: ``ap_fixed<...> v = x``."""
        raw, _ = self.from_float(x)
        return self.to_float(raw)

    def from_float(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(raw, overflowed)`` for float input ``x`` (as `requantize`); NaN becomes 0 and counts
        as an overflow."""
        y = x.detach().to(torch.float64, copy=True).mul_(2.0**self.f)
        low, high = _extremes(y)
        # the common case: x · 2^F below 2^52 (NaN is not) and exact (no underflow: a float32
        # source, or F >= 0); with at most 24 significant bits it has no bit below 2^-53 either
        if -(2.0**52) < low and high < 2.0**52 and (self.f >= 0 or x.dtype in _NARROW_FLOATS):
            return self._quantize(y, fine=x.dtype in _NARROW_FLOATS, extremes=(low, high))
        xd = x.detach().to(torch.float64)
        nan = torch.isnan(xd)
        # an infinity behaves as the largest double: it overflows every format the same way
        mant, exp = torch.frexp(torch.nan_to_num(xd, nan=0.0))
        # x = mant · 2^exp exactly, mant in ±[0.5, 1): a 53-bit integer times 2^(exp - 53)
        m = torch.ldexp(mant, torch.full_like(exp, 53)).to(torch.int64)
        raw, over = self.requantize(m, 53 - exp.to(torch.int64) - self.f)
        return raw, over | nan if bool(nan.any()) else over

    def to_float(self, raw: Tensor) -> Tensor:
        """Exact float64 values of raw integers of this format."""
        return torch.ldexp(raw.to(torch.float64), torch.tensor(-self.f, dtype=torch.float64))

    def requantize(self, raw: Tensor, shift: Tensor | int) -> tuple[Tensor, Tensor]:
        """Assign ``raw · 2^-shift`` (in LSBs of this format) to this format: ``(raw, overflowed)``,
        ``raw`` of `raw_dtype`, ``overflowed`` the mask of the overflowed elements, or a 0-dim
        False when there is none (counting it then costs no pass over the data).

        ``raw`` holds integers: float64 ones below 2^53, or int64. ``shift > 0`` drops bits
        (quantization mode), ``shift < 0`` appends zeros; ``shift`` may be a tensor (one shift
        per element, as a normalizing shifter has; then int64 raw integers have at most 53
        significant bits where the shift exceeds 62).
        """
        if raw.is_floating_point():
            # raw · 2^-shift is exact in float64 (a power of two only moves the exponent)
            if isinstance(shift, int):
                # an integral value is never written to: it may be ``raw`` itself
                y = raw if shift == 0 else raw * 2.0**-shift
                return self._quantize(y, integral=shift <= 0, fine=shift <= EXACT_BITS - 1)
            most = shift.max().item() if shift.numel() else 0
            return self._quantize(torch.ldexp(raw, (-shift).to(torch.float64)), fine=most <= EXACT_BITS - 1)
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

    def _quantize(self, y: Tensor, integral: bool = False, fine: bool = False,
                  extremes: tuple[float, float] | None = None) -> tuple[Tensor, Tensor]:
        """The value ``y`` (float64, exact, in LSBs of this format; a temporary, rounded in place)
        assigned to this format. ``integral``: ``y`` holds integers; ``fine``: ``y`` has no bit
        below 2^-53, so that ``y + ½`` is exact below 2^52; ``extremes``: y's, when known."""
        low, high = extremes or _extremes(y)
        bounds = (low - 1, high + 1)      # rounding moves a value by less than 1
        if integral:
            return self._saturate(y, y, bounds=bounds)
        if fine and -(2.0**52) < low and high < 2.0**52 and self.q == "RND" and self.o != "WRAP_SM":
            return self._saturate(y.add_(0.5).floor_(), None, bounds=bounds)
        floor = torch.floor(y)
        if self.q == "TRN":
            return self._saturate(floor, floor, bounds=bounds)
        return self._saturate(self._rounded(floor, y - floor, 0.5, y < 0), floor, bounds=bounds)

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
            inc = (rem > half) | ((rem == half) & (_floor_shift(floor, 0, 1) == 1))
        return floor + inc.to(floor.dtype)

    def _saturate(self, q: Tensor, floor: Tensor | None, neg: Tensor | None = None,
                  huge: Tensor | None = None, bounds: tuple[float, float] | None = None) -> tuple[Tensor, Tensor]:
        """The overflow mode applied to the quantized integers ``q`` (``floor``: before the
        rounding increment, needed by WRAP_SM; ``neg``: the sign of the values, by default that
        of ``q``; ``huge``: values known to lie beyond int64; ``bounds``: known bounds of ``q``),
        in this format's `raw_dtype`."""
        lo, hi, dtype = self.min_raw, self.max_raw, raw_dtype(self.w)
        low, high = bounds or _extremes(q)
        # Python compares its floats and ints exactly
        if lo < low and high <= hi and (huge is None or not bool(huge.any())):
            return as_raw(q, self.w), torch.zeros((), dtype=torch.bool)
        over = (q > hi) | (q < lo)
        if huge is not None:
            over = over | huge
        o = self.overflow
        if o == "SAT_SYM":
            over = over | (q == lo)
        neg = q < 0 if neg is None else neg
        if o == "SAT":
            out = torch.where(neg, lo, hi)
        elif o == "SAT_SYM":
            out = torch.where(neg, -hi, hi)
        elif o == "SAT_ZERO":
            out = torch.zeros(q.shape, dtype=dtype)
        else:
            out = self._wrap(q).to(dtype)
            if o == "WRAP_SM":
                assert floor is not None  # given in every call that can wrap sign-magnitude
                # the first dropped bit, taken before the rounding increment (as ap_fixed does)
                ld = _floor_shift(floor, self.w, 1) == 1
                flip = ld != (out < 0)
                mag = torch.remainder(-out - 1, hi + 1)      # (~out) & hi
                out = torch.where(flip, torch.where(ld, mag - (hi + 1), mag), out)
        # overflowed q may not fit the raw dtype: zeroed before the cast, then replaced by out
        return torch.where(over, out.to(dtype), torch.where(over, 0, q).to(dtype)), over

    def _wrap(self, q: Tensor) -> Tensor:
        """The low ``w`` bits of ``q`` read as a number of this type's signedness."""
        if not q.is_floating_point():
            half = 1 << (self.w - 1) if self.signed else 0
            return ((q + half) & ((1 << self.w) - 1)) - half
        # exact for any float64, even one too large for ``q + 2^(w-1)`` to be exact
        low = torch.remainder(q, 2.0**self.w)
        if not self.signed:
            return low
        return torch.where(low >= 2.0 ** (self.w - 1), low - 2.0**self.w, low)


def _extremes(t: Tensor) -> tuple[float, float]:
    """The least and the largest element of ``t`` (NaN if it holds one; 0 for an empty one)."""
    if not t.numel():
        return 0.0, 0.0
    low, high = torch.aminmax(t)
    return low.item(), high.item()


def _floor_shift(t: Tensor, k: int, bits: int) -> Tensor:
    """The ``bits`` bits of the integers ``t`` from bit ``k`` up: ``floor(t / 2^k) mod 2^bits``."""
    shifted = t >> k if not t.is_floating_point() else torch.floor(t * 2.0**-k)
    return torch.remainder(shifted, 1 << bits)


def ap_fixed(w: int, i: int, q: str = "TRN", o: str = "WRAP") -> ApFixed:
    """The format ``ap_fixed<w, i, AP_q, AP_o>`` (``q``/``o`` with or without the ``AP_`` prefix).

    >>> float(ap_fixed(3, 2, "RND").quantize(torch.tensor(1.25)))
    1.5
    """
    return ApFixed(w, i, q.upper().removeprefix("AP_"), o.upper().removeprefix("AP_"))


def ap_ufixed(w: int, i: int, q: str = "TRN", o: str = "WRAP") -> ApFixed:
    """The unsigned format ``ap_ufixed<w, i, AP_q, AP_o>`` (``q``/``o`` as for `ap_fixed`).

    >>> float(ap_ufixed(6, 0, "RND_CONV", "SAT").quantize(torch.tensor(-0.5)))
    0.0
    """
    return replace(ap_fixed(w, i, q, o), signed=False)


def quantized_bits(bits: int, integer: int = 0, keep_negative: bool = True, alpha: float = 1) -> ApFixed:
    """The ap type of QKeras' ``quantized_bits``: ``integer`` bits left of the point besides the
    sign (kept when ``keep_negative``), round to nearest even, clip.

    >>> str(quantized_bits(8, 3))
    'ap_fixed<8,4,AP_RND_CONV,AP_SAT>'
    """
    if alpha != 1:
        raise ValueError(f"quantized_bits alpha={alpha!r}: only alpha=1 is a fixed-point format "
                         "(another alpha scales every value)")
    if keep_negative:
        return ap_fixed(bits, integer + 1, "RND_CONV", "SAT")
    return ap_ufixed(bits, integer, "RND_CONV", "SAT")


def quantized_relu(bits: int, integer: int = 0) -> ApFixed:
    """The ap type of QKeras' ``quantized_relu`` (negative_slope 0): unsigned, ``integer`` bits
    left of the point, round to nearest even, clip."""
    return ap_ufixed(bits, integer, "RND_CONV", "SAT")


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

_FORMAT_TEXT = re.compile(r"(ap_u?fixed)\s*<\s*(\d+)\s*,\s*(-?\d+)\s*(?:,\s*(\w+)\s*)?(?:,\s*(\w+)\s*)?>")
_QUANTIZER_TEXT = re.compile(r"(quantized_bits|quantized_relu)\s*\((.*)\)", re.DOTALL)
_QUANTIZERS: dict[str, tuple[Callable[..., ApFixed], tuple[str, ...]]] = {
    "quantized_bits": (quantized_bits, ("bits", "integer", "keep_negative", "alpha")),
    "quantized_relu": (quantized_relu, ("bits", "integer")),
}
_EXPECTED = ("'float32', 'ap_fixed<W,I[,Q[,O]]>', 'ap_ufixed<W,I[,Q[,O]]>', "
             "'quantized_bits(bits, integer[, keep_negative[, alpha]])' or 'quantized_relu(bits, integer)'")


def parse_format(text: str) -> Format:
    """A format from its name: ``"float32"``; ``"ap_fixed<16,6>"``, ``"ap_ufixed<8,0,RND,SAT>"``
    (AP_ prefixes optional); or a QKeras quantizer, ``"quantized_bits(6, 0, alpha=1)"``,
    ``"quantized_relu(6, 0)"`` (positional or keyword arguments, as in Python)."""
    text = text.strip()
    if text == "float32":
        return FLOAT32
    m = _FORMAT_TEXT.fullmatch(text)
    if m:
        build = ap_fixed if m[1] == "ap_fixed" else ap_ufixed
        return build(int(m[2]), int(m[3]), m[4] or "TRN", m[5] or "WRAP")
    m = _QUANTIZER_TEXT.fullmatch(text)
    if not m:
        raise ValueError(f"number format {text!r}: expected {_EXPECTED}")
    quantizer, names = _QUANTIZERS[m[1]]
    return quantizer(**_arguments(text, m[2], names))


def _arguments(text: str, args: str, names: tuple[str, ...]) -> dict[str, float]:
    """The numeric arguments of a quantizer call, by name."""
    out: dict[str, float] = {}
    for n, part in enumerate(a.strip() for a in args.split(",") if a.strip()):
        name, eq, value = part.rpartition("=")
        name = name.strip() if eq else (names[n] if n < len(names) else "")
        if name not in names or name in out:
            raise ValueError(f"number format {text!r}: argument {part!r}: expected {', '.join(names)}, each once")
        try:
            number = float({"True": 1, "False": 0}.get(value.strip(), value))
        except ValueError:
            raise ValueError(f"number format {text!r}: argument {part!r} is not a number") from None
        if name != "alpha" and number != int(number):
            raise ValueError(f"number format {text!r}: {name} must be an integer, got {value.strip()}")
        out[name] = number if name == "alpha" else int(number)
    if "bits" not in out:
        raise ValueError(f"number format {text!r}: bits is required")
    return out
