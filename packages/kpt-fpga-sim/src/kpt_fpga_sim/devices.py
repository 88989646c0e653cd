"""Device profiles (whole-device resources, off-chip bandwidth, default clock) and the operator
library: latency in cycles and cost of each operator a loop issues, per number format.

Float32 cores (Vitis HLS floating-point library, UltraScale+ at 300 MHz; latencies scale with
the clock, since the cores are pipelined to meet it):

    fadd 2 DSP, lat 7 · fmul 3 DSP, lat 4 · fdiv/frecip ≈ 800 LUT, lat 16 · fexp 7 DSP, lat 20 ...

Fixed point ``ap_fixed<W, I>``: an adder is W LUTs, lat 1; a multiplier is
``⌈Wa/27⌉ · ⌈Wb/18⌉`` DSP48 slices, lat 3, or about Wa·Wb LUTs when both operands have at most
8 bits; a MAC folds the accumulation into the DSP post-adder; a table function is a ROM (its
BRAM is counted with the design's memories), one interpolating multiply-add, lat 4, plus a
leading-one detector and shifter for the normalized ones. Every number is calibratable:
``configure(be, operators={"add": OpCost(...)})`` replaces an entry.

Memories: BRAM18 in one of its aspect ratios (36×512 … 1×16384), URAM as 72×4096, and banks of
at most 1 Kib in LUTRAM (64 bits per LUT).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from .formats import ApFixed, Format
from .nonlinear import tables_for

LIMITS = {"lut": 0.70, "ff": 0.50, "bram18": 0.80, "dsp": 0.80, "uram": 0.80}
"""Utilization above which a design is called unfit (routing congestion, timing closure)."""

RESOURCES = ("dsp", "lut", "ff", "bram18", "uram")


@dataclass(frozen=True)
class OpCost:
    latency: int
    dsp: float = 0.0
    lut: float = 0.0
    ff: float = 0.0
    rom: tuple[int, int] = (0, 0)
    """A table unit's ROM as (width bits, entries); two units share one copy (dual port)."""


@dataclass(frozen=True)
class Family:
    """What a constant-weight design needs of a device family: the DSP slice's multiplier ports
    (DSP48E2: 27×18, DSP48E1: 25×18) and the delays of a combinational multiply and of one adder
    level of a LUT adder tree (the operator delays the C-synthesis schedules report, e.g. 1.94 ns
    for a 16-bit multiply on a -2 UltraScale+ part). A pipeline stage holds what fits in the
    clock period less the tool's default 12.5% uncertainty."""

    name: str
    dsp_a: int
    dsp_b: int
    mul_ns: float
    add_ns: float


ULTRASCALE_PLUS = Family("UltraScale+", 27, 18, 2.0, 0.5)
ULTRASCALE = Family("UltraScale", 27, 18, 2.4, 0.6)
SERIES7 = Family("7-series", 25, 18, 3.9, 1.0)


@dataclass(frozen=True)
class Device:
    name: str
    part: str
    lut: int
    ff: int
    bram18: int
    dsp: int
    uram: int
    memory: str
    bandwidth_gbs: float
    clock_mhz: float
    family: Family = ULTRASCALE_PLUS

    def total(self, resource: str) -> int:
        return getattr(self, resource)


DEVICES = {
    "u250": Device("u250", "xcu250", 1_728_000, 3_456_000, 5_376, 12_288, 1_280, "4x DDR4", 77.0, 300.0),
    "u280": Device("u280", "xcu280", 1_303_680, 2_607_360, 4_032, 9_024, 960, "HBM2", 460.0, 300.0),
    "u50": Device("u50", "xcu50", 871_680, 1_743_360, 2_688, 5_952, 640, "HBM2", 316.0, 300.0),
    "vu9p": Device("vu9p", "xcvu9p", 1_182_240, 2_364_480, 4_320, 6_840, 960, "4x DDR4", 77.0, 300.0),
    "vu13p": Device("vu13p", "xcvu13p", 1_728_000, 3_456_000, 5_376, 12_288, 1_280, "4x DDR4", 77.0, 300.0),
    "ku115": Device("ku115", "xcku115", 663_360, 1_326_720, 4_320, 5_520, 0, "2x DDR4", 38.4, 250.0,
                    ULTRASCALE),
    "zynq7020": Device("zynq7020", "xc7z020", 53_200, 106_400, 280, 220, 0, "DDR3", 4.2, 100.0, SERIES7),
    "zcu104": Device("zcu104", "xczu7ev", 230_400, 460_800, 624, 1_728, 96, "DDR4", 19.2, 300.0),
}
_ALIASES = {"alveo-u250": "u250", "alveo-u280": "u280", "alveo-u50": "u50", "zynq-7020": "zynq7020",
            "z7020": "zynq7020", "virtex-vu9p": "vu9p", "virtex-vu13p": "vu13p", "kintex-ku115": "ku115",
            "zu7ev": "zcu104",
            **{d.part: name for name, d in DEVICES.items()}}


def get_device(name: str | Device) -> Device:
    """A profile by short name (``u250``), part (``xcu250``) or full part name with package and
    speed grade (``xcu250-figd2104-2L-e``, ``xc7z020clg400-1``)."""
    if isinstance(name, Device):
        return name
    key = name.lower().replace("_", "-")
    key = _ALIASES.get(key, key)
    if key not in DEVICES:
        # a full part name: the part followed by its package and speed grade
        parts = sorted((p for p in _ALIASES if p.startswith("xc") and key.startswith(p)
                        and key[len(p):len(p) + 1] in ("-", *"abcdefghijklmnopqrstuvwxyz")), key=len)
        if not parts:
            raise ValueError(f"unknown device profile {name!r}; expected one of {sorted(DEVICES)} "
                             "or a part name such as xcu250-figd2104-2L-e")
        key = _ALIASES[parts[-1]]
    return DEVICES[key]


_FLOAT32_300MHZ = {
    "add": OpCost(7, 2, 220, 360),
    "mul": OpCost(4, 3, 80, 150),
    "mac": OpCost(11, 5, 300, 510),
    "cmp": OpCost(1, 0, 70, 10),
    "div": OpCost(16, 0, 800, 1400),
    "recip": OpCost(16, 0, 800, 1400),
    "rsqrt": OpCost(16, 4, 600, 900),
    "exp": OpCost(20, 7, 900, 1100),
    "log": OpCost(22, 12, 1100, 1300),
    "sigmoid": OpCost(43, 9, 1900, 2800),
    "tanh": OpCost(45, 9, 2000, 3000),
    "erf": OpCost(40, 10, 2200, 2800),
    "cvt": OpCost(3, 0, 150, 150),
    "mac8": OpCost(9, 2, 240, 300),
}
"""Float32 cores; ``cvt`` converts between float32 and FP8, ``mac8`` is an exact FP8 x FP8
product (a 4x4-bit mantissa multiply in LUTs) feeding an fadd."""

TABLE_FUNCTIONS = ("exp", "log", "rsqrt", "recip", "sigmoid", "tanh", "erf")


def _fixed_mul(wa: int, wb: int) -> OpCost:
    if max(wa, wb) <= 8:
        return OpCost(1, 0, wa * wb, wa + wb)
    return OpCost(3, math.ceil(wa / 27) * math.ceil(wb / 18), 0, wa + wb)


def _fixed_ops(fmt: ApFixed) -> dict[str, OpCost]:
    w = fmt.w
    mul = _fixed_mul(w, w)
    interp = _fixed_mul(w + 6, w - 2)
    table = OpCost(4, interp.dsp, interp.lut + 2 * w, 3 * w)
    shifter = OpCost(2, 0, 2 * w * max(1, w.bit_length()), 2 * w)
    ops = {
        "add": OpCost(1, 0, w, w),
        "mul": mul,
        "mac": OpCost(mul.latency + 1, mul.dsp, mul.lut + 2 * w, 4 * w),
        "cmp": OpCost(1, 0, w, 1),
        "div": OpCost(w + 4, 0, w * w, w * w),
        "cvt": OpCost(2, 0, 3 * w, w),
        "mac8": _FLOAT32_300MHZ["mac8"],
    }
    tables = tables_for(fmt.f)
    for name in TABLE_FUNCTIONS:
        normalized = name in ("rsqrt", "recip", "log")
        rom = tables[name if name in tables else "exp"]
        ops[name] = OpCost(table.latency + (shifter.latency if normalized else 0), table.dsp,
                           table.lut + (shifter.lut if normalized else 0),
                           table.ff + (shifter.ff if normalized else 0),
                           (rom.rom_bits // rom.entries, rom.entries))
    return ops


def operators(fmt: Format, clock_mhz: float,
              overrides: Mapping[str, OpCost] | None = None) -> dict[str, OpCost]:
    """The operator library for ``fmt`` at ``clock_mhz`` (with calibration ``overrides``)."""
    if isinstance(fmt, ApFixed):
        ops = _fixed_ops(fmt)
    else:
        scale = clock_mhz / 300.0
        ops = {k: OpCost(max(1, math.ceil(c.latency * scale)), c.dsp, c.lut, c.ff)
               for k, c in _FLOAT32_300MHZ.items()}
    ops.update(overrides or {})
    return ops


_BRAM18_SHAPES = ((36, 512), (18, 1024), (9, 2048), (4, 4096), (2, 8192), (1, 16384))
_LUTRAM_BITS = 1024


def memory_blocks(width: int, depth: int, device: Device, lutram: bool = True) -> dict[str, int]:
    """Resources of one memory bank of ``width`` bits × ``depth`` words (``lutram``: a bank of
    at most 1 Kib may go to LUTs)."""
    bits = width * depth
    if bits == 0:
        return {}
    if lutram and bits <= _LUTRAM_BITS:
        return {"lut": math.ceil(bits / 64)}
    bram = min(math.ceil(width / w) * math.ceil(depth / d) for w, d in _BRAM18_SHAPES)
    uram = math.ceil(width / 72) * math.ceil(depth / 4096)
    # a deep bank goes to URAM when the device has it and that takes no more 18 Kib equivalents
    if device.uram and depth >= 4096 and uram * 16 <= bram:
        return {"uram": uram}
    return {"bram18": bram}
