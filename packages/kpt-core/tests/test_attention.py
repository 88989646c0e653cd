"""The attention spec against F.scaled_dot_product_attention (with an explicit bottom-right mask where
Sq != Skv) in float64, forward and gradients, and the edge semantics of the contract: queries that
see no key, decoding with a KV cache, grouped-query heads, zero-size inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kpt
from kpt.kernels.attention import visible_pairs

REF = kpt.get_backend("reference")
SPEC = kpt.SPECS["attention"]


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


def _qkv(b: int, hq: int, hkv: int, sq: int, skv: int, d: int, dtype: torch.dtype = torch.float64):
    g = _gen()
    q = torch.randn(b, hq, sq, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(b, hkv, skv, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(b, hkv, skv, d, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


def _bottom_right(sq: int, skv: int) -> torch.Tensor:
    """True where query i may see key j: j <= i + Skv - Sq."""
    return torch.ones(sq, skv, dtype=torch.bool).tril(diagonal=skv - sq)


def _sdpa(q, k, v, causal: bool, scale: float | None = None) -> torch.Tensor:
    sq, skv = q.shape[2], k.shape[2]
    if causal and sq != skv:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_bottom_right(sq, skv), scale=scale,
                                              enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)


SHAPES = [
    # b, hq, hkv, sq, skv, d
    (2, 4, 4, 64, 64, 64),
    (1, 8, 2, 33, 33, 128),  # grouped-query
    (2, 4, 1, 17, 17, 16),  # multi-query
    (1, 2, 2, 1, 50, 64),  # decoding: one query, a KV cache
    (1, 2, 1, 9, 40, 80),  # chunked prefill
    (1, 1, 1, 3, 5, 256),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_sdpa_forward_and_gradients(shape: tuple[int, ...], causal: bool) -> None:
    q, k, v = (t.requires_grad_(True) for t in _qkv(*shape))
    out = REF.attention(q, k, v, causal=causal)
    expected = _sdpa(q, k, v, causal)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    do = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), do)
    want = torch.autograd.grad(expected, (q, k, v), do)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=f"d{name}")


def test_explicit_scale_and_default_scale() -> None:
    q, k, v = _qkv(1, 2, 2, 16, 24, 32)
    torch.testing.assert_close(REF.attention(q, k, v, scale=0.37), _sdpa(q, k, v, False, scale=0.37))
    args = SPEC.validate(SPEC.bind((q, k, v), {}), REF.dtypes)
    assert isinstance(args["scale"], float) and args["scale"] == 32**-0.5
    # an integer scale is a number too, normalized to float for the op schema
    assert SPEC.validate(SPEC.bind((q, k, v), {"scale": 1}), REF.dtypes)["scale"] == 1.0


def test_lse_is_the_natural_log_sum_exp_of_the_visible_scores() -> None:
    q, k, v = _qkv(2, 4, 2, 12, 20, 32)
    scale = 32**-0.5
    _, lse = SPEC.forward(q, k, v, True, scale, None)
    kk = k.repeat_interleave(2, dim=1)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, kk) * scale
    expected = scores.masked_fill(~_bottom_right(12, 20), float("-inf")).logsumexp(-1)
    assert lse.shape == (2, 4, 12) and lse.dtype == torch.float64
    torch.testing.assert_close(lse, expected, rtol=1e-12, atol=1e-12)


def test_decoding_query_sees_every_key() -> None:
    q, k, v = _qkv(2, 4, 2, 1, 33, 64)
    torch.testing.assert_close(REF.attention(q, k, v, causal=True), REF.attention(q, k, v, causal=False),
                               rtol=0, atol=0)


def test_queries_that_see_no_key_output_zeros() -> None:
    sq, skv = 7, 3  # causal with more queries than keys: queries 0..3 see nothing
    q, k, v = (t.requires_grad_(True) for t in _qkv(1, 2, 1, sq, skv, 16))
    out = REF.attention(q, k, v, causal=True)
    assert not out.isnan().any()
    blind = sq - skv
    assert torch.equal(out[:, :, :blind], torch.zeros_like(out[:, :, :blind]))
    expected = _sdpa(q[:, :, blind:], k, v, causal=True)
    torch.testing.assert_close(out[:, :, blind:], expected, rtol=1e-10, atol=1e-12)

    _, lse = SPEC.forward(q.detach(), k.detach(), v.detach(), True, 16**-0.5, None)
    assert torch.isneginf(lse[:, :, :blind]).all() and torch.isfinite(lse[:, :, blind:]).all()

    do = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv))
    assert torch.equal(dq[:, :, :blind], torch.zeros_like(dq[:, :, :blind]))
    want = torch.autograd.grad(expected, (q, k, v), do[:, :, blind:])
    torch.testing.assert_close(dk, want[1], rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(dv, want[2], rtol=1e-9, atol=1e-11)


def test_no_keys_gives_zeros() -> None:
    q, k, v = (t.requires_grad_(True) for t in _qkv(2, 2, 2, 5, 0, 16))
    out = REF.attention(q, k, v)
    assert out.shape == (2, 2, 5, 16) and torch.equal(out, torch.zeros_like(out))
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert torch.equal(dq, torch.zeros_like(q)) and dk.shape == k.shape and dv.shape == v.shape


def test_tied_scores_of_huge_magnitude_share_the_weight() -> None:
    # two keys holding bfloat16's max give tied scores of about 2e36, where log Σ exp(s − m) = log 2
    # is lost in lse: exp(s − lse) gave each weight 1 (the output twice the mean of their values)
    big = torch.finfo(torch.bfloat16).max
    q = torch.zeros(1, 1, 1, 16, dtype=torch.float64)
    q[..., 0] = -0.25
    k = torch.randn(1, 1, 4, 16, dtype=torch.float64)
    k[0, 0, 1, 0] = k[0, 0, 3, 0] = -big
    k[0, 0, 1, 1:] = k[0, 0, 3, 1:] = 0.0
    v = torch.randn(1, 1, 4, 16, dtype=torch.float64)
    out = REF.attention(q, k, v, scale=0.5)
    torch.testing.assert_close(out[0, 0, 0], (v[0, 0, 1] + v[0, 0, 3]) / 2, rtol=1e-12, atol=0.0)
    # gradients from the same probabilities: Σ_j p_j = 1, so dv sums to dO over the keys
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    do = torch.randn(1, 1, 1, 16, dtype=torch.float64)
    dv = torch.autograd.grad(REF.attention(q, k, v, scale=0.5), v, do)[0]
    torch.testing.assert_close(dv.sum(2), do[0], rtol=1e-12, atol=0.0)
    torch.testing.assert_close(dv[0, 0, 1], do[0, 0, 0] / 2, rtol=1e-12, atol=0.0)


@pytest.mark.parametrize("shape", [(0, 4, 2, 8, 8, 16), (2, 4, 2, 0, 8, 16)], ids=["batch", "queries"])
def test_zero_size_inputs(shape: tuple[int, ...]) -> None:
    q, k, v = (t.requires_grad_(True) for t in _qkv(*shape))
    out = REF.attention(q, k, v, causal=True)
    assert out.shape == q.shape
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert [t.shape for t in grads] == [q.shape, k.shape, v.shape]
    assert all(torch.equal(t, torch.zeros_like(t)) for t in grads)


def test_non_contiguous_inputs_give_the_same_contiguous_output() -> None:
    g = _gen()
    # [B, S, H, D] projections viewed as [B, H, S, D]
    q, k, v = (torch.randn(2, 24, h, 32, generator=g, dtype=torch.float64).transpose(1, 2) for h in (4, 2, 2))
    out = REF.attention(q, k, v, causal=True)
    assert out.is_contiguous()
    dense = REF.attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    torch.testing.assert_close(out, dense, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_low_precision_dtypes(dtype: torch.dtype) -> None:
    q, k, v = _qkv(1, 4, 2, 32, 32, 64, dtype=dtype)
    out, lse = SPEC.forward(q, k, v, True, 0.125, None)
    assert out.dtype == dtype and lse.dtype == torch.float32
    expected = _sdpa(q.double(), k.double(), v.double(), True, scale=0.125)
    tol = kpt.default_tolerance(dtype)
    torch.testing.assert_close(out.double(), expected, rtol=tol.rtol, atol=tol.atol)


@pytest.mark.parametrize("sq, skv", [(8, 8), (3, 10), (10, 3), (1, 7), (0, 4), (4, 0)])
def test_flops_count_the_visible_pairs(sq: int, skv: int) -> None:
    assert visible_pairs(sq, skv, True) == int(_bottom_right(sq, skv).sum())
    assert visible_pairs(sq, skv, False) == sq * skv
    q, k, v = _qkv(2, 4, 2, sq, skv, 16)
    args = SPEC.validate(SPEC.bind((q, k, v), {"causal": True}), REF.dtypes)
    assert SPEC.flops(args) == 4 * 2 * 4 * 16 * int(_bottom_right(sq, skv).sum())


def test_bad_input_messages_say_what_was_given() -> None:
    q, k, v = _qkv(2, 4, 3, 8, 8, 16)
    with pytest.raises(kpt.KernelInputError, match=r"attention: argument 'k' has 3 heads.*4 query heads"):
        REF.attention(q, k, v)
    q, k, v = _qkv(1, 1, 1, 4, 4, 8)
    with pytest.raises(kpt.KernelInputError, match=r"argument 'q' has head dimension 8 .*16\.\.256"):
        REF.attention(q, k, v)


@pytest.mark.parametrize("causal", [False, True])
def test_large_problems_are_computed_in_chunks_with_the_same_result(monkeypatch, causal: bool) -> None:
    """Above `SCORES_PER_CHUNK` the reference works per batch entry and group of key/value heads
    (bounded memory at real shapes); the result must not depend on it."""
    from kpt.kernels import attention

    q, k, v = _qkv(3, 8, 4, 33, 41, 16)
    do = torch.randn_like(q)
    whole = attention.attention_fwd(q, k, v, causal, 0.25, None)
    grads = attention.attention_bwd(q, k, v, causal, 0.25, None, whole[0], whole[1], do)
    # two query heads (one key/value head) per chunk: 12 chunks
    monkeypatch.setattr(attention, "SCORES_PER_CHUNK", 2 * 33 * 41)
    chunked = attention.attention_fwd(q, k, v, causal, 0.25, None)
    chunked_grads = attention.attention_bwd(q, k, v, causal, 0.25, None, chunked[0], chunked[1], do)
    for got, want in zip(chunked + chunked_grads, whole + grads, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
