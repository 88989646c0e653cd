"""kpt.bench's CPU-testable parts: `kpt bench`'s options and its refusal without a GPU, the
sweeps' shapes (valid contract inputs, the models and cases the sweeps promise), the peers'
wrappers against the reference math, the report and the roofline picture of a recorded run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import kpt
from kpt.bench import host, measure, peers, report, roofline, sweeps, timing
from kpt.cli import main, parser
from kpt.kernels.attention import attention_fwd
from kpt.kernels.moe import grouped_linear_fwd

FIXTURE = Path(__file__).parent / "data" / "bench_h100_excerpt.json"
"""An excerpt of a recorded H100 run (attention and linear sweeps), as bench.json holds it."""

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def test_bench_options_parse() -> None:
    args = parser().parse_args(["bench", "--backend", "cuda", "--kernels", "rms_norm,softmax", "--sweep", "models",
                                "--plot", "--no-compile", "--graphs", "--out", "somewhere"])
    assert (args.backend, args.kernels, args.sweep, args.plot, args.no_compile, args.graphs, args.out) == (
        "cuda", "rms_norm,softmax", "models", True, True, True, "somewhere")
    assert parser().parse_args(["bench"]).graphs is False
    assert args.run.__name__ == "_bench"
    with pytest.raises(SystemExit):
        parser().parse_args(["bench", "--sweep", "nope"])


def test_bench_help_runs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for option in ("--backend", "--kernels", "--sweep", "--plot", "--list"):
        assert option in out


def test_bench_without_gpu_says_it_needs_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--backend", "reference"])
    assert "GPU" in str(exit_.value) and "none" in str(exit_.value)


def test_bench_on_a_cpu_backend_says_it_needs_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--backend", "reference"])
    assert "backend 'reference' runs on the CPU" in str(exit_.value)


def test_graph_timing_needs_a_cuda_device() -> None:
    with pytest.raises(ValueError, match="CUDA-graph timing needs a CUDA device"):
        timing.time_ms(lambda: None, torch.device("cpu"), graphs=True)


def test_bench_rejects_unknown_kernels() -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--kernels", "rms_norm,nope", "--list"])
    assert "unknown kernels: nope" in str(exit_.value)


def test_bench_list_counts_the_sweep(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--sweep", "attention", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    points = sweeps.sweep(["attention"])
    assert lines[-1] == f"{len(points)} shapes, {sweeps.measurements(points)} timings"
    assert len(lines) == len(points) + 1


def test_every_kernel_is_in_a_sweep() -> None:
    for name in ("perf", "all"):
        assert {p.kernel for p in sweeps.sweep([name])} == set(kpt.SPECS), name
    assert {p.kernel for p in sweeps.sweep(["all"], ["rms_norm"])} == {"rms_norm"}


def _inputs(point: sweeps.Point) -> dict:
    """The point's inputs as meta tensors (shapes and dtypes, no data); grouped_linear's offsets
    count rows (no meta kernel), so it is drawn on the CPU with narrow experts."""
    g = torch.Generator().manual_seed(0)
    dtype = point.dtype or torch.bfloat16
    if point.kernel == "grouped_linear":
        return point.make(g, dtype, **{**point.kw, "k_dim": 16, "n_dim": 8})
    with torch.device("meta"):
        return point.case.make(g, dtype)


@pytest.mark.parametrize("name", [*sweeps.SWEEPS])
def test_sweep_inputs_are_valid_calls_within_the_size_cap(name: str) -> None:
    for p in sweeps.sweep([name]):
        if p.make is None and p.kernel == "grouped_linear":
            continue  # the contract's perf case, too large for the CPU: conformance runs it
        args = _inputs(p)
        kpt.SPECS[p.kernel].check((), args, DTYPES)  # a KernelInputError names the bad argument
        if name != "perf":
            largest = max(v.numel() for v in args.values() if isinstance(v, torch.Tensor))
            assert largest <= sweeps.MAX_ELEMENTS * 8 or p.kernel == "grouped_linear", p.case.name
        if p.kernel == "grouped_linear":
            counts = args["offsets"].diff()
            assert counts.max() > 2 * counts.float().mean(), f"{p.case.name}: expert loads are even"


def test_models_sweep_covers_the_models_and_token_range() -> None:
    points = sweeps.sweep(["models"])
    norms = {(p.kw["shape"][0], p.kw["shape"][1]) for p in points if p.kernel == "rms_norm"}
    assert {h for _, h in norms} == {4096, 8192, 3584, 5120, 2304, 7168}
    assert {1, 65536} <= {t for t, _ in norms}
    vocabs = {p.kw["shape"][1] for p in points if p.kernel == "cross_entropy"}
    assert vocabs == {128256, 152064, 151936, 32768, 256000, 129280}
    gating = {(p.kw["experts"], p.kw["k"]) for p in points if p.kernel == "moe_gating"}
    assert (256, 8) in gating
    for p in points:
        spec = kpt.SPECS[p.kernel]
        assert p.modes == (sweeps.MODES if spec.differentiable else sweeps.FWD), p.kernel
        assert p.peers == ("eager", "compile", "library")


def test_attention_sweep_covers_the_issue_shapes() -> None:
    points = sweeps.sweep(["attention"])
    kws = [(p.kw, p.dtype, p.modes) for p in points]
    perf = [k for k, _, _ in kws if (k["b"], k["hq"], k["sq"], k["d"]) == (4, 32, 4096, 128) and k["hkv"] == 32]
    assert {k["causal"] for k in perf} == {True, False}
    assert {k["sq"] for k, _, _ in kws} >= {1, 8, 1024, 4096, 16384}
    assert {k["hq"] // k["hkv"] for k, _, _ in kws} >= {1, 4, 8}
    assert {d for d, in {(k["d"],) for k, _, _ in kws}} == {64, 128, 256}
    assert {dt for _, dt, _ in kws} == {torch.bfloat16, torch.float16}
    assert all(m == sweeps.FWD for k, _, m in kws if k["d"] == 256 or k["sq"] < k["skv"])
    decode = [k for k, _, _ in kws if k["sq"] < k["skv"] and k["sq"] <= 16]
    assert max(k["skv"] for k in decode) == 32768 and {(k["hq"], k["hkv"]) for k in decode} == {(32, 8), (32, 4)}
    assert {k["sq"] for k in decode} == {1, 8, 16}
    prefill = [k for k, _, _ in kws if 16 < k["sq"] < k["skv"]]  # chunked prefill: bottom-right causal
    assert {k["sq"] for k in prefill} == {512, 4096} and all(k["causal"] for k in prefill)
    assert all(p.peers == ("library",) for p in points)


def test_linear_sweep_covers_activations_fp8_and_experts() -> None:
    points = sweeps.sweep(["linear"])
    acts = {p.kw["activation"] for p in points if p.kernel == "linear"}
    assert acts == {None, "silu", "gelu", "gelu_tanh", "relu"}
    tokens = {p.kw["x"][0] for p in points if p.kernel == "linear" and p.kw["x"][1:] == (4096,)}
    assert {1, 8192, 16384} <= tokens
    for p in points:
        if p.kernel == "fp8_linear":  # row-wise scales
            args = _inputs(p)
            assert args["x_scale"].shape == (p.kw["m"][0], 1) and args["w_scale"].shape == (p.kw["n"], 1)
    experts = {p.kw["experts"] for p in points if p.kernel == "grouped_linear"}
    assert min(experts) == 8 and max(experts) == 256


@pytest.mark.parametrize("sq, skv, causal", [(8, 32, True), (1, 32, True), (16, 16, True), (8, 32, False)])
def test_sdpa_peer_takes_the_contract_causal_alignment(sq: int, skv: int, causal: bool) -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, sq, 16, generator=g)
    k, v = torch.randn(2, 2, skv, 16, generator=g), torch.randn(2, 2, skv, 16, generator=g)
    got = peers._sdpa(q, k, v, causal, None)
    expected = attention_fwd(q.double(), k.double(), v.double(), causal, 16 ** -0.5, None)[0]
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_grouped_loop_peer_matches_the_contract() -> None:
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(10, 8, generator=g), torch.randn(3, 5, 8, generator=g)
    offsets = torch.tensor([1, 4, 4, 9], dtype=torch.int32)  # a row before the first expert, one after the last
    expected = grouped_linear_fwd(x.double(), offsets, w.double())[0]
    torch.testing.assert_close(peers._grouped_loop(x, offsets, w).double(), expected, atol=1e-5, rtol=1e-5)


def test_missing_libraries_are_reported_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # import fails as when not installed
    monkeypatch.setitem(sys.modules, "flag_gems", None)
    assert peers.libraries("rms_norm") == ({}, "n/a: Liger not installed, FlagGems not installed")
    assert peers.libraries("layer_norm") == ({}, "n/a: Liger not installed")
    assert peers.libraries("moe_gating") == ({}, "")
    assert set(peers.libraries("attention")[0]) == {"SDPA cuDNN", "SDPA flash", "SDPA efficient"}


def test_every_named_peer_has_an_adapter_for_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A spec naming a library peer gets that library's function for it (the imports stubbed)."""
    import types

    fake = types.SimpleNamespace(ops=types.SimpleNamespace(), fused=types.SimpleNamespace())
    monkeypatch.setitem(sys.modules, "flag_gems", fake)
    lg = types.ModuleType("liger_kernel.transformers.functional")
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", types.ModuleType("liger_kernel.transformers"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", lg)
    sys.modules["liger_kernel.transformers"].functional = lg  # type: ignore[attr-defined]
    for spec in kpt.SPECS.values():
        for peer in spec.peers:
            label, adapters = peers._LIBRARY_PEERS[peer]
            assert spec.name in adapters(), f"{spec.name} names {peer} but it has no adapter"


def _measurement(kernel: str, case: str, mode: str, **ms: float) -> measure.Measurement:
    return measure.Measurement(kernel, case, "bfloat16", mode, ms=ms)


def test_report_gives_each_kernels_worst_ratio_against_its_best_peer() -> None:
    results = [
        _measurement("rms_norm", "a", "fwd", backend=1.0, eager=4.0, compile=2.0),
        _measurement("rms_norm", "b", "fwd+bwd", backend=2.0, eager=3.0, compile=2.5),
        _measurement("rms_norm", "c", "fwd", backend=1.0, eager=1.5, compile=3.0),
        measure.Measurement("rms_norm", "d", "bfloat16", "fwd", wrong="y: max error 1"),
        _measurement("attention", "e", "fwd", backend=2.0, library=1.0),
    ]
    results[0].library = "n/a: Liger not installed"
    results[4].library, results[4].libraries = "SDPA cuDNN", {"SDPA cuDNN": 1.0, "SDPA flash": 1.5}
    results[4].errors = {"SDPA efficient": "RuntimeError: No available kernel."}
    results[1].spread = {"backend": 0.031, "eager": 0.0, "compile": 0.012}
    results[4].spread = {"backend": 0.02, "SDPA cuDNN": 0.05, "SDPA flash": 0.0}
    summary = report.worst(results)
    assert summary["rms_norm"] | {"seconds": 0} == {"timings": 4, "wrong": 1, "ratio": 1.25, "case": "b",
                                                    "mode": "fwd+bwd", "peer": "compile", "spread": (0.031, 0.012),
                                                    "seconds": 0}
    assert summary["attention"]["ratio"] == 0.5 and summary["attention"]["peer"] == "SDPA cuDNN"
    assert summary["attention"]["spread"] == (0.02, 0.05)  # the best library's own spread
    text = report.markdown(results, {"torch": "x"}, timing.Ceilings(3000.0, 700.0), title="T")
    assert "| rms_norm | 4 | 1 | 0 | 1.25 | b | fwd+bwd | compile | 3.1% / 1.2% |" in text
    assert "| attention | 1 | 0 | 0 | 0.50 | e | fwd | SDPA cuDNN | 2.0% / 5.0% |" in text
    assert ("| rms_norm | a | bfloat16 | fwd | 1.0000 | 4.0000 | 2.0000 | n/a: Liger not installed "
            "| 4.00 | 2.00 | – | 2.00 |") in text
    assert "| rms_norm | d | bfloat16 | fwd | WRONG: y: max error 1 |" in text
    assert "- attention e fwd: SDPA efficient: RuntimeError: No available kernel." in text


def test_measure_times_backend_and_eager_on_the_cpu() -> None:
    from kpt.kernels.rms_norm import _make

    small = sweeps.point("rms_norm", "small", _make, shape=(64, 256))
    results, costs = sweeps.run_sweep(kpt.get_backend("reference"), [small], torch.float32,
                                         timing.Ceilings(100.0, 1.0), no_compile=True, host=False, quiet=True)
    assert [r.mode for r in results] == ["fwd", "fwd+bwd"] and costs == []
    for r in results:
        assert not r.wrong and set(r.ms) == {"backend", "eager"} and r.seconds > 0
        assert r.nbytes >= 2 * 64 * 256 * 4 and r.flops > 0 and r.gbps > 0
        assert r.spread == {"backend": 0.0, "eager": 0.0}  # one round on a CPU: no spread to report


def test_a_failing_shape_is_recorded_and_the_sweep_goes_on() -> None:
    from kpt.kernels.rms_norm import _make

    bad = sweeps.point("rms_norm", "bad", _make, shape=(4, 8), unknown=1)
    good = sweeps.point("rms_norm", "good", _make, shape=(4, 8))
    results, _ = sweeps.run_sweep(kpt.get_backend("reference"), [bad, good], torch.float32,
                                     timing.Ceilings(100.0, 1.0), no_compile=True, host=False, quiet=True)
    assert [bool(r.wrong) for r in results] == [True, True, False, False]
    assert "unexpected keyword argument 'unknown'" in results[0].wrong


def test_roofline_from_a_recorded_run(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the roofline plot needs matplotlib (kpt-core[bench])")
    report = json.loads(FIXTURE.read_text())
    pts = roofline.points(report)
    assert set(pts) == {r["kernel"] for r in report["results"]}
    for kernel, values in pts.items():
        for intensity, tflops, gbps in values:
            assert intensity > 0 and tflops > 0 and gbps > 0, kernel
            assert tflops * 1e3 / gbps == pytest.approx(intensity, rel=1e-6)  # FLOP/s over bytes/s
    assert roofline.main([str(FIXTURE), str(tmp_path / "r.png")]) == 0
    data = (tmp_path / "r.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_points_past_the_time_limit_are_recorded_as_skipped() -> None:
    from kpt.kernels.rms_norm import _make

    points = [sweeps.point("rms_norm", "a", _make, shape=(4, 8)), sweeps.point("rms_norm", "b", _make, shape=(4, 8))]
    results, _ = sweeps.run_sweep(kpt.get_backend("reference"), points, torch.float32,
                                     timing.Ceilings(100.0, 1.0), no_compile=True, host=False, quiet=True,
                                     time_limit=1e-9)
    assert len(results) == 4 and all(r.skipped and not r.ms for r in results)
    assert report.worst(results)["rms_norm"]["skipped"] == 4
    assert "| rms_norm | a | float32 | fwd | SKIPPED: the time limit of 0 s was reached |" in report.markdown(
        results, {}, timing.Ceilings(100.0, 1.0))


def test_host_cost_times_small_calls_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from kpt.kernels.rms_norm import _make

    spec, backend = kpt.SPECS["rms_norm"], kpt.get_backend("reference")
    args = _make(torch.Generator().manual_seed(0), torch.float32, shape=(1, 4096))
    cost = host.host_cost(backend, spec, args, "1×4096")
    assert set(cost.us) == {"backend", "eager"} and all(us > 0 for us in cost.us.values())
    monkeypatch.setattr(host, "SMALL_CALL_S", 0.0)
    cost = host.host_cost(backend, spec, args, "1×4096")
    assert not cost.us and cost.errors["backend"].startswith("not a small call")
