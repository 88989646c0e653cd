"""Measuring kernels side by side, the docs/performance.md way.

    python -m kpt.benchmark --backend cuda --out reports/bench

For each kernel's perf case (the docs/performance.md shape) it times, on the backend's device, the backend,
torch eager (the contract's reference math, run as plain PyTorch), torch.compile of the same math
and the best library present (SDPA, cuBLAS, Liger-Kernel where installed), forward and
forward+backward (random output gradients; 1 for a scalar loss, as ``loss.backward()`` gives).
It reports time, achieved GB/s or TFLOP/s from the spec's cost model, and the fraction of the
ceilings measured in the same run (device-to-device copy bandwidth, bf16 matrix product). Every
timing is gated on correctness: a backend result that disagrees with eager at the perf shape is
reported as wrong, with no speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
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
from .testing import compare, to_device
from .tolerance import default_tolerance

MODES = ("fwd", "fwd+bwd")
SCHEMA_VERSION = 1
"""Of ``bench.json``: ``{"schema_version", "backend", "versions", "device", "machine", "timestamp"}``
(`kpt.overview.provenance`), then ``"environment"`` (the backend's facts), ``"ceilings"`` and
``"results"`` (one `Measurement` each)."""


def time_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """Median time of ``fn`` in milliseconds: device events after warm-up on GPUs, wall clock on CPUs."""
    if device.type == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError:
            do_bench = None
        if do_bench is not None:
            return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
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

    def speedup(self, other: str) -> float | None:
        if other not in self.ms or "backend" not in self.ms:
            return None
        return self.ms[other] / self.ms["backend"]


def _prepare(spec: KernelSpec, case: Case, dtype: torch.dtype, device: torch.device, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return to_device(case.make(g, dtype), device)


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


def library_call(kernel: str) -> tuple[str, Callable[..., Any]] | None:
    """The best library function present for ``kernel``, taking the contract's arguments:
    cuDNN/FlashAttention through SDPA, cuBLAS (``torch._scaled_mm`` for FP8), else Liger-Kernel."""
    import torch.nn.functional as F

    acts = {None: lambda t: t, "relu": F.relu, "gelu": F.gelu, "silu": F.silu,
            "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}

    def sdpa(q, k, v, causal, scale):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)

    def scaled_mm(xq, x_scale, wq, w_scale, bias, out_dtype):
        return torch._scaled_mm(xq, wq.t(), x_scale, w_scale.reshape(1, -1) if w_scale.dim() else w_scale,
                                bias=bias, out_dtype=out_dtype)

    native: dict[str, tuple[str, Callable[..., Any]]] = {
        "attention": ("SDPA", sdpa),
        "linear": ("cuBLAS+act", lambda x, weight, bias, activation: acts[activation](F.linear(x, weight, bias))),
        "fp8_linear": ("_scaled_mm", scaled_mm),
    }
    if kernel in native:
        return native[kernel]
    try:
        from liger_kernel.transformers import functional as lg
    except ImportError:
        return None

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
    return ("Liger", liger[kernel]) if kernel in liger else None


def measure(backend: Backend, spec: KernelSpec, case: Case, dtype: torch.dtype, mode: str,
            ceilings: Ceilings, compare_with: tuple[str, ...] = ("eager", "compile"), seed: int = 0) -> Measurement:
    """Time ``spec`` at ``case`` on ``backend`` and the ``compare_with`` implementations."""
    device = backend.device()
    args = _prepare(spec, case, dtype, device, seed)
    result = Measurement(spec.name, case.name, str(dtype).removeprefix("torch."), mode)
    eager = eager_call(spec, backend)
    got = as_tuple(backend.call(spec.name, **args))
    expected = as_tuple(eager(**args))
    for name, out, ref in zip(spec.outputs, got, expected):
        tol = default_tolerance(out.dtype if out.dtype.itemsize == 1 and out.is_floating_point() else dtype)
        check = compare(name, out, ref, tol)
        if not check.ok:
            result.wrong = check.message
            return result
    impls: dict[str, Callable[..., Any]] = {"backend": lambda **kw: backend.call(spec.name, **kw)}
    if "eager" in compare_with:
        impls["eager"] = eager
    if "compile" in compare_with:
        # every kernel's eager function shares one code object: without a reset, the compiler's
        # recompile limit would quietly run later kernels eagerly
        torch._dynamo.reset()
        impls["compile"] = torch.compile(eager, dynamic=False)
    library = library_call(spec.name) if "library" in compare_with and device.type == "cuda" else None
    if library is not None:
        result.library = library[0]
        impls["library"] = lambda **kw: library[1](**spec.check((), kw, backend.dtypes))
    for name, call in impls.items():
        result.ms[name] = time_ms(_runner(call, spec, args, mode), device)
    values = spec.check((), args, backend.dtypes)
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
    result.gbps = nbytes / seconds / 1e9
    result.tflops = flops / seconds / 1e12
    memory_floor = nbytes / (ceilings.copy_gbps * 1e9)
    compute_floor = flops / (ceilings.matmul_tflops * 1e12)
    result.bound = "memory" if memory_floor >= compute_floor else "compute"
    result.ceiling_fraction = max(memory_floor, compute_floor) / seconds
    return result


def perf_cases(spec: KernelSpec) -> list[Case]:
    return [c for c in spec.cases() if c.perf]


def markdown(results: list[Measurement], env: dict[str, str], ceilings: Ceilings) -> str:
    lines = [
        "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()) + ".",
        f"Ceilings measured in this run: copy {ceilings.copy_gbps:.0f} GB/s, "
        f"matmul {ceilings.matmul_tflops:.0f} TFLOP/s.", "",
        "| kernel | shape case | dtype | mode | kpt ms | eager ms | compile ms | library ms | × eager | × compile "
        "| × library | GB/s | TFLOP/s | of ceiling |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.wrong:
            lines.append(f"| {r.kernel} | {r.case} | {r.dtype} | {r.mode} | WRONG: {r.wrong} |||||||| ")
            continue
        ms = [f"{r.ms[k]:.4f}" if k in r.ms else "–" for k in ("backend", "eager", "compile")]
        ms.append(f"{r.ms['library']:.4f} ({r.library})" if "library" in r.ms else "–")
        ratios = [f"{r.speedup(k):.2f}" if k in r.ms else "–" for k in ("eager", "compile", "library")]
        lines.append(f"| {r.kernel} | {r.case} | {r.dtype} | {r.mode} | {' | '.join(ms)} | {' | '.join(ratios)} "
                     f"| {r.gbps:.0f} | {r.tflops:.1f} | {r.ceiling_fraction:.0%} ({r.bound}) |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kpt.benchmark", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=None, help="backend name (default: kpt.get_backend())")
    parser.add_argument("--kernels", default=",".join(SPECS), help="comma-separated kernel names")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile (saves compile time)")
    parser.add_argument("--out", default="reports/bench", help="directory for bench.json and bench.md")
    opts = parser.parse_args(argv)
    backend = get_backend(opts.backend)
    device = backend.device()
    dtype = getattr(torch, opts.dtype)
    ceilings = Ceilings.measure(device)
    compare_with = ("eager", "library") if opts.no_compile else ("eager", "compile", "library")
    results = []
    for name in opts.kernels.split(","):
        spec = SPECS[name]
        for case in perf_cases(spec):
            for mode in MODES if spec.differentiable else MODES[:1]:
                try:
                    r = measure(backend, spec, case, dtype, mode, ceilings, compare_with)
                except Exception as exc:  # one kernel's failure must not hide the others' numbers
                    r = Measurement(name, case.name, opts.dtype, mode, wrong=f"{type(exc).__name__}: {exc}")
                results.append(r)
                print(markdown([r], {}, ceilings).splitlines()[-1], flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    env = backend.environment()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(
        {"schema_version": SCHEMA_VERSION, "backend": backend.name, **provenance(device), "environment": env,
         "ceilings": asdict(ceilings), "results": [asdict(r) for r in results]}, indent=1))
    table = markdown(results, env, ceilings)
    (out / "bench.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
