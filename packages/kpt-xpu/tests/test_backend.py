from __future__ import annotations

import inspect
import os
import subprocess
import sys
import types

import kpt_xpu
import pytest
import torch
from kpt_xpu import device, plugin, tuning

import kpt


@pytest.fixture
def interpreted(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_discovered_through_the_entry_point(interpreted):
    info = {i.name: i for i in kpt.reload_backends(strict=True).list()}["xpu"]
    assert (info.vendor, info.device_type, info.priority, info.plugin) == ("Intel", "xpu", 100, "xpu")
    assert info.available and info.reason == ""
    assert isinstance(kpt.get_backend("xpu"), kpt_xpu.XpuBackend)


def test_plugin_returns_one_backend():
    (be,) = plugin.kpt_backends()
    assert isinstance(be, kpt_xpu.XpuBackend) and be.name == "xpu"


@pytest.mark.parametrize("interpret", ["0", "1"])
def test_every_contract_kernel_is_wired(monkeypatch, interpret):
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    kernels = kpt_xpu.XpuBackend().kernels()
    assert set(kernels) == set(kpt.SPECS) and kpt.missing_kernels(kernels) == {}
    for name, k in kernels.items():
        assert k.forward.__name__ == f"{name}_fwd"
        home = k.forward.__module__
        products = name in ("linear", "grouped_linear")
        assert home == "kpt_triton.products" if products else home.startswith("kpt_triton."), (name, home)


# what a CPU-only or CUDA torch, and a torch older than torch.xpu, leave kpt_xpu to find, with
# intel-extension-for-pytorch unimportable: kpt_xpu never needs it
_WITHOUT_XPU = """
import sys, torch
sys.modules["intel_extension_for_pytorch"] = None
{prepare}
import kpt, kpt_xpu
(info,) = [i for i in kpt.list_backends() if i.name == "xpu"]
print(info.available, info.reason)
"""


@pytest.mark.parametrize("prepare", ["", "del torch.xpu; sys.modules['torch.xpu'] = None; del torch.version.xpu"],
                         ids=["cpu-torch", "no-torch.xpu"])
def test_imports_without_xpu_support_and_without_ipex(prepare):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _WITHOUT_XPU.format(prepare=prepare)], env=env,
                         capture_output=True, text=True, check=True).stdout
    # "(a CPU build)" here, "(a CUDA 13.0 build)" on an NVIDIA machine
    assert out.startswith("False torch has no XPU support (a "), out


@pytest.mark.parametrize("arch", [None, "bmg", "lnl", "acm"])
def test_interpreter_runs_the_tuning_of_kpt_xpu_arch(interpreted, monkeypatch, arch):
    if arch is not None:
        monkeypatch.setenv("KPT_XPU_ARCH", arch)
    be = kpt_xpu.XpuBackend()
    assert be.is_available() == (True, "") and be.device() == torch.device("cpu")
    assert be.conformance_profile == "xpu-interpret"
    assert be.arch() == (arch or "pvc") == be.environment()["arch"]
    assert be.params("rms_norm_fwd") is tuning.TABLES[be.arch()]["rms_norm_fwd"]


def test_unknown_interpreter_arch_is_refused(interpreted, monkeypatch):
    monkeypatch.setenv("KPT_XPU_ARCH", "xe3")
    with pytest.raises(ValueError, match="KPT_XPU_ARCH='xe3' has no tuning table"):
        kpt_xpu.XpuBackend().arch()


def _fake_xpu(monkeypatch, props, *, visible=True, triton_backends=("intel",)):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.version, "xpu", "20250301", raising=False)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: visible)
    monkeypatch.setattr(torch.xpu, "current_device", lambda: 0)
    monkeypatch.setattr(torch.xpu, "get_device_properties", lambda *a: props)
    monkeypatch.setitem(sys.modules, "triton.backends", types.SimpleNamespace(backends=dict.fromkeys(triton_backends)))


# property sets of each arch as torch.xpu.get_device_properties reports them (the fields that
# detection and the reports read; public specifications of each part)
PROPS = {
    "max1550": ("pvc", dict(name="Intel(R) Data Center GPU Max 1550", device_id=0x0BD5, max_compute_units=448,
                            sub_group_sizes=[16, 32], has_fp64=True, driver_version="1.3.29735")),
    "max1100": ("pvc", dict(name="Intel(R) Data Center GPU Max 1100", device_id=0x0BDA, max_compute_units=448,
                            sub_group_sizes=[16, 32], has_fp64=True, driver_version="1.3.29735")),
    "b580": ("bmg", dict(name="Intel(R) Arc(TM) B580 Graphics", device_id=0xE20B, max_compute_units=160,
                         sub_group_sizes=[16, 32], has_fp64=True, driver_version="1.6.32224")),
    "pro-b60": ("bmg", dict(name="Intel(R) Arc(TM) Pro B60 Graphics", device_id=0xE211, max_compute_units=160,
                            sub_group_sizes=[16, 32], has_fp64=True, driver_version="1.6.32224")),
    "140v": ("lnl", dict(name="Intel(R) Arc(TM) 140V GPU (16GB)", device_id=0x64A0, max_compute_units=64,
                         sub_group_sizes=[16, 32], has_fp64=True, driver_version="1.6.32224")),
    "lnl-generic-name": ("lnl", dict(name="Intel(R) Graphics [0x64a0]", device_id=0x64A0, max_compute_units=64,
                                     sub_group_sizes=[16, 32], has_fp64=True, driver_version="1.6.32224")),
    "a770": ("acm", dict(name="Intel(R) Arc(TM) A770 Graphics", device_id=0x56A0, max_compute_units=512,
                         sub_group_sizes=[8, 16, 32], has_fp64=False, driver_version="1.3.29735")),
    "flex170": ("acm", dict(name="Intel(R) Data Center GPU Flex 170", device_id=0x56C0, max_compute_units=512,
                            sub_group_sizes=[8, 16, 32], has_fp64=False, driver_version="1.3.29735")),
}


@pytest.mark.parametrize("part", PROPS)
def test_arch_detection(monkeypatch, part):
    arch, props = PROPS[part]
    _fake_xpu(monkeypatch, types.SimpleNamespace(**props))
    be = kpt_xpu.XpuBackend()
    assert be.is_available() == (True, "") and be.arch() == arch
    assert be.device() == torch.device("xpu")
    assert device.facts()["arch"] == arch and device.facts()["device"] == props["name"]


@pytest.mark.parametrize("xpu, cuda, visible, backends, name, reason", [
    (None, None, False, ("intel",), "", "torch has no XPU support (a CPU build)"),
    (None, "12.8", False, ("intel",), "", "torch has no XPU support (a CUDA 12.8 build)"),
    ("20250301", None, False, ("intel",), "", "no Intel GPU visible"),
    ("20250301", None, True, ("nvidia", "amd"), "Intel(R) Arc(TM) B580 Graphics", "Triton has no Intel backend"),
    ("20250301", None, True, ("intel",), "Intel(R) Arc(TM) Graphics", "Intel(R) Arc(TM) Graphics has no tuning table"),
])
def test_unavailable_reasons(monkeypatch, xpu, cuda, visible, backends, name, reason):
    _fake_xpu(monkeypatch, types.SimpleNamespace(name=name, device_id=0x7D55), visible=visible,
              triton_backends=backends)
    monkeypatch.setattr(torch.version, "xpu", xpu)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    be = kpt_xpu.XpuBackend()
    available, why = be.is_available()
    assert not available and reason in why and "\n" not in why
    # the reason says how to run the kernels without the device; reports record the device's status
    status = why.partition(" (TRITON_INTERPRET=1 runs its Triton kernels on CPU tensors")[0]
    assert status != why and status in be.environment()["device"]
    assert why.endswith("with numpy: pip install 'kpt-xpu[interpret]')")  # the interpreter's extra


def test_tuning_tables_name_parameters_of_the_bodies_here():
    """Every entry names a body of this backend (after torch's grouped_linear replaced the Triton
    one) and keyword-only parameters it has."""
    keyword_only = {f.__name__: {n for n, p in inspect.signature(f).parameters.items() if p.kind is p.KEYWORD_ONLY}
                    for k in kpt_xpu.XpuBackend().kernels().values() for f in (k.forward, k.backward) if f is not None}
    counted = {name for name, params in keyword_only.items() if "elems_per_warp" in params}
    assert set(tuning.TABLES) == set(tuning.ARCHS) == set(tuning.SLM_BYTES)
    for arch, table in tuning.TABLES.items():
        assert counted <= set(table) and len(counted) > 20, arch  # every launcher that counts lanes
        for launcher, params in table.items():
            assert launcher in keyword_only, f"{arch}: {launcher} is not a kernel body"
            unknown = set(params) - keyword_only[launcher]
            assert not unknown, f"{arch}: {launcher} has no tuning parameter {unknown}"


def test_row_kernels_count_lanes_of_the_subgroup_they_are_compiled_at():
    for table in tuning.TABLES.values():
        assert table["rms_norm_fwd"]["elems_per_warp"] == 16 * 32 == table["gelu_fwd"]["elems_per_warp"]
        assert not any(e.get("scaled_mm") or e.get("native_cast") for e in table.values())


@pytest.mark.parametrize("arch", tuning.TABLES)
def test_attention_tiles_fit_shared_local_memory(arch):
    """The key and value tiles (16-bit) of every pipeline stage, or the query and output-gradient
    tiles of the backward's key loop, fit the arch's SLM; large GRF only on Xe-HPC and Xe2."""
    for direction in ("fwd", "bwd"):
        for head_dim, t in tuning.TABLES[arch][f"attention_{direction}"]["tiles"].items():
            assert t.num_stages * 2 * max(t.block_m, t.block_n) * head_dim * 2 <= tuning.SLM_BYTES[arch]
            assert t.options == ({} if arch == "acm" else {"grf_mode": "large"})


@pytest.mark.parametrize("arch", ["pvc", "acm"])
def test_attention_with_grf_mode_runs_under_the_interpreter(interpreted, monkeypatch, arch):
    monkeypatch.setenv("KPT_XPU_ARCH", arch)
    be = kpt.reload_backends(strict=True).get("xpu")
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 20, 64, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(3))
    out = be.attention(q, k, v, True)
    out.float().square().sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=True)
    ref.square().sum().backward()
    assert torch.allclose(out.double(), ref, atol=2e-2, rtol=2e-2)
    assert torch.allclose(q.grad.double(), q64.grad, atol=5e-2, rtol=5e-2)


def test_grouped_linear_reads_out_of_range_offsets_as_the_contract_does(interpreted):
    be = kpt.reload_backends(strict=True).get("xpu")
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(12, 8, generator=g), torch.randn(3, 5, 8, generator=g)
    offsets = torch.tensor([2, 7, 4, 40], dtype=torch.int32)  # rows 0-1 of no expert, a decrease, past the end
    x.requires_grad_(), w.requires_grad_()
    y = be.grouped_linear(x, offsets, w)
    y.sum().backward()
    ref = torch.zeros(12, 5, dtype=torch.float64)
    ref[2:7] = x[2:7].double() @ w[0].double().T
    ref[7:12] = x[7:12].double() @ w[2].double().T
    assert torch.allclose(y.double(), ref.detach(), atol=1e-5)
    assert torch.equal(x.grad[:2], torch.zeros(2, 8)) and torch.equal(w.grad[1], torch.zeros(5, 8))
    assert torch.allclose(x.grad[2:7], w[0].sum(0).expand(5, 8), atol=1e-5)


def test_float64_is_refused_with_the_dtypes_it_takes(interpreted):
    be = kpt.reload_backends(strict=True).get("xpu")
    with pytest.raises(kpt.KernelInputError, match="float64; expected one of: float32, float16, bfloat16"):
        be.rms_norm(torch.randn(2, 8, dtype=torch.float64))


def test_no_speed_promised_before_hardware():
    assert all(kpt_xpu.XpuBackend().perf_bar(name, "fwd") is None for name in kpt.SPECS)
