"""RMS normalization as an HLS design: ``rms_norm`` and ``add_rms_norm``.

    rstd = rsqrt(Σ x² · (1/D) + eps),   y = x · rstd · weight

    for each row (DATAFLOW, ping-pong row buffer, U lanes = unroll, buffers partitioned U/2):
        sum_sq: for j in 0..D step U  PIPELINE II=reuse   row[j] = x[j]; acc[lane] += x[j]²
        rstd:   adder tree over the lanes, one multiply-add, the rsqrt unit
        scale:  for j in 0..D step U  PIPELINE II=reuse   y[j] = row[j] · rstd · weight[j]

add_rms_norm adds ``h = x + residual`` (rounded to the data format) in front of sum_sq.

Backward, x̂ = x · rstd, g = dy · weight, c = Σ g · x̂ · (1/D):
    dot:    for j: acc += g[j] · x̂[j]         (x̂ and g kept in the row buffer)
    dx:     for j: dx[j] = rstd · (g[j] − x̂[j] · c)          dweight[j] += dy[j] · x̂[j]
dweight accumulates over the rows in an on-chip D-buffer (one read-modify-write per element).
"""

from __future__ import annotations

import torch

from kpt.spec import rows

from ..hls import Buffer
from ..sim import Call, Pass, current, flops, row_design, zeros


def _normalize(a, h, weight, eps):
    d = h.shape[-1]
    sum_sq = (h * h).sum(-1)
    rstd = a.rsqrt(sum_sq * a.const(1.0 / max(d, 1)) + a.const(eps))
    y = h * rstd[:, None]
    if weight is not None:
        y = y * a.load(weight, "weight")
    return a.cast(y, "y"), rstd


def _normalize_backward(a, h, weight, rstd, dy):
    d = h.shape[-1]
    xhat = a.cast(h * rstd[:, None], "x̂", a.wide)
    g = a.cast(dy * a.load(weight, "weight"), "g", a.wide) if weight is not None else dy
    c = (g * xhat).sum(-1) * a.const(1.0 / max(d, 1))
    dx = (g - xhat * c[:, None]) * rstd[:, None]
    dweight = (a.out(a.cast((dy * xhat).sum(0), "dweight", a.grown(h.shape[0])), weight.dtype)
               if weight is not None else torch.empty(0))
    return dx, dweight


def rms_norm_fwd(x, weight, eps):
    a = current().arith
    y, rstd = _normalize(a, a.load(rows(x), "x"), weight, eps)
    return a.out(y, x.dtype).reshape(x.shape), a.out(rstd, torch.float32)


def rms_norm_bwd(x, weight, eps, y, rstd, dy):
    a = current().arith
    dx, dweight = _normalize_backward(a, a.load(rows(x), "x"), weight, a.load_scale(rstd),
                                      a.load(rows(dy), "dy"))
    return a.out(a.cast(dx, "dx"), x.dtype).reshape(x.shape), dweight


def add_rms_norm_fwd(x, residual, weight, eps):
    a = current().arith
    # h is stored in x's dtype (and data format), and normalized from there
    h = a.out(a.cast(a.load(rows(x), "x") + a.load(rows(residual), "residual"), "h"), x.dtype)
    y, rstd = _normalize(a, a.load(h, "h"), weight, eps)
    return a.out(y, x.dtype).reshape(x.shape), h.reshape(x.shape), a.out(rstd, torch.float32)


def add_rms_norm_bwd(x, residual, weight, eps, y, h, rstd, dy, dh):
    a = current().arith
    hr = a.load(rows(h), "h")
    dyr = a.load(rows(dy if dy is not None else zeros(h)), "dy")
    dx, dweight = _normalize_backward(a, hr, weight, a.load_scale(rstd), dyr)
    if dh is not None:
        dx = a.cast(dx, "dx") + a.load(rows(dh), "dh")
    return a.out(a.cast(dx, "dx"), x.dtype).reshape(x.shape), dweight


# -- designs -------------------------------------------------------------------------------


def _design(call: Call, kernel: str, x, weight, args, residual: bool = False):
    n, d = rows(x).shape
    passes = [Pass("sum_sq", {"mul": 1, "add": 1 + residual}, ("add",) * residual + ("mul", "add"),
                   reduce="add"),
              Pass("scale", {"mul": 1 + (weight is not None)}, ("mul", "mul"))]
    # x and y, plus residual and h for the fused form; the weight once; rstd per row
    traffic = call.io_bytes(*[x] * (4 if residual else 2), weight) + 4 * n
    weights = (Buffer("weight", call.data_bits, d, call.banks(call.lanes(traffic / max(n * d, 1)))),)
    return row_design(call, kernel, n, d, passes, {"mul": 1, "add": 1, "rsqrt": 1}, ("mul", "add", "rsqrt"),
                      traffic, flops(kernel, args), weights if weight is not None else ())


def _bwd_design(call: Call, kernel: str, x, weight, args):
    n, d = rows(x).shape
    passes = [Pass("dot", {"mul": 2 + (weight is not None), "add": 1}, ("mul", "mul", "add"), reduce="add"),
              Pass("dx", {"mul": 3, "add": 1 + (weight is not None)}, ("mul", "add", "mul"))]
    traffic = call.io_bytes(x, x, x, weight, weight) + 4 * n
    acc = (Buffer("dweight", 32, d, call.banks(call.lanes(traffic / max(n * d, 1)))),)
    return row_design(call, kernel, n, d, passes, {"mul": 1}, ("mul",), traffic, flops(kernel, args, 2.0),
                      acc if weight is not None else ())


def rms_norm_design(call: Call, x, weight, eps):
    return _design(call, "rms_norm", x, weight, (x, weight, eps))


def rms_norm_bwd_design(call: Call, x, weight, eps, *outputs_and_grads):
    return _bwd_design(call, "rms_norm", x, weight, (x, weight, eps))


def add_rms_norm_design(call: Call, x, residual, weight, eps):
    return _design(call, "add_rms_norm", x, weight, (x, residual, weight, eps), residual=True)


def add_rms_norm_bwd_design(call: Call, x, residual, weight, eps, *outputs_and_grads):
    return _bwd_design(call, "add_rms_norm", x, weight, (x, residual, weight, eps))
