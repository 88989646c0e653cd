"""Scaled dot-product attention as an HLS design: ``attention`` (grouped-query, causal, with an
optional boolean mask).

Per (batch, query head), a block of query rows at a time (DATAFLOW over the blocks):

    qk:       S = Q · Kᵀ · scale          MAC array, K loop over D        (causal tiles skipped)
    softmax:  m = max_j S, e = exp(S − m) on the visible keys, l = Σ_j e   (score rows on chip)
    pv:       O = (e · V) · (1/l),  lse = m + ln l                         MAC array, K loop over Skv

The score rows of a query block are held on chip (BRAM/URAM), so the softmax is exact rather
than an online rescaling. A key is visible when the causal mask and the boolean mask both allow
it; the boolean mask's rows for the query block are streamed into an on-chip tile (one bit per
pair) and select in the softmax, and they skip no tile: which tiles it empties is data, and the
design is fixed by the shapes. A query that sees no key outputs zeros and lse = −∞ (its gradients
are zero).

Backward (scores recomputed from lse): P = exp(S − lse), dV = Σ_group Pᵀ dO, dP = dO Vᵀ,
dS = P ⊙ (dP − rowsum(P ⊙ dP)), dQ = dS K · scale, dK = Σ_group dSᵀ Q · scale; dP is declared
in the wide format with the growth bits of its sum over D.
"""

from __future__ import annotations

import math

import torch

from kpt.kernels.attention import visible_keys, visible_pairs

from ..hls import Buffer, Design, Loop, region
from ..sim import Call, current, flops, matmul, zeros


def _grouped(a, q, k, v, causal, scale, mask):
    """Loaded q, k, v grouped ``[B, Hkv, G|1, S, D]``, the scores (declared wide) and the visible
    pairs (causal and ``mask``; ``[Sq, Skv]`` without a mask, else ``[B, Hkv, G, Sq, Skv]``)."""
    batch, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    qg = a.load(q, "q").reshape(batch, hkv, hq // hkv, sq, d)
    kg, vg = a.load(k, "k")[:, :, None], a.load(v, "v")[:, :, None]
    s = a.cast(qg @ kg.mT * a.const(scale), "scores", a.wide)
    visible = visible_keys(sq, skv, causal)
    if mask is not None:
        visible = visible & mask.reshape(batch, hkv, hq // hkv, sq, skv)
    return qg, kg, vg, s, visible


def attention_fwd(q, k, v, causal, scale, mask):
    a = current().arith
    if k.shape[2] == 0:
        return zeros(q), torch.full(q.shape[:3], -math.inf)
    _, _, vg, s, visible = _grouped(a, q, k, v, causal, scale, mask)
    m = a.where(visible, s, a.lowest).amax(-1)
    seen = visible.any(-1)
    if isinstance(m, torch.Tensor):
        # floating point: every visible score -inf (an inf in q or k) is a row that saw no key, as
        # in the reference (fixed-point formats have no infinities)
        seen = seen & (m != -math.inf)
    m = a.where(seen, m, a.const(0.0))
    # masked scores go to the bottom of the exp unit's domain, where it gives exactly 0
    e = a.exp(a.where(visible, s - m[..., None], a.lowest))
    total = e.sum(-1)
    o = a.cast((e @ vg) * a.recip(a.where(seen, total, a.const(1.0)))[..., None], "o")
    lse = a.out(a.cast(m + a.log(a.where(seen, total, a.const(1.0))), "lse", a.wide), torch.float32)
    # a +inf score: lse = +inf (e holds inf - inf = NaN there), as torch.logsumexp gives
    lse = torch.where(a.out(m, torch.float32) == math.inf, math.inf, lse)
    lse = torch.where(seen, lse, -math.inf).reshape(q.shape[:3])
    return a.out(o, q.dtype).reshape(q.shape), lse


def attention_bwd(q, k, v, causal, scale, mask, o, lse, do):
    a = current().arith
    if k.shape[2] == 0:
        return tuple(zeros(t) for t in (q, k, v))
    qg, kg, vg, s, visible = _grouped(a, q, k, v, causal, scale, mask)
    # a row that saw no key (lse = -inf) has no visible score; NaN and +inf rows keep their lse
    lse_v = a.load(torch.where(lse == float("-inf"), 0.0, lse).reshape(s.shape[:-1]), "lse", a.wide)
    p = a.exp(a.where(visible, s - lse_v[..., None], a.lowest))
    dog = a.load(do, "do").reshape(qg.shape)
    summed = a.grown(qg.shape[2] * qg.shape[3])
    dv = a.cast((p.mT @ dog).sum(2), "dv", summed)
    # dP sums D products of unit-scale values (standard deviation √D: 8 at D = 64, beyond the
    # wide format's ±32 in about one element in 10⁴): declared with the sum's growth bits
    dp = a.cast(dog @ vg.mT, "dp", a.grown(q.shape[-1], a.wide))
    ds = a.cast(p * (dp - (p * dp).sum(-1)[..., None]), "ds", a.wide)
    dq = a.cast((ds @ kg) * a.const(scale), "dq")
    dk = a.cast((ds.mT @ qg).sum(2) * a.const(scale), "dk", summed)
    return (a.out(dq, q.dtype).reshape(q.shape), a.out(dk, k.dtype).reshape(k.shape),
            a.out(dv, v.dtype).reshape(v.shape))


def _shapes(q, k):
    batch, hq, sq, d = q.shape
    return batch * hq, sq, k.shape[2], d


def _mask_tile(call: Call, mask, block_rows: int, seen: float, lanes: int) -> tuple[tuple[Buffer, ...], int]:
    """The on-chip mask tile of a query block (one bit per pair, ping-pong) and the mask bytes
    read off chip, none without a mask. Per (batch, query head) the design reads the mask rows
    of its query blocks, of the causally visible tiles only; a mask broadcast over the queries
    (key padding: stride 0) is one row, read once per head and held for all its blocks."""
    if mask is None:
        return (), 0
    batch, hq, sq, skv = mask.shape
    per_query = mask.stride(2) != 0 and sq > 1
    rows, tile_rows = (sq, block_rows) if per_query else (1, 1)
    traffic = math.ceil(batch * hq * rows * skv * (seen if per_query else 1.0) * call.elem_bytes(mask))
    return (Buffer("mask tile", 1, tile_rows * max(skv, 1), call.banks(lanes), 2),), traffic


def attention_design(call: Call, q, k, v, causal, scale, mask):
    heads, sq, skv, d = _shapes(q, k)
    # the tiles the causal mask hides are skipped; the boolean mask skips none (a select)
    seen = visible_pairs(sq, skv, causal) / max(sq * skv, 1)
    qk, qk_bufs, qk_bytes, t = matmul(call, "qk", sq, skv, d, batch=heads, share=0.5, visible=seen)
    pv, pv_bufs, pv_bytes, _ = matmul(call, "pv", sq, d, skv, batch=heads, share=0.5, visible=seen)
    lanes = max(1, t.tm * t.tn // max(d, 1))
    rows = heads * sq
    mask_bufs, mask_bytes = _mask_tile(call, mask, t.bm, seen, lanes)
    reads = {b.name: (lanes, b.banks) for b in mask_bufs}  # the softmax's passes select with the tile
    softmax = [Loop("row max", math.ceil(seen * rows * skv / lanes), {"cmp": lanes}, ("cmp",), accesses=reads),
               Loop("exp_sum", math.ceil(seen * rows * skv / lanes), {"add": 2 * lanes, "exp": lanes},
                    ("add", "exp", "add"), accesses=reads),
               Loop("row unit", rows, {"recip": 1, "log": 1, "add": 1}, ("log", "add"))]
    top = region("attention", [qk, *softmax, pv], dataflow=call.directives.dataflow)
    scores = Buffer("score rows", call.data_bits + 4, t.bm * max(skv, 1), call.banks(lanes), 2)
    traffic = qk_bytes + pv_bytes + call.io_bytes(q) + 4 * rows + mask_bytes
    return Design("attention", top, (*qk_bufs, *pv_bufs, scores, *mask_bufs), traffic,
                  flops("attention", (q, k, v, causal, scale, mask)))


def attention_bwd_design(call: Call, q, k, v, causal, scale, mask, *outputs_and_grads):
    heads, sq, skv, d = _shapes(q, k)
    seen = visible_pairs(sq, skv, causal) / max(sq * skv, 1)
    buffers: list[Buffer] = []
    stages, traffic, tilings = [], 0, {}
    for name, m, n, kk in (("qk", sq, skv, d), ("dv", skv, d, sq), ("dp", sq, skv, d),
                           ("dq", sq, d, skv), ("dk", skv, d, sq)):
        loop, bufs, nbytes, tilings[name] = matmul(call, name, m, n, kk, batch=heads, share=0.2, visible=seen)
        stages.append(loop)
        buffers += bufs
        traffic += nbytes
    # the recomputed scores are masked as they leave the qk MAC array, a row of tn per cycle
    mask_bufs, mask_bytes = _mask_tile(call, mask, tilings["qk"].bm, seen, tilings["qk"].tn)
    traffic += call.io_bytes(q, k, v, q) + mask_bytes
    return Design("attention", region("attention backward", stages, dataflow=call.directives.dataflow),
                  (*buffers, *mask_bufs), traffic, flops("attention", (q, k, v, causal, scale, mask), 2.5))
