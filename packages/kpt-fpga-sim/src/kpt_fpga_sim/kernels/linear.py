"""Linear layer as an HLS design: ``linear`` (activation fused in the epilogue).

    mac:       for each (tm × tn) output tile, k in 0..K   PIPELINE II=reuse (flattened)
                   acc[i][j] += x[i][k] · w[j][k]          the tm × tn MAC array, fully unrolled
    epilogue:  for each output, U lanes                    PIPELINE
                   pre = acc + bias;  y = act(pre)          act: relu (a comparison) or a table unit

DATAFLOW between the MAC array and the epilogue; x and w are staged on chip in ping-pong blocks
(`kpt_fpga_sim.sim.matmul`). By default the array fills 75% of the device's DSPs and keeps II = 1
(float accumulations split into fadd-latency partial sums).

Backward: dpre = dy ⊙ act'(pre), dx = dpre · w, dweight = dpreᵀ · x, dbias = Σ_rows dpre.
"""

from __future__ import annotations

import math

import torch

from kpt.spec import rows

from ..hls import Design, region
from ..sim import Call, current, flops, matmul, stream
from .activations import gelu_grad, gelu_value, silu_grad, silu_value


def _relu(a, v):
    return a.maximum(v, a.const(0.0))


ACTIVATIONS = {
    "relu": (_relu, None),
    "gelu": (lambda a, v: gelu_value(a, v, "none"), lambda a, v: gelu_grad(a, v, "none")),
    "gelu_tanh": (lambda a, v: gelu_value(a, v, "tanh"), lambda a, v: gelu_grad(a, v, "tanh")),
    "silu": (silu_value, silu_grad),
}
"""Each fused activation on a loaded value: (function, derivative); relu's derivative is a select."""


def linear_fwd(x, weight, bias, activation):
    a = current().arith
    pre = a.load(rows(x), "x") @ a.load(weight, "weight").mT
    if bias is not None:
        pre = pre + a.load(bias, "bias")
    shape = (*x.shape[:-1], weight.shape[0])
    if activation is None:
        return a.out(a.cast(pre, "y"), x.dtype).reshape(shape), x.new_empty(0)
    pre = a.cast(pre, "pre")
    y = a.cast(ACTIVATIONS[activation][0](a, pre), "y")
    return a.out(y, x.dtype).reshape(shape), a.out(pre, x.dtype).reshape(shape)


def linear_bwd(x, weight, bias, activation, y, pre, dy):
    a = current().arith
    dpre = a.load(rows(dy), "dy")
    if activation == "relu":
        p = a.load(rows(pre), "pre")
        passes = p > a.const(0.0)
        if isinstance(p, torch.Tensor):  # floating point: relu'(NaN) = 1 as in torch; fixed point has no NaN
            passes = passes | p.isnan()
        dpre = a.where(passes, dpre, a.const(0.0))
    elif activation is not None:
        dpre = a.cast(dpre * ACTIVATIONS[activation][1](a, a.load(rows(pre), "pre")), "dpre")
    dx = a.cast(dpre @ a.load(weight, "weight"), "dx")
    summed = a.grown(dpre.shape[0])
    dweight = a.cast(dpre.mT @ a.load(rows(x), "x"), "dweight", summed)
    dbias = a.out(a.cast(dpre.sum(0), "dbias", summed), bias.dtype) if bias is not None else x.new_empty(0)
    return a.out(dx, x.dtype).reshape(x.shape), a.out(dweight, weight.dtype), dbias


STREAMED_WEIGHTS = ("streamed weights: a GEMM engine (MAC array over K, weights staged on chip); "
                    "for weights fixed at synthesis see kpt_fpga_sim.estimate_model")

_EPILOGUE = {None: ({}, ()), "relu": ({"cmp": 1}, ("cmp",)),
             "gelu": ({"mul": 3, "erf": 1, "add": 1}, ("mul", "erf", "add", "mul", "mul")),
             "gelu_tanh": ({"mul": 6, "add": 2, "tanh": 1},
                           ("mul", "mul", "add", "mul", "tanh", "add", "mul")),
             "silu": ({"mul": 1, "sigmoid": 1}, ("sigmoid", "mul"))}


def linear_design(call: Call, x, weight, bias, activation):
    m = math.prod(x.shape[:-1])
    n, k = weight.shape
    mac, buffers, operand_bytes, t = matmul(call, "mac", m, n, k, in_bytes=call.elem_bytes(x))
    ops, chain = _EPILOGUE[activation]
    ops = {**ops, "add": ops.get("add", 0) + (bias is not None)}
    # the epilogue drains tm·tn outputs every K cycles: that many lanes keep up
    lanes = max(1, math.ceil(t.tm * t.tn / max(k, 1)))
    epilogue = stream(call, "epilogue", m * n, lanes, ops, ("add", *chain) if bias is not None else chain)
    outputs = m * n * (1 + (activation is not None))
    traffic = operand_bytes + call.io_bytes(bias) + call.elem_bytes(x) * outputs
    top = region("linear", [mac, epilogue], dataflow=call.directives.dataflow)
    return Design("linear", top, buffers, int(traffic), flops("linear", (x, weight, bias, activation)),
                  architecture=STREAMED_WEIGHTS)


def linear_bwd_design(call: Call, x, weight, bias, activation, *outputs_and_grads):
    m = math.prod(x.shape[:-1])
    n, k = weight.shape
    dx, dx_bufs, dx_bytes, t = matmul(call, "dx", m, k, n, share=0.5, in_bytes=call.elem_bytes(x))
    dw, dw_bufs, dw_bytes, _ = matmul(call, "dweight", n, k, m, share=0.5, in_bytes=call.elem_bytes(x))
    ops, chain = _EPILOGUE[activation]
    lanes = max(1, math.ceil(t.tm * t.tn / max(n, 1)))
    dpre = stream(call, "dpre", m * n, lanes, {**ops, "mul": ops.get("mul", 0) + 1, "add": 1},
                  (*chain, "mul"))
    traffic = dx_bytes + dw_bytes + call.io_bytes(x, weight, bias) + call.elem_bytes(x) * m * n * 2
    top = region("linear backward", [dpre, dx, dw], dataflow=call.directives.dataflow)
    return Design("linear", top, (*dx_bufs, *dw_bufs), int(traffic),
                  flops("linear", (x, weight, bias, activation), 2.0), architecture=STREAMED_WEIGHTS)
