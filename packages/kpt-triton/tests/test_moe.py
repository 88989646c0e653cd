from __future__ import annotations

import pytest
import torch

from conftest import check_kernel, device, seeded
from kpt.spec import identity, randn, strided
from kpt_triton import moe as k

pytestmark = pytest.mark.interpreter  # launches Triton kernels (interpreted on a CPU machine)


def _route(g, tokens, experts, top_k, *, skewed=False):
    """int32 ``[tokens, top_k]``: distinct experts per token; skewed leaves the upper experts empty."""
    scores = torch.rand(tokens, experts, generator=g)
    if skewed:
        scores = scores + torch.linspace(2.0, 0.0, experts)
    return torch.sort(scores, dim=-1, descending=True).indices[:, :top_k].to(torch.int32)


def _with(fn, **kw):
    def body(*a):
        return fn(*a, **kw)

    return body


GATING = {  # tokens, experts, k, renormalize
    "llm": (33, 128, 8, True),
    "mixtral": (17, 8, 2, True),
    "no_renormalize": (20, 64, 6, False),
    "single": (1, 1, 1, True),
    "k_equals_e": (5, 3, 3, False),
    "many_experts": (3, 1000, 17, True),
    "zero_tokens": (0, 16, 4, True),
}


@pytest.mark.parametrize("shape", GATING.values(), ids=GATING.keys())
def test_gating(dtype, shape):
    tokens, experts, top_k, renormalize = shape
    g = seeded(shape)
    args = {"logits": randn(g, tokens, experts, dtype=dtype), "k": top_k, "renormalize": renormalize}
    # several programs, each with several rows
    check_kernel("moe_gating", _with(k.moe_gating_fwd, tile_elems=256),
                 _with(k.moe_gating_bwd, tile_elems=256), args, dtype)


@pytest.mark.parametrize("variant", ["ties", "strided", "huge", "huge_no_renormalize", "neg_inf"])
def test_gating_variants(dtype, variant):
    g = torch.Generator().manual_seed(21)
    renormalize = variant != "huge_no_renormalize"
    if variant == "ties":
        # small integers are exact in every dtype: ties must go to the lower expert
        logits = torch.randint(-2, 3, (40, 16), generator=g).to(dtype)
        logits[:4] = 0.0
        # -0 and +0 are equal logits too
        logits[4:8, ::2] = -0.0
    elif variant == "strided":
        logits = strided(randn(g, 33, 64, dtype=dtype))
    elif variant == "neg_inf":
        # experts masked out with -inf: never chosen while k finite logits remain
        logits = randn(g, 24, 32, dtype=dtype)
        logits[:, ::3] = float("-inf")
    else:
        # saturated softmax: all but the top probabilities underflow; ranking still by logit
        logits = randn(g, 32, 64, dtype=dtype, scale=1e3)
    args = {"logits": logits, "k": 8 if variant != "ties" else 4, "renormalize": renormalize}
    # Saturated gradients are w·(dw − Σ dw·w) with w ≈ one-hot: a cancellation whose condition
    # number is 1 / (1 − max w), so no float32 evaluation (PyTorch's included) gets near float64.
    bwd = None if variant.startswith("huge") else k.moe_gating_bwd
    check_kernel("moe_gating", k.moe_gating_fwd, bwd, args, dtype)


DISPATCH = {  # tokens, hidden, experts, k, skewed
    "llm": (64, 96, 16, 2, False),
    "top8": (40, 33, 64, 8, False),
    "single": (1, 1, 1, 1, False),
    "odd": (17, 3, 3, 3, False),
    "empty_experts": (40, 64, 32, 2, True),
    "zero_tokens": (0, 64, 8, 2, False),
    "zero_hidden": (5, 0, 8, 2, False),
}


@pytest.mark.parametrize("block_pairs", [16, 512], ids=["blocks", "one_block"])
@pytest.mark.parametrize("shape", DISPATCH.values(), ids=DISPATCH.keys())
def test_dispatch(dtype, shape, block_pairs):
    tokens, hidden, experts, top_k, skewed = shape
    g = seeded(shape)
    args = {"x": randn(g, tokens, hidden, dtype=dtype),
            "indices": _route(g, tokens, experts, top_k, skewed=skewed), "num_experts": experts}
    # blocks of 16 pairs: the stable order must hold across blocks, and several experts per block;
    # blocks of 512: every shape's pairs in one block, the one-launch path
    check_kernel("moe_dispatch", _with(k.moe_dispatch_fwd, block_pairs=block_pairs, block_h=16, block_e=16),
                 _with(k.moe_dispatch_bwd, block_t=4, block_h=16, one_block=block_pairs), args, dtype,
                 compare_saved=("offsets", "order"))


def test_dispatch_strided_and_repeated(dtype):
    """Non-contiguous x and indices, and a token sending two slots to one expert."""
    g = torch.Generator().manual_seed(23)
    indices = _route(g, 30, 8, 3)
    indices[::4, 1] = indices[::4, 0]
    args = {"x": strided(randn(g, 30, 48, dtype=dtype)), "indices": indices.t().contiguous().t(),
            "num_experts": 8}
    check_kernel("moe_dispatch", _with(k.moe_dispatch_fwd, block_pairs=32), k.moe_dispatch_bwd, args, dtype)


GROUPED = {  # rows, K, N, experts, skewed
    "llm": (200, 64, 48, 4, False),
    "single": (1, 1, 1, 1, False),
    "odd": (17, 3, 5, 3, False),
    "wide": (100, 17, 33, 16, False),
    "empty_experts": (100, 32, 16, 16, True),
    "zero_rows": (0, 16, 8, 4, False),
    "zero_k": (8, 0, 8, 4, False),
}


def _offsets(indices, experts):
    counts = torch.bincount(indices.reshape(-1).long(), minlength=experts)
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)


def _grouped_args(g, dtype, rows, k_dim, n_dim, experts, skewed, *, x_layout=identity, w_layout=identity):
    offsets = _offsets(_route(g, rows, experts, 1, skewed=skewed), experts)
    weight = randn(g, experts, n_dim, k_dim, dtype=dtype, scale=max(k_dim, 1) ** -0.5)
    return {"x_sorted": x_layout(randn(g, rows, k_dim, dtype=dtype)), "offsets": offsets,
            "weight": w_layout(weight)}


TILES = {"default": {}, "tiles16": {"block_m": 16, "block_n": 16, "block_k": 16}}


@pytest.mark.parametrize("tiles", TILES.values(), ids=TILES.keys())
@pytest.mark.parametrize("shape", GROUPED.values(), ids=GROUPED.keys())
def test_grouped_linear(dtype, shape, tiles):
    g = seeded(shape)
    check_kernel("grouped_linear", _with(k.grouped_linear_fwd, **tiles), _with(k.grouped_linear_bwd, **tiles),
                 _grouped_args(g, dtype, *shape), dtype)


@pytest.mark.parametrize("layout", ["strided_x", "transposed_weight"])
def test_grouped_linear_layouts(dtype, layout):
    g = torch.Generator().manual_seed(29)
    if layout == "strided_x":
        args = _grouped_args(g, dtype, 48, 40, 24, 4, False, x_layout=strided)
    else:
        # expert weights stored [E, K, N], used as their transpose
        args = _grouped_args(g, dtype, 48, 40, 24, 4, False,
                             w_layout=lambda t: t.transpose(-2, -1).contiguous().transpose(-2, -1))
    tiles = {"block_m": 16, "block_n": 16, "block_k": 16}
    check_kernel("grouped_linear", _with(k.grouped_linear_fwd, **tiles), _with(k.grouped_linear_bwd, **tiles),
                 args, dtype)


COMBINE = {  # tokens, k, hidden, weights in y's dtype
    "llm": (40, 8, 64, False),
    "single": (1, 1, 1, False),
    "odd": (17, 3, 3, False),
    "weights_like_y": (16, 2, 40, True),
    "zero_tokens": (0, 2, 64, False),
    "zero_hidden": (5, 2, 0, False),
}


def _combine_args(g, dtype, tokens, top_k, hidden, weights_like_y, *, layout=identity):
    indices = _route(g, tokens, max(16, top_k), top_k)
    order = torch.sort(indices.reshape(-1), stable=True).indices.to(torch.int32)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g, dtype=torch.float64), -1)
    return {"y_sorted": layout(randn(g, tokens * top_k, hidden, dtype=dtype)), "order": order,
            "weights": weights.to(dtype if weights_like_y else torch.float32)}


@pytest.mark.parametrize("one_block", [0, 512], ids=["inverse_kernel", "inverted_inside"])
@pytest.mark.parametrize("shape", COMBINE.values(), ids=COMBINE.keys())
def test_combine(dtype, shape, one_block):
    g = seeded(shape)
    check_kernel("moe_combine", _with(k.moe_combine_fwd, block_t=4, block_h=16, one_block=one_block),
                 _with(k.moe_combine_bwd, block_r=4, block_h=16, one_block=one_block),
                 _combine_args(g, dtype, *shape), dtype)


@pytest.mark.parametrize("one_block", [0, 512], ids=["inverse_kernel", "inverted_inside"])
def test_combine_ignores_bad_order_values_and_takes_the_last_repeat(one_block):
    """Unchecked orders: a value outside [0, P) names no pair, and of two rows naming one pair the
    forward reads the last; the backward gives the other rows and the unnamed pairs 0."""
    g = torch.Generator().manual_seed(43)
    y_sorted = randn(g, 4, 3, dtype=torch.float32).to(device())
    order = torch.tensor([0, 9, 0, 3], dtype=torch.int32).to(device())  # pair 0: rows 0, 2; pairs 1, 2: none
    weights = torch.tensor([[0.5, 2.0], [3.0, -1.0]]).to(device())
    (y,) = k.moe_combine_fwd(y_sorted, order, weights, one_block=one_block)
    torch.testing.assert_close(y, torch.stack([0.5 * y_sorted[2], -1.0 * y_sorted[3]]))
    dy = randn(g, 2, 3, dtype=torch.float32).to(device())
    dy_sorted, dweights = k.moe_combine_bwd(y_sorted, order, weights, y, dy, one_block=one_block)
    zero = torch.zeros(3, device=device())
    torch.testing.assert_close(dy_sorted, torch.stack([zero, zero, 0.5 * dy[0], -1.0 * dy[1]]))
    torch.testing.assert_close(dweights, torch.tensor([[(dy[0] * y_sorted[2]).sum(), 0.0],
                                                       [0.0, (dy[1] * y_sorted[3]).sum()]], device=device()))


def test_combine_strided(dtype):
    g = torch.Generator().manual_seed(31)
    args = _combine_args(g, dtype, 33, 2, 72, False, layout=strided)
    args["weights"] = args["weights"].t().contiguous().t()
    check_kernel("moe_combine", k.moe_combine_fwd, k.moe_combine_bwd, args, dtype)


def test_round_trip_is_identity():
    """dispatch then combine with unit weights sums each token's k copies: k · x."""
    g = torch.Generator().manual_seed(37)
    x = randn(g, 50, 24, dtype=torch.float32).to(device())
    indices = _route(g, 50, 12, 3).to(device())
    x_sorted, offsets, order = k.moe_dispatch_fwd(x, indices, 12, block_pairs=16)
    assert torch.equal(offsets.cpu(), _offsets(indices.cpu(), 12))
    (y,) = k.moe_combine_fwd(x_sorted, order, torch.ones(50, 3, device=device()))
    assert torch.equal(y, 3 * x)


@pytest.mark.parametrize("block_pairs", [2, 128], ids=["blocks", "one_block"])
def test_dispatch_sorts_unrouted_pairs_last(block_pairs):
    """Experts outside [0, E) (-1 and 7 of 3) sort after every expert's rows, in pair order."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(41)).to(device())
    indices = torch.tensor([[1, -1], [7, 0], [1, 2]], dtype=torch.int32).to(device())
    x_sorted, offsets, order = k.moe_dispatch_fwd(x, indices, 3, block_pairs=block_pairs)
    assert offsets.tolist() == [0, 1, 3, 4]
    assert order.tolist() == [3, 0, 4, 5, 1, 2]
    assert torch.equal(x_sorted, x[[1, 0, 2, 2, 0, 1]])
