"""Fixture backends built on the reference kernels, varied in one way each."""

from __future__ import annotations

import kpt
from kpt.reference import ReferenceBackend


class Fast(ReferenceBackend):
    name = "fixture-fast"
    vendor = "fixture"
    priority = 50


class Unavailable(ReferenceBackend):
    name = "fixture-unavailable"
    vendor = "fixture"
    priority = 90

    def is_available(self) -> tuple[bool, str]:
        return False, "no fixture device here"


class Simulator(ReferenceBackend):
    name = "fixture-sim"
    vendor = "fixture"
    priority = 1000
    simulator = True


class WrongVersion(ReferenceBackend):
    name = "fixture-wrong-version"
    vendor = "fixture"
    contract_version = 0


class Incomplete(ReferenceBackend):
    name = "fixture-incomplete"
    vendor = "fixture"

    def kernels(self):
        return {k: v for k, v in super().kernels().items() if k != "rms_norm"}


class AvailabilityRaises(ReferenceBackend):
    name = "fixture-availability-raises"
    vendor = "fixture"

    def is_available(self) -> tuple[bool, str]:
        raise RuntimeError("driver exploded")


@kpt.hookimpl
def kpt_backends():
    return [Fast(), Unavailable(), Simulator(), WrongVersion(), Incomplete(), AvailabilityRaises()]
