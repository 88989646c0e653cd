"""Plugins that cannot be turned against the user: throwaway distributions (a dist-info with an
``entry_points.txt`` on a temporary ``sys.path``) that shadow kpt's names, collide, exit, hang or
rewrite the contract, and what the registry makes of each."""

from __future__ import annotations

import signal
import sys
import textwrap
import threading
import types
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import torch

import kpt
from kpt.registry import ENTRY_POINT_GROUP

X = torch.randn(3, 5)


class Site:
    """A directory on ``sys.path`` where a test installs distributions of ``kpt.backends`` plugins."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.modules: list[str] = []

    def install(self, dist: str, plugins: dict[str, str], modules: dict[str, str]) -> None:
        """``dist`` declaring ``plugins`` (entry-point name: module) and shipping ``modules`` (name: source)."""
        info = self.path / f"{dist.replace('-', '_')}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(
            f"[{ENTRY_POINT_GROUP}]\n" + "".join(f"{name} = {module}\n" for name, module in plugins.items()))
        for module, source in modules.items():
            (self.path / f"{module}.py").write_text(textwrap.dedent(source))
            self.modules.append(module)

    def entry_points(self) -> list[metadata.EntryPoint]:
        return [ep for d in metadata.distributions(path=[str(self.path)])
                for ep in d.entry_points if ep.group == ENTRY_POINT_GROUP]

    def registry(self, strict: bool = False) -> kpt.Registry:
        return kpt.Registry(self.entry_points(), strict=strict)


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Site]:
    monkeypatch.delenv("KPT_BACKEND", raising=False)
    monkeypatch.delenv("KPT_STRICT_PLUGINS", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    s = Site(tmp_path)
    yield s
    for module in s.modules:
        sys.modules.pop(module, None)


def backend(name: str, vendor: str = "acme") -> str:
    """The source of a plugin module providing one reference-based backend called ``name``."""
    return textwrap.dedent(f"""
        import kpt
        from kpt.reference import ReferenceBackend

        class Plugged(ReferenceBackend):
            name = {name!r}
            vendor = {vendor!r}
            priority = 10

        @kpt.hookimpl
        def kpt_backends():
            return [Plugged()]
    """)


def test_an_entry_point_named_like_a_built_in_leaves_it_working(site: Site) -> None:
    site.install("evil", {"reference": "evil_reference", "fpga-sim": "evil_fpga_sim", "fpga": "evil_fpga"},
                 {"evil_reference": "", "evil_fpga_sim": "", "evil_fpga": backend("fpga-sim")})
    registry = site.registry()
    assert registry.get("reference").name == "reference"
    infos = {i.name: i for i in registry.list()}
    assert infos["reference"].available and infos["reference"].plugin == "reference"
    assert "'reference' is kpt's, provided by kpt-core; evil may not use it" in infos["evil:reference"].reason
    assert "provided by kpt-fpga-sim" in infos["evil:fpga-sim"].reason
    # a plugin of another name may not provide a built-in's name either
    assert "'fpga-sim' is kpt's, provided by kpt-fpga-sim" in infos["fpga:fpga-sim"].reason
    assert "fpga-sim" not in registry.backends
    assert "evil_reference" not in sys.modules and "evil_fpga_sim" not in sys.modules  # refused unimported


def test_names_that_differ_in_punctuation_cannot_both_register(site: Site) -> None:
    site.install("acme-a", {"acme-npu": "acme_a"}, {"acme_a": backend("acme-npu", "a")})
    site.install("acme-b", {"acme_npu": "acme_b"}, {"acme_b": backend("acme_npu", "b")})
    site.install("acme-c", {"acme": "acme_c"}, {"acme_c": backend("acme_x", "c")})
    registry = site.registry()
    assert registry.get("acme-npu").vendor == "a"
    infos = {i.name: i for i in registry.list()}
    assert "is not named as a backend" in infos["acme_npu"].reason
    assert "backend name 'acme_x' is not valid" in infos["acme:acme_x"].reason
    assert sorted(registry.backends) == ["acme-npu", "reference"]
    assert "acme_b" not in sys.modules


def test_a_backend_constructed_with_an_invalid_name_cannot_run() -> None:
    from kpt.reference import ReferenceBackend

    class Underscored(ReferenceBackend):
        name = "fixture_underscored"

    with pytest.raises(kpt.BackendError, match="backend name 'fixture_underscored' is not valid"):
        Underscored().silu(X)


def test_a_duplicate_is_refused_naming_both_distributions(site: Site) -> None:
    site.install("acme-a", {"acme": "dup_a"}, {"dup_a": backend("acme-npu", "a")})
    site.install("acme-b", {"acme-npu": "dup_b"}, {"dup_b": backend("acme-npu", "b")})
    site.install("zeta-c", {"zeta": "dup_c"}, {"dup_c": backend("zeta")})
    site.install("zeta-d", {"zeta": "dup_d"}, {"dup_d": backend("zeta")})
    registry = site.registry()
    assert registry.get("acme-npu").vendor == "a"  # the plugin of the shorter name, whatever the order
    reason = {i.name: i for i in registry.list()}["acme-b:acme-npu"].reason
    assert "acme-b (plugin 'acme-npu') provides 'acme-npu', which acme-a (plugin 'acme') already provides" in reason
    with pytest.raises(kpt.BackendError, match="the plugin 'zeta' is declared by zeta-c and zeta-d"):
        registry.get("zeta")
    assert "dup_c" not in sys.modules and "dup_d" not in sys.modules


@pytest.mark.parametrize("body, error", [
    ("import sys\nsys.exit(3)", "SystemExit: 3"),
    ("raise KeyboardInterrupt", "KeyboardInterrupt"),
    ("class Odd(BaseException):\n    pass\nraise Odd('odd')", "Odd: odd"),
], ids=["exit", "interrupt", "base-exception"])
def test_a_plugin_ending_its_import_any_way_is_recorded(site: Site, body: str, error: str) -> None:
    site.install("rude", {"rude": "rude_plugin"}, {"rude_plugin": body})
    try:
        registry = site.registry()
        infos = {i.name: i for i in registry.list()}
    except BaseException as exc:  # noqa: BLE001 - what the registry let through is the failure
        pytest.fail(f"the plugin's {type(exc).__name__} escaped the registry")
    assert infos["rude"].reason == "plugin failed to load" and error in infos["rude"].error
    assert registry.get("reference").name == "reference"


def test_a_real_ctrl_c_during_a_plugin_import_is_the_users(site: Site) -> None:
    # Python's own Ctrl-C handler, whatever this process inherited (a shell's background job ignores SIGINT)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _a_real_ctrl_c_is_the_users(site)
    finally:
        signal.signal(signal.SIGINT, previous)


def _a_real_ctrl_c_is_the_users(site: Site) -> None:
    site.install("slow", {"slow": "slow_plugin"}, {"slow_plugin": """
        import os, signal, time
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    """})
    with pytest.raises(KeyboardInterrupt):
        site.registry().list()


def test_strict_mode_imports_every_plugin_at_once_and_reraises(site: Site) -> None:
    site.install("rude", {"rude": "strict_plugin"}, {"strict_plugin": "raise ImportError('no libacme')"})
    with pytest.raises(ImportError, match="no libacme"):
        site.registry(strict=True)


def test_reference_imports_no_plugin(site: Site) -> None:
    site.install("acme", {"acme": "acme_lazy"}, {"acme_lazy": backend("acme")})
    registry = site.registry()
    assert registry.get("reference").name == "reference"
    assert "acme_lazy" not in sys.modules
    assert registry.get("acme").name == "acme" and "acme_lazy" in sys.modules  # asked for: imported


def _within(seconds: float, call: Callable[[], Any]) -> Any:
    """What ``call()`` returns if it returns within ``seconds`` (run in a thread), else None."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    thread.join(seconds)
    return result[0] if result else None


def test_a_hanging_plugin_import_does_not_block_reference(site: Site, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = types.SimpleNamespace(started=threading.Event(), release=threading.Event())
    monkeypatch.setitem(sys.modules, "kpt_test_gate", gate)
    hang = "import kpt_test_gate\nkpt_test_gate.started.set()\nkpt_test_gate.release.wait(60)\n"
    site.install("hang", {"hang": "hang_plugin"}, {"hang_plugin": hang + backend("hang")})
    try:
        registry = _within(10, site.registry)
        assert registry is not None, "making the registry waited for the hanging plugin"
        hanging = threading.Thread(target=registry.get, args=("hang",), daemon=True)
        hanging.start()
        assert gate.started.wait(10)
        assert _within(10, lambda: registry.get("reference").name) == "reference"
    finally:
        gate.release.set()
    hanging.join(10)
    assert registry.get("hang").name == "hang"


def test_a_plugin_that_changes_the_contract_is_refused_and_the_contract_put_back(site: Site) -> None:
    from kpt.kernels import activations

    site.install("meddle", {"meddle": "meddle_plugin", "meddle-code": "meddle_code"}, {
        "meddle_plugin": "import kpt\nkpt.SPECS['silu'] = kpt.SPECS['gelu']\n" + backend("meddle"),
        "meddle_code": ("from kpt.kernels import activations\n"
                        "activations._silu.__code__ = (lambda x: x * 0).__code__\n" + backend("meddle-code")),
    })
    specs, code = dict(kpt.SPECS), activations._silu.__code__
    try:
        registry = site.registry()
        infos = {i.name: i for i in registry.list()}
        assert "changed kpt's kernel contract (kpt.SPECS)" in infos["meddle"].reason
        assert "the code of kpt.kernels.activations._silu" in infos["meddle-code"].reason
        assert "meddle" not in registry.backends and "meddle-code" not in registry.backends
        assert kpt.SPECS == specs and activations._silu.__code__ is code
        torch.testing.assert_close(registry.get("reference").silu(X), X * torch.sigmoid(X))
    finally:  # whatever the registry did, the next tests get the contract as it was
        kpt.SPECS.clear()
        kpt.SPECS.update(specs)
        activations._silu.__code__ = code


def test_concurrent_first_calls_make_one_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[kpt.Registry] = []
    start = threading.Barrier(8)

    class Slow(kpt.Registry):
        def __init__(self) -> None:
            threading.Event().wait(0.05)  # long enough for every thread to find no registry yet
            super().__init__([])
            made.append(self)

    monkeypatch.setattr(kpt.registry, "_registry", None)
    monkeypatch.setattr(kpt.registry, "Registry", Slow)
    got: list[kpt.Registry] = []

    def first_call() -> None:
        start.wait()
        got.append(kpt.registry.registry())

    threads = [threading.Thread(target=first_call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and all(r is made[0] for r in got)


@pytest.mark.parametrize("name, packages", [
    ("cuda", "packages/kpt-core packages/kpt-triton packages/kpt-cuda"),
    ("rocm", "packages/kpt-core packages/kpt-triton packages/kpt-rocm"),
    ("xpu", "packages/kpt-core packages/kpt-triton packages/kpt-xpu"),
    ("mps", "packages/kpt-core packages/kpt-mps"),
    ("fpga-sim", "packages/kpt-core packages/kpt-fpga-sim"),
])
def test_an_uninstalled_built_in_backend_says_what_to_install(name: str, packages: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KPT_BACKEND", raising=False)
    package = packages.split("/")[-1]
    with pytest.raises(kpt.BackendError, match=rf"unknown kpt backend '{name}'; it comes with the {package} "
                                               rf"package, which is not installed: pip install {package} "
                                               rf"\(from a checkout of kpt: pip install {packages}\)"):
        kpt.Registry([]).get(name)
