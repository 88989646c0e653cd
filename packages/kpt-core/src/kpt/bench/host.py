"""The host's share of a call: one small call's wall time, beside an empty kernel's launch.

At the smallest shapes a device-event time is the larger of the device's time and the host's
time (argument checks, dispatch, launch), so the host's share needs its own number: `host_cost`
of each kernel's smallest shape, and the `baselines` of a one-element torch op and an empty
Triton kernel.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..backend import Backend
from ..spec import KernelSpec
from .measure import error_line
from .peers import eager_call, libraries


def _sync() -> None:
    """Wait for the accelerator, if there is one."""
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()


def host_us(run: Callable[[], Any], calls: int = 100, rounds: int = 5) -> float:
    """Host time of one call in microseconds: the wall clock of ``calls`` back-to-back calls with
    nothing synchronized inside (the median of ``rounds``). For a call whose kernels are shorter
    than its launch, this is what the call costs."""
    run()
    _sync()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            run()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        _sync()
    return statistics.median(samples)


@dataclass
class HostCost:
    """Host microseconds of one forward call of ``kernel`` at its smallest shape of the sweep."""

    kernel: str
    case: str
    us: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


def _empty_triton(t: torch.Tensor) -> Callable[[], Any]:
    """The launch of a Triton kernel that does nothing (one pointer argument), through Triton's
    Python launch path."""
    import triton

    @triton.jit
    def empty(x):
        pass

    return lambda: empty[(1,)](t)


def baselines(device: torch.device) -> dict[str, float | str]:
    """Host microseconds of the cheapest calls: a one-element torch op and an empty Triton kernel."""
    one = torch.zeros(1, device=device)
    out: dict[str, float | str] = {"torch op": host_us(lambda: torch.neg(one))}
    try:
        out["empty Triton kernel"] = host_us(_empty_triton(one))
    except Exception as exc:  # no Triton, or no Triton for this device
        out["empty Triton kernel"] = error_line(exc)
    return out


SMALL_CALL_S = 0.005
"""A call that takes longer than this (synchronized) has no host cost worth measuring: the device's
time is its cost."""


def host_cost(backend: Backend, spec: KernelSpec, args: dict[str, Any], label: str) -> HostCost:
    """Host time of one forward call of the backend, eager and each library present."""
    cost = HostCost(spec.name, label)
    impls: dict[str, Callable[..., Any]] = {"backend": lambda **kw: backend.call(spec.name, **kw),
                                            "eager": eager_call(spec, backend)}
    for name, fn in libraries(spec.name)[0].items():
        impls[name] = lambda fn=fn, **kw: fn(**spec.check((), kw, backend.dtypes))
    for name, call in impls.items():
        try:
            call(**args)  # compiled or tuned before it is timed
            start = time.perf_counter()
            call(**args)
            _sync()
            once = time.perf_counter() - start
            if once > SMALL_CALL_S:
                cost.errors[name] = f"not a small call ({once * 1e3:.1f} ms)"
                continue
            cost.us[name] = host_us(functools.partial(call, **args))
        except Exception as exc:
            cost.errors[name] = error_line(exc)
    return cost
