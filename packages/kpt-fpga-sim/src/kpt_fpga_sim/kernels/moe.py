"""Mixture of experts as HLS designs: ``moe_gating``, ``moe_dispatch``, ``grouped_linear``,
``moe_combine``.

    gating:    per token (DATAFLOW over tokens): max; exp and sum; a k-deep insertion network
               (k compare-and-swap cells per logit, larger logit wins, the earlier expert on a
               tie) keeps the top k; the reciprocal unit normalizes (float32, in every mode)
    dispatch:  a counting sort: histogram of the expert ids, prefix sum (offsets), then each
               (token, slot) pair is written to its expert's next row: a stable scatter of rows
    grouped:   the MAC array of `kpt_fpga_sim.kernels.linear` run once per expert over its rows
               (the design assumes evenly routed rows: routing is data, the hardware is fixed)
    combine:   per token: y = Σ_slot w[slot] · y_sorted[row(slot)], k multiply-adds per element
"""

from __future__ import annotations

import math

import torch

from ..hls import Buffer, Design, Loop, region
from ..sim import Call, Pass, current, flops, matmul, row_design, stream, zeros


def moe_gating_fwd(logits, k, renormalize):
    a = current().arith
    lg = a.load(logits, "logits")
    idx = torch.sort(lg, dim=-1, descending=True, stable=True).indices[:, :k]
    e = a.exp(lg - lg.amax(-1, keepdim=True))
    top = (e * a.recip(e.sum(-1, keepdim=True))).gather(1, idx)
    weights = top * a.recip(top.sum(-1, keepdim=True)) if renormalize else top
    return a.out(weights, torch.float32), idx.to(torch.int32).contiguous()


def moe_gating_bwd(logits, k, renormalize, weights, indices, dweights, dindices):
    a = current().arith
    if dweights is None:
        return zeros(logits)
    idx = indices.long()
    dw = a.load(dweights, "dweights")
    if renormalize:
        # w·(dw·Σw − Σ dw·w): Σw is 1 up to rounding, and with one slot the difference is exactly 0
        dsel = weights * (dw * weights.sum(-1, keepdim=True) - (dw * weights).sum(-1, keepdim=True))
        dlogits = torch.zeros(logits.shape).scatter_add(1, idx, dsel)
    else:
        lg = a.load(logits, "logits")
        e = a.exp(lg - lg.amax(-1, keepdim=True))
        p = e * a.recip(e.sum(-1, keepdim=True))
        dp = torch.zeros(p.shape).scatter_add(1, idx, dw)
        dlogits = p * (dp - (dp * p).sum(-1, keepdim=True))
    return a.out(dlogits, logits.dtype)


def _token_of_pair(tokens, k):
    return torch.arange(tokens)[:, None].expand(tokens, k).reshape(-1)


def moe_dispatch_fwd(x, indices, num_experts):
    experts = indices.reshape(-1).long()
    counts = torch.bincount(experts, minlength=num_experts)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    order = torch.sort(experts, stable=True).indices
    token = _token_of_pair(*indices.shape)[order]
    return x.index_select(0, token), offsets.to(torch.int32), order.to(torch.int32)


def moe_dispatch_bwd(x, indices, num_experts, x_sorted, offsets, order, dx_sorted, doffsets, dorder):
    a = current().arith
    tokens, k = indices.shape
    if dx_sorted is None:
        return zeros(x)
    per_pair = a.load(dx_sorted, "dx_sorted")[torch.argsort(order.long())]
    return a.out(per_pair.reshape(tokens, k, x.shape[1]).sum(1), x.dtype)


def _blocks(offsets):
    bounds = offsets.tolist()
    return [slice(bounds[e], bounds[e + 1]) for e in range(len(bounds) - 1)]


def _rows_of_experts(a, parts, offsets, rows, width, like, name):
    """The experts' row blocks with zero rows before the first and after the last (rows of no
    expert); the backend checks that offsets are non-decreasing within ``[0, rows]``."""
    first, last = int(offsets[0]), int(offsets[-1])
    head = a.load(like.new_zeros(first, width), name)
    tail = a.load(like.new_zeros(rows - last, width), name)
    return a.cat([head, *parts, tail], 0)


def grouped_linear_fwd(x_sorted, offsets, weight):
    a = current().arith
    x, w = a.load(x_sorted, "x_sorted"), a.load(weight, "weight")
    parts = [x[r] @ w[e].mT for e, r in enumerate(_blocks(offsets))]
    y = _rows_of_experts(a, parts, offsets, x_sorted.shape[0], weight.shape[1], x_sorted, "y")
    return a.out(a.cast(y, "y"), x_sorted.dtype)


def grouped_linear_bwd(x_sorted, offsets, weight, y, dy):
    a = current().arith
    if dy is None:
        return zeros(x_sorted), zeros(weight)
    x, w, g = a.load(x_sorted, "x_sorted"), a.load(weight, "weight"), a.load(dy, "dy")
    blocks = _blocks(offsets)
    dx = [g[r] @ w[e] for e, r in enumerate(blocks)]
    dw = [(g[r].mT @ x[r]).unsqueeze(0) for r in blocks]
    dx = _rows_of_experts(a, dx, offsets, x_sorted.shape[0], x_sorted.shape[1], x_sorted, "dx")
    dw = a.cat(dw, 0) if dw else a.load(zeros(weight), "dweight")
    return (a.out(a.cast(dx, "dx_sorted"), x_sorted.dtype),
            a.out(a.cast(dw, "dweight", a.grown(x_sorted.shape[0])), weight.dtype))


def _pair_rows(order):
    """``[T·k]``: the sorted row of each (token, slot) pair."""
    return torch.argsort(order.long())


def moe_combine_fwd(y_sorted, order, weights):
    a = current().arith
    tokens, k = weights.shape
    pairs = a.load(y_sorted, "y_sorted")[_pair_rows(order)].reshape(tokens, k, y_sorted.shape[1])
    y = (pairs * a.load(weights, "weights")[:, :, None]).sum(1)
    return a.out(a.cast(y, "y"), y_sorted.dtype)


def moe_combine_bwd(y_sorted, order, weights, y, dy):
    a = current().arith
    if dy is None:
        return zeros(y_sorted), zeros(weights)
    tokens, k = weights.shape
    hidden = y_sorted.shape[1]
    g = a.load(dy, "dy")[:, None, :]
    pairs = a.load(y_sorted, "y_sorted")[_pair_rows(order)].reshape(tokens, k, hidden)
    dweights = a.cast((pairs * g).sum(-1), "dweights", a.grown(hidden))
    dpairs = (g * a.load(weights, "weights")[:, :, None]).reshape(tokens * k, hidden)
    dy_sorted = a.cast(dpairs.index_select(0, order.long()), "dy_sorted")
    return a.out(dy_sorted, y_sorted.dtype), a.out(dweights, weights.dtype)


# -- designs -------------------------------------------------------------------------------


def moe_gating_design(call: Call, logits, k, renormalize):
    t, e = logits.shape
    passes = [Pass("max", {"cmp": 1}, ("cmp",), reduce="cmp"),
              Pass("exp_sum_topk", {"add": 2, "exp": 1, "cmp": k}, ("add", "exp", "add"), reduce="add")]
    return row_design(call, "moe_gating", t, e, passes, {"recip": 1 + renormalize, "mul": 2 * k, "add": k},
                      ("recip", "mul", "add", "recip", "mul"), call.io_bytes(logits) + 8 * t * k,
                      flops("moe_gating", (logits, k, renormalize)))


def moe_gating_bwd_design(call: Call, logits, k, renormalize, *rest):
    t, e = logits.shape
    passes = [Pass("dlogits", {"mul": 2, "add": 2}, ("mul", "add", "mul"), reduce="add")]
    return row_design(call, "moe_gating", t, e, passes, {}, (), call.io_bytes(logits, logits) + 8 * t * k,
                      flops("moe_gating", (logits, k, renormalize), 2.0))


def _copy_rows(call: Call, kernel: str, x, pairs: int, work: float, adds: int) -> Design:
    hidden = x.shape[1]
    traffic = call.io_bytes(x) + call.elem_bytes(x) * pairs * hidden + 12 * pairs
    histogram = Loop("histogram", pairs, {"add": 1}, ("add",))
    lanes = call.lanes(2 * call.elem_bytes(x))
    copy = stream(call, "scatter rows", pairs * hidden, lanes, {"add": adds}, ("add",))
    return Design(kernel, region(kernel, [histogram, copy], dataflow=False), (), int(traffic), work)


def moe_dispatch_design(call: Call, x, indices, num_experts):
    return _copy_rows(call, "moe_dispatch", x, indices.numel(), 0.0, 0)


def moe_dispatch_bwd_design(call: Call, x, indices, num_experts, *rest):
    return _copy_rows(call, "moe_dispatch", x, indices.numel(), float(indices.numel() * x.shape[1]), 1)


def _grouped(call: Call, x_sorted, weight, work: float, products) -> Design:
    experts = weight.shape[0]
    buffers: list[Buffer] = []
    stages, traffic = [], 0
    for name, m, n, k in products:
        loop, bufs, nbytes, _ = matmul(call, name, m, n, k, batch=experts, share=1.0 / len(products),
                                       in_bytes=call.elem_bytes(x_sorted))
        stages.append(loop)
        buffers += bufs
        traffic += nbytes
    traffic += call.io_bytes(x_sorted) * len(products)
    top = region("grouped_linear", stages, dataflow=call.directives.dataflow)
    return Design("grouped_linear", top, tuple(buffers), int(traffic), work)


def grouped_linear_design(call: Call, x_sorted, offsets, weight):
    e, n, k = weight.shape
    m = math.ceil(x_sorted.shape[0] / max(e, 1))
    return _grouped(call, x_sorted, weight, flops("grouped_linear", (x_sorted, offsets, weight)),
                    [("mac", m, n, k)])


def grouped_linear_bwd_design(call: Call, x_sorted, offsets, weight, *rest):
    e, n, k = weight.shape
    m = math.ceil(x_sorted.shape[0] / max(e, 1))
    return _grouped(call, x_sorted, weight, flops("grouped_linear", (x_sorted, offsets, weight), 2.0),
                    [("dx", m, k, n), ("dweight", n, k, m)])


def moe_combine_design(call: Call, y_sorted, order, weights):
    tokens, k = weights.shape
    n = tokens * y_sorted.shape[1]
    traffic = call.io_bytes(y_sorted, order, weights) + call.elem_bytes(y_sorted) * n
    lanes = call.lanes(traffic / max(n, 1))
    loop = stream(call, "combine", n, lanes, {"mul": k, "add": k}, ("mul",) + ("add",) * k)
    return Design("moe_combine", loop, (), traffic, flops("moe_combine", (y_sorted, order, weights)))


def moe_combine_bwd_design(call: Call, y_sorted, order, weights, *rest):
    tokens, k = weights.shape
    n = y_sorted.numel()
    traffic = 2 * call.io_bytes(y_sorted, weights) + call.io_bytes(order) + call.elem_bytes(y_sorted) * tokens
    loop = stream(call, "combine backward", n, call.lanes(traffic / max(n, 1)), {"mul": 2, "add": 1},
                  ("mul", "add"), accumulate=True)
    return Design("moe_combine", loop, (), traffic, flops("moe_combine", (y_sorted, order, weights), 2.0))
