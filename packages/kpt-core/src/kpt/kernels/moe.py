"""Mixture of experts: routing (``moe_gating``), permutation (``moe_dispatch``), the per-expert
matmul (``grouped_linear``) and the weighted un-permutation (``moe_combine``).

A token t of T picks k of E experts; its k (token, slot) pairs are numbered ``t·k + slot``:

    p          = softmax(logits[t])                      (float32, float64 for float64)
    indices[t] = the k largest logits, larger first, equal logits lower expert first
    weights[t] = p[indices[t]]  /  Σ_slot p[indices[t]]   (the division only with renormalize)

    order      = the pairs stably sorted by expert;  x_sorted[r] = x[order[r] // k]
    offsets[e] = number of pairs routed to experts < e       (offsets[0] = 0, offsets[E] = T·k)
    y_sorted[r] = x_sorted[r] @ weight[e].T    for offsets[e] <= r < offsets[e+1]
    y[t]       = Σ_slot weights[t, slot] · y_sorted[row of pair t·k + slot]

Backward, with w the gating weights and dw their gradient:
    dlogits     = scatter(w ⊙ (dw − Σ dw ⊙ w))                 (renormalize: a softmax over the k)
    dlogits     = p ⊙ (dp − Σ dp ⊙ p),  dp = scatter(dw)        (no renormalize)
    dx[t]       = Σ_slot dx_sorted[row of pair t·k + slot]
    dx_sorted   = dy_sorted @ weight[e],  dweight[e] = dy_sorted[rows of e].T @ x_sorted[rows of e]
    dy_sorted[r] = weights[pair r] · dy[token of pair r],  dweights[pair] = dy[t] · y_sorted[row of pair]

The reference runs on fake tensors, so it never reads routing values on the host: the per-expert
matmul is E masked dense matmuls (E times the work of a real kernel, exact all the same).

Routing values are checked only where values are checked (`kpt.checking_indices`; the reference
backend always): reading them would synchronize with the device. Unchecked, every backend stays
inside its tensors and gives these defined results for values out of range:

    moe_dispatch    a pair whose expert is outside [0, E) goes to no expert: such pairs sort after
                    the last expert's rows, in pair order, and offsets[E] counts the routed pairs
    grouped_linear  offsets are read as clamp(offsets, 0, M) made non-decreasing by a running
                    maximum; rows outside [offsets[0], offsets[E]) give 0
    moe_combine     an order value outside [0, T·k) is ignored; a pair no row names gives 0; a pair
                    named by several rows takes the last of them (the other rows get no gradient)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor

from ..spec import (
    PARTIAL,
    Args,
    BadIndices,
    BadInput,
    Case,
    Check,
    KernelSpec,
    compute_dtype,
    each_dim,
    identity,
    randn,
    strided,
    transposed,
)

INDEX_DTYPES = (torch.int32,)
"""Routing tensors (indices, offsets, order) are int32: a call whose experts, pairs or rows reach
2³¹ is refused (`_int32_count`), as they could not be numbered."""


def moe_gating(logits: Tensor, k: int, renormalize: bool = True) -> tuple[Tensor, Tensor]:
    """Top-k expert routing.

    ``p = softmax(logits, -1)`` in float32; the k experts with the largest logits (larger first;
    equal logits: lower expert index first) give ``indices`` and ``weights = p[indices]``,
    divided by their sum when ``renormalize``. Ranking by logit is ranking by probability
    except where probabilities round to equal values, which the logit order still separates.
    ``logits``: ``[T, E]``; ``1 <= k <= E``. Returns ``(weights, indices)``: weights float32
    ``[T, k]`` (float64 for float64 logits), indices int32 ``[T, k]``.
    Differentiable with respect to ``logits`` (through ``weights``).
    """
    raise AssertionError("signature only: call backend.moe_gating")


def moe_dispatch(x: Tensor, indices: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """Permute token rows into expert order.

    Every token row is repeated once per slot and the ``T·k`` copies are grouped by expert,
    stably (within an expert, in order of ``t·k + slot``). ``x``: ``[T, H]``; ``indices``:
    int32 ``[T, k]`` with values in ``[0, num_experts)`` (checked in checked mode; unchecked, a
    pair out of range goes to no expert and sorts after the last expert's rows). Returns
    ``(x_sorted [T·k, H], offsets int32 [E+1], order int32 [T·k])`` where expert e owns rows
    ``offsets[e]:offsets[e+1]`` and ``order[r] = t·k + slot`` of sorted row r.
    Differentiable with respect to ``x``.
    """
    raise AssertionError("signature only: call backend.moe_dispatch")


def grouped_linear(x_sorted: Tensor, offsets: Tensor, weight: Tensor) -> Tensor:
    """One matmul per expert over its contiguous block of rows.

    ``y[r] = x_sorted[r] @ weight[e].T`` for ``offsets[e] <= r < offsets[e+1]``, float32
    accumulation. ``x_sorted``: ``[M, K]``; ``offsets``: int32 ``[E+1]``, non-decreasing, in
    ``[0, M]`` (checked in checked mode; unchecked, read as clamped to ``[0, M]`` and made
    non-decreasing); rows outside ``[offsets[0], offsets[E])`` give 0; ``weight``: ``[E, N, K]``, dtype of x_sorted.
    Returns ``y [M, N]`` in x_sorted's dtype. Differentiable with respect to ``x_sorted`` and
    ``weight``.
    """
    raise AssertionError("signature only: call backend.grouped_linear")


def moe_combine(y_sorted: Tensor, order: Tensor, weights: Tensor) -> Tensor:
    """Un-permute expert outputs and sum each token's k slots, weighted.

    ``y[t] = Σ_slot weights[t, slot] · y_sorted[r]`` where ``order[r] = t·k + slot``; float32
    accumulation. ``y_sorted``: ``[T·k, H]``; ``order``: int32 ``[T·k]``, a permutation (as
    `moe_dispatch` returns; checked in checked mode; unchecked, a value out of range is ignored, a
    pair no row names gives 0 and a pair named twice takes the later row); ``weights``:
    ``[T, k]``, float32 or y_sorted's dtype. Returns ``y [T, H]`` in y_sorted's dtype.
    Differentiable with respect to ``y_sorted`` and ``weights``.
    """
    raise AssertionError("signature only: call backend.moe_combine")


# ---------------------------------------------------------------------------------------------
# Validation.


def _index(c: Check, arg: str, t: Any, ndim: int, like: Tensor) -> Tensor:
    c.tensor(arg, t, ndim=ndim, dtypes=INDEX_DTYPES)
    c.same_device(arg, t, like)
    return t


def _int32_count(c: Check, arg: str, count: int, what: str, numbered: str) -> None:
    """Refuse ``count`` things (experts, pairs, rows) of ``arg`` that int32 ``numbered`` cannot number."""
    if count >= 2**31:
        raise c.fail(arg, f"has {count} {what}, more than the int32 {numbered} can number (2**31 - 1)")


def validate_moe_gating(a: Args, dtypes: tuple[torch.dtype, ...]) -> Args:
    c = Check("moe_gating", dtypes)
    logits = c.tensor("logits", a["logits"], ndim=2)
    _int32_count(c, "logits", logits.shape[1], "experts", "indices")
    c.number("k", a["k"], low=1, high=logits.shape[1], integer=True)
    if not isinstance(a["renormalize"], bool):
        raise c.fail("renormalize", f"is {a['renormalize']!r}; expected True or False")
    return a


def validate_moe_dispatch(a: Args, dtypes: tuple[torch.dtype, ...]) -> Args:
    c = Check("moe_dispatch", dtypes)
    x = c.tensor("x", a["x"], ndim=2)
    indices = _index(c, "indices", a["indices"], 2, x)
    if indices.shape[0] != x.shape[0]:
        raise c.fail("indices", f"has shape {tuple(indices.shape)}; expected [{x.shape[0]}, k] "
                                "(one row per token of x)")
    _int32_count(c, "indices", indices.numel(), "(token, slot) pairs", "order and offsets")
    c.number("num_experts", a["num_experts"], low=1, high=2**31 - 1, integer=True)
    return a


def validate_grouped_linear(a: Args, dtypes: tuple[torch.dtype, ...]) -> Args:
    c = Check("grouped_linear", dtypes)
    x = c.tensor("x_sorted", a["x_sorted"], ndim=2)
    weight = c.tensor("weight", a["weight"], ndim=3)
    c.same_dtype("weight", weight, x, "x_sorted")
    c.same_device("weight", weight, x)
    if weight.shape[2] != x.shape[1]:
        raise c.fail("weight", f"has shape {tuple(weight.shape)}; expected [E, N, {x.shape[1]}] (K of x_sorted)")
    offsets = _index(c, "offsets", a["offsets"], 1, x)
    c.shape("offsets", offsets, (weight.shape[0] + 1,))
    _int32_count(c, "x_sorted", x.shape[0], "rows", "offsets")
    return a


def validate_moe_combine(a: Args, dtypes: tuple[torch.dtype, ...]) -> Args:
    c = Check("moe_combine", dtypes)
    y = c.tensor("y_sorted", a["y_sorted"], ndim=2)
    weights = c.tensor("weights", a["weights"], ndim=2, dtypes=(torch.float32, y.dtype))
    c.same_device("weights", weights, y)
    if weights.shape[0] * weights.shape[1] != y.shape[0]:
        raise c.fail("weights", f"has shape {tuple(weights.shape)}; expected [T, k] with T·k = {y.shape[0]} "
                                "(the rows of y_sorted)")
    order = _index(c, "order", a["order"], 1, y)
    c.shape("order", order, (y.shape[0],))
    _int32_count(c, "order", order.shape[0], "(token, slot) pairs", "order")
    return a


def check_moe_dispatch_indices(a: Args) -> None:
    Check("moe_dispatch", ()).values_in("indices", a["indices"], 0, a["num_experts"], "num_experts")


def check_grouped_linear_indices(a: Args) -> None:
    c = Check("grouped_linear", ())
    offsets, rows = a["offsets"], a["x_sorted"].shape[0]
    c.values_in("offsets", offsets, 0, rows + 1, f"x_sorted has {rows} rows")
    drops = offsets[1:] < offsets[:-1]
    if bool(drops.any()):
        at = int(drops.nonzero()[0, 0]) + 1
        raise c.fail("offsets", f"decreases at [{at}] ({int(offsets[at - 1])} then {int(offsets[at])}); "
                                "expected non-decreasing")


def check_moe_combine_indices(a: Args) -> None:
    c = Check("moe_combine", ())
    order = a["order"]
    c.values_in("order", order, 0, order.shape[0], "the T·k pairs")
    # stable: of equal values the later position follows, so it is the first repeat of each
    values, at = torch.sort(order, stable=True)
    repeats = at[1:][values[1:] == values[:-1]]
    if repeats.numel():
        r = int(repeats.min())
        raise c.fail("order", f"repeats {int(order[r])} at [{r}]; expected a permutation of the T·k pairs")


# ---------------------------------------------------------------------------------------------
# Reference math.


def moe_gating_fwd(logits: Tensor, k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """Returns ``(weights, indices)``."""
    # contiguous: sort and elementwise results keep a transposed input's layout, outputs must not
    lg = logits.to(compute_dtype(logits.dtype)).contiguous()
    # a stable descending sort keeps equal logits in index order: the contract's tie rule
    idx = torch.sort(lg, dim=-1, descending=True, stable=True).indices[:, :k]
    top = torch.softmax(lg, dim=-1).gather(1, idx)
    weights = top / top.sum(-1, keepdim=True) if renormalize else top
    return weights, idx.to(torch.int32)


def moe_gating_bwd(
    logits: Tensor, k: int, renormalize: bool, weights: Tensor, indices: Tensor,
    dweights: Optional[Tensor], dindices: Optional[Tensor],
) -> tuple[Tensor]:
    """Returns ``(dlogits,)``; only the k chosen logits get a gradient when ``renormalize``."""
    ct = weights.dtype
    if dweights is None:
        return (logits.new_zeros(logits.shape),)
    idx = indices.long()
    dw = dweights.to(ct)
    if renormalize:
        # renormalized top-k probabilities are a softmax over the chosen logits alone
        dsel = weights * (dw - (dw * weights).sum(-1, keepdim=True))
        dlogits = torch.zeros(logits.shape, dtype=ct, device=logits.device).scatter_add(1, idx, dsel)
    else:
        p = torch.softmax(logits.to(ct).contiguous(), dim=-1)
        dp = torch.zeros_like(p).scatter_add(1, idx, dw)
        dlogits = p * (dp - (dp * p).sum(-1, keepdim=True))
    return (dlogits.to(logits.dtype),)


def _token_of_pair(tokens: int, k: int, device: torch.device) -> Tensor:
    """``[T·k]``: the token of pair ``t·k + slot`` (no division, so k may be 0)."""
    return torch.arange(tokens, device=device)[:, None].expand(tokens, k).reshape(-1)


def moe_dispatch_fwd(x: Tensor, indices: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """Returns ``(x_sorted, offsets, order)``; a pair routed outside ``[0, E)`` sorts as expert E."""
    flat = indices.reshape(-1)
    routed = (flat >= 0) & (flat < num_experts)
    experts, order = torch.sort(torch.where(routed, flat, num_experts), stable=True)
    bounds = torch.arange(num_experts + 1, dtype=experts.dtype, device=x.device)
    offsets = torch.searchsorted(experts, bounds).to(torch.int32)
    token = _token_of_pair(indices.shape[0], indices.shape[1], x.device)[order]
    return x.index_select(0, token), offsets, order.to(torch.int32)


def moe_dispatch_bwd(
    x: Tensor, indices: Tensor, num_experts: int, x_sorted: Tensor, offsets: Tensor, order: Tensor,
    dx_sorted: Optional[Tensor], doffsets: Optional[Tensor], dorder: Optional[Tensor],
) -> tuple[Tensor]:
    """Returns ``(dx,)``: each token sums the gradients of its k copies."""
    tokens, k = indices.shape
    ct = compute_dtype(x.dtype)
    if dx_sorted is None:
        return (x.new_zeros(x.shape),)
    per_pair = torch.zeros(tokens * k, x.shape[1], dtype=ct, device=x.device)
    per_pair = per_pair.index_copy(0, order.long(), dx_sorted.to(ct))
    return (per_pair.reshape(tokens, k, x.shape[1]).sum(1).to(x.dtype),)


def expert_bounds(offsets: Tensor, rows: int) -> Tensor:
    """The offsets as every backend reads them: clamped to ``[0, rows]`` and made non-decreasing
    (a running maximum), so that bad values give empty experts, never overlapping ones."""
    return offsets.clamp(0, rows).cummax(0).values


def _expert_rows(bounds: Tensor, rows: int, expert: int) -> Tensor:
    """``[rows, 1]`` boolean: is row r in expert ``expert``'s block?"""
    r = torch.arange(rows, device=bounds.device)[:, None]
    return (r >= bounds[expert]) & (r < bounds[expert + 1])


def grouped_linear_fwd(x_sorted: Tensor, offsets: Tensor, weight: Tensor) -> tuple[Tensor]:
    """Returns ``(y,)``."""
    ct = compute_dtype(x_sorted.dtype)
    x, w = x_sorted.to(ct), weight.to(ct)
    bounds = expert_bounds(offsets, x.shape[0])
    y = torch.zeros(x.shape[0], w.shape[1], dtype=ct, device=x.device)
    for e in range(w.shape[0]):
        y = torch.where(_expert_rows(bounds, x.shape[0], e), x @ w[e].T, y)
    return (y.to(x_sorted.dtype),)


def grouped_linear_bwd(x_sorted: Tensor, offsets: Tensor, weight: Tensor, y: Tensor,
                            dy: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """Returns ``(dx_sorted, dweight)``."""
    if dy is None:
        return x_sorted.new_zeros(x_sorted.shape), weight.new_zeros(weight.shape)
    ct = compute_dtype(x_sorted.dtype)
    x, w, g = x_sorted.to(ct), weight.to(ct), dy.to(ct)
    bounds = expert_bounds(offsets, x.shape[0])
    dx = x.new_zeros(x.shape)
    dws = []
    # selected, not multiplied by the row mask: an inf in another expert's rows or weight would
    # reach this expert's gradients as 0 · inf = NaN
    for e in range(w.shape[0]):
        rows = _expert_rows(bounds, x.shape[0], e)
        ge = torch.where(rows, g, 0.0)
        dx = torch.where(rows, ge @ w[e], dx)
        dws.append(ge.T @ torch.where(rows, x, 0.0))
    dw = torch.stack(dws) if dws else w.new_zeros(w.shape)
    return dx.to(x_sorted.dtype), dw.to(weight.dtype)


def row_of_pair(order: Tensor) -> Tensor:
    """``[P]`` int64: the sorted row that names each pair, ``-1`` where none does; values of
    ``order`` outside ``[0, P)`` are ignored, and of rows naming one pair the last wins."""
    pairs = order.shape[0]
    o = order.long()
    named = (o >= 0) & (o < pairs)
    rows = torch.arange(pairs, device=order.device)
    none = torch.full((pairs,), -1, dtype=torch.int64, device=order.device)
    return none.scatter_reduce(0, torch.where(named, o, 0), torch.where(named, rows, -1), "amax")


def _unsort(rows: Tensor, inverse: Tensor) -> Tensor:
    """Rows in expert order back to pair order ``t·k + slot``, through ``inverse = row_of_pair(order)``
    (0 for a pair no row names)."""
    return torch.where(inverse[:, None] >= 0, rows.index_select(0, inverse.clamp(min=0)), 0)


def moe_combine_fwd(y_sorted: Tensor, order: Tensor, weights: Tensor) -> tuple[Tensor]:
    """Returns ``(y,)``."""
    ct = compute_dtype(y_sorted.dtype)
    tokens, k = weights.shape
    pairs = _unsort(y_sorted.to(ct), row_of_pair(order)).reshape(tokens, k, y_sorted.shape[1])
    y = (pairs * weights.to(ct)[:, :, None]).sum(1)
    return (y.to(y_sorted.dtype),)


def moe_combine_bwd(y_sorted: Tensor, order: Tensor, weights: Tensor, y: Tensor,
                         dy: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """Returns ``(dy_sorted, dweights)``."""
    if dy is None:
        return y_sorted.new_zeros(y_sorted.shape), weights.new_zeros(weights.shape)
    ct = compute_dtype(y_sorted.dtype)
    tokens, k = weights.shape
    hidden = y_sorted.shape[1]
    g = dy.to(ct)[:, None, :]
    inverse = row_of_pair(order)
    pairs = _unsort(y_sorted.to(ct), inverse).reshape(tokens, k, hidden)
    dweights = (pairs * g).sum(-1)
    dpairs = (g * weights.to(ct)[:, :, None]).reshape(tokens * k, hidden)
    # a row gets its pair's gradient only where it is the row the forward read for that pair
    pair = order.long().clamp(0, max(tokens * k - 1, 0))
    read = inverse.index_select(0, pair) == torch.arange(tokens * k, device=order.device)
    dy_sorted = torch.where(read[:, None], dpairs.index_select(0, pair), 0)
    return dy_sorted.to(y_sorted.dtype), dweights.to(weights.dtype)


# ---------------------------------------------------------------------------------------------
# Conformance inputs. Routing is drawn at random (k distinct experts per token), or skewed so
# that the upper half of the experts receives no rows at all and the lowest ones most of them.


def _route(g: torch.Generator, tokens: int, experts: int, k: int, *, skewed: bool = False) -> Tensor:
    """int32 ``[tokens, k]``: k distinct experts per token."""
    noise = torch.rand(tokens, experts, generator=g)
    if skewed:
        # expert 0 always scores >= 2, so an expert whose bias is below 1 never wins with k = 1
        noise = noise + torch.linspace(2.0, 0.0, experts)
    return torch.sort(noise, dim=-1, descending=True).indices[:, :k].to(torch.int32)


def _offsets(indices: Tensor, experts: int) -> Tensor:
    counts = torch.bincount(indices.reshape(-1).long(), minlength=experts)
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)


def _order(indices: Tensor) -> Tensor:
    return torch.sort(indices.reshape(-1), stable=True).indices.to(torch.int32)


def _make_gating(g: torch.Generator, dtype: torch.dtype, *, tokens: int, experts: int, k: int,
                 renormalize: bool = True, scale: float = 1.0, offset: float = 0.0, layout=identity) -> Args:
    logits = (randn(g, tokens, experts, dtype=torch.float64, scale=scale) + offset).to(dtype)
    return {"logits": layout(logits), "k": k, "renormalize": renormalize}


def _make_gating_ties(g: torch.Generator, dtype: torch.dtype) -> Args:
    # small integers are exact in every dtype, so ties are ties on every backend
    logits = torch.randint(-2, 3, (64, 16), generator=g).to(dtype)
    logits[:4] = 0.0
    return {"logits": logits, "k": 4, "renormalize": True}


def _make_dispatch(g: torch.Generator, dtype: torch.dtype, *, tokens: int, hidden: int, experts: int,
                   k: int, skewed: bool = False, layout=identity) -> Args:
    return {"x": layout(randn(g, tokens, hidden, dtype=dtype)),
            "indices": _route(g, tokens, experts, k, skewed=skewed), "num_experts": experts}


def _make_grouped(g: torch.Generator, dtype: torch.dtype, *, rows: int, k_dim: int, n_dim: int,
                  experts: int, skewed: bool = False, gap: int = 0, x_layout=identity, w_layout=identity) -> Args:
    """``gap`` rows before the first expert's and after the last one's belong to no expert."""
    indices = _route(g, rows - 2 * gap, experts, 1, skewed=skewed)
    weight = randn(g, experts, n_dim, k_dim, dtype=dtype, scale=max(k_dim, 1) ** -0.5)
    return {"x_sorted": x_layout(randn(g, rows, k_dim, dtype=dtype)), "offsets": _offsets(indices, experts) + gap,
            "weight": w_layout(weight)}


def _make_combine(g: torch.Generator, dtype: torch.dtype, *, tokens: int, k: int, hidden: int,
                  experts: int = 16, weights_like_y: bool = False, layout=identity,
                  w_layout=identity) -> Args:
    indices = _route(g, tokens, max(experts, k), k)
    weights = torch.softmax(torch.randn(tokens, k, generator=g, dtype=torch.float64), -1)
    return {"y_sorted": layout(randn(g, tokens * k, hidden, dtype=dtype)), "order": _order(indices),
            "weights": w_layout(weights.to(dtype if weights_like_y else compute_dtype(dtype)))}


def _cases_of(make: Callable[..., Args], shapes: dict[str, dict[str, Any]]) -> Callable[[], list[Case]]:
    def cases() -> list[Case]:
        out = []
        for name, kw in shapes.items():
            kw = dict(kw)
            perf, grad = kw.pop("perf", False), kw.pop("grad", True)
            out.append(Case(name, functools.partial(make, **kw), perf=perf, grad=grad))
        return out
    return cases


_GATING_CASES = _cases_of(_make_gating, {
    "llm": {"tokens": 256, "experts": 128, "k": 8},
    "mixtral": {"tokens": 64, "experts": 8, "k": 2},
    "no_renormalize": {"tokens": 100, "experts": 64, "k": 6, "renormalize": False},
    "single": {"tokens": 1, "experts": 1, "k": 1},
    "k_equals_e": {"tokens": 17, "experts": 3, "k": 3},
    "many_tokens": {"tokens": 4097, "experts": 8, "k": 2},
    "many_experts": {"tokens": 3, "experts": 1000, "k": 17},
    "strided": {"tokens": 33, "experts": 64, "k": 4, "layout": strided},
    "transposed": {"tokens": 40, "experts": 16, "k": 4, "layout": transposed},
    "zero_tokens": {"tokens": 0, "experts": 64, "k": 8},
    # saturated softmax: all but the top probabilities underflow, ranking still by logit. The
    # gradient p·(dp − Σ dp·p) cancels where p → 1: ill-conditioned, so forward only
    "huge": {"tokens": 32, "experts": 64, "k": 8, "scale": 1e3, "grad": False},
    "huge_no_renormalize": {"tokens": 32, "experts": 64, "k": 8, "scale": 1e3, "renormalize": False, "grad": False},
    # large logits with an O(1) spread (overflow without the max subtraction; coarse 16-bit
    # spacing makes ties): a well-conditioned gradient
    "shifted": {"tokens": 32, "experts": 64, "k": 8, "offset": 1e3},
    "shifted_no_renormalize": {"tokens": 32, "experts": 64, "k": 8, "offset": 1e3, "renormalize": False},
    "tiny": {"tokens": 32, "experts": 64, "k": 8, "scale": 1e-4},
    "perf": {"tokens": 16384, "experts": 128, "k": 8, "perf": True},
})


def _gating_cases() -> list[Case]:
    return _GATING_CASES() + [Case("ties", _make_gating_ties)]


_DISPATCH_CASES = _cases_of(_make_dispatch, {
    "llm": {"tokens": 256, "hidden": 512, "experts": 16, "k": 2},
    "top8": {"tokens": 64, "hidden": 128, "experts": 64, "k": 8},
    "single": {"tokens": 1, "hidden": 1, "experts": 1, "k": 1},
    "odd": {"tokens": 17, "hidden": 3, "experts": 3, "k": 3},
    "wide": {"tokens": 1000, "hidden": 17, "experts": 8, "k": 2},
    "many_tokens": {"tokens": 4097, "hidden": 4, "experts": 8, "k": 1},
    "empty_experts": {"tokens": 40, "hidden": 64, "experts": 32, "k": 2, "skewed": True},
    "strided": {"tokens": 33, "hidden": 256, "experts": 8, "k": 2, "layout": strided},
    "transposed": {"tokens": 40, "hidden": 96, "experts": 8, "k": 2, "layout": transposed},
    "zero_tokens": {"tokens": 0, "hidden": 64, "experts": 8, "k": 2},
    "zero_hidden": {"tokens": 5, "hidden": 0, "experts": 8, "k": 2},
    "perf": {"tokens": 16384, "hidden": 2048, "experts": 128, "k": 8, "perf": True},
})

_GROUPED_CASES = _cases_of(_make_grouped, {
    "llm": {"rows": 512, "k_dim": 256, "n_dim": 384, "experts": 8},
    "single": {"rows": 1, "k_dim": 1, "n_dim": 1, "experts": 1},
    "odd": {"rows": 17, "k_dim": 3, "n_dim": 5, "experts": 3},
    "wide": {"rows": 200, "k_dim": 17, "n_dim": 33, "experts": 64},
    "empty_experts": {"rows": 100, "k_dim": 64, "n_dim": 32, "experts": 16, "skewed": True},
    "strided_x": {"rows": 96, "k_dim": 128, "n_dim": 64, "experts": 4, "x_layout": strided},
    "transposed_x": {"rows": 96, "k_dim": 128, "n_dim": 64, "experts": 4, "x_layout": transposed},
    # expert weights stored [E, K, N] and used as their transpose
    "transposed_weight": {"rows": 96, "k_dim": 128, "n_dim": 64, "experts": 4, "w_layout": transposed},
    "zero_rows": {"rows": 0, "k_dim": 64, "n_dim": 32, "experts": 4},
    "zero_k": {"rows": 8, "k_dim": 0, "n_dim": 32, "experts": 4},
    # rows outside [offsets[0], offsets[E]) belong to no expert and give 0 (padding rows)
    "unrouted_rows": {"rows": 150, "k_dim": 64, "n_dim": 48, "experts": 4, "gap": 20},
    # Mixtral-8x7B w1: 16384 tokens x top-2; 8 experts keep the masked reference (E times the
    # work of one matmul) usable as the eager baseline
    "perf": {"rows": 32768, "k_dim": 4096, "n_dim": 14336, "experts": 8, "perf": True},
})

_COMBINE_CASES = _cases_of(_make_combine, {
    "llm": {"tokens": 256, "k": 8, "hidden": 512, "experts": 64},
    "single": {"tokens": 1, "k": 1, "hidden": 1, "experts": 1},
    "odd": {"tokens": 17, "k": 3, "hidden": 3, "experts": 3},
    "wide": {"tokens": 1000, "k": 2, "hidden": 17},
    "many_tokens": {"tokens": 4097, "k": 1, "hidden": 4},
    "weights_like_y": {"tokens": 16, "k": 2, "hidden": 64, "weights_like_y": True},
    "strided": {"tokens": 33, "k": 2, "hidden": 256, "layout": strided, "w_layout": transposed},
    "transposed": {"tokens": 40, "k": 2, "hidden": 96, "layout": transposed},
    "zero_tokens": {"tokens": 0, "k": 2, "hidden": 64},
    "zero_hidden": {"tokens": 5, "k": 2, "hidden": 0},
    "perf": {"tokens": 16384, "k": 8, "hidden": 2048, "experts": 128, "perf": True},
})


def _gating_bad() -> list[BadInput]:
    base = {"logits": torch.randn(4, 8), "k": 2, "renormalize": True}
    return [
        BadInput("int_logits", lambda: {**base, "logits": torch.ones(4, 8, dtype=torch.int64)}),
        BadInput("logits_1d", lambda: {**base, "logits": torch.randn(8)}),
        BadInput("logits_3d", lambda: {**base, "logits": torch.randn(2, 4, 8)}),
        BadInput("k_zero", lambda: {**base, "k": 0}),
        BadInput("k_above_experts", lambda: {**base, "k": 9}),
        BadInput("k_not_int", lambda: {**base, "k": 2.0}),
        BadInput("renormalize_not_bool", lambda: {**base, "renormalize": "yes"}),
        BadInput("not_a_tensor", lambda: {**base, "logits": [[1.0, 2.0]]}),
    ]


def _dispatch_bad() -> list[BadInput]:
    base = {"x": torch.randn(4, 8), "indices": torch.zeros(4, 2, dtype=torch.int32), "num_experts": 4}
    return [
        BadInput("int_x", lambda: {**base, "x": torch.ones(4, 8, dtype=torch.int64)}),
        BadInput("x_3d", lambda: {**base, "x": torch.randn(1, 4, 8)}),
        BadInput("indices_int64", lambda: {**base, "indices": torch.zeros(4, 2, dtype=torch.int64)}),
        BadInput("indices_float", lambda: {**base, "indices": torch.zeros(4, 2)}),
        BadInput("indices_1d", lambda: {**base, "indices": torch.zeros(4, dtype=torch.int32)}),
        BadInput("indices_tokens", lambda: {**base, "indices": torch.zeros(5, 2, dtype=torch.int32)}),
        BadInput("indices_device", lambda: {**base, "indices": torch.zeros(4, 2, dtype=torch.int32, device="meta")}),
        BadInput("num_experts_zero", lambda: {**base, "num_experts": 0}),
        BadInput("num_experts_float", lambda: {**base, "num_experts": 4.0}),
    ]


def _grouped_bad() -> list[BadInput]:
    base = {"x_sorted": torch.randn(6, 8), "offsets": torch.tensor([0, 2, 6], dtype=torch.int32),
            "weight": torch.randn(2, 5, 8)}
    return [
        BadInput("int_x", lambda: {**base, "x_sorted": torch.ones(6, 8, dtype=torch.int64)}),
        BadInput("x_3d", lambda: {**base, "x_sorted": torch.randn(1, 6, 8)}),
        BadInput("weight_2d", lambda: {**base, "weight": torch.randn(5, 8)}),
        BadInput("weight_k", lambda: {**base, "weight": torch.randn(2, 5, 7)}),
        BadInput("weight_dtype", lambda: {**base, "weight": torch.randn(2, 5, 8, dtype=torch.float16)}),
        BadInput("weight_device", lambda: {**base, "weight": torch.randn(2, 5, 8, device="meta")}),
        BadInput("offsets_length", lambda: {**base, "offsets": torch.tensor([0, 6], dtype=torch.int32)}),
        BadInput("offsets_int64", lambda: {**base, "offsets": torch.tensor([0, 2, 6])}),
        BadInput("offsets_2d", lambda: {**base, "offsets": torch.tensor([[0, 2, 6]], dtype=torch.int32)}),
    ]


def _combine_bad() -> list[BadInput]:
    base = {"y_sorted": torch.randn(6, 8), "order": torch.arange(6, dtype=torch.int32), "weights": torch.rand(3, 2)}
    return [
        BadInput("int_y", lambda: {**base, "y_sorted": torch.ones(6, 8, dtype=torch.int64)}),
        BadInput("y_1d", lambda: {**base, "y_sorted": torch.randn(6)}),
        BadInput("weights_pairs", lambda: {**base, "weights": torch.rand(3, 3)}),
        BadInput("weights_1d", lambda: {**base, "weights": torch.rand(6)}),
        BadInput("weights_dtype", lambda: {**base, "weights": torch.rand(3, 2, dtype=torch.float16)}),
        BadInput("weights_device", lambda: {**base, "weights": torch.rand(3, 2, device="meta")}),
        BadInput("order_length", lambda: {**base, "order": torch.arange(5, dtype=torch.int32)}),
        BadInput("order_int64", lambda: {**base, "order": torch.arange(6)}),
    ]


# Out-of-range routing values: the checked mode names them, unchecked kernels stay inside their
# tensors and give the defined results of the module docstring. Extremes of int32 catch index
# arithmetic that wraps.
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _bad_dispatch_indices() -> list[BadIndices]:
    def make(bad: list[int]) -> Args:
        g = torch.Generator().manual_seed(len(bad))
        indices = _route(g, 40, 8, 2)
        flat = indices.view(-1)
        flat[torch.randperm(flat.numel(), generator=g)[: len(bad)]] = torch.tensor(bad, dtype=torch.int32)
        return {"x": randn(g, 40, 64, dtype=torch.float32), "indices": indices, "num_experts": 8}

    return [
        BadIndices("expert_equals_num_experts", lambda: make([8]), "indices"),
        BadIndices("expert_negative", lambda: make([-1] * 10), "indices"),
        BadIndices("expert_int32_extremes", lambda: make([_INT32_MAX, _INT32_MIN, 9, -3]), "indices"),
    ]


def _bad_grouped_indices() -> list[BadIndices]:
    def make(offsets: list[int]) -> Args:
        g = torch.Generator().manual_seed(len(offsets))
        return {"x_sorted": randn(g, 100, 32, dtype=torch.float32),
                "offsets": torch.tensor(offsets, dtype=torch.int32),
                "weight": randn(g, len(offsets) - 1, 24, 32, dtype=torch.float32, scale=32**-0.5)}

    return [
        BadIndices("offsets_decreasing", lambda: make([0, 50, 20, 100]), "offsets"),
        BadIndices("offsets_past_rows", lambda: make([0, 30, 500]), "offsets"),
        BadIndices("offsets_negative", lambda: make([-7, 40, 100]), "offsets"),
        BadIndices("offsets_int32_extremes", lambda: make([0, _INT32_MAX, _INT32_MIN, 100]), "offsets"),
    ]


def _bad_combine_indices() -> list[BadIndices]:
    def make(change: Callable[[Tensor], None]) -> Args:
        g = torch.Generator().manual_seed(3)
        order = _order(_route(g, 40, 8, 2))
        change(order)
        weights = torch.softmax(torch.randn(40, 2, generator=g, dtype=torch.float64), -1).float()
        return {"y_sorted": randn(g, 80, 64, dtype=torch.float32), "order": order, "weights": weights}

    def out_of_range(order: Tensor) -> None:
        order[[3, 50, 79]] = torch.tensor([80, -1, _INT32_MIN], dtype=torch.int32)

    def repeated(order: Tensor) -> None:
        order[[10, 11, 60]] = order[[5, 5, 0]]

    def extremes(order: Tensor) -> None:
        order[::2] = _INT32_MAX

    return [
        BadIndices("order_out_of_range", lambda: make(out_of_range), "order"),
        BadIndices("order_repeated", lambda: make(repeated), "order"),
        BadIndices("order_int32_extremes", lambda: make(extremes), "order"),
    ]


MOE_GATING = KernelSpec(
    name="moe_gating",
    signature=moe_gating,
    validate=validate_moe_gating,
    forward=moe_gating_fwd,
    backward=moe_gating_bwd,
    outputs=("weights", "indices"),
    differentiable=("logits",),
    # softmax: max, subtract, exp, sum, divide per logit
    flops=lambda a: 5.0 * a["logits"].numel(),
    cases=_gating_cases,
    bad_inputs=_gating_bad,
    sharding=lambda a: each_dim((0,), ("weights", "indices"), ("logits",)),
)

MOE_DISPATCH = KernelSpec(
    name="moe_dispatch",
    signature=moe_dispatch,
    validate=validate_moe_dispatch,
    forward=moe_dispatch_fwd,
    backward=moe_dispatch_bwd,
    outputs=("x_sorted", "offsets", "order"),
    differentiable=("x",),
    flops=lambda a: 0.0,
    cases=_DISPATCH_CASES,
    bad_inputs=_dispatch_bad,
    check_indices=check_moe_dispatch_indices,
    bad_indices=_bad_dispatch_indices,
    sharding=lambda a: each_dim((1,), ("x_sorted",), ("x",)),  # routing is replicated: decided for all rows
)

GROUPED_LINEAR = KernelSpec(
    name="grouped_linear",
    signature=grouped_linear,
    validate=validate_grouped_linear,
    forward=grouped_linear_fwd,
    backward=grouped_linear_bwd,
    outputs=("y",),
    differentiable=("x_sorted", "weight"),
    flops=lambda a: 2.0 * a["x_sorted"].shape[0] * a["weight"].shape[1] * a["x_sorted"].shape[1],
    cases=_GROUPED_CASES,
    bad_inputs=_grouped_bad,
    check_indices=check_grouped_linear_indices,
    bad_indices=_bad_grouped_indices,
    sharding=lambda a: [({"y": 1}, {"weight": 1}), ({"y": PARTIAL}, {"x_sorted": 1, "weight": 2})],
)

MOE_COMBINE = KernelSpec(
    name="moe_combine",
    signature=moe_combine,
    validate=validate_moe_combine,
    forward=moe_combine_fwd,
    backward=moe_combine_bwd,
    outputs=("y",),
    differentiable=("y_sorted", "weights"),
    flops=lambda a: 2.0 * a["y_sorted"].numel(),
    cases=_COMBINE_CASES,
    bad_inputs=_combine_bad,
    check_indices=check_moe_combine_indices,
    bad_indices=_bad_combine_indices,
    sharding=lambda a: each_dim((1,), ("y",), ("y_sorted",)),
)

SPECS = (MOE_GATING, MOE_DISPATCH, GROUPED_LINEAR, MOE_COMBINE)
