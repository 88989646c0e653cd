"""Run every kernel of a backend once, forward and backward, on its conformance cases and, with
value checks off, on its out-of-range index values (`KernelSpec.bad_indices`).

Meant to run under a memory checker, where the full suite would be too slow:

    compute-sanitizer --tool memcheck python3 scripts/every_kernel.py --backend cuda

With ``--each``, every call is named on a line of its own (``call: kernel case dtype``) before it
runs and the device synchronized after it, so that a checker's reports can be told apart by call.
"""

from __future__ import annotations

import argparse

import torch

import kpt
from kpt.ops import as_tuple
from kpt.testing import to_device


def _run(be: kpt.Backend, spec: kpt.KernelSpec, args: dict, grad: bool) -> None:
    names = [n for n in spec.differentiable if isinstance(args[n], torch.Tensor) and grad]
    for n in names:
        args[n] = args[n].detach().requires_grad_(True)
    outs = [o for o in as_tuple(be.call(spec.name, **args)) if o.requires_grad]
    if outs:
        torch.autograd.grad(outs, [args[n] for n in names], [torch.randn_like(o) for o in outs], allow_unused=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=None)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--kernels", default=",".join(kpt.SPECS), help="comma-separated (default: all)")
    parser.add_argument("--each", action="store_true", help="name each call and synchronize after it")
    opts = parser.parse_args()
    be = kpt.get_backend(opts.backend)

    def run(spec: kpt.KernelSpec, args: dict, grad: bool, label: str) -> None:
        if opts.each:
            print(f"call: {spec.name} {label}", flush=True)
        _run(be, spec, to_device(args, be.device()), grad)
        if opts.each and be.device().type == "cuda":
            torch.cuda.synchronize()

    g = torch.Generator().manual_seed(0)
    calls = 0
    specs = [kpt.SPECS[name] for name in opts.kernels.split(",")]
    for spec in specs:
        for case in spec.cases():
            if case.device_only:
                continue
            for dtype in (getattr(torch, d) for d in opts.dtypes.split(",")):
                if case.dtypes and dtype not in case.dtypes:
                    continue
                run(spec, case.make(g, dtype), case.grad, f"{case.name} {str(dtype).split('.')[-1]}")
                calls += 1
        with kpt.checking_indices(False):
            for bad in spec.bad_indices():
                run(spec, bad.make(), True, f"bad value: {bad.name}")
                calls += 1
        if be.device().type == "cuda":
            torch.cuda.synchronize()
        print(f"{spec.name}: ok", flush=True)
    print(f"{calls} calls of {len(specs)} kernels ran on {be.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
