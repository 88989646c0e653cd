"""Writes `kpt.methods`, the kernel methods every backend has, from the contract (`kpt.SPECS`).

The methods are written out as source, not attached at run time, so that editors, ``help()``,
``inspect.signature`` and type checkers all see each kernel's signature, types and docstring.
After changing a kernel's signature or docstring, regenerate them::

    python -m kpt.codegen

kpt-core's tests fail while ``methods.py`` differs from what this module generates.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

from .kernels import SPECS
from .spec import KernelSpec

METHODS_FILE = Path(__file__).with_name("methods.py")

_HEADER = '''\
"""The kernel methods of every backend (``backend.rms_norm(x, weight)``...): one per kernel of
the contract, with its signature, types and docstring. Each validates the call against the
kernel's spec and runs it on the backend (`kpt.Backend.call`).

Generated from ``kpt.SPECS`` by ``python -m kpt.codegen``: do not edit.
"""

from __future__ import annotations

import abc
{typing_import}
import torch
from torch import Tensor


class KernelMethods(abc.ABC):
    """The kernel methods of `kpt.Backend`."""

    @abc.abstractmethod
    def call(self, kernel: str, *args: Any, **kwargs: Any) -> Any:
        """Validate a call of ``kernel`` against its spec and run it on this backend."""
'''

_TYPING_NAMES = ("Any", "Literal", "Optional", "Union")


def _annotation(annotation: Any) -> str:
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def _method(spec: KernelSpec) -> str:
    signature = inspect.signature(spec.signature)
    params = ["self"]
    for p in signature.parameters.values():
        text = f"{p.name}: {_annotation(p.annotation)}"
        params.append(text if p.default is p.empty else f"{text} = {p.default!r}")
    returns = _annotation(signature.return_annotation)
    head = f"    def {spec.name}({', '.join(params)}) -> {returns}:"
    if len(head) > 120:
        head = f"    def {spec.name}(\n" + "".join(f"        {p},\n" for p in params) + f"    ) -> {returns}:"
    doc = inspect.cleandoc(spec.signature.__doc__ or "")
    quote = 'r"""' if "\\" in doc else '"""'
    doc = "\n".join(f"        {line}".rstrip() for line in doc.splitlines()).lstrip()
    args = "".join(f", {name}" for name in signature.parameters)
    return f'{head}\n        {quote}{doc}\n        """\n        return self.call("{spec.name}"{args})\n'


def kernel_methods_source() -> str:
    """The source of `kpt.methods` for the current contract."""
    methods = [_method(spec) for spec in SPECS.values()]
    used = {n for n in _TYPING_NAMES if any(re.search(rf"\b{n}\b", m) for m in methods)} | {"Any"}
    typing_import = f"from typing import {', '.join(sorted(used))}\n"
    return _HEADER.format(typing_import=typing_import) + "".join("\n" + m for m in methods)


def main() -> None:
    METHODS_FILE.write_text(kernel_methods_source())
    print(f"wrote {METHODS_FILE}")


if __name__ == "__main__":
    main()
