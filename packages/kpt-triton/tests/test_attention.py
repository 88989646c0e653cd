from __future__ import annotations

import pytest
import torch

import kpt
from conftest import assert_close, check_kernel, device, seeded, to64
from kpt.kernels import attention as attention_spec
from kpt.spec import randn
from kpt_triton import attention as k

pytestmark = pytest.mark.interpreter  # launches Triton kernels (interpreted on a CPU machine)

# (B, Hq, Hkv, Sq, Skv, D, causal): odd lengths, Sq != Skv both ways, grouped-query, padded head dims
SHAPES = {
    "odd": (1, 2, 2, 17, 17, 24, False),
    "gqa_causal": (2, 4, 2, 17, 40, 64, True),
    "more_queries_causal": (1, 2, 1, 40, 17, 80, True),
    "decode": (1, 3, 1, 1, 33, 32, True),
    "mqa_long": (1, 2, 1, 100, 100, 64, True),
    "cross": (1, 2, 1, 9, 100, 16, False),
    # longer than the portable plan's chunks (`Decode.split_keys`): float32 splits too
    "decode_long": (1, 2, 1, 3, 600, 16, True),
}


def _all_dims(block_m, block_n):
    """The same small tiles for every head dim (16-bit inputs; float32 keeps the portable tiles)."""
    tiles = {d: k.Tiles(block_m, block_n, 4, 2) for d in (16, 32, 64, 128, 256)}
    return {"tiles": tiles}


SPLIT_DECODE = k.Decode(block_n=16, programs_per_sm=64, split_keys=16)
"""Chunks of 16 keys: the decode kernel splits every 16-bit cache of the tests and merges the chunks."""
WIDE_DECODE = k.Decode(block_n=128, num_stages=3, programs_per_sm=1, split_keys=32, scores=512)
"""Key blocks halved to fit ``scores`` (32 keys for 16 rows), one program per CPU."""

# small tiles make every loop of the kernels take several trips and hit every block boundary case;
# a call with few queries per KV head (decode, cross; up to 128 in 16 bits, one tile with the small
# tiles) runs the decode kernel
TILES = {"portable": {}, "tiles16": {**_all_dims(16, 16), "decode": k.Decode(rows=16)},
         "tiles16x32": {**_all_dims(16, 32), "decode": k.Decode(rows=16)}, "split_decode": {"decode": SPLIT_DECODE},
         "wide_decode": {"decode": WIDE_DECODE}}


def _args(g, dtype, b, hq, hkv, sq, skv, d, causal, *, transposed=False, scale=None, mask=None):
    """A call's arguments; ``mask``: None or a bool tensor that broadcasts to [B, Hq, Sq, Skv], passed
    as core's validation passes it (the broadcast view, stride 0 where it broadcasts), on the test
    device already (a copy into a view with stride 0 is refused)."""
    def draw(h, s):
        if transposed:
            return randn(g, b, s, h, d, dtype=dtype).transpose(1, 2)
        return randn(g, b, h, s, d, dtype=dtype)

    return {"q": draw(hq, sq), "k": draw(hkv, skv), "v": draw(hkv, skv), "causal": causal,
            "scale": d**-0.5 if scale is None else scale,
            "mask": None if mask is None else mask.to(device()).expand(b, hq, sq, skv)}


def _bodies(tiles):
    def fwd(*a):
        return k.attention_fwd(*a, **tiles)

    def bwd(*a):
        return k.attention_bwd(*a, **{n: t for n, t in tiles.items() if n != "decode"})

    return fwd, bwd


@pytest.mark.parametrize("tiles", TILES.values(), ids=TILES.keys())
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_shapes(dtype, shape, tiles):
    g = seeded(shape)
    check_kernel("attention", *_bodies(tiles), _args(g, dtype, *shape), dtype, compare_saved=("lse",))


@pytest.mark.parametrize("variant", ["strided", "head_dim_256", "explicit_scale", "zero_scale"])
def test_variants(dtype, variant):
    g = torch.Generator().manual_seed(11)
    if variant == "strided":
        args = _args(g, dtype, 2, 4, 2, 33, 33, 64, True, transposed=True)
    elif variant == "head_dim_256":
        args = _args(g, dtype, 1, 2, 1, 17, 17, 256, True)
    elif variant == "explicit_scale":
        args = _args(g, dtype, 1, 2, 2, 20, 20, 48, False, scale=0.3)
    else:
        # uniform attention; the causal mask must not meet 0 · -inf
        args = _args(g, dtype, 1, 2, 2, 20, 20, 48, True, scale=0.0)
    check_kernel("attention", *_bodies(_all_dims(16, 16)), args, dtype, compare_saved=("lse",))


# Gradient bounds (relative error norm) for nearly one-hot attention. The true gradient is the
# small difference dp - delta: float32 loses the rounding of scores near 200 (~1e-5; float32
# PyTorch itself lands at 1.6e-5..3.3e-5 here), 16-bit dtypes the rounding of o, from which
# delta = rowsum(do * o) is taken, and of p in the forward's p·v (measured: float16 ~2e-3,
# bfloat16 2e-2..6e-2). A wrong gradient is off by order 1.
HUGE_SCORE_GRAD_BOUND = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 0.1}


def test_huge_scores(dtype):
    """Scores with a standard deviation of 64: the softmax is nearly one-hot."""
    g = torch.Generator().manual_seed(13)
    args = _args(g, dtype, 1, 2, 2, 40, 40, 64, True, scale=8.0)
    fwd, bwd = _bodies(_all_dims(16, 16))
    check_kernel("attention", fwd, None, args, dtype, compare_saved=("lse",))
    on_dev = [v.to(device()) if isinstance(v, torch.Tensor) else v for v in args.values()]
    out = fwd(*on_dev)
    do = randn(g, *out[0].shape, dtype=dtype).to(device())
    got = bwd(*on_dev, *out, do)
    spec = kpt.SPECS["attention"]
    ref64 = [v.double() if isinstance(v, torch.Tensor) else v for v in args.values()]
    want = spec.backward(*ref64, *spec.forward(*ref64), do.cpu().double())
    for name, a, b in zip("qkv", got, want):
        assert not bool(a.isnan().any()), f"grad of {name} has NaN"
        err = float((a.cpu().double() - b).norm() / b.norm())
        assert err < HUGE_SCORE_GRAD_BOUND[dtype], f"grad of {name}: relative norm error {err:.3g}"


EMPTY = {"zero_queries": (2, 2, 2, 0, 16, 64, True), "zero_keys": (2, 2, 2, 16, 0, 64, False),
         "zero_batch": (0, 4, 2, 16, 16, 64, False)}


@pytest.mark.parametrize("shape", EMPTY.values(), ids=EMPTY.keys())
def test_empty(dtype, shape):
    g = torch.Generator().manual_seed(3)
    check_kernel("attention", k.attention_fwd, k.attention_bwd, _args(g, dtype, *shape), dtype,
                 compare_saved=("lse",))


# (shape, dtype, tuning): the decode plans apply to 16-bit inputs
BLIND = {"tiles": ((1, 2, 1, 24, 8, 32, True), torch.float32, _all_dims(16, 16)),
         "split_decode": ((1, 1, 1, 30, 20, 32, True), torch.float16, {"decode": SPLIT_DECODE})}


@pytest.mark.parametrize("case", BLIND.values(), ids=BLIND.keys())
def test_blind_queries_are_zero_not_nan(case):
    """Causal with Sq > Skv: the first Sq - Skv queries see no key: o = 0, lse = -inf, zero gradients."""
    shape, dtype, tuning = case
    g = torch.Generator().manual_seed(5)
    a = {n: v.to(device()) if isinstance(v, torch.Tensor) else v
         for n, v in _args(g, dtype, *shape).items()}
    o, lse = k.attention_fwd(*a.values(), **tuning)
    blind = shape[3] - shape[4]
    assert torch.equal(o[:, :, :blind], torch.zeros_like(o[:, :, :blind]))
    assert bool((lse[:, :, :blind] == float("-inf")).all()) and bool(lse[:, :, blind:].isfinite().all())
    do = randn(g, *o.shape, dtype=dtype).to(device())
    dq, dk, dv = k.attention_bwd(*a.values(), o, lse, do, **_all_dims(16, 16))
    assert torch.equal(dq[:, :, :blind], torch.zeros_like(dq[:, :, :blind]))
    assert not any(bool(t.isnan().any()) for t in (dq, dk, dv))


def test_no_output_gradient_gives_zeros():
    g = torch.Generator().manual_seed(9)
    a = {n: v.to(device()) if isinstance(v, torch.Tensor) else v
         for n, v in _args(g, torch.float16, 1, 2, 1, 5, 7, 16, True).items()}
    o, lse = k.attention_fwd(*a.values())
    grads = k.attention_bwd(*a.values(), o, lse, None)
    for grad, inp in zip(grads, (a["q"], a["k"], a["v"])):
        assert grad.shape == inp.shape and grad.dtype == inp.dtype and not bool(grad.any())


# (input, row, value, causal): a NaN or ±inf score in a row; a key hidden from the first queries
# (causal, in a key block past their diagonal) with inf or NaN in k (masked away) and in v (the
# reference's p · v gives 0 · inf = NaN in that column, the queries that see no key included)
SPECIALS = {
    "nan_query": ("q", 30, float("nan"), False),
    "inf_key": ("k", 3, float("inf"), False),
    "neg_inf_key_causal": ("k", 40, float("-inf"), True),
    "hidden_nan_key": ("k", 55, float("nan"), True),
    "hidden_inf_value": ("v", 55, float("inf"), True),
    "hidden_nan_value": ("v", 50, float("nan"), True),
}


# the same for the decode kernel, 4 queries against 50 keys in chunks of 16: the last chunk (keys 48
# and 49) holds only keys hidden from queries 0 and 1, whose (o, lse) there are (0 · v, -inf)
DECODE_SPECIALS = {
    "nan_query": ("q", 2, float("nan"), False),
    "inf_key": ("k", 3, float("inf"), False),
    "neg_inf_key_causal": ("k", 40, float("-inf"), True),
    "hidden_nan_key": ("k", 48, float("nan"), True),
    "hidden_inf_value": ("v", 48, float("inf"), True),
    "hidden_nan_value": ("v", 49, float("nan"), True),
}
SPECIAL_LAYOUTS = {
    **{f"tiles-{n}": (c, (1, 2, 1, 70, 60, 32), _all_dims(16, 16)) for n, c in SPECIALS.items()},
    **{f"split_decode-{n}": (c, (1, 2, 1, 4, 50, 32), {"decode": SPLIT_DECODE}) for n, c in DECODE_SPECIALS.items()},
}


@pytest.mark.parametrize("case", SPECIAL_LAYOUTS.values(), ids=SPECIAL_LAYOUTS.keys())
def test_forward_special_values_match_the_reference(dtype, case):
    """o and lse carry inf and NaN exactly where the float64 reference does (`kpt.kernels`)."""
    (name, row, value, causal), shape, tuning = case
    g = torch.Generator().manual_seed(13)
    a = _args(g, dtype, *shape, causal)  # tiles, causal: queries 0..9 see no key
    a[name][0, 0, row, 5] = value
    a = {n: v.to(device()) if isinstance(v, torch.Tensor) else v for n, v in a.items()}
    o, lse = k.attention_fwd(*a.values(), **tuning)
    o64, lse64 = kpt.SPECS["attention"].forward(*(to64(v) for v in a.values()))
    for out, ref, what in ((o, o64, "o"), (lse, lse64, "lse")):
        out, ref = out.cpu().double(), ref.cpu()
        assert torch.equal(out.isnan(), ref.isnan()), f"{what}: NaN at other places than the reference's"
        assert torch.equal(out.isinf(), ref.isinf()) and bool((out[ref.isinf()] == ref[ref.isinf()]).all())
        finite = ref.isfinite()
        assert_close(out[finite], ref[finite], dtype, what)


# a key with ±inf whose every visible score is −inf (p = 0): the reference's gradients stay finite;
# the query rows padding the last query block (q = 0) must not meet it as 0 · inf = NaN
HIDDEN_INF_KEYS = {
    "causal": (True, float("inf")),  # key 5 seen by query 3 only, whose score with it is −inf
    "full": (False, float("-inf")),  # key 5's score is −inf for every query
}


@pytest.mark.parametrize("case", HIDDEN_INF_KEYS.values(), ids=HIDDEN_INF_KEYS.keys())
def test_backward_special_key_with_zero_weight_stays_finite(case):
    causal, value = case
    g = torch.Generator().manual_seed(21)
    a = _args(g, torch.float32, 1, 1, 1, 4, 6, 16, causal)
    a["k"][0, 0, 5, 2] = value
    a["q"][0, 0, :, 2] = 1.0 if value < 0 else -1.0  # every score with key 5 is −inf
    _assert_backward_nan_as_the_reference(a, g)


@pytest.mark.parametrize("causal", [False, True])
def test_backward_query_with_only_minus_inf_scores_stays_finite(causal):
    """A query with -inf where every key is positive: its scores are all -inf and it sees no key
    (dq = 0); the zero rows padding the last key block must not meet it as inf · 0 = NaN."""
    g = torch.Generator().manual_seed(22)
    a = _args(g, torch.float32, 1, 1, 1, 4, 6, 16, causal)
    a["k"][0, 0, :, 2] = 1.0
    a["q"][0, 0, 3, 2] = float("-inf")
    _assert_backward_nan_as_the_reference(a, g)


def _assert_backward_nan_as_the_reference(a, g):
    """The gradients of the call ``a`` (16×16 tiles; the output gradient drawn from ``g``) are NaN
    where the reference's are, and close to them elsewhere."""
    causal = a["causal"]
    a = {n: v.to(device()) if isinstance(v, torch.Tensor) else v for n, v in a.items()}
    o, lse = k.attention_fwd(*a.values(), **_all_dims(16, 16))
    do = randn(g, *o.shape, dtype=o.dtype).to(o.device)
    got = k.attention_bwd(*a.values(), o, lse, do, **_all_dims(16, 16))
    leaves = {n: to64(a[n]).requires_grad_(True) for n in ("q", "k", "v")}
    ref = kpt.get_backend("reference").attention(**leaves, causal=causal, scale=a["scale"])
    expected = torch.autograd.grad(ref, list(leaves.values()), to64(do))
    for name, grad, e in zip(("dq", "dk", "dv"), got, expected):
        grad = grad.cpu().double()
        assert torch.equal(grad.isnan(), e.isnan()), f"{name}: NaN at other places than the reference's"
        assert_close(grad[e.isfinite()], e[e.isfinite()], torch.float32, name)


# Masks: the conformance cases' forms (`kpt.kernels.attention.MASKS`: key padding, packed documents,
# a sliding window, a static cache's slots, any per-head pattern), each as core passes it (a view
# broadcast to [B, Hq, Sq, Skv]), on shapes whose rows cross tiles: (mask, (B, Hq, Hkv, Sq, Skv, D, causal))
MASKED = {
    # entry 1: 5 pads; entry 2 sees only the last key: its other queries see no key (o = 0, lse = -inf)
    "left_padding": ("left_padding", (3, 4, 2, 24, 24, 32, True)),
    "right_padding_bidirectional": ("right_padding", (2, 2, 1, 24, 24, 64, False)),
    "packed": ("packed", (1, 4, 2, 40, 40, 32, True)),
    "window_chunk": ("window", (2, 2, 1, 20, 48, 32, True)),  # a chunk of queries against a longer cache
    "static_cache": ("static_cache", (2, 4, 2, 3, 32, 64, True)),  # few queries: the decode kernel
    "random": ("random", (2, 4, 2, 20, 33, 16, False)),  # one pattern per head, a query that sees no key
    "random_more_queries_causal": ("random", (2, 2, 1, 40, 17, 80, True)),
}
MASK_TILES = {n: TILES[n] for n in ("portable", "tiles16", "split_decode")}


@pytest.mark.parametrize("tiles", MASK_TILES.values(), ids=MASK_TILES.keys())
@pytest.mark.parametrize("case", MASKED.values(), ids=MASKED.keys())
def test_masks(dtype, case, tiles):
    name, shape = case
    g = torch.Generator().manual_seed(sum(shape[:6]))
    b, hq, _, sq, skv, _, _ = shape
    args = _args(g, dtype, *shape, mask=attention_spec.MASKS[name](g, b, hq, sq, skv))
    check_kernel("attention", *_bodies(tiles), args, dtype, compare_saved=("lse",))


def _strided_masks(g, b, hq, sq, skv):
    """Masks of other layouts than a broadcast one: keys outermost (a transposed view) and a slice at a
    storage offset, with whole rows and columns False."""
    transposed = (torch.rand(b, hq, skv, sq, generator=g) < 0.5).transpose(-1, -2)
    transposed[:, :, 3] = False
    sliced = (torch.rand(b, 1, sq + 3, skv + 5, generator=g) < 0.5)[:, :, 3:, 5:]
    sliced[..., 7] = False
    return {"transposed": transposed, "sliced": sliced}


@pytest.mark.parametrize("layout", ["transposed", "sliced"])
@pytest.mark.parametrize("tiles", MASK_TILES.values(), ids=MASK_TILES.keys())
def test_masks_of_any_strides_with_strided_inputs(dtype, layout, tiles):
    """A mask read by its strides (never copied), with q, k, v as [B, S, H, D] views; grouped-query."""
    g = torch.Generator().manual_seed(17)
    shape = (2, 4, 2, 19, 35, 32)
    mask = _strided_masks(g, 2, 4, 19, 35)[layout]
    assert not mask.is_contiguous()
    args = _args(g, dtype, *shape, True, transposed=True, mask=mask)
    check_kernel("attention", *_bodies(tiles), args, dtype, compare_saved=("lse",))


def _padded_decode_mask(b, skv):
    """One query per head against a left-padded cache: entry 0 sees every key, entry 1 only the last
    third (its first chunks hold padding alone), entry 2 none."""
    mask = torch.ones(b, 1, 1, skv, dtype=torch.bool)
    mask[1, ..., : 2 * skv // 3] = False
    mask[2] = False
    return mask


@pytest.mark.parametrize("tiles", [{}, {"decode": SPLIT_DECODE}], ids=["portable", "split_decode"])
def test_padded_decode_splits_the_cache(dtype, tiles, monkeypatch):
    """The split-KV decode kernel (float32: the portable plan's chunks of 256 keys, with 64
    multiprocessors; 16-bit with the split plan: 16): a chunk whose keys are all masked contributes
    nothing to the merge, and a query that sees no key at all gets o = 0, lse = -inf and zero gradients."""
    monkeypatch.setattr(k.tiling, "multiprocessor_count", lambda device: 64)
    merges = []
    combine = k._attn_decode_combine_kernel

    class Spy:
        def __getitem__(self, grid):
            merges.append(grid)
            return combine[grid]

    monkeypatch.setattr(k, "_attn_decode_combine_kernel", Spy())
    b, skv = 3, 600
    g = torch.Generator().manual_seed(19)
    args = _args(g, dtype, b, 4, 1, 1, skv, 32, True, mask=_padded_decode_mask(b, skv))
    check_kernel("attention", *_bodies(tiles), args, dtype, compare_saved=("lse",))
    assert merges, "the call did not split its keys"


# (shape, tuning): the forward kernel with small tiles, and the split decode kernel
BLIND_MASKED = {"tiles": ((3, 4, 2, 24, 40, 32), TILES["tiles16"]),
                "split_decode": ((3, 4, 1, 2, 600, 32), {"decode": SPLIT_DECODE})}


@pytest.mark.parametrize("case", BLIND_MASKED.values(), ids=BLIND_MASKED.keys())
def test_queries_whose_keys_are_all_masked_are_zero_not_nan(case):
    """A query whose visible keys (the mask's and the causal mask's together) are none: o exactly 0,
    lse -inf, dq exactly 0; a key no query sees: dk, dv exactly 0; no NaN anywhere. Entry 2's keys
    are all masked, entry 1's first two thirds (with causal, its first queries may see none either)."""
    shape, tuning = case
    b, hq, _, sq, skv, _ = shape
    g = torch.Generator().manual_seed(23)
    a = {n: v.to(device()) if isinstance(v, torch.Tensor) else v
         for n, v in _args(g, torch.float16, *shape, True, mask=_padded_decode_mask(b, skv)).items()}
    visible = a["mask"] & attention_spec.visible_keys(sq, skv, True, a["mask"].device)
    blind, unseen = ~visible.any(-1), ~visible.any(-2)  # [B, Hq, Sq] queries, [B, Hq, Skv] keys
    assert blind[2].all() and not blind[0].any()
    o, lse = k.attention_fwd(*a.values(), **tuning)
    assert torch.equal(lse == float("-inf"), blind) and bool(lse[~blind].isfinite().all())
    assert not bool(o[blind].any()) and not bool(o.isnan().any())
    do = randn(g, *o.shape, dtype=o.dtype).to(o.device)
    dq, dk, dv = k.attention_bwd(*a.values(), o, lse, do, **_all_dims(16, 16))
    assert not bool(dq[blind].any())
    unseen_kv = unseen.all(1)  # [B, Skv]: hidden from every query head (a key/value head's group)
    for grad in (dk, dv):
        assert not bool(grad.transpose(1, 2)[unseen_kv].any())
    assert not any(bool(t.isnan().any()) for t in (dq, dk, dv))
