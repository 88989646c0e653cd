"""The mixture-of-experts specs against independent formulas: torch.topk and F.softmax for the
gating, per-expert Python loops for the permutation, matmuls and combination, and a dense
per-token MoE layer for the whole chain and its gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kpt

REF = kpt.get_backend("reference")


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


def _distinct_routes(g: torch.Generator, tokens: int, experts: int, k: int) -> torch.Tensor:
    return torch.rand(tokens, experts, generator=g).argsort(-1)[:, :k].to(torch.int32)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens, experts, k", [(64, 8, 2), (33, 128, 8), (5, 3, 3)])
def test_gating_is_softmax_then_topk(tokens: int, experts: int, k: int, renormalize: bool) -> None:
    logits = torch.randn(tokens, experts, generator=_gen(), dtype=torch.float64)
    weights, indices = REF.moe_gating(logits, k, renormalize=renormalize)
    top = torch.topk(logits, k, dim=-1)  # random float64 logits have no ties
    assert indices.dtype == torch.int32 and indices.shape == (tokens, k)
    assert torch.equal(indices.long(), top.indices)
    expected = F.softmax(logits, dim=-1).gather(1, top.indices)
    if renormalize:
        expected = expected / expected.sum(-1, keepdim=True)
        torch.testing.assert_close(weights.sum(-1), torch.ones(tokens, dtype=torch.float64))
    torch.testing.assert_close(weights, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gating_weights_are_float32(dtype: torch.dtype) -> None:
    logits = torch.randn(16, 32, generator=_gen()).to(dtype)
    weights, indices = REF.moe_gating(logits, 4)
    assert weights.dtype == torch.float32 and indices.dtype == torch.int32
    expected = F.softmax(logits.double(), -1).gather(1, indices.long())
    expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(weights.double(), expected, rtol=1e-6, atol=1e-7)


def test_gating_ties_take_the_lower_expert_first() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 1.0, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    _, indices = REF.moe_gating(logits, 3)
    assert indices.tolist() == [[1, 2, 4], [0, 1, 2]]

    # small integers in bfloat16: ties everywhere, ranked by (-logit, expert)
    g = _gen()
    logits = torch.randint(-3, 4, (50, 12), generator=g).to(torch.bfloat16)
    _, indices = REF.moe_gating(logits, 5)
    for row, got in zip(logits.tolist(), indices.tolist()):
        assert got == sorted(range(12), key=lambda e: (-row[e], e))[:5]


@pytest.mark.parametrize("renormalize", [True, False])
def test_gating_ranks_by_logit_when_probabilities_underflow(renormalize: bool) -> None:
    logits = torch.tensor([[0.0, -1000.0, -2000.0, -1001.0, -3000.0]])
    weights, indices = REF.moe_gating(logits, 3, renormalize=renormalize)
    assert indices.tolist() == [[0, 1, 3]]
    assert weights.tolist() == [[1.0, 0.0, 0.0]]


def test_gating_zero_tokens() -> None:
    weights, indices = REF.moe_gating(torch.randn(0, 16), 4)
    assert weights.shape == (0, 4) and indices.shape == (0, 4)


def _dispatch_by_loops(x: torch.Tensor, indices: torch.Tensor, experts: int):
    tokens, k = indices.shape
    order = [t * k + s for e in range(experts) for t in range(tokens) for s in range(k) if indices[t, s] == e]
    counts = torch.bincount(indices.reshape(-1).long(), minlength=experts)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    return x[[p // k for p in order]], offsets, torch.tensor(order, dtype=torch.long)


@pytest.mark.parametrize("tokens, hidden, experts, k",
                         [(40, 16, 8, 2), (17, 3, 3, 3), (7, 5, 32, 1), (0, 8, 4, 2)])
def test_dispatch_groups_rows_by_expert_stably(tokens: int, hidden: int, experts: int, k: int) -> None:
    g = _gen()
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)
    indices = _distinct_routes(g, tokens, experts, k)
    x_sorted, offsets, order = REF.moe_dispatch(x, indices, experts)
    want_x, want_offsets, want_order = _dispatch_by_loops(x, indices, experts)
    assert offsets.dtype == torch.int32 and order.dtype == torch.int32
    assert torch.equal(offsets.long(), want_offsets)
    assert torch.equal(order.long(), want_order)
    assert torch.equal(x_sorted, want_x)


def test_dispatch_with_empty_and_repeated_experts() -> None:
    x = torch.randn(4, 3, generator=_gen())
    # expert 1 and 3 receive nothing; token 2 routes twice to expert 2
    indices = torch.tensor([[2, 0], [0, 2], [2, 2], [4, 0]], dtype=torch.int32)
    x_sorted, offsets, order = REF.moe_dispatch(x, indices, 5)
    assert offsets.tolist() == [0, 3, 3, 7, 7, 8]
    assert order.tolist() == [1, 2, 7, 0, 3, 4, 5, 6]
    assert torch.equal(x_sorted, x[[0, 1, 3, 0, 1, 2, 2, 3]])


def _offsets_of(counts: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("counts", [[5, 0, 9, 2], [0, 0, 7], [1], [0, 0]])
def test_grouped_linear_is_one_matmul_per_expert(counts: list[int]) -> None:
    g = _gen()
    experts, k_dim, n_dim = len(counts), 24, 10
    offsets = _offsets_of(counts)
    x = torch.randn(sum(counts), k_dim, generator=g, dtype=torch.float64)
    weight = torch.randn(experts, n_dim, k_dim, generator=g, dtype=torch.float64)
    y = REF.grouped_linear(x, offsets, weight)
    bounds = offsets.tolist()
    expected = torch.cat([F.linear(x[bounds[e]:bounds[e + 1]], weight[e]) for e in range(experts)])
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("where", ["x_sorted", "weight"])
def test_grouped_linear_gradients_are_per_expert_with_inf(where: str) -> None:
    """An inf in one expert's rows or weight reaches that expert's gradients only, as in one
    matmul per expert (not 0 · inf = NaN in the others')."""
    g = _gen()
    offsets = _offsets_of([3, 4])
    x = torch.randn(7, 8, generator=g, dtype=torch.float64)
    weight = torch.randn(2, 5, 8, generator=g, dtype=torch.float64)
    {"x_sorted": x, "weight": weight[0]}[where][1, 2] = float("inf")
    x.requires_grad_(True)
    weight.requires_grad_(True)
    y = REF.grouped_linear(x, offsets, weight)
    dx, dweight = torch.autograd.grad(y, [x, weight], torch.ones_like(y))
    assert not dx.isnan().any() and not dweight.isnan().any()
    # expert 1 (rows 3..6) sees nothing of expert 0's inf
    assert dx[3:].isfinite().all() and dweight[1].isfinite().all()
    assert (dweight[0].isinf().any() if where == "x_sorted" else dx[:3].isinf().any())


def test_grouped_linear_float32_accumulation_for_bfloat16() -> None:
    g = _gen()
    offsets = _offsets_of([30, 0, 34])
    x = torch.randn(64, 512, generator=g).to(torch.bfloat16)
    weight = (torch.randn(3, 48, 512, generator=g) / 512**0.5).to(torch.bfloat16)
    y = REF.grouped_linear(x, offsets, weight)
    assert y.dtype == torch.bfloat16
    exact = torch.cat([F.linear(x[a:b].double(), weight[e].double())
                       for e, (a, b) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist()))])
    # one bfloat16 rounding of the output (2^-8 relative) on top of a float32 sum; a bfloat16
    # accumulation over K = 512 terms would miss this by orders of magnitude
    assert ((y.double() - exact).abs() <= 2**-8 * exact.abs() + 1e-5).all()


@pytest.mark.parametrize("tokens, k, hidden", [(30, 2, 16), (9, 3, 1), (1, 1, 4), (0, 2, 8)])
def test_combine_is_the_weighted_sum_of_each_token_slots(tokens: int, k: int, hidden: int) -> None:
    g = _gen()
    order = torch.randperm(tokens * k, generator=g).to(torch.int32)
    y_sorted = torch.randn(tokens * k, hidden, generator=g, dtype=torch.float64)
    weights = torch.rand(tokens, k, generator=g, dtype=torch.float64)
    y = REF.moe_combine(y_sorted, order, weights)
    row_of = {pair: r for r, pair in enumerate(order.tolist())}
    expected = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for s in range(k):
            expected[t] += weights[t, s] * y_sorted[row_of[t * k + s]]
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)


def test_dispatch_then_combine_is_identity_for_unit_weights() -> None:
    g = _gen()
    x = torch.randn(25, 8, generator=g).to(torch.bfloat16)
    indices = _distinct_routes(g, 25, 6, 3)
    x_sorted, _, order = REF.moe_dispatch(x, indices, 6)
    y = REF.moe_combine(x_sorted, order, torch.full((25, 3), 1 / 3))
    torch.testing.assert_close(y, x, rtol=2**-8, atol=0)


def _dense_moe(x, router, w_up, k):
    """A per-token MoE layer written independently of the kernels (torch.topk, F.linear)."""
    probs = F.softmax(x @ router.T, dim=-1)
    top = torch.topk(probs, k, dim=-1)
    weights = top.values / top.values.sum(-1, keepdim=True)
    rows = []
    for t in range(x.shape[0]):
        rows.append(sum(weights[t, s] * F.linear(x[t], w_up[top.indices[t, s]]) for s in range(k)))
    return torch.stack(rows)


def _kernel_moe(be, x, router, w_up, k):
    weights, indices = be.moe_gating(x @ router.T, k)
    x_sorted, offsets, order = be.moe_dispatch(x, indices, w_up.shape[0])
    return be.moe_combine(be.grouped_linear(x_sorted, offsets, w_up), order, weights)


def _layer_inputs(tokens: int, hidden: int = 12, experts: int = 6, out: int = 10):
    g = _gen()
    return [torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(True)
            for shape in [(tokens, hidden), (experts, hidden), (experts, out, hidden)]]


def test_moe_layer_and_its_gradients_match_a_dense_per_token_layer() -> None:
    inputs = _layer_inputs(20)
    dy = torch.randn(20, 10, dtype=torch.float64)
    got = _kernel_moe(REF, *inputs, k=2)
    want = _dense_moe(*inputs, k=2)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    got_grads = torch.autograd.grad(got, inputs, dy)
    want_grads = torch.autograd.grad(want, inputs, dy)
    for name, a, b in zip(["x", "router", "w_up"], got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=f"d{name}")


def test_moe_layer_compiles_with_dynamic_token_counts() -> None:
    compiled = torch.compile(lambda *a: _kernel_moe(REF, *a, k=2), fullgraph=True, dynamic=True,
                             backend="aot_eager")
    for tokens in (9, 23):
        inputs = _layer_inputs(tokens)
        got = compiled(*inputs)
        torch.testing.assert_close(got, _kernel_moe(REF, *inputs, k=2), rtol=1e-12, atol=1e-12)
        grads = torch.autograd.grad(got.sum(), inputs)
        want = torch.autograd.grad(_dense_moe(*inputs, k=2).sum(), inputs)
        for a, b in zip(grads, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_gradients_never_nan_for_saturated_gating() -> None:
    logits = (torch.randn(8, 16, generator=_gen(), dtype=torch.float64) * 1e3).requires_grad_(True)
    weights, _ = REF.moe_gating(logits, 4, renormalize=False)
    (grad,) = torch.autograd.grad(weights.sum(), logits)
    assert torch.isfinite(grad).all()


# -- routing values out of range: checked mode names them, unchecked results are defined --------


def test_reference_names_the_first_bad_routing_value() -> None:
    x = torch.randn(4, 8)
    indices = torch.tensor([[0, 1], [2, 3], [3, 9], [-1, 0]], dtype=torch.int32)
    with pytest.raises(kpt.KernelInputError, match=r"moe_dispatch: argument 'indices' has 9 at \[2, 1\]"):
        REF.moe_dispatch(x, indices, 4)
    offsets = torch.tensor([0, 5, 3, 6], dtype=torch.int32)
    with pytest.raises(kpt.KernelInputError, match=r"'offsets' decreases at \[2\] \(5 then 3\)"):
        REF.grouped_linear(torch.randn(6, 8), offsets, torch.randn(3, 5, 8))
    with pytest.raises(kpt.KernelInputError, match=r"'offsets' has 7 at \[3\]"):
        REF.grouped_linear(torch.randn(6, 8), torch.tensor([0, 1, 2, 7], dtype=torch.int32), torch.randn(3, 5, 8))
    order = torch.tensor([0, 1, 2, 1, 4, 5], dtype=torch.int32)
    with pytest.raises(kpt.KernelInputError, match=r"'order' repeats 1 at \[3\]"):
        REF.moe_combine(torch.randn(6, 8), order, torch.rand(3, 2))


def test_unchecked_dispatch_sorts_unrouted_pairs_last() -> None:
    x = torch.randn(3, 4, dtype=torch.float64)
    indices = torch.tensor([[1, -1], [7, 0], [1, 2]], dtype=torch.int32)  # 3 experts: -1 and 7 unrouted
    with kpt.checking_indices(False):
        x_sorted, offsets, order = REF.moe_dispatch(x, indices, 3)
    assert offsets.tolist() == [0, 1, 3, 4]
    assert order.tolist() == [3, 0, 4, 5, 1, 2]
    assert torch.equal(x_sorted, x[[1, 0, 2, 2, 0, 1]])


def test_unchecked_grouped_linear_reads_bounds_clamped_and_non_decreasing() -> None:
    x, w = torch.randn(10, 4, dtype=torch.float64), torch.randn(3, 5, 4, dtype=torch.float64)
    with kpt.checking_indices(False):
        y = REF.grouped_linear(x, torch.tensor([-4, 6, 2, 99], dtype=torch.int32), w)
    # read as [0, 6, 6, 10]: expert 0 rows 0..5, expert 1 none, expert 2 rows 6..9
    torch.testing.assert_close(y, torch.cat([x[:6] @ w[0].T, x[6:] @ w[2].T]))
    y = REF.grouped_linear(x, torch.tensor([2, 4, 4, 7], dtype=torch.int32), w)
    assert torch.equal(y[:2], torch.zeros(2, 5, dtype=torch.float64)) and torch.equal(y[7:], torch.zeros(3, 5))


def test_unchecked_combine_ignores_bad_order_values_and_takes_the_last_repeat() -> None:
    y_sorted = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    weights = torch.ones(2, 2, dtype=torch.float64)
    order = torch.tensor([0, 9, 0, 3], dtype=torch.int32)  # pair 0 named by rows 0 and 2, pairs 1, 2 by none
    with kpt.checking_indices(False):
        y = REF.moe_combine(y_sorted, order, weights)
    torch.testing.assert_close(y, torch.stack([y_sorted[2], y_sorted[3]]).detach())
    y.sum().backward()
    assert y_sorted.grad[:, 0].tolist() == [0.0, 0.0, 1.0, 1.0]  # only the rows the forward read


def test_indices_checked_by_context_then_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from kpt.spec import indices_checked

    monkeypatch.delenv("KPT_CHECK_INDICES", raising=False)
    assert not indices_checked(False) and indices_checked(True)
    monkeypatch.setenv("KPT_CHECK_INDICES", "1")
    assert indices_checked(False)
    with kpt.checking_indices(False):
        assert not indices_checked(True) and not indices_checked(False)
    monkeypatch.setenv("KPT_CHECK_INDICES", "0")
    with kpt.checking_indices():
        assert indices_checked(False)
    assert not indices_checked(False)
