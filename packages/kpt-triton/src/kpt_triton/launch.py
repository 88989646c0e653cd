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
A call with any other kind of argument or a grid given as a function, a call while Triton's
launch hooks are set (profilers), and Triton's interpreter always take Triton's own path.

Every kpt-triton kernel launched with a fixed grid is wrapped, except attention's training kernels
(not yet run wrapped on a GPU; on Hopper, kpt-cuda's attention is cuDNN's); its decode kernels are.
On an H100 host it took 10 to 45 µs off the host time of a one-token call (rms_norm 1 × 4096: 66–69
against 55 µs; moe_combine 132–137 against 89 µs; ``benchmarks/h100-2026-11-26b.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from triton import knobs
from triton.runtime import driver


def _specialize(args: tuple[Any, ...]) -> tuple[list[Any], list[Any]] | None:
    """What Triton specializes a compiled kernel on for each positional argument, and the
    arguments as the launcher takes them (tensors as addresses: it would otherwise look each up
    through a driver call); None for an argument of another kind.

    The most frequent kinds are tested first and each gives one key entry (an int of the int32
    range: 1, a multiple of 16, or neither): this runs on every launch, for up to two dozen
    arguments (rope's strides)."""
    key: list[Any] = []
    values: list[Any] = []
    for arg in args:
        kind = type(arg)
        if kind is int:  # 1, multiples of 16, and the width (int32, int64, uint64) change the code
            if -0x80000000 <= arg < 0x80000000:
                key.append(1 if arg == 1 else 16 if arg & 15 == 0 else 0)
            else:
                key.append((arg & 15 == 0, arg >= 1 << 63))
            values.append(arg)
        elif kind is torch.Tensor or isinstance(arg, torch.Tensor):
            address = arg.data_ptr()
            key.append((arg.dtype, arg.is_cpu, address & 15 == 0))
            values.append(address)
        elif kind is bool or kind is float or arg is None:
            key.append(kind)
            values.append(arg)
        else:
            return None
    return key, values


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
        specialized = _specialize(args)
        if specialized is None:
            self.fn[grid](*args, **kwargs)
            return
        device = self._device()
        key, values = specialized
        try:
            hit = self._compiled.get((device, *key, *kwargs.items()))
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

    def _first(self, grid: Sequence[int], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        """Triton's own launch; remembers the compiled kernel where the call is cacheable."""
        kernel = self.fn[grid](*args, **kwargs)
        if not all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata")):
            return  # the interpreter, or a Triton whose compiled kernels look different
        specialized = _specialize(args)
        if specialized is None or any(isinstance(v, torch.Tensor) for v in kwargs.values()):
            return  # tensors are keyed, and passed as addresses, only when positional
        if self._device is None:
            active = driver.active
            self._device, self._stream = active.get_current_device, active.get_current_stream
            interface = getattr(active, "get_device_interface", None)  # the torch module of the device
            if interface is not None and interface().device_count() == 1:
                self._device = _only_device
        # the launcher takes every parameter in order, constexprs included (it skips them)
        rest = list(self.fn.signature.parameters.values())[len(args):]
        key = (self._device(), *specialized[0], *kwargs.items())
        try:
            self._compiled[key] = kernel, tuple(kwargs.get(p.name, p.default) for p in rest)
        except TypeError:  # an unhashable keyword value: this call stays on Triton's path
            pass
