"""What one multiply costs, from its operands: the rule a constant-weight design is costed by.

HLS tools look at the operands before choosing hardware for a product. With the weight a
constant known at synthesis (an hls4ml-style latency design, reuse factor 1):

* a **zero** weight removes the product and its adder input (constant propagation);
* a **power of two** (±2^k) is a shift: wiring, no logic;
* a constant with **two nonzero digits** in canonical signed-digit form (non-adjacent form,
  e.g. 96 = 2^7 − 2^5, 5 = 2^2 + 2^0) becomes a shift and one add or subtract: an adder of the
  product's width in LUTs;
* any other constant takes a **DSP slice** — ``⌈Wx / A⌉ · ⌈Wc / B⌉`` of them for an A×B
  multiplier port (DSP48E2: 27×18, DSP48E1: 25×18), Wc the constant's significant bits with
  its sign — unless both operands have at most 8 bits, then a LUT multiplier (about one adder
  per further digit).

The C-synthesis schedules show it directly: products by two-digit constants appear as
bit-concatenations (shifts) feeding adds, the others as ``mul`` cores; on the output layer of
the hls4ml jet-tagging MLP (ap_fixed<16,6>, Vitis HLS 2022.2, xcu250) this rule counts 122
DSPs for its 160 weights, as the report does.

A multiplier shared by several weights (reuse factor > 1, or weights read from a ROM in the
resource strategy) sees a variable operand: it is costed by the widths alone (`general`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .devices import Family

NARROW_BITS = 8
"""Products whose operands both have at most this many bits are built in LUTs."""


def naf_digits(a: int) -> int:
    """Nonzero digits of ``a >= 0`` in non-adjacent form (the fewest signed digits)."""
    digits = 0
    while a:
        if a & 1:
            a -= 2 - (a & 3)          # digit +1 (a ≡ 1 mod 4) or −1 (a ≡ 3 mod 4)
            digits += 1
        a >>= 1
    return digits


@dataclass(frozen=True)
class Product:
    """The hardware of one product: ``kind`` is zero, shift, shift-add, lut or dsp."""

    kind: str
    dsp: int = 0
    lut: int = 0
    registered_bits: int = 0
    """Bits a pipelined design registers for this product in fabric flip-flops (a DSP keeps
    its own pipeline register; a removed product or a shift registers nothing of its own)."""


ZERO = Product("zero")
SHIFT = Product("shift")


def _dsp(wx: int, wc: int, family: Family) -> int:
    a, b = max(wx, wc), min(wx, wc)
    return math.ceil(a / family.dsp_a) * math.ceil(b / family.dsp_b)


def constant(raw: int, data_bits: int, family: Family) -> Product:
    """The product of a ``data_bits``-wide operand and the constant weight ``raw`` (an integer in
    LSBs of the weight format)."""
    a = abs(int(raw))
    if a == 0:
        return ZERO
    a >>= (a & -a).bit_length() - 1          # trailing zeros are a shift
    if a == 1:
        return SHIFT
    digits = naf_digits(a)
    width = data_bits + a.bit_length() + 1
    if digits <= 2:
        return Product("shift-add", lut=width, registered_bits=width)
    wc = a.bit_length() + 1
    if max(data_bits, wc) <= NARROW_BITS:
        return Product("lut", lut=(digits - 1) * width, registered_bits=width)
    return Product("dsp", dsp=_dsp(data_bits, wc, family))


def general(data_bits: int, weight_bits: int, family: Family) -> Product:
    """A multiplier whose weight operand varies (shared by several weights)."""
    if max(data_bits, weight_bits) <= NARROW_BITS:
        width = data_bits + weight_bits
        return Product("lut", lut=data_bits * weight_bits, registered_bits=width)
    return Product("dsp", dsp=_dsp(data_bits, weight_bits, family))
