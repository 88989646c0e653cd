"""The vendor-native bodies' own logic, on the CPU: the unfused linear (cuBLAS's product on a GPU,
torch's CPU product here) against the float64 reference, and which library each attention call
goes to. Their GPU runs are checked by the conformance suite on a GPU."""

from __future__ import annotations

import pytest
import torch

import kpt
from kpt_cuda import attention, linear, moe, tuning


@pytest.mark.parametrize("activation", [None, "relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_unfused_linear_matches_the_reference(activation, bias):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 24, generator=g)
    w = torch.randn(40, 24, generator=g) / 5
    b = torch.randn(40, generator=g) if bias else None
    y, pre = linear.linear_fwd(x, w, b, activation)
    expected = kpt.get_backend("reference").linear(x.double(), w.double(), None if b is None else b.double(),
                                                   activation=activation)
    torch.testing.assert_close(y, expected.float(), rtol=1e-5, atol=1e-5)
    assert y.shape == (3, 5, 40)
    assert pre.numel() == (0 if activation is None else y.numel())


def _lib(sq, skv, causal, d=128, dtype=torch.bfloat16, scale=0.1, backward=False, batch=1, tiles=None, ws=None):
    return attention._library(torch.empty(batch, 8, sq, d, dtype=dtype), torch.empty(batch, 2, skv, d, dtype=dtype),
                              causal, scale, backward, tiles=tiles, warp_specialized=ws)


@pytest.fixture(autouse=True)
def _an_h100(monkeypatch):
    """132 multiprocessors, as an H100 SXM has."""
    monkeypatch.setattr(attention, "_multiprocessors", lambda dev: 132)


def test_attention_library_choice():
    assert _lib(64, 64, True) == "cudnn"  # equal lengths: cuDNN's top-left mask is kpt's
    assert _lib(1, 4096, True) == "cudnn"  # one query sees every key: no mask to align
    # a few queries against a KV cache: up to 128 rows of 4 query heads x Sq
    assert _lib(8, 4096, True) is None  # kpt-triton's decode kernel
    assert _lib(32, 4096, False, batch=32) is None
    assert _lib(8, 4096, True, backward=True) == "flash"
    assert _lib(33, 4096, True, batch=32) == "cudnn-mask"  # 132 rows: chunked prefill
    assert _lib(8, 4096, True, d=256) is None  # head dim 256: one query tile, 32 rows
    assert _lib(16, 4096, True, d=256) == "flash"
    assert _lib(64, 4096, True) == "flash"  # FlashAttention's bottom-right mask
    assert _lib(64, 4096, False) == "flash"  # few query tiles: FlashAttention splits the keys
    assert _lib(64, 4096, True, batch=32) == "cudnn-mask"  # 32 x 8 tiles: cuDNN with kpt's mask
    assert _lib(64, 4096, False, batch=32) == "cudnn"
    assert _lib(64, 4092, True, batch=32) == "flash"  # the mask's rows would not be 16-byte aligned
    # a causal chunk whose mask is too large to cache: the portable kernel where the arch gives it tiles
    # and its 128-query tiles fill 3 waves (4 x 8 heads x 16 = 512 tiles), else FlashAttention-2
    hopper = tuning.SM90_HBM3E["attention_fwd"]["tiles"]
    assert _lib(2048, 8192, True, batch=4, tiles=hopper) is None
    assert _lib(2048, 8192, True, batch=4) == "flash"
    assert _lib(2048, 8192, True, batch=2, tiles=hopper) == "flash"  # 256 tiles
    assert _lib(2048, 8192, True, batch=4, d=256, tiles=hopper) == "flash"  # no tiles for head dim 256
    assert _lib(1024, 4096, True, batch=4, tiles=hopper) == "cudnn-mask"  # 1024 x 4096: the mask is cached
    # where the arch has a plan for it, kpt's warp-specialized forward takes causal chunks at head dim 128
    # that fill half the multiprocessors with tiles and each with 40 blocks of 128 x 128 visible pairs
    ws = tuning.SM90_HBM3E["attention_fwd"]["warp_specialized"]
    assert _lib(2048, 8192, True, batch=4, tiles=hopper, ws=ws) == "warp-specialized"
    assert _lib(2048, 8192, True, batch=2, tiles=hopper, ws=ws) == "warp-specialized"  # 256 tiles
    assert _lib(2048, 8192, True, batch=4, dtype=torch.float16, ws=ws) == "warp-specialized"
    assert _lib(1024, 16384, True, batch=2, ws=ws) == "warp-specialized"  # 128 tiles, 120 blocks an SM
    assert _lib(1024, 4096, True, batch=4, ws=ws) == "warp-specialized"  # before cuDNN with kpt's mask
    assert _lib(1024, 2048, True, batch=4, ws=ws) == "cudnn-mask"  # 256 tiles, 23 blocks an SM
    assert _lib(512, 16384, True, batch=1, ws=ws) == "flash"  # 32 tiles: a quarter of the SMs
    assert _lib(2048, 8192, True, batch=4, d=64, tiles=hopper, ws=ws) is None  # the portable tiles at 64
    assert _lib(1024, 4096, True, batch=4, d=64, ws=ws) == "cudnn-mask"
    assert _lib(2048, 8192, True, batch=4, d=256, tiles=hopper, ws=ws) == "flash"
    assert _lib(2048, 8192, False, batch=4, ws=ws) == "cudnn"
    assert _lib(2048, 8192, True, batch=4, dtype=torch.float32, ws=ws) is None
    assert _lib(2048, 8192, True, batch=4, ws=ws, backward=True) == "flash"  # its backward reads (o, lse)
    # equal lengths: long sequences with many tiles (8 heads x 32 tiles a batch at 4096)
    assert _lib(4096, 4096, False, batch=8, ws=ws) == "warp-specialized"  # 2048 tiles
    assert _lib(4096, 4096, False, batch=4, ws=ws) == "cudnn"  # 1024 tiles: enough with a mask only
    assert _lib(2048, 2048, True, batch=8, ws=ws) == "warp-specialized"  # 1024 tiles
    assert _lib(2048, 2048, False, batch=64, ws=ws) == "cudnn"  # 8192 tiles, but 2048 keys without a mask
    assert _lib(1024, 1024, True, batch=64, ws=ws) == "cudnn"  # 1024 keys
    assert _lib(4096, 4096, True, batch=8, d=64, ws=ws) == "cudnn"
    assert _lib(4096, 4096, True, batch=8, dtype=torch.float32, ws=ws) is None
    assert _lib(4096, 4096, True, batch=8, ws=ws, backward=True) == "cudnn"  # cuDNN's backward reads (o, lse)
    # one query against a long cache would fill the chunk rule's tiles and blocks, with one row of 128 each
    long_cache = torch.empty(1, 1, 1, 128, dtype=torch.bfloat16).expand(64, 2, 1 << 20, 128)
    assert attention._library(torch.empty(64, 8, 1, 128, dtype=torch.bfloat16), long_cache, True, 0.1,
                              warp_specialized=ws) == "cudnn"
    assert _lib(64, 4096, True, batch=32, backward=True) == "flash"
    assert _lib(1, 1, False, backward=True) == "flash"  # cuDNN's backward refuses Sq = Skv = 1
    assert _lib(100, 10, True) is None  # queries that see no key: the portable kernel's zeros
    assert _lib(100, 10, False) == "flash"
    assert _lib(64, 0, False) is None
    assert _lib(64, 64, True, d=36) is None  # head dim not a multiple of 8
    assert _lib(64, 64, True, dtype=torch.float32) is None
    assert _lib(64, 64, True, scale=0.0) is None
    assert _lib(64, 64, True, d=256) == "cudnn"
    assert _lib(64, 64, True, d=256, backward=True) == "flash"  # cuDNN's backward stops at 128
    assert _lib(64, 64, True, d=128, backward=True) == "cudnn"
    assert attention.available() is (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9)


def test_warp_specialized_sections_hold_whole_groups_within_the_plans_l2_share():
    """The persistent forward runs the tiles of a few heads together (`_ws_tile`): as many grouped-query
    groups as have K and V within the plan's ``l2_section`` bytes, at least one, at most every head."""
    plan = tuning.SM90_HBM3E["attention_fwd"]["warp_specialized"]
    assert plan.l2_section == 16 << 20

    def heads(b, hq, hkv, skv, d=128):
        q = torch.empty(b, hq, 1, d, dtype=torch.bfloat16)
        return attention._section_heads(q, torch.empty(b, hkv, skv, d, dtype=torch.bfloat16), plan)

    assert heads(4, 32, 32, 4096) == 8  # K and V of a head: 2 MiB
    assert heads(2, 32, 8, 8192) == 16  # 4 MiB a group of 4 query heads: 4 groups
    assert heads(1, 32, 32, 65536) == 1  # one head's 32 MiB: still one
    assert heads(1, 32, 4, 65536) == 8  # one group, whole
    assert heads(1, 4, 4, 1024) == 4  # every head fits


@pytest.mark.parametrize("sq", [2, 8])
def test_causal_mask_is_the_last_columns_of_a_cached_band(sq):
    """The causal bias for cuDNN hides exactly the keys j > i + Skv - Sq of query i, for every key
    length served by one band (a decode loop's growing cache), and those lengths share its storage."""
    q = torch.empty(3, 4, sq, 64, dtype=torch.bfloat16)
    bands = set()
    for skv in (8, 16, 24, 512, 520, 1016, 1024):
        mask = attention._causal_mask(q, skv)
        i, j = torch.arange(sq)[:, None], torch.arange(skv)[None, :]
        expected = torch.where(j > i + skv - sq, float("-inf"), 0.0).to(torch.bfloat16)
        assert mask.shape == (3, 4, sq, skv) and torch.equal(mask[2, 3], expected), skv
        assert mask.stride(-2) % 8 == 0 and mask.data_ptr() % 16 == 0  # rows as cuDNN reads them
        bands.add(mask.untyped_storage().data_ptr())
    assert len(bands) == 5  # widths 8, 16, 32 (for 24), 512, 1024 (for 520, 1016 and 1024)


# (Sq, Skv, batch): calls that go to cuDNN, FlashAttention-2 or the warp-specialized forward unmasked
LIBRARY_CALLS = {"one_query": (1, 4096, 1), "chunk": (64, 4096, 1), "long_chunk": (2048, 8192, 4),
                 "odd_keys": (68, 68, 1)}


@pytest.mark.parametrize("shape", LIBRARY_CALLS.values(), ids=LIBRARY_CALLS.keys())
def test_masked_calls_of_other_lengths_run_the_portable_kernels(monkeypatch, shape):
    """A call with a mask whose lengths differ (or whose key rows would not be 16-byte aligned as a
    bias) goes to the portable kernels, forward and backward, with the mask and the arch's tuning
    keywords, where the same call without one goes to a library kernel or kpt's Hopper forward."""
    sq, skv, batch = shape
    tuned = {"tiles": tuning.SM90_HBM3E["attention_fwd"]["tiles"],
             "warp_specialized": tuning.SM90_HBM3E["attention_fwd"]["warp_specialized"]}
    q = torch.empty(batch, 8, sq, 128, dtype=torch.bfloat16)
    k = torch.empty(batch, 2, skv, 128, dtype=torch.bfloat16)
    mask = torch.ones(batch, 1, 1, skv, dtype=torch.bool).expand(batch, 8, sq, skv)
    assert attention._library(q, k, True, 0.1, **tuned) is not None
    assert attention._library(q, k, True, 0.1, **tuned, mask=mask) is None
    assert attention._library(q, k, True, 0.1, backward=True, mask=mask) is None
    calls = []
    monkeypatch.setattr(attention.portable, "attention_fwd", lambda *a, **kw: calls.append((a, kw)) or "fwd")
    monkeypatch.setattr(attention.portable, "attention_bwd", lambda *a, **kw: calls.append((a, kw)) or "bwd")
    assert attention.attention_fwd(q, k, k, True, 0.1, mask, **tuned) == "fwd"
    lse = torch.empty(batch, 8, sq)
    assert attention.attention_bwd(q, k, k, True, 0.1, mask, q, lse, q, tiles=tuned["tiles"]) == "bwd"
    (fwd_args, fwd_tuning), (bwd_args, bwd_tuning) = calls
    assert fwd_args[5] is mask and bwd_args[5] is mask
    assert fwd_tuning["tiles"] is tuned["tiles"] and bwd_tuning == {"tiles": tuned["tiles"]}


def test_masked_calls_of_equal_lengths_run_cudnn_with_a_bias():
    """Training and prefill with a mask (padding, documents, the causal mask transformers builds
    under torch.compile) run cuDNN with the mask as an additive bias, forward and backward; its
    backward only to cuDNN's head dim."""
    tuned = {"tiles": tuning.SM90_HBM3E["attention_fwd"]["tiles"],
             "warp_specialized": tuning.SM90_HBM3E["attention_fwd"]["warp_specialized"]}
    for s, d in ((64, 64), (4096, 128), (2048, 256)):
        q = torch.empty(4, 8, s, d, dtype=torch.bfloat16)
        k = torch.empty(4, 2, s, d, dtype=torch.bfloat16)
        mask = torch.ones(4, 1, s, s, dtype=torch.bool).expand(4, 8, s, s)
        assert attention._library(q, k, True, 0.1, **tuned, mask=mask) == "cudnn-bias"
        assert attention._library(q, k, False, 0.1, mask=mask) == "cudnn-bias"
        assert attention._library(q, k, True, 0.1, backward=True, mask=mask) == ("cudnn-bias" if d <= 128 else None)
        assert attention._library(q.float(), k.float(), True, 0.1, mask=mask) is None


def test_a_mask_becomes_an_additive_bias_made_once_per_batch_entry():
    """`_mask_bias`: 0 where a key is seen, -inf where hidden, in the queries' dtype, built over the
    batch and heads the mask varies over and broadcast (stride 0) over the rest."""
    seen = torch.rand(3, 1, 5, 8) < 0.5
    mask = seen.expand(3, 4, 5, 8)
    bias = attention._mask_bias(mask, torch.bfloat16)
    assert bias.shape == mask.shape and bias.dtype == torch.bfloat16 and bias.stride(1) == 0
    assert torch.equal(bias == 0, mask) and bool(bias[~mask].eq(float("-inf")).all())
    padding = (torch.rand(3, 1, 1, 8) < 0.5).expand(3, 4, 5, 8)
    assert torch.equal(attention._compact(padding), padding[:, :1, :1])  # keys only: one row per batch entry
    bias = attention._mask_bias(padding, torch.float16)
    assert torch.equal(bias == 0, padding) and bias.stride(1) == bias.stride(2) == 0


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq", [5, 8])
def test_a_query_sees_a_key_where_its_mask_and_the_causal_one_both_let_it(causal, sq):
    """`_sees` (which queries cuDNN's NaN becomes zeros at) against the mask and the bottom-right
    causal one applied in full: a key-padding mask (stride 0 over the queries) whose first keys are
    hidden leaves the first queries of a causal layer nothing to see, not every query something."""
    from kpt.kernels.attention import visible_keys

    keys = torch.ones(3, 1, 1, 8, dtype=torch.bool)
    keys[0, ..., :4] = False  # left padding
    keys[1, ..., 6:] = False  # right padding
    keys[2] = False  # nothing to see
    whole = torch.rand(3, 1, sq, 8) < 0.3
    for mask in (keys.expand(3, 4, sq, 8), whole.expand(3, 4, sq, 8)):
        full = mask & visible_keys(sq, 8, causal)
        assert torch.equal(attention._sees(mask, causal).expand(3, 4, sq), full.any(-1))


def test_fused_kernels_get_aligned_views():
    """A view at an odd storage offset, or with a row stride that is not 16-byte aligned, is copied
    before it reaches cuDNN or FlashAttention-2 (on an H100 such a view faulted with "misaligned
    address"); an aligned view, transposed heads included, goes as it is."""
    buffer = torch.randn(3 + 2 * 4 * 16 * 64).bfloat16()
    odd = buffer[3:].view(2, 4, 16, 64)
    assert odd.data_ptr() % 16
    copy = attention._fused_layout(odd)
    assert copy.data_ptr() % 16 == 0 and copy.is_contiguous() and torch.equal(copy, odd)
    padded = torch.randn(2, 4, 16, 68).bfloat16()[..., 2:66]  # rows 68 apart, data 4 bytes in
    assert attention._fused_layout(padded).data_ptr() % 16 == 0
    heads = torch.randn(2, 16, 4, 64).bfloat16().transpose(1, 2)  # [B, S, H, D] as [B, H, S, D]
    assert attention._fused_layout(heads) is heads
    # aligned data and rows, but batches 4 elements (8 bytes) further apart than the heads fill
    skewed = torch.randn(2 * (4 * 16 * 64 + 4)).bfloat16().as_strided((2, 4, 16, 64), (4 * 16 * 64 + 4, 16 * 64, 64, 1))
    assert attention._fused_layout(skewed).is_contiguous()


@pytest.mark.skipif(not attention.available(), reason="needs a Hopper GPU (cuDNN and FlashAttention-2)")
def test_misaligned_views_match_the_reference_on_hopper():
    g = torch.Generator().manual_seed(3)

    def odd_view(*shape):
        t = torch.randn(5 + torch.Size(shape).numel(), generator=g).bfloat16().cuda()
        return t[5:].view(*shape).requires_grad_()

    q, k, v = odd_view(1, 4, 64, 64), odd_view(1, 2, 64, 64), odd_view(1, 2, 64, 64)
    be, ref = kpt.get_backend("cuda"), kpt.get_backend("reference")
    o = be.attention(q, k, v, causal=True)
    do = torch.randn(o.shape, generator=g).bfloat16().cuda()
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    expected = ref.attention(*leaves, causal=True)
    torch.testing.assert_close(o.cpu().double(), expected.detach(), rtol=2e-2, atol=2e-2)
    for got, want in zip((dq, dk, dv), torch.autograd.grad(expected, leaves, do.cpu().double())):
        torch.testing.assert_close(got.cpu().double(), want, rtol=2e-2, atol=5e-2)


@pytest.mark.skipif(not attention.available(), reason="needs a Hopper GPU")
@pytest.mark.parametrize(("b", "hq", "hkv", "sq", "skv", "causal"), [
    (4, 16, 4, 1000, 1000, True),  # 512 tiles on 132 or so programs: the tile counter, the L2 sections
    (2, 8, 2, 300, 1000, True),  # a chunk, bottom-right; lengths off the tile
    (3, 8, 8, 700, 700, False),
    (1, 4, 4, 1, 700, True),
    (1, 2, 2, 1, 1, False),
], ids=["counter", "chunk", "full", "one-query", "one-key"])
def test_warp_specialized_forward_matches_the_reference_on_hopper(b, hq, hkv, sq, skv, causal):
    """kpt's Hopper forward, called directly (its route takes only long calls): o and lse against the
    float64 reference, q and v as [B, S, H, D] views. A first call on NaN queries and values leaves
    NaN in the blocks the second call's outputs get from torch's allocator (same sizes, just freed),
    so an element the kernel does not write fails the comparison."""
    g = torch.Generator().manual_seed(sq + skv)
    plan = tuning.SM90_HBM3E["attention_fwd"]["warp_specialized"]
    q = torch.randn(b, sq, hq, 128, generator=g).bfloat16().transpose(1, 2)
    k = torch.randn(b, hkv, skv, 128, generator=g).bfloat16()
    v = torch.randn(b, skv, hkv, 128, generator=g).bfloat16().transpose(1, 2)

    def forward(q, k, v):
        return attention.warp_specialized_fwd(*(attention._fused_layout(t.cuda()) for t in (q, k, v)), causal,
                                              128 ** -0.5, plan)

    poisoned = forward(torch.full_like(q, float("nan")), k, torch.full_like(v, float("nan")))
    assert poisoned[0].isnan().all()
    del poisoned
    o, lse = forward(q, k, v)
    qd, kd, vd = (t.double().repeat_interleave(hq // t.shape[1], 1) for t in (q, k, v))
    scores = qd @ kd.transpose(-1, -2) * 128 ** -0.5
    if causal:
        hidden = torch.ones(sq, skv, dtype=torch.bool).triu(skv - sq + 1)
        scores = scores.masked_fill(hidden, float("-inf"))
    torch.testing.assert_close(lse.cpu().double(), scores.logsumexp(-1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(o.cpu().double(), scores.softmax(-1) @ vd, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not attention.available(), reason="needs a Hopper GPU (cuDNN and FlashAttention-2)")
def test_cudnn_with_the_cached_causal_mask_matches_the_reference_on_hopper():
    """Chunked prefill with enough query tiles for cuDNN (`_library`: "cudnn-mask"), key lengths
    that share a band and one that does not."""
    g = torch.Generator().manual_seed(4)
    be, ref = kpt.get_backend("cuda"), kpt.get_backend("reference")
    for skv in (1024, 1016, 520, 72):
        q = torch.randn(32, 8, 64, 64, generator=g).bfloat16()
        k, v = (torch.randn(32, 2, skv, 64, generator=g).bfloat16() for _ in range(2))
        assert attention._library(q.cuda(), k.cuda(), True, 0.125) == "cudnn-mask"
        o = be.attention(q.cuda(), k.cuda(), v.cuda(), causal=True)
        expected = ref.attention(q.double(), k.double(), v.double(), causal=True)
        torch.testing.assert_close(o.cpu().double(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not attention.available(), reason="needs a Hopper GPU (cuDNN)")
@pytest.mark.parametrize("form", ["padding", "key-padding", "documents", "causal_whole"])
def test_cudnn_with_a_mask_matches_the_reference_on_hopper(form):
    """Masked calls of equal lengths on cuDNN ("cudnn-bias"): output and gradients against the float64
    reference, left-padded rows whose padding queries see no key among them (zeros, no gradient, no
    NaN), as a whole mask and as key padding under the causal mask (a bias broadcast over the
    queries), packed documents, and the whole causal mask transformers builds under torch.compile."""
    g = torch.Generator().manual_seed(7)
    b, hq, hkv, s, d = 3, 8, 2, 264, 64
    if form == "padding":  # left padding: row i's first 40 * i keys hidden, and its queries there see none
        keys = torch.arange(s)[None, :] >= 40 * torch.arange(b)[:, None]
        mask = keys[:, None, None, :] & torch.ones(s, s, dtype=torch.bool).tril()
        mask = mask & keys[:, None, :, None]
    elif form == "key-padding":  # the same left padding as kpt.patch gives it: the keys only, under the causal mask
        mask = (torch.arange(s)[None, :] >= 40 * torch.arange(b)[:, None])[:, None, None, :]
    elif form == "documents":
        doc = torch.cat([torch.full((n,), i) for i, n in enumerate((100, 64, 100))])
        mask = (doc[:, None] == doc[None, :]).tril().expand(b, 1, s, s)
    else:
        mask = torch.ones(s, s, dtype=torch.bool).tril().expand(b, 1, s, s)
    q = torch.randn(b, hq, s, d, generator=g).bfloat16()
    k, v = (torch.randn(b, hkv, s, d, generator=g).bfloat16() for _ in range(2))
    do = torch.randn(b, hq, s, d, generator=g).bfloat16()
    be, ref = kpt.get_backend("cuda"), kpt.get_backend("reference")
    leaves = [t.cuda().requires_grad_() for t in (q, k, v)]
    full = mask.cuda().expand(b, hq, s, s)
    assert attention._library(leaves[0], leaves[1], True, d ** -0.5, mask=full) == "cudnn-bias"
    o = be.attention(*leaves, causal=True, mask=mask.cuda())
    grads = torch.autograd.grad(o, leaves, do.cuda())
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    expected = ref.attention(*exact, causal=True, mask=mask)
    for got, want in zip((o, *grads), (expected, *torch.autograd.grad(expected, exact, do.double()))):
        assert not got.isnan().any()
        torch.testing.assert_close(got.cpu().double(), want.detach(), rtol=2e-2, atol=5e-2)
    if form in ("padding", "key-padding"):
        assert bool((o[2, :, :80] == 0).all()) and bool((grads[0][2, :, :80] == 0).all())


def test_grouped_linear_in_the_library_matches_the_reference():
    """bfloat16 with K, N multiples of 8 goes to ``torch._grouped_mm``; other operands go to the
    portable Triton kernel. On a GPU if there is one (its Triton kernels take no CPU tensors), else
    on the CPU through Triton's interpreter."""
    g = torch.Generator().manual_seed(2)
    xc = torch.randn(20, 16, generator=g).bfloat16()
    wc = (torch.randn(3, 24, 16, generator=g) / 4).bfloat16()
    oc = torch.tensor([2, 9, 9, 17], dtype=torch.int32)  # an empty expert; rows 0, 1, 17.. in none
    dyc = torch.randn(20, 24, generator=g).bfloat16()
    x, w, offsets, dy = (t.to("cuda" if torch.cuda.is_available() else "cpu") for t in (xc, wc, oc, dyc))
    assert moe.products.grouped_in_library(x, w)
    assert not moe.products.grouped_in_library(x.float(), w.float())
    assert not moe.products.grouped_in_library(x[:, :12], w[:, :, :12])
    (y,) = moe.grouped_linear_fwd(x, offsets, w)
    expected = kpt.get_backend("reference").grouped_linear(xc.double(), oc, wc.double())
    torch.testing.assert_close(y.cpu().double(), expected, rtol=2e-2, atol=2e-2)
    dx, dw = moe.grouped_linear_bwd(x, offsets, w, y, dy)
    xd, wd = xc.double().requires_grad_(), wc.double().requires_grad_()
    kpt.get_backend("reference").grouped_linear(xd, oc, wd).backward(dyc.double())
    torch.testing.assert_close(dx.cpu().double(), xd.grad, rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(dw.cpu().double(), wd.grad, rtol=2e-2, atol=5e-2)



@pytest.mark.parametrize(("causal", "dtype", "sq", "skv", "spill"), [
    (True, "bfloat16", 512, 4096, 16), (False, "float16", 512, 4096, 16), (True, "bfloat16", 300, 1000, 40),
    (False, "bfloat16", 4096, 4096, 16),
], ids=["causal-aligned", "full-aligned-fp16", "causal-odd", "equal-lengths"])
def test_warp_specialized_forward_compiles_for_hopper(causal, dtype, sq, skv, spill):
    """The Hopper forward (Gluon) compiles for sm_90a here, within the shared memory one block may use,
    spilling at most ``spill`` bytes a thread: under Triton 3.6, 8-16 at lengths that are multiples of
    16 (Triton specializes them; a consumer stores one value when it starts and loads it once a tile),
    40 at other lengths (their index arithmetic), none in the loops over keys; none under Triton 3.9.
    Checked ahead of time, since it runs only on a Hopper GPU, in a process without the interpreter
    these tests run Triton in."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("compile_hopper.py")
    out = subprocess.run([sys.executable, str(script), str(causal), dtype, str(sq), str(skv)], capture_output=True,
                         text=True, env={**os.environ, "TRITON_INTERPRET": "0"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["setmaxnreg"] >= 2  # the consumers take the registers the producer gives up
    assert result["registers"] > 0
    assert result["spills"] <= spill
    assert 0 < result["shared"] <= 232448
