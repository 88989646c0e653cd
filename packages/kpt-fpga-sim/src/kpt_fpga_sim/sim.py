"""The context of one kernel call, and the loop patterns the kernel designs are built from.

A backend runs every body inside a `Call` (`current` returns it): the body computes with
``call.arith``; the kernel's ``<kernel>_design(call, *args)`` describes the loop nest that
computes it, from the argument shapes and ``call.directives`` only, so the same function also
serves `kpt_fpga_sim.FpgaSimBackend.estimate` on shapes that are never run.

Two patterns cover the kernels:

* `stream`: a pipelined loop over items, ``lanes`` of them per iteration (the unroll), each
  lane issuing ``ops``; its buffers are partitioned into ``banks``;
* `matmul`: an output-stationary MAC array of ``tm × tn`` units (`Tiling`) under a K loop
  pipelined at II = reuse and flattened over the output tiles; operands are staged on chip in
  ``bm × bk`` / ``bn × bk`` blocks (ping-pong), partial outputs in a ``bm × bn`` block, so the
  operands are read from off-chip memory ``⌈N/bn⌉`` and ``⌈M/bm⌉`` times.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from kpt.kernels import SPECS

from .arith import Arith, make_arith
from .config import MAC_BUDGET_MARGIN, Directives, SimConfig
from .devices import LIMITS, OpCost, memory_blocks
from .fixed import bits_for
from .formats import FLOAT32, ApFixed
from .hls import Buffer, Design, Loop, region

_CURRENT: contextvars.ContextVar[Call] = contextvars.ContextVar("kpt_fpga_sim_call")

FLOAT_ONLY = ("moe_gating", "moe_dispatch", "quantize_fp8", "dequantize_fp8", "fp8_linear")
"""Kernels that compute the same in every mode: expert routing must rank experts exactly as the
contract's float32 softmax does (and dispatch only moves rows), the FP8 kernels compute in
their FP8 minifloats with float32 scales."""

ON_CHIP_BUDGET = 0.5
"""Fraction of the device's BRAM and URAM a matrix product stages its blocks in."""


@functools.lru_cache(maxsize=64)
def _library(config: SimConfig) -> dict[str, OpCost]:
    return config.operator_library()


class Call:
    """One kernel call on a configured simulator."""

    def __init__(self, kernel: str, config: SimConfig) -> None:
        self.kernel = kernel
        self.config = replace(config, format=FLOAT32) if kernel in FLOAT_ONLY else config
        self.arith: Arith = make_arith(self.config.format)
        self.directives: Directives = config.directives_for(kernel)
        self.ops: dict[str, OpCost] = _library(self.config)

    @property
    def fixed(self) -> bool:
        return self.config.fixed

    @property
    def data_bits(self) -> int:
        """Bits of one activation on chip."""
        fmt = self.config.format
        return fmt.w if isinstance(fmt, ApFixed) else 32

    def elem_bytes(self, t: torch.Tensor | None) -> int:
        """Bytes of one element of ``t`` in off-chip memory (fixed mode packs its format)."""
        if t is None:
            return 0
        if self.fixed and t.dtype.is_floating_point:
            return math.ceil(self.data_bits / 8)
        return t.element_size()

    def io_bytes(self, *tensors: torch.Tensor | None) -> int:
        return sum(t.numel() * self.elem_bytes(t) for t in tensors if t is not None)

    def lanes(self, bytes_per_item: float) -> int:
        """The unroll of a streaming loop: the directive, else as many items per cycle as the
        off-chip bandwidth delivers (a power of two)."""
        if self.directives.unroll is not None:
            return self.directives.unroll
        per_cycle = self.config.device.bandwidth_gbs * 1e9 / (self.config.clock_mhz * 1e6)
        return 1 << bits_for(math.ceil(per_cycle / max(bytes_per_item, 1e-9)))

    def banks(self, accesses: int) -> int:
        """Partition factor of a buffer read ``accesses`` times per iteration (2 ports a bank)."""
        if self.directives.partition is not None:
            return self.directives.partition
        return max(1, math.ceil(accesses / 2))

    def carried(self, accumulate: bool) -> str | None:
        """The recurrence of a float accumulation kept in one accumulator (no partial sums)."""
        return "add" if accumulate and not self.fixed and not self.directives.partial_sums else None

    def mac_units(self, mac: str = "mac") -> int:
        """MAC units of a matrix product: the directive, else as many as fit in each resource's
        utilization limit less `MAC_BUDGET_MARGIN` (75% of the DSPs when they bind)."""
        if self.directives.unroll is not None:
            return self.directives.unroll
        cost = self.ops[mac]
        dev = self.config.device
        fits = [(LIMITS[r] - MAC_BUDGET_MARGIN) * dev.total(r) / getattr(cost, r)
                for r in ("dsp", "lut", "ff") if getattr(cost, r)]
        return max(1, int(min(fits)))


def zeros(t: torch.Tensor) -> torch.Tensor:
    """A new contiguous zero tensor like ``t`` (``zeros_like`` would keep a strided layout)."""
    return torch.zeros(t.shape, dtype=t.dtype)


def current() -> Call:
    """The call being simulated (set by the backend around every kernel body)."""
    call = _CURRENT.get(None)
    if call is None:
        raise RuntimeError("kpt_fpga_sim kernel bodies run through a backend: kpt.get_backend('fpga-sim')")
    return call


@contextlib.contextmanager
def running(call: Call) -> Iterator[Call]:
    """Make ``call`` the current one while a kernel body runs."""
    token = _CURRENT.set(call)
    try:
        yield call
    finally:
        _CURRENT.reset(token)


def stream(call: Call, name: str, items: int, lanes: int, ops: Mapping[str, int],
           chain: tuple[str, ...], buffers: Mapping[str, int] | None = None,
           accumulate: bool = False) -> Loop:
    """A loop over ``items``, ``lanes`` per iteration; ``ops`` and buffer accesses are per item."""
    return Loop(
        name, math.ceil(items / lanes), {k: v * lanes for k, v in ops.items()}, chain,
        ii=call.directives.reuse,
        accesses={b: (n * lanes, call.banks(n * lanes)) for b, n in (buffers or {}).items()},
        carried=call.carried(accumulate),
    )


@dataclass(frozen=True)
class Tiling:
    tm: int
    tn: int
    bm: int
    bn: int
    bk: int


def _blocks(call: Call, name: str, t: Tiling, in_bits: int, acc_bits: int,
            partials: int) -> tuple[Buffer, ...]:
    return (
        Buffer(f"{name} lhs block", in_bits, t.bm * t.bk, call.banks(t.tm), 2),
        Buffer(f"{name} rhs block", in_bits, t.bn * t.bk, call.banks(t.tn), 2),
        Buffer(f"{name} partial outputs", acc_bits, t.bm * t.bn, t.tn),
        Buffer(f"{name} partial sums", acc_bits * partials, t.tm * t.tn, t.tm * t.tn),
    )


def _memories(call: Call, buffers: Sequence[Buffer]) -> dict[str, int]:
    """BRAM18 and URAM blocks of ``buffers``."""
    total = {"bram18": 0, "uram": 0}
    for b in buffers:
        per_bank = memory_blocks(b.width, math.ceil(b.depth / b.banks), call.config.device)
        for res in total:
            total[res] += b.banks * b.copies * per_bank.get(res, 0)
    return total


def tile(call: Call, name: str, m: int, n: int, k: int, in_bits: int, acc_bits: int, partials: int,
         units: int, memory_share: float = 1.0) -> tuple[Tiling, tuple[Buffer, ...]]:
    """The MAC array (``tm × tn`` ≤ units, wasting few cycles on partial tiles, square) and
    the largest on-chip blocks (``r`` array rows / columns per block, r a power of two) whose
    BRAM and URAM fit in ``memory_share`` of `ON_CHIP_BUDGET` of the device's."""
    m, n, k = max(m, 1), max(n, 1), max(k, 1)
    shapes = []
    for tm in range(1, min(m, units, 512) + 1):
        tn = min(n, units // tm)
        if tn < 1:
            break
        shapes.append(((m * n) / (math.ceil(m / tm) * math.ceil(n / tn)), tm, tn))
    # within 1% of the fewest wasted cycles, the squarest array: operands are re-read least
    best = max(useful for useful, _, _ in shapes)
    _, tm, tn = min((abs(math.log(tm / tn)), tm, tn) for useful, tm, tn in shapes if useful >= 0.99 * best)
    dev = call.config.device
    budget = {res: memory_share * ON_CHIP_BUDGET * dev.total(res) for res in ("bram18", "uram")}
    bk = min(k, 512)
    chosen = None
    for r in (1, 2, 4, 8, 16, 32, 64):
        t = Tiling(tm, tn, min(tm * r, math.ceil(m / tm) * tm), min(tn * r, math.ceil(n / tn) * tn), bk)
        buffers = _blocks(call, name, t, in_bits, acc_bits, partials)
        if chosen is not None and any(v > budget[res] for res, v in _memories(call, buffers).items()):
            break
        chosen = (t, buffers)
    assert chosen is not None
    return chosen


def matmul(call: Call, name: str, m: int, n: int, k: int, *, batch: int = 1, mac: str = "mac",
           share: float = 1.0, visible: float = 1.0, in_bits: int | None = None,
           in_bytes: float | None = None) -> tuple[Loop, tuple[Buffer, ...], int, Tiling]:
    """``batch`` products ``[m, k] @ [k, n]``: the MAC loop, its block buffers, the operand
    bytes it reads off chip, and the tiling. ``share``: the fraction of the MAC units and of the
    memories this product gets (several products in one DATAFLOW region); ``visible``: the
    fraction of output tiles computed (a causal mask skips the others)."""
    in_bits = in_bits or call.data_bits
    acc_bits = 32 if not call.fixed else 2 * in_bits + bits_for(k)
    partials = call.ops["add"].latency if (not call.fixed and call.directives.partial_sums) else 1
    units = max(1, int(call.mac_units(mac) * share))
    t, buffers = tile(call, name, m, n, k, in_bits, acc_bits, partials, units, share)
    tiles = math.ceil(visible * batch * math.ceil(m / t.tm) * math.ceil(n / t.tn))
    # partial sums drain through the PE's own adder: partials - 1 extra cycles per output tile
    trip = tiles * (k + partials - 1) if k else 0
    loop = Loop(
        name, trip, {mac: t.tm * t.tn}, (mac,), ii=call.directives.reuse,
        accesses={f"{name} lhs block": (t.tm, call.banks(t.tm)),
                  f"{name} rhs block": (t.tn, call.banks(t.tn))},
        carried=call.carried(True),
    )
    in_bytes = in_bits / 8 if in_bytes is None else in_bytes
    traffic = visible * batch * in_bytes * (m * k * math.ceil(n / t.bn) + n * k * math.ceil(m / t.bm))
    return loop, buffers, int(traffic), t


def flops(kernel: str, args: Sequence[Any], factor: float = 1.0) -> float:
    """The spec's flop count of a forward call with positional ``args`` (times ``factor``: a
    backward counts as twice its forward, the two matrix products of each forward one)."""
    return factor * SPECS[kernel].flops(dict(zip(_forward_names(kernel), args)))


@functools.cache
def _forward_names(kernel: str) -> tuple[str, ...]:
    return tuple(inspect.signature(SPECS[kernel].forward).parameters)


@dataclass(frozen=True)
class Pass:
    """One sweep over a row: ``ops`` per element along ``chain``; ``reduce`` (an operator) folds
    a row statistic (per-lane partial results, then a tree of that operator over the lanes)."""

    name: str
    ops: Mapping[str, int]
    chain: tuple[str, ...]
    reduce: str | None = None


def row_design(call: Call, kernel: str, n_rows: int, d: int, passes: Sequence[Pass],
               row_ops: Mapping[str, int], row_chain: tuple[str, ...], traffic: int, work: float,
               buffers: Sequence[Buffer] = ()) -> Design:
    """A row-wise kernel: for each row (DATAFLOW over rows, a ping-pong row buffer), the passes
    in order, with the per-row scalar unit (``row_ops`` along ``row_chain``) after the last
    reducing pass."""
    # no more lanes than a row has elements: the rest would idle
    lanes = max(1, min(call.lanes(traffic / max(n_rows * d, 1)), d))
    stages: list[Loop] = []
    for p in passes:
        stages.append(stream(call, p.name, d, lanes, p.ops, p.chain, {"row": 1}, p.reduce == "add"))
        if p.reduce:
            depth = bits_for(lanes)
            stages.append(Loop(f"{p.name} tree", 1, {p.reduce: max(lanes - 1, 0)}, (p.reduce,) * depth))
    last = max((i for i, s in enumerate(stages) if s.name.endswith(" tree")), default=-1)
    if row_ops:
        stages.insert(last + 1, Loop("row unit", 1, dict(row_ops), row_chain))
    top = region(kernel, stages, repeat=n_rows, dataflow=call.directives.dataflow)
    row = Buffer("row", call.data_bits, d, call.banks(lanes), 2)
    return Design(kernel, top, (row, *buffers), traffic, work)
