"""Launching a Triton kernel again without Triton's per-call dispatch (for kernels of microseconds).

``kernel[grid](*args)`` on a `triton.jit` function binds the arguments, derives their
specialization, hashes it, looks the compiled kernel up and checks the globals it read, on every
call. That is several microseconds of Python on a fast CPU and tens on a slow one: more than a
small kernel (MoE gating of a decode step) runs on the GPU. `cached_launch` wraps such a kernel:

    @cached_launch
    @triton.jit
    def _kernel(X, Y, n, BLOCK: tl.constexpr): ...

    _kernel[grid](x, y, n, BLOCK=128)      # same call as before

The first call of each specialization goes through Triton (and compiles); later calls with the
same specialization launch the compiled kernel directly. The key holds everything Triton
specializes a compiled kernel on, and a little more: the current device, the keyword arguments
(constexprs and options such as ``num_warps``) by value, and per positional argument: for a
tensor, whether it is in host memory, its dtype and its 16-byte alignment; for an int, its width
(int32, int64, uint64) and whether it is 1 or a multiple of 16; else its type (bool, float, None).
The key is computed by a function generated for the kinds of the arguments (`_binder`, as Triton
generates its own binder), which a kernel keeps for its next launches. A call with any other kind of
argument or a grid given as a function, a call while Triton's launch hooks are set (profilers), and
Triton's interpreter always take Triton's own path.

Every kpt-triton kernel launched with a fixed grid is wrapped, except attention's training kernels
(not yet run wrapped on a GPU; on Hopper, kpt-cuda's attention is cuDNN's); its decode kernels are.
On an H100 host it took 10 to 45 µs off the host time of a one-token call (rms_norm 1 × 4096: 66–69
against 55 µs; moe_combine 132–137 against 89 µs; ``benchmarks/h100-2026-11-26b.md``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from triton import knobs
from triton.runtime import driver


def _kind(arg: Any) -> Any:
    """What `_binder` keys an argument of this kind by: "tensor", "int" (of the int32 range),
    "wide int", or the type of a bool, a float or None; None for any other argument."""
    kind = type(arg)
    if kind is int:
        return "int" if -0x80000000 <= arg < 0x80000000 else "wide int"
    if kind is torch.Tensor or isinstance(arg, torch.Tensor):
        return "tensor"
    if kind is bool or kind is float or arg is None:
        return kind
    return None


Binder = Callable[[tuple[Any, ...]], "tuple[tuple[Any, ...], tuple[Any, ...]] | None"]
"""`_binder`'s functions: the arguments' key and the values the launcher takes, or None."""


def _binder(args: tuple[Any, ...]) -> Binder | None:
    """A function of a launch's positional arguments giving what Triton specializes a compiled
    kernel on (the key) and the arguments as its launcher takes them (tensors as addresses: it
    would otherwise look each up through a driver call), for arguments of the kinds (`_kind`) that
    ``args`` have; it gives None for arguments of other kinds. None where an argument of ``args``
    is of a kind that is not keyed.

    Key entries: a tensor's dtype, whether it is in host memory and whether its address is 16-byte
    aligned; an int of the int32 range: 1, a multiple of 16 or neither; a wider int: whether it is a
    multiple of 16 and whether it needs uint64; nothing for a bool, a float or None (their kind is
    the binder's own). The function is generated with the arguments unrolled, as Triton generates
    its own binder: a loop over them took 2.5 µs a launch of rms_norm's 13 arguments on a CPU where
    this takes 1.4. One function serves every kernel launched with the same kinds of arguments, so
    a kernel's cache keys (which hold it) stay the same when it makes a binder again."""
    kinds = tuple(_kind(arg) for arg in args)
    return None if None in kinds else _generated(kinds)


@functools.cache
def _generated(kinds: tuple[Any, ...]) -> Binder:
    """`_binder`'s function for arguments of these kinds."""
    guards, lines, key, values = [], [], [], []
    for i, kind in enumerate(kinds):
        a = f"a{i}"
        if kind == "tensor":
            guards.append(f"(type({a}) is Tensor or isinstance({a}, Tensor))")
            lines.append(f"p{i} = {a}.data_ptr()")
            key.append(f"{a}.dtype, {a}.is_cpu, not p{i} & 15")
            values.append(f"p{i}")
        elif kind == "int":
            guards.append(f"type({a}) is int and -0x80000000 <= {a} < 0x80000000")
            key.append(f"1 if {a} == 1 else 16 if not {a} & 15 else 0")
            values.append(a)
        elif kind == "wide int":
            guards.append(f"type({a}) is int and not -0x80000000 <= {a} < 0x80000000")
            key.append(f"not {a} & 15, {a} >= 1 << 63")
            values.append(a)
        else:
            guards.append(f"{a} is None" if kind is type(None) else f"type({a}) is {kind.__name__}")
            values.append(a)
    source = "\n    ".join([
        "def bind(args):",
        f"if len(args) != {len(kinds)}:", "    return None",
        f"{''.join(f'a{i}, ' for i in range(len(kinds)))}= args" if kinds else "pass",
        f"if not ({' and '.join(guards) or 'True'}):", "    return None",
        *lines,
        f"return ({''.join(k + ', ' for k in key)}), ({''.join(v + ', ' for v in values)})",
    ]) + "\n"
    scope: dict[str, Any] = {"Tensor": torch.Tensor}
    exec(compile(source, f"<kpt_triton.launch binder of {len(kinds)} arguments>", "exec"), scope)  # noqa: S102
    return scope["bind"]


MAX_BINDERS = 8
"""Binders a kernel tries first (most recent first): the kinds of arguments it is launched with (a
residual or none, a weight or none)."""


def _only_device() -> int:
    """The current device where one is visible: 0, without asking the runtime. Asking costs 0.3 µs in
    the caller's thread and 4 µs in the autograd engine's device thread, where backward kernels launch
    (torch.cuda.current_device on an H100 host, `benchmarks/h100-2026-11-27c.md`)."""
    return 0


def _hooked(hook: Any) -> bool:
    """Whether a launch hook is set: a callable, or a chain of them (Triton 3.5 on) holding one."""
    return hook is not None and bool(getattr(hook, "calls", True))


class cached_launch:  # noqa: N801 (a decorator, named like triton.jit)
    """A `triton.jit` kernel whose repeat launches skip Triton's dispatch (see the module docstring)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self._compiled: dict[tuple[Any, ...], tuple[Any, tuple[Any, ...]]] = {}
        self._binders: list[Binder] = []
        self._device: Callable[[], int] | None = None
        self._stream: Callable[[int], int] | None = None

    def __getitem__(self, grid: Sequence[int] | Callable[..., Sequence[int]]) -> Callable[..., Any]:
        if callable(grid):  # a grid computed from the arguments: Triton's path
            return self.fn[grid]
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid: Sequence[int], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        """``self[grid](*args, **kwargs)`` without building the call: for a launcher that keeps the
        keywords of a shape (`kpt_triton.tiling.row_launch`), which this never modifies."""
        if (self._device is None or self._stream is None or _hooked(knobs.runtime.launch_enter_hook)
                or _hooked(knobs.runtime.launch_exit_hook)):
            self._first(grid, args, kwargs)
            return
        bound = self._bind(args)
        if bound is None:
            self.fn[grid](*args, **kwargs)
            return
        binder, key, values = bound
        device = self._device()
        try:
            hit = self._compiled.get((device, binder, *key, *kwargs.items()))
        except TypeError:  # an unhashable keyword value
            hit = None
        if hit is None:
            self._first(grid, args, kwargs)
            return
        kernel, constexprs = hit
        kernel.run(
            grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
            self._stream(device), kernel.function, kernel.packed_metadata, None, None, None, *values, *constexprs,
        )

    def _bind(self, args: tuple[Any, ...]) -> tuple[Binder, tuple[Any, ...], tuple[Any, ...]] | None:
        """``(binder, key, values)`` of a launch's positional arguments (`_binder`), from the first
        of this kernel's binders that takes them, else a new one; None for arguments of a kind that
        is not keyed. The binder is part of the cache key: each keys its own kinds of arguments."""
        for binder in self._binders:
            bound = binder(args)
            if bound is not None:
                return binder, *bound
        made = _binder(args)
        if made is None:
            return None
        self._binders.insert(0, made)
        del self._binders[MAX_BINDERS:]
        key, values = made(args)  # type: ignore[misc]  # made for these arguments: never None
        return made, key, values

    def _first(self, grid: Sequence[int], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        """Triton's own launch; remembers the compiled kernel where the call is cacheable."""
        kernel = self.fn[grid](*args, **kwargs)
        if not all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata")):
            return  # the interpreter, or a Triton whose compiled kernels look different
        bound = self._bind(args)
        if bound is None or any(isinstance(v, torch.Tensor) for v in kwargs.values()):
            return  # tensors are keyed, and passed as addresses, only when positional
        if self._device is None:
            active = driver.active
            self._device, self._stream = active.get_current_device, active.get_current_stream
            interface = getattr(active, "get_device_interface", None)  # the torch module of the device
            if interface is not None and interface().device_count() == 1:
                self._device = _only_device
        # the launcher takes every parameter in order, constexprs included (it skips them)
        rest = list(self.fn.signature.parameters.values())[len(args):]
        key = (self._device(), bound[0], *bound[1], *kwargs.items())
        try:
            self._compiled[key] = kernel, tuple(kwargs.get(p.name, p.default) for p in rest)
        except TypeError:  # an unhashable keyword value: this call stays on Triton's path
            pass
