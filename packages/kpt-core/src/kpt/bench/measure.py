"""One kernel at one shape in one mode, timed beside its peers and gated on correctness.

`measure` (or `measure_args` at inputs already drawn) checks the backend's result against torch
eager, times the backend and each peer in rounds that take turns (`ROUNDS`), and returns a
`Measurement`: the times, what the backend achieved by the spec's cost model (GB/s, TFLOP/s, the
fraction of the `Ceilings`) and what went wrong. A backend result that disagrees with eager is
reported as wrong, with no speed; a library that disagrees is left out, with why.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..backend import Backend
from ..ops import as_tuple
from ..spec import Case, KernelSpec
from ..spec import nbytes as nbytes_of
from ..testing import compare, to_device
from ..tolerance import default_tolerance
from .peers import PEERS, compiled, eager_call, libraries
from .timing import Ceilings, time_ms


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


def draw_inputs(spec: KernelSpec, case: Case, dtype: torch.dtype, device: torch.device,
                seed: int) -> dict[str, Any]:
    """The case's inputs, drawn on ``device`` itself (large shapes never pass through the host)."""
    g = torch.Generator(device).manual_seed(seed)
    with torch.device(device):
        args = case.make(g, dtype)
    return to_device(args, device)


def make_runner(call: Callable[..., Any], spec: KernelSpec, args: dict[str, Any],
                mode: str) -> Callable[[], Any]:
    """``call`` at ``args`` as a function of nothing: the forward (mode "fwd"), or the forward and the
    gradients of the differentiable inputs from fixed random output gradients, 1 for a scalar loss (mode
    "fwd+bwd")."""
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


def _agrees(spec: KernelSpec, got: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...],
            dtype: torch.dtype) -> str:
    """Why ``got`` disagrees with eager's ``expected`` (empty when it agrees)."""
    for name, out, ref in zip(spec.outputs, got, expected):
        tol = default_tolerance(out.dtype if out.dtype.itemsize == 1 and out.is_floating_point() else dtype)
        check = compare(name, out, ref, tol)
        if not check.ok:
            return check.message
    return ""


def error_line(exc: BaseException) -> str:
    """``exc`` as one line: its type and the first line of its message, at most 300 characters."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def measure(backend: Backend, spec: KernelSpec, case: Case, dtype: torch.dtype, mode: str,
            ceilings: Ceilings, compare_with: tuple[str, ...] = ("eager", "compile"), seed: int = 0) -> Measurement:
    """Time ``spec`` at ``case`` on ``backend`` and the ``compare_with`` peers ("eager", "compile",
    "library"), torch.compile compiling this shape alone."""
    device = backend.device()
    args = draw_inputs(spec, case, dtype, device, seed)
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
            impls["compile"] = compiled(f"eager {spec.name}", eager)
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
            wrong = error_line(exc)
        if wrong:
            result.errors[name] = wrong
        else:
            impls[name] = call
    # one call of each first (torch.compile compiles there), then the device is brought back to
    # its clocks (it idles while the host compiles), then each is timed
    runners: dict[str, Callable[[], Any]] = {}
    for name, call in impls.items():
        try:
            runners[name] = make_runner(call, spec, args, mode)
            runners[name]()
        except Exception as exc:  # one peer's failure must not hide the others' numbers
            if name == "backend":
                result.wrong = error_line(exc)
                return result
            result.errors[name] = error_line(exc)
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
                    result.wrong = error_line(exc)
                    return result
                result.errors[name] = error_line(exc)
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
    """The cases of ``spec`` marked ``perf``: its docs/performance.md shapes."""
    return [c for c in spec.cases() if c.perf]
