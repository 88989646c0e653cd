"""A Metal execution emulator: kpt-mps's shaders run on CPU tensors, with Metal's semantics.

A ``.metal`` source is compiled by the system C++ compiler (``$CXX``, else ``c++``, ``g++`` or
``clang++``) as C++17 against ``include/kpt_metal_shim.h``, which stands in for ``<metal_stdlib>``,
into a shared library cached by the hash of its source (``$KPT_MPS_CACHE``, else
``~/.cache/kpt-mps``: a directory of this user that no one else may write, see `kpt.cache`; a cached
library is loaded only if its bytes have the digest recorded when it was built). Two things are
rewritten on the way, nothing else:

* ``threadgroup T name[N];`` declarations become tracked arrays and ``threadgroup T*`` pointers
  tracked pointers (the race check);
* each ``kernel void name(...)`` gets a launcher that passes buffer ``i`` to its ``[[buffer(i)]]``
  argument and each built-in (``[[thread_position_in_grid]]``...) to its argument.

`Library.dispatch` runs a 1-D dispatch: every thread of a threadgroup is a fiber, barriers and
simdgroup functions suspend it until its group (or simdgroup) arrives, and the threadgroup-memory
race check reports the first conflict. The subset of Metal the shim accepts is listed in the
package README; anything outside it fails the build (`BuildError`), never silently.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from importlib import resources
from pathlib import Path

import torch

from kpt import cache

INCLUDE = Path(str(resources.files(__package__).joinpath("include")))
FLAGS = ("-std=c++17", "-O2", "-shared", "-fPIC", "-U_FORTIFY_SOURCE", "-D_FORTIFY_SOURCE=0",
         "-fno-strict-aliasing", "-Werror=attributes", "-Wno-unused-variable")
"""``-U_FORTIFY_SOURCE``: the fibers switch stacks with ``_longjmp``, which fortified glibc refuses."""

BUILTINS = ("thread_position_in_grid", "thread_position_in_threadgroup", "threadgroup_position_in_grid",
            "threads_per_threadgroup", "threadgroups_per_grid", "thread_index_in_simdgroup",
            "simdgroup_index_in_threadgroup", "simdgroups_per_threadgroup", "threads_per_simdgroup",
            "threads_per_grid")


class BuildError(RuntimeError):
    """A shader outside the emulator's Metal subset, or one the compiler rejects."""


class DispatchError(RuntimeError):
    """A dispatch the emulator stopped: a threadgroup-memory race, an out-of-bounds or uninitialized
    threadgroup read, a barrier or simdgroup function not reached by every thread."""


_KERNEL = re.compile(r"\bkernel\s+void\s+(\w+)\s*\(")
_PARAM = re.compile(r"^(?P<type>.+?)\s*(?P<name>\w+)\s*\[\[\s*(?P<attr>\w+)(?:\((?P<index>\d+)\))?\s*\]\]$", re.S)
_TG_DECL = re.compile(r"\bthreadgroup\s+(\w+)\s+(\w+)\s*\[([^\]]+)\]\s*;")
_TG_POINTER = re.compile(r"\bthreadgroup\s+(\w+)\s*\*")


def compiler() -> str | None:
    """The C++ compiler the emulator uses, or None when there is none."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _parameters(text: str, start: int) -> list[str]:
    """The comma-separated parameters from ``start`` (just after an opening parenthesis) to its match."""
    depth, params, begin = 0, [], start
    for i in range(start, len(text)):
        c = text[i]
        if c in "([":
            depth += 1
        elif c in ")]" and depth:
            depth -= 1
        elif c == ")" or (c == "," and not depth):
            params.append(text[begin:i].strip())
            begin = i + 1
            if c == ")":
                return [p for p in params if p]
    raise BuildError("a kernel's parameter list is not closed")


def translate(source: str, origin: str = "<metal>") -> tuple[str, list[str]]:
    """The C++ translation unit of ``source`` and its kernel names; `BuildError` outside the subset."""
    # comments out (keeping line numbers): "threadgroup" in prose is no declaration
    body = re.sub(r"//[^\n]*|/\*.*?\*/", lambda m: "\n" * m[0].count("\n"), source, flags=re.S)
    body = _TG_DECL.sub(lambda m: f"KPT_THREADGROUP({m[1]}, {m[2]}, {m[3]});", body)
    body = _TG_POINTER.sub(lambda m: f"::mtl::emu::tg_ptr<{m[1]}> ", body)
    stray = re.search(r"\bthreadgroup\b(?!_)", body)
    if stray:
        line = body[: stray.start()].count("\n") + 1
        raise BuildError(f"{origin}:{line}: threadgroup memory outside the subset: only `threadgroup T name[N];` "
                         "declarations (1-D arrays at kernel scope) and `threadgroup T*` pointers are supported")
    kernels, launchers = [], []
    for match in _KERNEL.finditer(body):
        name, params = match[1], _parameters(body, match.end())
        args = []
        for p in params:
            m = _PARAM.match(p)
            if m is None:
                raise BuildError(f"{origin}: kernel {name}: argument {p!r} has no [[buffer(i)]] or built-in attribute")
            if m["attr"] == "buffer":
                if "*" not in m["type"]:
                    raise BuildError(f"{origin}: kernel {name}: buffer argument {m['name']!r} must be a pointer")
                args.append(f"({m['type']})b[{int(m['index'])}]")
            elif m["attr"] in BUILTINS:
                if m["type"].strip() != "uint":
                    raise BuildError(f"{origin}: kernel {name}: built-in {m['attr']} must be a scalar uint "
                                     "(the emulator runs 1-D dispatches)")
                args.append(f"t.v[{BUILTINS.index(m['attr'])}]")
            else:
                raise BuildError(f"{origin}: kernel {name}: attribute [[{m['attr']}]] is outside the subset")
        kernels.append(name)
        launchers.append(f"static void kpt_launch_{name}(void* const* b, const ::mtl::emu::Builtins& t) "
                         f"{{ {name}({', '.join(args)}); }}")
    if not kernels:
        raise BuildError(f"{origin}: no kernel functions")
    lookup = "".join(f'  if (!std::strcmp(n, "{k}")) return kpt_launch_{k};\n' for k in kernels)
    glue = "\n".join([
        "", "// ---- launchers generated by kpt_mps.emulator ----", *launchers,
        'extern "C" ::mtl::emu::Launch kpt_emu_find(const char* n) {', lookup + "  return nullptr;", "}",
        'extern "C" int kpt_emu_dispatch(::mtl::emu::Launch f, void* const* b, unsigned groups, unsigned size,'
        " char* err, int len) { return ::mtl::emu::dispatch(f, b, groups, size, err, len); }", "",
    ])
    return f'#line 1 "{origin}"\n' + body + glue, kernels


BUILD_TIMEOUT_S = 600
"""How long one shader may take to compile before the build is given up."""


def cache_dir() -> Path:
    """Where compiled shaders are kept (`kpt.cache.user_dir`); `PermissionError` for a
    ``$KPT_MPS_CACHE`` that others could write to."""
    return cache.user_dir("KPT_MPS_CACHE", "kpt-mps")


def build(source: str, origin: str = "<metal>") -> Path:
    """The shared library of ``source`` (compiled once per source, shim and flags): the cached
    one if `kpt.cache.verified`, else built anew (replacing a file that only has its name)."""
    unit, _ = translate(source, origin)
    cxx = compiler()
    if cxx is None:
        raise BuildError("the Metal emulator needs a C++17 compiler (set CXX, or install g++ or clang++)")
    shim = (INCLUDE / "kpt_metal_shim.h").read_text()
    key = hashlib.sha256("\0".join([unit, shim, cxx, *FLAGS]).encode()).hexdigest()[:20]
    target = cache_dir() / f"{Path(origin).stem}-{key}.so"
    if cache.verified(target):
        return target
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / "unit.cpp"
        src.write_text(unit)
        out = Path(tmp) / target.name
        command = [cxx, *FLAGS, "-I", str(INCLUDE), "-include", "kpt_metal_shim.h", str(src), "-o", str(out)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise BuildError(f"{origin}: {cxx} took more than {BUILD_TIMEOUT_S} s; build given up") from None
        if done.returncode:
            raise BuildError(f"{origin} does not compile in the Metal emulator (outside the supported subset?):\n"
                             + done.stderr[-6000:])
        cache.store(out, target)  # atomic: concurrent builders agree on the result
    return target


_RUNNING = threading.Lock()


class Library:
    """A compiled ``.metal`` source; ``dispatch`` runs one of its kernels on CPU tensors."""

    def __init__(self, source: str, origin: str = "<metal>") -> None:
        self.origin = origin
        self._lib = ctypes.CDLL(str(build(source, origin)))
        self._lib.kpt_emu_find.restype = ctypes.c_void_p
        self._lib.kpt_emu_find.argtypes = (ctypes.c_char_p,)
        self._lib.kpt_emu_dispatch.restype = ctypes.c_int
        self._lib.kpt_emu_dispatch.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint,
                                               ctypes.c_char_p, ctypes.c_int)

    def dispatch(self, kernel: str, buffers: list[torch.Tensor], threads: int, group_size: int) -> None:
        """Run ``kernel`` over ``threads`` threads in threadgroups of ``group_size`` (``threads``
        a multiple of it); buffer ``i`` is ``buffers[i]`` (contiguous CPU tensors)."""
        fn = self._lib.kpt_emu_find(kernel.encode())
        if not fn:
            raise BuildError(f"{self.origin} has no kernel {kernel!r}")
        if threads % group_size:
            raise DispatchError(f"{kernel}: {threads} threads are not whole threadgroups of {group_size}")
        for i, t in enumerate(buffers):
            if t.device.type != "cpu" or not t.is_contiguous():
                raise DispatchError(f"{kernel}: buffer {i} must be a contiguous CPU tensor")
        pointers = (ctypes.c_void_p * max(len(buffers), 1))(*(t.data_ptr() for t in buffers))
        err = ctypes.create_string_buffer(2048)
        with _RUNNING:  # one dispatch at a time: the fibers and their scheduler are process-wide
            failed = threads and self._lib.kpt_emu_dispatch(fn, pointers, threads // group_size, group_size, err,
                                                            len(err))
        if failed:
            raise DispatchError(f"{self.origin}: {kernel}: {err.value.decode()}")
