"""Performance: the backend against torch eager on the same device, in one run.

Each backend declares its bar per kernel and mode (`kpt.Backend.perf_bar`): a speedup over eager
and/or a fraction of the copy bandwidth / matmul rate measured in this same run. (The side-by-side
with torch.compile and the best library is the benchmark's job: ``python -m kpt.benchmark``.) Kernels without a bar,
and backends without a real device (CPU tensors: the reference backend, Triton's interpreter), are
skipped with the reason.
"""

from __future__ import annotations

import pytest
import torch

import kpt
from kpt.benchmark import MODES, Ceilings, measure, perf_cases, time_ms

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
        return _simulation_speed(backend, spec, mode, bar, record_property)
    if request.getfixturevalue("device").type == "cpu":
        pytest.skip(f"backend {backend.name!r} runs on CPU tensors here: no real device to time")
    ceilings = request.getfixturevalue("ceilings")
    for case in perf_cases(spec):
        r = measure(backend, spec, case, torch.bfloat16, mode, ceilings, ("eager",))
        assert not r.wrong, f"wrong result at the perf shape, no speed: {r.wrong}"
        record_property("kpt", {"numbers": {"speedup_eager": r.speedup("eager"),
                                             "ceiling_fraction": r.ceiling_fraction}, "ms": r.ms})
        if bar.min_speedup is not None:
            assert r.speedup("eager") >= bar.min_speedup, (
                f"{r.speedup('eager'):.2f}x eager, bar {bar.min_speedup}x ({r.ms})")
        if bar.min_ceiling_fraction is not None:
            assert r.ceiling_fraction >= bar.min_ceiling_fraction, (
                f"{r.ceiling_fraction:.1%} of the {r.bound} ceiling, bar {bar.min_ceiling_fraction:.0%}")


def _simulation_speed(backend, spec, mode, bar, record_property) -> None:
    """Simulators: the total time over the conformance cases against the reference backend."""
    ref = kpt.get_backend("reference")
    g = torch.Generator().manual_seed(0)
    total = {"backend": 0.0, "reference": 0.0}
    for case in spec.cases():
        if case.perf:
            continue
        args = case.make(g, torch.float32)
        for name, be in (("backend", backend), ("reference", ref)):
            total[name] += time_ms(lambda be=be, args=args: be.call(spec.name, **args), torch.device("cpu"))
    speedup = total["reference"] / total["backend"]
    record_property("kpt", {"numbers": {"speedup_reference": speedup}})
    assert speedup >= bar.min_speedup, f"{1 / speedup:.1f}x slower than the reference, bar {1 / bar.min_speedup:.0f}x"
