"""The HLS cost model: loop nests with their directives, turned into cycles and resources.

A kernel describes its design as a tree of regions over pipelined loops:

* `Loop`: one pipelined loop whose inner loops are fully unrolled (their operators are the
  ``ops`` issued per iteration). ``II = max(target II (the reuse factor), memory-port limit
  ⌈accesses / (2 · banks)⌉ per buffer (dual-port BRAM), recurrence (the latency of a
  loop-carried operator, when an accumulation is not split into partial sums))``.
  Latency ``depth + II · (trip − 1)`` with ``depth`` the operator latencies along ``chain``
  plus a read and a write cycle; non-pipelined, ``trip · depth``. Each operator kind gets
  ``⌈ops / II⌉`` units (one unit serves II issues).
* `Dataflow`: stages overlapping through FIFOs / ping-pong buffers while ``repeat`` items
  stream through: the interval is the slowest stage's, the latency the stages' fill
  latencies plus ``repeat`` slowest intervals. With the ``dataflow`` directive off it becomes
  a `Sequential` region: the stages run one after the other, ``repeat`` times.
* Resources add up over every loop (pipelined loops share no operator) plus the `Buffer`s.

`evaluate` puts a `Design` on a device at a clock: the design streams its off-chip traffic
while it computes, so its time is the larger of the compute latency and traffic / bandwidth,
and that larger term is what `Report.bound` names.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Union

from .devices import LIMITS, RESOURCES, Device, OpCost, memory_blocks

_IO_CYCLES = 2
"""A pipeline reads its operands and writes its result: one cycle each on top of the operators."""


@dataclass(frozen=True)
class Loop:
    name: str
    trip: int
    ops: Mapping[str, int]
    chain: tuple[str, ...] = ()
    ii: int = 1
    accesses: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    """buffer -> (accesses per iteration, banks it is partitioned into)."""
    carried: str | None = None
    pipelined: bool = True


@dataclass(frozen=True)
class Dataflow:
    name: str
    stages: tuple[Region, ...]
    repeat: int = 1


@dataclass(frozen=True)
class Sequential:
    name: str
    stages: tuple[Region, ...]
    repeat: int = 1


Region = Union[Loop, Dataflow, Sequential]


def region(name: str, stages: Sequence[Region], repeat: int = 1, dataflow: bool = True) -> Region:
    """A DATAFLOW region over ``stages`` (or a sequential one when the directive is off)."""
    return (Dataflow if dataflow else Sequential)(name, tuple(stages), repeat)


@dataclass(frozen=True)
class Buffer:
    """An on-chip array: ``banks`` partitions of ``width`` × ⌈depth / banks⌉, ``copies`` (ping-pong)."""

    name: str
    width: int
    depth: int
    banks: int = 1
    copies: int = 1


@dataclass(frozen=True)
class Design:
    """A kernel's design for one call: loops, memories, off-chip traffic and work."""

    kernel: str
    top: Region
    buffers: tuple[Buffer, ...]
    traffic: int
    """Bytes moved to and from off-chip memory."""
    flops: float
    roof_op: str = "mac"
    """The operator that sets the compute roofline (the device filled with it)."""
    roof_flops: int = 2
    """Flops one ``roof_op`` performs."""
    architecture: str = "operands streamed from off-chip memory"
    """What kind of circuit was estimated (named in the report)."""


@dataclass(frozen=True)
class _Timing:
    latency: int
    interval: int
    fill: int
    ii: int
    why: str


def _ii(loop: Loop, ops: Mapping[str, OpCost]) -> tuple[int, str]:
    terms = [(loop.ii, "reuse factor" if loop.ii > 1 else "II=1")]
    for buf, (n, banks) in loop.accesses.items():
        terms.append((math.ceil(n / (2 * max(banks, 1))), f"ports of {buf}"))
    if loop.carried is not None:
        terms.append((ops[loop.carried].latency, f"recurrence on {loop.carried}"))
    return max(terms, key=lambda t: t[0])


def _timing(r: Region, ops: Mapping[str, OpCost]) -> _Timing:
    if isinstance(r, Loop):
        depth = sum(ops[o].latency for o in r.chain) + _IO_CYCLES
        if r.trip == 0:
            return _Timing(0, 0, 0, 1, "empty")
        if not r.pipelined:
            lat = r.trip * depth
            return _Timing(lat, lat, depth, depth, "not pipelined")
        ii, why = _ii(r, ops)
        return _Timing(depth + ii * (r.trip - 1), ii * r.trip, depth, ii, why)
    parts = [_timing(s, ops) for s in r.stages]
    if not parts:
        return _Timing(0, 0, 0, 1, "empty")
    slowest = max(parts, key=lambda t: t.interval)
    if isinstance(r, Dataflow):
        fill = sum(p.fill for p in parts)
        return _Timing(fill + r.repeat * slowest.interval, r.repeat * slowest.interval, fill,
                       slowest.ii, slowest.why)
    total = r.repeat * sum(p.latency for p in parts)
    return _Timing(total, total, sum(p.fill for p in parts), slowest.ii, slowest.why)


def _loops(r: Region) -> list[Loop]:
    return [r] if isinstance(r, Loop) else [lp for s in r.stages for lp in _loops(s)]


def units(loop: Loop, ops: Mapping[str, OpCost]) -> dict[str, int]:
    """Operator units a loop instantiates: one unit serves II issues."""
    ii = _ii(loop, ops)[0] if loop.pipelined else 1
    return {k: math.ceil(n / ii) for k, n in loop.ops.items() if n}


def resources(design: Design, device: Device, ops: Mapping[str, OpCost]) -> dict[str, float]:
    total = dict.fromkeys(RESOURCES, 0.0)
    for loop in _loops(design.top):
        for kind, n in units(loop, ops).items():
            cost = ops[kind]
            total["dsp"] += n * cost.dsp
            total["lut"] += n * cost.lut
            total["ff"] += n * cost.ff
            if cost.rom[0]:
                # a table unit reads its ROM: one copy per two units (dual-port block RAM)
                for res, blocks in memory_blocks(*cost.rom, device).items():
                    total[res] += blocks * math.ceil(n / 2)
    for buf in design.buffers:
        per_bank = memory_blocks(buf.width, math.ceil(buf.depth / max(buf.banks, 1)), device)
        for res, n in per_bank.items():
            total[res] += n * buf.banks * buf.copies
    return total


@dataclass(frozen=True)
class Report:
    """What one kernel call would cost as an FPGA design (see `evaluate`)."""

    kernel: str
    direction: str
    format: str
    device: str
    clock_mhz: float
    cycles: int
    interval: int
    ii: int
    ii_limit: str
    latency_us: float
    calls_per_s: float
    dsp: float
    lut: float
    ff: float
    bram18: float
    uram: float
    utilization: dict[str, float]
    fits: bool
    over_limit: tuple[str, ...]
    flops: float
    traffic_bytes: int
    gflops: float
    compute_roof_gflops: float
    memory_roof_gflops: float
    roof_fraction: float
    """Achieved GFLOP/s over the roofline min(compute roof, intensity x bandwidth)."""
    compute_roof_fraction: float
    """Achieved GFLOP/s over the compute (DSP) roof alone."""
    bound: str
    overflows: dict[str, int] = field(default_factory=dict)
    directives: dict[str, Any] = field(default_factory=dict)
    architecture: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def evaluate(design: Design, device: Device, clock_mhz: float, fmt: str,
             ops: Mapping[str, OpCost], direction: str = "forward",
             directives: Mapping[str, Any] | None = None) -> Report:
    """Put ``design`` on ``device`` at ``clock_mhz`` with the operator library ``ops``."""
    t = _timing(design.top, ops)
    hz = clock_mhz * 1e6
    memory_cycles = math.ceil(design.traffic / (device.bandwidth_gbs * 1e9) * hz)
    cycles = max(t.latency, memory_cycles, 1)
    interval = max(t.interval, memory_cycles, 1)
    res = resources(design, device, ops)
    util = {k: (res[k] / device.total(k) if device.total(k) else (math.inf if res[k] else 0.0))
            for k in RESOURCES}
    over = tuple(k for k in RESOURCES if util[k] > LIMITS[k])
    seconds = cycles / hz
    gflops = design.flops / seconds / 1e9
    roof = ops[design.roof_op]
    per_unit = [device.total(k) / getattr(roof, k) for k in ("dsp", "lut", "ff") if getattr(roof, k)]
    compute_roof = min(per_unit) * design.roof_flops * hz / 1e9
    memory_roof = (design.flops / design.traffic * device.bandwidth_gbs) if design.traffic else math.inf
    roofline = min(compute_roof, memory_roof)
    if memory_cycles > t.latency:
        bound = f"memory ({device.memory}, {device.bandwidth_gbs:g} GB/s)"
    else:
        bound = f"compute ({t.why})"
    return Report(
        kernel=design.kernel, direction=direction, format=fmt, device=device.name, clock_mhz=clock_mhz,
        cycles=cycles, interval=interval, ii=t.ii, ii_limit=t.why, latency_us=seconds * 1e6,
        calls_per_s=hz / interval, dsp=res["dsp"], lut=res["lut"], ff=res["ff"], bram18=res["bram18"],
        uram=res["uram"], utilization=util, fits=not over, over_limit=over, flops=design.flops,
        traffic_bytes=design.traffic, gflops=gflops, compute_roof_gflops=compute_roof,
        memory_roof_gflops=memory_roof, roof_fraction=gflops / roofline if roofline else 0.0,
        compute_roof_fraction=gflops / compute_roof if compute_roof else 0.0, bound=bound,
        directives=dict(directives or {}), architecture=design.architecture,
    )


_COLUMNS = (
    ("kernel", "{}"), ("direction", "{}"), ("cycles", "{:,}"), ("ii", "{}"), ("latency_us", "{:.2f}"),
    ("dsp", "{:,.0f}"), ("bram18", "{:,.0f}"), ("uram", "{:,.0f}"), ("lut", "{:,.0f}"), ("ff", "{:,.0f}"),
    ("fits", "{}"), ("gflops", "{:,.1f}"), ("roof_fraction", "{:.0%}"), ("compute_roof_fraction", "{:.0%}"),
    ("bound", "{}"), ("overflows", "{}"),
)
_HEADERS = {"latency_us": "µs", "roof_fraction": "of roof", "compute_roof_fraction": "of DSP roof",
            "gflops": "GFLOP/s", "direction": "dir"}


def format_table(reports: Sequence[Report], extra: Sequence[str] = ()) -> str:
    """Reports as an aligned text table (``extra``: labels of a leading column, one per report)."""
    header = (["variant"] if extra else []) + [_HEADERS.get(c, c) for c, _ in _COLUMNS]
    rows = []
    for k, r in enumerate(reports):
        cells = [fmt.format(getattr(r, c)) for c, fmt in _COLUMNS]
        cells[-1] = ", ".join(f"{n}: {v}" for n, v in r.overflows.items()) or "0"
        cells[header.index("dsp") - bool(extra)] += f" ({r.utilization['dsp']:.0%})"
        rows.append(([extra[k]] if extra else []) + cells)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    head = reports[0] if reports else None
    title = f"{head.device} @ {head.clock_mhz:g} MHz, {head.format}" if head else "no reports"
    archs = dict.fromkeys(f"{r.kernel}: {r.architecture}" for r in reports if r.architecture)
    return title + "\n" + "\n".join(lines) + "".join(f"\narchitecture of {a}" for a in archs)
