"""Generic checks of every kernel spec: the contract must be self-consistent before it judges backends.

* each reference backward equals torch autograd of the reference forward, in float64;
* each kernel's op passes ``torch.library.opcheck`` and traces with ``fullgraph=True``;
* each documented bad input raises its documented error through a backend call;
* the cost model is defined for every case.
"""

from __future__ import annotations

import pytest
import torch

import kpt
from kpt.ops import as_tuple

REF = kpt.get_backend("reference")
SPECS = list(kpt.SPECS.values())
DIFFERENTIABLE = [s for s in SPECS if s.differentiable]


def _f64(args: dict) -> dict:
    return {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() and v.element_size() > 1
            else v for k, v in args.items()}


def _small_cases(spec: kpt.KernelSpec) -> list[kpt.Case]:
    return [c for c in spec.cases() if not c.device_only]


def _forward_args(spec: kpt.KernelSpec, args: dict, needs_grad: bool) -> list:
    return spec.forward_values(spec.check((), args, REF.dtypes), needs_grad)


@pytest.mark.parametrize("spec", DIFFERENTIABLE, ids=lambda s: s.name)
def test_reference_backward_matches_autograd(spec: kpt.KernelSpec) -> None:
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    for case in _small_cases(spec):
        if not case.grad:
            continue
        args = _f64(case.make(g, torch.float64))
        for name in spec.differentiable:
            if isinstance(args[name], torch.Tensor):
                args[name] = args[name].detach().requires_grad_(True)
        values = _forward_args(spec, args, needs_grad=True)
        outs = as_tuple(spec.forward(*values))
        public = outs[: len(spec.outputs)]
        grads = [torch.randn_like(o) if o.is_floating_point() else None for o in public]
        inputs = [args[n] for n in spec.differentiable if isinstance(args[n], torch.Tensor)]
        pairs = [(o, gr) for o, gr in zip(public, grads) if gr is not None and o.requires_grad]
        expected = torch.autograd.grad([o for o, _ in pairs], inputs, [gr for _, gr in pairs],
                                       allow_unused=True) if pairs else [None] * len(inputs)
        detached = [v.detach() if isinstance(v, torch.Tensor) else v for v in values]
        results = as_tuple(spec.backward(*detached, *(o.detach() for o in outs), *grads))
        if spec.grads is not None:
            results = spec.grads(results)
        got = [r for n, r in zip(spec.differentiable, results) if isinstance(args[n], torch.Tensor)]
        for name, e, r in zip(spec.differentiable, expected, got):
            e = torch.zeros_like(r) if e is None else e
            assert r.shape == e.shape, f"{spec.name}/{case.name}: d{name} shape {r.shape} != {e.shape}"
            torch.testing.assert_close(r, e, rtol=1e-9, atol=1e-9, msg=f"{spec.name}/{case.name}: d{name}")


def _first_nonempty(spec: kpt.KernelSpec, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(0)
    for case in _small_cases(spec):
        if case.dtypes and dtype not in case.dtypes:
            continue
        args = case.make(g, dtype)
        if all(v.numel() > 0 for v in args.values() if isinstance(v, torch.Tensor)):
            return args
    raise AssertionError(f"{spec.name} has no non-empty case")


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_opcheck(spec: kpt.KernelSpec) -> None:
    args = _first_nonempty(spec, torch.float32)
    for name in spec.differentiable:
        if isinstance(args[name], torch.Tensor):
            args[name] = args[name].requires_grad_(True)
    op = getattr(torch.ops, REF.op_namespace)
    REF.call(spec.name, **args)  # registers the ops
    values = _forward_args(spec, args, needs_grad=bool(spec.differentiable))
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if any(isinstance(v, torch.Tensor) and v.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for v in values):
        utils = utils[1:]  # the schema check compares inputs with allclose, which CPU float8 lacks
    torch.library.opcheck(getattr(op, spec.name).default, tuple(values), test_utils=utils)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_fullgraph_trace(spec: kpt.KernelSpec) -> None:
    torch._dynamo.reset()  # a fresh trace per kernel: one shared lambda would hit the recompile limit
    args = _first_nonempty(spec, torch.float32)
    compiled = torch.compile(lambda **kw: REF.call(spec.name, **kw), fullgraph=True, backend="aot_eager")
    for expected, got in zip(as_tuple(REF.call(spec.name, **args)), as_tuple(compiled(**args))):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_compiled_call_differentiates_with_inductor() -> None:
    x = torch.randn(8, 64, requires_grad=True)
    w = torch.randn(64, requires_grad=True)
    compiled = torch.compile(lambda x, w: REF.rms_norm(x, w).square().sum(), fullgraph=True)
    compiled(x, w).backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    REF.rms_norm(x, w).square().sum().backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)


@pytest.mark.parametrize(
    "spec, bad", [(s, b) for s in SPECS for b in s.bad_inputs()], ids=lambda v: getattr(v, "name", "")
)
def test_bad_input_raises(spec: kpt.KernelSpec, bad: kpt.BadInput) -> None:
    with pytest.raises(bad.error) as info:
        REF.call(spec.name, **bad.make())
    assert spec.name in str(info.value), f"the error must name the kernel: {info.value}"


def test_unknown_argument_is_an_input_error() -> None:
    with pytest.raises(kpt.KernelInputError, match="rms_norm"):
        REF.call("rms_norm", torch.randn(2, 4), bogus=1)
    # the kernel methods have the contract's signature; a call that does not bind names its parameters
    with pytest.raises(kpt.KernelInputError, match=r"rms_norm: no parameter 'bogus'; its parameters: rms_norm\(x,"):
        REF.rms_norm(torch.randn(2, 4), bogus=1)  # type: ignore[call-arg]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_cost_model(spec: kpt.KernelSpec) -> None:
    args = _first_nonempty(spec, torch.float32)
    outs = as_tuple(REF.call(spec.name, **args))
    assert spec.flops(spec.check((), args, REF.dtypes)) >= 0
    assert spec.min_bytes(args, outs) > 0


def test_every_spec_has_the_conformance_ingredients() -> None:
    for spec in SPECS:
        cases = spec.cases()
        assert sum(c.perf for c in cases) == 1, f"{spec.name}: needs exactly one perf case"
        assert any(not c.device_only for c in cases), f"{spec.name}: no numerics case the CPU profiles run"
        assert spec.bad_inputs(), f"{spec.name}: no bad-input case"
        assert spec.signature.__doc__, f"{spec.name}: no docstring"



def test_eager_and_compiled_paths_agree_and_reused_gradients_cannot_be_reused_twice() -> None:
    """Eager calls skip the custom op, compiled ones trace it: same numbers. A gradient that the
    forward prepared is scaled in place by the eager backward, so a second backward through the
    same graph must raise instead of scaling it again."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 50, (6,), generator=g)
    loss = REF.cross_entropy(logits, target)
    (eager,) = torch.autograd.grad(loss * 3.0, logits, retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        torch.autograd.grad(loss, logits)
    compiled = torch.compile(lambda x: REF.cross_entropy(x, target) * 3.0, backend="aot_eager", fullgraph=True)
    (traced,) = torch.autograd.grad(compiled(logits), logits)
    torch.testing.assert_close(eager, traced, rtol=0, atol=0)


def test_inputs_the_backward_never_reads_are_not_kept() -> None:
    import weakref

    logits = torch.randn(4, 10, dtype=torch.float64, requires_grad=True)
    view = logits * 1.0
    alive = weakref.ref(view)
    loss = REF.cross_entropy(view, torch.tensor([1, 2, 3, 4]))
    del view
    assert alive() is None, "cross_entropy's autograd node keeps its logits alive"
    loss.backward()
    assert logits.grad is not None


def test_a_call_tolerance_defaults_to_the_kernel_tolerance_and_is_asked_with_the_call() -> None:
    from kpt.testing import tolerance_for

    class Strict(kpt.get_backend("reference").__class__):
        def call_tolerance(self, kernel, dtype, args, output):
            wide = args["x"].shape[-1] > 8 and output == "y"
            return kpt.Tolerance(1e-3, 1e-3, 1e-3, "wide rows") if wide else self.tolerance(kernel, dtype)

    be = kpt.get_backend("reference")
    x = torch.randn(2, 16)
    assert be.call_tolerance("gelu", torch.float32, {"x": x}, "y") is None
    y = torch.empty(2, 16)
    assert tolerance_for(Strict(), "gelu", torch.float32, y, args={"x": x}, output="y").reason == "wide rows"
    assert tolerance_for(Strict(), "gelu", torch.float32, y) == kpt.default_tolerance(torch.float32)


def test_rows_flattens_leading_dimensions_and_keeps_2d_tensors() -> None:
    from kpt.spec import rows

    t = torch.arange(24.0).reshape(2, 3, 4)
    r = rows(t)
    assert r.shape == (6, 4) and r.data_ptr() == t.data_ptr()
    m = torch.empty(5, 7).t()  # a 2-D tensor is returned as it is, strides and all
    assert rows(m) is m
    assert rows(torch.empty(0, 3, 2)).shape == (0, 2)
    assert rows(torch.empty(4)).shape == (1, 4)
