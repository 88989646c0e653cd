"""Turns a backend's kernel bodies into differentiable, compilable PyTorch operators.

For every kernel, core registers two ``torch.library`` custom ops in the backend's own namespace
(``kpt_<backend>::<kernel>`` and ``kpt_<backend>::<kernel>_backward``):

* their schemas come from the annotations of the spec's reference ``forward``;
* their fake (meta) implementations *are* the spec's reference math run on fake tensors, so
  ``torch.compile(fullgraph=True)`` traces any backend without graph breaks;
* autograd is registered on the forward op and calls the backend's backward body.

Dispatching a custom op costs tens of microseconds of Python per call, which a small kernel
feels, so eager calls take a shorter road with the same bodies and the same autograd logic
(`eager_functions`: a ``torch.autograd.Function`` per kernel); the ops are what
``torch.compile`` traces. A forward body made only of differentiable torch operations (a vendor
library's product then torch's activation) can say so with `torch_autograd`: eager calls then run
it as it is and torch's own autograd differentiates it, with no Python in the backward.
"""

from __future__ import annotations

import inspect
import sys
import typing
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, cast

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
    names = list(inspect.signature(spec.forward).parameters)
    # inputs the backward never reads come as None
    params = [p.replace("Tensor ", "Tensor? ", 1) if name in spec.unsaved else p
              for name, p in zip(names, _params(spec.forward))]
    params += [f"Tensor out_{name}" for name in spec.outputs + spec.saved]
    params += [f"Tensor? grad_{name}" for name in spec.outputs]
    n = backward_results(spec)
    returns = "Tensor" if n == 1 else "(" + ", ".join(["Tensor"] * n) + ")"
    return f"({', '.join(params)}) -> {returns}"


def gradient_results(spec: KernelSpec) -> list[int]:
    """For each differentiable input, which result of the backward body is its gradient: its own,
    unless ``spec.grads`` hands one result to several inputs."""
    indices = tuple(range(len(spec.differentiable)))
    return list(indices if spec.grads is None else spec.grads(indices))  # type: ignore[arg-type]


def backward_results(spec: KernelSpec) -> int:
    """How many tensors the backward body returns."""
    return max(gradient_results(spec)) + 1


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
        if "torch.distributed.tensor" in sys.modules:  # DTensors in use: their sharding rules
            from .distributed import register_rules

            register_rules(namespace)
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
    n_grad = backward_results(spec)
    # ops are functional: the backward body may overwrite its reusable inputs, so it gets copies
    n_args = len(inspect.signature(spec.forward).parameters)
    copied = [n_args + (spec.outputs + spec.saved).index(name) for name in spec.reusable]

    def run_backward(*args: Any) -> Any:
        args = tuple(a.clone() if i in copied else a for i, a in enumerate(args))
        # a differentiable kernel's bodies include a backward (`missing_kernels` names one that lacks it)
        return cast(Callable[..., Any], _BODIES[namespace][spec.name].backward)(*args)

    bwd = torch.library.custom_op(
        f"{namespace}::{spec.name}_backward", _tuple_body(run_backward, n_grad),
        mutates_args=(), schema=backward_schema(spec),
    )
    bwd.register_fake(_tuple_body(spec.backward, n_grad))

    setup_context, backward = _autograd(spec, bwd)
    fwd.register_autograd(backward, setup_context=setup_context)
    return fwd


def _autograd(spec: KernelSpec, run_backward: Callable[..., Any], overwrites: bool = False
              ) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(setup_context, backward)`` of ``spec`` for autograd; ``run_backward`` runs its backward
    body, which ``overwrites`` the reusable saved outputs it is given (else it gets copies)."""
    names = list(inspect.signature(spec.forward).parameters)
    tensors = [i for i, name in enumerate(names) if _params(spec.forward)[i].startswith("Tensor")]
    tensor_pos = [i for i in tensors if names[i] not in spec.unsaved]
    grad_pos = [names.index(name) for name in spec.differentiable]
    reusable = [len(tensor_pos) + (spec.outputs + spec.saved).index(name) for name in spec.reusable]

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(*(inputs[i] for i in tensor_pos), *as_tuple(output))
        ctx.args = [None if i in tensors else a for i, a in enumerate(inputs)]
        ctx.absent = [inputs[i] is None for i in grad_pos]
        # the saved outputs get no gradient: None, not a tensor of zeros as large as them
        ctx.set_materialize_grads(False)

    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        saved = ctx.saved_tensors
        args = list(ctx.args)
        for k, i in enumerate(tensor_pos):
            args[i] = saved[k]
        outputs = saved[len(tensor_pos):]
        results = as_tuple(run_backward(*args, *outputs, *grads[: len(spec.outputs)]))
        if overwrites:
            # a second backward through this graph (retain_graph) must fail, not reuse them
            for i in reusable:
                torch.autograd.graph.increment_version(saved[i])
        if spec.grads is not None:
            results = spec.grads(results)
        input_grads: list[Any] = [None] * len(names)
        for k, i in enumerate(grad_pos):
            input_grads[i] = None if ctx.absent[k] else results[k]
        return tuple(input_grads)

    return setup_context, backward


def torch_autograd(forward: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a forward body as made only of differentiable torch operations, so that torch's
    autograd can differentiate its first results (the kernel's outputs) itself.

    Eager calls that need gradients then run the body directly, whose backward is torch's (in C++:
    the per-call host cost of an eager torch expression); traced and compiled calls keep the
    custom op and the kernel's ``_bwd`` body, which must compute the same gradients."""
    forward.torch_autograd = True  # type: ignore[attr-defined]
    return forward


def eager_functions(kernels: Mapping[str, Kernel]) -> dict[str, Callable[..., Any]]:
    """``Function.apply`` of every differentiable kernel: the same bodies and autograd as the ops,
    without the custom-op dispatch; a `torch_autograd` forward body itself."""
    return {name: kernels[name].forward if getattr(kernels[name].forward, "torch_autograd", False)
            else _function(spec, kernels[name]) for name, spec in SPECS.items() if spec.differentiable}


def _function(spec: KernelSpec, kernel: Kernel) -> Callable[..., Any]:
    setup, differentiate = _autograd(spec, cast(Callable[..., Any], kernel.backward), overwrites=True)

    class Function(torch.autograd.Function):
        # ctx in forward rather than a separate setup_context: ``apply`` then skips an
        # ``inspect.signature`` of the forward on every call
        @staticmethod
        def forward(ctx: Any, *args: Any) -> tuple[torch.Tensor, ...]:
            out = as_tuple(kernel.forward(*args))
            setup(ctx, args, out)
            return out

        backward = staticmethod(differentiate)

    Function.__name__ = spec.name
    return Function.apply
