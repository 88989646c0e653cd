from __future__ import annotations

import inspect
import os
import subprocess
import sys
import types

import pytest
import torch

import kpt
import kpt_cuda
from kpt_cuda import backend, device, plugin, tuning
from kpt_triton import backend as base


@pytest.fixture
def interpreted(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.interpreter
def test_discovered_through_the_entry_point(interpreted):
    registry = kpt.reload_backends(strict=True)
    info = {i.name: i for i in registry.list()}["cuda"]
    assert (info.vendor, info.device_type, info.priority, info.plugin) == ("NVIDIA", "cuda", 100, "cuda")
    assert info.available and info.reason == ""
    assert isinstance(kpt.get_backend("cuda"), kpt_cuda.CudaBackend)


def test_plugin_returns_one_backend():
    (be,) = plugin.kpt_backends()
    assert isinstance(be, kpt_cuda.CudaBackend) and be.name == "cuda"


def test_every_contract_kernel_is_wired():
    kernels = kpt_cuda.CudaBackend().kernels()
    assert kpt.missing_kernels(kernels) == {}
    assert set(kernels) == set(kpt.SPECS)
    for name, k in kernels.items():
        assert k.forward.body.__name__ == f"{name}_fwd"
        assert k.forward.body.__module__.startswith(("kpt_triton.", "kpt_cuda."))


@pytest.mark.interpreter
def test_interpreter_mode(interpreted):
    be = kpt_cuda.CudaBackend()
    assert be.is_available() == (True, "")
    assert be.device() == torch.device("cpu")
    assert be.conformance_profile == "cuda-interpret"
    assert "interpreter" in be.environment()["device"]
    assert be.arch() == "interpret" and be.params("rms_norm_fwd") == {}


@pytest.mark.parametrize("case, reason", [
    ("hip", "ROCm build of torch"),
    ("no_cuda_build", "torch was built without CUDA"),
    ("no_device", "no CUDA device"),
    ("old_gpu", "compute capability 7.5"),
])
def test_unavailable_reasons(monkeypatch, case, reason):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.version, "hip", "6.2" if case == "hip" else None)
    monkeypatch.setattr(torch.version, "cuda", None if case == "no_cuda_build" else "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: case == "old_gpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    be = kpt_cuda.CudaBackend()
    available, why = be.is_available()
    assert not available and reason in why
    # the reason says how to run the kernels without the device; reports record the device's status
    status = why.partition(" (TRITON_INTERPRET=1 runs its Triton kernels on CPU tensors")[0]
    assert status != why and status in be.environment()["device"]
    assert why.endswith("with numpy: pip install 'kpt-cuda[interpret]')")  # the interpreter's extra


@pytest.mark.parametrize("cc, gib, arch", [((8, 0), 80, "sm80"), ((8, 9), 24, "sm80"), ((9, 0), 80, "sm90"),
                                           ((9, 0), 141, "sm90-hbm3e"), ((10, 0), 180, "sm100"),
                                           ((10, 3), 268, "sm100"), ((12, 0), 32, "sm90")])
def test_arch_tags(monkeypatch, cc, gib, arch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: cc)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: types.SimpleNamespace(total_memory=gib * 2**30))
    assert device.arch() == arch


def test_tuning_tables_name_real_parameters():
    """Every table names kernel bodies and their keyword parameters; on Hopper (sm90 tables) the body is
    the vendor-native one where a native module has it (`kpt_cuda.backend.NATIVE_MODULES`)."""
    launchers = {f.__name__: f for k in kpt_cuda.CudaBackend().kernels().values()
                 for f in (k.forward.body, k.backward.body if k.backward else None) if f is not None}
    native = {name: getattr(m, name) for m in backend.NATIVE_MODULES for name in launchers if hasattr(m, name)}
    assert {"sm80", "sm90"} <= set(tuning.TABLES)
    for arch, table in tuning.TABLES.items():
        for launcher, params in table.items():
            assert launcher in launchers, f"{arch}: {launcher} is not a kernel body"
            body = native.get(launcher, launchers[launcher]) if arch.startswith("sm90") else launchers[launcher]
            params_of = inspect.signature(body).parameters.values()
            # a native body that takes **tuning passes it on to the portable one
            passed_on = launchers[launcher] if any(p.kind is p.VAR_KEYWORD for p in params_of) else body
            keyword_only = {p.name for f in (body, passed_on) for p in inspect.signature(f).parameters.values()
                            if p.kind is p.KEYWORD_ONLY}
            unknown = set(params) - keyword_only
            assert not unknown, f"{arch}: {launcher} has no tuning parameter {unknown}"


def test_tuning_is_bound_at_the_first_call(monkeypatch):
    seen = []

    def body_fwd(x, *, block=1):
        seen.append(block)
        return (x,)

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(device, "arch", lambda: "sm90")
    monkeypatch.setitem(tuning.TABLES, "sm90", {"body_fwd": {"block": 7}})
    tuned = base.Tuned(body_fwd, kpt_cuda.CudaBackend().params)
    tuned(torch.zeros(1))
    monkeypatch.setattr(device, "arch", lambda: "sm80")  # looked up once, at the first call
    tuned(torch.zeros(1))
    assert seen == [7, 7]


@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors in the interpreter: on a GPU machine the "
                    "kernels were compiled for the GPU when imported; the conformance suite checks gradients there")
def test_calls_run_through_autograd(interpreted):
    be = kpt.reload_backends(strict=True).get("cuda")
    x = torch.randn(3, 40, dtype=torch.float64).to(torch.bfloat16).requires_grad_()
    w = torch.ones(40, dtype=torch.bfloat16, requires_grad=True)
    y = be.rms_norm(x, w)
    y.float().square().sum().backward()
    ref = kpt.SPECS["rms_norm"].forward(x.detach().double(), w.detach().double(), 1e-6)[0]
    assert torch.allclose(y.double(), ref, rtol=1e-2, atol=1e-2)
    assert x.grad is not None and w.grad is not None and x.grad.isfinite().all()


def test_interpreter_mode_is_never_selected_automatically() -> None:
    if not base.interpreted():
        pytest.skip("runs under TRITON_INTERPRET=1 (CI), where the backend simulates itself on the CPU")
    assert kpt.reload_backends().get().name == "reference"
    assert kpt.get_backend("cuda").device().type == "cpu"


def test_every_kernel_declares_a_speed_bar():
    be = kpt_cuda.CudaBackend()
    for name in kpt.SPECS:
        for mode in ("fwd", "fwd+bwd"):
            bar = be.perf_bar(name, mode)
            assert bar.min_speedup is not None or bar.min_ceiling_fraction is not None, (name, mode)
    assert be.perf_bar("rms_norm", "fwd").min_ceiling_fraction == 0.6
    assert be.perf_bar("rms_norm", "fwd+bwd").min_ceiling_fraction is None


def test_plugin_loads_without_numpy() -> None:
    # numpy comes only with the optional CuPy extra (and Triton's interpreter, so not under it);
    # the backend must register without it
    code = ("import sys; sys.modules['numpy'] = None; import kpt; "
            "info = {i.name: i for i in kpt.reload_backends().list()}['cuda']; "
            "assert info.error is None, info.error")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
