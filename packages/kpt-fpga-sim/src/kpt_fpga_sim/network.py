"""Whole networks as constant-weight HLS designs, the way hls4ml builds them: `estimate_model`.

The weights are known at synthesis, so a dense or convolution layer is not a GEMM engine fed
from memory (`kpt_fpga_sim.kernels.linear`) but a fixed circuit:

* ``strategy="latency"``: every multiply unrolled (one per nonzero weight, costed by
  `kpt_fpga_sim.multipliers.constant`), an adder tree per output, the whole layer one pipeline
  stage deep or a few (multiply delay plus ⌈log2 K⌉ adder levels over the clock period). A reuse
  factor R > 1 shares each multiplier among R weights: ⌈nonzero / R⌉ general multipliers,
  interval R.
* ``strategy="resource"``: the weights in a ROM (R words of ⌈N·K / R⌉ weights; LUT RAM up to
  1 Kib, else block RAM), ⌈N·K / R⌉ general multipliers each accumulating R products
  into its output lane: latency R plus the ROM read, multiply, accumulate and write stages.
* In the resource strategy, reuse factors are adjusted to the nearest valid one as hls4ml does
  (`valid_reuse`), and the report shows the one used. The latency strategy keeps the configured
  factor (hls4ml adjusts only resource-strategy layers: a latency-strategy project's
  parameters.h carries ``reuse_factor = 16`` for a 9 → 4 convolution).
* ``io="parallel"``: whole arrays between layers, the network one pipeline (interval: the
  slowest layer's; latency: the layers' plus one register stage per registered layer, plus
  the input register). A convolution computes one output pixel per R cycles.
* ``io="stream"``: FIFOs between layers (DATAFLOW; one per channel, as deep as the layer
  writes pixels: hls4ml's default, so no layer ever waits for room), one pixel of C channels a
  beat. Each layer is a loop over its input beats at an initiation interval: a convolution keeps
  K−1 lines of its input in a line buffer and runs its loop over every (padded) input pixel at
  II = R in the latency strategy, or, in the resource strategy, not pipelined, each pixel taking
  the window shift (C·K² − `WINDOW_SHIFT_SAVED` cycles) plus the whole product (a C-synthesis
  report gives this worst case); ReLU, batch-norm and the table activations take a beat a cycle;
  pooling emits an output at each pixel that completes a window; a dense layer or softmax reads
  all its beats, computes, writes. The layers overlap: `kpt_fpga_sim.stream` follows every
  beat through the chain (a layer's iteration starts when its input beat has arrived and its
  previous iteration is done), so the latency is the fill of the chain plus the image at the slowest layer's rate,
  and the interval the slowest layer's, not the sum of the layers.
* Batch-norm after a dense or convolution is folded into its weights and bias; alone it is a
  constant multiply and add per element. ReLU is a comparison and a select; softmax, sigmoid and
  tanh read 1024-entry tables (exp and 1/x for softmax), one ROM copy per two lookups, BRAM
  counted; max pooling compares, average pooling adds and scales.

Timing of a layer uses the device family's multiply and adder delays
(`kpt_fpga_sim.devices.Family`); resources are integer counts. `NetworkReport` prints like a
C-synthesis summary; `kpt_fpga_sim.calibration` compares it with published reports.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.nn import functional as F

from kpt.errors import KernelInputError, KernelNotSupportedError

from . import multipliers
from .devices import LIMITS, RESOURCES, Device, get_device, memory_blocks
from .fixed import bits_for
from .formats import ApFixed, parse_format
from .stream import Flow, fifo, padded_sources, window_registers

STRATEGIES = ("latency", "resource")
IOS = ("parallel", "stream")
OVERRIDES = ("reuse", "strategy", "weight_format", "bias_format", "result_format", "accum_format")

TABLE_ENTRIES = 1024
"""Entries of the exp, 1/x, sigmoid and tanh tables (hls4ml's default table size)."""
TABLE_BITS = 18
"""Width of a table entry (hls4ml's default table type, ap_fixed<18,8>)."""
CLOCK_BUDGET = 0.875
"""Share of the clock period a pipeline stage may use (the rest is the tools' default uncertainty)."""
WINDOW_SHIFT_SAVED = 3
"""Cycles fewer than C·K² that a resource-strategy convolution spends shifting its window per
pixel (fitted to the two convolutions of the pominiq/DNNonSilicon report: 6 cycles at C·K² = 9,
34 at 36)."""


@dataclass(frozen=True)
class Settings:
    """The choices for one layer (`estimate_model`'s arguments, with ``layers`` overrides)."""

    reuse: int
    strategy: str
    weight_format: ApFixed
    bias_format: ApFixed
    result_format: ApFixed
    accum_format: ApFixed


@dataclass(frozen=True)
class LayerReport:
    name: str
    op: str
    architecture: str
    reuse: int
    latency_cycles: int
    interval: int
    dsp: int
    lut: int
    ff: int
    bram18: int
    uram: int = 0
    note: str = ""


@dataclass(frozen=True)
class NetworkReport:
    """What the network would cost as one constant-weight design (see `estimate_model`)."""

    model: str
    device: str
    part: str
    clock_mhz: float
    format: str
    strategy: str
    io: str
    latency_cycles: int
    interval: int
    dsp: int
    lut: int
    ff: int
    bram18: int
    uram: int
    utilization: dict[str, float]
    fits: bool
    over_limit: tuple[str, ...]
    layers: tuple[LayerReport, ...] = field(default_factory=tuple)

    @property
    def latency_us(self) -> float:
        return self.latency_cycles / self.clock_mhz

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        head = (f"== kpt-fpga-sim estimate for '{self.model}': {self.part} ({self.device}) @ "
                f"{self.clock_mhz:g} MHz, {self.format}, {self.strategy} strategy, io_{self.io}\n"
                f"   constant-weight design (weights known at synthesis)\n\n"
                f"+ Latency: {self.latency_cycles:,} cycles ({self.latency_us * 1000:,.1f} ns), "
                f"interval {self.interval:,}\n\n+ Utilization:\n")
        cols = ("bram18", "dsp", "ff", "lut", "uram")
        names = ("BRAM_18K", "DSP", "FF", "LUT", "URAM")
        total = ["Total", *(f"{getattr(self, c):,}" for c in cols)]
        util = ["Utilization (%)", *(f"{100 * self.utilization[c]:.1f}" for c in cols)]
        summary = _table(["", *names], [total, util])
        rows = [[r.name, r.op, r.architecture, str(r.reuse), f"{r.latency_cycles:,}", f"{r.interval:,}",
                 *(f"{getattr(r, c):,}" for c in cols), r.note] for r in self.layers]
        layers = _table(["layer", "op", "architecture", "reuse", "latency", "interval", *names, "note"], rows)
        fit = "fits" if self.fits else f"does not fit ({', '.join(self.over_limit)} over the limit)"
        return f"{head}{summary}\n  {fit}\n\n+ Layers:\n{layers}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    line = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    fmt = [("|" + "|".join(f" {x:<{w}} " for x, w in zip(r, widths)) + "|").rstrip() for r in [header, *rows]]
    return "\n".join([line, fmt[0], line, *fmt[1:], line])


# -- reuse factors --------------------------------------------------------------------------------

def valid_reuse(n_in: int, n_out: int, reuse: int) -> bool:
    """Whether hls4ml accepts ``reuse`` for a ``n_in`` → ``n_out`` product: it divides the
    n_in·n_out multiplies evenly, and each multiplier serves whole inputs of whole outputs."""
    if reuse < 1 or (n_in * n_out) % reuse:
        return False
    if reuse >= n_in:
        return reuse % n_in == 0
    return math.ceil(n_in * n_out / reuse) % n_out == 0


def nearest_reuse(n_in: int, n_out: int, reuse: int) -> int:
    """The valid reuse factor nearest to ``reuse`` (the smaller on a tie)."""
    valid = [r for r in range(1, n_in * n_out + 1) if valid_reuse(n_in, n_out, r)]
    return min(valid, key=lambda r: (abs(r - reuse), r))


# -- the cost of one layer ------------------------------------------------------------------------

@dataclass(frozen=True)
class _Cost:
    latency: int
    interval: int
    dsp: int = 0
    lut: int = 0
    ff: int = 0
    bram18: int = 0
    uram: int = 0
    architecture: str = ""
    reuse: int = 1
    note: str = ""
    flow: Flow | None = None
    """How the layer consumes and emits stream beats (io_stream); None: a beat in, a beat out
    (or, for fewer output beats, all of them after the last input)."""


@functools.lru_cache(maxsize=1 << 16)
def _constant(raw: int, data_bits: int, family) -> multipliers.Product:
    return multipliers.constant(raw, data_bits, family)


class _Ctx:
    def __init__(self, device: Device, clock_mhz: float, io: str) -> None:
        self.device, self.clock_mhz, self.io = device, clock_mhz, io
        self.period_ns = 1000.0 / clock_mhz
        self.family = device.family

    def stages(self, ns: float) -> int:
        """Register stages a combinational path of ``ns`` needs at the clock, less the 12.5%
        clock uncertainty the HLS tools reserve by default (at least one)."""
        return max(1, math.ceil(ns / (CLOCK_BUDGET * self.period_ns) - 1e-9))


def _quantized(w: torch.Tensor, fmt: ApFixed) -> torch.Tensor:
    raw, _ = fmt.from_float(w.detach().to(torch.float64))
    return raw.to(torch.int64)


def _registers(ctx: _Ctx, dsp: bool, tree_ns: float) -> int:
    """Register stages inside a dense layer: its products (a DSP multiply, or about one adder for
    a shift-add) and the adder tree after them, over the clock; a layer that fits one period is
    combinational (0)."""
    product_ns = ctx.family.mul_ns if dsp else ctx.family.add_ns
    return ctx.stages(product_ns + tree_ns) - 1


def _dense_core(ctx: _Ctx, w: torch.Tensor, bias: bool, data_bits: int, s: Settings) -> _Cost:
    """One product ``y[N] = W[N, K] · x[K] (+ b)`` with constant weights."""
    n, k = w.shape
    raw = _quantized(w, s.weight_format)
    keep = s.strategy == "latency" or valid_reuse(k, n, s.reuse)
    reuse = s.reuse if keep else nearest_reuse(k, n, s.reuse)
    note = f"reuse {s.reuse} -> {reuse}" if reuse != s.reuse else ""
    acc = s.accum_format.w
    out_bits = s.result_format.w
    nonzero = (raw != 0).sum(1)
    terms = int(nonzero.max()) + bias if n else 0
    tree_ns = bits_for(max(terms, 1)) * ctx.family.add_ns
    if s.strategy == "latency":
        adders = int((nonzero + bias - 1).clamp_min(0).sum())
        if reuse == 1:
            counts: dict[multipliers.Product, int] = {}
            for v in raw.flatten().tolist():
                p = _constant(v, data_bits, ctx.family)
                counts[p] = counts.get(p, 0) + 1
            dsp = sum(p.dsp * c for p, c in counts.items())
            compute = _registers(ctx, dsp > 0, tree_ns)
            lut = sum(p.lut * c for p, c in counts.items())
            regs = sum(p.registered_bits * c for p, c in counts.items())
            if compute > 1:
                # the adder tree spans stages: every product and partial sum crosses a register
                nonzero_products = int(nonzero.sum())
                regs += (compute - 1) * nonzero_products * (data_bits + s.weight_format.w)
            kinds = {p.kind: 0 for p in counts}
            for p, c in counts.items():
                kinds[p.kind] += c
            detail = ", ".join(f"{c} {kd}" for kd, c in sorted(kinds.items()))
            arch = "constant multiplies, unrolled"
            note = ("; ".join(x for x in (note, detail) if x))
        else:
            units = math.ceil(int(nonzero.sum()) / reuse)
            p = multipliers.general(data_bits, s.weight_format.w, ctx.family)
            dsp, lut, regs = units * p.dsp, units * p.lut, units * p.registered_bits
            compute = _registers(ctx, p.dsp > 0, tree_ns)
            arch = f"{units} shared multipliers"
        return _Cost(compute + reuse - 1, reuse, dsp, lut + adders * acc,
                     compute * n * out_bits + regs, architecture=arch, reuse=reuse, note=note)
    units = math.ceil(n * k / reuse)
    wb = s.weight_format.w
    p = multipliers.general(data_bits, wb, ctx.family)
    rom = memory_blocks(units * wb, reuse, ctx.device)
    # ROM read, multiply, accumulate, write around the R products each multiplier makes
    latency = reuse + 2 + ctx.stages(ctx.family.mul_ns)
    # each multiplier selects its input among R (an R:1 multiplexer, 4 inputs a LUT6 per bit),
    # registers its product and its partial sum; one accumulator per output
    mux = data_bits * math.ceil((reuse - 1) / 3)
    return _Cost(latency, reuse, units * p.dsp, units * (p.lut + mux + acc) + rom.get("lut", 0),
                 n * acc + units * (data_bits + wb + acc), rom.get("bram18", 0), rom.get("uram", 0),
                 f"weights in ROM, {units} multipliers", reuse, note)


@dataclass(frozen=True)
class _Tensor:
    shape: tuple[int, ...]
    """Without the batch dimension: (features,) or (channels, *spatial)."""
    bits: int
    stream_beats: int | None = None
    """The beats of a flattened image (it keeps the pixels of its source as beats)."""

    @property
    def beats(self) -> int:
        """Stream beats: one per pixel (all channels in a beat), one for a flat vector."""
        if self.stream_beats is not None:
            return self.stream_beats
        return math.prod(self.shape[1:]) if len(self.shape) > 1 else 1


def _dense(ctx: _Ctx, w, b, x: _Tensor, s: Settings) -> _Cost:
    core = _dense_core(ctx, w, b is not None, x.bits, s)
    if ctx.io == "parallel":
        return core
    # read the input beats, compute, write the outputs: three loops, each entered and left
    latency = (x.beats + 1) + (core.latency + 1) + 2
    return replace(core, latency=latency, interval=latency + 1)


def _conv(ctx: _Ctx, mod, w, b, x: _Tensor, y: _Tensor, s: Settings) -> _Cost:
    f, c = w.shape[:2]
    kernel = tuple(w.shape[2:])
    core = _dense_core(ctx, w.reshape(f, -1), b is not None, x.bits, s)
    out_pixels = math.prod(y.shape[1:])
    if ctx.io == "parallel":
        latency = core.latency + (out_pixels - 1) * core.interval + 1
        return replace(core, latency=latency, interval=out_pixels * core.interval,
                       architecture=core.architecture + ", one output pixel per step")
    pad = mod.padding if isinstance(mod.padding, tuple) else (mod.padding,) * len(kernel)
    padded = [d + 2 * p for d, p in zip(x.shape[1:], pad)]
    in_pixels = math.prod(padded)
    window = window_registers(kernel, padded[-1], c, x.bits)
    # the loop over every padded input pixel: pipelined at II = R (latency strategy), or not
    # pipelined, each pixel shifting the window and computing a whole product (resource)
    if s.strategy == "latency":
        ii, depth = core.interval, core.latency + 1
    else:
        ii = core.latency + max(c * math.prod(kernel) - WINDOW_SHIFT_SAVED, 1)
        depth = ii
    latency = (in_pixels - 1) * ii + depth
    deps, index = padded_sources(x.shape[1:], [(p, p) for p in pad])
    emits = torch.ones(in_pixels, dtype=torch.bool)
    for d, k in enumerate(kernel):
        emits &= index[d] >= k - 1
    return replace(core, latency=latency, interval=in_pixels * ii + 1, flow=Flow(deps, ii, emits, depth),
                   lut=core.lut + window, ff=core.ff + window, architecture=core.architecture + ", line buffer")


def _elementwise(ctx: _Ctx, x: _Tensor, depth: int) -> tuple[int, int, int]:
    """(latency, interval, lanes) of a per-element operation ``depth`` stages deep: all elements
    at once in parallel io, one beat of channels a cycle in stream io."""
    n = math.prod(x.shape)
    if ctx.io == "parallel":
        return depth, 1, n
    lanes = x.shape[0] if len(x.shape) > 1 else n
    return x.beats + depth, x.beats, lanes


def _table_rom(ctx: _Ctx, lookups: int) -> dict[str, int]:
    per = memory_blocks(TABLE_BITS, TABLE_ENTRIES, ctx.device)
    return {k: v * math.ceil(lookups / 2) for k, v in per.items()}


def _activation(ctx: _Ctx, kind: str, x: _Tensor, s: Settings) -> _Cost:
    w = s.result_format.w
    if kind == "relu":
        latency, interval, lanes = _elementwise(ctx, x, 0 if ctx.io == "parallel" else 1)
        return _Cost(latency, interval, lut=lanes * w, ff=0 if ctx.io == "parallel" else lanes * w,
                     architecture="compare and select")
    if kind in ("sigmoid", "tanh"):
        latency, interval, lanes = _elementwise(ctx, x, 2)
        rom = _table_rom(ctx, lanes)
        return _Cost(latency, interval, lut=lanes * 2 * w, ff=2 * lanes * w, bram18=rom.get("bram18", 0),
                     architecture=f"{TABLE_ENTRIES}-entry table")
    if kind == "softmax":
        n = x.shape[0]
        tree = ctx.stages(bits_for(n) * ctx.family.add_ns)
        # max tree, exp table read, sum tree, 1/x table read, the N products by 1/sum
        latency = 2 * tree + 2 + ctx.stages(ctx.family.mul_ns)
        rom = _table_rom(ctx, n)
        inv = memory_blocks(TABLE_BITS, TABLE_ENTRIES, ctx.device)
        p = multipliers.general(w, TABLE_BITS, ctx.family)
        interval = 1
        if ctx.io == "stream":
            latency += x.beats + 3
            interval = latency + 1
        return _Cost(latency, interval, dsp=n * p.dsp, lut=n * (p.lut + 3 * w + TABLE_BITS),
                     ff=latency * n * w, bram18=rom.get("bram18", 0) + inv.get("bram18", 0),
                     architecture="max, exp table, sum, 1/x table (stable)")
    raise AssertionError(kind)


def _batchnorm(ctx: _Ctx, mod, x: _Tensor, s: Settings) -> _Cost:
    scale, shift = _bn_affine(mod)
    raw = _quantized(scale, s.weight_format).tolist()
    per_channel = [_constant(v, x.bits, ctx.family) for v in raw]
    per_pixel = math.prod(x.shape[1:]) if len(x.shape) > 1 else 1
    copies = per_pixel if ctx.io == "parallel" else 1
    dsp = copies * sum(p.dsp for p in per_channel)
    lut = copies * sum(p.lut + s.accum_format.w for p in per_channel)
    depth = ctx.stages(ctx.family.mul_ns + ctx.family.add_ns)
    latency, interval, lanes = _elementwise(ctx, x, depth)
    return _Cost(latency, interval, dsp=dsp, lut=lut, ff=lanes * s.result_format.w * depth,
                 architecture="constant scale and shift")


def _pool(ctx: _Ctx, kind: str, kernel: tuple[int, ...], x: _Tensor, y: _Tensor, s: Settings) -> _Cost:
    w = s.result_format.w
    window = math.prod(kernel)
    outs = math.prod(y.shape)
    per_out = (window - 1) * (w if kind == "max" else s.accum_format.w)
    if ctx.io == "parallel":
        latency = ctx.stages(bits_for(window) * ctx.family.add_ns)
        return _Cost(latency, 1, lut=outs * per_out, ff=outs * w * latency,
                     architecture=f"{kind} over {window}, unrolled")
    lanes = y.shape[0]
    if window == x.beats:       # global pooling: one running max or sum per channel
        regs, per_out = 0, per_out // max(window - 1, 1)
    else:
        regs = window_registers(kernel, x.shape[-1], lanes, x.bits)
    latency = x.beats + ctx.stages(bits_for(window) * ctx.family.add_ns) + 1
    emits = torch.ones(x.beats, dtype=torch.bool)
    for i, k, n in zip(torch.meshgrid(*(torch.arange(d) for d in x.shape[1:]), indexing="ij"), kernel, y.shape[1:]):
        emits &= ((i.reshape(-1) % k) == k - 1) & (i.reshape(-1) < n * k)
    return _Cost(latency, latency + 1, lut=lanes * per_out + regs, ff=2 * lanes * w + regs,
                 architecture=f"{kind} over {window}, streamed",
                 flow=Flow.from_latency(torch.arange(x.beats), 1, emits, latency))


def _bn_affine(mod) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch-norm in inference as ``y = scale · x + shift`` per channel."""
    var = mod.running_var if mod.running_var is not None else torch.ones(mod.num_features)
    mean = mod.running_mean if mod.running_mean is not None else torch.zeros(mod.num_features)
    scale = torch.rsqrt(var.double() + mod.eps)
    shift = -mean.double() * scale
    if mod.affine:
        scale = scale * mod.weight.detach().double()
        shift = shift * mod.weight.detach().double() + mod.bias.detach().double()
    return scale, shift


def _fold(w: torch.Tensor, b: torch.Tensor | None, bn) -> tuple[torch.Tensor, torch.Tensor]:
    scale, shift = _bn_affine(bn)
    view = (-1,) + (1,) * (w.dim() - 1)
    b0 = b.detach().double() if b is not None else torch.zeros(w.shape[0], dtype=torch.float64)
    return w.detach().double() * scale.reshape(view), b0 * scale + shift


# -- the graph ------------------------------------------------------------------------------------

_ACTIVATION_MODULES = {nn.ReLU: "relu", nn.Sigmoid: "sigmoid", nn.Tanh: "tanh", nn.Softmax: "softmax"}
_ACTIVATION_FUNCTIONS = {F.relu: "relu", torch.relu: "relu", torch.sigmoid: "sigmoid", torch.tanh: "tanh",
                         F.softmax: "softmax", torch.softmax: "softmax", "relu": "relu", "sigmoid": "sigmoid",
                         "tanh": "tanh", "softmax": "softmax"}
_RESHAPES = {torch.flatten, "flatten", "view", "reshape", nn.Flatten, nn.Identity, nn.Dropout,
             operator.getitem}
_POOLS = {nn.MaxPool1d: "max", nn.MaxPool2d: "max", nn.AvgPool1d: "avg", nn.AvgPool2d: "avg",
          nn.AdaptiveAvgPool1d: "avg", nn.AdaptiveAvgPool2d: "avg", nn.AdaptiveMaxPool1d: "max",
          nn.AdaptiveMaxPool2d: "max"}
_PADS = (nn.ZeroPad1d, nn.ZeroPad2d, nn.ConstantPad1d, nn.ConstantPad2d)


def _shape(node) -> tuple[int, ...]:
    meta = node.meta.get("tensor_meta")
    if meta is None or not hasattr(meta, "shape"):
        raise KernelNotSupportedError(f"estimate_model: node {node.name!r} does not produce one tensor")
    return tuple(meta.shape)[1:]


def _settings(base: Settings, name: str, layers: Mapping[str, Mapping[str, Any]]) -> Settings:
    over = dict(layers.get(name, {}))
    for key in ("weight_format", "bias_format", "result_format", "accum_format"):
        if key in over:
            over[key] = _fixed(over[key], key)
    if "strategy" in over:
        _check_strategy(over["strategy"])
    if "reuse" in over:
        _check_reuse(over["reuse"])
    return replace(base, **over)


def _fixed(fmt: Any, what: str) -> ApFixed:
    try:
        parsed = parse_format(fmt) if isinstance(fmt, str) else fmt
    except ValueError as exc:
        raise KernelInputError(f"estimate_model: {what}: {exc}") from exc
    if not isinstance(parsed, ApFixed):
        raise KernelInputError(f"estimate_model: {what} must be an ap_fixed format, got {fmt!r}")
    return parsed


def _check_strategy(strategy: Any) -> None:
    if strategy not in STRATEGIES:
        raise KernelInputError(f"estimate_model: strategy must be one of {STRATEGIES}, got {strategy!r}")


def _check_reuse(reuse: Any) -> None:
    if not isinstance(reuse, int) or isinstance(reuse, bool) or reuse < 1:
        raise KernelInputError(f"estimate_model: reuse must be a positive integer, got {reuse!r}")


def _trace(model: nn.Module, example: torch.Tensor) -> torch.fx.GraphModule:
    try:
        gm = torch.fx.symbolic_trace(model)
    except Exception as exc:  # torch.fx raises many kinds (TraceError, TypeError, ...)
        raise KernelNotSupportedError(f"estimate_model: torch.fx cannot trace {type(model).__name__}: {exc}") from exc
    with torch.no_grad():
        ShapeProp(gm).propagate(example.detach().to(torch.float32))
    return gm


def _folds(gm: torch.fx.GraphModule) -> dict[str, str]:
    """Batch-norm nodes folded into the dense / convolution node that alone feeds them."""
    out = {}
    for node in gm.graph.nodes:
        if node.op != "call_module" or not isinstance(gm.get_submodule(node.target), nn.modules.batchnorm._BatchNorm):
            continue
        src = node.args[0]
        if (isinstance(src, torch.fx.Node) and src.op == "call_module" and isinstance(src.target, str)
                and len(src.users) == 1
                and isinstance(gm.get_submodule(src.target), (nn.Linear, nn.Conv1d, nn.Conv2d))):
            out[src.name] = node.name
    return out


def _kernel(mod, x: _Tensor, y: _Tensor) -> tuple[int, ...]:
    """The pooling window's shape."""
    if isinstance(mod, (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d)):
        return tuple(a // max(b, 1) for a, b in zip(x.shape[1:], y.shape[1:]))
    k = mod.kernel_size
    return k if isinstance(k, tuple) else (k,) * (len(x.shape) - 1)


def estimate_model(model: nn.Module, example: torch.Tensor, *, format: str | ApFixed = "ap_fixed<16,6>",
                   device: str | Device = "u250", clock_mhz: float = 200.0, reuse: int = 1,
                   strategy: str = "latency", io: str = "parallel",
                   layers: Mapping[str, Mapping[str, Any]] | None = None) -> NetworkReport:
    """The cost of ``model`` as one constant-weight HLS design (hls4ml style), layer by layer.

    ``model``: a `torch.nn.Module` that `torch.fx` traces, of Linear, Conv1d/2d, BatchNorm1d/2d,
    ReLU, Softmax, Sigmoid, Tanh, max/avg/adaptive pooling, Flatten, zero padding (and Dropout
    or Identity, which cost nothing); ``example``: one input with batch 1. ``format`` is every
    value's type unless ``layers`` overrides it: ``{module name: {"reuse", "strategy",
    "weight_format", "bias_format", "result_format", "accum_format"}}``.
    """
    fmt = _fixed(format, "format")
    _check_strategy(strategy)
    _check_reuse(reuse)
    if io not in IOS:
        raise KernelInputError(f"estimate_model: io must be one of {IOS}, got {io!r}")
    if not isinstance(model, nn.Module):
        raise KernelInputError(f"estimate_model: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(example, torch.Tensor) or example.dim() < 2 or example.shape[0] != 1:
        raise KernelInputError("estimate_model: example must be one input with a batch dimension of 1")
    if not clock_mhz > 0:
        raise KernelInputError(f"estimate_model: clock_mhz must be positive, got {clock_mhz!r}")
    try:
        dev = get_device(device)
    except ValueError as exc:
        raise KernelInputError(f"estimate_model: {exc}") from exc
    layers = dict(layers or {})
    names = {n for n, _ in model.named_modules() if n}
    unknown = sorted(set(layers) - names)
    bad = sorted({k for v in layers.values() for k in v} - set(OVERRIDES))
    if unknown or bad:
        raise KernelInputError(f"estimate_model: layers names no module {unknown} or sets unknown keys {bad}; "
                               f"modules: {sorted(names)}; keys: {OVERRIDES}")
    base = Settings(reuse, strategy, fmt, fmt, fmt, fmt)
    ctx = _Ctx(dev, clock_mhz, io)
    gm = _trace(model, example)
    folds = _folds(gm)
    folded = set(folds.values())
    tensors: dict[str, _Tensor] = {}
    arrivals: dict[str, torch.Tensor] = {}
    """io_stream: the cycle at which each beat of a tensor is in its FIFO."""
    done = 0
    reports: list[LayerReport] = []
    input_bits = 0
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            tensors[node.name] = _Tensor(_shape(node), fmt.w)
            input_bits += math.prod(_shape(node)) * fmt.w
            arrivals[node.name] = torch.arange(tensors[node.name].beats)   # the input stream: a beat a cycle
            continue
        if node.op in ("output", "get_attr"):
            continue
        src = next((a for a in node.args if isinstance(a, torch.fx.Node)), None)
        if src is None or src.name not in tensors:
            raise KernelNotSupportedError(f"estimate_model: node {node.name!r} ({node.target}) takes no tensor input")
        x = tensors[src.name]
        mod = gm.get_submodule(node.target) if node.op == "call_module" else None
        name = node.target if node.op == "call_module" else node.name
        s = _settings(base, name, layers)
        y = _Tensor(_shape(node), s.result_format.w)
        tensors[node.name] = y
        key = type(mod) if mod is not None else node.target
        cost, op = _layer(ctx, gm, node, mod, key, x, y, s, folds)
        arrivals[node.name] = arrivals[src.name]
        if node.name in folded:
            tensors[node.name] = replace(y, bits=x.bits)
            reports.append(LayerReport(name, op, "folded into the layer before", 1, 0, 1, 0, 0, 0, 0))
            continue
        if cost is None:
            # wiring; a flattened image still streams its source's pixels
            tensors[node.name] = replace(y, bits=x.bits, stream_beats=x.beats if io == "stream" else None)
            continue
        if io == "stream":
            flow = cost.flow or Flow.beats(x.beats, y.beats, cost.latency)
            arrivals[node.name], finished = flow.run(arrivals[src.name])
            done = max(done, finished)
            # the FIFO to the next layer: one per channel (per element of a flat vector), as deep
            # as the layer writes beats
            buffer = fifo(y.bits, y.beats, dev)
            lanes = y.shape[0]
            cost = replace(cost, lut=cost.lut + lanes * buffer.get("lut", 0),
                           bram18=cost.bram18 + lanes * buffer.get("bram18", 0))
        reports.append(LayerReport(name, op, cost.architecture, cost.reuse, cost.latency, cost.interval,
                                   cost.dsp, cost.lut, cost.ff, cost.bram18, cost.uram, cost.note))
    return _network(type(model).__name__, ctx, fmt, strategy, reports, input_bits, done)


def _layer(ctx: _Ctx, gm, node, mod, key, x: _Tensor, y: _Tensor, s: Settings, folds):
    """``(cost, op)`` of one node; cost None for a node that is only wiring."""
    if key in _RESHAPES:
        return None, "reshape"
    if isinstance(mod, (nn.Linear, nn.Conv1d, nn.Conv2d)):
        w, b = mod.weight, mod.bias
        op = type(mod).__name__
        if node.name in folds:
            w, b = _fold(w, b, gm.get_submodule(next(n.target for n in node.users)))
            op += "+BatchNorm"
        if isinstance(mod, nn.Linear):
            if len(x.shape) != 1:
                raise KernelNotSupportedError(f"estimate_model: {node.target} applies Linear to a "
                                              f"{len(x.shape)}-d input; flatten it first")
            return _dense(ctx, w, b, x, s), op
        if mod.groups != 1 or any(d != 1 for d in _tuple(mod.dilation)) or any(t != 1 for t in _tuple(mod.stride)) \
                or isinstance(mod.padding, str) or mod.padding_mode != "zeros":
            raise KernelNotSupportedError(f"estimate_model: {node.target}: only stride 1, dilation 1, groups 1 "
                                          "and integer zero padding are modeled")
        return _conv(ctx, mod, w, b, x, y, s), op
    if isinstance(mod, nn.modules.batchnorm._BatchNorm):
        if node.name in folds.values():
            return _Cost(0, 1), type(mod).__name__
        return _batchnorm(ctx, mod, x, s), type(mod).__name__
    kind = _ACTIVATION_MODULES.get(key) if mod is not None else _ACTIVATION_FUNCTIONS.get(key)
    if kind is not None:
        if kind == "softmax" and len(x.shape) != 1:
            raise KernelNotSupportedError(f"estimate_model: {node.name}: softmax over a flat vector only")
        return _activation(ctx, kind, x, s), kind
    if key in _POOLS:
        return _pool(ctx, _POOLS[key], _kernel(mod, x, y), x, y, s), type(mod).__name__
    if isinstance(mod, _PADS) or key is F.pad:
        value = getattr(mod, "value", node.kwargs.get("value", 0.0) if mod is None else 0.0)
        if value:
            raise KernelNotSupportedError(f"estimate_model: {node.name}: only zero padding is modeled")
        if ctx.io == "parallel":
            return None, "pad"
        given = mod.padding if mod is not None else node.kwargs.get("pad", node.args[1] if len(node.args) > 1 else ())
        widths = tuple(given)
        widths = widths if len(widths) > 1 else widths * 2 * (len(x.shape) - 1)
        # torch lists (before, after) from the last dimension back
        pads = [(widths[2 * d], widths[2 * d + 1]) for d in range(len(x.shape) - 1)][::-1]
        deps, _ = padded_sources(x.shape[1:], pads)
        return _Cost(y.beats + 1, y.beats + 1, ff=2 * y.shape[0] * y.bits, architecture="zero insertion",
                     flow=Flow.from_latency(deps, 1, torch.ones(y.beats, dtype=torch.bool), y.beats + 1)), "pad"
    raise KernelNotSupportedError(f"estimate_model: {node.name} ({getattr(key, '__name__', key)}) is not a "
                                  "layer this estimate models")


def _tuple(v) -> tuple[int, ...]:
    return v if isinstance(v, tuple) else (v,)


def _network(model: str, ctx: _Ctx, fmt: ApFixed, strategy: str, reports: list[LayerReport],
             input_bits: int, stream_done: int) -> NetworkReport:
    active = [r for r in reports if r.latency_cycles or r.dsp or r.lut]
    if ctx.io == "parallel":
        # one pipeline: the input register, and every layer its own latency and its output
        # register, except a ReLU (a select) that chains into the next layer's cycle
        latency = 1 + sum(r.latency_cycles + 1 for r in active if r.op != "relu")
        extra_ff = input_bits
    else:
        # the layers overlap (DATAFLOW): the design is done when its last layer is (`Flow`)
        latency = 1 + stream_done
        extra_ff = 0
    interval = max([r.interval for r in active] or [1])
    total = {res: sum(getattr(r, res) for r in reports) for res in RESOURCES}
    total["ff"] += extra_ff
    dev = ctx.device
    util = {k: (total[k] / dev.total(k) if dev.total(k) else (math.inf if total[k] else 0.0)) for k in RESOURCES}
    over = tuple(k for k in RESOURCES if util[k] > LIMITS[k])
    return NetworkReport(model, dev.name, dev.part, ctx.clock_mhz, str(fmt).replace(",AP_TRN,AP_WRAP", ""),
                         strategy, ctx.io, latency, interval, total["dsp"], total["lut"], total["ff"],
                         total["bram18"], total["uram"], util, not over, over, tuple(reports))
