"""Published C-synthesis reports of hls4ml designs, and `estimate_model` set against them.

Every number in `REPORTS` was read from the report named by its source (repository, commit and
path): the summary's latency and interval (cycles; the worst case where it gives a range) and
its utilization totals. The model
(architecture, precision, reuse factor, strategy, io type, part, clock) is the one the report's
project was built from. A constant multiply's hardware depends on the weight
(`kpt_fpga_sim.multipliers`), so where the design's project publishes its trained weights the
estimate takes their statistics (``weights``: a file of `kpt_fpga_sim/published` holding, per
layer, a histogram of the weight values in the design's weight type and the number of nonzero
weights of each output; the weights themselves are not redistributed). `published_weights` lays
these out as a weight tensor, and the estimate is exactly the one the trained weights give:
it reads no more of them. Elsewhere it draws them Glorot-uniform (seeded): Keras's default
initializer, which hls4ml's test model keeps untrained; a trained network with many near-zero
weights needs fewer DSPs than that, a quantization-aware trained one more (its weights spread
over the few levels of its type). A pruned design's report project states how many weights of
each layer are zero (``n_zeros`` in its parameters.h): a Glorot-uniform draw zeroes as many, the
smallest first.

Reports marked ``held_out`` were not looked at while the model's constants were chosen (the
constants came from the others); `table` states the sMAPE of both groups, and the tests hold every
report to `TOLERANCE` (2x on latency, interval and DSP) and the held-out sMAPE near its measured
value.

    python -m kpt_fpga_sim calibrate        # estimate against report, per quantity, and the sMAPE
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources

import torch
from torch import nn

from .network import NetworkReport, estimate_model

QUANTITIES = ("latency_cycles", "interval", "dsp", "lut", "ff", "bram18")
TOLERANCE = {"latency_cycles": 2.0, "interval": 2.0, "dsp": 2.0, "lut": 3.0, "ff": 3.0}
"""The factor within which the estimate must stay of each report (tested in CI)."""


def jet_tagging_mlp() -> nn.Module:
    """The hls4ml tutorial's jet tagger: 16 → 64 → 32 → 32 → 5, ReLU, softmax."""
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 5), nn.Softmax(dim=-1))


def dense_16_5_relu() -> nn.Module:
    """hls4ml's report test model: one Dense(5) on 16 inputs with a ReLU."""
    return nn.Sequential(nn.Linear(16, 5), nn.ReLU())


def small_mnist_cnn() -> nn.Sequential:
    """28×28×1 → conv 3×3 ×4, ReLU, max-pool 4 → conv 3×3 ×8, ReLU, max-pool 2 → dense 10."""
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.MaxPool2d(4), nn.Conv2d(4, 8, 3), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32, 10))


def small_mnist_cnn_softmax() -> nn.Module:
    """`small_mnist_cnn` with a softmax after its dense layer."""
    return nn.Sequential(*small_mnist_cnn(), nn.Softmax(dim=-1))


def small_mnist_cnn_relu() -> nn.Module:
    """`small_mnist_cnn` with a ReLU after its dense layer."""
    return nn.Sequential(*small_mnist_cnn(), nn.ReLU())


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "jet-tagging MLP 16-64-32-32-5": (jet_tagging_mlp, (1, 16)),
    "dense 16-5 + relu": (dense_16_5_relu, (1, 16)),
    "CNN 28x28x1 conv4-pool4-conv8-pool2-dense10": (small_mnist_cnn, (1, 1, 28, 28)),
    "CNN 28x28x1 conv4-pool4-conv8-pool2-dense10-softmax": (small_mnist_cnn_softmax, (1, 1, 28, 28)),
    "CNN 28x28x1 conv4-pool4-conv8-pool2-dense10-relu": (small_mnist_cnn_relu, (1, 1, 28, 28)),
}

_QKERAS_BITS = "quantized_bits(6, 0, alpha=1)"
_QKERAS_MLP = {**{name: {"weight_format": _QKERAS_BITS, "bias_format": _QKERAS_BITS} for name in ("0", "2", "4", "6")},
               **{name: {"result_format": "quantized_relu(6, 0)"} for name in ("1", "3", "5")}}
"""The hls4ml tutorial's QKeras jet tagger: 6-bit weights and biases, 6-bit unsigned ReLU outputs
(``ap_ufixed<6,0,AP_RND_CONV,AP_SAT>``), everything else ``ap_fixed<16,6>``."""


@dataclass(frozen=True)
class Published:
    """One C-synthesis report: where it is, how it was built, what it says."""

    source: str
    commit: str
    path: str
    tool: str
    model: str
    precision: str
    reuse: int
    strategy: str
    io: str
    part: str
    clock_mhz: float
    numbers: dict[str, int]
    zeros: tuple[int, ...] = ()
    """Pruned weights of each dense / convolution layer, in order (empty: none)."""
    layers: dict[str, dict[str, str]] = field(default_factory=dict)
    """`estimate_model`'s per-module overrides (the project's per-layer precisions)."""
    held_out: bool = False
    """Not used when the model's constants were chosen."""
    weights: str = ""
    """The file of `kpt_fpga_sim/published` with the statistics of the design's weights
    (`published_weights`; empty: Glorot-uniform)."""

    @property
    def name(self) -> str:
        """The repository and the report's project folder."""
        folder = self.path.split("/myproject_prj/")[0]
        return f"{self.source}/{folder.rsplit('/', 1)[0] if folder.endswith('.rpt') else folder}"


REPORTS = (
    Published("nrp-nautilus/6nrp-hls4ml", "c83384d5a417642bb38ce8a523b8c4c189ecdc26",
              "model_1/hls4ml_prj/myproject_prj/solution1/syn/report/myproject_csynth.rpt",
              "Vitis HLS 2022.2", "jet-tagging MLP 16-64-32-32-5", "ap_fixed<16,6>", 1, "latency", "parallel",
              "xcu250-figd2104-2L-e", 200.0,
              {"latency_cycles": 15, "interval": 1, "dsp": 2557, "lut": 116694, "ff": 24233, "bram18": 8}),
    Published("Hector-Plata/hls4ml-tutorial", "4ac4f07a0edf530cde74aec53610e1e22a6ecc2d",
              "model_1/hls4ml_prj/myproject_prj/solution1/syn/report/myproject_csynth.rpt",
              "Vivado HLS 2019.2", "jet-tagging MLP 16-64-32-32-5", "ap_fixed<16,6>", 1, "latency", "parallel",
              "xcu250-figd2104-2L-e", 200.0,
              {"latency_cycles": 13, "interval": 1, "dsp": 1520, "lut": 85140, "ff": 11100, "bram18": 4},
              weights="hls4ml-tutorial_model_1.hist"),
    Published("fastmachinelearning/hls4ml", "9d6e76efe7373d4bac58b0200f8a3986de696505",
              "test/pytest/test_report/Vivado/myproject_csynth.rpt",
              "Vivado HLS 2020.1", "dense 16-5 + relu", "ap_fixed<16,6>", 1, "latency", "stream",
              "xc7z020-clg400-1", 200.0,
              {"latency_cycles": 10, "interval": 8, "dsp": 73, "lut": 2532, "ff": 7969, "bram18": 0}),
    # reuse 8 as configured; hls4ml moved the convolutions' to 9 (its parameters.h), as the estimate does
    Published("pominiq/DNNonSilicon", "ee1d2a3be1b094268ce30eed7d966c352839bd4f",
              "model_1/hls4ml_prj/myproject_prj/solution1/syn/report/myproject_csynth.rpt",
              "Vivado HLS 2020.1", "CNN 28x28x1 conv4-pool4-conv8-pool2-dense10", "ap_fixed<16,6>", 8, "resource",
              "stream", "xc7z020-clg400-1", 100.0,
              {"latency_cycles": 14182, "interval": 14113, "dsp": 76, "lut": 25632, "ff": 16975, "bram18": 45}),
    # held out: gathered after the io_stream model's constants were fixed
    Published("Hector-Plata/hls4ml-tutorial", "4ac4f07a0edf530cde74aec53610e1e22a6ecc2d",
              "model_2/hls4ml_prj/myproject_prj/solution1/syn/report/myproject_csynth.rpt",
              "Vivado HLS 2019.2", "jet-tagging MLP 16-64-32-32-5", "ap_fixed<16,6>", 1, "latency", "parallel",
              "xcu250-figd2104-2L-e", 200.0,
              {"latency_cycles": 11, "interval": 1, "dsp": 803, "lut": 30204, "ff": 5734, "bram18": 4},
              zeros=(767, 1536, 768, 120), held_out=True, weights="hls4ml-tutorial_model_2.hist"),
    Published("Hector-Plata/hls4ml-tutorial", "4ac4f07a0edf530cde74aec53610e1e22a6ecc2d",
              "model_3/hls4ml_prj/myproject_prj/solution1/syn/report/myproject_csynth.rpt",
              "Vivado HLS 2019.2", "jet-tagging MLP 16-64-32-32-5", "ap_fixed<16,6>", 1, "latency", "parallel",
              "xcu250-figd2104-2L-e", 200.0,
              {"latency_cycles": 10, "interval": 1, "dsp": 28, "lut": 32227, "ff": 3045, "bram18": 4},
              zeros=(777, 1616, 796, 120), layers=_QKERAS_MLP, held_out=True,
              weights="hls4ml-tutorial_model_3.hist"),
    # reuse 16 as configured (latency strategy), 40 MHz
    Published("pominiq/DNNonSilicon", "c28e4f1689d3b0259290c3e02abf7db3d4b2296c",
              "hls4ml_prj/myproject_prj/solution1/syn/report/myproject_csynth.rpt",
              "Vivado HLS 2020.1", "CNN 28x28x1 conv4-pool4-conv8-pool2-dense10-softmax", "ap_fixed<16,6>", 16,
              "latency", "stream", "xc7z020-clg400-1", 40.0,
              {"latency_cycles": 10250, "interval": 10195, "dsp": 42, "lut": 32975, "ff": 17532, "bram18": 14},
              held_out=True),
    Published("taitashaw/hls4ml-fpga-classifier", "75c19f391508bfba1b88981e3c83f6f12a1b7a15",
              "my-hls-test/myproject_prj/solution1/syn/report/myproject_csynth.rpt",
              "Vitis HLS 2025.2", "jet-tagging MLP 16-64-32-32-5", "ap_fixed<16,6>", 1, "latency", "stream",
              "xczu7ev-ffvc1156-2-e", 100.0,
              {"latency_cycles": 20, "interval": 7, "dsp": 3334, "lut": 127264, "ff": 5127, "bram18": 4},
              held_out=True),
    # held out: four more io_stream CNNs of the same project (Vivado HLS 2020.1), added after the
    # estimate's rules were last changed and not used to change them
    Published("pominiq/DNNonSilicon", "d3a8c6907950ee96c858a2d0ab80d12d1c8f721f",
              "Folder_2_HLS4ML_Vivado_HLS/models/MNIST_original/myproject_prj/solution1/syn/report/myproject_csynth.rpt",
              "Vivado HLS 2020.1", "CNN 28x28x1 conv4-pool4-conv8-pool2-dense10-softmax", "ap_fixed<16,6>", 1,
              "latency", "stream", "xcu50-fsvh2104-2-e", 40.0,
              {"latency_cycles": 794, "interval": 788, "dsp": 567, "lut": 30339, "ff": 5989, "bram18": 16},
              held_out=True),
    Published("pominiq/DNNonSilicon", "588f69ec05398b41ad61a3866673312d6bbbc3b3",
              "model_02/hls4ml_prj/myproject_prj/solution1/syn/report/myproject_csynth.rpt",
              "Vivado HLS 2020.1", "CNN 28x28x1 conv4-pool4-conv8-pool2-dense10", "ap_fixed<16,6>", 64, "resource",
              "stream", "xc7z020-clg400-1", 100.0,
              {"latency_cycles": 35422, "interval": 35281, "dsp": 10, "lut": 18408, "ff": 13539, "bram18": 17},
              held_out=True),
    Published("pominiq/DNNonSilicon", "bc4d6a868866181c789f39f070ca017a5796b279",
              "model_03/hls4ml_prj/myproject_prj/solution1/syn/report/myproject_csynth.rpt",
              "Vivado HLS 2020.1", "CNN 28x28x1 conv4-pool4-conv8-pool2-dense10-relu", "ap_fixed<16,6>", 4, "resource",
              "stream", "xc7z020-clg400-1", 100.0,
              {"latency_cycles": 9482, "interval": 9409, "dsp": 164, "lut": 34122, "ff": 22809, "bram18": 80},
              held_out=True),
    Published("pominiq/DNNonSilicon", "435942acda596a8ecefa81fade691106890bd869",
              "model_2_mix_RF32/hls4ml_prj/myproject_prj/solution1/syn/report/myproject_csynth.rpt",
              "Vivado HLS 2020.1", "CNN 28x28x1 conv4-pool4-conv8-pool2-dense10", "ap_fixed<16,6>", 32, "resource",
              "stream", "xcu50-fsvh2104-2-e", 100.0,
              {"latency_cycles": 33777, "interval": 33713, "dsp": 19, "lut": 17110, "ff": 8251, "bram18": 21},
              held_out=True),
)


HISTOGRAM_SEED = 0
"""The seed of the order in which `published_weights` lays out a histogram's values."""


def published_weights(name: str) -> dict[str, torch.Tensor]:
    """Weights with the statistics in file ``name`` of `kpt_fpga_sim/published`: module name ->
    weight in torch's layout (out, in), float64, values exactly the design's fixed-point ones.

    The file holds, per layer, how many weights take each value and how many nonzero weights feed
    each output, not the weights themselves. That is all `estimate_model` reads of a
    constant-weight layer: its multipliers are costed weight by weight and summed over the layer,
    and the adder tree of each output depends on how many nonzero weights it sums. Each output gets
    its count of nonzero values, taken in turn from the nonzero values in a seeded random order
    (`HISTOGRAM_SEED`), at seeded random inputs. Any other layout with the same statistics gives
    the same estimate.
    """
    return weights_from_histograms((resources.files(__package__) / "published" / name).read_text(), name)


def weights_from_histograms(text: str, name: str = "histograms") -> dict[str, torch.Tensor]:
    """`published_weights` of the text of a histogram file (``name`` labels its errors)."""
    words = " ".join(line for line in text.splitlines() if not line.startswith("#")).split()
    out: dict[str, torch.Tensor] = {}
    i = 0
    while i < len(words):
        head = words[i:i + 6]
        if len(head) < 6 or head[0] != "layer" or head[5] != "fan_in" or not all(w.isdigit() for w in head[2:5]):
            raise ValueError(f"{name}: expected 'layer <module> <n_in> <n_out> <fractional bits> fan_in' "
                             f"at word {i}, got {' '.join(head)!r}")
        module, n_in, n_out, frac = head[1], int(head[2]), int(head[3]), int(head[4])
        fan_in = [int(w) for w in words[i + 6:i + 6 + n_out] if w.isdigit()]
        i += 6 + n_out
        if len(fan_in) != n_out or i >= len(words) or words[i] != "values":
            raise ValueError(f"{name}: layer {module}: expected {n_out} fan-in counts, then 'values'")
        counts: dict[int, int] = {}
        i += 1
        while i < len(words) and words[i] != "layer":
            value, _, count = words[i].partition(":")
            if not value.lstrip("-").isdigit() or not count.isdigit() or int(value) in counts:
                raise ValueError(f"{name}: layer {module}: expected distinct '<integer>:<count>' pairs, "
                                 f"got {words[i]!r}")
            counts[int(value)] = int(count)
            i += 1
        if sum(counts.values()) != n_in * n_out or n_in * n_out - counts.get(0, 0) != sum(fan_in) \
                or max(fan_in, default=0) > n_in:
            raise ValueError(f"{name}: layer {module}: {sum(counts.values())} values with fan-in counts "
                             f"summing to {sum(fan_in)} (at most {n_in} each) do not fill a {n_out} x {n_in} weight")
        out[module] = _layout(counts, fan_in, n_in) / 2.0**frac
    return out


def _layout(counts: dict[int, int], fan_in: list[int], n_in: int) -> torch.Tensor:
    """An (out, in) tensor with ``counts[v]`` entries of each value v and ``fan_in[o]`` nonzero
    entries in row o (see `published_weights`)."""
    g = torch.Generator().manual_seed(HISTOGRAM_SEED)
    nonzero = torch.tensor([v for v, c in sorted(counts.items()) if v for _ in range(c)], dtype=torch.float64)
    nonzero = nonzero[torch.randperm(len(nonzero), generator=g)]
    raw = torch.zeros(len(fan_in), n_in, dtype=torch.float64)
    start = 0
    for row, n in enumerate(fan_in):
        raw[row, torch.randperm(n_in, generator=g)[:n]] = nonzero[start:start + n]
        start += n
    return raw


def estimate(report: Published, seed: int = 0) -> NetworkReport:
    """`estimate_model` on the report's model and settings, with weights laid out from the
    statistics of the design's published ones (``report.weights``) or Glorot-uniform ones from
    ``seed``; biases zero."""
    build, shape = MODELS[report.model]
    model = build().eval()
    if report.weights:
        given = published_weights(report.weights)
        with torch.no_grad():
            for name, m in model.named_modules():
                if isinstance(m, (nn.Linear, nn.Conv2d)):
                    m.weight.copy_(given[name].reshape(m.weight.shape))
                    if m.bias is not None:
                        m.bias.zero_()
        return _estimate(model, shape, report)
    g = torch.Generator().manual_seed(seed)
    weighted = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    zeros = report.zeros or (0,) * len(weighted)
    with torch.no_grad():
        for m, n_zeros in zip(weighted, zeros, strict=True):
            fan_in, fan_out = m.weight[0].numel(), m.weight.shape[0] * m.weight[0, 0].numel()
            limit = (6.0 / (fan_in + fan_out)) ** 0.5
            m.weight.copy_(torch.rand(m.weight.shape, generator=g) * 2 * limit - limit)
            if n_zeros:
                # magnitude pruning: the n_zeros smallest weights
                m.weight.view(-1)[m.weight.abs().flatten().argsort()[:n_zeros]] = 0.0
            if m.bias is not None:
                m.bias.zero_()
    return _estimate(model, shape, report)


def _estimate(model: nn.Module, shape: tuple[int, ...], report: Published) -> NetworkReport:
    return estimate_model(model, torch.zeros(shape), format=report.precision, device=report.part,
                          clock_mhz=report.clock_mhz, reuse=report.reuse, strategy=report.strategy, io=report.io,
                          layers=report.layers)


def smape(pairs: Sequence[tuple[float, float]]) -> float:
    """Symmetric mean absolute percentage error of (estimate, report) pairs, in percent."""
    terms = [abs(e - r) / ((abs(e) + abs(r)) / 2) for e, r in pairs if e or r]
    return 100.0 * sum(terms) / len(terms) if terms else 0.0


def smapes(reports: Sequence[Published]) -> dict[str, float]:
    """The sMAPE of every quantity over ``reports``."""
    ests = [estimate(rep) for rep in reports]
    return {q: smape([(getattr(e, q), rep.numbers[q]) for e, rep in zip(ests, reports)]) for q in QUANTITIES}


def table(reports: Sequence[Published] = REPORTS) -> str:
    """Estimate against report for every quantity of every report, and the sMAPE per quantity,
    over all reports, the fitted ones and the held-out ones."""
    rows = []
    pairs: dict[str, list[tuple[float, float]]] = {q: [] for q in QUANTITIES}
    groups: dict[str, dict[str, list[tuple[float, float]]]] = {"fitted": {q: [] for q in QUANTITIES},
                                                               "held out": {q: [] for q in QUANTITIES}}
    for rep in reports:
        est = estimate(rep)
        label = f"{rep.name} ({rep.tool}{', held out' if rep.held_out else ''})"
        for q in QUANTITIES:
            e, r = getattr(est, q), rep.numbers[q]
            pairs[q].append((e, r))
            groups["held out" if rep.held_out else "fitted"][q].append((e, r))
            ratio = f"{e / r:.2f}" if r else ("-" if not e else "inf")
            rows.append((label, q, f"{e:,}", f"{r:,}", ratio))
    header = ("report", "quantity", "estimate", "report value", "estimate / report")
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in (header, *rows)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    lines.append("sMAPE: " + ", ".join(f"{q} {smape(p):.0f}%" for q, p in pairs.items()))
    for name, group in groups.items():
        if group["dsp"]:
            each = ", ".join(f"{q} {smape(p):.0f}%" for q, p in group.items())
            lines.append(f"  {name} ({len(group['dsp'])}): {each}")
    return "\n".join(lines)
