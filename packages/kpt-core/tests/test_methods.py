"""The kernel methods (`kpt.methods`, generated from `kpt.SPECS`): each backend method carries the
contract's signature, type hints and docstring, and the generated file matches the contract."""

from __future__ import annotations

import inspect

import pytest
import torch

import kpt
from kpt.codegen import METHODS_FILE, kernel_methods_source

REF = kpt.get_backend("reference")


def test_generated_methods_match_the_contract() -> None:
    assert METHODS_FILE.read_text() == kernel_methods_source(), (
        "kpt/methods.py differs from the contract: regenerate it with `python -m kpt.codegen`")


@pytest.mark.parametrize("spec", kpt.SPECS.values(), ids=lambda s: s.name)
def test_method_has_the_contract_signature_and_docstring(spec: kpt.KernelSpec) -> None:
    method = getattr(REF, spec.name)
    assert inspect.signature(method) == inspect.signature(spec.signature)
    assert inspect.getdoc(method) == inspect.getdoc(spec.signature)
    # declared on the class, where editors and type checkers look, not attached at run time
    assert spec.name in vars(kpt.methods.KernelMethods)


def test_first_argument_is_not_taken_as_self() -> None:
    assert list(inspect.signature(REF.rms_norm).parameters)[:2] == ["x", "weight"]
    assert list(inspect.signature(REF.cross_entropy).parameters)[0] == "logits"
    assert list(inspect.signature(REF.attention).parameters)[:3] == ["q", "k", "v"]


def test_method_calls_the_backend_with_keywords_and_defaults() -> None:
    x, w = torch.randn(3, 8), torch.rand(8)
    assert torch.equal(REF.rms_norm(x, weight=w), REF.call("rms_norm", x, w, 1e-6))
    assert torch.equal(REF.softmax(x), REF.call("softmax", x, dim=-1))


def test_every_kernel_is_listed() -> None:
    assert kpt.list_kernels() == list(kpt.SPECS)
    assert "rms_norm" in kpt.list_kernels() and "attention" in kpt.list_kernels()


class _Fusing(kpt.reference.ReferenceBackend):
    name = "fusing-test"
    compiler_fuses = frozenset({"rms_norm"})


def test_compiler_fuses_gives_the_compiler_the_contract_expression_not_the_op() -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    be = _Fusing()
    be.register_ops()
    x = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    up = torch.randn(5, 16, dtype=torch.float64)

    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return be.swiglu(be.rms_norm(x, w), up)

    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    y = torch.compile(block, backend=counter, fullgraph=True)(x, w)
    gx, gw = torch.autograd.grad(y.square().sum(), (x, w))
    ops = {str(n.target) for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert "kpt_fusing_test.swiglu.default" in ops  # a kernel not in compiler_fuses stays an op
    assert not any("rms_norm" in op for op in ops), ops
    eager = block(x, w)  # eager calls run the backend's kernel, whatever compiler_fuses says
    ex, ew = torch.autograd.grad(eager.square().sum(), (x, w))
    torch.testing.assert_close(y, eager, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close((gx, gw), (ex, ew), rtol=1e-10, atol=1e-12)
