"""kpt-mps attention with a boolean mask, through the Metal emulator: the shaders read the mask in
place through its strides (a broadcast or sliced view, never a copy), combine it with the causal
mask, and a query that sees no key gives zeros, lse = -inf and zero gradients, with no NaN."""

from __future__ import annotations

import pytest
import torch
from kpt_mps import metal
from kpt_mps.attention import attention_bwd, attention_fwd

import kpt
from kpt.testing import check_backward, check_forward

SPEC = kpt.SPECS["attention"]


def _qkv(g, b=2, hq=4, hkv=2, sq=13, skv=19, d=24):
    """q, k, v with no size a multiple of 8: the tiles' padding meets the mask."""
    return (torch.randn(b, hq, sq, d, generator=g), torch.randn(b, hkv, skv, d, generator=g),
            torch.randn(b, hkv, skv, d, generator=g))


def _key_padding(b, skv, lengths):
    """``[B, 1, 1, Skv]``: entry i's first ``lengths[i]`` keys are real, the rest padding."""
    return (torch.arange(skv)[None, :] < torch.tensor(lengths)[:, None])[:, None, None]


def _sliced_mask(g, b, hq, sq, skv):
    """A per-head mask that is a non-contiguous view: transposed and offset in a larger tensor."""
    return (torch.rand(b, hq, skv + 3, sq, generator=g) < 0.6).transpose(-1, -2)[..., 2:-1]


def _check(args, g):
    forward = check_forward(kpt.get_backend("mps"), SPEC, args, torch.float32)
    assert forward.ok, forward.message
    backward = check_backward(kpt.get_backend("mps"), SPEC, args, torch.float32, g)
    assert backward.ok, backward.message


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("form", ["key_padding", "sliced_per_head"])
def test_masks_match_the_reference(emulated, form, causal):
    g = torch.Generator().manual_seed(3)
    q, k, v = _qkv(g)
    # core expands the key-padding mask to a view with stride 0 over heads and queries
    mask = _key_padding(2, 19, [19, 6]) if form == "key_padding" else _sliced_mask(g, 2, 4, 13, 19)
    _check({"q": q, "k": k, "v": v, "causal": causal, "scale": None, "mask": mask}, g)


def test_the_mask_is_read_through_its_strides(emulated):
    """The same pattern as a broadcast view, a sliced view and a contiguous copy gives the same bits."""
    g = torch.Generator().manual_seed(5)
    q, k, v = _qkv(g)
    sliced = _sliced_mask(g, 2, 4, 13, 19)
    padding = _key_padding(2, 19, [11, 4])
    for mask in (sliced, padding.expand(2, 4, 13, 19)):
        o, lse = attention_fwd(q, k, v, True, 0.2, mask)
        o_copy, lse_copy = attention_fwd(q, k, v, True, 0.2, mask.contiguous())
        assert torch.equal(o, o_copy) and torch.equal(lse, lse_copy)


def test_an_all_true_mask_gives_the_unmasked_bits(emulated):
    g = torch.Generator().manual_seed(7)
    q, k, v = _qkv(g)
    mask = torch.ones(1, 1, 1, 1, dtype=torch.bool).expand(2, 4, 13, 19)
    o, lse = attention_fwd(q, k, v, True, 0.2, mask)
    o_plain, lse_plain = attention_fwd(q, k, v, True, 0.2, None)
    assert torch.equal(o, o_plain) and torch.equal(lse, lse_plain)
    do = torch.randn(o.shape, generator=g)
    for got, plain in zip(attention_bwd(q, k, v, True, 0.2, mask, o, lse, do),
                          attention_bwd(q, k, v, True, 0.2, None, o, lse, do)):
        assert torch.equal(got, plain)


def test_a_query_that_sees_no_key_gives_zeros_and_no_gradient(emulated):
    """Left padding of 5 keys with a causal mask: queries 0..4 of entry 1 see no key; entry 2 sees
    only its last key. Their o and gradients are 0, lse is -inf, nothing is NaN."""
    g = torch.Generator().manual_seed(11)
    q, k, v = _qkv(g, b=3, sq=12, skv=12)
    mask = torch.ones(3, 1, 1, 12, dtype=torch.bool)
    mask[1, ..., :5] = False
    mask[2, ..., :11] = False
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    o = kpt.get_backend("mps").attention(*leaves, causal=True, mask=mask.expand(3, 4, 12, 12))
    o.backward(torch.randn(o.shape, generator=g))
    assert not any(t.isnan().any() for t in (o, q.grad, k.grad, v.grad))
    assert torch.equal(o[1, :, :5], torch.zeros_like(o[1, :, :5]))
    assert torch.equal(q.grad[1, :, :5], torch.zeros_like(q.grad[1, :, :5]))
    assert torch.equal(q.grad[2, :, :11], torch.zeros_like(q.grad[2, :, :11]))
    assert torch.equal(k.grad[1, :, :5], torch.zeros_like(k.grad[1, :, :5]))  # padding keys: seen by none
    assert torch.equal(v.grad[2, :, :11], torch.zeros_like(v.grad[2, :, :11]))
    _, lse = attention_fwd(q.detach(), k.detach(), v.detach(), True, 24**-0.5, mask.expand(3, 4, 12, 12))
    assert torch.equal(lse[1, :, :5], torch.full_like(lse[1, :, :5], -torch.inf))


@pytest.mark.parametrize("old, grads", [
    # the forward ignores the mask: every output of a masked pair differs
    ("sv[j] = seen ? sc * scale : -INFINITY;", "o"),
    # dk and dv ignore the mask (dq and the forward keep it)
    ("ss[e] = seen ? precise::exp(s * scale - stat) : 0.0f;", "dk"),
])
def test_a_kernel_that_ignores_the_mask_fails(emulated, monkeypatch, old, grads):
    original = metal.source

    def source(family: str) -> str:
        text = original(family)
        assert old in text
        return text.replace(old, old.replace("seen ?", "true ?"), 1)

    monkeypatch.setattr(metal, "source", source)
    metal._library.cache_clear()
    g = torch.Generator().manual_seed(3)
    q, k, v = _qkv(g)
    args = {"q": q, "k": k, "v": v, "causal": True, "scale": None, "mask": _key_padding(2, 19, [19, 6])}
    check = check_forward if grads == "o" else check_backward
    report = check(kpt.get_backend("mps"), SPEC, args, torch.float32, *(() if grads == "o" else (g,)))
    assert not report.ok and grads in report.message
