"""Backend discovery and selection: entry points, isolation of broken plugins, `get_backend`.

A plugin is an entry point of the ``kpt.backends`` group. Its name says which backends it may
provide, so that kpt knows where a backend comes from without importing anything: the plugin
``acme`` provides ``acme`` and names under it (``acme-npu``), nothing else. A plugin is imported
only when one of its names is asked for, or when every backend is (`list_backends`, or
`get_backend` choosing one): ``get_backend("reference")`` imports no plugin.

kpt's own backends cannot be shadowed or knocked out: their names (`BUILT_IN`, and the names
under them) belong to their own distributions, and an entry point or a backend of such a name
from any other distribution is refused, unimported. Names are checked (`kpt.backend.NAME`: one
spelling, one op namespace); a backend name two plugins provide is refused for the later one,
with both distributions named; an entry-point name two distributions declare is refused for both.

Every plugin is loaded on its own. A plugin that fails to import (any exception: ``SystemExit``
and ``KeyboardInterrupt`` raised by the plugin itself included, though not a real Ctrl-C), whose
hook raises, whose backend targets another contract version, lacks kernels, or whose
``is_available`` raises is recorded with the reason and skipped; the others load. A plugin that
changes kpt's kernel contract while it loads (`kpt.SPECS`, the specs, the reference math) is
refused and the contract put back. Set ``KPT_STRICT_PLUGINS=1`` (or pass ``strict=True``) to
import every plugin at once and re-raise instead, which is what a vendor wants while developing
a plugin.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
import os
import re
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from importlib import metadata
from typing import Any, cast

import pluggy
import torch

from . import hookspecs, reference
from .backend import CONTRACT_VERSION, NAME, Backend, check_name, describe_missing, missing_kernels
from .errors import BackendError
from .kernels import SPECS

ENTRY_POINT_GROUP = "kpt.backends"

BUILT_IN: dict[str, tuple[str, ...]] = {
    "reference": ("kpt-core",),
    "cuda": ("kpt-core", "kpt-triton", "kpt-cuda"),
    "rocm": ("kpt-core", "kpt-triton", "kpt-rocm"),
    "xpu": ("kpt-core", "kpt-triton", "kpt-xpu"),
    "mps": ("kpt-core", "kpt-mps"),
    "fpga-sim": ("kpt-core", "kpt-fpga-sim"),
}
"""kpt's own backends, each with the packages it needs; the last one provides it and alone may
use its name and the names under it (``fpga-sim-…``)."""


def owner(name: str) -> str | None:
    """The distribution that alone may provide backend (or entry point) ``name``, if it is kpt's."""
    for builtin, packages in BUILT_IN.items():
        if name == builtin or name.startswith(builtin + "-"):
            return packages[-1]
    return None


def install_hint(name: str) -> str:
    """How to install kpt's backend ``name`` (empty for another name)."""
    packages = BUILT_IN.get(name)
    if packages is None or name == "reference":
        return ""
    return (f"; it comes with the {packages[-1]} package, which is not installed: pip install {packages[-1]} "
            f"(from a checkout of kpt: pip install {' '.join('packages/' + p for p in packages)})")


@dataclass(frozen=True)
class BackendInfo:
    """What `list_backends` reports for one discovered backend (or a plugin that failed)."""

    name: str
    vendor: str
    device_type: str
    priority: int
    simulator: bool
    available: bool
    reason: str
    """Why it is not available here, or why it was refused; empty when usable."""
    error: str | None
    """The exception of a plugin that failed to load, or of a refused backend."""
    plugin: str


class BackendList(list[BackendInfo]):
    """What `list_backends` returns: a list of `BackendInfo` that prints as a table."""

    def rows(self) -> list[tuple[str, ...]]:
        """The header, then one row of strings per backend (what `table` aligns)."""
        rows: list[tuple[str, ...]] = [("backend", "vendor", "device", "priority", "usable", "why not")]
        for i in self:
            usable = ("yes, when named (simulator)" if i.simulator else "yes") if i.available else "no"
            why = i.reason + (f" ({i.error})" if i.error else "")
            rows.append((i.name, i.vendor, i.device_type, str(i.priority), usable, why))
        return rows

    def table(self) -> str:
        """One row per backend: who makes it, its device, its priority, and whether it can be
        used here (a simulator only when named), else why not."""
        rows = self.rows()
        widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]) - 1)]
        return "\n".join("  ".join([*(v.ljust(w) for v, w in zip(row, widths)), row[-1]]).rstrip() for row in rows)

    def __repr__(self) -> str:
        return self.table()


@dataclass
class _Plugin:
    """One entry point, not imported until one of its names is needed."""

    name: str
    distribution: str
    load: Callable[[], Any]
    state: str = "pending"
    """"pending", "loading" (by the thread holding the registry's lock) or "done"."""

    def provides(self, backend: str) -> bool:
        return backend == self.name or backend.startswith(self.name + "-")


def _distribution(ep: metadata.EntryPoint) -> str:
    """The name of the distribution that declares ``ep``, normalized (``kpt_cuda`` is ``kpt-cuda``)."""
    dist = getattr(ep, "dist", None)
    return re.sub(r"[-_.]+", "-", dist.name).lower() if dist is not None else "an unnamed distribution"


class Registry:
    """The backends found through ``entry_points`` (default: the installed ``kpt.backends``).

    ``infos`` holds what has been loaded so far (`list` loads every plugin first)."""

    def __init__(self, entry_points: Iterable[metadata.EntryPoint] | None = None,
                 strict: bool | None = None) -> None:
        if entry_points is None:
            entry_points = metadata.entry_points(group=ENTRY_POINT_GROUP)
        if strict is None:
            strict = os.environ.get("KPT_STRICT_PLUGINS", "") not in ("", "0")
        self.strict = strict
        self.backends: dict[str, Backend] = {}
        self._seen: dict[str, Backend] = {}
        self.infos: dict[str, BackendInfo] = {}
        self._by_device: dict[str, Backend] = {}
        self._lock = threading.RLock()
        self._plugins = pluggy.PluginManager(hookspecs.PROJECT)
        self._plugins.add_hookspecs(hookspecs)
        self._pending: dict[str, _Plugin] = {}
        self._load_plugin(_Plugin("reference", "kpt-core", lambda: reference))
        declared: dict[str, list[_Plugin]] = {}
        for ep in entry_points:
            declared.setdefault(ep.name, []).append(_Plugin(ep.name, _distribution(ep), ep.load))
        for name, plugins in sorted(declared.items()):
            self._declare(name, plugins)
        if strict:
            self._load_all()

    def _declare(self, name: str, plugins: list[_Plugin]) -> None:
        """Keep the entry point ``name`` for loading on demand, or refuse it unimported."""
        dists = sorted({p.distribution for p in plugins})
        if not isinstance(name, str) or not NAME.fullmatch(name):
            return self._fail(name, name, f"refused: the entry point of {', '.join(dists)} is not named as a "
                                          "backend (lower-case letters and digits in words joined by hyphens)", None)
        reserved = owner(name)
        for plugin in plugins:
            if reserved is not None and plugin.distribution != reserved:
                self._fail(name, f"{plugin.distribution}:{name}",
                           f"refused: the name {name!r} is kpt's, provided by {reserved}; "
                           f"{plugin.distribution} may not use it", None)
        plugins = [p for p in plugins if reserved is None or p.distribution == reserved]
        if len(plugins) > 1:
            return self._fail(name, name, f"refused: the plugin {name!r} is declared by {' and '.join(dists)}; "
                                          "uninstall one of them", None)
        if plugins:
            self._pending[name] = plugins[0]

    def _fail(self, plugin: str, name: str, reason: str, exc: BaseException | None) -> None:
        if self.strict:
            if exc is not None:
                raise exc
            raise BackendError(f"{name}: {reason}")
        error = "".join(traceback.format_exception_only(type(exc), exc)).strip() if exc else None
        self.infos[name] = BackendInfo(name, "?", "?", 0, False, False, reason, error, plugin)

    # -- loading ---------------------------------------------------------------------------

    def _load(self, name: str) -> None:
        """Import the plugins that may provide backend ``name`` (shorter names first)."""
        self._load_where(lambda p: p.provides(name))

    def _load_all(self) -> None:
        self._load_where(lambda p: True)

    def _load_where(self, wanted: Callable[[_Plugin], bool]) -> None:
        if not any(p.state != "done" and wanted(p) for p in list(self._pending.values())):
            return  # nothing to import: no lock taken (a plugin hanging in its import blocks no one else)
        with self._lock:
            for plugin in sorted(self._pending.values(), key=lambda p: p.name):
                if plugin.state == "pending" and wanted(plugin):
                    plugin.state = "loading"  # a plugin asking for backends while it imports gets the others
                    try:
                        self._load_plugin(plugin)
                    finally:
                        plugin.state = "done"

    def _load_plugin(self, plugin: _Plugin) -> None:
        contract = _Contract()
        with _real_interrupts() as interrupted:
            try:
                module = plugin.load()
                self._plugins.register(module, name=plugin.name)
                impls = [i for i in self._plugins.hook.kpt_backends.get_hookimpls() if i.plugin_name == plugin.name]
                backends = [b for impl in impls for b in cast(Iterable[Any], impl.function())]  # checked below
                for backend in backends:
                    self._add_backend(plugin, backend)
            except BaseException as exc:  # a broken plugin must not take the registry (or the process) down
                if isinstance(exc, KeyboardInterrupt) and interrupted[0]:
                    raise
                contract.restore()
                self._drop(plugin.name)
                return self._fail(plugin.name, plugin.name, "plugin failed to load", exc)
        changed = contract.restore()
        if changed:
            self._drop(plugin.name)
            self._fail(plugin.name, plugin.name, f"refused: loading it changed kpt's kernel contract ({changed}); "
                                                 "kpt put the contract back", None)

    def _drop(self, plugin: str) -> None:
        """Forget the backends ``plugin`` added before it failed."""
        for name in [n for n, i in self.infos.items() if i.plugin == plugin]:
            self.backends.pop(name, None)
            self._seen.pop(name, None)
            del self.infos[name]

    def _add_backend(self, plugin: _Plugin, backend: Backend) -> None:
        if not isinstance(backend, Backend):
            return self._fail(plugin.name, plugin.name,
                              f"its hook returned {backend!r}, which is not a kpt.Backend", None)
        name = backend.name
        key = f"{plugin.name}:{name}"  # a refused name keeps the entry of the backend that holds it
        try:
            check_name(name)
        except BackendError as exc:
            return self._fail(plugin.name, key, f"refused: {exc}", None)
        reserved = owner(name)
        if not plugin.provides(name) or (reserved is not None and plugin.distribution != reserved):
            allowed = f"only backends named {plugin.name!r} or {plugin.name + '-…'!r}"
            why = f"{name!r} is kpt's, provided by {reserved}" if reserved and plugin.distribution != reserved else (
                f"the plugin {plugin.name!r} may provide {allowed}")
            return self._fail(plugin.name, key, f"refused: {why}", None)
        if name in self.infos:
            holder = self.infos[name].plugin
            held = self._pending[holder].distribution if holder in self._pending else "kpt-core"
            return self._fail(plugin.name, f"{plugin.distribution}:{name}",
                              f"refused: {plugin.distribution} (plugin {plugin.name!r}) provides {name!r}, which "
                              f"{held} (plugin {holder!r}) already provides; uninstall one of them", None)
        self._seen[name] = backend
        if backend.contract_version != CONTRACT_VERSION:
            return self._fail(plugin.name, name, (
                f"implements kernel contract v{backend.contract_version}, but this kpt-core "
                f"implements v{CONTRACT_VERSION}: install a matching version of one or the other"), None)
        try:
            missing = missing_kernels(backend.kernels())
            available, why = backend.is_available() if not missing else (False, "")
        except Exception as exc:
            return self._fail(plugin.name, name, "kernels() or is_available() raised", exc)
        if missing:
            return self._fail(plugin.name, name, f"refused: missing kernels: {describe_missing(missing)}", None)
        self.backends[name] = backend
        self.infos[name] = BackendInfo(
            name, backend.vendor, backend.device_type, backend.priority, backend.simulator,
            bool(available), "" if available else why, None, plugin.name)

    # -- queries ---------------------------------------------------------------------------

    def find(self, name: str) -> Backend | None:
        """The backend object of that name even if it was refused (for the conformance suite to
        report what it lacks), or None."""
        self._load(name)
        return self._seen.get(name)

    def list(self) -> BackendList:
        self._load_all()
        return BackendList(sorted(self.infos.values(), key=lambda i: (-i.priority, i.name)))

    def get(self, name: str | None = None) -> Backend:
        source = ""
        if name is None and os.environ.get("KPT_BACKEND"):
            name, source = os.environ["KPT_BACKEND"], " (named by the KPT_BACKEND environment variable)"
        if name is None:
            usable = [i for i in self.list() if i.available and not i.simulator and i.name in self.backends]
            return self._ready(self.backends[usable[0].name] if usable else self.backends["reference"])
        if name not in self.infos:  # once known, final: a name's plugins load shortest first
            self._load(name)
        if name not in self.infos:
            known = sorted({*self.infos, *self._pending})
            raise BackendError(f"unknown kpt backend {name!r}{source}{install_hint(name)}; "
                               f"registered: {', '.join(known)}")
        info = self.infos[name]
        if name not in self.backends:
            raise BackendError(f"kpt backend {name!r}{source} cannot be used: {info.reason}"
                               + (f" ({info.error})" if info.error else ""))
        if not info.available:
            raise BackendError(f"kpt backend {name!r}{source} is not available here: {info.reason}")
        return self._ready(self.backends[name])

    def for_device(self, device: torch.device) -> Backend:
        """The highest-priority usable backend (simulators excluded) whose tensors live on
        ``device``'s type; ``reference`` for CPU tensors when no other backend claims the CPU.
        Remembered per device type (the layers of a model ask at every call)."""
        if device.type in self._by_device:
            return self._by_device[device.type]
        for i in self.list():
            backend = self.backends.get(i.name)
            if backend is not None and i.available and not i.simulator and backend.device().type == device.type:
                self._by_device[device.type] = self._ready(backend)
                return backend
        if device.type == "cpu":
            self._by_device["cpu"] = self._ready(self.backends["reference"])
            return self._by_device["cpu"]
        raise BackendError(f"no usable kpt backend for {device.type} tensors; installed: "
                           f"{', '.join(sorted(self.infos))} (kpt info says why each can or cannot run here)")

    @staticmethod
    def _ready(backend: Backend) -> Backend:
        """``backend``, its custom ops registered (`Backend.register_ops`): ready to run, and to
        be traced by ``torch.compile``."""
        backend.register_ops()
        return backend


@contextlib.contextmanager
def _real_interrupts() -> Iterator[list[bool]]:
    """Notes a real Ctrl-C (SIGINT) inside the block: the KeyboardInterrupt it raises is the
    user's and passes through, where one the plugin raises itself is recorded against it.

    Signals reach the main thread only, so elsewhere every KeyboardInterrupt is the plugin's;
    so it is where SIGINT has no Python handler (ignored, or the default that kills the process).
    """
    noted = [False]
    previous = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    if not callable(previous):
        yield noted
        return
    handler = cast(Callable[[int, Any], Any], previous)

    def note(signum: int, frame: Any) -> None:
        noted[0] = True
        handler(signum, frame)

    signal.signal(signal.SIGINT, note)
    try:
        yield noted
    finally:
        if signal.getsignal(signal.SIGINT) is note:  # a plugin that installed its own keeps it
            signal.signal(signal.SIGINT, previous)


class _Contract:
    """What the kernel contract is made of, taken before a plugin loads: `kpt.SPECS`, each spec's
    fields, the code of their functions, and the globals (and kpt classes) of the modules that
    define them. `restore` puts back whatever changed and says what it was."""

    def __init__(self) -> None:
        self.specs = dict(SPECS)
        self.fields = {name: {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
                       for name, spec in SPECS.items()}
        modules = {sys.modules[fn.__module__] for fields in self.fields.values() for fn in fields.values()
                   if inspect.isfunction(fn) and fn.__module__.startswith("kpt.")}
        self.namespaces: dict[str, tuple[Any, dict[str, Any]]] = {}
        for module in modules:
            self._take(module.__name__, module)
            for value in vars(module).values():
                if isinstance(value, type) and value.__module__.startswith("kpt."):
                    self._take(f"{value.__module__}.{value.__qualname__}", value)
        functions = [v for _, names in self.namespaces.values() for v in names.values() if inspect.isfunction(v)]
        functions += [v for fields in self.fields.values() for v in fields.values() if inspect.isfunction(v)]
        self.code = {id(fn): (fn, fn.__code__, fn.__defaults__, fn.__kwdefaults__) for fn in functions}

    def _take(self, label: str, namespace: Any) -> None:
        self.namespaces[label] = (namespace, {k: v for k, v in vars(namespace).items() if not k.startswith("__")})

    def restore(self) -> str:
        """Put back what changed since the snapshot; what that was, in words ("" if nothing)."""
        changed = []
        if [(k, id(v)) for k, v in SPECS.items()] != [(k, id(v)) for k, v in self.specs.items()]:
            changed.append("kpt.SPECS")
            SPECS.clear()
            SPECS.update(self.specs)
        for name, fields in self.fields.items():
            spec = self.specs[name]
            for field, value in fields.items():
                if getattr(spec, field) is not value:
                    changed.append(f"the spec of {name} ({field})")
                    object.__setattr__(spec, field, value)
        for label, (namespace, names) in self.namespaces.items():
            now = {k: v for k, v in vars(namespace).items() if not k.startswith("__")}
            for key in now.keys() - names.keys():
                changed.append(f"{label}.{key}")
                delattr(namespace, key)
            for key, value in names.items():
                if now.get(key, _ABSENT) is not value:
                    changed.append(f"{label}.{key}")
                    setattr(namespace, key, value)
        for fn, code, defaults, kwdefaults in self.code.values():
            if fn.__code__ is not code or fn.__defaults__ is not defaults or fn.__kwdefaults__ is not kwdefaults:
                changed.append(f"the code of {fn.__module__}.{fn.__qualname__}")
                fn.__code__, fn.__defaults__, fn.__kwdefaults__ = code, defaults, kwdefaults
        return ", ".join(sorted(set(changed)))


_ABSENT = object()

_registry: Registry | None = None
_registry_lock = threading.Lock()


def registry() -> Registry:
    """The process's registry, made on first use (once, whichever threads ask at once)."""
    global _registry
    if _registry is None:
        with _registry_lock:
            if _registry is None:
                _registry = Registry()
    return _registry


def reload_backends(strict: bool | None = None) -> Registry:
    """Discover the installed backends again (after installing a plugin in a running process)."""
    global _registry
    with _registry_lock:
        _registry = Registry(strict=strict)
    return _registry


_pinned: contextvars.ContextVar[Backend | None] = contextvars.ContextVar("kpt_pinned_backend", default=None)


def get_backend(name: str | None = None) -> Backend:
    """The backend to run kernels on.

    ``name`` if given, else the one `use_backend` pins, else the ``KPT_BACKEND`` environment
    variable, else the highest-priority backend available on this machine (simulators excluded),
    else ``reference``. Only the plugins that may provide a named backend are imported.
    Raises `kpt.BackendError` for an unknown name (listing the registered ones, and for one of
    kpt's own backends the package to install) or a backend that cannot run here (saying why).
    """
    pinned = _pinned.get()
    return pinned if name is None and pinned is not None else registry().get(name)


def backend_for(device: torch.device | str) -> Backend:
    """The backend for tensors on ``device`` (what the `kpt.nn` layers call): the one
    `use_backend` pins, else ``KPT_BACKEND``, else the highest-priority usable backend of that
    device type (a model on ``cuda`` gets the cuda backend, the same model on the CPU the
    reference backend). Raises `kpt.BackendError` when no installed backend runs there."""
    pinned = _pinned.get()
    if pinned is not None:
        return pinned
    if os.environ.get("KPT_BACKEND"):
        return registry().get()
    return registry().for_device(torch.device(device))


@contextlib.contextmanager
def use_backend(backend: str | Backend) -> Iterator[Backend]:
    """``with kpt.use_backend("fpga-sim"):`` pins one backend (by name, or a backend object such
    as a configured simulator) for `get_backend` and every `kpt.nn` layer inside the block (this
    thread or task only); yields it. A name is checked on entry (`kpt.BackendError` for an
    unknown or unusable backend)."""
    if isinstance(backend, str):
        backend = registry().get(backend)
    else:
        backend.register_ops()
    token = _pinned.set(backend)
    try:
        yield backend
    finally:
        _pinned.reset(token)


def list_backends() -> BackendList:
    """Every discovered backend, usable or not, highest priority first, with the reasons; it
    prints as a table."""
    return registry().list()
