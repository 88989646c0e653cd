"""The emulator's cache of compiled shaders cannot be used to run someone else's code: a library
planted under the right name is never loaded, wherever it is planted, and a cache directory
others could write to is refused."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from kpt_mps import emulator
from kpt_mps.emulator import Library

from kpt import cache

SOURCE = """#include <metal_stdlib>
using namespace metal;
kernel void twice(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                  uint i [[thread_position_in_grid]]) { y[i] = 2.0f * x[i]; }
"""


def works(library: Library) -> bool:
    x, y = torch.arange(32, dtype=torch.float32), torch.zeros(32)
    library.dispatch("twice", [x, y], 32, 32)
    return torch.equal(y, 2 * x)


def library_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The file name the emulator gives SOURCE's library, which an attacker can compute as well."""
    monkeypatch.setenv("KPT_MPS_CACHE", str(tmp_path / "name-probe"))
    return emulator.build(SOURCE, "cached.metal").name


def plant(path: Path, marker: Path) -> None:
    """A shared library at ``path`` whose constructor creates ``marker`` when it is loaded."""
    c = path.with_suffix(".planted.cpp")
    c.write_text("#include <fcntl.h>\n#include <unistd.h>\n__attribute__((constructor)) static void planted() "
                 f'{{ close(open("{marker}", O_CREAT | O_WRONLY, 0600)); }}\n')
    subprocess.run([emulator.compiler(), "-shared", "-fPIC", str(c), "-o", str(path)], check=True, timeout=120)
    c.unlink()


@pytest.mark.parametrize("record", ["none", "stale"])
def test_a_planted_library_with_the_right_name_is_never_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              record: str) -> None:
    name, marker = library_name(tmp_path, monkeypatch), tmp_path / "planted-code-ran"
    hostile = tmp_path / "cache"
    hostile.mkdir(mode=0o700)
    plant(hostile / name, marker)
    if record == "stale":  # a digest recorded for another build: the bytes no longer match it
        (hostile / f"{name}.sha256").write_text("0" * 64 + "\n")
    monkeypatch.setenv("KPT_MPS_CACHE", str(hostile))
    assert works(Library(SOURCE, "cached.metal"))
    assert not marker.exists()
    assert cache.verified(hostile / name)  # rebuilt in its place, with its digest


def test_no_fixed_shared_directory_is_used_when_the_home_cache_cannot_be_made(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name, marker = library_name(tmp_path, monkeypatch), tmp_path / "planted-code-ran"
    monkeypatch.delenv("KPT_MPS_CACHE")
    home = tmp_path / "home"
    home.mkdir()
    (home / ".cache").write_text("a file where the cache directory would go")
    monkeypatch.setenv("HOME", str(home))
    shared = tmp_path / "shared-tmp"
    (shared / "kpt-mps").mkdir(parents=True)
    plant(shared / "kpt-mps" / name, marker)  # where a fixed fallback under the temp directory would look
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    cache._private_dir.cache_clear()
    try:
        assert works(Library(SOURCE, "cached.metal"))
        private = emulator.cache_dir()
    finally:
        cache._private_dir.cache_clear()
    assert not marker.exists()
    assert private != shared / "kpt-mps" and (os.stat(private).st_mode & 0o777) == 0o700


def test_the_default_cache_is_made_for_this_user_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KPT_MPS_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    path = emulator.cache_dir()
    assert path == tmp_path / ".cache" / "kpt-mps" and (os.stat(path).st_mode & 0o777) == 0o700


@pytest.mark.parametrize("hostile, message", [
    ("writable", "can be written by others"),
    ("link", "is a symbolic link"),
    ("foreign", "belongs to another user"),
])
def test_a_named_cache_others_could_write_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     hostile: str, message: str) -> None:
    path = tmp_path / "cache"
    path.mkdir(mode=0o700)
    if hostile == "writable":
        path.chmod(0o777)
    elif hostile == "link":
        (tmp_path / "link").symlink_to(path)
        path = tmp_path / "link"
    else:
        uid = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: uid + 4242)  # the directory is then another user's
    monkeypatch.setenv("KPT_MPS_CACHE", str(path))
    with pytest.raises(PermissionError, match=rf"KPT_MPS_CACHE={path} {message}"):
        Library(SOURCE, "cached.metal")
