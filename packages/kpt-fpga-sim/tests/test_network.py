"""Whole networks as constant-weight designs: the multiplier rule, estimate_model's layers and
settings, the devices, and the calibration against published C-synthesis reports."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from torch import nn

from kpt.errors import KernelInputError, KernelNotSupportedError
from kpt_fpga_sim import calibration, configure, estimate_model, multipliers, network, stream
from kpt_fpga_sim.devices import SERIES7, ULTRASCALE_PLUS, get_device, memory_blocks, operators
from kpt_fpga_sim.formats import ap_fixed
from kpt_fpga_sim.hls import Design, Loop, format_table, resources
from kpt_fpga_sim.network import nearest_reuse, valid_reuse


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


def _mlp(g: torch.Generator, *sizes: int) -> nn.Sequential:
    mods: list[nn.Module] = []
    for a, b in itertools.pairwise(sizes):
        lin = nn.Linear(a, b)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(b, a, generator=g) * 0.3)
            lin.bias.copy_(torch.randn(b, generator=g) * 0.1)
        mods += [lin, nn.ReLU()]
    return nn.Sequential(*mods[:-1])


# -- the multiplier rule --------------------------------------------------------------------------

def _fewest_signed_digits(a: int) -> int:
    """By search: the fewest ±2^k terms summing to a."""
    frontier, seen = {a}, {a}
    for n in range(1, 12):
        nxt = set()
        for v in frontier:
            for k in range(12):
                for t in (v - (1 << k), v + (1 << k)):
                    if t == 0:
                        return n
                    if abs(t) < 4096 and t not in seen:
                        seen.add(t)
                        nxt.add(t)
        frontier = nxt
    raise AssertionError(a)


def test_naf_digits_are_the_fewest_signed_digits() -> None:
    assert multipliers.naf_digits(0) == 0
    for a in range(1, 300):
        assert multipliers.naf_digits(a) == _fewest_signed_digits(a), a


def test_constant_products_by_operands() -> None:
    fam = ULTRASCALE_PLUS
    assert multipliers.constant(0, 16, fam).kind == "zero"
    for raw in (1, -1, 64, -512, 2**14):
        assert multipliers.constant(raw, 16, fam) == multipliers.SHIFT
    for raw in (3, -7, 96, 5 << 4, -(2**9 + 1)):            # two signed digits
        p = multipliers.constant(raw, 16, fam)
        assert (p.kind, p.dsp) == ("shift-add", 0) and p.lut > 0
    for raw in (11, -301, 0x2AB):                           # three or more
        assert multipliers.constant(raw, 16, fam) == multipliers.Product("dsp", dsp=1)
    # a 30-bit operand overflows the 27-bit port; the 25-bit port of a DSP48E1 earlier
    assert multipliers.constant(301, 30, fam).dsp == 2
    assert multipliers.constant(301, 26, SERIES7).dsp == 2
    assert multipliers.constant(301, 26, fam).dsp == 1
    narrow = multipliers.constant(11, 6, fam)
    assert (narrow.kind, narrow.dsp) == ("lut", 0) and narrow.lut > 0
    assert multipliers.general(16, 16, fam).dsp == 1 and multipliers.general(6, 6, fam).dsp == 0


# -- estimate_model ---------------------------------------------------------------------------------

def test_dsp_follows_the_weights() -> None:
    g = _gen()
    model = _mlp(g, 12, 20, 7)
    x = torch.randn(1, 12, generator=g)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    full = estimate_model(model, x)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())     # inputs unchanged
    linears = [r for r in full.layers if r.op == "Linear"]
    assert full.dsp == sum(r.dsp for r in full.layers) and all(r.dsp > 0 for r in linears)
    # the multiplier rule, weight by weight, gives the first layer's count
    raw = ap_fixed(16, 6).from_float(model[0].weight.detach().double())[0]
    expect = sum(multipliers.constant(int(v), 16, ULTRASCALE_PLUS).dsp for v in raw.flatten())
    assert linears[0].dsp == expect
    with torch.no_grad():
        model[0].weight.zero_()                              # pruned: nothing left to multiply
        model[2].weight.copy_(torch.randint(-3, 4, model[2].weight.shape, generator=g).double().exp2()
                              * torch.randint(0, 2, model[2].weight.shape, generator=g).mul(2).sub(1))
    cheap = estimate_model(model, x)
    assert [r.dsp for r in cheap.layers if r.op == "Linear"] == [0, 0]              # zeros and shifts
    assert cheap.lut < full.lut


def test_reuse_strategy_and_overrides() -> None:
    g = _gen()
    model = _mlp(g, 16, 64, 32)
    x = torch.randn(1, 16, generator=g)
    lat1 = estimate_model(model, x)
    assert lat1.interval == 1 and all(r.reuse == 1 for r in lat1.layers)
    lat4 = estimate_model(model, x, reuse=4)
    assert lat4.interval == 4 and lat4.dsp < lat1.dsp
    assert lat4.latency_cycles > lat1.latency_cycles
    res = estimate_model(model, x, reuse=8, strategy="resource")
    dense = [r for r in res.layers if r.op == "Linear"]
    # every weight through a shared multiplier: n·k / reuse of them, 16x16 bits = one DSP each
    assert [r.dsp for r in dense] == [16 * 64 // 8, 64 * 32 // 8]
    assert res.interval == 8 and all(r.latency_cycles >= 8 for r in dense)
    mixed = estimate_model(model, x, layers={"2": {"reuse": 2, "weight_format": "ap_fixed<8,2>"}})
    per = {r.name: r for r in mixed.layers}
    assert per["2"].reuse == 2 and per["2"].interval == 2 and per["0"].reuse == 1
    assert mixed.interval == 2


def test_reuse_adjusted_to_a_valid_factor() -> None:
    for n_in, n_out, want in [(16, 64, 5), (16, 5, 7), (32, 32, 3), (10, 3, 4)]:
        got = nearest_reuse(n_in, n_out, want)
        valid = [r for r in range(1, n_in * n_out + 1) if valid_reuse(n_in, n_out, r)]
        assert got in valid and abs(got - want) == min(abs(r - want) for r in valid)
        assert all((n_in * n_out) % r == 0 for r in valid)
    g = _gen()
    model = _mlp(g, 10, 3)
    rep = estimate_model(model, torch.randn(1, 10, generator=g), reuse=4, strategy="resource")
    assert rep.layers[0].reuse == nearest_reuse(10, 3, 4) != 4 and "reuse 4 ->" in rep.layers[0].note
    kept = estimate_model(model, torch.randn(1, 10, generator=g), reuse=4)   # the latency strategy keeps it
    assert kept.layers[0].reuse == 4 and kept.layers[0].interval == 4 and "reuse" not in kept.layers[0].note


def test_batchnorm_is_folded_into_the_layer_before() -> None:
    g = _gen()
    conv = nn.Conv2d(3, 6, 3, padding=1)
    # a batch-norm whose folding is exact in float32 (scales ±2^k, no shift): the estimator folds in
    # float64, and a float32 fold by hand would round some weights across a step of the weight
    # format (a DSP more or less on one draw in several)
    bn = nn.BatchNorm2d(6, eps=0.0)
    with torch.no_grad():
        bn.running_mean.zero_()
        bn.running_var.fill_(1.0)
        signs = torch.where(torch.rand(6, generator=g) < 0.5, -1.0, 1.0)
        bn.weight.copy_(signs * 2.0 ** torch.randint(-2, 3, (6,), generator=g))
        bn.bias.zero_()
    model = nn.Sequential(conv, bn, nn.ReLU()).eval()
    x = torch.randn(1, 3, 8, 8, generator=g)
    rep = estimate_model(model, x)
    folded = nn.Conv2d(3, 6, 3, padding=1)
    scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    with torch.no_grad():
        folded.weight.copy_(conv.weight * scale[:, None, None, None])
        folded.bias.copy_((conv.bias - bn.running_mean) * scale + bn.bias)
    ref = estimate_model(nn.Sequential(folded, nn.ReLU()), x)
    assert rep.layers[0].op == "Conv2d+BatchNorm" and rep.layers[1].architecture.startswith("folded")
    assert (rep.dsp, rep.lut, rep.latency_cycles) == (ref.dsp, ref.lut, ref.latency_cycles)


def test_cnn_parallel_and_stream() -> None:
    g = _gen()
    model = nn.Sequential(nn.ZeroPad2d(1), nn.Conv2d(2, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Identity(),
                          nn.Conv2d(4, 8, 3), nn.Tanh(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 3), nn.Sigmoid()).eval()
    x = torch.randn(1, 2, 12, 12, generator=g)
    par = estimate_model(model, x)
    convs = [r for r in par.layers if r.op == "Conv2d"]
    # one output pixel per step: 12x12 then 4x4 output pixels
    assert [r.interval for r in convs] == [144, 16] and par.interval == 144
    st = estimate_model(model, x, io="stream", reuse=2)
    sconvs = [r for r in st.layers if r.op == "Conv2d"]
    # hls4ml's loop over the 14x14 padded input pixels, pipelined at II = reuse
    assert sconvs[0].reuse == 2 and sconvs[0].interval == 14 * 14 * 2 + 1
    assert st.interval == max(r.interval for r in st.layers)
    # the layers overlap: more than the slowest layer, less than the sum of them
    assert sconvs[0].latency_cycles < st.latency_cycles < sum(r.latency_cycles for r in st.layers)
    res = estimate_model(model, x, io="stream", reuse=4, strategy="resource")
    rconv = next(r for r in res.layers if r.op == "Conv2d")
    # not pipelined: every pixel shifts the window (C·K² = 18 values, less the cycles saved) and
    # runs a whole resource-strategy product (R = 4 and its ROM read, multiply, accumulate, write)
    product = rconv.reuse + 2 + 1
    assert rconv.interval == 14 * 14 * (product + 18 - network.WINDOW_SHIFT_SAVED) + 1
    assert {r.op for r in st.layers} >= {"tanh", "sigmoid", "AdaptiveAvgPool2d", "MaxPool2d", "pad"}
    assert all(r.bram18 > 0 for r in st.layers if r.op in ("tanh", "sigmoid"))       # the tables
    conv1d = nn.Sequential(nn.Conv1d(3, 5, 3), nn.ReLU(), nn.AvgPool1d(2), nn.Flatten(), nn.Linear(15, 2))
    r1 = estimate_model(conv1d, torch.randn(1, 3, 8, generator=g), io="stream")
    assert r1.layers[0].op == "Conv1d" and r1.dsp > 0


def test_stream_flow_follows_every_beat() -> None:
    # iteration i starts when its beat is in and iteration i - 1 is ii cycles old
    flow = stream.Flow(torch.tensor([0, 1, -1, 2]), 2, torch.tensor([True, False, True, True]), 3)
    out, done = flow.run(torch.tensor([0, 10, 11]))
    assert out.tolist() == [3, 15, 17] and done == 17          # starts 0, 10, 12, 14
    # a padded row: the padding pixels wait for the input pixel before them
    deps, index = stream.padded_sources((2,), [(1, 2)])
    assert deps.tolist() == [-1, 0, 1, 1, 1] and index[0].tolist() == [0, 1, 2, 3, 4]

    from torch.nn import functional as F

    class Padded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(1, 2, 3)

        def forward(self, x):
            return self.conv(F.pad(x, pad=(1, 2, 0, 1)))

    x = torch.randn(1, 1, 6, 6)
    functional = estimate_model(Padded(), x, io="stream")
    module = estimate_model(nn.Sequential(nn.ZeroPad2d((1, 2, 0, 1)), nn.Conv2d(1, 2, 3)), x, io="stream")
    assert (functional.latency_cycles, functional.interval) == (module.latency_cycles, module.interval)
    assert module.interval == 9 * 7 + 1       # the 9x7 padded image at II = 1


def test_functional_calls_are_layers_too() -> None:
    from torch.nn import functional as F

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(2, 3, 3)
            self.fc = nn.Linear(3 * 8, 4)

        def forward(self, v):
            v = F.pad(v, (1, 1))
            v = F.relu(self.conv(v))
            v = torch.flatten(v, 1)
            return torch.softmax(torch.sigmoid(self.fc(v)).view(1, -1), dim=-1)

    g = _gen()
    rep = estimate_model(Net(), torch.randn(1, 2, 8, generator=g), io="stream")
    assert [r.op for r in rep.layers] == ["pad", "Conv1d", "relu", "Linear", "sigmoid", "softmax"]
    assert estimate_model(Net(), torch.randn(1, 2, 8, generator=g)).dsp > 0


def test_report_prints_like_a_synthesis_summary() -> None:
    g = _gen()
    rep = estimate_model(nn.Sequential(_mlp(g, 16, 8, 5), nn.Softmax(dim=-1)), torch.randn(1, 16, generator=g),
                         device="xcvu9p-flga2104-2L-e")
    text = str(rep)
    assert "xcvu9p" in text and f"+ Latency: {rep.latency_cycles:,} cycles" in text
    assert f"{rep.dsp:,}" in text and f"{rep.lut:,}" in text
    for layer in rep.layers:
        assert f"| {layer.name} " in text
    assert rep.fits and json.loads(json.dumps(rep.as_dict()))["layers"][0]["name"] == rep.layers[0].name


def test_bad_input_is_a_clear_error() -> None:
    g = _gen()
    model = _mlp(g, 4, 3)
    x = torch.randn(1, 4, generator=g)
    for kwargs in ({"strategy": "fast"}, {"io": "axi"}, {"reuse": 0}, {"format": "float32"},
                   {"layers": {"nope": {"reuse": 2}}}, {"layers": {"0": {"unroll": 2}}}, {"device": "u9000"},
                   {"clock_mhz": 0}):
        with pytest.raises(KernelInputError):
            estimate_model(model, x, **kwargs)
    with pytest.raises(KernelInputError):
        estimate_model(model, torch.randn(2, 4, generator=g))
    with pytest.raises(KernelNotSupportedError):
        estimate_model(nn.Sequential(nn.Linear(4, 4), nn.GELU()), x)

    class Branchy(nn.Module):
        def forward(self, v):
            return v if v.sum() > 0 else -v

    with pytest.raises(KernelNotSupportedError):
        estimate_model(Branchy(), x)


# -- devices and the row kernels --------------------------------------------------------------------

def test_devices_by_full_part_name() -> None:
    for part, name in [("xcu250-figd2104-2L-e", "u250"), ("xc7z020clg400-1", "zynq7020"), ("xcu50-fsvh2104-2-e", "u50"),
                       ("xcvu9p-flga2104-2L-e", "vu9p"), ("xcvu13p-fhga2104-2L-e", "vu13p"),
                       ("xcku115-flvb2104-2-e", "ku115"), ("XCU280", "u280")]:
        assert get_device(part).name == name
    for bad in ("xcu9999", "xcu2500-figd2104", "vu19p"):
        with pytest.raises(ValueError):
            get_device(bad)


def test_kernel_reports_name_their_architecture() -> None:
    meta = torch.device("meta")
    be = configure()
    lin = be.estimate("linear", x=torch.empty(64, 128, device=meta), weight=torch.empty(32, 128, device=meta))
    assert lin.architecture.startswith("streamed weights: a GEMM engine")
    assert "architecture of linear: streamed weights" in format_table([lin])
    norm = be.estimate("rms_norm", x=torch.empty(4, 64, device=meta), weight=torch.empty(64, device=meta))
    assert norm.architecture == "operands streamed from off-chip memory"


def test_row_lanes_capped_at_the_row_and_tables_counted() -> None:
    x = torch.empty(64, 5, device="meta")
    fmt = ap_fixed(16, 6)
    free = configure(format=fmt).estimate("softmax", x=x, dim=-1)
    five = configure(format=fmt, directives={"softmax": {"unroll": 5}}).estimate("softmax", x=x, dim=-1)
    assert (free.dsp, free.lut, free.bram18) == (five.dsp, five.lut, five.bram18)
    ops = operators(fmt, 200.0)
    width, depth = ops["exp"].rom
    assert width > 0 and depth > 0
    design = Design("t", Loop("l", 4, {"exp": 3}, ("exp",)), (), 0, 0.0)
    per_copy = memory_blocks(width, depth, get_device("u250"))
    got = resources(design, get_device("u250"), ops)
    assert got["bram18"] + 16 * got["uram"] == 2 * (per_copy.get("bram18", 0) + 16 * per_copy.get("uram", 0)) > 0


# -- calibration ----------------------------------------------------------------------------------

def _key(report) -> str:
    return report.name


_EXPECTED_MISSES = {("taitashaw/hls4ml-fpga-classifier/my-hls-test", "ff")}
"""Cells outside the tolerance. my-hls-test (held out, Vitis 2025.2, io_stream): 19,480 FF
estimated against 5,127, the pipeline registers of a
latency-strategy dense layer that this tool version and hls4ml's newer stream dense do without."""


@pytest.mark.parametrize("report", calibration.REPORTS, ids=_key)
def test_calibration_within_tolerance(report) -> None:
    est = calibration.estimate(report)
    for quantity, factor in calibration.TOLERANCE.items():
        e, r = getattr(est, quantity), report.numbers[quantity]
        inside = r / factor <= e <= r * factor
        if (_key(report), quantity) in _EXPECTED_MISSES:
            assert not inside, f"{quantity}: {e} now within {factor}x of {r}: drop the expected miss"
            continue
        assert inside, f"{_key(report)} {quantity}: estimate {e}, report {r}"


def test_held_out_reports_smape() -> None:
    held = [r for r in calibration.REPORTS if r.held_out]
    assert len(held) >= 8 and {r.io for r in held} == {"parallel", "stream"} and any(r.layers for r in held)
    # each within 2x on latency, interval and DSP: test_calibration_within_tolerance, no miss excused
    assert all(calibration.TOLERANCE[q] == 2.0 for q in ("latency_cycles", "interval", "dsp"))
    assert not {q for _, q in _EXPECTED_MISSES} & {"latency_cycles", "interval", "dsp"}
    got = calibration.smapes(held)
    # measured on the eight held-out reports: latency 14%, interval 8%, DSP 6% (the four gathered
    # first alone: latency 26%, the Vitis 2025.2 io_stream MLP at 1.8x); the target is latency 25%,
    # and the bounds sit just above the measured numbers so that a regression fails
    assert got["latency_cycles"] <= 16 and got["interval"] <= 10 and got["dsp"] <= 8, got


_TUTORIAL_ESTIMATES = {
    "model_1": (15, 1, 1562, 75905, 18119, 4),
    "model_2": (13, 1, 808, 23561, 5871, 4),
    "model_3": (11, 1, 35, 24895, 8068, 4),
}
"""calibration.QUANTITIES of the three hls4ml-tutorial reports as estimated from their trained
weights, recorded before those files were replaced by the histograms of `published_weights`."""


def test_histograms_give_the_trained_weights_estimates() -> None:
    reports = {r.path.split("/")[0]: r for r in calibration.REPORTS if r.weights}
    assert set(reports) == set(_TUTORIAL_ESTIMATES)
    for key, rep in reports.items():
        est = calibration.estimate(rep)
        assert tuple(getattr(est, q) for q in calibration.QUANTITIES) == _TUTORIAL_ESTIMATES[key], key
        if rep.zeros:
            # the weights parameters.h states pruned, and in model_2's second layer three small
            # ones that truncate to 0 in the weight type
            zeros = [int((w == 0).sum()) for w in calibration.published_weights(rep.weights).values()]
            more = [z - n for z, n in zip(zeros, rep.zeros, strict=True)]
            assert more == ([0, 3, 0, 0] if key == "model_2" else [0, 0, 0, 0]), key


def test_estimate_reads_the_value_histogram_and_fan_in_only() -> None:
    rep = next(r for r in calibration.REPORTS if r.weights == "hls4ml-tutorial_model_2.hist")   # pruned
    build, shape = calibration.MODELS[rep.model]
    weights = calibration.published_weights(rep.weights)

    def cost(layout: dict[str, torch.Tensor]) -> network.NetworkReport:
        model = build().eval()
        with torch.no_grad():
            for name, w in layout.items():
                model.get_submodule(name).weight.copy_(w)
                model.get_submodule(name).bias.zero_()
        return calibration._estimate(model, shape, rep)

    base = cost(weights)
    g = _gen()
    # the nonzero values moved between outputs, each output keeping its count, and then between inputs
    mixed = {}
    for name, w in weights.items():
        moved = torch.zeros_like(w)
        moved[w != 0] = w[w != 0][torch.randperm(int((w != 0).sum()), generator=g)]
        mixed[name] = torch.stack([row[torch.randperm(len(row), generator=g)] for row in moved])
    assert cost(mixed) == base
    # every entry shuffled: the outputs' counts of nonzero weights change, and so do their adder trees
    g = torch.Generator().manual_seed(0)
    shuffled = {name: w.flatten()[torch.randperm(w.numel(), generator=g)].reshape(w.shape)
                for name, w in weights.items()}
    assert any(not torch.equal((shuffled[n] != 0).sum(1), (w != 0).sum(1)) for n, w in weights.items())
    changed = cost(shuffled)
    assert changed.dsp == base.dsp and (changed.latency_cycles, changed.ff) != (base.latency_cycles, base.ff)


def test_histogram_file() -> None:
    w = calibration.weights_from_histograms("# two outputs\nlayer 0 2 2 3\nfan_in 1 2\nvalues -4:1 0:1 8:2\n")["0"]
    assert w.shape == (2, 2) and sorted(w.flatten().tolist()) == [-0.5, 0.0, 1.0, 1.0]
    assert (w != 0).sum(1).tolist() == [1, 2]
    for bad, message in [("layer 0 2 2 3 values 0:4", "expected 'layer"),
                         ("layer 0 2 2 3 fan_in 1 values 0:4", "expected 2 fan-in counts"),
                         ("layer 0 2 2 3 fan_in 1 2 values 0:1 8:2 8:1", "distinct '<integer>:<count>'"),
                         ("layer 0 2 2 3 fan_in 1 2 values 0:1 8=3", "distinct '<integer>:<count>'"),
                         ("layer 0 2 2 3 fan_in 1 2 values 0:1 8:2", "do not fill a 2 x 2"),
                         ("layer 0 2 2 3 fan_in 1 1 values 0:1 8:3", "do not fill a 2 x 2"),
                         ("layer 0 2 2 3 fan_in 3 1 values 8:4", "do not fill a 2 x 2")]:
        with pytest.raises(ValueError, match=message):
            calibration.weights_from_histograms(bad, "bad.hist")


def test_calibrate_cli(capsys) -> None:
    from kpt_fpga_sim.__main__ import main
    assert main(["calibrate"]) == 0
    out = capsys.readouterr().out
    assert all(r.source in out for r in calibration.REPORTS) and "sMAPE: latency_cycles" in out
    assert math.isclose(calibration.smape([(1.0, 1.0), (3.0, 1.0)]), 50.0)


def test_estimate_cli(tmp_path, capsys) -> None:
    from kpt_fpga_sim.__main__ import main
    g = _gen()
    path = tmp_path / "mlp.pt"
    torch.save(_mlp(g, 16, 8, 4), path)
    assert main(["estimate", str(path), "--trust-pickle", "--input-shape", "1,16", "--reuse", "2", "--io", "stream",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["io"] == "stream" and data["interval"] >= 2 and len(data["layers"]) == 3
