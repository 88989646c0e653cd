"""How serving and training stacks use kernels, checked on a GPU backend.

    python3 scripts/production_check.py --backend cuda [--threads-seconds 60]

* graphs: every kernel's forward, on each of its conformance cases (float32 and bfloat16),
  captured in a CUDA graph and replayed on fresh inputs copied into the captured buffers, gives
  the eager result bit for bit;
* threads: 8 threads, each on its own CUDA stream, call kernels for a while; every result equals
  what one thread computed for the same inputs;
* dynamic shapes: ``torch.compile(dynamic=True)`` of a small decoder block (rms_norm, rope,
  attention, swiglu) over 200 sequence lengths; counts the compilations;
* soak: 100,000 calls leave the allocated memory where it started.

Prints one line per check and exits non-zero if any fails.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

import kpt
from kpt.ops import as_tuple
from kpt.testing import to_device


def _cases(spec: kpt.KernelSpec, g: torch.Generator, device: torch.device):
    for case in spec.cases():
        if case.device_only:
            continue
        for dtype in (torch.float32, torch.bfloat16):
            if case.dtypes and dtype not in case.dtypes:
                continue
            yield case.name, dtype, to_device(case.make(g, dtype), device)


def _same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    """Bit for bit (NaN included)."""
    return len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype
        and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        for x, y in zip(a, b))


def graphs(be: kpt.Backend, device: torch.device) -> list[str]:
    """Capture each forward, replay it on new inputs, compare with eager on those inputs."""
    g = torch.Generator().manual_seed(0)
    failures = []
    calls = 0
    for spec in kpt.SPECS.values():
        for name, dtype, args in _cases(spec, g, device):
            fresh = to_device(next(c for c in spec.cases() if c.name == name).make(g, dtype), device)
            with torch.no_grad():
                as_tuple(be.call(spec.name, **args))  # compile and cache outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(graph):
                        captured = as_tuple(be.call(spec.name, **args))
                except Exception as exc:  # a capture failure is a finding, reported with the case
                    failures.append(f"{spec.name}/{name}/{dtype}: capture failed: {type(exc).__name__}: {exc}")
                    continue
                for k, v in fresh.items():
                    if isinstance(v, torch.Tensor):
                        args[k].copy_(v)
                graph.replay()
                eager = as_tuple(be.call(spec.name, **args))
                torch.cuda.synchronize()
            calls += 1
            if not _same(captured, eager):
                failures.append(f"{spec.name}/{name}/{dtype}: replay differs from eager")
    print(f"graphs: {calls} captured forwards replayed, {len(failures)} failures")
    return failures


def threads(be: kpt.Backend, device: torch.device, seconds: float) -> list[str]:
    """8 threads on their own streams, each repeating a fixed set of calls; results checked
    against one thread's."""
    g = torch.Generator().manual_seed(1)
    kernels = ("rms_norm", "softmax", "swiglu", "rope", "attention", "cross_entropy", "moe_dispatch",
               "moe_combine", "quantize_fp8")
    work = []
    for name in kernels:
        spec = kpt.SPECS[name]
        _, _, args = next(_cases(spec, g, device))
        with torch.no_grad():
            work.append((name, args, [t.clone() for t in as_tuple(be.call(name, **args))]))
    torch.cuda.synchronize()
    failures: list[str] = []
    counts = [0] * 8
    stop = time.monotonic() + seconds

    def run(i: int) -> None:
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream), torch.no_grad():
            while time.monotonic() < stop:
                for name, args, expected in work:
                    out = as_tuple(be.call(name, **args))
                    stream.synchronize()
                    if not _same(out, tuple(expected)):
                        failures.append(f"thread {i}: {name} differs from one thread's result")
                        return
                    counts[i] += 1

    pool = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    print(f"threads: 8 threads, {sum(counts)} calls in {seconds:.0f} s, {len(failures)} failures")
    return failures


def dynamic(be: kpt.Backend, device: torch.device) -> list[str]:
    """A decoder block compiled once with dynamic shapes, run over 200 sequence lengths."""
    import torch._dynamo

    torch._dynamo.reset()
    heads, kv_heads, dim, hidden = 8, 2, 64, 512
    w = torch.ones(hidden, device=device)
    up = torch.randn(2, 4 * hidden, hidden, device=device) * hidden**-0.5

    def block(x, cos, sin):
        h = be.rms_norm(x, w)
        b, s, _ = h.shape
        q = h.view(b, s, heads, dim).transpose(1, 2)
        k = h[..., : kv_heads * dim].reshape(b, s, kv_heads, dim).transpose(1, 2)
        q, k = be.rope(q, k, cos, sin)
        o = be.attention(q, k, k, causal=True).transpose(1, 2).reshape(b, s, hidden)
        return x + be.swiglu(o @ up[0].T, o @ up[1].T)[..., :hidden]

    compiled = torch.compile(block, dynamic=True, fullgraph=True)
    torch._dynamo.utils.counters.clear()
    lengths = torch.randint(1, 2048, (200,), generator=torch.Generator().manual_seed(2)).tolist()
    failures = []
    for s in lengths:
        x = torch.randn(1, s, hidden, device=device)
        cos, sin = torch.randn(s, dim, device=device), torch.randn(s, dim, device=device)
        out, ref = compiled(x, cos, sin), block(x, cos, sin)
        if not torch.allclose(out, ref, rtol=1e-3, atol=1e-3):
            failures.append(f"dynamic: sequence length {s} differs from eager")
            break
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    print(f"dynamic: 200 sequence lengths, {frames} graphs compiled, {len(failures)} failures")
    if frames > 4:
        failures.append(f"dynamic: {frames} compilations for 200 sequence lengths (allowed 4)")
    return failures


def soak(be: kpt.Backend, device: torch.device, calls: int = 100_000) -> list[str]:
    x, w = torch.randn(1, 4096, device=device), torch.ones(4096, device=device)
    with torch.no_grad():
        be.rms_norm(x, w)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(device)
        start = time.monotonic()
        for _ in range(calls):
            be.rms_norm(x, w)
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated(device)
    print(f"soak: {calls} calls in {time.monotonic() - start:.1f} s, allocated {before} -> {after} bytes")
    return [] if after == before else [f"soak: allocated memory grew by {after - before} bytes"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--threads-seconds", type=float, default=60.0)
    opts = parser.parse_args()
    be = kpt.get_backend(opts.backend)
    device = be.device()
    failures = graphs(be, device) + threads(be, device, opts.threads_seconds) + dynamic(be, device) + soak(be, device)
    for f in failures:
        print("FAIL", f)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
