"""Every bad-input case of the contract raises the documented error on the backend."""

from __future__ import annotations

import pytest
import torch

import kpt
from kpt.testing import to_device

CASES = [(spec, bad) for spec in kpt.SPECS.values() for bad in spec.bad_inputs()]


def _on(device: torch.device, args: dict) -> dict:
    """Move the CPU tensors to ``device``; a case may put a tensor elsewhere (meta) on purpose."""
    cpu = {k: v for k, v in args.items() if isinstance(v, torch.Tensor) and v.device.type == "cpu"}
    return {**args, **to_device(cpu, device)}


@pytest.mark.parametrize("spec, bad", CASES, ids=[f"{s.name}-{b.name}" for s, b in CASES])
def test_bad_input(backend: kpt.Backend, device: torch.device, spec: kpt.KernelSpec, bad: kpt.BadInput,
                   record_property) -> None:
    record_property("kpt", {"kernel": spec.name, "kind": "errors", "case": bad.name})
    with pytest.raises(bad.error) as info:
        backend.call(spec.name, **_on(device, bad.make()))
    assert spec.name in str(info.value), f"error does not name the kernel: {info.value}"
