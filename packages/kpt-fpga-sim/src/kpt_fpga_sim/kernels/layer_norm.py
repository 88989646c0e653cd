"""Layer normalization as an HLS design: ``layer_norm``.

    mean = Σ x · (1/D),   rstd = rsqrt(Σ (x − mean)² · (1/D) + eps),   y = (x − mean) · rstd · w + b

    for each row (DATAFLOW, ping-pong row buffer, U lanes):
        sum:     for j step U  PIPELINE   row[j] = x[j]; acc[lane] += x[j]
        mean:    adder tree, multiply by 1/D
        sum_sq:  for j step U  PIPELINE   acc[lane] += (row[j] − mean)²       (two passes: no
                                          E[x²] − E[x]² cancellation when |mean| ≫ std)
        rstd:    adder tree, multiply-add, rsqrt unit
        scale:   for j step U  PIPELINE   y[j] = (row[j] − mean) · rstd · w[j] + b[j]

Backward, x̂ = (x − mean) · rstd, g = dy · w:
    dx = rstd · (g − Σg/D − x̂ · Σ(g·x̂)/D),  dweight = Σ_rows dy · x̂,  dbias = Σ_rows dy
"""

from __future__ import annotations

import torch

from kpt.spec import rows

from ..hls import Buffer
from ..sim import Call, Pass, current, flops, row_design


def _inv(a, d):
    return a.const(1.0 / max(d, 1))


def layer_norm_fwd(x, weight, bias, eps):
    a = current().arith
    xr = a.load(rows(x), "x")
    d = xr.shape[-1]
    mean = a.cast(xr.sum(-1) * _inv(a, d), "mean", a.wide)
    xc = xr - mean[:, None]
    rstd = a.rsqrt((xc * xc).sum(-1) * _inv(a, d) + a.const(eps))
    y = xc * rstd[:, None]
    if weight is not None:
        y = y * a.load(weight, "weight")
    if bias is not None:
        y = a.cast(y, "y", a.wide) + a.load(bias, "bias")
    return (a.out(a.cast(y, "y"), x.dtype).reshape(x.shape), a.out(mean, torch.float32),
            a.out(rstd, torch.float32))


def layer_norm_bwd(x, weight, bias, eps, y, mean, rstd, dy):
    a = current().arith
    xr = a.load(rows(x), "x")
    d = xr.shape[-1]
    r = a.load_scale(rstd)[:, None]
    xhat = a.cast((xr - a.load(mean, "mean", a.wide)[:, None]) * r, "x̂", a.wide)
    dyr = a.load(rows(dy), "dy")
    g = a.cast(dyr * a.load(weight, "weight"), "g", a.wide) if weight is not None else dyr
    mean_g = g.sum(-1) * _inv(a, d)
    mean_gx = (g * xhat).sum(-1) * _inv(a, d)
    dx = a.cast((g - mean_g[:, None] - xhat * mean_gx[:, None]) * r, "dx")
    summed = a.grown(xr.shape[0])
    dweight = (a.out(a.cast((dyr * xhat).sum(0), "dweight", summed), weight.dtype) if weight is not None
               else x.new_empty(0))
    dbias = a.out(a.cast(dyr.sum(0), "dbias", summed), bias.dtype) if bias is not None else x.new_empty(0)
    return a.out(dx, x.dtype).reshape(x.shape), dweight, dbias


def layer_norm_design(call: Call, x, weight, bias, eps):
    n, d = rows(x).shape
    params = (weight is not None) + (bias is not None)
    passes = [Pass("sum", {"add": 1}, ("add",), reduce="add"),
              Pass("sum_sq", {"add": 2, "mul": 1}, ("add", "mul", "add"), reduce="add"),
              Pass("scale", {"add": 1 + (bias is not None), "mul": 1 + (weight is not None)},
                   ("add", "mul", "mul", "add"))]
    traffic = call.io_bytes(x, x, weight, bias) + 8 * n
    lanes = call.lanes(traffic / max(n * d, 1))
    buffers = tuple(Buffer(p, call.data_bits, d, call.banks(lanes)) for p in ("weight", "bias")[:params])
    return row_design(call, "layer_norm", n, d, passes, {"mul": 2, "add": 1, "rsqrt": 1},
                      ("mul", "mul", "add", "rsqrt"), traffic, flops("layer_norm", (x, weight, bias, eps)),
                      buffers)


def layer_norm_bwd_design(call: Call, x, weight, bias, eps, *outputs_and_grads):
    n, d = rows(x).shape
    passes = [Pass("dots", {"mul": 3, "add": 3}, ("add", "mul", "mul", "add"), reduce="add"),
              Pass("dx", {"mul": 3, "add": 4}, ("add", "mul", "add", "mul"))]
    traffic = call.io_bytes(x, x, x, weight, weight, bias) + 8 * n
    lanes = call.lanes(traffic / max(n * d, 1))
    acc = tuple(Buffer(f"d{p}", 32, d, call.banks(lanes)) for p, t in (("weight", weight), ("bias", bias))
                if t is not None)
    return row_design(call, "layer_norm", n, d, passes, {"mul": 2}, ("mul",), traffic,
                      flops("layer_norm", (x, weight, bias, eps), 2.0), acc)
