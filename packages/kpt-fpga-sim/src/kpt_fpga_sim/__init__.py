"""kpt-fpga-sim: every kpt kernel computed the way an HLS design would, with what it would cost.

    import kpt, kpt_fpga_sim
    be = kpt.get_backend("fpga-sim")                     # float32, Alveo U250, 300 MHz
    fx = kpt_fpga_sim.configure(be, format=kpt_fpga_sim.ap_fixed(16, 6, "RND", "SAT"),
                                device="u280", clock_mhz=250, directives={"linear": {"reuse": 4}})
    y = fx.linear(x, w)
    print(fx.last_report)                                # cycles, II, resources, roofline, overflows

A whole network as a constant-weight (hls4ml-style) design, layer by layer:

    report = kpt_fpga_sim.estimate_model(model, torch.zeros(1, 16), format="ap_fixed<16,6>", device="u250",
                                         clock_mhz=200, reuse=1, strategy="latency", io="parallel")
    print(report)                                        # like a C-synthesis summary

Number formats: `kpt_fpga_sim.formats`; cost model: `kpt_fpga_sim.hls`; devices and operator
library: `kpt_fpga_sim.devices`; networks: `kpt_fpga_sim.network`, its io_stream timing
`kpt_fpga_sim.stream`, `multipliers`, `calibration`; the C-simulation check: `kpt_fpga_sim.csim`.
"""

from __future__ import annotations

from .backend import DesignBar, FpgaSimBackend, configure
from .config import Directives, SimConfig
from .devices import DEVICES, Device, OpCost
from .formats import E4M3FN, E5M2, FLOAT32, ApFixed, Minifloat, ap_fixed, parse_format
from .hls import Report, format_table
from .network import LayerReport, NetworkReport, estimate_model

__version__ = "0.1.0"

__all__ = [
    "DEVICES", "E4M3FN", "E5M2", "FLOAT32", "ApFixed", "DesignBar", "Device", "Directives",
    "FpgaSimBackend", "LayerReport", "Minifloat", "NetworkReport", "OpCost", "Report", "SimConfig", "ap_fixed",
    "configure", "estimate_model", "format_table", "parse_format",
]
