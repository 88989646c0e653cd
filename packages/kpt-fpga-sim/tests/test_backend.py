"""The backend: registration, configuration, both number modes on the kernels, reports."""

from __future__ import annotations

import math

import pytest
import torch

import kpt
import kpt_fpga_sim
from kpt.ops import as_tuple
from kpt.testing import check_backward, check_forward, compare, to_oracle, tolerance_for
from kpt_fpga_sim import FpgaSimBackend, ap_fixed, configure
from kpt_fpga_sim.backend import (
    NORMALIZATION_FLOOR_AT_MOST,
    ROUNDINGS,
    data_scale,
    fixed_tolerance,
    normalization_gain,
)
from kpt_fpga_sim.config import from_environment

FIXED = ap_fixed(16, 6, "RND", "SAT")


@pytest.fixture(scope="module")
def be() -> FpgaSimBackend:
    return kpt.get_backend("fpga-sim")


@pytest.fixture(scope="module")
def fx(be) -> FpgaSimBackend:
    return configure(be, format=FIXED)


def test_registered_opt_in_with_every_kernel(be) -> None:
    assert isinstance(be, FpgaSimBackend) and be.simulator and be.device_type == "cpu"
    assert kpt.get_backend().name != "fpga-sim"
    assert kpt.missing_kernels(be.kernels()) == {}
    assert be.config.describe() == "float32 on u250 at 300 MHz"


def test_configure_returns_a_new_backend_with_its_own_ops(be) -> None:
    other = configure(be, format="ap_fixed<12,4,RND_CONV,SAT_SYM>", device="xc7z020", clock_mhz=125,
                      directives={"linear": {"reuse": 4}})
    assert other is not be and other.op_namespace != be.op_namespace
    assert other.config.format == ap_fixed(12, 4, "RND_CONV", "SAT_SYM")
    assert (other.config.device.name, other.config.clock_mhz) == ("zynq7020", 125.0)
    assert other.config.directives_for("linear").reuse == 4 and be.config.directives_for("linear").reuse == 1
    assert other.conformance_profile == "fpga-sim-fixed" and be.conformance_profile == "fpga-sim"
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    assert other.linear(x, w).shape == (3, 5) and be.linear(x, w).shape == (3, 5)
    assert configure(other, device="u280").config.clock_mhz == 300.0
    for bad in ({"format": "ap_fixed<40,8>"}, {"device": "vu19p"}, {"clock_mhz": -1},
                {"directives": {"linaer": {"reuse": 2}}}, {"directives": {"linear": {"reuse": 0}}},
                {"directives": {"linear": {"pipeline": 2}}}):
        with pytest.raises(ValueError):
            configure(be, **bad)


def test_environment_selects_the_configuration(monkeypatch) -> None:
    monkeypatch.setenv("KPT_FPGA_SIM_FORMAT", "ap_fixed<16,6,RND,SAT>")
    monkeypatch.setenv("KPT_FPGA_SIM_DEVICE", "u280")
    monkeypatch.setenv("KPT_FPGA_SIM_CLOCK_MHZ", "250")
    config = from_environment()
    assert (config.format, config.device.name, config.clock_mhz) == (FIXED, "u280", 250.0)


def test_unsigned_data_from_a_qkeras_quantizer(monkeypatch) -> None:
    # every value of the design in quantized_relu(10, 3) = ap_ufixed<10,3,AP_RND_CONV,AP_SAT>: the
    # negative inputs and weights saturate to 0, the product is exact, the result rounded once
    monkeypatch.setenv("KPT_FPGA_SIM_FORMAT", "quantized_relu(10, 3)")
    be = kpt_fpga_sim.configure(format=from_environment().format)
    fmt = be.config.format
    assert str(fmt) == "ap_ufixed<10,3,AP_RND_CONV,AP_SAT>"
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(5, 24, generator=g) * 2, torch.randn(7, 24, generator=g), torch.randn(7, generator=g)
    want = fmt.quantize(torch.relu(fmt.quantize(x) @ fmt.quantize(w).T + fmt.quantize(b)))
    assert torch.equal(be.linear(x, w, b, "relu").double(), want)
    with pytest.raises(ValueError, match="wider than 24 bits"):
        configure(be, format="ap_ufixed<24,8>")


@pytest.mark.parametrize("variable, value, message", [
    ("KPT_FPGA_SIM_FORMAT", "ap_fixd<16,6>", "number format"),
    ("KPT_FPGA_SIM_DEVICE", "u999", "u999"),
    ("KPT_FPGA_SIM_CLOCK_MHZ", "fast", "could not convert"),
])
def test_a_bad_environment_value_names_its_variable(monkeypatch, variable, value, message) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=f"{variable}={value!r}: .*{message}"):
        from_environment()
    # the registry refuses the plugin with that reason, and says it when the backend is asked for
    with pytest.raises(kpt.BackendError, match=f"'fpga-sim' cannot be used: .*{variable}={value!r}"):
        kpt.Registry().get("fpga-sim")


def _draw(spec_name: str, case_name: str, dtype: torch.dtype) -> dict:
    spec = kpt.SPECS[spec_name]
    case = next(c for c in spec.cases() if c.name == case_name)
    return case.make(torch.Generator().manual_seed(torch.seed() % 2**31), dtype)


FLOAT_CASES = [("rms_norm", "odd"), ("layer_norm", "strided"), ("softmax", "middle_dim"),
               ("gelu", "tanh_wide"), ("swiglu", "odd"), ("rope", "odd"), ("attention", "prefill_chunk"),
               ("linear", "odd"), ("cross_entropy", "label_smoothing"), ("linear_cross_entropy", "odd"),
               ("moe_gating", "ties"), ("moe_dispatch", "odd"), ("grouped_linear", "odd"),
               ("moe_combine", "odd"), ("quantize_fp8", "e5m2_row"), ("fp8_linear", "odd")]


@pytest.mark.parametrize("kernel, case", FLOAT_CASES)
def test_float32_mode_matches_the_oracle(be, kernel: str, case: str) -> None:
    spec = kpt.SPECS[kernel]
    for dtype in (torch.float32, torch.bfloat16):
        args = _draw(kernel, case, dtype)
        report = check_forward(be, spec, args, dtype)
        assert report.ok, report.message
        if spec.differentiable:
            report = check_backward(be, spec, args, dtype, torch.Generator().manual_seed(1))
            assert report.ok, report.message


FIXED_CASES = [("rms_norm", "wide"), ("add_rms_norm", "odd"), ("layer_norm", "no_params"), ("gelu", "wide"),
               ("silu", "odd"), ("geglu", "none_wide"), ("rope", "llama_gqa"), ("attention", "mqa"),
               ("linear", "bias"), ("linear", "silu"), ("grouped_linear", "odd"), ("moe_combine", "odd")]


@pytest.mark.parametrize("kernel, case", FIXED_CASES)
def test_fixed_mode_within_the_format_tolerance(fx, kernel: str, case: str) -> None:
    spec = kpt.SPECS[kernel]
    args = _draw(kernel, case, torch.float32)
    report = check_forward(fx, spec, args, torch.float32)
    assert report.ok, report.message
    assert fx.last_report.format == str(FIXED)
    if spec.differentiable:
        report = check_backward(fx, spec, args, torch.float32, torch.Generator().manual_seed(2))
        assert report.ok, report.message


def test_fixed_mode_really_quantizes(fx, be) -> None:
    x = torch.randn(4, 64)
    y = fx.silu(x)
    assert torch.equal(y * 2**FIXED.f, torch.round(y * 2**FIXED.f))
    assert not torch.equal(y, be.silu(x))


def test_fixed_mode_takes_float32_activations_only(fx) -> None:
    with pytest.raises(kpt.KernelNotSupportedError, match="float32 activations only"):
        fx.rms_norm(torch.randn(2, 8, dtype=torch.bfloat16))
    # kernels that compute in their own formats take every dtype
    weights, _ = fx.moe_gating(torch.randn(4, 8, dtype=torch.bfloat16), 2)
    assert weights.dtype == torch.float32


def test_fixed_tolerance_is_derived_from_the_format(fx, be) -> None:
    tol = fx.tolerance("rms_norm", torch.float32)
    assert tol is not None and "ap_fixed<16,6" in tol.reason and "2^-10" in tol.reason
    coarse = configure(be, format=ap_fixed(12, 6, "TRN", "SAT")).tolerance("rms_norm", torch.float32)
    assert coarse.atol > tol.atol
    assert be.tolerance("rms_norm", torch.float32) is None
    assert fx.tolerance("quantize_fp8", torch.float32) is None


def test_fixed_tolerance_grows_with_a_weights_fan_in(fx, be) -> None:
    base = fx.tolerance("linear", torch.float32)
    short, long = ({"weight": torch.zeros(3, k)} for k in (64, 4097))
    assert fx.call_tolerance("linear", torch.float32, short, "y") == base
    assert fx.call_tolerance("linear", torch.float32, long, "dx").rel_norm > base.rel_norm
    # dweight is not computed through the weight
    assert fx.call_tolerance("linear", torch.float32, long, "dweight") == base
    assert be.call_tolerance("linear", torch.float32, long, "y") is None


def test_fixed_tolerance_has_an_absolute_floor_at_the_scale_of_the_calls_data(fx) -> None:
    r, n = FIXED.lsb / 2, ROUNDINGS["silu"]
    x = torch.tensor([[0.5, -3.0, 0.25]])
    tol = fx.call_tolerance("silu", torch.float32, {"x": x}, "y")
    assert tol.abs_floor == pytest.approx(r * (2 + n * 3.0))
    # a gradient's data include the upstream gradient (named d<output> by kpt.testing)
    grad = fx.call_tolerance("silu", torch.float32, {"x": x, "dy": torch.tensor([[-5.0, 0.0, 0.0]])}, "dx")
    assert grad.abs_floor == pytest.approx(r * (2 + n * 5.0))
    # data the format does not hold get no floor: beyond its range (saturated), or all below its LSB
    assert fx.call_tolerance("silu", torch.float32, {"x": x * 20}, "y").abs_floor == 0.0
    assert fx.call_tolerance("silu", torch.float32, {"x": x * 1e-4}, "y").abs_floor == 0.0
    assert fx.tolerance("silu", torch.float32).abs_floor == 0.0


@pytest.mark.parametrize("kernel", ["silu", "gelu"])
def test_one_small_element_passes_at_the_formats_resolution(fx, kernel) -> None:
    """An activation of one element a few LSB from 0 (the conformance case ``one_element`` draws
    one from N(0, 1)): the rounding of x and of y each cost up to r whatever x's size, and the
    floor allows both. With only y's rounding allowed, x = -0.00145 failed at 1.45x."""
    worst = 0.0
    for value in torch.linspace(-0.05, 0.05, 1001):
        x = value.reshape(1, 1).float()
        if x.abs() < FIXED.lsb:  # below one LSB: the format does not hold the data (no floor)
            continue
        y = getattr(fx, kernel)(x)
        ref = getattr(kpt.get_backend("reference"), kernel)(to_oracle(x))
        worst = max(worst, compare("y", y, ref, fx.call_tolerance(kernel, torch.float32, {"x": x}, "y")).worst)
    assert 0.5 < worst <= 1.0


def test_probabilities_count_at_unit_scale(fx) -> None:
    """Logits reach cross-entropy's outputs only as probabilities: large logits do not widen the
    floor (it would let a mean loss's small gradient pass as zeros), the upstream gradient does."""
    r, n = FIXED.lsb / 2, ROUNDINGS["cross_entropy"]
    logits = torch.tensor([[8.0, -3.0, 0.5]])
    args = {"logits": logits, "target": torch.tensor([0])}
    assert fx.call_tolerance("cross_entropy", torch.float32, args, "loss").abs_floor == pytest.approx(r * (2 + n))
    grad = fx.call_tolerance("cross_entropy", torch.float32, {**args, "dloss": torch.tensor(2.0)}, "dlogits")
    assert grad.abs_floor == pytest.approx(r * (2 + n * 2.0))
    silu = fx.call_tolerance("silu", torch.float32, {"x": logits}, "y")
    assert silu.abs_floor == pytest.approx(r * (2 + ROUNDINGS["silu"] * 8.0))


def _add_rms_norm(fx, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> tuple:
    """The arguments of an add_rms_norm call, fx's y for them, the oracle's y, and y's tolerance."""
    args = {"x": x, "residual": residual, "weight": weight, "eps": 1e-6}
    y, _ = fx.add_rms_norm(**args)
    ref, _ = kpt.get_backend("reference").add_rms_norm(**{k: to_oracle(v) for k, v in args.items()})
    return args, y, ref, tolerance_for(fx, "add_rms_norm", torch.float32, y, args=args, output="y")


def test_a_normalizations_floor_covers_a_row_that_nearly_cancels(fx) -> None:
    """A fuzzed add_rms_norm call (seed 1440464999): x + residual cancels to h = [-0.0293, -0.0082],
    rms 0.02; the format's step rounds h by up to r, which y / weight amplifies by 1/rms to 2-5%.
    At the data's scale (`data_scale`) y is allowed 4x too little; at the row's gain it passes."""
    x = torch.tensor([[0.7, -1.2], [1.5, 0.4], [0.5012, 0.3001]])
    residual = torch.tensor([[0.9, 0.3], [-0.6, 1.1], [-0.5305, -0.3083]])
    args, y, ref, tol = _add_rms_norm(fx, x, residual, torch.tensor([-1.25, -1.5]))
    gain = normalization_gain("add_rms_norm", args)
    assert gain == pytest.approx(1.5 / math.sqrt((0.0293**2 + 0.0082**2) / 2 + 1e-6), rel=1e-3)
    assert tol.abs_floor == pytest.approx(FIXED.lsb / 2 * (2 + ROUNDINGS["add_rms_norm"] * gain))
    assert compare("y", y, ref, tol).ok
    at_data_scale = fixed_tolerance("add_rms_norm", FIXED, scale=data_scale(FIXED, args))
    assert not compare("y", y, ref, at_data_scale).ok


def test_a_normalizations_floor_is_no_license_on_rows_of_unit_scale(fx) -> None:
    """Rows of unit scale amplify nothing: y's tolerance is the one at the data's scale, and a y
    10% off fails."""
    g = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(8, 64, generator=g) for _ in range(2))
    args, y, ref, tol = _add_rms_norm(fx, x, residual, 1 + 0.1 * torch.randn(64, generator=g))
    assert tol == fixed_tolerance("add_rms_norm", FIXED, scale=data_scale(FIXED, args))
    assert compare("y", y, ref, tol).ok
    assert not compare("y", y * 1.1, ref, tol).ok


def test_normalization_gain_is_the_weight_over_the_smallest_row_scale(fx) -> None:
    """rms_norm divides by the rms of x, layer_norm by the std of x's row (its mean taken out),
    both with eps; without a weight, by 1. Only y is normalized: h (add_rms_norm) is not."""
    x = torch.tensor([[1.0, 1.02], [3.0, -3.0]])
    smallest_rms = math.sqrt((1 + 1.02**2) / 2 + 1e-6)
    assert normalization_gain("rms_norm", {"x": x, "eps": 1e-6}) == pytest.approx(1 / smallest_rms)
    layer = {"x": torch.tensor([[1.0, 1.05], [3.0, -3.0]]), "weight": torch.tensor([2.0, -4.0]), "eps": 1e-5}
    gain = 4 / math.sqrt(0.025**2 + 1e-5)
    assert normalization_gain("layer_norm", layer) == pytest.approx(gain)
    assert fx.call_tolerance("layer_norm", torch.float32, layer, "y").abs_floor == pytest.approx(
        FIXED.lsb / 2 * (2 + ROUNDINGS["layer_norm"] * gain))
    cancelling = {"x": x, "residual": -x, "eps": 1e-6}
    assert fx.call_tolerance("add_rms_norm", torch.float32, cancelling, "h") == fixed_tolerance(
        "add_rms_norm", FIXED, scale=3.0)


def test_no_normalization_floor_that_would_reach_the_outputs_scale(fx) -> None:
    """A row of σ ≤ 4 · roundings · r (here x + residual = 0: σ = √eps) would get a floor above a
    quarter of max|w|, y's own scale, which a y that far off would pass: there y keeps the
    tolerance at the data's scale."""
    x = torch.tensor([[0.25, -0.5], [1.0, 2.0]])
    args = {"x": x, "residual": torch.tensor([[-0.25, 0.5], [0.5, -1.0]]), "weight": torch.ones(2), "eps": 1e-6}
    cutoff = ROUNDINGS["add_rms_norm"] * FIXED.lsb / 2 / NORMALIZATION_FLOOR_AT_MOST
    assert normalization_gain("add_rms_norm", args) == pytest.approx(1e3)
    assert normalization_gain("add_rms_norm", args, min_sigma=cutoff) == 0.0
    assert fx.call_tolerance("add_rms_norm", torch.float32, args, "y") == fixed_tolerance(
        "add_rms_norm", FIXED, scale=data_scale(FIXED, args))


@pytest.mark.parametrize("kernel, case", [("rope", "llama_gqa"), ("silu", "wide")])
def test_fixed_tolerance_still_fails_10_lsb_or_1_percent(fx, kernel: str, case: str) -> None:
    """On a normal-size case the floor is no license: the backend's own result passes, the same
    result with one element off by 10 LSB at the data's scale, or every element off by 1%, fails."""
    spec = kpt.SPECS[kernel]
    args = _draw(kernel, case, torch.float32)
    outs = as_tuple(fx.call(kernel, **args))
    refs = as_tuple(kpt.get_backend("reference").call(kernel, **{k: to_oracle(v) for k, v in args.items()}))
    scale = data_scale(FIXED, args)
    for name, out, ref in zip(spec.outputs, outs, refs):
        tol = tolerance_for(fx, kernel, torch.float32, out, args=args, output=name)
        assert compare(name, out, ref, tol).ok
        off = out.clone()
        off.view(-1)[0] += 10 * FIXED.lsb * scale
        assert not compare(name, off, ref, tol).ok
        assert not compare(name, out * 1.01, ref, tol).ok


def test_attention_backward_holds_dp_of_a_long_head(fx) -> None:
    # dP = dO·Vᵀ over D = 256 has a standard deviation of 16: within its declared type
    q, k, v = (torch.randn(1, 2, 17, 256, requires_grad=True) for _ in range(3))
    o = fx.attention(q, k, v)
    torch.autograd.grad(o, (q, k, v), torch.randn_like(o))
    assert fx.last_report.direction == "backward" and "dp" not in fx.last_report.overflows


@pytest.mark.parametrize("causal", [False, True])
def test_attention_rows_of_infinite_scores_as_the_reference(be, causal) -> None:
    # query 0 meets every key with a -inf score (it saw no key: o = 0), query 2 key 2 with +inf
    # (lse = +inf, o NaN), the gradients' NaN at the reference's places
    q, k, v = (torch.randn(1, 1, 3, 16) for _ in range(3))
    k[0, 0, :, 3] = -1.0
    q[0, 0, 0, 3] = float("inf")
    k[0, 0, 2, 5] = float("inf")
    q[0, 0, :, 5] = torch.tensor([-1.0, -1.0, 1.0])
    reference = kpt.get_backend("reference")
    results = []
    for backend, dtype in ((be, torch.float32), (reference, torch.float64)):
        leaves = [t.to(dtype).requires_grad_(True) for t in (q, k, v)]
        o = backend.attention(*leaves, causal=causal)
        results.append((o, *torch.autograd.grad(o, leaves, torch.ones_like(o))))
    assert torch.equal(results[0][0][0, 0, 0], torch.zeros(16))
    for got, expected in zip(*results):
        assert torch.equal(got.isnan(), expected.isnan())


def test_overflows_are_counted_and_reported(fx) -> None:
    fx.clear_reports()
    y = fx.silu(torch.tensor([[1.0, 100.0, -100.0, 2.0]]))
    report = fx.last_report
    assert report.overflows == {"x": 2}
    assert float(y[0, 1]) == pytest.approx(32.0, abs=2 * FIXED.lsb)
    assert "x: 2" in fx.report_table()


def test_every_call_is_reported(be) -> None:
    be.clear_reports()
    x = torch.randn(8, 32, requires_grad=True)
    be.rms_norm(x, torch.ones(32)).sum().backward()
    assert [(r.kernel, r.direction) for r in be.reports] == [("rms_norm", "forward"),
                                                             ("rms_norm", "backward")]
    r = be.reports[0]
    assert r.cycles > 0 and r.latency_us == pytest.approx(r.cycles / 300.0)
    assert r.fits and 0 < r.utilization["dsp"] < 0.8 and r.gflops > 0
    table = be.report_table()
    assert "rms_norm" in table and "u250 @ 300 MHz, float32" in table
    assert set(r.as_dict()) >= {"cycles", "ii", "dsp", "bram18", "uram", "lut", "ff", "bound", "overflows"}


def test_public_api() -> None:
    assert kpt_fpga_sim.configure is configure
    assert set(kpt_fpga_sim.DEVICES) == {"u250", "u280", "u50", "vu9p", "vu13p", "ku115", "zynq7020", "zcu104"}


def test_calls_beyond_the_format_are_named_and_not_fuzzed(fx, be) -> None:
    """A fuzzed rms_norm call (CI, 2026-12-05): a row of one element x = -0.0053, so σ = 0.0062 (6 LSB
    of ap_fixed<16,6>), where rounding x by half an LSB moves y by 0.02 (dy/dx = eps / σ³ = 43): the
    format's ``tiny``/``eps_comparable`` failure, drawn at random. Such a call, and data or outputs
    beyond the format's range, are named beyond the format (the suite's fuzzing draws none); rows of
    unit scale and the float32 mode are not."""
    x = torch.randn(64, 1, generator=torch.Generator().manual_seed(0))
    x[10] = -0.0053
    why = fx.beyond_format("rms_norm", {"x": x, "weight": None, "eps": 1e-5})
    assert why is not None and "0.00617" in why and "16 LSB" in why, why
    x[10] = 0.5
    assert fx.beyond_format("rms_norm", {"x": x, "weight": None, "eps": 1e-5}) is None
    assert "range" in fx.beyond_format("silu", {"x": torch.tensor([40.0])})
    assert fx.beyond_format("silu", {"x": torch.tensor([3.0])}) is None
    # a fuzzed moe_combine (seed 77): every expert row the same, weights summing to 9.5: an output of
    # 34.1 saturates at 32
    row = torch.full((1, 4), 3.58).expand(8, 4)
    combine = {"y_sorted": row, "order": torch.arange(8, dtype=torch.int32), "weights": torch.full((1, 8), 1.19)}
    assert "output beyond" in fx.beyond_format("moe_combine", combine)
    assert fx.beyond_format("moe_combine", {**combine, "weights": torch.full((1, 8), 0.5)}) is None
    assert be.beyond_format("rms_norm", {"x": torch.full((2, 1), 1e-3), "weight": None, "eps": 1e-5}) is None


@pytest.mark.parametrize("smoothing", [0.1, 1.0])
def test_a_target_logit_of_minus_inf_loses_as_the_reference(be, smoothing) -> None:
    """With label smoothing a -inf target logit loses +inf (NaN at ε = 1), as the contract computes
    it: the simulator's smoothing term gave +inf − inf (a fuzzed float16 call)."""
    logits = torch.randn(3, 65, generator=torch.Generator().manual_seed(0)).half()
    target = torch.tensor([12, 5, -100])
    logits[0, 12] = logits[1, 30] = -math.inf
    got = be.cross_entropy(logits, target, label_smoothing=smoothing, reduction="none")
    expected = kpt.get_backend("reference").cross_entropy(logits.double(), target, label_smoothing=smoothing,
                                                          reduction="none")
    assert torch.equal(got.isnan(), expected.isnan()) and bool(got[0].isnan() or got[0] == math.inf)
    torch.testing.assert_close(got.double().nan_to_num(), expected.nan_to_num(), rtol=1e-2, atol=1e-2)
