"""The cost model: II and latency rules, resources, the default designs' roofline promise."""

from __future__ import annotations

import math

import pytest
import torch

import kpt
from kpt_fpga_sim import configure
from kpt_fpga_sim.devices import DEVICES, memory_blocks, operators
from kpt_fpga_sim.formats import FLOAT32, ap_fixed
from kpt_fpga_sim.hls import Dataflow, Design, Loop, Sequential, evaluate

OPS = operators(FLOAT32, 300.0)
U250 = DEVICES["u250"]


def _report(top, buffers=(), traffic=0, work=1.0):
    return evaluate(Design("k", top, tuple(buffers), traffic, work), U250, 300.0, "float32", OPS)


def test_pipelined_loop_latency_and_ii_limits() -> None:
    depth = OPS["mul"].latency + OPS["add"].latency + 2
    r = _report(Loop("l", 100, {"mul": 4, "add": 4}, ("mul", "add")))
    assert (r.cycles, r.ii, r.dsp) == (depth + 99, 1, 4 * 3 + 4 * 2)
    reuse = _report(Loop("l", 100, {"mul": 4, "add": 4}, ("mul", "add"), ii=4))
    assert (reuse.cycles, reuse.ii, reuse.dsp) == (depth + 4 * 99, 4, 3 + 2)
    ports = _report(Loop("l", 100, {"mul": 8}, ("mul",), accesses={"buf": (8, 2)}))
    assert ports.ii == 2 and ports.ii_limit == "ports of buf"
    carried = _report(Loop("l", 100, {"add": 1}, ("add",), carried="add"))
    assert carried.ii == OPS["add"].latency and carried.ii_limit == "recurrence on add"
    flat = _report(Loop("l", 100, {"add": 1}, ("add",), pipelined=False))
    assert flat.cycles == 100 * (OPS["add"].latency + 2)


def test_dataflow_overlaps_and_sequential_adds() -> None:
    a = Loop("a", 1000, {"mul": 1}, ("mul",))
    b = Loop("b", 500, {"add": 1}, ("add",))
    fill = (OPS["mul"].latency + 2) + (OPS["add"].latency + 2)
    df = _report(Dataflow("r", (a, b), repeat=10))
    assert df.cycles == fill + 10 * 1000 and df.interval == 10 * 1000
    seq = _report(Sequential("r", (a, b), repeat=10))
    assert seq.cycles == 10 * ((OPS["mul"].latency + 2 + 999) + (OPS["add"].latency + 2 + 499))


def test_memory_bound_design_and_fit() -> None:
    loop = Loop("stream", 1000, {"mul": 1}, ("mul",))
    r = _report(loop, traffic=10**9, work=1e9)
    assert r.bound.startswith("memory") and r.cycles == math.ceil(1e9 / 77e9 * 300e6)
    assert r.gflops == pytest.approx(r.memory_roof_gflops, rel=1e-3)
    too_big = _report(Loop("wide", 10, {"mac": 3000}, ("mac",)))
    assert not too_big.fits and too_big.over_limit == ("dsp",)


def test_memory_blocks() -> None:
    assert memory_blocks(32, 512, U250) == {"bram18": 1}
    assert memory_blocks(32, 1024, U250) == {"bram18": 2}
    assert memory_blocks(72, 8192, U250) == {"uram": 2}
    assert memory_blocks(72, 8192, DEVICES["zynq7020"]) == {"bram18": 32}
    assert memory_blocks(16, 32, U250) == {"lut": 8}


def test_fixed_operators_by_width() -> None:
    assert operators(ap_fixed(16, 6), 300.0)["mul"].dsp == 1
    assert operators(ap_fixed(24, 8), 300.0)["mul"].dsp == 2
    assert operators(ap_fixed(8, 3), 300.0)["mul"].dsp == 0
    assert operators(FLOAT32, 100.0)["add"].latency < OPS["add"].latency


def _perf_args(kernel: str) -> dict:
    """The kernel's docs/performance.md case as meta tensors (a design needs shapes only)."""
    if kernel == "grouped_linear":
        # its case draws the routing with bincount, which meta tensors cannot run: the same shapes
        return {"x_sorted": torch.empty(32768, 4096, device="meta"),
                "offsets": torch.empty(9, dtype=torch.int32, device="meta"),
                "weight": torch.empty(8, 14336, 4096, device="meta")}
    case = next(c for c in kpt.SPECS[kernel].cases() if c.perf)
    with torch.device("meta"):
        return case.make(torch.Generator().manual_seed(0), torch.float32)


@pytest.mark.parametrize("device", ["u250", "u280", "zynq7020"])
@pytest.mark.parametrize("fmt", ["float32", "ap_fixed<16,6>"])
def test_matmul_family_keeps_ii_1_and_70_percent_of_the_dsp_roof(device: str, fmt: str) -> None:
    be = configure(format=fmt, device=device)
    for kernel in ("linear", "grouped_linear", "fp8_linear"):
        bar = be.design_bar(kernel)
        report = be.estimate(kernel, **_perf_args(kernel))
        assert report.ii == bar.ii, (kernel, report.ii_limit)
        fraction = report.compute_roof_fraction
        assert fraction >= bar.min_compute_roof_fraction, (kernel, fraction)
        assert report.fits, (kernel, report.over_limit, report.utilization)
    # the fused loss shares the device with its softmax unit (and may be bound by memory)
    fused = be.estimate("linear_cross_entropy", **_perf_args("linear_cross_entropy"))
    assert fused.ii == 1 and fused.fits and fused.roof_fraction > 0.6
    assert be.design_bar("rms_norm") is None and be.design_bar("linear_cross_entropy") is None


def test_directives_change_the_design_as_documented() -> None:
    x, w = torch.empty(1024, 1024, device="meta"), torch.empty(1024, 1024, device="meta")
    base = configure().estimate("linear", x, w)
    reuse = configure(directives={"linear": {"reuse": 4}}).estimate("linear", x, w)
    assert reuse.ii == 4 and reuse.dsp == pytest.approx(base.dsp / 4, rel=0.05)
    assert reuse.cycles == pytest.approx(4 * base.cycles, rel=0.05)
    serial = configure(directives={"linear": {"partial_sums": False}}).estimate("linear", x, w)
    assert serial.ii == OPS["add"].latency and serial.ii_limit == "recurrence on add"
    small = configure(directives={"linear": {"unroll": 64}}).estimate("linear", x, w)
    assert small.dsp < base.dsp / 10 and small.cycles > 10 * base.cycles
    starved = configure(directives={"rms_norm": {"unroll": 64, "partition": 4}})
    r = starved.estimate("rms_norm", torch.empty(64, 4096, device="meta"))
    assert r.ii == 8 and r.ii_limit == "ports of row"
    lanes = {u: configure(directives={"rms_norm": {"unroll": u}}).estimate(
        "rms_norm", torch.empty(512, 4096, device="meta")) for u in (4, 64)}
    assert lanes[4].bound.startswith("compute") and lanes[64].bound.startswith("memory")
    overlapped = configure().estimate("layer_norm", torch.empty(64, 4096, device="meta"))
    serial_rows = configure(directives={"layer_norm": {"dataflow": False}}).estimate(
        "layer_norm", torch.empty(64, 4096, device="meta"))
    assert serial_rows.cycles > 2 * overlapped.cycles


def test_devices_scale_the_same_design() -> None:
    x, w = torch.empty(4096, 4096, device="meta"), torch.empty(4096, 4096, device="meta")
    big = configure(device="u250").estimate("linear", x, w)
    small = configure(device="zynq7020").estimate("linear", x, w)
    assert small.dsp <= 0.8 * DEVICES["zynq7020"].dsp < big.dsp
    assert small.latency_us > 20 * big.latency_us
    assert small.clock_mhz == 100.0
