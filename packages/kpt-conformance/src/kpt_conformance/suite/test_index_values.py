"""Index values out of range: named by the checked mode, harmless without it.

Every kernel with index-like inputs (targets, expert ids, offsets, permutations) gets calls whose
shapes are valid but whose values are not (`KernelSpec.bad_indices`):

* in checked mode (`kpt.checking_indices`) each raises `kpt.KernelInputError` naming the kernel and
  the argument, and leaves its inputs unchanged;
* without it, a backend that checks by default (`Backend.checks_indices`) raises the same error; any
  other backend must stay inside its tensors and return the contract's defined result for those
  values (the reference math on float64 copies, computed with checks off), forward and backward,
  with outputs poisoned so that an unwritten element fails.
"""

from __future__ import annotations

import pytest
import torch

import kpt
from kpt.testing import check_backward, check_forward, modified, snapshot, to_device
from kpt_conformance.plugin import run_of

CASES = [(spec, bad) for spec in kpt.SPECS.values() for bad in spec.bad_indices()]
IDS = [f"{s.name}-{b.name}" for s, b in CASES]


def _assert_raises_naming(backend: kpt.Backend, spec: kpt.KernelSpec, bad: kpt.BadIndices, args: dict) -> None:
    before = snapshot(args)
    with pytest.raises(kpt.KernelInputError) as info:
        backend.call(spec.name, **args)
    message = str(info.value)
    assert spec.name in message and f"'{bad.arg}'" in message, f"error does not name {spec.name}/{bad.arg}: {message}"
    changed = modified(args, before)
    assert not changed, "; ".join(changed)


@pytest.mark.parametrize("spec, bad", CASES, ids=IDS)
def test_checked_mode_names_the_value(backend: kpt.Backend, device: torch.device, spec: kpt.KernelSpec,
                                      bad: kpt.BadIndices, record_property) -> None:
    record_property("kpt", {"kernel": spec.name, "kind": "errors", "case": bad.name})
    with kpt.checking_indices():
        _assert_raises_naming(backend, spec, bad, to_device(bad.make(), device))


@pytest.mark.parametrize("spec, bad", CASES, ids=IDS)
def test_unchecked_stays_defined(request: pytest.FixtureRequest, backend: kpt.Backend, device: torch.device,
                                 spec: kpt.KernelSpec, bad: kpt.BadIndices, record_property) -> None:
    record_property("kpt", {"kernel": spec.name, "kind": "errors", "case": bad.name})
    args = to_device(bad.make(), device)
    if backend.checks_indices:
        _assert_raises_naming(backend, spec, bad, args)
        return
    # the oracle (the reference backend) checks by default: its math gives the defined values
    with kpt.checking_indices(False):
        report = check_forward(backend, spec, args, torch.float32)
        assert report.ok, report.message
        if spec.differentiable and "backward" not in run_of(request.config).missing.get(spec.name, ()):
            report = check_backward(backend, spec, args, torch.float32, torch.Generator().manual_seed(0))
            assert report.ok, report.message
