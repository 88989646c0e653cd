"""Discovery and selection: fixture plugins installed as entry points for each test."""

from __future__ import annotations

import types
from importlib.metadata import EntryPoint

import pytest
import torch

import kpt
from kpt.registry import ENTRY_POINT_GROUP


def _ep(name: str, module: str) -> EntryPoint:
    return EntryPoint(name=name, value=f"kpt_fixture_plugins.{module}", group=ENTRY_POINT_GROUP)


PLUGINS = [_ep("fixture", "backends"), _ep("broken-import", "broken_import"), _ep("broken-hook", "broken_hook"),
           _ep("wrong-types", "wrong_types"), _ep("not-a-list", "not_a_list")]


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> kpt.Registry:
    monkeypatch.delenv("KPT_BACKEND", raising=False)
    monkeypatch.delenv("KPT_STRICT_PLUGINS", raising=False)
    return kpt.Registry(PLUGINS)


def test_default_without_plugins_is_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KPT_BACKEND", raising=False)
    assert kpt.Registry([]).get().name == "reference"


def test_auto_selection_takes_highest_available_non_simulator(registry: kpt.Registry) -> None:
    assert registry.get().name == "fixture-fast"


def test_environment_variable_selects(registry: kpt.Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KPT_BACKEND", "reference")
    assert registry.get().name == "reference"
    assert registry.get("fixture-sim").name == "fixture-sim"  # explicit name beats the variable


def test_unknown_name_lists_registered(registry: kpt.Registry) -> None:
    with pytest.raises(kpt.BackendError, match="unknown kpt backend 'nope'; registered: .*fixture, .*reference"):
        registry.get("nope")


def test_environment_variable_is_named_in_its_errors(registry: kpt.Registry,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KPT_BACKEND", "nope")
    with pytest.raises(kpt.BackendError, match=r"unknown kpt backend 'nope' \(named by the KPT_BACKEND environment"):
        registry.get()
    monkeypatch.setenv("KPT_BACKEND", "fixture-unavailable")
    with pytest.raises(kpt.BackendError, match=r"\(named by the KPT_BACKEND environment variable\) is not available"):
        registry.get()
    with pytest.raises(kpt.BackendError) as info:  # a name passed in is not blamed on the variable
        registry.get("nope")
    assert "KPT_BACKEND" not in str(info.value)


def test_list_prints_as_a_table(registry: kpt.Registry) -> None:
    listed = registry.list()
    lines = repr(listed).splitlines()
    assert str(listed) == repr(listed) == listed.table()
    assert lines[0].split() == ["backend", "vendor", "device", "priority", "usable", "why", "not"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert list(rows) == [i.name for i in listed]
    assert rows["fixture-unavailable"].split()[4:] == ["no", "no", "fixture", "device", "here"]
    assert "yes, when named (simulator)" in rows["fixture-sim"]
    assert rows["reference"].split()[1:] == ["kpt", "cpu", "0", "yes"]
    assert "ImportError" in rows["broken-import"] and "libfixture.so" in rows["broken-import"]


def test_list_reports_every_backend_and_failure(registry: kpt.Registry) -> None:
    infos = {i.name: i for i in registry.list()}
    assert infos["reference"].available and infos["fixture-fast"].available
    assert infos["fixture-sim"].simulator and infos["fixture-sim"].available
    assert not infos["fixture-unavailable"].available
    assert infos["fixture-unavailable"].reason == "no fixture device here"
    assert "ImportError" in infos["broken-import"].error and "libfixture.so" in infos["broken-import"].error
    assert "hook failed" in infos["broken-hook"].error
    assert "missing kernels: rms_norm" in infos["fixture-incomplete"].reason
    assert "contract v0" in infos["fixture-wrong-version"].reason
    assert "driver exploded" in infos["fixture-availability-raises"].error
    assert "returned 'not a backend', which is not a kpt.Backend" in infos["wrong-types"].reason
    assert "not iterable" in infos["not-a-list"].error
    # a second backend named "reference" is refused under its own entry (plugin:name); the first one keeps the name
    assert "'reference' is kpt's, provided by kpt-core" in infos["wrong-types:reference"].reason
    assert infos["reference"].plugin == "reference" and registry.get("reference").name == "reference"
    assert [i.priority for i in registry.list()] == sorted((i.priority for i in registry.list()), reverse=True)


@pytest.mark.parametrize("name, message", [
    ("fixture-incomplete", "missing kernels: rms_norm"),
    ("fixture-wrong-version", f"implements kernel contract v0, but this kpt-core implements v{kpt.CONTRACT_VERSION}"),
    ("fixture-unavailable", "not available here: no fixture device here"),
    ("broken-import", "plugin failed to load"),
])
def test_refused_backends_explain_themselves(registry: kpt.Registry, name: str, message: str) -> None:
    with pytest.raises(kpt.BackendError, match=message):
        registry.get(name)


def test_strict_mode_reraises_plugin_errors() -> None:
    with pytest.raises(ImportError, match="libfixture.so"):
        kpt.Registry([_ep("broken-import", "broken_import")], strict=True)


def test_strict_mode_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KPT_STRICT_PLUGINS", "1")
    with pytest.raises(kpt.BackendError, match="contract v0"):
        kpt.Registry([_ep("fixture", "backends")])


def test_plugin_backend_runs_kernels_in_its_own_namespace(registry: kpt.Registry) -> None:
    be = registry.get("fixture-fast")
    x = torch.randn(3, 5, requires_grad=True)
    y = be.rms_norm(x)
    y.sum().backward()
    assert y.grad_fn is not None and x.grad is not None
    assert hasattr(torch.ops.kpt_fixture_fast, "rms_norm")


def test_incomplete_backend_is_refused_at_register_ops_and_runs_only_what_it_has() -> None:
    from kpt_fixture_plugins.backends import Incomplete

    be = Incomplete()
    with pytest.raises(kpt.BackendError, match=r"missing kernels: rms_norm \(forward, backward\)"):
        be.register_ops()
    with pytest.raises(kpt.BackendError, match=r"missing kernel 'rms_norm' \(forward\)"):
        be.rms_norm(torch.randn(2, 2))
    x = torch.randn(2, 3)
    torch.testing.assert_close(be.silu(x), x * torch.sigmoid(x))


def test_missing_backward_alone_is_named_as_such() -> None:
    from kpt.reference import ReferenceBackend

    kernels = ReferenceBackend().kernels()
    kernels["silu"] = kpt.Kernel(kernels["silu"].forward)
    del kernels["quantize_fp8"]
    missing = kpt.missing_kernels(kernels)
    assert missing == {"silu": ("backward",), "quantize_fp8": ("forward",)}
    assert kpt.describe_missing(missing) == "silu (backward), quantize_fp8 (forward)"


def _module(name: str, **functions) -> types.ModuleType:
    module = types.ModuleType(name)
    vars(module).update(functions)
    return module


def test_kernels_from_collects_fwd_and_bwd_last_module_wins() -> None:
    first = _module("first", silu_fwd=abs, silu_bwd=max, gelu_fwd=min)
    second = _module("second", silu_fwd=round)
    found = kpt.kernels_from(first, second)
    assert found == {"silu": kpt.Kernel(round, None), "gelu": kpt.Kernel(min, None)}


def test_the_reference_bodies_are_named_as_every_backend_names_its_bodies() -> None:
    """The spec's reference math is its family module's ``<kernel>_fwd`` / ``<kernel>_bwd``: what
    `kpt.kernels_from` collects from a backend's modules."""
    found = kpt.kernels_from(*kpt.kernels.FAMILIES)
    assert found == {name: kpt.Kernel(spec.forward, spec.backward) for name, spec in kpt.SPECS.items()}


@pytest.mark.parametrize("functions, message", [
    ({"silu_forward": abs}, "silu_forward look like kernel bodies; kpt.kernels_from finds them only as silu_fwd"),
    ({"silu_fwd": abs, "silu_backward": abs}, "silu_backward .* only as silu_bwd"),
    ({"silu_bwd": abs}, "silu_bwd has no silu_fwd beside it"),
])
def test_kernels_from_refuses_misnamed_bodies(functions: dict, message: str) -> None:
    with pytest.raises(kpt.BackendError, match=message):
        kpt.kernels_from(_module("vendor_kernels", **functions))


def test_global_get_backend_is_reference_on_a_cpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KPT_BACKEND", raising=False)
    if any(i.available and not i.simulator and i.name != "reference" for i in kpt.list_backends()):
        pytest.skip("another backend is installed and available here")
    assert kpt.get_backend().name == "reference"


def test_unsupported_combination_raises_not_supported() -> None:
    from kpt.reference import ReferenceBackend

    class NoWeight(ReferenceBackend):
        name = "fixture-no-weight"

        def unsupported(self, kernel, args):
            return "weight is not supported" if kernel == "rms_norm" and args["weight"] is not None else None

    with pytest.raises(kpt.KernelNotSupportedError, match="backend 'fixture-no-weight'"):
        NoWeight().rms_norm(torch.randn(2, 4), torch.ones(4))


def test_first_call_of_a_backend_can_be_inside_fullgraph_compile(registry: kpt.Registry) -> None:
    be = registry.get("fixture-fast")  # get() registers the ops: the compiled call only traces them
    x, w = torch.randn(4, 8), torch.randn(8)
    compiled = torch.compile(lambda x, w: be.rms_norm(x, w) + 1, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, w), be.rms_norm(x, w) + 1)


def test_an_exception_inside_a_kernel_is_a_backend_error_naming_backend_and_kernel() -> None:
    from kpt.reference import ReferenceBackend

    class Faulty(ReferenceBackend):
        name = "fixture-faulty-kernel"

        def kernels(self):
            def forward(*args):
                raise IndexError("index 7 is out of bounds")

            def backward(*args):
                raise ZeroDivisionError("division by zero")

            bodies = super().kernels()
            return {**bodies, "silu": kpt.Kernel(forward, bodies["silu"].backward),
                    "gelu": kpt.Kernel(bodies["gelu"].forward, backward)}

    be = Faulty()
    message = r"'fixture-faulty-kernel' failed in silu \(forward\): IndexError"
    with pytest.raises(kpt.BackendError, match=message) as info:
        be.silu(torch.randn(3))
    assert isinstance(info.value.__cause__, IndexError)
    y = be.gelu(torch.randn(3, requires_grad=True))
    with pytest.raises(kpt.BackendError, match=r"failed in gelu \(backward\): ZeroDivisionError"):
        y.sum().backward()
    # the contract's own errors pass through unchanged, and other kernels keep working
    with pytest.raises(kpt.KernelInputError):
        be.silu(torch.ones(3, dtype=torch.int64))
    torch.testing.assert_close(be.softmax(torch.zeros(4)), torch.full((4,), 0.25))
