"""Attention with a boolean mask on the simulator: the numbers in both modes (a hidden key adds
exactly nothing, so in fixed point a padded batch is bit for bit the unpadded one), rows that see
no key, and what the mask costs the design (its read and its tile, no skipped tile)."""

from __future__ import annotations

import math

import pytest
import torch

import kpt
from kpt.kernels.attention import visible_pairs
from kpt.testing import check_backward, check_forward
from kpt_fpga_sim import FpgaSimBackend, ap_fixed, configure

SPEC = kpt.SPECS["attention"]


@pytest.fixture(scope="module")
def be() -> FpgaSimBackend:
    return kpt.get_backend("fpga-sim")


@pytest.fixture(scope="module")
def fx(be) -> FpgaSimBackend:
    return configure(be, format=ap_fixed(16, 6, "RND", "SAT"))


def _qkv(g, b=2, hq=4, hkv=2, sq=13, skv=19, d=16):
    return (torch.randn(b, hq, sq, d, generator=g), torch.randn(b, hkv, skv, d, generator=g),
            torch.randn(b, hkv, skv, d, generator=g))


def _key_padding(skv, lengths):
    """``[B, 1, 1, Skv]``: entry i's first ``lengths[i]`` keys are real, the rest padding."""
    return (torch.arange(skv)[None, :] < torch.tensor(lengths)[:, None])[:, None, None]


@pytest.mark.parametrize("fixed", [False, True], ids=["float32", "fixed"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("form", ["key_padding", "per_head"])
def test_masks_match_the_reference(be, fx, fixed, causal, form):
    g = torch.Generator().manual_seed(1)
    q, k, v = _qkv(g)
    if form == "key_padding":
        mask = _key_padding(19, [19, 7])
    else:  # a non-contiguous view, as a transposed mask is
        mask = (torch.rand(2, 4, 19, 13, generator=g) < 0.6).transpose(-1, -2)
    args = {"q": q, "k": k, "v": v, "causal": causal, "scale": None, "mask": mask}
    backend = fx if fixed else be
    forward = check_forward(backend, SPEC, args, torch.float32)
    assert forward.ok, forward.message
    backward = check_backward(backend, SPEC, args, torch.float32, g)
    assert backward.ok, backward.message


def test_fixed_point_padding_is_bit_for_bit_the_shorter_sequence(fx):
    """Hidden keys enter no sum (exp gives exactly 0 at the bottom of its domain, integer sums are
    exact): right padding gives the bits of attention over the real keys alone, and no gradient to
    the padding."""
    g = torch.Generator().manual_seed(2)
    q, k, v = _qkv(g, b=1, sq=9, skv=15)
    real = 10
    do = torch.randn(q.shape, generator=g)
    padded = [t.clone().requires_grad_(True) for t in (q, k, v)]
    short = [t.clone().requires_grad_(True) for t in (q, k[:, :, :real], v[:, :, :real])]
    o = fx.attention(*padded, mask=_key_padding(15, [real]))
    o_short = fx.attention(*short)
    assert torch.equal(o, o_short)
    o.backward(do)
    o_short.backward(do)
    assert torch.equal(padded[0].grad, short[0].grad)
    for got, expected in zip(padded[1:], short[1:]):
        assert torch.equal(got.grad[:, :, :real], expected.grad)
        assert torch.equal(got.grad[:, :, real:], torch.zeros_like(got.grad[:, :, real:]))


@pytest.mark.parametrize("fixed", [False, True], ids=["float32", "fixed"])
def test_a_query_that_sees_no_key_gives_zeros_and_no_gradient(be, fx, fixed):
    """Left padding with a causal mask: the first 5 queries of entry 1 see no key."""
    from kpt_fpga_sim.kernels.attention import attention_fwd
    from kpt_fpga_sim.sim import Call, running

    backend = fx if fixed else be
    g = torch.Generator().manual_seed(3)
    q, k, v = _qkv(g, sq=12, skv=12)
    mask = torch.ones(2, 1, 1, 12, dtype=torch.bool)
    mask[1, ..., :5] = False
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    o = backend.attention(*leaves, causal=True, mask=mask)
    o.backward(torch.randn(o.shape, generator=g))
    assert not any(t.isnan().any() for t in (o, q.grad, k.grad, v.grad))
    for t in (o[1, :, :5], q.grad[1, :, :5], k.grad[1, :, :5], v.grad[1, :, :5]):
        assert torch.equal(t, torch.zeros_like(t))
    with running(Call("attention", backend.config)):
        _, lse = attention_fwd(q.detach(), k.detach(), v.detach(), True, 0.25, mask.expand(2, 4, 12, 12))
    assert torch.equal(lse[1, :, :5], torch.full((4, 5), -math.inf))
    assert lse[0].isfinite().all() and lse[1, :, 5:].isfinite().all()


def _meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("causal", [False, True])
def test_a_mask_costs_its_read_and_its_tile_and_skips_no_tile(be, causal):
    b, hq, sq, skv, d = 2, 8, 256, 256, 64
    q, k = _meta(b, hq, sq, d), _meta(b, hq, skv, d)
    plain = be.estimate("attention", q, k, k, causal=causal)
    padding = be.estimate("attention", q, k, k, causal=causal, mask=_meta(b, 1, 1, skv, dtype=torch.bool))
    full = be.estimate("attention", q, k, k, causal=causal, mask=_meta(b, hq, sq, skv, dtype=torch.bool))
    assert plain.cycles == padding.cycles == full.cycles
    # key padding: one row of Skv bytes per (batch, head); a full mask: the rows of the computed tiles
    assert padding.traffic_bytes - plain.traffic_bytes == b * hq * skv
    seen = visible_pairs(sq, skv, causal) / (sq * skv)
    assert full.traffic_bytes - plain.traffic_bytes == math.ceil(b * hq * sq * skv * seen)
    # the tile: a row of 256 bits per bank fits in LUTs, a block of rows takes block RAM
    assert padding.bram18 == plain.bram18 and padding.lut > plain.lut
    assert full.bram18 > plain.bram18


def test_the_backward_design_reads_the_mask_and_skips_no_tile(be):
    from kpt_fpga_sim.kernels.attention import attention_bwd_design
    from kpt_fpga_sim.sim import Call

    b, hq, s, d = 2, 4, 128, 64
    q, k = _meta(b, hq, s, d), _meta(b, hq, s, d)
    lse = _meta(b, hq, s)
    call = Call("attention", be.config)
    plain = attention_bwd_design(call, q, k, k, True, 0.125, None, q, lse, q)
    masked = attention_bwd_design(call, q, k, k, True, 0.125, _meta(b, hq, s, s, dtype=torch.bool), q, lse, q)
    assert masked.top == plain.top  # the same loops: the same compute cycles
    seen = visible_pairs(s, s, True) / (s * s)
    assert masked.traffic - plain.traffic == math.ceil(b * hq * s * s * seen)
    assert [buf.name for buf in masked.buffers if buf not in plain.buffers] == ["mask tile"]
