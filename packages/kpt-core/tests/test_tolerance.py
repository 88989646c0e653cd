"""The comparison rule of `kpt.tolerance`: the absolute floor ``abs_floor``."""

from __future__ import annotations

import torch

import kpt
from kpt.testing import check_backward, compare, tolerance_for

TOL = kpt.Tolerance(rel_norm=1e-3, atol=1e-3, rtol=1e-3)


def test_no_default_tolerance_has_a_floor() -> None:
    assert all(t.abs_floor == 0.0 for t in kpt.tolerance.DEFAULT_TOLERANCES.values())


def test_the_floor_raises_the_elementwise_and_the_norm_bound() -> None:
    ref = torch.full((100,), 1e-2, dtype=torch.float64)
    off = ref + 1e-4  # 1% of every element: beyond 1e-3 relative
    assert not compare("y", off, ref, TOL).ok
    assert compare("y", off, ref, kpt.Tolerance(1e-3, 1e-3, 1e-3, abs_floor=1e-4)).ok
    assert not compare("y", off, ref, kpt.Tolerance(1e-3, 1e-3, 1e-3, abs_floor=0.5e-4)).ok
    # one element off by 3x the floor fails elementwise although the norm of the error is small
    spike = ref.clone()
    spike[0] += 3e-4
    assert not compare("y", spike, ref, kpt.Tolerance(1e-3, 1e-3, 1e-3, abs_floor=1e-4)).ok
    # a floor below the relative bound changes nothing
    big = torch.linspace(-5, 5, 100, dtype=torch.float64)
    low = kpt.Tolerance(1e-3, 1e-3, 1e-3, abs_floor=1e-6)
    for out in (big + 4e-3, big * 1.002):
        assert compare("y", out, big, TOL).worst == compare("y", out, big, low).worst


def test_a_case_scale_widens_the_floor_too() -> None:
    class Floored(kpt.get_backend("reference").__class__):
        def call_tolerance(self, kernel, dtype, args, output):
            return kpt.Tolerance(1e-3, 1e-3, 1e-3, "floored", abs_floor=1e-4)

    y = torch.empty(3)
    assert tolerance_for(Floored(), "gelu", torch.float32, y, 4.0, {}, "y").abs_floor == 4e-4


def test_a_gradients_call_tolerance_sees_the_upstream_gradients() -> None:
    seen = {}

    class Recording(kpt.get_backend("reference").__class__):
        def call_tolerance(self, kernel, dtype, args, output):
            seen[output] = sorted(args)
            return None

    args = {"x": torch.randn(2, 8), "residual": torch.randn(2, 8), "weight": torch.randn(8), "eps": 1e-6}
    report = check_backward(Recording(), kpt.SPECS["add_rms_norm"], args, torch.float32, torch.Generator())
    assert report.ok, report.message
    assert seen["dx"] == ["dh", "dy", "eps", "residual", "weight", "x"]
