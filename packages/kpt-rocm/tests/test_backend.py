from __future__ import annotations

import inspect
import types

import kpt_rocm
import pytest
import torch
from kpt_rocm import plugin, tuning

import kpt
from kpt_triton import aot, attention_tiles


@pytest.fixture
def interpreted(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.interpreter
def test_discovered_through_the_entry_point(interpreted):
    info = {i.name: i for i in kpt.reload_backends(strict=True).list()}["rocm"]
    assert (info.vendor, info.device_type, info.priority, info.plugin) == ("AMD", "cuda", 100, "rocm")
    assert info.available and info.reason == ""
    assert isinstance(kpt.get_backend("rocm"), kpt_rocm.RocmBackend)


def test_plugin_returns_one_backend():
    (be,) = plugin.kpt_backends()
    assert isinstance(be, kpt_rocm.RocmBackend) and be.name == "rocm"


def test_every_contract_kernel_is_wired_to_kpt_triton():
    kernels = kpt_rocm.RocmBackend().kernels()
    assert set(kernels) == set(kpt.SPECS) and kpt.missing_kernels(kernels) == {}
    for name, k in kernels.items():
        assert k.forward.body.__name__ == f"{name}_fwd"
        assert k.forward.body.__module__.startswith("kpt_triton.")
    # the products through torch (hipBLASLt), the Triton activation as linear's epilogue
    for name in ("linear", "grouped_linear"):
        assert kernels[name].forward.body.__module__ == "kpt_triton.products"


@pytest.mark.interpreter
@pytest.mark.parametrize("arch", [None, "gfx90a", "gfx1201"])
def test_interpreter_runs_the_tuning_of_kpt_rocm_arch(interpreted, monkeypatch, arch):
    if arch is not None:
        monkeypatch.setenv("KPT_ROCM_ARCH", arch)
    be = kpt_rocm.RocmBackend()
    assert be.is_available() == (True, "") and be.device() == torch.device("cpu")
    assert be.conformance_profile == "rocm-interpret"
    assert be.arch() == (arch or "gfx942") == be.environment()["arch"]
    assert be.params("rms_norm_fwd") is tuning.TABLES[be.arch()]["rms_norm_fwd"]


@pytest.mark.interpreter
def test_unknown_interpreter_arch_is_refused(interpreted, monkeypatch):
    monkeypatch.setenv("KPT_ROCM_ARCH", "gfx908")
    with pytest.raises(ValueError, match="KPT_ROCM_ARCH='gfx908' has no tuning table"):
        kpt_rocm.RocmBackend().arch()


@pytest.mark.parametrize("hip, cuda, visible, arch, reason", [
    (None, None, False, "", "torch is a CPU build"),
    (None, "12.8", True, "", "torch is a CUDA build (CUDA 12.8)"),
    ("6.4", None, False, "", "no AMD GPU visible"),
    ("6.4", None, True, "gfx908:sramecc+:xnack-", "is gfx908: kpt-rocm is built for gfx942, gfx950"),
])
def test_unavailable_reasons(monkeypatch, hip, cuda, visible, arch, reason):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: visible)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "AMD Instinct MI100")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: types.SimpleNamespace(gcnArchName=arch))
    be = kpt_rocm.RocmBackend()
    available, why = be.is_available()
    assert not available and reason in why
    # the reason says how to run the kernels without the device; reports record the device's status
    status = why.partition(" (TRITON_INTERPRET=1 runs its Triton kernels on CPU tensors")[0]
    assert status != why and status in be.environment()["device"]
    assert why.endswith("with numpy: pip install 'kpt-rocm[interpret]')")  # the interpreter's extra


@pytest.mark.parametrize("name, arch", [("gfx942:sramecc+:xnack-", "gfx942"), ("gfx950", "gfx950"),
                                        ("gfx1100", "gfx1100")])
def test_arch_detection(monkeypatch, name, arch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.version, "hip", "6.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: types.SimpleNamespace(gcnArchName=name))
    be = kpt_rocm.RocmBackend()
    assert be.is_available() == (True, "") and be.arch() == arch


def test_tuning_tables_name_real_parameters():
    launchers = {f.__name__: f for k in kpt_rocm.RocmBackend().kernels().values()
                 for f in (k.forward.body, k.backward.body if k.backward else None) if f is not None}
    assert set(tuning.TABLES) == {"gfx942", "gfx950", "gfx90a", "gfx1100", "gfx1201"}
    for arch, table in tuning.TABLES.items():
        for launcher, params in table.items():
            assert launcher in launchers, f"{arch}: {launcher} is not a kernel body"
            keyword_only = {n for n, p in inspect.signature(launchers[launcher]).parameters.items()
                            if p.kind is p.KEYWORD_ONLY}
            unknown = set(params) - keyword_only
            assert not unknown, f"{arch}: {launcher} has no tuning parameter {unknown}"


def test_wavefront_width_sets_the_warp_arithmetic():
    assert tuning.TABLES["gfx942"]["rms_norm_fwd"]["elems_per_warp"] == 16 * 64
    assert tuning.TABLES["gfx1100"]["rms_norm_fwd"]["elems_per_warp"] == 16 * 32


@pytest.mark.parametrize("arch", tuning.TABLES)
def test_attention_tiles_fit_the_lds_at_every_head_dim(arch):
    """The table's attention tiles as every launch takes them (`kpt_triton.attention_tiles.fit`)
    hold within the arch's LDS in every dtype, with and without a mask; those that fit are kept."""
    limit = aot.TARGETS[arch].shared_limit
    for direction, backward in (("fwd", False), ("bwd", True)):
        entry = tuning.TABLES[arch][f"attention_{direction}"]
        for head_dim in range(16, 257):
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                for masked in (False, True):
                    block_d, t = attention_tiles.launch_tiles(head_dim, dtype, entry["tiles"], entry.get("fp32_tiles"),
                                                              backward, masked, limit)
                    rows = max(t.block_m, t.block_n) if backward else t.block_n
                    scores = backward or masked or dtype == torch.float32
                    assert attention_tiles.shared_bytes(rows, t.block_m, t.block_n, block_d, t.num_stages, dtype,
                                                        scores) <= limit
        wide = entry["tiles"][128]
        assert attention_tiles.fit(wide, 128, torch.bfloat16, backward, False, limit) == wide


def test_scaled_mm_only_where_the_arch_has_ocp_float8():
    assert [a for a, t in tuning.TABLES.items() if t["fp8_linear_fwd"].get("scaled_mm")] == ["gfx950"]
    assert not any(t[name].get("native_cast") for t in tuning.TABLES.values() for name in t)


@pytest.mark.interpreter
@pytest.mark.parametrize("arch", ["gfx942", "gfx950", "gfx1100"])
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_gives_the_contract_format_on_every_arch(interpreted, monkeypatch, arch, fp8_dtype):
    monkeypatch.setenv("KPT_ROCM_ARCH", arch)
    be = kpt.reload_backends(strict=True).get("rocm")
    x = torch.randn(4, 64) * 3
    xq, scale = be.quantize_fp8(x, "row", fp8_dtype)
    ref_q, ref_scale = kpt.SPECS["quantize_fp8"].forward(x.double(), "row", fp8_dtype)
    assert xq.dtype == fp8_dtype
    assert torch.equal(xq.view(torch.uint8), ref_q.view(torch.uint8))
    y = be.fp8_linear(xq, scale, xq, scale, None, torch.float32)
    expected = (xq.double() * scale) @ (xq.double() * scale).T
    assert torch.allclose(y.double(), expected, rtol=1e-5, atol=1e-4)
    assert torch.allclose(scale.double(), ref_scale, rtol=1e-6)


def test_no_speed_promised_before_hardware():
    assert all(kpt_rocm.RocmBackend().perf_bar(name, "fwd") is None for name in kpt.SPECS)
