from __future__ import annotations

import sys
from importlib import resources

import kpt_mps
import pytest
import torch
from kpt_mps import device, metal, plugin
from kpt_mps.families import FAMILIES

import kpt


def test_plugin_returns_one_backend():
    (be,) = plugin.kpt_backends()
    assert isinstance(be, kpt_mps.MpsBackend) and be.name == "mps"


def test_every_contract_kernel_has_a_metal_body():
    kernels = kpt_mps.MpsBackend().kernels()
    assert set(kernels) == set(kpt.SPECS) and kpt.missing_kernels(kernels) == {}
    shaders = resources.files("kpt_mps").joinpath("shaders")
    for module in FAMILIES:
        family = module.__name__.rsplit(".", 1)[-1]
        assert shaders.joinpath(f"{family}.metal").is_file(), family


@pytest.mark.skipif(sys.platform == "darwin", reason="checks the reason given off macOS")
def test_listed_with_its_reason_off_macos(monkeypatch):
    monkeypatch.delenv("KPT_MPS_EMULATE", raising=False)
    info = {i.name: i for i in kpt.reload_backends(strict=True).list()}["mps"]
    assert (info.vendor, info.device_type, info.available) == ("Apple", "mps", False)
    assert info.reason.startswith("not macOS (KPT_MPS_EMULATE=1 runs the shaders")


def test_emulated_backend_is_a_simulator_on_cpu(emulated):
    be = kpt.reload_backends(strict=True).find("mps")
    assert be.is_available() == (True, "")
    assert be.simulator and be.device() == torch.device("cpu") and be.conformance_profile == "mps-emulate"
    assert "Metal emulator" in be.environment()["device"]
    assert kpt.get_backend() is not be  # a simulator is never picked automatically


def test_float64_is_refused(emulated):
    be = kpt.get_backend("mps")
    with pytest.raises(kpt.KernelInputError, match="float64"):
        be.rms_norm(torch.randn(2, 8, dtype=torch.float64))


def test_bfloat16_below_macos_14_is_not_supported(monkeypatch):
    monkeypatch.setattr(device, "bf16_supported", lambda: False)
    monkeypatch.setattr(metal, "emulated", lambda: False)
    be = kpt_mps.MpsBackend()
    assert be.unsupported("rms_norm", {"x": torch.ones(2, dtype=torch.bfloat16)}) == \
        "bfloat16 on MPS needs macOS 14 or newer"
    assert be.unsupported("dequantize_fp8", {"dtype": torch.bfloat16}) is not None
    assert be.unsupported("rms_norm", {"x": torch.ones(2)}) is None


def test_a_gradient_through_the_emulated_shaders(emulated):
    be = kpt.get_backend("mps")
    ref = kpt.get_backend("reference")
    x = torch.randn(3, 40, requires_grad=True)
    w = torch.randn(40, requires_grad=True)
    be.layer_norm(x, w).square().sum().backward()
    gx, gw = x.grad, w.grad
    x.grad = w.grad = None
    ref.layer_norm(x, w).square().sum().backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)
