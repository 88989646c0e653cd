"""`kpt_triton.backend.TritonBackend`, the base of the vendor backends, on a made-up vendor: its
abstract hooks, availability and its reasons, the tuning lookup, the interpreter switch, the
kernel list (portable, torch products, native bodies)."""

from __future__ import annotations

import types

import pytest
import torch

import kpt
from kpt_triton import backend as base
from kpt_triton import linear, moe, products

TABLES = {"a1": {"rms_norm_fwd": {"tile_elems": 1024}}, "a2": {}, "sim": {"softmax_fwd": {"tile_elems": 256}}}


class Acme(base.TritonBackend):
    name, vendor = "acme", "Acme"
    tables = TABLES
    status = (False, "no Acme GPU visible")

    def device_status(self):
        return self.status

    def detect_arch(self):
        return "a1"

    def interpreter_arch(self):
        return "sim"


@pytest.fixture
def interpreted(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def on_device(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.mark.parametrize("hook", ["device_status", "detect_arch", "interpreter_arch"])
def test_a_vendor_missing_a_hook_fails_at_instantiation(hook):
    hooks = {"device_status": lambda self: (True, ""), "detect_arch": lambda self: "a1",
             "interpreter_arch": lambda self: "sim"}
    del hooks[hook]
    partial = type("Partial", (base.TritonBackend,), {"name": "partial", "vendor": "x", "tables": TABLES, **hooks})
    with pytest.raises(TypeError, match=hook):
        partial()


def test_without_its_device_the_reason_says_how_to_run_anyway(on_device):
    be = Acme()
    assert be.is_available() == (False, "no Acme GPU visible (TRITON_INTERPRET=1 runs its Triton kernels "
                                        "on CPU tensors, with numpy: pip install 'kpt-acme[interpret]')")
    assert be.environment()["device"] == "none (no Acme GPU visible)"
    assert not be.simulator and be.conformance_profile == "acme" and be.device() == torch.device("cuda")


def test_on_its_device_the_detected_arch_is_tuned(on_device, monkeypatch):
    monkeypatch.setattr(Acme, "status", (True, ""))
    monkeypatch.setattr(Acme, "device_facts", lambda self: {"device": "Acme 1", "arch": self.arch()})
    be = Acme()
    assert be.is_available() == (True, "") and be.arch() == "a1"
    assert be.params("rms_norm_fwd") == {"tile_elems": 1024}
    assert be.params("softmax_fwd") == {}  # a launcher the table leaves out keeps its defaults
    assert be.environment()["device"] == "Acme 1"


def test_a_pinned_arch_wins_over_detection_and_the_interpreter(interpreted):
    assert Acme(arch="a2").arch() == "a2" and Acme(arch="a2").params("rms_norm_fwd") == {}


def test_the_interpreter_switch(interpreted):
    be = Acme()
    assert be.is_available() == (True, "")
    assert be.arch() == "sim" and be.params("softmax_fwd") == {"tile_elems": 256}
    assert be.simulator and be.device() == torch.device("cpu")
    assert be.conformance_profile == "acme-interpret"
    assert be.environment()["arch"] == "sim" and "interpreter" in be.environment()["device"]


def test_tuned_bodies_look_their_tuning_up_at_the_first_call():
    looked_up = []

    def body(x, *, scale=1):
        return x * scale

    def params(launcher):
        looked_up.append(launcher)
        return {"scale": 3}

    tuned = base.Tuned(body, params)
    assert looked_up == [] and tuned.__name__ == "body"
    assert tuned(2) == 6 and tuned(5) == 15 and looked_up == ["body"]


def test_a_tuned_body_gets_the_keywords_it_takes():
    """An entry written for a vendor's native body also serves the portable body that runs where the
    native one cannot: that one gets only its own keywords; a body that passes keywords on gets all."""
    entry = {"scale": 3, "native_plan": "wide"}

    def portable(x, *, scale=1):
        return x * scale

    def native(x, *, scale=1, native_plan=None, **passed_on):
        return x * scale, native_plan, passed_on

    assert base.Tuned(portable, lambda name: entry)(2) == 6
    assert base.Tuned(native, lambda name: {**entry, "tiles": 4})(2) == (6, "wide", {"tiles": 4})


def test_kernels_come_from_the_contract():
    kernels = Acme().kernels()
    assert set(kernels) == set(kpt.SPECS) and kpt.missing_kernels(kernels) == {}
    assert kernels["linear"].forward.body is linear.linear_fwd
    assert kernels["grouped_linear"].backward.body is moe.grouped_linear_bwd


def test_torch_products_replace_the_triton_gemms(monkeypatch):
    monkeypatch.setattr(Acme, "torch_products", True)
    kernels = Acme().kernels()
    assert kernels["linear"].forward.body is products.linear_fwd
    assert kernels["linear"].backward.body is products.linear_bwd
    assert kernels["grouped_linear"].forward.body is products.grouped_linear_fwd
    assert kernels["grouped_linear"].backward.body is products.grouped_linear_bwd
    assert kernels["rms_norm"].forward.body.__module__ == "kpt_triton.rms_norm"


def test_eager_torch_products_linear_is_differentiated_by_torch(monkeypatch, interpreted):
    """The products' linear is torch operations only (`kpt.torch_autograd`): an eager call that
    needs gradients is differentiated by torch's autograd, with `products.linear_bwd`'s gradients."""
    monkeypatch.setattr(Acme, "torch_products", True)
    monkeypatch.setattr(Acme, "status", (True, ""))
    g = torch.Generator().manual_seed(5)
    x, w, b = (torch.randn(*s, generator=g).requires_grad_() for s in ((3, 8), (6, 8), (6,)))
    y = Acme().linear(x, w, b, activation="silu")
    assert type(y.grad_fn).__name__ == "SiluBackward0"  # not a kpt autograd function
    dy = torch.randn(3, 6, generator=g)
    _, pre = products.linear_fwd(x.detach(), w.detach(), b.detach(), "silu")
    expected = products.linear_bwd(x.detach(), w.detach(), b.detach(), "silu", None, pre, dy)
    for got, want in zip(torch.autograd.grad(y, (x, w, b), dy), expected):
        torch.testing.assert_close(got, want)


def test_native_bodies_replace_portable_ones_on_the_device_only(monkeypatch):
    native = types.ModuleType("acme_native")
    native.softmax_fwd = lambda x, dim: (x,)
    monkeypatch.setattr(Acme, "native_modules", lambda self: (native,))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert Acme().kernels()["softmax"].forward.body is native.softmax_fwd
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert Acme().kernels()["softmax"].forward.body.__module__ == "kpt_triton.softmax"


def test_speed_bars():
    be = Acme()
    assert be.perf_bar("linear", "fwd").min_ceiling_fraction == 0.8
    assert be.perf_bar("rms_norm", "fwd").min_ceiling_fraction == 0.6
    assert be.perf_bar("rms_norm", "fwd+bwd").min_ceiling_fraction is None
    assert be.perf_bar("attention", "fwd").min_speedup == 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", [None, "gelu", "gelu_tanh", "silu", "relu"])
def test_torch_products_add_a_float32_bias_beyond_the_dtype_as_the_contract(dtype, activation):
    """``torch.addmm`` adds the bias in the activations' dtype: float32's ±max (or ±1e5 beside
    float16) cast alone became ±inf, and gelu(-inf) NaN where the contract's float32 add gives 0
    (found by CI's fuzzing). The products add a float32 bias in float32 now."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(4, 8, generator=g).to(dtype), (torch.randn(6, 8, generator=g) / 8).to(dtype)
    big = torch.finfo(torch.float32).max
    bias = torch.tensor([big, -big, 1e5, -1e5, float("inf"), -float("inf")])
    y, _ = products.linear_fwd(x, w, bias, activation)
    # the bias's gradient through the eager autograd path keeps the reference's NaN (where act'(NaN)
    # is NaN); -1e5 is beyond float16's range (±max is not fuzzed in gradients: gelu_tanh' of
    # -3.4e38 overflows float32, which the contract allows)
    nan_bias = torch.tensor([float("nan"), -1e5, 1.0]).requires_grad_()
    dbias, = torch.autograd.grad(products.linear_fwd(x, w[:3], nan_bias, activation)[0].sum(), nan_bias)
    ref_bias = nan_bias.detach().double().requires_grad_()
    ref_y = kpt.get_backend("reference").linear(x.double(), w[:3].double(), ref_bias, activation=activation)
    ref_dbias, = torch.autograd.grad(ref_y.sum(), ref_bias)
    assert torch.equal(dbias.isnan(), ref_dbias.isnan()), (dbias, ref_dbias)
    ref = kpt.get_backend("reference").linear(x.double(), w.double(), bias.double(), activation=activation)
    report = kpt.testing.compare("y", y, kpt.testing.either(y, ref, kpt.get_backend("reference").linear(
        x, w, bias, activation=activation)), kpt.tolerance.default_tolerance(dtype))
    assert report.ok, report.message


def test_torch_products_add_a_float32_bias_in_float32():
    """x · w = 1 and a float32 bias of -1 + 2^-12: the contract's pre-activation is 2^-12 > 0, so
    relu passes it and its gradient; the bias rounded to bfloat16 first (-1) made it 0 (found by
    the fuzzing: dx and dweight off where relu' changed)."""
    x = torch.ones(1, 1, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(1, 1, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.tensor([-1.0 + 2.0**-12], requires_grad=True)
    y, pre = products.linear_fwd(x, w, bias, "relu")
    assert float(y) == 2.0**-12 and float(pre) == 2.0**-12
    dx, dw, db = torch.autograd.grad(y, (x, w, bias), torch.ones_like(y))
    assert float(dx) == float(dw) == float(db) == 1.0
    assert products.linear_bwd(x, w, bias, "relu", y, pre, torch.ones_like(y))[0].item() == 1.0
