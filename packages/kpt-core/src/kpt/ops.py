"""Turns a backend's kernel bodies into differentiable, compilable PyTorch operators.

For every kernel, core registers two ``torch.library`` custom ops in the backend's own namespace
(``kpt_<backend>::<kernel>`` and ``kpt_<backend>::<kernel>_backward``):

* their schemas come from the annotations of the spec's reference ``forward``;
* their fake (meta) implementations *are* the spec's reference math run on fake tensors, so
  ``torch.compile(fullgraph=True)`` traces any backend without graph breaks;
* autograd is registered on the forward op and calls the backend's backward body.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from .kernels import SPECS
from .spec import KernelSpec

_SCHEMA_TYPES: dict[Any, str] = {
    torch.Tensor: "Tensor",
    typing.Optional[torch.Tensor]: "Tensor?",
    float: "float",
    typing.Optional[float]: "float?",
    int: "SymInt",
    bool: "bool",
    str: "str",
    typing.Optional[str]: "str?",
    torch.dtype: "ScalarType",
}


class Kernel(NamedTuple):
    """A backend's bodies for one kernel: ``forward`` and, if differentiable, ``backward``."""

    forward: Callable[..., Any]
    backward: Callable[..., Any] | None = None


def _params(fn: Callable[..., Any]) -> list[str]:
    hints = typing.get_type_hints(fn)
    return [f"{_SCHEMA_TYPES[hints[name]]} {name}" for name in inspect.signature(fn).parameters]


def forward_schema(spec: KernelSpec) -> str:
    n = len(spec.outputs) + len(spec.saved)
    returns = "Tensor" if n == 1 else "(" + ", ".join(["Tensor"] * n) + ")"
    return f"({', '.join(_params(spec.forward))}) -> {returns}"


def backward_schema(spec: KernelSpec) -> str:
    params = _params(spec.forward)
    params += [f"Tensor out_{name}" for name in spec.outputs + spec.saved]
    params += [f"Tensor? grad_{name}" for name in spec.outputs]
    n = len(spec.differentiable)
    returns = "Tensor" if n == 1 else "(" + ", ".join(["Tensor"] * n) + ")"
    return f"({', '.join(params)}) -> {returns}"


def as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def _tuple_body(fn: Callable[..., Any], n: int) -> Callable[..., Any]:
    """Custom ops return a bare Tensor for a single output and a tuple otherwise."""

    def body(*args: Any) -> Any:
        out = as_tuple(fn(*args))
        return out[0] if n == 1 else tuple(out)

    return body


_OPS: dict[str, dict[str, Any]] = {}
_BODIES: dict[str, Mapping[str, Kernel]] = {}


def register_all(namespace: str, kernels: Mapping[str, Kernel]) -> dict[str, Any]:
    """The ops of every contract kernel in ``namespace``, running ``kernels``.

    An op name can be registered once per process, so a second backend object with the same
    namespace (another instance of the same class) reuses the ops and its bodies replace the
    previous ones.
    """
    _BODIES[namespace] = kernels
    if namespace not in _OPS:
        _OPS[namespace] = {name: _register(namespace, spec) for name, spec in SPECS.items()}
    return _OPS[namespace]


def _register(namespace: str, spec: KernelSpec) -> Any:
    """Register ``namespace::spec.name`` (with autograd if differentiable)."""
    n_out = len(spec.outputs) + len(spec.saved)
    fwd = torch.library.custom_op(
        f"{namespace}::{spec.name}", _tuple_body(lambda *a: _BODIES[namespace][spec.name].forward(*a), n_out),
        mutates_args=(), schema=forward_schema(spec),
    )
    fwd.register_fake(_tuple_body(spec.forward, n_out))
    if not spec.differentiable:
        return fwd
    assert spec.backward is not None
    n_grad = len(spec.differentiable)
    bwd = torch.library.custom_op(
        f"{namespace}::{spec.name}_backward",
        _tuple_body(lambda *a: _BODIES[namespace][spec.name].backward(*a), n_grad),
        mutates_args=(), schema=backward_schema(spec),
    )
    bwd.register_fake(_tuple_body(spec.backward, n_grad))

    names = list(inspect.signature(spec.forward).parameters)
    tensor_pos = [i for i, name in enumerate(names) if _params(spec.forward)[i].startswith("Tensor")]
    grad_pos = [names.index(name) for name in spec.differentiable]

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(*(inputs[i] for i in tensor_pos), *as_tuple(output))
        ctx.args = [None if i in tensor_pos else a for i, a in enumerate(inputs)]
        ctx.absent = [inputs[i] is None for i in grad_pos]

    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        saved = ctx.saved_tensors
        args = list(ctx.args)
        for k, i in enumerate(tensor_pos):
            args[i] = saved[k]
        outputs = saved[len(tensor_pos):]
        results = as_tuple(bwd(*args, *outputs, *grads[: len(spec.outputs)]))
        if spec.grads is not None:
            results = spec.grads(results)
        input_grads: list[Any] = [None] * len(names)
        for k, i in enumerate(grad_pos):
            input_grads[i] = None if ctx.absent[k] else results[k]
        return tuple(input_grads)

    fwd.register_autograd(backward, setup_context=setup_context)
    return fwd
