"""Sweep tuning parameters of kpt-triton launchers at the docs/performance.md shapes on the current GPU.

    python3 scripts/tune_sweep.py rms_norm_bwd softmax_fwd ...

For each launcher it times every combination of its grid (median, device events) on the kernel's
perf case in bfloat16, checks the result against the portable defaults, and prints the best
parameters, to be copied into ``kpt_cuda/tuning.py``.
"""

from __future__ import annotations

import importlib
import itertools
import sys

import torch

import kpt
from kpt.benchmark import time_ms
from kpt.ops import as_tuple
from kpt.testing import to_device

ROW = {"tile_elems": [2048, 4096, 8192, 16384], "elems_per_warp": [256, 512, 1024]}
GRIDS: dict[str, dict[str, list]] = {
    "rms_norm_bwd": {**ROW, "programs_per_sm": [2, 4, 8, 16]},
    "layer_norm_bwd": {**ROW, "programs_per_sm": [2, 4, 8, 16]},
    "softmax_fwd": {"tile_elems": [2048, 4096, 8192], "elems_per_warp": [512, 1024, 2048], "stream": [False, True]},
    "layer_norm_fwd": {"tile_elems": [4096, 8192, 16384], "elems_per_warp": [512, 1024, 2048],
                       "stream": [False, True]},
    "softmax_bwd": ROW,
    "rope_fwd": {"tile_elems": [1024, 2048, 4096], "elems_per_warp": [128, 256, 512], "stream": [False, True]},
    "cross_entropy_fwd": {"block_v": [8192, 16384, 32768], "elems_per_warp": [512, 1024, 2048],
                          "programs_per_sm": [1, 2, 4, 8, 16]},
    "quantize_fp8_fwd": {"tile_elems": [4096, 8192], "elems_per_warp": [512, 1024, 2048], "native_cast": [True]},
    "moe_gating_fwd": {"tile_elems": [128, 256, 512, 1024], "num_warps": [1, 2, 4]},
}
MODULE = {"rms": "rms_norm", "layer": "layer_norm", "softmax": "softmax", "rope": "rope", "cross": "cross_entropy",
          "quantize": "fp8", "moe": "moe"}


def _inputs(kernel: str) -> tuple[list, tuple]:
    spec = kpt.SPECS[kernel]
    case = next(c for c in spec.cases() if c.perf)
    args = to_device(case.make(torch.Generator().manual_seed(0), torch.bfloat16), torch.device("cuda"))
    # as in training: a forward that can prepare gradients does
    values = spec.forward_values(spec.check((), args, kpt.FLOAT_DTYPES), True)
    outs = as_tuple(spec.forward(*values)) if spec.backward else ()
    grads = tuple(torch.randn_like(o) if o.is_floating_point() else None for o in outs[: len(spec.outputs)])
    return values, outs + grads


def sweep(launcher: str) -> None:
    kernel, direction = launcher.rsplit("_", 1)
    module = importlib.import_module(f"kpt_triton.{MODULE[kernel.split('_')[0]]}")
    fn = getattr(module, launcher)
    values, extra = _inputs(kernel)
    call_args = values + (list(extra) if direction == "bwd" else [])
    expected = as_tuple(fn(*call_args))
    grid = GRIDS[launcher]
    results = []
    for combo in itertools.product(*grid.values()):
        params = dict(zip(grid, combo))
        try:
            got = as_tuple(fn(*call_args, **params))
            if any(not torch.allclose(g.float(), e.float(), rtol=2e-2, atol=1e-3) for g, e in zip(got, expected)
                   if g.is_floating_point() and g.numel()):
                results.append((float("inf"), params, "WRONG"))
                continue
            results.append((time_ms(lambda p=params: fn(*call_args, **p), torch.device("cuda")), params, ""))
        except Exception as exc:  # a combination the kernel cannot compile is skipped
            results.append((float("inf"), params, type(exc).__name__))
    results.sort(key=lambda r: r[0])
    default = time_ms(lambda: fn(*call_args), torch.device("cuda"))
    print(f"{launcher}: default {default:.4f} ms; best {results[0][0]:.4f} ms {results[0][1]}", flush=True)
    for t, p, note in results[1:4]:
        print(f"    {t:.4f} ms {p} {note}", flush=True)


if __name__ == "__main__":
    for name in sys.argv[1:] or GRIDS:
        sweep(name)
        torch.cuda.empty_cache()
