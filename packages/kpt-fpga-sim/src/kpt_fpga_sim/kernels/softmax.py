"""Softmax as an HLS design: ``softmax`` (any dimension, moved innermost by the load).

    for each row (DATAFLOW, ping-pong row buffer, U lanes):
        max:        for j step U  PIPELINE   row[j] = x[j]; m[lane] = max(m[lane], x[j])
        exp_sum:    for j step U  PIPELINE   e = exp(row[j] − m); row[j] = e; s[lane] += e
        normalize:  reciprocal unit r = 1/Σs, then for j step U  PIPELINE   y[j] = row[j] · r

The maximum is subtracted first, so every exp argument is ≤ 0 (the exp unit's domain).
Backward: dx = y · (dy − Σ dy · y), two passes over the row.
"""

from __future__ import annotations

import torch

from kpt.spec import rows

from ..sim import Call, Pass, current, flops, row_design


def softmax_fwd(x, dim):
    a = current().arith
    xt = x.movedim(dim, -1)
    if xt.shape[-1] == 0:
        return torch.empty(x.shape, dtype=x.dtype)
    xr = a.load(rows(xt), "x")
    e = a.exp(xr - xr.amax(-1)[:, None])
    y = a.cast(e * a.recip(e.sum(-1))[:, None], "y")
    return a.out(y, x.dtype).reshape(xt.shape).movedim(-1, dim).contiguous()


def softmax_bwd(x, dim, y, dy):
    a = current().arith
    yt = y.movedim(dim, -1)
    yr, dyr = a.load(rows(yt), "y"), a.load(rows(dy.movedim(dim, -1)), "dy")
    dot = (dyr * yr).sum(-1)
    dx = a.cast(yr * (dyr - dot[:, None]), "dx")
    return a.out(dx, x.dtype).reshape(yt.shape).movedim(-1, dim).contiguous()


def _shape(x, dim):
    d = x.shape[dim]
    return (x.numel() // d if d else 0), d


def softmax_design(call: Call, x, dim):
    n, d = _shape(x, dim)
    passes = [Pass("max", {"cmp": 1}, ("cmp",), reduce="cmp"),
              Pass("exp_sum", {"add": 2, "exp": 1}, ("add", "exp", "add"), reduce="add"),
              Pass("normalize", {"mul": 1}, ("mul",))]
    return row_design(call, "softmax", n, d, passes, {"recip": 1}, ("recip",), call.io_bytes(x, x),
                      flops("softmax", (x, dim)))


def softmax_bwd_design(call: Call, x, dim, *outputs_and_grads):
    n, d = _shape(x, dim)
    passes = [Pass("dot", {"mul": 1, "add": 1}, ("mul", "add"), reduce="add"),
              Pass("dx", {"mul": 1, "add": 1}, ("add", "mul"))]
    return row_design(call, "softmax", n, d, passes, {}, (), call.io_bytes(x, x, x),
                      flops("softmax", (x, dim), 2.0))
