"""Forward and backward numerics of every kernel x case x dtype against the float64 oracle.

Inputs are drawn fresh every run (the seed is printed and saved in the report; ``--seed`` replays a
run). Perf-size and other large cases (`kpt.Case.device_only`) run only on a real device (never on
the CPU), in bfloat16.
"""

from __future__ import annotations

import pytest
import torch

import kpt
from kpt.testing import CheckReport, check_backward, check_forward, to_device
from kpt_conformance.plugin import run_of


def _params(config: pytest.Config, backward: bool) -> list:
    run = run_of(config)
    on_cpu = run.device.type == "cpu"
    params = []
    for spec in kpt.SPECS.values():
        if backward and not spec.differentiable:
            continue
        for case in spec.cases():
            if (case.device_only and on_cpu) or (backward and not case.grad):
                continue
            for dtype in run.dtypes:
                if case.device_only and dtype != torch.bfloat16:
                    continue  # real-size numerics in the training dtype keep a device run short
                if case.dtypes is None or dtype in case.dtypes:
                    name = str(dtype).removeprefix("torch.")
                    params.append(pytest.param(spec, case, dtype, id=f"{spec.name}-{case.name}-{name}"))
    return params


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if {"spec", "case", "dtype"} <= set(metafunc.fixturenames):
        backward = metafunc.function.__name__ == "test_backward"
        metafunc.parametrize("spec, case, dtype", _params(metafunc.config, backward))


def _inputs(request: pytest.FixtureRequest, device: torch.device, case: kpt.Case, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(run_of(request.config).seed(request.node.nodeid))
    return to_device(case.make(g, dtype), device)


def _record(record_property, spec, case, dtype, kind) -> None:
    # recorded before the call, so that a test whose kernel raises is reported with its case
    record_property("kpt", {"kernel": spec.name, "kind": kind, "case": case.name, "description": case.description,
                            "dtype": str(dtype).removeprefix("torch.")})


def _judge(record_property, report: CheckReport) -> None:
    record_property("kpt", {"worst": report.worst})
    if not report.ok:
        pytest.fail(report.message, pytrace=False)


def test_forward(request, backend, device, spec, case, dtype, record_property) -> None:
    _record(record_property, spec, case, dtype, "forward")
    _judge(record_property, check_forward(backend, spec, _inputs(request, device, case, dtype), dtype,
                                          case.tolerance_scale, case.eager_factor))


def test_backward(request, backend, device, spec, case, dtype, record_property) -> None:
    _record(record_property, spec, case, dtype, "backward")
    g = torch.Generator().manual_seed(run_of(request.config).seed(request.node.nodeid + "/grad"))
    _judge(record_property, check_backward(backend, spec, _inputs(request, device, case, dtype), dtype, g,
                                           case.tolerance_scale, case.eager_factor))
