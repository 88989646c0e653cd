"""What a configured simulator is: number format, device profile, clock, per-kernel directives.

Defaults: float32 on an Alveo U250 at its 300 MHz. The environment can choose them for a
whole process (the conformance suite runs ``kpt.get_backend("fpga-sim")`` this way)::

    KPT_FPGA_SIM_FORMAT="ap_fixed<16,6,RND,SAT>"  KPT_FPGA_SIM_DEVICE=u280  KPT_FPGA_SIM_CLOCK_MHZ=250

Directives (per kernel, `Directives`):

    reuse         each operator serves this many issues: II = reuse, operators / reuse
    unroll        parallel lanes of a streaming loop, or MAC units of a matrix product;
                  default: lanes matched to the off-chip bandwidth, MAC units filling the
                  device up to 5% below each utilization limit (75% of the DSPs when they bind)
    partition     banks of the on-chip buffers (each bank has 2 ports); default: enough for
                  II = 1 at the chosen unroll
    dataflow      overlap the stages of the kernel (DATAFLOW) or run them one after the other
    partial_sums  split float accumulations into partial sums (II = 1) or keep one
                  accumulator (II = fadd latency)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from kpt.kernels import SPECS

from .devices import DEVICES, Device, OpCost, get_device, operators
from .formats import FLOAT32, ApFixed, Format, parse_format

MAC_BUDGET_MARGIN = 0.05
"""What a default matrix product leaves below each utilization limit for the rest of its design
(epilogue, control): it fills 75% of the DSPs when they bind."""
MAX_DATA_BITS = 24
"""Widest data format of fixed mode: a 24x24 product summed over 2^14 terms fits 64 bits."""


@dataclass(frozen=True)
class Directives:
    reuse: int = 1
    unroll: int | None = None
    partition: int | None = None
    dataflow: bool = True
    partial_sums: bool = True

    def __post_init__(self) -> None:
        for name in ("reuse", "unroll", "partition"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"directive {name}={value!r}: expected a positive integer")
        for name in ("dataflow", "partial_sums"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"directive {name}={getattr(self, name)!r}: expected True or False")

    def changed(self) -> dict[str, Any]:
        """The directives that differ from the defaults."""
        default = Directives()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}


DIRECTIVE_NAMES = tuple(f.name for f in fields(Directives))


@dataclass(frozen=True)
class SimConfig:
    format: Format = FLOAT32
    device: Device = DEVICES["u250"]
    clock_mhz: float = 300.0
    directives: tuple[tuple[str, Directives], ...] = ()
    operators: tuple[tuple[str, OpCost], ...] = field(default=())

    def directives_for(self, kernel: str) -> Directives:
        return dict(self.directives).get(kernel, Directives())

    def operator_library(self) -> dict[str, OpCost]:
        return operators(self.format, self.clock_mhz, dict(self.operators))

    @property
    def fixed(self) -> bool:
        return isinstance(self.format, ApFixed)

    def describe(self) -> str:
        return f"{self.format} on {self.device.name} at {self.clock_mhz:g} MHz"


def make_config(base: SimConfig, *, format: Format | str | None = None, device: Device | str | None = None,
                clock_mhz: float | None = None, directives: Mapping[str, Mapping[str, Any]] | None = None,
                operators: Mapping[str, OpCost] | None = None) -> SimConfig:
    """``base`` with the given settings replaced (``directives`` merge per kernel)."""
    changes: dict[str, Any] = {}
    if format is not None:
        changes["format"] = parse_format(format) if isinstance(format, str) else format
    if device is not None:
        changes["device"] = get_device(device)
        if clock_mhz is None:
            changes["clock_mhz"] = changes["device"].clock_mhz
    if clock_mhz is not None:
        if not (isinstance(clock_mhz, (int, float)) and 0 < clock_mhz <= 1000):
            raise ValueError(f"clock_mhz={clock_mhz!r}: expected a number in (0, 1000]")
        changes["clock_mhz"] = float(clock_mhz)
    if directives is not None:
        merged = dict(base.directives)
        for kernel, values in directives.items():
            if kernel not in SPECS:
                raise ValueError(f"directives for unknown kernel {kernel!r}; kernels: {', '.join(SPECS)}")
            unknown = set(values) - set(DIRECTIVE_NAMES)
            if unknown:
                raise ValueError(f"unknown directive(s) {sorted(unknown)} for {kernel!r}; "
                                 f"expected some of {DIRECTIVE_NAMES}")
            merged[kernel] = replace(merged.get(kernel, Directives()), **values)
        changes["directives"] = tuple(sorted(merged.items()))
    if operators is not None:
        changes["operators"] = tuple(sorted({**dict(base.operators), **operators}.items()))
    config = replace(base, **changes)
    if isinstance(config.format, ApFixed) and config.format.container[0] > MAX_DATA_BITS:
        raise ValueError(f"fixed-point data format {config.format} is wider than {MAX_DATA_BITS} bits "
                         "(an unsigned one counts a bit more, its sign in signed arithmetic): "
                         "products and their sums must stay within 64-bit accumulators")
    return config


ENVIRONMENT = (("KPT_FPGA_SIM_FORMAT", "format"), ("KPT_FPGA_SIM_DEVICE", "device"),
               ("KPT_FPGA_SIM_CLOCK_MHZ", "clock_mhz"))
"""The variables `from_environment` reads, each with the `make_config` setting it gives."""


def from_environment() -> SimConfig:
    """The default configuration, with the ``KPT_FPGA_SIM_*`` variables applied; a value that
    is not valid raises ValueError naming its variable."""
    config = SimConfig()
    for variable, setting in ENVIRONMENT:
        value = os.environ.get(variable)
        if not value:
            continue
        try:
            settings: dict[str, Any] = {setting: float(value) if setting == "clock_mhz" else value}
            config = make_config(config, **settings)
        except ValueError as exc:
            raise ValueError(f"{variable}={value!r}: {exc}") from None
    return config
