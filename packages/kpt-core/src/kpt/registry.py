"""Backend discovery and selection: entry points, isolation of broken plugins, `get_backend`.

Every plugin is loaded on its own. A plugin that fails to import, whose hook raises, whose
backend targets another contract version, lacks kernels, or whose ``is_available`` raises is
recorded with the reason and skipped; the others load. Set ``KPT_STRICT_PLUGINS=1`` (or pass
``strict=True``) to re-raise instead, which is what a vendor wants while developing a plugin.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import traceback
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib import metadata
from typing import Any, cast

import pluggy
import torch

from . import hookspecs, reference
from .backend import CONTRACT_VERSION, Backend, describe_missing, missing_kernels
from .errors import BackendError

ENTRY_POINT_GROUP = "kpt.backends"


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


class Registry:
    """The backends found through ``entry_points`` (default: the installed ``kpt.backends``)."""

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
        self._plugins = pluggy.PluginManager(hookspecs.PROJECT)
        self._plugins.add_hookspecs(hookspecs)
        self._add_plugin("reference", lambda: reference)
        for ep in entry_points:
            self._add_plugin(ep.name, ep.load)

    def _fail(self, plugin: str, name: str, reason: str, exc: BaseException | None) -> None:
        if self.strict:
            if exc is not None:
                raise exc
            raise BackendError(f"{name}: {reason}")
        error = "".join(traceback.format_exception_only(type(exc), exc)).strip() if exc else None
        self.infos[name] = BackendInfo(name, "?", "?", 0, False, False, reason, error, plugin)

    def _add_plugin(self, plugin: str, load: Any) -> None:
        try:
            module = load()
            self._plugins.register(module, name=plugin)
            impls = [i for i in self._plugins.hook.kpt_backends.get_hookimpls() if i.plugin_name == plugin]
            backends = [b for impl in impls for b in cast(Iterable[Any], impl.function())]  # checked below
        except Exception as exc:  # a broken plugin must not take the registry down
            self._fail(plugin, plugin, "plugin failed to load", exc)
            return
        for backend in backends:
            self._add_backend(plugin, backend)

    def _add_backend(self, plugin: str, backend: Backend) -> None:
        if not isinstance(backend, Backend):
            return self._fail(plugin, plugin, f"its hook returned {backend!r}, which is not a kpt.Backend", None)
        name = backend.name
        if name in self.infos:
            # recorded under its own key: the backend that holds the name keeps its entry
            return self._fail(plugin, f"{plugin}:{name}",
                              f"refused: the name {name!r} is already registered by plugin {self.infos[name].plugin!r}",
                              None)
        self._seen[name] = backend
        if backend.contract_version != CONTRACT_VERSION:
            return self._fail(plugin, name, (
                f"implements kernel contract v{backend.contract_version}, but this kpt-core "
                f"implements v{CONTRACT_VERSION}: install a matching version of one or the other"), None)
        try:
            missing = missing_kernels(backend.kernels())
            available, why = backend.is_available() if not missing else (False, "")
        except Exception as exc:
            return self._fail(plugin, name, "kernels() or is_available() raised", exc)
        if missing:
            return self._fail(plugin, name, f"refused: missing kernels: {describe_missing(missing)}", None)
        self.backends[name] = backend
        self.infos[name] = BackendInfo(
            name, backend.vendor, backend.device_type, backend.priority, backend.simulator,
            bool(available), "" if available else why, None, plugin)

    def find(self, name: str) -> Backend | None:
        """The backend object of that name even if it was refused (for the conformance suite to
        report what it lacks), or None."""
        return self._seen.get(name)

    def list(self) -> BackendList:
        return BackendList(sorted(self.infos.values(), key=lambda i: (-i.priority, i.name)))

    def get(self, name: str | None = None) -> Backend:
        source = ""
        if name is None and os.environ.get("KPT_BACKEND"):
            name, source = os.environ["KPT_BACKEND"], " (named by the KPT_BACKEND environment variable)"
        if name is None:
            usable = [i for i in self.list() if i.available and not i.simulator and i.name in self.backends]
            return self._bound(self.backends[usable[0].name] if usable else self.backends["reference"])
        if name not in self.infos:
            raise BackendError(f"unknown kpt backend {name!r}{source}; registered: {', '.join(sorted(self.infos))}")
        info = self.infos[name]
        if name not in self.backends:
            raise BackendError(f"kpt backend {name!r}{source} cannot be used: {info.reason}"
                               + (f" ({info.error})" if info.error else ""))
        if not info.available:
            raise BackendError(f"kpt backend {name!r}{source} is not available here: {info.reason}")
        return self._bound(self.backends[name])

    def for_device(self, device: torch.device) -> Backend:
        """The highest-priority usable backend (simulators excluded) whose tensors live on
        ``device``'s type; ``reference`` for CPU tensors when no other backend claims the CPU.
        Remembered per device type (the layers of a model ask at every call)."""
        if device.type in self._by_device:
            return self._by_device[device.type]
        for i in self.list():
            backend = self.backends.get(i.name)
            if backend is not None and i.available and not i.simulator and backend.device().type == device.type:
                self._by_device[device.type] = self._bound(backend)
                return backend
        if device.type == "cpu":
            self._by_device["cpu"] = self._bound(self.backends["reference"])
            return self._by_device["cpu"]
        raise BackendError(f"no usable kpt backend for {device.type} tensors; installed: "
                           f"{', '.join(sorted(self.infos))} (kpt info says why each can or cannot run here)")

    @staticmethod
    def _bound(backend: Backend) -> Backend:
        backend.bind()
        return backend


_registry: Registry | None = None


def registry() -> Registry:
    global _registry
    if _registry is None:
        _registry = Registry()
    return _registry


def reload_backends(strict: bool | None = None) -> Registry:
    """Discover the installed backends again (after installing a plugin in a running process)."""
    global _registry
    _registry = Registry(strict=strict)
    return _registry


_pinned: contextvars.ContextVar[Backend | None] = contextvars.ContextVar("kpt_pinned_backend", default=None)


def get_backend(name: str | None = None) -> Backend:
    """The backend to run kernels on.

    ``name`` if given, else the one `use_backend` pins, else the ``KPT_BACKEND`` environment
    variable, else the highest-priority backend available on this machine (simulators excluded),
    else ``reference``.
    Raises `kpt.BackendError` for an unknown name (listing the registered ones) or a backend
    that cannot run here (saying why).
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
        backend.bind()
    token = _pinned.set(backend)
    try:
        yield backend
    finally:
        _pinned.reset(token)


def list_backends() -> BackendList:
    """Every discovered backend, usable or not, highest priority first, with the reasons; it
    prints as a table."""
    return registry().list()
