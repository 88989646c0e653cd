"""Attention's gradients with a non-finite value that the causal mask hides: `check_backward`
with the second oracle accepts, per element, the reference's dense products or the value where
hidden pairs add nothing (`kpt.kernels.attention.attention_hidden_pairs_add_nothing`), and nothing else."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import kpt
from kpt.kernels.attention import attention_hidden_pairs_add_nothing
from kpt.testing import CheckReport, check_backward

REF = kpt.get_backend("reference")
SPEC = kpt.SPECS["attention"]


class _HiddenPairsAddNothing(type(REF)):
    """The reference, with gradients replaced by the second oracle's (in the inputs' dtype), then
    by ``edit`` of them."""

    def __init__(self, edit: Callable[[dict[str, torch.Tensor]], None] = lambda grads: None) -> None:
        super().__init__()
        self.edit = edit

    def call(self, kernel, **args):
        out = super().call(kernel, **args)
        grads = {}

        def oracle(do: torch.Tensor) -> None:
            grads.update(attention_hidden_pairs_add_nothing(SPEC.check((), args, self.dtypes), {"do": do}))
            self.edit(grads)

        out.register_hook(oracle)  # the upstream gradient arrives before those of q, k and v
        for name in ("q", "k", "v"):
            args[name].register_hook(lambda g, name=name: grads[name].to(g.dtype))
        return out


def _args() -> dict:
    """Causal grouped-query attention with a NaN in the first query, which sees only the first key:
    the reference's p = exp(−∞ − NaN) of the keys hidden from it carries the NaN into every dk and
    dv, the second oracle into those of the first key alone; dq of the other queries is finite in both."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, 4, 16, generator=g) for heads in (2, 1, 1))
    q[0, 0, 0, 3] = float("nan")
    return {"q": q, "k": k, "v": v, "causal": True, "scale": None}


def _check(backend: kpt.Backend, alternative: bool = True) -> CheckReport:
    return check_backward(backend, SPEC, _args(), torch.float32, torch.Generator().manual_seed(1),
                          alternative=attention_hidden_pairs_add_nothing if alternative else None)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq, skv", [(5, 7), (7, 5), (1, 1), (0, 3), (3, 0)])
def test_without_special_values_the_oracles_agree(sq: int, skv: int, causal: bool) -> None:
    g = torch.Generator().manual_seed(sq * 10 + skv)
    q, k, v = (torch.randn(2, heads, n, 16, generator=g, dtype=torch.float64).requires_grad_(True)
               for heads, n in ((6, sq), (2, skv), (2, skv)))
    out = REF.attention(q, k, v, causal=causal, scale=0.3)
    do = torch.randn(out.shape, generator=g, dtype=torch.float64)
    dense = torch.autograd.grad(out, (q, k, v), do)
    masked = attention_hidden_pairs_add_nothing({"q": q, "k": k, "v": v, "causal": causal, "scale": 0.3}, {"do": do})
    for name, want in zip("qkv", dense):
        torch.testing.assert_close(masked[name], want, rtol=1e-12, atol=1e-12, msg=f"d{name}")


def test_the_oracles_differ_only_where_the_reference_is_nan() -> None:
    args = {n: t.double().requires_grad_(True) if isinstance(t, torch.Tensor) else t for n, t in _args().items()}
    out = REF.attention(**args)
    do = torch.randn_like(out)
    dense = dict(zip("qkv", torch.autograd.grad(out, [args[n] for n in "qkv"], do)))
    masked = attention_hidden_pairs_add_nothing(SPEC.check((), args, REF.dtypes), {"do": do})
    for name in "qkv":
        differ = ~torch.isclose(dense[name], masked[name], equal_nan=True)
        assert torch.isnan(dense[name][differ]).all() and torch.isfinite(masked[name][differ]).all()
    assert torch.isnan(dense["k"]).all() and torch.isfinite(masked["k"][:, :, 1:]).all()
    assert torch.isfinite(dense["q"][:, :, 1:]).all() and torch.isfinite(dense["q"][:, 1]).all()


def test_the_dense_gradients_pass() -> None:
    report = _check(REF)
    assert report.ok, report.message


def test_gradients_where_hidden_pairs_add_nothing_pass() -> None:
    report = _check(_HiddenPairsAddNothing())
    assert report.ok, report.message
    # the reference alone would not have them
    assert not _check(_HiddenPairsAddNothing(), alternative=False).ok


def test_nan_where_both_oracles_are_finite_fails() -> None:
    def poison(grads: dict[str, torch.Tensor]) -> None:
        grads["q"][0, 0, 2, 5] = float("nan")

    report = _check(_HiddenPairsAddNothing(poison))
    assert not report.ok and "dq" in report.message
