"""Host time of one small eager call: kpt's row kernels beside the cheapest calls there are.

    python3 scripts/host_overhead.py                 # on a GPU: the cuda backend, JSON on stdout
    python3 scripts/host_overhead.py --cpu-stub      # anywhere: the same host path, launches stubbed
    python3 scripts/host_overhead.py --cpu-stub --profile rms_norm   # and where its time goes

At one token (rms_norm of 1 × 4096 in bfloat16) a kernel runs for about 2 µs on the GPU, so a
call costs what the host spends on it: argument checks, dispatch, tiling, allocation, launch. For
each call this prints, in one JSON object, the host time per call (``wall_us``: the wall clock of
``--calls`` back-to-back calls, nothing synchronized inside, so the GPU never holds the host back;
``cpu_us``: the CPU time of this thread over the same calls) and, on a GPU, the device time per
call (``device_us``: its kernels' durations in the torch profiler). The baselines measured in the
same run: the launch of an empty Triton kernel (through Triton's launcher, and through
`kpt_triton.launch.cached_launch`), a one-element ``torch.add``, and torch's eager kernels. Then
``kpt rms_norm`` taken apart (`rms_norm_parts`): its argument check, its kernel body, its
allocations and its launch, each on its own, and the call with its body stubbed (the check and the
dispatch).

``--cpu-stub`` runs kpt-cuda's host path on CPU tensors without a GPU and without Triton's
interpreter: the backend is pinned to the H200's tuning table (``sm90-hbm3e``), and each compiled
kernel is replaced by one whose launch does nothing, so that every line of Python from the kernel
method down to the launcher's call runs as on the GPU; only the C launch itself (and the CUDA
caching allocator, replaced by the CPU one) is missing. Torch's eager rows then compute on the CPU.
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import json
import os
import pstats
import statistics
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import kpt


def device_us(run: Callable[[], Any], calls: int = 20) -> float:
    """Device time of one call in microseconds: the sum of its kernels' durations in the profiler."""
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    # operators have no self device time: their kernels do
    return sum(e.self_device_time_total for e in prof.key_averages()) / calls


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_us(run: Callable[[], Any], calls: int, rounds: int = 7) -> dict[str, float]:
    """Wall and thread-CPU microseconds per call of ``calls`` back-to-back calls: the median of
    ``rounds`` (synchronized between rounds only), and the fastest round's CPU time (the round least
    disturbed by other processes)."""
    for _ in range(10):  # compiled, tuned and cached before it is timed
        run()
    _sync()
    wall, cpu = [], []
    for _ in range(rounds):
        start, start_cpu = time.perf_counter(), time.thread_time()
        for _ in range(calls):
            run()
        wall.append((time.perf_counter() - start) / calls * 1e6)
        cpu.append((time.thread_time() - start_cpu) / calls * 1e6)
        _sync()
    return {
        "wall_us": round(statistics.median(wall), 2),
        "cpu_us": round(statistics.median(cpu), 2),
        "min_cpu_us": round(min(cpu), 2),
    }


class _Compiled:
    """What `cached_launch` reads of a compiled kernel, with a launch that does nothing."""

    function = 0
    packed_metadata = None

    def run(self, *args: Any) -> None:
        pass


class _StubJit:
    """A ``triton.jit`` function that "compiles" to `_Compiled` at its first launch."""

    def __init__(self, fn: Any) -> None:
        self.signature = fn.signature

    def __getitem__(self, grid: Any) -> Callable[..., _Compiled]:
        return lambda *args, **kwargs: _Compiled()


def stub_launches(*extra: Any) -> None:
    """Make every kpt-triton launch (and each `cached_launch` kernel of ``extra``) a no-op that
    still runs `cached_launch`'s Python: its cache-hit path, as on a GPU after the first call, with
    one visible device whose current stream is 0. Kernels launched through Triton's own path do
    nothing at all (their dispatch is not measured)."""
    from triton.runtime.jit import JITFunction

    from kpt_triton import launch
    from kpt_triton.backend import portable_modules

    one_device = types.SimpleNamespace(device_count=lambda: 1)
    launch.driver = types.SimpleNamespace(
        active=types.SimpleNamespace(  # type: ignore[assignment]
            get_current_device=lambda: 0, get_current_stream=lambda device: 0, get_device_interface=lambda: one_device
        )
    )
    kernels = [
        v for m in set(portable_modules().values()) for v in vars(m).values() if isinstance(v, launch.cached_launch)
    ]
    for kernel in (*kernels, *extra):
        kernel.fn = _StubJit(kernel.fn)
    JITFunction.run = lambda self, *args, **kwargs: None  # type: ignore[method-assign]


def empty_kernels(t: torch.Tensor, stub: bool) -> dict[str, Callable[[], Any]]:
    """Launches of a Triton kernel that does nothing (one pointer argument); with ``stub``, only
    `cached_launch`'s, stubbed (Triton's own launcher needs a GPU)."""
    import triton

    from kpt_triton.launch import cached_launch

    @triton.jit
    def empty(x):
        pass

    cached = cached_launch(empty)
    if stub:
        stub_launches(cached)
        return {"empty Triton kernel (cached_launch)": lambda: cached[(1,)](t)}
    return {
        "empty Triton kernel (Triton's launch)": lambda: empty[(1,)](t),
        "empty Triton kernel (cached_launch)": lambda: cached[(1,)](t),
    }


def calls(be: kpt.Backend, device: torch.device) -> dict[str, Callable[[], Any]]:
    """The measured calls, by name: decode-step shapes (one token) in bfloat16."""
    bf16 = {"dtype": torch.bfloat16, "device": device}
    x = torch.randn(1, 4096, **bf16)
    w, b = torch.randn(4096, **bf16), torch.randn(4096, **bf16)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    q, k = torch.randn(1, 32, 1, 128, **bf16), torch.randn(1, 8, 1, 128, **bf16)
    cos, sin = torch.randn(1, 128, **bf16), torch.randn(1, 128, **bf16)
    norm = kpt.nn.RMSNorm(4096, **bf16)
    one = torch.ones(1, device=device)
    return {
        "torch.add, 1 element": lambda: torch.add(one, one),
        "torch rms_norm": lambda: F.rms_norm(x, (4096,), w, 1e-6),
        "torch layer_norm": lambda: F.layer_norm(x, (4096,), w, b, 1e-5),
        "torch softmax": lambda: F.softmax(x, -1),
        "kpt rms_norm": lambda: be.rms_norm(x, w, 1e-6),
        "kpt rms_norm, call by keywords": lambda: be.call("rms_norm", x=x, weight=w, eps=1e-6),
        "kpt rms_norm, requires grad": lambda: be.rms_norm(xg, wg, 1e-6),
        "kpt rms_norm, nn.RMSNorm": lambda: norm(x),
        "kpt layer_norm": lambda: be.layer_norm(x, w, b, 1e-5),
        "kpt softmax": lambda: be.softmax(x, -1),
        "kpt rope": lambda: be.rope(q, k, cos, sin),
    }


def rms_norm_parts(be: kpt.Backend, device: torch.device) -> dict[str, Callable[[], Any]]:
    """``kpt rms_norm`` (1 × 4096, bfloat16) taken apart, each part timed on its own: the contract's
    argument check, the backend's kernel body called directly (tiling, the outputs' allocation and
    the launch; no check, no dispatch), the two allocations, the launch of its compiled kernel with
    the arguments prepared, and the whole call with a body that does nothing: the check and
    `kpt.Backend.call`'s dispatch (grad mode, compile and autocast tests, the result's unpacking)."""
    from kpt.backend import _guarded
    from kpt.ops import Kernel
    from kpt_triton import rms_norm as triton_rms_norm
    from kpt_triton.tiling import row_launch

    bf16 = {"dtype": torch.bfloat16, "device": device}
    x, w = torch.randn(1, 4096, **bf16), torch.randn(4096, **bf16)
    spec, body = kpt.SPECS["rms_norm"], be.kernels()["rms_norm"].forward
    defaults = inspect.signature(triton_rms_norm.rms_norm_fwd).parameters.values()
    tuning = {**{p.name: p.default for p in defaults if p.kind is p.KEYWORD_ONLY}, **getattr(body, "params", {})}
    grid, options = row_launch(1, 4096, tuning["max_block"], tuning["tile_elems"], tuning["elems_per_warp"], True,
                               HAS_RESIDUAL=False, HAS_WEIGHT=True)
    y, rstd = torch.empty_like(x), torch.empty(1, dtype=torch.float32, device=device)
    args = (x, x, w, y, None, rstd, 1, 4096, 4096, 1, 4096, 1, 1e-6)
    # a second backend of the same class and tuning whose rms_norm body only returns the outputs
    # above (wrapped as every body is, `kpt.backend._guarded`): its call is the check and the dispatch
    dispatch_only = type(be)(arch=be.arch())
    dispatch_only._registration.kernels.update(
        _guarded(be.name, {"rms_norm": Kernel(lambda *_: (y, rstd), None)}))
    return {
        "kpt rms_norm: check and dispatch (body stubbed)": lambda: dispatch_only.rms_norm(x, w, 1e-6),
        "kpt rms_norm: contract check only": lambda: spec.check((x, w, 1e-6), {}, be.dtypes),
        "kpt rms_norm: kernel body only": lambda: body(x, w, 1e-6),
        "kpt rms_norm: its two allocations": lambda: (torch.empty_like(x), torch.empty(1, dtype=torch.float32,
                                                                                       device=x.device)),
        "kpt rms_norm: launch only": lambda: triton_rms_norm._rms_norm_fwd_kernel.launch(grid, args, options),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-stub", action="store_true", help="CPU tensors, launches stubbed (no GPU needed)")
    parser.add_argument("--calls", type=int, default=1000, help="back-to-back calls per round")
    parser.add_argument(
        "--profile",
        metavar="NAME",
        help="cProfile this call (a key of the JSON's rows, or a kernel: 'rms_norm' is 'kpt rms_norm') to stderr",
    )
    opts = parser.parse_args()
    if opts.cpu_stub:
        if os.environ.get("TRITON_INTERPRET", "0") == "1":
            parser.error("--cpu-stub runs the GPU's host path: unset TRITON_INTERPRET")
        from kpt_cuda import CudaBackend

        be: kpt.Backend = CudaBackend(arch="sm90-hbm3e")
        device = torch.device("cpu")
    else:
        be = kpt.get_backend("cuda")
        device = be.device()
    run = {**empty_kernels(torch.zeros(1, device=device), opts.cpu_stub), **calls(be, device),
           **rms_norm_parts(be, device)}
    rows = {}
    with kpt.use_backend(be):  # for nn.RMSNorm: on CPU tensors it would find the reference backend
        for name, fn in run.items():
            rows[name] = host_us(fn, opts.calls)
            if not opts.cpu_stub:
                rows[name]["device_us"] = round(device_us(fn), 2)
    environment = {**be.environment(), "python": sys.version.split()[0], "mode": "cpu-stub" if opts.cpu_stub else "gpu"}
    print(json.dumps({"environment": environment, "calls": opts.calls, "rows": rows}, indent=1))
    if opts.profile:
        fn = run.get(opts.profile) or run[f"kpt {opts.profile}"]
        profiler = cProfile.Profile()
        with kpt.use_backend(be):
            profiler.runcall(lambda: [fn() for _ in range(20 * opts.calls)])
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
