"""The clocks of kpt.bench: how long a call takes on the device, and what the device can do.

`time_ms` times a call the docs/performance.md way (device events with the L2 cache flushed before
each call on GPUs, the wall clock on CPUs); `graph_ms` replays it from a CUDA graph instead (no host
time, no flush); `Ceilings` measures the copy bandwidth and the matrix-product rate that every
result is reported against.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


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
