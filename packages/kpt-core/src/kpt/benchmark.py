"""Measuring kernels side by side, the docs/performance.md way.

    python -m kpt.benchmark --backend cuda --out reports/bench                 # the docs/performance.md shapes
    python -m kpt.benchmark --backend cuda --sweep models --out reports/models  # real models' shapes
    kpt bench --backend cuda --sweep attention --plot                          # the same, as a command

For each shape of a sweep (`kpt.sweeps`) it times, on the backend's device, the backend, torch
eager (the contract's reference math, run as plain PyTorch), torch.compile of the same math and the
libraries present (SDPA with each of its backends, cuBLAS then the activation, ``torch._scaled_mm``,
a loop of cuBLAS products and ``torch._grouped_mm``, Liger-Kernel where installed), forward and
forward+backward (random output gradients; 1 for a scalar loss, as ``loss.backward()`` gives), in
rounds that take turns (`ROUNDS`), so that a drift of the card's clocks reaches each of them alike.
It reports time, achieved GB/s or TFLOP/s from the spec's cost model, the fraction of the ceilings
measured in the same run (device-to-device copy bandwidth, bf16 matrix product), the ratio to each
peer and to the best of them, and each kernel's worst ratio over the sweep. Every timing is gated
on correctness: a backend result that disagrees with eager is reported as wrong, with no speed, and
a library that disagrees is left out. A failure at one shape is recorded there and the sweep goes
on. Separately it measures the host time of one small call of each kernel (argument checks,
dispatch, launch) beside an empty Triton kernel's launch and a one-element torch op: at the
smallest shapes a device-event time is the larger of the device's time and the host's time less
the L2 flush before each call (about 85 µs on an H100), so the host's share needs its own number.

In the sweeps other than perf, torch.compile compiles each kernel once and follows the shapes
with its automatic dynamic shapes (what a user's compiled model gets); perf compiles each shape.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .backend import Backend
from .kernels import SPECS
from .ops import as_tuple
from .overview import provenance
from .registry import get_backend
from .spec import Case, KernelSpec
from .spec import nbytes as nbytes_of
from .sweeps import MODES as MODES
from .sweeps import SWEEPS, Point, sweep
from .testing import compare, to_device
from .tolerance import default_tolerance

SCHEMA_VERSION = 1
"""Of ``bench.json``: ``schema_version``, ``backend``, then what `kpt.overview.provenance` records
(``versions``, ``device``, ``machine``, ``timestamp``), then the run's ``environment`` (the backend's
facts), ``ceilings``, ``sweep``, ``timing`` ("calls", or "CUDA-graph replays" with ``--graphs``) and its
results."""

PEERS = ("eager", "compile", "library")
"""The columns a kernel is compared with; "library" is the fastest library present."""

LIGER = {"rms_norm", "add_rms_norm", "layer_norm", "softmax", "swiglu", "geglu", "rope", "cross_entropy",
         "linear_cross_entropy"}
"""The kernels whose library peer is Liger-Kernel (n/a where it is not installed)."""


def time_ms(fn: Callable[[], Any], device: torch.device, warmup: float = 25, rep: float = 100,
            graphs: bool = False) -> float:
    """Median time of ``fn`` in milliseconds: device events after ``warmup`` ms of warm-up, ``rep``
    ms of calls, the L2 cache flushed before each (``triton.testing.do_bench``) on GPUs; wall clock
    on CPUs. With ``graphs`` (CUDA GPUs), ``fn`` is captured in a CUDA graph, about ``rep`` ms of
    calls in a row, and replayed (`graph_ms`): no host time, no L2 flush between calls, what a
    program that replays its step from a graph sees."""
    if graphs:
        if device.type != "cuda":
            raise ValueError(f"CUDA-graph timing needs a CUDA device, not {device.type}")
        return graph_ms(fn, rep)
    if device.type != "cpu":
        try:
            from triton.testing import do_bench
        except ImportError:
            do_bench = None
        if do_bench is not None:
            return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()
        samples = []
        for _ in range(20):
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        return statistics.median(samples)
    fn()
    samples = []
    deadline = time.perf_counter() + 0.5
    while len(samples) < 3 or (time.perf_counter() < deadline and len(samples) < 50):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def graph_ms(fn: Callable[[], Any], rep: float = 100, replays: int = 10) -> float:
    """Median time of ``fn`` in milliseconds, replayed from a CUDA graph of about ``rep`` ms of calls
    in a row, on a side stream (``fn`` is called once first, outside the graph: compiling and
    autotuning are not captured).

    As many calls are captured as fit in half the free device memory, judged from a graph of one
    call: inside a capture, memory freed with pending uses on another stream (autograd's backward
    makes such) is not reused by the next call. A capture that fails releases its memory pool; the
    graph context of torch (2.11) leaves it registered, and from then on the allocator keeps such
    freed memory for good (after a library whose call cannot be captured, 77 of an H100's 79 GB
    were held within a few shapes, `benchmarks/h100-2026-11-27f.md`)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    graph = _capture(fn, 1, stream)
    per_call = max(torch.cuda.memory_reserved() - reserved, 1 << 20)
    estimate = _replay_ms(graph, 1, 3)
    calls = max(1, min(int(rep / max(estimate, 1e-3)), int(torch.cuda.mem_get_info()[0] / 2 / per_call)))
    if calls > 1:
        del graph
        torch.cuda.empty_cache()
        graph = _capture(fn, calls, stream)
    return statistics.median(_replay_ms(graph, calls, 1) for _ in range(replays))


def _capture(fn: Callable[[], Any], calls: int, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` calls of ``fn``, in a memory pool of its own; on failure the pool
    is released before the error propagates (where the graph does not release it: releasing it
    twice aborts the process)."""
    graph = torch.cuda.CUDAGraph()
    pool = torch.cuda.graph_pool_handle()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            for _ in range(calls):
                fn()
    except BaseException:
        device = torch.cuda.current_device()
        try:
            torch._C._cuda_endAllocateToPool(device, pool)
        except RuntimeError:
            pass  # the capture got as far as ending it: the graph releases its pool itself
        else:
            torch._C._cuda_releasePool(device, pool)
        raise
    return graph


def _replay_ms(graph: torch.cuda.CUDAGraph, calls: int, times: int) -> float:
    """Milliseconds per call of ``times`` replays of ``graph`` (of ``calls`` calls)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(times):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (times * calls)


def _sync() -> None:
    """Wait for the accelerator, if there is one."""
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()


def host_us(run: Callable[[], Any], calls: int = 100, rounds: int = 5) -> float:
    """Host time of one call in microseconds: the wall clock of ``calls`` back-to-back calls with
    nothing synchronized inside (the median of ``rounds``). For a call whose kernels are shorter
    than its launch, this is what the call costs."""
    run()
    _sync()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            run()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        _sync()
    return statistics.median(samples)


@dataclass(frozen=True)
class Ceilings:
    """What the device can do, measured in the same run: copy GB/s (read + write) and bf16 TFLOP/s."""

    copy_gbps: float
    matmul_tflops: float

    @staticmethod
    def measure(device: torch.device) -> Ceilings:
        big = device.type != "cpu"
        n = (512 << 20) // 4 if big else (64 << 20) // 4
        src = torch.randn(n, device=device)
        dst = torch.empty_like(src)
        copy_ms = time_ms(lambda: dst.copy_(src), device)
        m = 8192 if big else 1024
        dtype = torch.bfloat16 if big else torch.float32
        a, b = torch.randn(m, m, device=device, dtype=dtype), torch.randn(m, m, device=device, dtype=dtype)
        mm_ms = time_ms(lambda: a @ b, device)
        return Ceilings(2 * src.numel() * 4 / copy_ms / 1e6, 2 * m**3 / mm_ms / 1e9)


@dataclass
class Measurement:
    """One kernel at one shape in one mode: the times of the backend and its peers (ms), what the
    backend achieved, and what went wrong (``wrong``: the backend; ``errors``: a peer)."""

    kernel: str
    case: str
    dtype: str
    mode: str
    ms: dict[str, float] = field(default_factory=dict)
    gbps: float = 0.0
    tflops: float = 0.0
    ceiling_fraction: float = 0.0
    bound: str = ""
    library: str = ""
    wrong: str = ""
    sweep: str = ""
    flops: float = 0.0
    nbytes: float = 0.0
    libraries: dict[str, float] = field(default_factory=dict)
    """Every library's time; ``ms["library"]`` is the fastest."""
    errors: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    """Wall time this measurement took (compiling included)."""
    skipped: str = ""
    """Why it was not measured (the sweep's time limit), where it was not."""
    spread: dict[str, float] = field(default_factory=dict)
    """Per implementation (backend, eager, compile, each library by name): how far its `ROUNDS`
    timings lay apart, (slowest − fastest) / median; 0 from one round. A ratio nearer 1 than
    these is within the run's own noise."""

    def speedup(self, other: str) -> float | None:
        """How many times faster the backend is than ``other`` (above 1: the backend wins)."""
        if other not in self.ms or "backend" not in self.ms:
            return None
        return self.ms[other] / self.ms["backend"]

    def best_peer(self) -> tuple[str, float] | None:
        """The fastest peer and the backend's speedup over it."""
        peers = [(self.ms[p], p) for p in PEERS if p in self.ms]
        if not peers or "backend" not in self.ms:
            return None
        ms, name = min(peers)
        return (self.library if name == "library" else name), ms / self.ms["backend"]


def _prepare(spec: KernelSpec, case: Case, dtype: torch.dtype, device: torch.device, seed: int) -> dict[str, Any]:
    """The case's inputs, drawn on ``device`` itself (large shapes never pass through the host)."""
    g = torch.Generator(device).manual_seed(seed)
    with torch.device(device):
        args = case.make(g, dtype)
    return to_device(args, device)


def _runner(call: Callable[..., Any], spec: KernelSpec, args: dict[str, Any], mode: str) -> Callable[[], Any]:
    if mode == "fwd":
        return lambda: call(**args)
    names = [n for n in spec.differentiable if isinstance(args[n], torch.Tensor)]
    leaves = {k: (v.detach().requires_grad_(True) if k in names else v) for k, v in args.items()}
    outs = [o for o in as_tuple(call(**leaves)) if o.requires_grad]
    # a scalar output is a loss: its gradient is 1, as in loss.backward()
    grads = [torch.ones_like(o) if o.dim() == 0 else torch.randn_like(o) for o in outs]

    def run() -> Any:
        outs = [o for o in as_tuple(call(**leaves)) if o.requires_grad]
        return torch.autograd.grad(outs, [leaves[n] for n in names], grads, allow_unused=True)

    return run


def eager_call(spec: KernelSpec, backend: Backend) -> Callable[..., Any]:
    """torch eager: the contract's reference math as plain PyTorch ops (no custom op around it)."""

    def call(**kw: Any) -> Any:
        values = spec.forward_values(spec.check((), kw, backend.dtypes), torch.is_grad_enabled())
        return as_tuple(spec.forward(*values))[: len(spec.outputs)]

    return call


# ---------------------------------------------------------------------------------------------
# The libraries: each takes the contract's arguments (checked and in order).

_COMPILED: dict[str, Callable[..., Any]] = {}


def _compiled(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile(fn)``, made once per process (shapes recompile as torch does for a user)."""
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fn)
    return _COMPILED[name]


def _sdpa(q, k, v, causal, scale):
    """SDPA with the contract's causal alignment (bottom-right: the queries are the last positions
    of the keys); SDPA's ``is_causal`` aligns top-left, the same only when Sq = Skv."""
    import torch.nn.functional as F

    sq, skv = q.shape[-2], k.shape[-2]
    mask = None
    if causal and sq != skv and sq > 1:
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(sq, skv)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and sq == skv, scale=scale,
                                          enable_gqa=True)


def _sdpa_backends() -> dict[str, Callable[..., Any]]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def with_backend(b: SDPBackend) -> Callable[..., Any]:
        def call(q, k, v, causal, scale):
            with sdpa_kernel([b]):
                return _sdpa(q, k, v, causal, scale)
        return call

    return {f"SDPA {n}": with_backend(b) for n, b in (
        ("cuDNN", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION))}


def _grouped_loop(x_sorted, offsets, weight):
    """One cuBLAS product per expert over its rows (the offsets read back to the host, as a loop must)."""
    ends = offsets.tolist()
    out = x_sorted.new_zeros(x_sorted.shape[0], weight.shape[1])
    for e in range(weight.shape[0]):
        if ends[e + 1] > ends[e]:
            out[ends[e]:ends[e + 1]] = x_sorted[ends[e]:ends[e + 1]] @ weight[e].t()
    return out


def _grouped_mm(x_sorted, offsets, weight):
    """``torch._grouped_mm`` (the experts' ends as offsets; rows start at offsets[0] = 0)."""
    return torch._grouped_mm(x_sorted, weight.transpose(-2, -1), offs=offsets[1:])


def libraries(kernel: str) -> tuple[dict[str, Callable[..., Any]], str]:
    """The library functions present for ``kernel`` (by name, taking the contract's arguments) and,
    where the kernel's library is missing, why (e.g. "Liger not installed")."""
    import torch.nn.functional as F

    acts = {None: lambda t: t, "relu": F.relu, "gelu": F.gelu, "silu": F.silu,
            "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}

    def cublas_act(x, weight, bias, activation):
        return acts[activation](F.linear(x, weight, bias))

    def scaled_mm(xq, x_scale, wq, w_scale, bias, out_dtype):
        return torch._scaled_mm(xq, wq.t(), x_scale, w_scale.reshape(1, -1) if w_scale.dim() else w_scale,
                                bias=bias, out_dtype=out_dtype)

    native: dict[str, Callable[[], dict[str, Callable[..., Any]]]] = {
        "attention": _sdpa_backends,
        "linear": lambda: {"cuBLAS+act": cublas_act, "compile(cuBLAS+act)": _compiled("linear", cublas_act)},
        "fp8_linear": lambda: {"_scaled_mm": scaled_mm},
        "grouped_linear": lambda: {"cuBLAS loop": _grouped_loop, "_grouped_mm": _grouped_mm},
    }
    if kernel in native:
        return native[kernel](), ""
    if kernel not in LIGER:
        return {}, ""
    try:
        from liger_kernel.transformers import functional as lg
    except ImportError:
        return {}, "n/a: Liger not installed"

    def rope(q, k, cos, sin):
        return lg.liger_rope(q, k, cos[None] if cos.dim() == 2 else cos, sin[None] if sin.dim() == 2 else sin)

    liger: dict[str, Callable[..., Any]] = {
        "rms_norm": lambda x, weight, eps: lg.liger_rms_norm(x, weight, eps, in_place=False),
        "add_rms_norm": lambda x, residual, weight, eps: lg.liger_fused_add_rms_norm(
            x, residual, weight, eps, in_place=False),
        "layer_norm": lambda x, weight, bias, eps: lg.liger_layer_norm(x, weight, bias, eps),
        "softmax": lambda x, dim: lg.liger_softmax(x),
        "swiglu": lambda gate, up: lg.liger_swiglu(gate, up),
        "geglu": lambda gate, up, approximate: lg.liger_geglu(gate, up),
        "rope": rope,
        "cross_entropy": lambda logits, target, ignore_index, label_smoothing, reduction: lg.liger_cross_entropy(
            logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction),
        "linear_cross_entropy": lambda hidden, weight, target, bias, ignore_index, reduction:
            lg.liger_fused_linear_cross_entropy(hidden, weight, target, bias, ignore_index=ignore_index,
                                                reduction=reduction),
    }
    return {"Liger": liger[kernel]}, ""


# ---------------------------------------------------------------------------------------------
# One measurement.


def _agrees(spec: KernelSpec, got: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...],
            dtype: torch.dtype) -> str:
    """Why ``got`` disagrees with eager's ``expected`` (empty when it agrees)."""
    for name, out, ref in zip(spec.outputs, got, expected):
        tol = default_tolerance(out.dtype if out.dtype.itemsize == 1 and out.is_floating_point() else dtype)
        check = compare(name, out, ref, tol)
        if not check.ok:
            return check.message
    return ""


def _message(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def measure(backend: Backend, spec: KernelSpec, case: Case, dtype: torch.dtype, mode: str,
            ceilings: Ceilings, compare_with: tuple[str, ...] = ("eager", "compile"), seed: int = 0) -> Measurement:
    """Time ``spec`` at ``case`` on ``backend`` and the ``compare_with`` peers ("eager", "compile",
    "library"), torch.compile compiling this shape alone."""
    device = backend.device()
    args = _prepare(spec, case, dtype, device, seed)
    return measure_args(backend, spec, args, case.name, dtype, mode, ceilings, compare_with)


def measure_args(backend: Backend, spec: KernelSpec, args: dict[str, Any], label: str, dtype: torch.dtype,
                 mode: str, ceilings: Ceilings, compare_with: tuple[str, ...], warmup: float = 25,
                 rep: float = 100, compile_once: bool = False, graphs: bool = False) -> Measurement:
    """`measure` at prepared inputs ``args``. ``compile_once`` keeps one compiled function per
    kernel across shapes (torch's automatic dynamic shapes, as a user gets; compiling each shape
    anew would not fit a sweep in minutes) instead of compiling this shape alone. ``graphs``: every
    implementation replayed from a CUDA graph (`time_ms`); one that cannot be captured is left out
    with its error (kpt's own: a failure)."""
    device = backend.device()
    result = Measurement(spec.name, label, str(dtype).removeprefix("torch."), mode)
    eager = eager_call(spec, backend)
    with torch.no_grad():
        got = as_tuple(backend.call(spec.name, **args))
        expected = as_tuple(eager(**args))
    result.wrong = _agrees(spec, got, expected, dtype)
    if result.wrong:
        return result
    impls: dict[str, Callable[..., Any]] = {"backend": lambda **kw: backend.call(spec.name, **kw)}
    if "eager" in compare_with:
        impls["eager"] = eager
    if "compile" in compare_with:
        if compile_once:
            impls["compile"] = _compiled(f"eager {spec.name}", eager)
        else:
            # every kernel's eager function shares one code object: without a reset, the compiler's
            # recompile limit would quietly run later kernels eagerly
            torch._dynamo.reset()
            impls["compile"] = torch.compile(eager, dynamic=False)
    found: dict[str, Callable[..., Any]] = {}
    if "library" in compare_with and device.type == "cuda":
        found, result.library = libraries(spec.name)
    for name, fn in found.items():
        def call(fn=fn, **kw: Any) -> Any:
            return fn(**spec.check((), kw, backend.dtypes))
        try:
            with torch.no_grad():
                wrong = _agrees(spec, as_tuple(call(**args)), expected, dtype)
        except Exception as exc:  # a library that cannot take this shape is left out, with why
            wrong = _message(exc)
        if wrong:
            result.errors[name] = wrong
        else:
            impls[name] = call
    # one call of each first (torch.compile compiles there), then the device is brought back to
    # its clocks (it idles while the host compiles), then each is timed
    runners: dict[str, Callable[[], Any]] = {}
    for name, call in impls.items():
        try:
            runners[name] = _runner(call, spec, args, mode)
            runners[name]()
        except Exception as exc:  # one peer's failure must not hide the others' numbers
            if name == "backend":
                result.wrong = _message(exc)
                return result
            result.errors[name] = _message(exc)
            runners.pop(name, None)
    _busy(device)
    samples: dict[str, list[float]] = {name: [] for name in runners}
    rounds = 1 if device.type == "cpu" else ROUNDS
    for turn in range(rounds):
        names = list(runners)
        for name in names[turn % len(names):] + names[:turn % len(names)]:
            try:
                samples[name].append(time_ms(runners[name], device, warmup / rounds, rep / rounds, graphs))
            except Exception as exc:
                if name == "backend":
                    result.wrong = _message(exc)
                    return result
                result.errors[name] = _message(exc)
                del runners[name]
    for name in runners:
        ms = statistics.median(samples[name])
        result.spread[name] = (max(samples[name]) - min(samples[name])) / ms if ms > 0 else 0.0
        if name in found:
            result.libraries[name] = ms
        else:
            result.ms[name] = ms
    if result.libraries:
        result.library, result.ms["library"] = min(result.libraries.items(), key=lambda kv: kv[1])
    _cost(result, spec, spec.check((), args, backend.dtypes), got, mode, ceilings)
    return result


ROUNDS = 3
"""Each implementation of a shape is timed in this many rounds of a third of the time each, taking
turns in a rotating order, and its median kept. A card's clocks drift under a sustained load (on an
H100 one cuBLAS product took 2.49 to 2.79 ms from one run to the next, `benchmarks/h100-2026-11-26b.md`):
timed one after another, the implementations would each get a different part of that drift. On a
CPU (tests), one round."""


def _busy(device: torch.device, ms: float = 10.0) -> None:
    """Keep the device busy with matrix products for about ``ms`` milliseconds (clocks up)."""
    if device.type == "cpu":
        return
    a = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)
    start = time.perf_counter()
    while (time.perf_counter() - start) * 1e3 < ms:
        for _ in range(20):
            a @ a
        torch.accelerator.synchronize()


def _cost(result: Measurement, spec: KernelSpec, values: dict[str, Any], got: tuple[torch.Tensor, ...],
          mode: str, ceilings: Ceilings) -> None:
    """What the backend achieved: GB/s and TFLOP/s from the cost model, the bound and its fraction."""
    nbytes = spec.min_bytes(values, got)
    flops = spec.flops(values)
    if mode == "fwd+bwd":
        grads = [values[n] for n in spec.differentiable if isinstance(values[n], torch.Tensor)]
        if spec.needs_grad_arg:
            # the forward can prepare the gradients while it reads the inputs: each gradient
            # written once is all the backward adds
            nbytes += nbytes_of(*grads)
        else:
            # the backward reads the inputs and the output gradients once and writes the input gradients
            nbytes += spec.min_bytes(values, got) + nbytes_of(*grads)
        flops *= 3  # a product's backward is two products of the forward's size
    seconds = result.ms["backend"] / 1e3
    result.flops, result.nbytes = float(flops), float(nbytes)
    result.gbps = nbytes / seconds / 1e9
    result.tflops = flops / seconds / 1e12
    memory_floor = nbytes / (ceilings.copy_gbps * 1e9)
    compute_floor = flops / (ceilings.matmul_tflops * 1e12)
    result.bound = "memory" if memory_floor >= compute_floor else "compute"
    result.ceiling_fraction = max(memory_floor, compute_floor) / seconds


def perf_cases(spec: KernelSpec) -> list[Case]:
    return [c for c in spec.cases() if c.perf]


# ---------------------------------------------------------------------------------------------
# The host's share: one small call's wall time, beside an empty kernel's launch.


@dataclass
class HostCost:
    """Host microseconds of one forward call of ``kernel`` at its smallest shape of the sweep."""

    kernel: str
    case: str
    us: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


def _empty_triton(t: torch.Tensor) -> Callable[[], Any]:
    """The launch of a Triton kernel that does nothing (one pointer argument), through Triton's
    Python launch path."""
    import triton

    @triton.jit
    def empty(x):
        pass

    return lambda: empty[(1,)](t)


def baselines(device: torch.device) -> dict[str, float | str]:
    """Host microseconds of the cheapest calls: a one-element torch op and an empty Triton kernel."""
    one = torch.zeros(1, device=device)
    out: dict[str, float | str] = {"torch op": host_us(lambda: torch.neg(one))}
    try:
        out["empty Triton kernel"] = host_us(_empty_triton(one))
    except Exception as exc:  # no Triton, or no Triton for this device
        out["empty Triton kernel"] = _message(exc)
    return out


SMALL_CALL_S = 0.005
"""A call that takes longer than this (synchronized) has no host cost worth measuring: the device's
time is its cost."""


def host_cost(backend: Backend, spec: KernelSpec, args: dict[str, Any], label: str) -> HostCost:
    """Host time of one forward call of the backend, eager and each library present."""
    cost = HostCost(spec.name, label)
    impls: dict[str, Callable[..., Any]] = {"backend": lambda **kw: backend.call(spec.name, **kw),
                                            "eager": eager_call(spec, backend)}
    for name, fn in libraries(spec.name)[0].items():
        impls[name] = lambda fn=fn, **kw: fn(**spec.check((), kw, backend.dtypes))
    for name, call in impls.items():
        try:
            call(**args)  # compiled or tuned before it is timed
            start = time.perf_counter()
            call(**args)
            _sync()
            once = time.perf_counter() - start
            if once > SMALL_CALL_S:
                cost.errors[name] = f"not a small call ({once * 1e3:.1f} ms)"
                continue
            cost.us[name] = host_us(functools.partial(call, **args))
        except Exception as exc:
            cost.errors[name] = _message(exc)
    return cost


# ---------------------------------------------------------------------------------------------
# A sweep, its summary and its report.


def _progress(items: list[Point], quiet: bool) -> Iterator[tuple[Point, Callable[[str], None]]]:
    """Each item with a print function: under a rich progress bar when rich is installed."""
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        for item in items:
            yield item, (lambda line: None) if quiet else (lambda line: print(line, flush=True))
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task("kpt bench", total=len(items))
        for item in items:
            bar.update(task, description=f"{item.kernel} {item.case.name}"[:60])
            yield item, (lambda line: None) if quiet else (lambda line: print(line, flush=True))
            bar.advance(task)


def _by_kernel(points: list[Point]) -> list[Point]:
    """``points`` grouped by kernel (in order of first appearance), so compiled code is reset once
    per kernel."""
    order = {k: i for i, k in reversed(list(enumerate(p.kernel for p in points)))}
    return sorted(points, key=lambda p: order[p.kernel])


def _args_bytes(args: dict[str, Any]) -> int:
    return nbytes_of(*(v for v in args.values() if isinstance(v, torch.Tensor)))


def run_sweep(backend: Backend, points: list[Point], dtype: torch.dtype, ceilings: Ceilings, *,
              no_compile: bool = False, warmup: float = 5, rep: float = 25, host: bool = True,
              quiet: bool = False, time_limit: float | None = None,
              graphs: bool = False) -> tuple[list[Measurement], list[HostCost]]:
    """Measure every point of a sweep in every mode (``graphs``: replayed from CUDA graphs, see
    `time_ms`); then the host cost of each kernel's smallest point. A failure (wrong result, error,
    out of memory) is recorded at its point, and the sweep goes on. Points not started within
    ``time_limit`` seconds are recorded as skipped."""
    device = backend.device()
    results: list[Measurement] = []
    smallest: dict[str, tuple[int, str, dict[str, Any]]] = {}
    last_kernel = None
    deadline = time.perf_counter() + time_limit if time_limit else None
    for p, say in _progress(_by_kernel(points), quiet):
        spec = SPECS[p.kernel]
        dt = p.dtype or dtype
        if deadline is not None and time.perf_counter() > deadline:
            for mode in p.modes:
                results.append(Measurement(p.kernel, p.case.name, str(dt).removeprefix("torch."), mode, sweep=p.sweep,
                                           skipped=f"the time limit of {time_limit:.0f} s was reached"))
            continue
        if p.kernel != last_kernel:
            torch._dynamo.reset()
            _COMPILED.pop(f"eager {last_kernel}", None)
            last_kernel = p.kernel
        peers = tuple(x for x in p.peers if not (no_compile and x == "compile"))
        try:
            args = _prepare(spec, p.case, dt, device, seed=len(results))
        except Exception as exc:
            args = None
            failure = _message(exc)
        for mode in p.modes:
            if args is None:
                r = Measurement(p.kernel, p.case.name, str(dt).removeprefix("torch."), mode, wrong=failure)
            else:
                started = time.perf_counter()
                try:
                    r = measure_args(backend, spec, args, p.case.name, dt, mode, ceilings, peers, warmup, rep,
                                     compile_once=True, graphs=graphs)
                except Exception as exc:  # one shape's failure must not hide the others' numbers
                    r = Measurement(p.kernel, p.case.name, str(dt).removeprefix("torch."), mode, wrong=_message(exc))
                r.seconds = time.perf_counter() - started
            r.sweep = p.sweep
            results.append(r)
            say(f"{row(r)} {r.seconds:.1f} s")
        if args is not None and host:
            size = _args_bytes(args)
            if p.kernel not in smallest or size < smallest[p.kernel][0]:
                smallest[p.kernel] = (size, p.case.name, args)
        del args
        if device.type == "cuda":
            torch.cuda.empty_cache()
    costs = []
    for kernel, (_, label, args) in smallest.items():
        try:
            costs.append(host_cost(backend, SPECS[kernel], args, label))
        except Exception as exc:
            costs.append(HostCost(kernel, label, errors={"backend": _message(exc)}))
    return results, costs


def worst(results: Iterable[Measurement]) -> dict[str, dict[str, Any]]:
    """Per kernel: the shape and mode where it does worst against its best peer (the ratio: the
    peer's time over the backend's, and ``spread``: the backend's and that peer's round spreads
    there, `Measurement.spread`), how many timings it had, and how many were wrong or failed."""
    out: dict[str, dict[str, Any]] = {}
    for r in results:
        s = out.setdefault(r.kernel, {"timings": 0, "wrong": 0, "ratio": None, "case": "", "mode": "", "peer": "",
                                      "spread": None, "seconds": 0.0})
        s["timings"] += 1
        s["seconds"] += r.seconds
        if r.skipped:
            s["skipped"] = s.get("skipped", 0) + 1
            continue
        if r.wrong:
            s["wrong"] += 1
            continue
        best = r.best_peer()
        if best is not None and (s["ratio"] is None or best[1] < s["ratio"]):
            spread = (r.spread["backend"], r.spread[best[0]]) if {"backend", best[0]} <= r.spread.keys() else None
            s.update(ratio=best[1], case=r.case, mode=r.mode, peer=best[0], spread=spread)
    return out


def _spread(value: tuple[float, float] | None) -> str:
    return "–" if value is None else f"{value[0]:.1%} / {value[1]:.1%}"


def _ms(r: Measurement, key: str) -> str:
    if key == "library" and "library" not in r.ms:
        return r.library or "–"
    if key not in r.ms:
        return "–"
    return f"{r.ms[key]:.4f}" + (f" ({r.library})" if key == "library" else "")


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


HEADER = ("| kernel | shape | dtype | mode | kpt ms | eager ms | compile ms | library ms | × eager | × compile "
          "| × library | × best | GB/s | TFLOP/s | of ceiling |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def row(r: Measurement) -> str:
    """One measurement as a row of `HEADER`'s table (× peer: the peer's time over kpt's)."""
    if r.wrong or r.skipped:
        what = f"WRONG: {r.wrong}" if r.wrong else f"SKIPPED: {r.skipped}"
        return f"| {r.kernel} | {r.case} | {r.dtype} | {r.mode} | {what} |||||||||| "
    best = r.best_peer()
    ms = " | ".join(_ms(r, k) for k in ("backend", *PEERS))
    ratios = " | ".join(_ratio(r.speedup(k)) for k in PEERS)
    return (f"| {r.kernel} | {r.case} | {r.dtype} | {r.mode} | {ms} | {ratios} | {_ratio(best and best[1])} "
            f"| {r.gbps:.0f} | {r.tflops:.1f} | {r.ceiling_fraction:.0%} ({r.bound}) |")


def markdown(results: list[Measurement], env: dict[str, str], ceilings: Ceilings,
             host: list[HostCost] | None = None, base: dict[str, float | str] | None = None,
             title: str = "") -> str:
    """The report: environment and ceilings, each kernel's worst ratio, the host costs, every row."""
    lines = [title, ""] if title else []
    lines += [
        "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()) + ".",
        f"Ceilings measured in this run: copy {ceilings.copy_gbps:.0f} GB/s, "
        f"matmul {ceilings.matmul_tflops:.0f} TFLOP/s.",
        "Ratios are the peer's time over kpt's: above 1, kpt is faster. × best: against the fastest of "
        "eager, compile and the libraries.", "",
    ]
    summary = worst(results)
    if summary:
        lines += ["| kernel | timings | wrong or failed | skipped | worst × best | at | mode | best peer there "
                  "| round spread there, kpt / peer | seconds |", "|---|---|---|---|---|---|---|---|---|---|"]
        for kernel, s in summary.items():
            lines.append(f"| {kernel} | {s['timings']} | {s['wrong']} | {s.get('skipped', 0)} | {_ratio(s['ratio'])} "
                         f"| {s['case'] or '–'} | {s['mode'] or '–'} | {s['peer'] or '–'} | {_spread(s['spread'])} "
                         f"| {s['seconds']:.0f} |")
        lines += ["", "Round spread: how far an implementation's timings in the rounds that take turns lay "
                  "apart, (slowest − fastest) / median; a worst ratio nearer 1 than it is within the run's noise.",
                  ""]
    if host:
        lines += ["Host time of one forward call (µs, wall clock of back-to-back calls) at each kernel's "
                  "smallest shape; baselines: " + ", ".join(
                      f"{k} {v:.1f} µs" if isinstance(v, float) else f"{k}: {v}" for k, v in (base or {}).items())
                  + ".", "",
                  "| kernel | shape | kpt µs | eager µs | libraries µs |", "|---|---|---|---|---|"]
        for c in host:
            libs = ", ".join(f"{k} {v:.1f}" for k, v in c.us.items() if k not in ("backend", "eager"))
            cells = [f"{c.us[k]:.1f}" if k in c.us else c.errors.get(k, "–") for k in ("backend", "eager")]
            lines.append(f"| {c.kernel} | {c.case} | {' | '.join(cells)} | {libs or '–'} |")
        lines.append("")
    lines += [HEADER, *(row(r) for r in results)]
    errors = [(r, k, v) for r in results for k, v in r.errors.items()]
    if errors:
        lines += ["", "Peers left out (an error, or a result that disagreed with eager):", ""]
        lines += [f"- {r.kernel} {r.case} {r.mode}: {k}: {v}" for r, k, v in errors]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# The command line (also `kpt bench`).


TIME_LIMIT = 270.0
"""The default time limit of a sweep other than perf: with start-up, ceilings and the host costs,
a run stays within five minutes."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m kpt.benchmark`` and ``kpt bench``."""
    parser.add_argument("--backend", default=None, help="backend name (default: kpt.get_backend())")
    parser.add_argument("--kernels", default=None, help="comma-separated kernel names (default: every kernel)")
    parser.add_argument("--sweep", default="perf", choices=[*SWEEPS, "all"],
                        help="the shapes: perf (docs/performance.md), models (real models' sizes), attention, linear, "
                             "or all but perf (default: perf)")
    parser.add_argument("--dtype", default="bfloat16", help="the dtype where a shape names none")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile (saves compile time)")
    parser.add_argument("--no-host", action="store_true", help="skip the host cost of small calls")
    parser.add_argument("--graphs", action="store_true",
                        help="time every implementation replayed from a CUDA graph (no host time, no L2 flush): "
                             "what a serving loop that captures its step sees; the default times calls as "
                             "eager code makes them")
    parser.add_argument("--rep-ms", type=float, default=None,
                        help="timing per implementation and shape (default: 100 ms for perf, 20 for the others)")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds after which the shapes not yet started are recorded as skipped "
                             f"(default: none for perf, {TIME_LIMIT:.0f} for the other sweeps; 0: none)")
    parser.add_argument("--out", default="reports/bench", help="directory for bench.json and bench.md")
    parser.add_argument("--plot", action="store_true", help="also write roofline.png (needs matplotlib)")
    parser.add_argument("--list", action="store_true", help="print the sweep's shapes and stop (no GPU needed)")
    parser.add_argument("--quiet", action="store_true", help="no row per timing while it runs")


def run(opts: argparse.Namespace) -> int:
    """Run the sweep ``opts`` names and write ``bench.json`` and ``bench.md`` (and ``roofline.png``)."""
    kernels = [k.strip() for k in opts.kernels.split(",")] if opts.kernels else None
    unknown = sorted(set(kernels or ()) - set(SPECS))
    if unknown:
        sys.exit(f"unknown kernels: {', '.join(unknown)}; the kernels are: {', '.join(SPECS)}")
    points = sweep([opts.sweep], kernels)
    if opts.list:
        for p in points:
            print(f"{p.kernel}: {p.case.name} [{', '.join(p.modes)}]")
        print(f"{len(points)} shapes, {sum(len(p.modes) for p in points)} timings")
        return 0
    if opts.plot:
        from .roofline import require_matplotlib

        require_matplotlib()
    if not torch.accelerator.is_available():
        sys.exit("kpt bench times kernels on a GPU, and this machine has none that torch can use "
                 "(torch.accelerator.is_available() is False). Run it where the backend's GPU is; "
                 "--list shows the shapes here.")
    backend = get_backend(opts.backend)
    device = backend.device()
    if device.type == "cpu":
        sys.exit(f"kpt bench times kernels on a GPU, and backend {backend.name!r} runs on the CPU: "
                 "name a GPU backend with --backend (kpt info lists them).")
    if opts.graphs and device.type != "cuda":
        sys.exit(f"--graphs replays CUDA graphs; backend {backend.name!r} runs on {device.type}")
    dtype = getattr(torch, opts.dtype)
    started = time.perf_counter()
    ceilings = Ceilings.measure(device)
    rep = opts.rep_ms if opts.rep_ms is not None else (100.0 if opts.sweep == "perf" else 20.0)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    limit = opts.time_limit if opts.time_limit is not None else (None if opts.sweep == "perf" else TIME_LIMIT)
    results, costs = run_sweep(backend, points, dtype, ceilings, no_compile=opts.no_compile, warmup=rep / 4,
                               rep=rep, host=not opts.no_host, quiet=opts.quiet, time_limit=limit or None,
                               graphs=opts.graphs)
    base = baselines(device) if not opts.no_host else {}
    wall = time.perf_counter() - started
    env = backend.environment()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"schema_version": SCHEMA_VERSION, "backend": backend.name, **provenance(device),
              "environment": env, "ceilings": asdict(ceilings), "sweep": opts.sweep,
              "timing": "CUDA-graph replays" if opts.graphs else "calls", "shapes": len(points),
              "timings": len(results), "wall_s": wall, "worst": worst(results),
              "host_baselines_us": base, "host_us": [asdict(c) for c in costs],
              "results": [asdict(r) for r in results]}
    (out / "bench.json").write_text(json.dumps(report, indent=1))
    timing = ", every implementation replayed from CUDA graphs" if opts.graphs else ""
    title = (f"kpt benchmark, sweep {opts.sweep}{timing}: {len(points)} shapes, {len(results)} timings, "
             f"{sum(1 for r in results if r.wrong)} wrong or failed, "
             f"{sum(1 for r in results if r.skipped)} skipped at the time limit, {wall:.0f} s.")
    table = markdown(results, env, ceilings, costs, base, title)
    (out / "bench.md").write_text(table)
    if opts.plot:
        from .roofline import plot

        plot(report, out / "roofline.png")
    print(table if opts.quiet else title)
    print(f"wrote {out / 'bench.json'} and {out / 'bench.md'}" + (f" and {out / 'roofline.png'}" if opts.plot else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kpt.benchmark", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
