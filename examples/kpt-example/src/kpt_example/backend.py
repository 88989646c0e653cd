"""The example backend: its own bodies where it has them, the contract's reference math elsewhere."""

from __future__ import annotations

import kpt

from . import activations, rms_norm, softmax


class ExampleBackend(kpt.Backend):
    name = "example"
    vendor = "Example Devices"
    device_type = "cpu"
    priority = 10

    def kernels(self) -> dict[str, kpt.Kernel]:
        reference = {name: kpt.Kernel(spec.forward, spec.backward) for name, spec in kpt.SPECS.items()}
        # its own bodies replace the reference ones, a missing backward included (silu)
        return {**reference, **kpt.kernels_from(rms_norm, activations, softmax)}
