"""Command line: compare directive choices for one kernel, estimate a whole network, calibrate.

    python -m kpt_fpga_sim compare linear --shape 8192,8192,8192 --reuse 1,2,4
    python -m kpt_fpga_sim compare rms_norm --case llm --unroll 8,16,32 --device zynq7020
    python -m kpt_fpga_sim compare attention --dataflow on,off --format "ap_fixed<16,6>" --json

Every combination of the listed directive values is one variant; each is estimated on the
shapes of a conformance case of the kernel (``--case``, default ``perf``: the docs/performance.md shape) or,
for ``linear``/``fp8_linear``, on ``--shape M,N,K``, and printed as one row of a table.

    python -m kpt_fpga_sim estimate model.pt --input-shape 1,16 --reuse 2 --io stream --device xcvu9p
    python -m kpt_fpga_sim calibrate

``estimate`` loads a whole module saved with ``torch.save(model, path)`` (unpickling runs code
from the file: only load files you trust) and prints `kpt_fpga_sim.estimate_model`'s report;
``calibrate`` prints the estimates against the published reports of `kpt_fpga_sim.calibration`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Sequence
from typing import Any

import torch

from kpt.kernels import SPECS

from .backend import configure
from .hls import format_table

_DIRECTIVES = {"reuse": int, "unroll": int, "partition": int, "dataflow": "bool", "partial_sums": "bool"}


def _values(text: str, kind: Any) -> list[Any]:
    if kind == "bool":
        table = {"on": True, "off": False, "true": True, "false": False, "1": True, "0": False}
        return [table[v.strip().lower()] for v in text.split(",")]
    return [kind(v) for v in text.split(",")]


def _shape_args(kernel: str, shape: str, dtype: torch.dtype) -> dict[str, Any]:
    m, n, k = (int(v) for v in shape.split(","))
    meta = torch.device("meta")
    if kernel == "linear":
        return {"x": torch.empty(m, k, dtype=dtype, device=meta),
                "weight": torch.empty(n, k, dtype=dtype, device=meta)}
    if kernel == "fp8_linear":
        fp8 = torch.float8_e4m3fn
        return {"xq": torch.empty(m, k, dtype=fp8, device=meta), "x_scale": torch.empty((), device=meta),
                "wq": torch.empty(n, k, dtype=fp8, device=meta), "w_scale": torch.empty((), device=meta)}
    raise SystemExit(f"--shape is for linear and fp8_linear; use --case for {kernel}")


def _case_args(kernel: str, name: str, dtype: torch.dtype) -> dict[str, Any]:
    cases = {c.name: c for c in SPECS[kernel].cases()}
    if name not in cases:
        raise SystemExit(f"{kernel} has no case {name!r}; cases: {', '.join(cases)}")
    g = torch.Generator().manual_seed(0)
    try:
        # shapes are all a design needs: draw the inputs as meta tensors when the case allows it
        with torch.device("meta"):
            return cases[name].make(g, dtype)
    except (NotImplementedError, RuntimeError):
        return cases[name].make(g, dtype)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kpt_fpga_sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    cmp = sub.add_parser("compare", help="estimate a kernel under several directive choices")
    cmp.add_argument("kernel", choices=sorted(SPECS))
    cmp.add_argument("--case", default="perf", help="conformance case whose shapes to use (default: perf)")
    cmp.add_argument("--shape", help="M,N,K for linear / fp8_linear")
    cmp.add_argument("--dtype", default="float32", help="activation dtype (default float32)")
    cmp.add_argument("--format", help='number format: float32 (default) or "ap_fixed<W,I[,Q[,O]]>"')
    cmp.add_argument("--device", help="u250 (default), u280, u50, vu9p, vu13p, ku115, zynq7020 or a part name")
    cmp.add_argument("--clock", type=float, help="clock in MHz (default: the device's)")
    cmp.add_argument("--json", action="store_true", help="print the reports as JSON")
    for name in _DIRECTIVES:
        cmp.add_argument(f"--{name.replace('_', '-')}", dest=name, help=f"comma-separated {name} values")
    est = sub.add_parser("estimate", help="estimate a saved torch.nn.Module as a constant-weight design")
    est.add_argument("model", help="a file written by torch.save(model) (only load files you trust)")
    est.add_argument("--input-shape", required=True, help="the example input's shape, batch 1 (e.g. 1,16)")
    est.add_argument("--format", default="ap_fixed<16,6>", help='every value\'s type (default "ap_fixed<16,6>")')
    est.add_argument("--device", default="u250", help="device profile or part name (default u250)")
    est.add_argument("--clock", type=float, default=200.0, help="clock in MHz (default 200)")
    est.add_argument("--reuse", type=int, default=1, help="reuse factor (default 1)")
    est.add_argument("--strategy", default="latency", choices=("latency", "resource"))
    est.add_argument("--io", default="parallel", choices=("parallel", "stream"))
    est.add_argument("--json", action="store_true", help="print the report as JSON")
    sub.add_parser("calibrate", help="estimates against published C-synthesis reports, with the sMAPE")
    args = parser.parse_args(argv)
    if args.command == "calibrate":
        from .calibration import table
        print(table())
        return 0
    if args.command == "estimate":
        return _estimate(args)

    dtype = getattr(torch, args.dtype)
    inputs = (_shape_args(args.kernel, args.shape, dtype) if args.shape
              else _case_args(args.kernel, args.case, dtype))
    axes = {name: _values(getattr(args, name), kind) for name, kind in _DIRECTIVES.items()
            if getattr(args, name)}
    variants = [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())] or [{}]
    reports, labels = [], []
    for directives in variants:
        be = configure(format=args.format, device=args.device, clock_mhz=args.clock,
                       directives={args.kernel: directives})
        reports.append(be.estimate(args.kernel, **inputs))
        labels.append(", ".join(f"{k}={v}" for k, v in directives.items()) or "defaults")
    if args.json:
        print(json.dumps([{"variant": label, **r.as_dict()} for label, r in zip(labels, reports)], indent=1))
    else:
        print(format_table(reports, labels))
    return 0


def _estimate(args: argparse.Namespace) -> int:
    from .network import estimate_model
    model = torch.load(args.model, weights_only=False)
    if not isinstance(model, torch.nn.Module):
        raise SystemExit(f"{args.model} holds a {type(model).__name__}, not a module saved with torch.save(model)")
    shape = tuple(int(v) for v in args.input_shape.split(","))
    report = estimate_model(model.eval(), torch.zeros(shape), format=args.format, device=args.device,
                            clock_mhz=args.clock, reuse=args.reuse, strategy=args.strategy, io=args.io)
    print(json.dumps(report.as_dict(), indent=1, default=str) if args.json else report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
