"""Caches of built or downloaded artifacts that another user cannot plant code in.

kpt-mps keeps the shared libraries its Metal emulator compiles, kpt-fpga-sim the ap_types headers
its C-simulation compiles against. A cache is used only where no one else can write:

* `user_dir`: ``$<VARIABLE>``, else ``~/.cache/<name>``, made ``0700``; before every use it must
  be a directory (not a link) of this user that neither group nor others may write. A directory
  named by the variable that is not is an error; a default that cannot be had gives way to a
  private temporary directory of this process, never a fixed shared path such as ``/tmp/<name>``.
* `store` moves a file built in a fresh temporary directory into place atomically and records
  its sha256 beside it (``<file>.sha256``); `verified` accepts a cached file only when its bytes
  still have that digest and both are files of this user that no one else may write, so a file
  merely carrying the right name is never used.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import os
import shutil
import stat
import tempfile
from pathlib import Path


def unsafe(path: Path, kind: str = "directory") -> str | None:
    """Why ``path`` may not hold trusted artifacts (None when it may): it must be a ``kind``
    ("directory" or "file") that is not a link, owned by this user, not writable by group or others."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not (stat.S_ISDIR(st.st_mode) if kind == "directory" else stat.S_ISREG(st.st_mode)):
        return f"is not a {kind}"
    if st.st_uid != os.getuid():
        return f"belongs to another user (uid {st.st_uid})"
    if st.st_mode & 0o022:
        return f"can be written by others (mode {st.st_mode & 0o777:o})"
    return None


def user_dir(variable: str, name: str) -> Path:
    """The cache directory ``$variable`` or ``~/.cache/<name>``, checked by `unsafe` (see the module
    docstring). Raises `PermissionError` for an unsafe directory named by ``variable``."""
    named = os.environ.get(variable)
    path = Path(named) if named else Path.home() / ".cache" / name
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        problem = unsafe(path)
    except OSError as exc:
        problem = f"cannot be made ({exc.strerror or exc})"
    if problem is None:
        return path
    if named:
        raise PermissionError(f"{variable}={named} {problem}: kpt keeps built code only in a directory of yours "
                              "that no one else may write")
    return _private_dir(name)


@functools.cache
def _private_dir(name: str) -> Path:
    """A fresh ``0700`` directory for this process alone, removed when it exits."""
    path = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _record(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def store(built: Path, target: Path) -> None:
    """Move ``built`` (made in a fresh temporary directory beside ``target``) onto ``target``
    atomically, then record its digest (atomically too: a reader sees the old record or the new)."""
    digest = sha256(built)
    os.replace(built, target)
    partial = built.with_name(built.name + ".sha256")
    partial.write_text(digest + "\n")
    os.replace(partial, _record(target))


def verified(target: Path) -> bool:
    """Whether ``target`` is a cached file that `store` put there, unchanged since."""
    record = _record(target)
    try:
        if unsafe(target, "file") or unsafe(record, "file"):
            return False
        return record.read_text().strip() == sha256(target)
    except OSError:
        return False
