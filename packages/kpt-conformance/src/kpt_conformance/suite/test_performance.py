"""Performance: the backend against torch eager on the same device, in one run.

Each backend declares its bar per kernel and mode (`kpt.Backend.perf_bar`): a speedup over eager
and/or a fraction of the copy bandwidth / matmul rate measured in this same run. Only timing on a
real device gates. (The side-by-side with torch.compile and the best library is the benchmark's
job: ``python -m kpt.bench``.) Kernels without a bar, and backends without a real device (CPU
tensors: the reference backend, Triton's interpreter), are skipped with the reason, which the
report gives as "speed not checked". A simulator's CPU timing (``PerfBar(cases="conformance")``)
is measured in the mode it names against the reference backend and reported, without gating.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

import kpt
from kpt.bench.measure import measure, perf_cases
from kpt.bench.sweeps import MODES
from kpt.bench.timing import Ceilings
from kpt.ops import as_tuple

MIN_ROUNDS, MAX_ROUNDS = 5, 25
SETTLED = 0.05
"""CPU timing stops once two more rounds moved the median ratio by less than this fraction."""

PARAMS = [(spec, mode) for spec in kpt.SPECS.values() for mode in (MODES if spec.differentiable else MODES[:1])]


@pytest.fixture(scope="session")
def ceilings(backend: kpt.Backend, device: torch.device) -> Ceilings:
    return Ceilings.measure(device)


@pytest.mark.parametrize("spec, mode", PARAMS, ids=[f"{s.name}-{m}" for s, m in PARAMS])
def test_speed(backend: kpt.Backend, spec: kpt.KernelSpec, mode: str, request, record_property) -> None:
    record_property("kpt", {"kernel": spec.name, "kind": "perf", "mode": mode})
    bar = backend.perf_bar(spec.name, mode)
    if bar is None:
        pytest.skip(f"backend {backend.name!r} declares no speed bar for {spec.name}")
    if bar.cases == "conformance":
        return _simulation_speed(backend, spec, mode, record_property)
    if request.getfixturevalue("device").type == "cpu":
        pytest.skip(f"backend {backend.name!r} runs on CPU tensors here: no real device to time")
    ceilings = request.getfixturevalue("ceilings")
    for case in perf_cases(spec):
        r = measure(backend, spec, case, torch.bfloat16, mode, ceilings, ("eager",))
        assert not r.wrong, f"wrong result at the perf shape, no speed: {r.wrong}"
        speedup = r.speedup("eager")
        assert speedup is not None, f"the backend or eager was not timed at the perf shape ({r.ms})"
        record_property("kpt", {"numbers": {"speedup_eager": speedup,
                                             "ceiling_fraction": r.ceiling_fraction}, "ms": r.ms})
        if bar.min_speedup is not None:
            assert speedup >= bar.min_speedup, (
                f"{speedup:.2f}x eager, bar {bar.min_speedup}x ({r.ms})")
        if bar.min_ceiling_fraction is not None:
            assert r.ceiling_fraction >= bar.min_ceiling_fraction, (
                f"{r.ceiling_fraction:.1%} of the {r.bound} ceiling, bar {bar.min_ceiling_fraction:.0%}")


def _simulation_speed(backend, spec, mode, record_property) -> None:
    """A simulator on the CPU: the time of the conformance cases in ``mode``, against the
    reference backend, in rounds until the median ratio settles; reported with its spread, never
    gating (a shared CPU's timing swings too much to hold a bar)."""
    reference = kpt.get_backend("reference")
    g = torch.Generator().manual_seed(0)
    calls = [[_call(be, spec, mode, case.make(g, torch.float32)) for be in (backend, reference)]
             for case in spec.cases() if not case.device_only]
    ratios: list[float] = []
    while len(ratios) < MIN_ROUNDS or (len(ratios) < MAX_ROUNDS and not _settled(ratios)):
        ours = sum(_seconds(c[0]) for c in calls)
        theirs = sum(_seconds(c[1]) for c in calls)
        ratios.append(theirs / ours)
    median = statistics.median(ratios)
    q = statistics.quantiles(ratios, n=4)
    spread = (q[2] - q[0]) / median
    record_property("kpt", {"numbers": {"speed_vs_reference": median, "spread": spread}})
    pytest.skip(f"CPU timing, not gated: {median:.2f}x the reference backend's speed ({mode}, "
                f"median of {len(ratios)} rounds, interquartile spread {spread:.0%})")


def _settled(ratios: list[float]) -> bool:
    before, now = statistics.median(ratios[:-2]), statistics.median(ratios)
    return abs(now - before) <= SETTLED * now


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _call(backend: kpt.Backend, spec: kpt.KernelSpec, mode: str, args: dict):
    """One call of ``spec`` in ``mode``: the forward alone, or the forward and the gradients of
    its differentiable inputs."""
    if mode == "fwd":
        return lambda: backend.call(spec.name, **args)
    inputs = [n for n in spec.differentiable if isinstance(args[n], torch.Tensor)]
    leaves = {k: v.detach().requires_grad_(True) if k in inputs else v for k, v in args.items()}

    def forward_backward():
        outs = [o for o in as_tuple(backend.call(spec.name, **leaves)) if o.requires_grad]
        torch.autograd.grad(outs, [leaves[n] for n in inputs], [torch.ones_like(o) for o in outs], allow_unused=True)

    return forward_backward
