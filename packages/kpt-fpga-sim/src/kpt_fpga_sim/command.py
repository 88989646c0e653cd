"""``kpt fpga-report``: compare directive choices for one kernel, estimate a whole network, calibrate.

    kpt fpga-report compare linear --shape 8192,8192,8192 --reuse 1,2,4
    kpt fpga-report compare rms_norm --case llm --unroll 8,16,32 --device zynq7020
    kpt fpga-report compare attention --dataflow on,off --format "ap_fixed<16,6>" --json

Every combination of the listed directive values is one variant; each is estimated on the
shapes of a conformance case of the kernel (``--case``, default ``perf``: the docs/performance.md
shape) or, for ``linear``/``fp8_linear``, on ``--shape M,N,K``, and printed as one row of a table.

    kpt fpga-report example-model model.pt2        # a small MLP to try estimate on
    kpt fpga-report estimate model.pt2 --input-shape 1,16 --reuse 2 --io stream --device vu9p
    kpt fpga-report estimate weights.pt --factory mypackage.models:make_mlp --input-shape 1,16
    kpt fpga-report calibrate

``estimate`` prints `kpt_fpga_sim.estimate_model`'s report of a network saved as a
``torch.export`` program (``torch.export.save(torch.export.export(model, (x,)), "model.pt2")``),
or of a state dict (``torch.save(model.state_dict(), "weights.pt")``) loaded into the module that
``--factory module:callable`` builds (`kpt_fpga_sim.loading`). ``calibrate`` prints the estimates
against the published reports of `kpt_fpga_sim.calibration`.

``kpt fpga-report`` comes with kpt-fpga-sim (the ``kpt.commands`` entry point);
``python -m kpt_fpga_sim`` is the same command. Every mistake in the options is one line.
"""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Any

import torch

from kpt.cli import Command, UsageError
from kpt.kernels import SPECS

_DIRECTIVES = {"reuse": int, "unroll": int, "partition": int, "dataflow": "bool", "partial_sums": "bool"}
_BOOLS = {"on": True, "off": False, "true": True, "false": False, "1": True, "0": False}


def _values(option: str, text: str, kind: Any) -> list[Any]:
    try:
        if kind == "bool":
            return [_BOOLS[v.strip().lower()] for v in text.split(",")]
        return [kind(v) for v in text.split(",")]
    except (KeyError, ValueError):
        expected = "on or off" if kind == "bool" else "integers"
        raise UsageError(f"--{option.replace('_', '-')} {text}: expected comma-separated {expected}") from None


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise UsageError(f"--dtype {name}: not a floating-point torch dtype (float32, bfloat16, float16)")
    return dtype


def _shape_args(kernel: str, shape: str, dtype: torch.dtype) -> dict[str, Any]:
    if kernel not in ("linear", "fp8_linear"):
        raise UsageError(f"--shape is for linear and fp8_linear; use --case for {kernel}")
    try:
        m, n, k = (int(v) for v in shape.split(","))
    except ValueError:
        raise UsageError(f"--shape {shape}: expected M,N,K, three positive integers (e.g. 4096,4096,4096)") from None
    if min(m, n, k) < 1:
        raise UsageError(f"--shape {shape}: M, N and K must be positive")
    meta = torch.device("meta")
    if kernel == "linear":
        return {"x": torch.empty(m, k, dtype=dtype, device=meta),
                "weight": torch.empty(n, k, dtype=dtype, device=meta)}
    fp8 = torch.float8_e4m3fn
    return {"xq": torch.empty(m, k, dtype=fp8, device=meta), "x_scale": torch.empty((), device=meta),
            "wq": torch.empty(n, k, dtype=fp8, device=meta), "w_scale": torch.empty((), device=meta)}


def _case_args(kernel: str, name: str, dtype: torch.dtype) -> dict[str, Any]:
    cases = {c.name: c for c in SPECS[kernel].cases()}
    if name not in cases:
        raise UsageError(f"{kernel} has no case {name!r}; cases: {', '.join(cases)}")
    g = torch.Generator().manual_seed(0)
    try:
        # shapes are all a design needs: draw the inputs as meta tensors when the case allows it
        with torch.device("meta"):
            return cases[name].make(g, dtype)
    except (NotImplementedError, RuntimeError):
        return cases[name].make(g, dtype)


def _configure(**options: Any) -> Any:
    """`kpt_fpga_sim.configure`, a bad device, format or clock being a mistake on the command line."""
    from .backend import configure

    try:
        return configure(**options)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) < 2 or shape[0] != 1 or min(shape) < 1:
        raise UsageError(f"--input-shape {text}: expected the example input's shape with batch 1, e.g. 1,16")
    return shape


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommands of ``kpt fpga-report`` and their options."""
    sub = parser.add_subparsers(dest="fpga_command", required=True, metavar="SUBCOMMAND")
    cmp = sub.add_parser("compare", help="estimate a kernel under several directive choices")
    cmp.add_argument("kernel", choices=sorted(SPECS))
    cmp.add_argument("--case", default="perf", help="conformance case whose shapes to use (default: perf)")
    cmp.add_argument("--shape", help="M,N,K for linear / fp8_linear")
    cmp.add_argument("--dtype", default="float32", help="activation dtype (default float32)")
    cmp.add_argument("--format", help='number format: float32 (default), "ap_fixed<W,I[,Q[,O]]>", '
                     '"ap_ufixed<W,I[,Q[,O]]>" or a QKeras quantizer, "quantized_bits(8,3)"')
    cmp.add_argument("--device", help="u250 (default), u280, u50, vu9p, vu13p, ku115, zynq7020, zcu104 or a part name")
    cmp.add_argument("--clock", type=float, help="clock in MHz (default: the device's)")
    cmp.add_argument("--json", action="store_true", help="print the reports as JSON")
    for name in _DIRECTIVES:
        cmp.add_argument(f"--{name.replace('_', '-')}", dest=name, help=f"comma-separated {name} values")
    cmp.set_defaults(fpga_run=_compare)

    from .loading import add_arguments as add_model_arguments

    est = sub.add_parser(
        "estimate", help="estimate a saved network as a constant-weight design",
        description="Estimate a network as one constant-weight HLS design, layer by layer: a torch.export "
                    "program (.pt2), or a state dict with --factory. `kpt fpga-report example-model model.pt2` "
                    "writes a small one to try.")
    add_model_arguments(est)
    est.add_argument("--input-shape", required=True, help="the example input's shape, batch 1 (e.g. 1,16)")
    est.add_argument("--format", default="ap_fixed<16,6>",
                     help='every value\'s type (default "ap_fixed<16,6>"; also ap_ufixed<W,I[,Q[,O]]>, '
                          'quantized_bits(bits,integer[,keep_negative]), quantized_relu(bits,integer))')
    est.add_argument("--device", default="u250", help="device profile or part name (default u250)")
    est.add_argument("--clock", type=float, default=200.0, help="clock in MHz (default 200)")
    est.add_argument("--reuse", type=int, default=1, help="reuse factor (default 1)")
    est.add_argument("--strategy", default="latency", choices=("latency", "resource"))
    est.add_argument("--io", default="parallel", choices=("parallel", "stream"))
    est.add_argument("--json", action="store_true", help="print the report as JSON")
    est.set_defaults(fpga_run=_estimate)

    example = sub.add_parser(
        "example-model", help="write a small MLP (16 -> 8 -> 4) as a torch.export program, for estimate",
        description="Write a small multilayer perceptron (Linear 16->8, ReLU, Linear 8->4, Softmax; fixed "
                    "random weights) as a torch.export program, to try `kpt fpga-report estimate PATH "
                    "--input-shape 1,16` on.")
    example.add_argument("path", help="where to write it, e.g. model.pt2")
    example.add_argument("--force", action="store_true", help="replace an existing file")
    example.set_defaults(fpga_run=_example)

    sub.add_parser("calibrate", help="estimates against published C-synthesis reports, with the sMAPE",
                   ).set_defaults(fpga_run=_calibrate)


def _compare(args: argparse.Namespace) -> int:
    from .hls import format_table

    dtype = _dtype(args.dtype)
    inputs = (_shape_args(args.kernel, args.shape, dtype) if args.shape
              else _case_args(args.kernel, args.case, dtype))
    axes = {name: _values(name, getattr(args, name), kind) for name, kind in _DIRECTIVES.items()
            if getattr(args, name)}
    variants = [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())] or [{}]
    reports, labels = [], []
    for directives in variants:
        be = _configure(format=args.format, device=args.device, clock_mhz=args.clock,
                        directives={args.kernel: directives})
        reports.append(be.estimate(args.kernel, **inputs))
        labels.append(", ".join(f"{k}={v}" for k, v in directives.items()) or "defaults")
    if args.json:
        print(json.dumps([{"variant": label, **r.as_dict()} for label, r in zip(labels, reports)], indent=1))
    else:
        print(format_table(reports, labels))
    return 0


def _estimate(args: argparse.Namespace) -> int:
    from .loading import load_model
    from .network import estimate_model

    shape = _shape(args.input_shape)
    model = load_model(args)
    try:
        with torch.no_grad():
            model(torch.zeros(shape))
    except RuntimeError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UsageError(f"--input-shape {args.input_shape} does not fit the model: {first}") from None
    report = estimate_model(model, torch.zeros(shape), format=args.format, device=args.device,
                            clock_mhz=args.clock, reuse=args.reuse, strategy=args.strategy, io=args.io)
    print(json.dumps(report.as_dict(), indent=1, default=str) if args.json else report)
    return 0


def _example(args: argparse.Namespace) -> int:
    from .loading import write_example

    print(write_example(args.path, force=args.force))
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from .calibration import table

    print(table())
    return 0


COMMAND = Command(
    help="the FPGA simulator's cost reports: compare (a kernel's directives), estimate (a network), calibrate",
    description=__doc__, add_arguments=add_arguments, run=lambda args: args.fpga_run(args))
