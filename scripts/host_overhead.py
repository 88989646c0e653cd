"""Where a kernel call's time goes on the GPU: the host (Python, launches) or the device (kernels).

    python3 scripts/host_overhead.py --backend cuda rms_norm softmax moe_gating ...

For each kernel's perf case in bfloat16, forward and forward+backward, it prints three numbers:
the `kpt.bench` time (device events, the docs/performance.md method), the host time of one call (wall
clock of back-to-back calls, nothing synchronized inside) and the device time of one call (the
sum of its kernels' durations in the torch profiler). A benchmark time near the host time and far
above the device time means the host, not the kernel, is the bottleneck.
"""

from __future__ import annotations

import argparse
import functools

import torch
from torch.profiler import ProfilerActivity, profile

import kpt
from kpt.bench.host import host_us
from kpt.bench.measure import draw_inputs, make_runner
from kpt.bench.sweeps import MODES
from kpt.bench.timing import time_ms


def device_us(run, calls: int = 20) -> float:
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    # operators have no self device time: their kernels do
    return sum(e.self_device_time_total for e in prof.key_averages()) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("kernels", nargs="+")
    opts = parser.parse_args()
    backend = kpt.get_backend(opts.backend)
    print("| kernel | mode | benchmark ms | host us/call | device us/call |\n|---|---|---|---|---|")
    for name in opts.kernels:
        spec = kpt.SPECS[name]
        case = next(c for c in spec.cases() if c.perf)
        args = draw_inputs(spec, case, torch.bfloat16, backend.device(), seed=0)
        for mode in MODES if spec.differentiable else MODES[:1]:
            run = make_runner(functools.partial(backend.call, name), spec, args, mode)
            ms = time_ms(run, backend.device())
            print(f"| {name} | {mode} | {ms:.4f} | {host_us(run):.1f} | {device_us(run):.1f} |", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
