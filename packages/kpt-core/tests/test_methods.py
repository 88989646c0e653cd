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
