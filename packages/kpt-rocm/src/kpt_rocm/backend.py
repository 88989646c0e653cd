"""`RocmBackend`: the portable Triton kernels of kpt-triton, tuned per AMD architecture.

Only wiring on `kpt_triton.backend.TritonBackend`: device detection in `device`, tuning tables
(and the float8 handling of each architecture) in `tuning`. The products (``linear`` and
``grouped_linear``: `kpt_triton.products`; ``fp8_linear`` on gfx950) run through torch, i.e.
hipBLASLt, with kpt-triton's activation kernel as linear's epilogue.
"""

from __future__ import annotations

from kpt_triton.backend import TritonBackend

from . import device, tuning


class RocmBackend(TritonBackend):
    name = "rocm"
    vendor = "AMD"
    priority = 100
    tables = tuning.TABLES
    spills = tuning.SPILLS
    torch_products = True

    def device_status(self) -> tuple[bool, str]:
        return device.status()

    def detect_arch(self) -> str:
        return device.gcn_arch()

    def interpreter_arch(self) -> str:
        return device.interpreter_arch()

    def device_facts(self) -> dict[str, str]:
        return device.facts()

    def perf_bar(self, kernel: str, mode: str) -> None:
        """No speed is promised: these kernels have not yet been timed on AMD hardware."""
        return None
