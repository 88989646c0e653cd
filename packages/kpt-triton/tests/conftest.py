"""Shared checks: each launcher against its spec's float64 reference.

Without a GPU the kernels run in the Triton interpreter on CPU tensors; the switch must be
set before ``triton`` is first imported, hence here.
"""

from __future__ import annotations

import inspect
import os
import random
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kpt  # noqa: E402
from kpt.spec import finite as finite_values  # noqa: E402
from kpt.testing import oracle_backend, to_device  # noqa: E402

DTYPES = (torch.float32, torch.float16, torch.bfloat16)

SEED = int(os.environ.get("KPT_TEST_SEED") or random.randrange(2**31))
"""This run's seed of the tests' random inputs: fresh at every run, printed at the end of the run
(quiet runs included); ``KPT_TEST_SEED=<seed>`` gives a failing run's inputs again."""


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.write_line(f"kpt-triton tests: inputs seed {SEED} (replay: KPT_TEST_SEED={SEED})")


def seeded(*case: Any) -> torch.Generator:
    """The generator of one test case's inputs: this run's `SEED` and the case (its parts' repr,
    which, unlike Python's ``hash`` of a string, is the same in every process)."""
    return torch.Generator().manual_seed((SEED + zlib.crc32(repr(case).encode())) % 2**31)


def device() -> torch.device:
    """The GPU (with its index, as the tensors on it name it) or, under the interpreter, the CPU."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to64(v: Any) -> Any:
    if isinstance(v, torch.Tensor) and v.is_floating_point():
        return v.detach().to("cpu", torch.float64)
    return v.detach().cpu() if isinstance(v, torch.Tensor) else v


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str,
                 allowance: torch.Tensor | None = None) -> None:
    """The criterion of ``kpt.tolerance`` with the default tolerance of ``dtype``; differences up to
    ``allowance`` (per element: a rounding the contract permits, `kpt.KernelSpec.rounding`) are not
    counted, as in the conformance suite's comparison."""
    tol = kpt.default_tolerance(dtype)
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert out.is_contiguous(), f"{what}: output is not contiguous"
    if not ref.is_floating_point():
        assert torch.equal(out.cpu(), ref), f"{what}: integer output differs"
        return
    o, r = out.detach().to("cpu", torch.float64), ref.to(torch.float64)
    assert not (o.isnan() & ~r.isnan()).any(), f"{what}: NaN where the reference has none"
    if r.numel() == 0:
        return
    finite = r.isfinite()
    same = (o[~finite] == r[~finite]) | (o[~finite].isnan() & r[~finite].isnan())
    assert same.all(), f"{what}: infinities or NaNs differ from the reference"
    o, r = o[finite], r[finite]
    if r.numel() == 0:
        return
    scale = r.abs().max().clamp_min(torch.finfo(torch.float64).tiny)
    err = (o - r).abs()
    if allowance is not None:
        err = (err - finite_values(allowance.to(torch.float64))[finite]).clamp_min(0.0)
    rel_norm = err.norm() / r.norm().clamp_min(torch.finfo(torch.float64).tiny)
    assert rel_norm <= tol.rel_norm, f"{what}: relative norm error {rel_norm:.3g} > {tol.rel_norm}"
    bad = err > tol.atol * scale + tol.rtol * r.abs()
    assert not bad.any(), f"{what}: {int(bad.sum())} elements out of tolerance, max error {err.max():.3g}"


def _meta(v: Any) -> Any:
    return v.to("meta") if isinstance(v, torch.Tensor) else v


def check_kernel(name: str, fwd: Callable[..., Any], bwd: Callable[..., Any] | None, args: dict[str, Any],
                 dtype: torch.dtype, *, compare_saved: Sequence[str] = (), seed: int = 0,
                 output_allowances: Mapping[str, torch.Tensor] | None = None) -> None:
    """Run ``fwd`` (and ``bwd`` with random output gradients) on ``args`` on the test device and
    compare public outputs, the named saved tensors and every gradient with the float64
    reference; dtypes and shapes must be those of the reference run on the real dtypes. A
    gradient may also carry the rounding the contract permits (`kpt.KernelSpec.rounding`), an output
    the one ``output_allowances`` gives by its name.

    Unlike ``kpt.testing`` this drives the launchers directly (no backend, no autograd), so each
    kernel body is checked on its own."""
    spec = kpt.SPECS[name]
    dev = device()
    on_dev = list(to_device(args, dev).values())
    out = fwd(*on_dev)
    expected = spec.forward(*[_meta(v) for v in args.values()])
    ref_args = [to64(v) for v in args.values()]
    ref = spec.forward(*ref_args)
    assert len(out) == len(ref), f"{name}: forward returned {len(out)} tensors, the spec {len(ref)}"
    for i, n in enumerate(spec.outputs + spec.saved):
        assert out[i].dtype == expected[i].dtype, f"{name}.{n}: dtype {out[i].dtype} != {expected[i].dtype}"
        if n in spec.outputs or n in compare_saved:
            assert_close(out[i], ref[i], _tol_dtype(out[i], dtype), f"{name}.{n}", (output_allowances or {}).get(n))
    if bwd is None:
        return
    g = torch.Generator().manual_seed(seed + 1)
    grads = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(dev, o.dtype)
             for o in out[: len(spec.outputs)]]
    got = bwd(*on_dev, *out, *grads)
    # the oracle differentiates its own float64 forward, as the conformance suite does
    want = spec.backward(*ref_args, *ref, *[to64(gr) for gr in grads])
    want_meta = spec.backward(*[_meta(v) for v in [*args.values(), *out, *grads]])
    assert len(got) == len(want), f"{name}: backward returned {len(got)} tensors, the spec {len(want)}"
    if spec.grads is not None:
        got, want, want_meta = spec.grads(got), spec.grads(want), spec.grads(want_meta)
    allowances = _allowances(spec, args, ref_args, grads, dtype)
    for n, a, b, m in zip(spec.differentiable, got, want, want_meta, strict=True):
        assert a.dtype == m.dtype, f"{name}: grad of {n} has dtype {a.dtype}, expected {m.dtype}"
        assert_close(a, b, dtype, f"{name}: grad of {n}", allowances.get(n))


def _allowances(spec: kpt.KernelSpec, args: dict[str, Any], ref_args: list[Any], grads: list[torch.Tensor],
                dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The spec's rounding allowance per gradient (none where it has no `rounding`), from the float64
    arguments of its public signature and the upstream gradients, as the conformance suite computes it."""
    if spec.rounding is None:
        return {}
    public = inspect.signature(spec.signature).parameters
    named = {n: v for n, v in zip(args, ref_args) if n in public}
    checked = spec.check((), named, oracle_backend().dtypes)
    upstream = {f"d{n}": to64(g) for n, g in zip(spec.outputs, grads)}
    return spec.rounding(checked, upstream, dtype)


def assert_nan_rows_stay(fwd: Callable[..., Any], bwd: Callable[..., Any], dtype: torch.dtype,
                         activation: str | None) -> None:
    """linear's bodies ``fwd`` / ``bwd`` given a 64 × 17 x whose row 1 holds an inf: only row 1 of y
    and of dx may be inf or NaN."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 17, generator=g).to(dtype)
    x[1, 3] = float("inf")
    a = to_device({"x": x, "weight": (torch.randn(5, 17, generator=g) / 4).to(dtype),
                   "bias": torch.randn(5, generator=g), "activation": activation}, device())
    y, pre = fwd(*a.values())
    dx, _, _ = bwd(*a.values(), y, pre, torch.randn(64, 5, generator=g).to(dtype).to(device()))
    for name, t in (("y", y), ("dx", dx)):
        assert set((~t.isfinite()).any(1).nonzero().flatten().tolist()) <= {1}, name


def _tol_dtype(out: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """fp8 outputs have their own tolerance; everything else that of the activation dtype."""
    return out.dtype if out.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else dtype


@pytest.fixture(params=DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def dtype(request: pytest.FixtureRequest) -> torch.dtype:
    return request.param
