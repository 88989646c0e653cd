"""GPU time alone of every implementation at the model sweep's one-token shapes.

    python3 scripts/device_time.py --backend cuda [rms_norm,softmax,...]

For each kernel of the models sweep (`kpt.bench.sweeps.models_sweep`) at one token, forward and
forward+backward, it prints the sum of the kernels' durations per call in the torch profiler for
kpt, torch eager, torch.compile and the libraries present, and the ratio of the best peer to kpt.
A one-token call is host-bound: its benchmark time (`kpt bench`) mixes in the host's share, which
the benchmark reports separately (host time of back-to-back calls); this is the device's share.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from host_overhead import device_us  # this directory's: run as python3 scripts/device_time.py

import kpt
from kpt.bench.measure import draw_inputs, make_runner
from kpt.bench.peers import eager_call, libraries
from kpt.bench.sweeps import models_sweep


def implementations(be: kpt.Backend, spec: kpt.KernelSpec) -> dict[str, Callable[..., Any]]:
    """kpt, eager, torch.compile (this shape alone) and the libraries, by name."""
    eager = eager_call(spec, be)
    torch._dynamo.reset()
    impls: dict[str, Callable[..., Any]] = {"kpt": lambda **kw: be.call(spec.name, **kw), "eager": eager,
                                            "compile": torch.compile(eager, dynamic=False)}
    found, _ = libraries(spec.name)
    for name, fn in found.items():
        impls[name] = lambda fn=fn, **kw: fn(**spec.check((), kw, be.dtypes))
    return impls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("kernels", nargs="?", help="comma-separated (default: every kernel of the sweep)")
    opts = parser.parse_args()
    be = kpt.get_backend(opts.backend)
    only = opts.kernels.split(",") if opts.kernels else None
    print("| kernel | shape | mode | kpt µs | eager µs | compile µs | library µs | × best |")
    print("|---|---|---|---|---|---|---|---|")
    for point in models_sweep():
        if " T=1 " not in point.case.name + " " or (only and point.kernel not in only):
            continue
        spec = kpt.SPECS[point.kernel]
        args = draw_inputs(spec, point.case, torch.bfloat16, be.device(), 0)
        impls = implementations(be, spec)
        for mode in point.modes:
            res = {}
            for name, fn in impls.items():
                try:
                    res[name] = device_us(make_runner(fn, spec, args, mode), calls=30)
                except Exception as exc:  # a library that cannot take this shape: left out, with why
                    res[name] = float("nan")
                    print(f"<!-- {point.kernel} {name}: {type(exc).__name__}: {str(exc)[:100]} -->")
            peers = [v for k, v in res.items() if k != "kpt" and v == v]
            libs = " ".join(f"{k} {v:.2f}" for k, v in res.items() if k not in ("kpt", "eager", "compile")) or "–"
            print(f"| {point.kernel} | {point.case.name} | {mode} | {res['kpt']:.2f} | {res['eager']:.2f} | "
                  f"{res['compile']:.2f} | {libs} | {min(peers) / res['kpt']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
