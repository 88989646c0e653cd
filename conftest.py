"""pytest hooks for kpt's own tests (packages/*/tests, examples/*/tests, tests/); the conformance
suite has its own configuration (kpt_conformance/suite/pytest.ini) and names its tests itself."""

from __future__ import annotations

from typing import Any

import torch


def _id(value: Any) -> str | None:
    """``bfloat16`` for a dtype, ``8x4096`` for a shape, ``k=v`` pairs for a dict, an object's own
    ``str`` (``ap_fixed<16,6,AP_RND,AP_SAT>``) or ``name``, a builtin's name; None leaves a value to
    pytest (strings, numbers, enums, functions and classes it names itself)."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, torch.Size | tuple | list) and all(type(v) is int for v in value):
        return "x".join(map(str, value)) or "scalar"
    if isinstance(value, tuple | list):
        parts = [_id(v) or (str(v) if isinstance(v, str | int | float | bool) else None) for v in value]
        return "-".join(p for p in parts if p is not None) if all(p is not None for p in parts) else None
    if isinstance(value, dict):
        parts = [_id(v) or (str(v) if isinstance(v, str | int | float | bool) else None) for v in value.values()]
        return ",".join(f"{k}={p}" for k, p in zip(value, parts)) if all(p is not None for p in parts) else None
    if type(value).__str__ is not object.__str__ and not isinstance(value, str | int | float | bool):
        return str(value)
    name = getattr(value, "name", None)
    if isinstance(name, str):
        return name
    name = getattr(value, "__name__", None)
    return name if isinstance(name, str) and callable(value) else None


def pytest_make_parametrize_id(config: Any, val: Any, argname: str) -> str | None:
    return _id(val)
