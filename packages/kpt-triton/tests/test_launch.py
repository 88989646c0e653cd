"""`kpt_triton.launch.cached_launch`: the same results as Triton's own launch, every specialization
keyed apart, and Triton's path wherever the fast one does not apply (the interpreter, hooks)."""

from __future__ import annotations

import inspect

import pytest
import torch
import triton
import triton.language as tl

from conftest import device
from kpt.testing import poisoned
from kpt_triton.launch import MAX_BINDERS, _binder, cached_launch

pytestmark = pytest.mark.interpreter  # launches Triton kernels (interpreted on a CPU machine)


@cached_launch
@triton.jit
def _axpy_kernel(X, Y, n, stride, alpha, BLOCK: tl.constexpr, SHIFT: tl.constexpr = 0):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(X + offs * stride, mask=ok).to(tl.float32)
    tl.store(Y + offs, (alpha * x + SHIFT).to(Y.dtype.element_ty), mask=ok)


def _axpy(x: torch.Tensor, alpha: float, block: int = 64, shift: int | None = None) -> torch.Tensor:
    with poisoned():
        y = torch.empty(x.numel(), dtype=x.dtype, device=x.device)
    extra = {} if shift is None else {"SHIFT": shift}
    _axpy_kernel[(triton.cdiv(x.numel(), block),)](x, y, x.numel(), x.stride(0), alpha, BLOCK=block, **extra)
    return y


def _expected(x: torch.Tensor, alpha: float, shift: int = 0) -> torch.Tensor:
    return (alpha * x.float() + shift).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_specialization_computes_its_own_result(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2 * 1031, generator=g).to(dtype).to(device())
    calls = [
        (base[:1], 2.0, {}),  # n == 1
        (base[:16], -1.5, {}),  # n a multiple of 16
        (base[:17], 0.5, {}),
        (base[1:1001], 3.0, {}),  # a pointer off 16-byte alignment
        (base[::2], 0.25, {}),  # stride 2
        (base[:300], 1.0, {"block": 128}),  # another constexpr
        (base[:300], 1.0, {"shift": 3}),  # a default constexpr given
        (base[:300], 1.0, {}),  # back to the first specialization of this size
    ]
    for _ in range(2):  # the second round runs from the cache where there is one
        for x, alpha, kw in calls:
            got = _axpy(x, alpha, **kw)
            assert torch.equal(got.cpu(), _expected(x, alpha, kw.get("shift", 0)).cpu()), (x.shape, x.stride(), kw)


def test_keys_tell_apart_what_triton_specializes_on() -> None:
    kernel = cached_launch(_Jit())

    def key(*args: object) -> object:
        bound = kernel._bind(args)
        return None if bound is None else bound[:2]  # the binder (the arguments' kinds) and its key

    t = torch.zeros(64)
    assert key(t) != key(t[1:])  # 16-byte alignment
    assert key(t) != key(t.half())  # dtype
    assert key(t) != key(t.to("meta"))  # host memory or not
    assert key(t) == key(torch.ones(64)) and key(t) == key(torch.nn.Parameter(t))  # a subclass keys alike
    # 1, a multiple of 16, and the width (int32, int64, uint64) each change the compiled kernel
    assert key(1) != key(17) and key(16) != key(17) and key(16) == key(32) and key(2) == key(17)
    assert len({key((1 << 31) - 16), key(1 << 31), key(1 << 63)}) == 3
    assert len({key(True), key(2.0), key(None), key(2)}) == 4
    assert key((1, 2)) is None and key("a") is None and key(t, "a") is None
    assert key(t, 3) != key(t, 3, 3) and key(t, 3) != key(t, None)
    assert kernel._bind((t, 3))[2] == (t.data_ptr(), 3)  # tensors go to the launcher as addresses


def test_a_kernel_keeps_its_latest_binders() -> None:
    kernel = cached_launch(_Jit())
    t = torch.zeros(8)
    kinds = [(t,), (1,), (1 << 40,), (True,), (2.0,), (None,), (t, t), (t, 1), (t, None), (1, 1)]
    for args in kinds:
        assert kernel._bind(args)[0] is kernel._binders[0]
    assert len(kernel._binders) == MAX_BINDERS
    assert kernel._bind((t, None))[0] is kernel._binders[1]  # still kept: found, not made again
    assert _binder((t, 2))((t, 1 << 40)) is None and _binder(())(()) == ((), ())


@pytest.mark.gpu
@pytest.mark.skipif(device().type != "cuda", reason="needs a GPU: the interpreter never caches")
def test_repeat_calls_skip_triton_and_new_specializations_do_not(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(4096, device="cuda")
    _axpy(x, 2.0, block=512)  # a block size no other test uses: a specialization of its own
    first = []
    monkeypatch.setattr(_axpy_kernel, "_first", lambda *a: first.append(a[1]))
    y = _axpy(torch.randn(4096, device="cuda"), 2.0, block=512)
    assert not first and not y.isnan().any()
    _axpy(x[1:], 2.0, block=512)  # misaligned: a new specialization goes through Triton
    _axpy(x.half(), 2.0, block=512)
    _axpy(x, 2.0, block=512, shift=1)
    assert len(first) == 3


def test_interpreter_hooks_and_grid_functions_take_tritons_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from triton import knobs

    x = torch.randn(100, device=device())
    y = torch.empty_like(x)
    _axpy_kernel[lambda meta: (triton.cdiv(100, meta["BLOCK"]),)](x, y, 100, 1, 3.0, BLOCK=32)
    assert torch.equal(y.cpu(), _expected(x, 3.0).cpu())
    _axpy(x, 1.0)
    if device().type == "cpu":
        assert not _axpy_kernel._compiled
    seen = []
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: seen.append(a))
    assert torch.equal(_axpy(x, 2.0).cpu(), _expected(x, 2.0).cpu())
    if device().type == "cuda":
        assert seen  # the hook saw the launch


class _Compiled:
    """Stands for a compiled Triton kernel: its launcher records the arguments it is given."""

    function, packed_metadata = "function", "metadata"

    def __init__(self) -> None:
        self.runs: list[tuple[object, ...]] = []

    def run(self, *args: object) -> None:
        self.runs.append(args)


class _Jit:
    """Stands for a `triton.jit` function of ``(X, n, alpha, BLOCK: constexpr, SHIFT: constexpr = 0)``:
    each launch through Triton's path is recorded and returns the one compiled kernel."""

    def __init__(self) -> None:
        def kernel(X, n, alpha, BLOCK, SHIFT=0):  # noqa: N803 (Triton's spelling)
            pass

        self.signature = inspect.signature(kernel)
        self.compiled = _Compiled()
        self.triton_launches: list[tuple[object, ...]] = []

    def __getitem__(self, grid: tuple[int, ...]):
        def launch(*args: object, **kwargs: object) -> _Compiled:
            self.triton_launches.append((grid, args, kwargs))
            return self.compiled

        return launch


class _Driver:
    """Triton's active driver as the fast path asks it: one device, stream 7."""

    class active:  # noqa: N801
        get_current_device = staticmethod(lambda: 0)
        get_current_stream = staticmethod(lambda device: 7)


def test_a_repeat_launch_passes_the_compiled_kernel_what_triton_would(monkeypatch: pytest.MonkeyPatch) -> None:
    # the fast path runs on a GPU only; here its launcher is a recording stand-in
    import kpt_triton.launch

    monkeypatch.setattr(kpt_triton.launch, "driver", _Driver)
    jit = _Jit()
    kernel = cached_launch(jit)
    x = torch.zeros(64)
    kernel[(4,)](x, 10, 2.0, BLOCK=64)  # the first call of a specialization: Triton's path
    assert len(jit.triton_launches) == 1 and not jit.compiled.runs
    kernel[(4, 2)](x, 10, 2.0, BLOCK=64)
    kernel.launch((3,), (x, 26, 0.5), {"BLOCK": 64, "SHIFT": 3})  # SHIFT given: another key
    kernel.launch((3,), (x, 26, 0.5), {"BLOCK": 64, "SHIFT": 3})
    assert jit.compiled.runs == [
        (4, 2, 1, 7, "function", "metadata", None, None, None, x.data_ptr(), 10, 2.0, 64, 0),
        (3, 1, 1, 7, "function", "metadata", None, None, None, x.data_ptr(), 26, 0.5, 64, 3),
    ]
    assert len(jit.triton_launches) == 2
    # whatever Triton specializes on differently goes through Triton again, once
    for args in [(x[1:], 10, 2.0), (x.half(), 10, 2.0), (x, 1, 2.0), (x, 16, 2.0), (x, 1 << 40, 2.0), (x, 10, None)]:
        kernel[(1,)](*args, BLOCK=64)
        kernel[(1,)](*args, BLOCK=64)
    assert len(jit.triton_launches) == 2 + 6 and len(jit.compiled.runs) == 2 + 6
    # numbers given by keyword are keyed by value and go to the launcher in the signature's order
    kernel[(1,)](x, alpha=0.25, n=12, BLOCK=64)
    kernel[(1,)](x, alpha=0.25, n=12, BLOCK=64)
    assert len(jit.triton_launches) == 2 + 6 + 1
    assert jit.compiled.runs[-1] == (1, 1, 1, 7, "function", "metadata", None, None, None,
                                     x.data_ptr(), 12, 0.25, 64, 0)
    # a tensor given by keyword is never cached (the launcher takes addresses by position only)
    kernel[(1,)](x, 10, alpha=torch.ones(1), BLOCK=64)
    kernel[(1,)](x, 10, alpha=torch.ones(1), BLOCK=64)
    assert len(jit.triton_launches) == 2 + 6 + 1 + 2
    # a profiler's launch hook sees every launch: Triton's path while one is set
    from triton import knobs

    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    kernel[(4,)](x, 10, 2.0, BLOCK=64)
    assert len(jit.triton_launches) == 2 + 6 + 1 + 2 + 1
