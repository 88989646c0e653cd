"""Compile every kernel of a backend before any eager call, forward and backward, then check the
compiled results against eager calls of the same inputs.

A user who wraps a model in ``torch.compile`` reaches kpt for the first time inside the tracer,
so this must run in a fresh process (CI runs it once per backend profile):

    python scripts/compile_first.py --backend reference
    TRITON_INTERPRET=1 python scripts/compile_first.py --backend cuda   # on a machine without a GPU

Each kernel runs its smallest non-empty conformance case in float32 (or the first dtype the case
allows) under ``torch.compile(fullgraph=True)``: a graph break or a tracing error fails it. The
gradients of the compiled call come from the compiled backward graph. Exits non-zero naming every
kernel that failed.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from typing import Any

import torch

import kpt
from kpt.ops import as_tuple
from kpt.testing import to_device


def smallest_case(spec: kpt.KernelSpec, be: kpt.Backend, g: torch.Generator) -> dict[str, Any]:
    """The inputs of the kernel's smallest non-empty conformance case, on the backend's device."""
    drawn = []
    for case in spec.cases():
        if case.device_only or (spec.differentiable and not case.grad):
            continue
        allowed = [d for d in (case.dtypes or (torch.float32,)) if d in be.dtypes]
        if not allowed:
            continue
        args = case.make(g, allowed[0])
        size = sum(v.numel() for v in args.values() if isinstance(v, torch.Tensor))
        if size:
            drawn.append((size, args))
    return to_device(min(drawn, key=lambda d: d[0])[1], be.device())


def run(be: kpt.Backend, spec: kpt.KernelSpec, args: dict[str, Any], compiled: bool,
        g: torch.Generator) -> list[torch.Tensor]:
    """The kernel's float outputs and the gradients of its differentiable inputs for fixed random
    output gradients (drawn from ``g``), through ``torch.compile`` or eagerly."""
    leaves = {k: v.detach().requires_grad_(k in spec.differentiable and v.is_floating_point())
              if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    method = getattr(be, spec.name)
    call = torch.compile(lambda kw: method(**kw), fullgraph=True) if compiled else (lambda kw: method(**kw))
    outs = as_tuple(call(leaves))
    inputs = [v for v in leaves.values() if isinstance(v, torch.Tensor) and v.requires_grad]
    graded = [o for o in outs if o.requires_grad]
    grads: tuple[torch.Tensor | None, ...] = ()
    if inputs and graded:
        upstream = [torch.randn(o.shape, generator=g).to(o.dtype).to(o.device) for o in graded]
        grads = torch.autograd.grad(graded, inputs, upstream, allow_unused=True)
    return [t.detach() for t in (*outs, *grads) if t is not None]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=None, help="the backend (default: as kpt.get_backend picks)")
    parser.add_argument("--kernels", default=",".join(kpt.SPECS), help="comma-separated (default: all)")
    opts = parser.parse_args()
    be = kpt.get_backend(opts.backend)
    specs = [kpt.SPECS[name] for name in opts.kernels.split(",")]
    inputs = {spec.name: smallest_case(spec, be, torch.Generator().manual_seed(0)) for spec in specs}
    start = time.perf_counter()
    compiled: dict[str, list[torch.Tensor]] = {}
    failed: dict[str, str] = {}
    for spec in specs:  # every compiled call before the first eager one
        torch.compiler.reset()
        try:
            compiled[spec.name] = run(be, spec, inputs[spec.name], True, torch.Generator().manual_seed(1))
        except Exception:
            failed[spec.name] = traceback.format_exc()
    for name, results in compiled.items():
        expected = run(be, kpt.SPECS[name], inputs[name], False, torch.Generator().manual_seed(1))
        try:
            torch.testing.assert_close(results, expected, equal_nan=True)
        except AssertionError as exc:
            failed[name] = f"compiled and eager results differ: {exc}"
    for name, error in failed.items():
        print(f"--- {name} failed:\n{error}", file=sys.stderr)
    summary = f"; failed: {', '.join(failed)}" if failed else ""
    print(f"{be.conformance_profile}: {len(specs) - len(failed)} of {len(specs)} kernels compiled first, "
          f"forward and backward, in {time.perf_counter() - start:.0f} s{summary}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
