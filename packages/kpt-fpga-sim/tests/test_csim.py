"""C-simulation: the HLS C++ of the +/×/compare/shift kernels, compiled against the ap_types
headers (fetched from the hls4ml wheel), agrees bit for bit with the simulator."""

from __future__ import annotations

import itertools

import pytest
import torch

from kpt_fpga_sim import configure, csim
from kpt_fpga_sim.arith import FixedArith
from kpt_fpga_sim.fixed import Fx
from kpt_fpga_sim.formats import O_MODES, Q_MODES, ap_fixed, ap_ufixed, parse_format

pytestmark = pytest.mark.slow  # each test compiles C++ with g++ (10 to 30 s on one core)


@pytest.fixture(scope="module", autouse=True)
def toolchain() -> None:
    try:
        csim.compiler()
        csim.ap_types_dir()
    except csim.CsimUnavailable as exc:
        pytest.skip(f"C-simulation unavailable: {exc}")


def _run(source: str) -> torch.Tensor:
    return torch.tensor(csim.run(source), dtype=torch.float64)


def _fresh() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


def test_quantization_and_overflow_modes() -> None:
    g = _fresh()
    grid = torch.randint(-700, 700, (120,), generator=g).double() / 64
    x = torch.cat([grid, grid + 1 / 128, torch.randn(120, generator=g, dtype=torch.float64) * 10])
    # every mode pair, with widths and integer bits varying too
    shapes = itertools.cycle([(8, 3), (12, 5), (6, -1), (20, 12)])
    formats = [ap_fixed(w, i, q, o) for (q, o), (w, i) in zip(itertools.product(Q_MODES, O_MODES), shapes)]
    # ap_ufixed in every mode the headers accept for it (all but WRAP_SM), QKeras' quantizers
    unsigned = [o for o in O_MODES if o != "WRAP_SM"]
    formats += [ap_ufixed(w, i, q, o) for (q, o), (w, i) in zip(itertools.product(Q_MODES, unsigned), shapes)]
    formats += [parse_format(t) for t in ("quantized_bits(6, 0, keep_negative=0)", "quantized_bits(8, 3)",
                                          "quantized_relu(4, 2)")]
    got = _run(csim.quantize_source(formats, x)).reshape(len(formats), -1)
    for fmt, row in zip(formats, got):
        assert torch.equal(row, fmt.quantize(x)), str(fmt)


@pytest.mark.parametrize("activation", [None, "relu"])
@pytest.mark.parametrize("fmt", [ap_fixed(16, 6, "RND", "SAT"), ap_fixed(12, 4, "TRN", "WRAP")])
def test_linear(fmt, activation) -> None:
    g = _fresh()
    x = torch.randn(6, 40, generator=g)
    w = torch.randn(9, 40, generator=g) * 0.3
    b = torch.randn(9, generator=g)
    be = configure(format=fmt)
    y = be.linear(x, w, b, activation)
    assert torch.equal(_run(csim.linear_source(fmt, x, w, b, activation)), y.double().reshape(-1))
    y_nobias = be.linear(x, w, None, activation)
    assert torch.equal(_run(csim.linear_source(fmt, x, w, None, activation)), y_nobias.double().reshape(-1))


@pytest.mark.parametrize("fmt", [ap_fixed(16, 6, "RND", "SAT"), ap_fixed(14, 5, "RND_CONV", "SAT_SYM")])
def test_silu_table(fmt) -> None:
    x = torch.cat([torch.randn(300, generator=_fresh()) * 4, torch.tensor([-40.0, -16.0, 0.0, 16.0, 40.0])])
    be = configure(format=fmt)
    sigmoid = FixedArith(fmt).tables["sigmoid"]
    assert torch.equal(_run(csim.silu_source(fmt, x, sigmoid)), be.silu(x).double())


def test_rms_norm_around_the_simulators_rsqrt() -> None:
    fmt = ap_fixed(16, 6, "RND", "SAT")
    g = _fresh()
    x, w = torch.randn(5, 64, generator=g) * 2, torch.randn(64, generator=g) + 1
    eps = 1e-6
    y, rstd = configure(format=fmt).kernels()["rms_norm"].forward(x, w, eps)
    a = FixedArith(fmt)
    f_out = a.tables["rsqrt"].f_out
    mant, exponent = torch.frexp(rstd.double())
    raw = torch.ldexp(mant, torch.tensor(float(f_out))).to(torch.int64)
    inv_d, eps_c = a.const(1.0 / 64), a.const(eps)
    source = csim.rms_norm_source(fmt, x, w, (int(inv_d.raw), inv_d.w, inv_d.i),
                                  (int(eps_c.raw), eps_c.w, eps_c.i), raw, exponent, f_out + 2)
    out = csim.run(source)
    per_row = 3 + 64
    for r in range(5):
        arg_raw, width, iwidth = (int(v) for v in out[r * per_row: r * per_row + 3])
        # the C++ rsqrt argument, fed to the simulator's rsqrt unit, gives the simulator's rstd
        unit = a.rsqrt(Fx(torch.tensor([arg_raw]), width, iwidth))
        assert float(unit.to_float()) == float(rstd[r])
        got = torch.tensor(out[r * per_row + 3: (r + 1) * per_row], dtype=torch.float64)
        assert torch.equal(got, y[r].double())
