"""The cross-entropy specs against F.cross_entropy (and F.linear before it) in float64, forward and
gradients, and the edge semantics of the contract: ignored rows (all of them: 0, never NaN), an
ignore_index that is a real class, zero rows, extreme logits; and, for linear_cross_entropy, that
no [N, V] logits are ever held and that the fused path costs three matrix products in all."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import kpt
from kpt.kernels import cross_entropy as ce_module

REF = kpt.get_backend("reference")
CE = kpt.SPECS["cross_entropy"]
LCE = kpt.SPECS["linear_cross_entropy"]
REDUCTIONS = ["mean", "sum", "none"]


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


def _targets(g: torch.Generator, n: int, v: int, ignore_index: int = -100, every: int = 3) -> torch.Tensor:
    """Random classes, every ``every``-th row ignored (none when ``every`` is 0)."""
    target = torch.randint(0, v, (n,), generator=g)
    if every:
        target[::every] = ignore_index
    return target


def _grad_out(loss: torch.Tensor) -> torch.Tensor:
    return torch.randn_like(loss)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1, 1.0])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("n, v", [(33, 50), (4, 1000), (1, 1)], ids=str)
def test_matches_F_cross_entropy(n: int, v: int, reduction: str, label_smoothing: float) -> None:
    g = _gen()
    logits = (torch.randn(n, v, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    target = _targets(g, n, v, every=3 if n > 1 else 0)
    loss = REF.cross_entropy(logits, target, label_smoothing=label_smoothing, reduction=reduction)
    expected = F.cross_entropy(logits, target, label_smoothing=label_smoothing, reduction=reduction)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    dloss = _grad_out(loss)
    (got,) = torch.autograd.grad(loss, logits, dloss)
    (want,) = torch.autograd.grad(expected, logits, dloss)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_ignored_gives_zero_never_nan(reduction: str) -> None:
    logits = torch.randn(6, 20, generator=_gen(), dtype=torch.float64, requires_grad=True)
    target = torch.full((6,), -100)
    loss = REF.cross_entropy(logits, target, reduction=reduction, label_smoothing=0.1)
    assert torch.equal(loss, torch.zeros_like(loss)), loss  # F.cross_entropy gives NaN for "mean"
    (grad,) = torch.autograd.grad(loss, logits, torch.ones_like(loss))
    assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_an_ignored_row_adds_nothing_whatever_it_holds(value: float) -> None:
    """Its gradient is 0, not 0 · NaN, and in linear_cross_entropy its hidden state reaches neither
    dweight nor dbias (`kpt.kernels`, special values)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5, generator=g, dtype=torch.float64)
    logits[1, 2] = value
    target = torch.tensor([0, -100, 4])
    x = logits.requires_grad_(True)
    (dlogits,) = torch.autograd.grad(REF.cross_entropy(x, target, reduction="sum"), [x])
    assert dlogits[1].eq(0).all() and dlogits.isfinite().all()
    hidden = torch.randn(3, 4, generator=g, dtype=torch.float64)
    hidden[1, 0] = value
    leaves = [hidden.requires_grad_(True), torch.randn(5, 4, generator=g, dtype=torch.float64).requires_grad_(True),
              torch.randn(5, generator=g, dtype=torch.float64).requires_grad_(True)]
    loss = REF.linear_cross_entropy(leaves[0], leaves[1], target, leaves[2], reduction="mean")
    dhidden, dweight, dbias = torch.autograd.grad(loss, leaves)
    assert loss.isfinite() and dhidden[1].eq(0).all()
    assert all(bool(t.isfinite().all()) for t in (dhidden, dweight, dbias))


def test_a_nan_logit_beside_a_plus_inf_one_gives_nan() -> None:
    logits = torch.tensor([[float("inf"), float("nan"), 0.0], [float("inf"), 0.0, 1.0]], dtype=torch.float64)
    loss = REF.cross_entropy(logits, torch.tensor([2, 2]), reduction="none")
    assert loss[0].isnan() and loss[1] == float("inf")


def test_ignore_index_may_be_a_real_class() -> None:
    g = _gen()
    logits = torch.randn(40, 5, generator=g, dtype=torch.float64)
    target = torch.randint(0, 5, (40,), generator=g)
    loss = REF.cross_entropy(logits, target, ignore_index=2)
    kept = target != 2
    torch.testing.assert_close(loss, F.cross_entropy(logits[kept], target[kept]), rtol=1e-12, atol=1e-12)


def test_ignore_index_outside_the_classes() -> None:
    g = _gen()
    logits = torch.randn(9, 7, generator=g, dtype=torch.float64)
    target = _targets(g, 9, 7, ignore_index=10**6)
    loss = REF.cross_entropy(logits, target, ignore_index=10**6, reduction="none")
    torch.testing.assert_close(loss, F.cross_entropy(logits, target, ignore_index=10**6, reduction="none"))


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_zero_rows(reduction: str) -> None:
    logits = torch.randn(0, 10, dtype=torch.float64, requires_grad=True)
    loss = REF.cross_entropy(logits, torch.zeros(0, dtype=torch.int64), reduction=reduction)
    assert loss.shape == ((0,) if reduction == "none" else ())
    assert not loss.isnan().any() and (loss.numel() == 0 or loss.item() == 0)
    (grad,) = torch.autograd.grad(loss, logits, torch.ones_like(loss))
    assert grad.shape == (0, 10)


def test_extreme_logits_stay_finite() -> None:
    g = _gen()
    logits = torch.randn(16, 2048, generator=g, dtype=torch.float64) * 1e4
    target = _targets(g, 16, 2048)
    for dtype in (torch.float64, torch.float32, torch.float16):
        x = logits.to(dtype).requires_grad_(True)
        loss = REF.cross_entropy(x, target)
        (grad,) = torch.autograd.grad(loss, x)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        expected = F.cross_entropy(x.detach().double(), target)
        torch.testing.assert_close(loss.double(), expected, rtol=kpt.default_tolerance(dtype).rtol, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_forward_prepares_the_gradient_and_backward_scales_it(dtype: torch.dtype) -> None:
    g = _gen()
    logits = torch.randn(8, 300, generator=g).to(dtype)
    target = _targets(g, 8, 300)
    loss, empty = CE.forward(logits, target, -100, 0.0, "none", False)
    assert loss.dtype == torch.float32 and empty.numel() == 0  # the loss is float32 whatever the dtype
    loss, dlogits = CE.forward(logits, target, -100, 0.0, "none", True)
    expected = torch.softmax(logits.float(), -1) - F.one_hot(target.clamp(min=0), 300)
    expected[target == -100] = 0
    assert dlogits.dtype == dtype and dlogits.is_contiguous()
    torch.testing.assert_close(dlogits, expected.to(dtype))
    dloss = torch.randn(8, generator=g).to(dtype)
    (scaled,) = CE.backward(None, target, -100, 0.0, "none", True, loss, dlogits, dloss)
    assert scaled.dtype == dtype
    torch.testing.assert_close(scaled, (dlogits.float() * dloss.float()[:, None]).to(dtype))


def test_transposed_logits_give_contiguous_gradients() -> None:
    g = _gen()
    logits = torch.randn(50, 12, generator=g, dtype=torch.float64).T.requires_grad_(True)  # [12, 50]
    target = _targets(g, 12, 50)
    (grad,) = torch.autograd.grad(REF.cross_entropy(logits, target), logits)
    (want,) = torch.autograd.grad(F.cross_entropy(logits, target), logits)
    torch.testing.assert_close(grad, want, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# linear_cross_entropy


def _lce_inputs(n: int, k: int, v: int, bias: bool, dtype: torch.dtype = torch.float64, every: int = 3):
    g = _gen()
    hidden = torch.randn(n, k, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(v, k, generator=g, dtype=torch.float64) * k**-0.5).to(dtype)
    b = torch.randn(v, generator=g, dtype=torch.float64).to(dtype) if bias else None
    return hidden, weight, _targets(g, n, v, every=every), b


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("n, k, v", [(33, 16, 70), (1, 1, 1), (5, 64, 4097)], ids=str)
def test_linear_cross_entropy_matches_unfused(n: int, k: int, v: int, reduction: str, bias: bool) -> None:
    hidden, weight, target, b = _lce_inputs(n, k, v, bias, every=3 if n > 1 else 0)
    leaves = [t.requires_grad_(True) for t in (hidden, weight, b) if t is not None]
    loss = REF.linear_cross_entropy(hidden, weight, target, b, reduction=reduction)
    expected = F.cross_entropy(F.linear(hidden, weight, b), target, reduction=reduction)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    dloss = _grad_out(loss)
    want = torch.autograd.grad(expected, leaves, dloss)
    for name, got, exp in zip(["hidden", "weight", "bias"], torch.autograd.grad(loss, leaves, dloss), want):
        torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-12, msg=f"d{name}")


class _LargestLogits(TorchDispatchMode):
    """Records the most rows of any op result shaped ``[rows, V]`` (but weightᵀ, ``[K, V]``)."""

    def __init__(self, k: int, v: int) -> None:
        super().__init__()
        self.k, self.v = k, v
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[1] == self.v and t.shape[0] != self.k:
                self.rows = max(self.rows, t.shape[0])
        return out


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_linear_cross_entropy_works_chunk_by_chunk(monkeypatch: pytest.MonkeyPatch, reduction: str) -> None:
    n, k, v, chunk = 17, 8, 40, 5  # 17 rows: three chunks of 5 and one of 2; K differs from all
    monkeypatch.setattr(ce_module, "CHUNK_ELEMENTS", chunk * v)
    hidden, weight, target, b = _lce_inputs(n, k, v, bias=True)
    args = (hidden, weight, target, b, -100, reduction)
    with _LargestLogits(k, v) as fwd_mode, FlopCounterMode(display=False) as fwd_flops:
        outs = LCE.forward(*args, True)
    dloss = torch.randn_like(outs[0])
    with _LargestLogits(k, v) as bwd_mode, FlopCounterMode(display=False) as bwd_flops:
        dhidden, dweight, dbias = LCE.backward(*args, True, *outs, dloss)
    assert fwd_mode.rows == chunk and bwd_mode.rows <= chunk

    gemm = 2 * n * k * v
    # mean/sum: logits and both gradients during the forward, the backward only scales;
    # none: logits in the forward, logits again and both gradients in the backward
    fused = reduction != "none"
    assert fwd_flops.get_total_flops() == (3 if fused else 1) * gemm
    assert bwd_flops.get_total_flops() == (0 if fused else 3) * gemm

    leaves = [t.requires_grad_(True) for t in (hidden, weight, b)]
    expected = F.cross_entropy(F.linear(hidden, weight, b), target, reduction=reduction)
    torch.testing.assert_close(outs[0], expected.detach(), rtol=1e-12, atol=1e-12)
    want = torch.autograd.grad(expected, leaves, dloss)
    for got, exp in zip((dhidden, dweight, dbias), want):
        torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-12)


def test_linear_cross_entropy_without_grad_makes_no_gradients() -> None:
    hidden, weight, target, b = _lce_inputs(9, 16, 30, bias=True)
    with FlopCounterMode(display=False) as flops:
        loss, dhidden, dweight, dbias, lse = LCE.forward(hidden, weight, target, b, -100, "mean", False)
    assert flops.get_total_flops() == 2 * 9 * 16 * 30
    assert dhidden.numel() == dweight.numel() == dbias.numel() == 0
    torch.testing.assert_close(lse, torch.logsumexp(F.linear(hidden, weight, b), -1), rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(REF.linear_cross_entropy(hidden, weight, target, b), loss, rtol=0, atol=0)


def test_linear_cross_entropy_all_ignored_and_zero_rows() -> None:
    for n, every in ((6, 1), (0, 0)):
        hidden, weight, target, _ = _lce_inputs(n, 8, 12, bias=False, every=every)
        hidden.requires_grad_(True)
        weight.requires_grad_(True)
        loss = REF.linear_cross_entropy(hidden, weight, target)
        assert loss.shape == () and loss.item() == 0
        dh, dw = torch.autograd.grad(loss, (hidden, weight))
        assert torch.equal(dh, torch.zeros_like(hidden)) and torch.equal(dw, torch.zeros_like(weight))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_linear_cross_entropy_mixed_precision(dtype: torch.dtype) -> None:
    hidden, weight, target, _ = _lce_inputs(16, 32, 100, bias=False, dtype=dtype)
    b = torch.randn(100, generator=_gen(), dtype=torch.float32)
    leaves = [t.requires_grad_(True) for t in (hidden, weight, b)]
    loss = REF.linear_cross_entropy(hidden, weight, target, b)
    assert loss.dtype == torch.float32  # whatever the activations' dtype, as transformers' loss
    grads = torch.autograd.grad(loss, leaves)
    assert [t.dtype for t in grads] == [dtype, dtype, torch.float32]
    expected = F.cross_entropy(F.linear(hidden.double(), weight.double(), b.double()), target)
    torch.testing.assert_close(loss.double(), expected, rtol=kpt.default_tolerance(dtype).rtol, atol=0)


def test_bad_input_messages_say_what_was_given() -> None:
    hidden, weight, target, _ = _lce_inputs(4, 8, 10, bias=False)
    message = r"linear_cross_entropy: argument 'weight' has shape \(10, 9\); expected \[V, 8\]"
    with pytest.raises(kpt.KernelInputError, match=message):
        REF.linear_cross_entropy(hidden, torch.randn(10, 9, dtype=torch.float64), target)
    with pytest.raises(kpt.KernelInputError, match=r"cross_entropy: argument 'target' has dtype torch.int32"):
        REF.cross_entropy(torch.randn(4, 10), torch.zeros(4, dtype=torch.int32))
    with pytest.raises(kpt.KernelInputError, match=r"argument 'reduction' is 'avg'"):
        REF.cross_entropy(torch.randn(4, 10), torch.zeros(4, dtype=torch.int64), reduction="avg")


def test_target_out_of_range_is_named_or_gives_nan() -> None:
    logits = torch.randn(4, 10, dtype=torch.float64)
    target = torch.tensor([1, -100, 10, -5])
    with pytest.raises(kpt.KernelInputError, match=r"'target' has 10 at \[2\]; expected values in \[0, 10\)"):
        REF.cross_entropy(logits, target)
    with kpt.checking_indices(False):
        losses = REF.cross_entropy(logits, target, reduction="none")
    expected = F.cross_entropy(logits[:1], target[:1], reduction="none")
    torch.testing.assert_close(losses[:2], torch.cat([expected, torch.zeros(1, dtype=torch.float64)]))
    assert losses[2:].isnan().all()
