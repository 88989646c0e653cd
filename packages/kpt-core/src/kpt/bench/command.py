"""Measuring kernels side by side, the docs/performance.md way.

    python -m kpt.bench --backend cuda --out reports/bench                 # the docs/performance.md shapes
    python -m kpt.bench --backend cuda --sweep models --out reports/models  # real models' shapes
    kpt bench --backend cuda --sweep attention --plot                      # the same, as a command

For each shape of a sweep (`kpt.bench.sweeps`) it times, on the backend's device, the backend, torch
eager (the contract's reference math, run as plain PyTorch), torch.compile of the same math and the
libraries present (SDPA with each of its backends, cuBLAS then the activation, ``torch._scaled_mm``,
a loop of cuBLAS products and ``torch._grouped_mm``, Liger-Kernel where installed), forward and
forward+backward (random output gradients; 1 for a scalar loss, as ``loss.backward()`` gives), in
rounds that take turns (`kpt.bench.measure.ROUNDS`), so that a drift of the card's clocks reaches each of them alike.
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
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..kernels import SPECS
from ..overview import provenance
from ..registry import get_backend
from .host import baselines
from .report import SCHEMA_VERSION, markdown, worst
from .roofline import plot, require_matplotlib
from .sweeps import SWEEPS, run_sweep, sweep
from .timing import Ceilings

TIME_LIMIT = 270.0
"""The default time limit of a sweep other than perf: with start-up, ceilings and the host costs,
a run stays within five minutes."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m kpt.bench`` and ``kpt bench``."""
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
        plot(report, out / "roofline.png")
    print(table if opts.quiet else title)
    print(f"wrote {out / 'bench.json'} and {out / 'bench.md'}" + (f" and {out / 'roofline.png'}" if opts.plot else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kpt.bench", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
