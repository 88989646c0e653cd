"""Cross-entropy as HLS designs: ``cross_entropy`` and ``linear_cross_entropy``.

cross_entropy, for each row of logits (DATAFLOW over rows, ping-pong row buffer, U lanes):

    max:       for j step U  PIPELINE   row[j] = z[j]; m = max(m, z[j]); pick z[t]; Σ z
    exp_sum:   for j step U  PIPELINE   s += exp(row[j] − m)
    row unit:  lse = m + ln s;  loss = lse − (1 − ε) z[t] − ε Σz / V   (ignored rows: 0)
    reduce:    Σ over rows, times 1/kept for "mean" (0 when every row is ignored)

With a gradient wanted, a third pass over the row buffer writes dz = g_r · (exp(z − lse) −
(1 − ε) onehot(t) − ε / V) for an upstream gradient of 1 (g_r = 1 or 1/kept; 0 on ignored rows),
and the backward only streams dz through a multiplier by the upstream gradient.

linear_cross_entropy streams chunks of rows: the logits of a chunk come from the MAC array
(`kpt_fpga_sim.kernels.linear`), the row pipeline above consumes them, and for "mean"/"sum" with
gradients the same chunk's dz feeds two more MAC arrays (dhidden = dz · W, dW += dzᵀ · H), so the
[N, V] logits never leave the chip. The gradient of every row is a multiple of one scalar (1 or
1/kept), applied after the matrix products.
"""

from __future__ import annotations

import math

import torch

from kpt.kernels.cross_entropy import CHUNK_ELEMENTS

from ..hls import Buffer, Design, region
from ..sim import Call, Pass, current, flops, matmul, row_design, stream


def _targets(target, v):
    """Targets safe to index with (an ignored target may be any integer)."""
    return target.clamp(0, max(v - 1, 0))[:, None]


def _row_terms(a, z, target, ignore_index, smoothing):
    """``(lse, losses)`` of loaded logits ``[n, V]`` (losses 0 on ignored rows)."""
    v = z.shape[1]
    kept = target != ignore_index
    if v == 0:
        lse = a.where(kept, a.const(0.0), a.const(0.0))
        return lse, lse
    m = z.amax(-1)
    lse = a.cast(m + a.log(a.exp(z - m[:, None]).sum(-1)), "lse", a.wide)
    if isinstance(m, torch.Tensor):
        # floating point: a +inf logit makes the shifted sum NaN (inf − inf); the log-sum-exp is
        # then +inf, as in the reference (fixed-point formats have no infinities)
        lse = torch.where(m == math.inf, m, lse)
    picked = z.gather(1, _targets(target, v))[:, 0]
    loss = lse - picked
    if smoothing:
        # ε·(z[t] − Σz / V) as its own term: a row with one class (or equal logits) loses exactly 0
        loss = loss + (a.const(smoothing) * picked - a.const(smoothing / v) * z.sum(-1))
        if isinstance(picked, torch.Tensor):
            # floating point: a -inf target logit gives +inf − inf there (NaN); the contract's
            # (1 − ε)·(lse − z[t]) + ε·(lse − mean(z)) is +inf (NaN at ε = 1)
            whole = (1.0 - smoothing) * (lse - picked) + smoothing * (lse - z.mean(-1))
            loss = torch.where(picked == -math.inf, whole, loss)
    return lse, a.where(kept, loss, a.const(0.0))


def _scale(a, target, ignore_index, reduction):
    """The gradient every kept row's loss gets from the reduction: 1, or 1/kept for "mean"."""
    if reduction != "mean":
        return a.const(1.0)
    kept = (target != ignore_index).sum().clamp(min=1)
    return a.recip(a.count(kept))


def _reduce(a, losses, target, ignore_index, reduction):
    if reduction == "none":
        return losses
    total = losses.sum(0)
    return total * _scale(a, target, ignore_index, reduction) if reduction == "mean" else total


def _loss_format(a, reduction, target):
    """A summed loss is declared with the sum's growth bits; a mean or per-row loss is not."""
    return a.grown(target.shape[0]) if reduction == "sum" else None


def _dlogits(a, z, target, lse, smoothing):
    """``softmax(z) − (1 − ε) onehot − ε/V`` (declared in the wide format)."""
    p = a.exp(z - lse[:, None])
    hot = torch.arange(z.shape[1]) == target[:, None]
    d = a.where(hot, p - a.const(1.0 - smoothing), p)
    if smoothing:
        d = d - a.const(smoothing / max(z.shape[1], 1))
    return a.cast(d, "dz", a.wide)


def cross_entropy_fwd(logits, target, ignore_index, label_smoothing, reduction, needs_grad):
    a = current().arith
    z = a.load(logits, "logits")
    lse, losses = _row_terms(a, z, target, ignore_index, label_smoothing)
    loss = a.cast(_reduce(a, losses, target, ignore_index, reduction), "loss",
                  _loss_format(a, reduction, target))
    if not needs_grad:
        return a.out(loss, torch.float32), logits.new_empty(0)
    d = _dlogits(a, z, target, lse, label_smoothing) * _scale(a, target, ignore_index, reduction)
    dz = a.where((target != ignore_index)[:, None], a.cast(d, "dlogits"), a.const(0.0))
    return a.out(loss, torch.float32), a.out(dz, logits.dtype)


def cross_entropy_bwd(logits, target, ignore_index, label_smoothing, reduction, needs_grad, loss, dlogits, dloss):
    a = current().arith
    g = a.load(dloss, "dloss")
    dz = a.cast(a.load(dlogits, "dlogits") * (g[:, None] if reduction == "none" else g), "dlogits")
    return a.out(dz, dlogits.dtype)


# -- linear_cross_entropy --------------------------------------------------------------------


def _chunks(n, v):
    step = max(1, CHUNK_ELEMENTS // max(v, 1))
    # with no rows, one empty chunk still gives every result its shape
    return [slice(s, s + step) for s in range(0, max(n, 1), step)]


def _logits(a, h, w, b):
    z = h @ w.mT
    return a.cast(z + b if b is not None else z, "logits", a.wide)


def linear_cross_entropy_fwd(hidden, weight, target, bias, ignore_index, reduction, needs_grad):
    a = current().arith
    w = a.load(weight, "weight")
    b = a.load(bias, "bias") if bias is not None else None
    fused = needs_grad and reduction != "none"
    losses, lses, dhs, dw, db = [], [], [], None, None
    for r in _chunks(hidden.shape[0], weight.shape[0]):
        h = a.load(hidden[r], "hidden")
        z = _logits(a, h, w, b)
        lse, loss = _row_terms(a, z, target[r], ignore_index, 0.0)
        losses.append(loss)
        lses.append(lse)
        if fused:
            # an ignored row adds nothing, also where its hidden state or a weight holds inf or NaN
            kept = (target[r] != ignore_index)[:, None]
            d = a.where(kept, _dlogits(a, z, target[r], lse, 0.0), a.const(0.0))
            dhs.append(a.where(kept, d @ w, a.const(0.0)))
            hk = a.where(kept, h, a.const(0.0))
            dw = d.mT @ hk if dw is None else dw + d.mT @ hk
            db = d.sum(0) if db is None else db + d.sum(0)
    loss = a.cast(_reduce(a, a.cat(losses, 0), target, ignore_index, reduction), "loss",
                  _loss_format(a, reduction, target))
    lse = a.out(a.cat(lses, 0), torch.float32)
    if not fused:
        return (a.out(loss, torch.float32), *(hidden.new_empty(0) for _ in range(3)), lse)
    s = _scale(a, target, ignore_index, reduction)
    dh, dw, db = a.cat(dhs, 0) * s, dw * s, db * s
    summed = a.grown(hidden.shape[0])
    dbias = a.out(a.cast(db, "dbias", summed), bias.dtype) if bias is not None else hidden.new_empty(0)
    return (a.out(loss, torch.float32), a.out(a.cast(dh, "dhidden"), hidden.dtype),
            a.out(a.cast(dw, "dweight", summed), weight.dtype), dbias, lse)


def linear_cross_entropy_bwd(hidden, weight, target, bias, ignore_index, reduction, needs_grad,
                             loss, dhidden, dweight, dbias, lse, dloss):
    a = current().arith
    g = a.load(dloss, "dloss")
    summed = a.grown(hidden.shape[0])
    if needs_grad and reduction != "none":
        def scaled(t, name, fmt=None):
            return a.cast(a.load(t, name, fmt) * g, name, fmt)

        db = a.out(scaled(dbias, "dbias", summed), bias.dtype) if bias is not None else dbias.new_empty(0)
        return (a.out(scaled(dhidden, "dhidden"), hidden.dtype),
                a.out(scaled(dweight, "dweight", summed), weight.dtype), db)
    w = a.load(weight, "weight")
    b = a.load(bias, "bias") if bias is not None else None
    lse_v = a.load(lse, "lse", a.wide)
    g = g * _scale(a, target, ignore_index, reduction)
    kept = target != ignore_index
    dhs, dw, db = [], None, None
    for r in _chunks(hidden.shape[0], weight.shape[0]):
        h = a.load(hidden[r], "hidden")
        d = _dlogits(a, _logits(a, h, w, b), target[r], lse_v[r], 0.0)
        dz = a.cast(d * (g[r][:, None] if reduction == "none" else g), "dz", a.wide)
        dz = a.where(kept[r][:, None], dz, a.const(0.0))
        dhs.append(a.where(kept[r][:, None], dz @ w, a.const(0.0)))
        hk = a.where(kept[r][:, None], h, a.const(0.0))
        dw = dz.mT @ hk if dw is None else dw + dz.mT @ hk
        db = dz.sum(0) if db is None else db + dz.sum(0)
    dbias = a.out(a.cast(db, "dbias", summed), bias.dtype) if bias is not None else hidden.new_empty(0)
    return (a.out(a.cast(a.cat(dhs, 0), "dhidden"), hidden.dtype),
            a.out(a.cast(dw, "dweight", summed), weight.dtype), dbias)


# -- designs -------------------------------------------------------------------------------

SOFTMAX_SHARE = 0.9
"""The matrix products get 90% of the default MAC budget: the rest is the softmax row unit's
(its exp core alone is 7 DSPs, more than the 5% margin of a small device)."""

_CE_PASSES = [Pass("max", {"cmp": 2, "add": 1}, ("cmp",), reduce="cmp"),
              Pass("exp_sum", {"add": 2, "exp": 1}, ("add", "exp", "add"), reduce="add")]
_CE_ROW = ({"log": 1, "add": 3, "mul": 2}, ("log", "add", "mul", "add"))


def cross_entropy_design(call: Call, logits, target, ignore_index, label_smoothing, reduction, needs_grad):
    n, v = logits.shape
    passes = _CE_PASSES
    traffic = call.io_bytes(logits, target) + 4 * n
    if needs_grad:
        passes = passes + [Pass("dlogits", {"add": 3, "exp": 1, "mul": 1}, ("add", "exp", "add", "mul"))]
        traffic += call.io_bytes(logits)
    args = (logits, target, ignore_index, label_smoothing, reduction, needs_grad)
    return row_design(call, "cross_entropy", n, v, passes, *_CE_ROW, traffic,
                      flops("cross_entropy", args, 2.0 if needs_grad else 1.0))


def cross_entropy_bwd_design(call: Call, logits, target, ignore_index, label_smoothing, reduction, needs_grad,
                             loss, dlogits, *rest):
    n = dlogits.numel()
    scale = stream(call, "scale", n, call.lanes(2 * call.elem_bytes(dlogits)), {"mul": 1}, ("mul",))
    return Design("cross_entropy", scale, (), 2 * call.io_bytes(dlogits), float(n))


def _lce_design(call: Call, hidden, weight, target, bias, products, work: float) -> Design:
    n, k = hidden.shape
    v = weight.shape[0]
    share = SOFTMAX_SHARE / len(products)
    buffers: list[Buffer] = []
    stages, traffic = [], call.io_bytes(target, bias) + 4 * n
    for name, m_, n_, k_ in products:
        loop, bufs, nbytes, t = matmul(call, name, m_, n_, k_, share=share, in_bytes=call.elem_bytes(hidden))
        stages.append(loop)
        buffers += bufs
        traffic += nbytes
    lanes = max(1, math.ceil(t.tm * t.tn / max(k, 1)))
    stages.insert(1, stream(call, "softmax rows", n * v, lanes, {"cmp": 1, "add": 3, "exp": 1},
                            ("add", "exp", "add"), accumulate=True))
    top = region("linear_cross_entropy", stages, dataflow=call.directives.dataflow)
    return Design("linear_cross_entropy", top, tuple(buffers), int(traffic), work)


def linear_cross_entropy_design(call: Call, hidden, weight, target, bias, ignore_index, reduction,
                                needs_grad):
    n, k = hidden.shape
    v = weight.shape[0]
    products = [("logits", n, v, k)]
    if needs_grad and reduction != "none":
        products += [("dhidden", n, k, v), ("dweight", v, k, n)]
    args = (hidden, weight, target, bias, ignore_index, reduction, needs_grad)
    return _lce_design(call, hidden, weight, target, bias, products,
                       flops("linear_cross_entropy", args, len(products)))


def linear_cross_entropy_bwd_design(call: Call, hidden, weight, target, bias, ignore_index, reduction,
                                    needs_grad, *rest):
    n, k = hidden.shape
    v = weight.shape[0]
    args = (hidden, weight, target, bias, ignore_index, reduction, needs_grad)
    if needs_grad and reduction != "none":
        n_grads = hidden.numel() + weight.numel()
        scale = stream(call, "scale", n_grads, call.lanes(2 * call.elem_bytes(hidden)), {"mul": 1}, ("mul",))
        traffic = 2 * call.io_bytes(hidden, weight, bias)
        return Design("linear_cross_entropy", scale, (), traffic, float(n_grads))
    products = [("logits", n, v, k), ("dhidden", n, k, v), ("dweight", v, k, n)]
    return _lce_design(call, hidden, weight, target, bias, products, flops("linear_cross_entropy", args, 3.0))
