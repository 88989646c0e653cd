"""Sweep tuning parameters of kpt-triton launchers at the docs/performance.md shapes on the current GPU.

    python3 scripts/tune_sweep.py rms_norm_bwd softmax_fwd ...
    python3 scripts/tune_sweep.py softmax_fwd@4096x32768 layer_norm_bwd@65536x8192 ...

For each launcher it times every combination of its grid (median, device events) on the kernel's
perf case in bfloat16 (or, after ``@``, on rows × columns of the model sweep's shapes: every
tensor of two or more dimensions becomes ``[rows, columns]`` and every vector ``[columns]``),
checks the result against the current table's, and prints the best parameters next to the
table's (`kpt_cuda.tuning` for this GPU), to be copied into ``kpt_cuda/tuning.py``.
"""

from __future__ import annotations

import importlib
import itertools
import sys

import torch

import kpt
from kpt.bench.timing import time_ms
from kpt.ops import as_tuple
from kpt.testing import to_device
from kpt_cuda import device
from kpt_cuda.tuning import TABLES

ROW = {"tile_elems": [2048, 4096, 8192, 16384], "elems_per_warp": [256, 512, 1024]}
ROW_BWD = {**ROW, "programs_per_sm": [1, 2, 4, 8, 16]}
POINTWISE = {"block": [2048, 4096, 8192, 16384], "elems_per_warp": [256, 512, 1024, 2048]}
GRIDS: dict[str, dict[str, list]] = {
    "rms_norm_fwd": ROW,
    "rms_norm_bwd": ROW_BWD,
    "add_rms_norm_fwd": ROW,
    "add_rms_norm_bwd": ROW_BWD,
    "layer_norm_fwd": {"tile_elems": [4096, 8192, 16384], "elems_per_warp": [512, 1024, 2048],
                       "stream": [False, True]},
    "layer_norm_bwd": ROW_BWD,
    # max_block: rows up to this long are read once (a 32768-wide row is read twice at 16384)
    "softmax_fwd": {"max_block": [16384, 32768, 65536], "tile_elems": [2048, 4096, 8192],
                    "elems_per_warp": [512, 1024, 2048], "stream": [False, True]},
    "softmax_bwd": {**ROW, "max_block": [16384, 32768, 65536]},
    **{f"{k}_{d}": POINTWISE for k in ("gelu", "silu", "swiglu", "geglu") for d in ("fwd", "bwd")},
    "rope_fwd": {"tile_elems": [1024, 2048, 4096], "elems_per_warp": [128, 256, 512], "stream": [False, True]},
    "cross_entropy_fwd": {"block_v": [8192, 16384, 32768], "elems_per_warp": [512, 1024, 2048],
                          "programs_per_sm": [1, 2, 4, 8, 16]},
    "quantize_fp8_fwd": {"tile_elems": [4096, 8192], "elems_per_warp": [512, 1024, 2048], "native_cast": [True]},
    "moe_gating_fwd": {"tile_elems": [128, 256, 512, 1024], "num_warps": [1, 2, 4]},
}
MODULE = {"rms": "rms_norm", "add": "rms_norm", "layer": "layer_norm", "softmax": "softmax", "rope": "rope",
          "cross": "cross_entropy", "quantize": "fp8", "moe": "moe", "gelu": "activations", "silu": "activations",
          "swiglu": "activations", "geglu": "activations"}


def _reshaped(args: dict, shape: tuple[int, int] | None, g: torch.Generator) -> dict:
    """The perf case's arguments, or with ``shape`` = (rows, columns): every tensor of two or more
    dimensions drawn again as [rows, columns], every vector as [columns]."""
    if shape is None:
        return args
    out = {}
    for name, v in args.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim():
            size = shape if v.dim() >= 2 else shape[1:]
            v = torch.randn(size, generator=g, dtype=torch.float32).to(v.dtype)
        out[name] = v
    return out


def _inputs(kernel: str, shape: tuple[int, int] | None) -> tuple[list, tuple]:
    spec = kpt.SPECS[kernel]
    case = next(c for c in spec.cases() if c.perf)
    g = torch.Generator().manual_seed(0)
    args = to_device(_reshaped(case.make(g, torch.bfloat16), shape, g), torch.device("cuda"))
    # as in training: a forward that can prepare gradients does
    values = spec.forward_values(spec.check((), args, kpt.FLOAT_DTYPES), True)
    outs = as_tuple(spec.forward(*values)) if spec.backward else ()
    grads = tuple(torch.randn_like(o) if o.is_floating_point() else None for o in outs[: len(spec.outputs)])
    return values, outs + grads


def sweep(target: str) -> None:
    launcher, _, at = target.partition("@")
    shape = tuple(int(n) for n in at.split("x")) if at else None
    kernel, direction = launcher.rsplit("_", 1)
    module = importlib.import_module(f"kpt_triton.{MODULE[kernel.split('_')[0]]}")
    fn = getattr(module, launcher)
    table = TABLES[device.arch()].get(launcher, {})
    values, extra = _inputs(kernel, shape)
    call_args = values + (list(extra) if direction == "bwd" else [])
    expected = as_tuple(fn(*call_args, **table))
    grid = GRIDS[launcher]
    results = []
    for combo in itertools.product(*grid.values()):
        params = {**table, **dict(zip(grid, combo))}
        try:
            got = as_tuple(fn(*call_args, **params))
            if any(not torch.allclose(g.float(), e.float(), rtol=2e-2, atol=1e-3) for g, e in zip(got, expected)
                   if g is not None and g.is_floating_point() and g.numel()):
                results.append((float("inf"), params, "WRONG"))
                continue
            results.append((time_ms(lambda p=params: fn(*call_args, **p), torch.device("cuda")), params, ""))
        except Exception as exc:  # a combination the kernel cannot compile is skipped
            results.append((float("inf"), params, type(exc).__name__))
    results.sort(key=lambda r: r[0])
    current = time_ms(lambda: fn(*call_args, **table), torch.device("cuda"))
    print(f"{target}: table {current:.4f} ms {table}; best {results[0][0]:.4f} ms {results[0][1]}", flush=True)
    for t, p, note in results[1:4]:
        print(f"    {t:.4f} ms {p} {note}", flush=True)


if __name__ == "__main__":
    for target in sys.argv[1:] or GRIDS:
        sweep(target)
        torch.cuda.empty_cache()
