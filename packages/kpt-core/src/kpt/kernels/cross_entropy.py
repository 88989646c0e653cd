"""Cross-entropy loss, and the same loss fused with the linear layer that produces its logits.

For one row of logits z ∈ ℝ^V with target t (rows with t = ignore_index contribute nothing):

    lse  = log Σ_c exp(z_c)
    loss = (1 − ε) · (lse − z_t) + ε · (lse − mean(z))          (ε = label_smoothing)

reduced over the rows by "none", "sum" or "mean" (mean over the rows not ignored; 0 when every
row is ignored). With g_r the gradient that reaches row r (g·[r kept]/n_kept for mean, g·[r kept]
for sum, g_r·[r kept] for none):

    dz = g_r · (softmax(z) − (1 − ε) · onehot(t) − ε / V)

When a gradient will be needed, the forward computes dz for an upstream gradient of 1 while it
reads the logits (one pass over them instead of two more in the backward) and saves it in place of
the logits; the backward only scales it by the upstream gradient.

``linear_cross_entropy`` applies this to z = hidden · weightᵀ + bias chunk of rows by chunk of rows,
so that the ``[N, V]`` logits are never held. With Z the logits of a chunk H of hidden rows:

    dhidden = dZ · weight,   dweight = Σ_chunks dZᵀ · H,   dbias = Σ_chunks Σ_rows dZ

For reduction "mean"/"sum" the forward computes these for an upstream gradient of 1 while it has
each chunk's logits (three matrix products in all, like logits + backward of the unfused layers),
and the backward only scales them. For "none" the forward keeps lse and the backward recomputes
each chunk's logits.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch import Tensor

from ..spec import (
    PARTIAL,
    Args,
    BadIndices,
    BadInput,
    Case,
    Check,
    KernelSpec,
    Placement,
    Strategy,
    compute_dtype,
    finite,
    identity,
    randn,
    row_cases,
    strided,
    transposed,
)
from .linear import rounding_sums, summed

REDUCTIONS = ("mean", "sum", "none")

CHUNK_ELEMENTS = 1 << 24
"""How many logits `linear_cross_entropy`'s reference holds at once (rows per chunk = this // V)."""


def cross_entropy(
    logits: Tensor, target: Tensor, ignore_index: int = -100, label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> Tensor:
    """Cross-entropy of ``[N, V]`` logits against int64 class targets, like ``F.cross_entropy``.

    ``loss_r = (1 − ε)(lse_r − logits[r, t_r]) + ε (lse_r − mean_c logits[r, c])``, ε =
    ``label_smoothing`` in [0, 1], computed in float32 (float64 for float64). Rows whose target is
    ``ignore_index`` give 0 and are not counted; ``reduction`` is ``"mean"`` (over counted rows; 0,
    never NaN, when every row is ignored), ``"sum"`` or ``"none"``. A target outside ``[0, V)`` that
    is not ``ignore_index`` raises in checked mode (`kpt.checking_indices`); unchecked, its row's loss
    is NaN (so a reduced loss is NaN) and its gradient lacks the target's term.
    ``logits``: ``[N, V]`` float; ``target``: ``[N]`` int64. Returns a scalar (``[N]`` for "none") in
    float32 (float64 for float64) whatever the logits' dtype, as ``F.cross_entropy(logits.float())``.
    Differentiable with respect to ``logits``: the gradient is computed during the forward pass (it
    takes the memory of the logits until the backward).
    """
    raise AssertionError("signature only: call backend.cross_entropy")


def linear_cross_entropy(
    hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None, ignore_index: int = -100,
    reduction: str = "mean",
) -> Tensor:
    """``cross_entropy(hidden @ weight.T + bias, target, ignore_index, reduction=reduction)``, fused.

    Never holds the full ``[N, V]`` logits: works through chunks of rows, and for "mean"/"sum"
    computes the gradients during the forward pass (the backward only scales them).
    ``hidden``: ``[N, K]`` float; ``weight``: ``[V, K]``, hidden's dtype; ``bias``: ``[V]``, hidden's
    dtype or float32, or None; ``target``: ``[N]`` int64, out-of-range values as in
    `cross_entropy`. The logits ``hidden @ weight.T`` may be rounded to hidden's dtype, as
    ``linear`` returns them (the reference keeps them in float32); the loss is computed in float32
    (float64 for float64). Returns a scalar (``[N]``
    for "none") in float32 (float64 for float64) whatever hidden's dtype. Differentiable with
    respect to ``hidden``, ``weight`` and ``bias``.
    """
    raise AssertionError("signature only: call backend.linear_cross_entropy")


def _check_targets(c: Check, a: Args, n: int, like: Tensor) -> None:
    c.tensor("target", a["target"], ndim=1, dtypes=(torch.int64,))
    c.shape("target", a["target"], (n,))
    c.same_device("target", a["target"], like)
    c.number("ignore_index", a["ignore_index"], integer=True)
    c.choice("reduction", a["reduction"], REDUCTIONS)


def validate_cross_entropy(a: Args, dtypes: tuple[torch.dtype, ...]) -> Args:
    c = Check("cross_entropy", dtypes)
    logits = c.tensor("logits", a["logits"], ndim=2)
    _check_targets(c, a, logits.shape[0], logits)
    a["label_smoothing"] = float(c.number("label_smoothing", a["label_smoothing"], low=0.0, high=1.0))
    return a


def _check_target_indices(kernel: str, a: Args, classes: int) -> None:
    Check(kernel, ()).values_in("target", a["target"], 0, classes, "the classes", allowed=a["ignore_index"])


def check_cross_entropy_indices(a: Args) -> None:
    _check_target_indices("cross_entropy", a, a["logits"].shape[1])


def check_linear_cross_entropy_indices(a: Args) -> None:
    _check_target_indices("linear_cross_entropy", a, a["weight"].shape[0])


def validate_linear_cross_entropy(a: Args, dtypes: tuple[torch.dtype, ...]) -> Args:
    c = Check("linear_cross_entropy", dtypes)
    hidden = c.tensor("hidden", a["hidden"], ndim=2)
    weight = c.tensor("weight", a["weight"], ndim=2)
    c.same_dtype("weight", weight, hidden, "hidden")
    c.same_device("weight", weight, hidden)
    if weight.shape[1] != hidden.shape[1]:
        raise c.fail("weight", f"has shape {tuple(weight.shape)}; expected [V, {hidden.shape[1]}] "
                               f"to match hidden {tuple(hidden.shape)}")
    c.param("bias", a["bias"], hidden, (weight.shape[0],))
    _check_targets(c, a, hidden.shape[0], hidden)
    return a


def _row_losses(z: Tensor, target: Tensor, ignore_index: int, label_smoothing: float, lse: Tensor) -> Tensor:
    """Per-row losses of compute-dtype logits ``z`` ``[n, V]`` with row log-sum-exp ``lse`` (0 if
    ignored, NaN for a target out of range)."""
    kept = target != ignore_index
    in_range = (target >= 0) & (target < z.shape[1])
    # an ignored target may be any integer: read class 0 in its place (nothing at all without classes)
    safe = torch.where(kept & in_range, target, 0)[:, None]
    loss = lse - (z.gather(1, safe)[:, 0] if z.shape[1] else torch.zeros_like(lse))
    if label_smoothing:
        loss = (1 - label_smoothing) * loss + label_smoothing * (lse - z.mean(-1))
    return torch.where(kept, torch.where(in_range, loss, math.nan), 0)


def _one_hot(target: Tensor, classes: int) -> Tensor:
    return torch.arange(classes, device=target.device) == target[:, None]


def dlogits(z: Tensor, target: Tensor, lse: Tensor, label_smoothing: float, row_grad: Tensor,
             kept: Tensor) -> Tensor:
    """``row_grad[:, None] · (softmax(z) − (1 − ε) onehot − ε / V)`` on the ``kept`` rows, 0 on the
    ignored ones (selected: an inf or NaN logit of an ignored row reaches nothing)."""
    d = torch.exp(z - lse[:, None]) - (1 - label_smoothing) * _one_hot(target, z.shape[1]).to(z.dtype)
    if label_smoothing:
        # max: with no classes d is empty anyway
        d = d - label_smoothing / max(z.shape[1], 1)
    return torch.where(kept[:, None], d * row_grad[:, None], 0.0)


def _kept(target: Tensor, ignore_index: int) -> Tensor:
    """How many rows count towards the mean, at least 1 so that all-ignored gives 0, not NaN."""
    return (target != ignore_index).sum().clamp(min=1)


def _reduce(losses: Tensor, target: Tensor, ignore_index: int, reduction: str) -> Tensor:
    if reduction == "none":
        return losses
    total = losses.sum()
    return total if reduction == "sum" else total / _kept(target, ignore_index)


def row_grads(dloss: Tensor, target: Tensor, ignore_index: int, reduction: str, ct: torch.dtype) -> Tensor:
    """The gradient reaching each row's loss: ``[N]`` in ``ct``, 0 on ignored rows."""
    g = dloss.to(ct)
    if reduction == "mean":
        g = g / _kept(target, ignore_index)
    return torch.where(target != ignore_index, g, 0)


def _unit_grads(target: Tensor, ignore_index: int, reduction: str, ct: torch.dtype) -> Tensor:
    """The gradient reaching each row's loss for an upstream gradient of 1 (one per row for "none")."""
    one = torch.ones(target.shape if reduction == "none" else (), dtype=ct, device=target.device)
    return row_grads(one, target, ignore_index, reduction, ct)


def cross_entropy_fwd(
    logits: Tensor, target: Tensor, ignore_index: int, label_smoothing: float, reduction: str, needs_grad: bool
) -> tuple[Tensor, Tensor]:
    """Returns ``(loss, dlogits)``: with ``needs_grad``, ``dlogits`` is the gradient for an upstream
    gradient of 1 (1 per row for "none"), contiguous, in logits' dtype; otherwise it is empty."""
    # contiguous: elementwise math would keep a transposed input's layout, and outputs must not
    z = logits.to(compute_dtype(logits.dtype)).contiguous()
    lse = torch.logsumexp(z, -1)
    losses = _row_losses(z, target, ignore_index, label_smoothing, lse)
    loss = _reduce(losses, target, ignore_index, reduction)
    if not needs_grad:
        return loss, logits.new_empty(0)
    row_grad = _unit_grads(target, ignore_index, reduction, z.dtype)
    return loss, dlogits(z, target, lse, label_smoothing, row_grad, target != ignore_index).to(logits.dtype)


def cross_entropy_bwd(
    logits: Optional[Tensor], target: Tensor, ignore_index: int, label_smoothing: float, reduction: str,
    needs_grad: bool, loss: Tensor, dlogits: Tensor, dloss: Optional[Tensor],
) -> tuple[Tensor]:
    """Returns ``(dlogits · dloss,)`` (per row for "none"); ``logits`` is not read (None)."""
    if dloss is None:
        return (torch.zeros_like(dlogits),)
    g = dloss.to(compute_dtype(dlogits.dtype))
    return ((dlogits.to(g.dtype) * (g[:, None] if reduction == "none" else g)).to(dlogits.dtype),)


def _chunked(
    hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, ignore_index: int,
    row_grad: Optional[Tensor], lse: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Optional[tuple[Tensor, Tensor, Tensor]]]:
    """One pass over chunks of rows of ``z = hidden · weightᵀ + bias``, each chunk's logits computed once.

    Returns the per-row losses, the row lse (``lse`` itself when given) and, when ``row_grad`` (the
    gradient reaching each row's loss) is given, ``(dhidden, dweight, dbias)`` (``dbias`` empty without
    bias); all in the compute dtype.
    """
    ct = compute_dtype(hidden.dtype)
    w = weight.to(ct)
    b = bias.to(ct) if bias is not None else None
    step = max(1, CHUNK_ELEMENTS // max(weight.shape[0], 1))
    losses, lses, dhs = [], [], []
    if row_grad is not None:
        dw, db = w.new_zeros(w.shape), w.new_zeros(w.shape[0] if b is not None else 0)
    # max(n, 1): with no rows, one empty chunk still gives every result its shape
    for start in range(0, max(hidden.shape[0], 1), step):
        r = slice(start, start + step)
        h = hidden[r].to(ct)
        z = h @ w.T if b is None else torch.addmm(b, h, w.T)
        lse_r = torch.logsumexp(z, -1) if lse is None else lse[r]
        losses.append(_row_losses(z, target[r], ignore_index, 0.0, lse_r))
        lses.append(lse_r)
        if row_grad is not None:
            # an ignored row adds nothing, also where its hidden state or a weight holds inf or NaN
            kept = (target[r] != ignore_index)[:, None]
            dz = dlogits(z, target[r], lse_r, 0.0, row_grad[r], kept[:, 0])
            dhs.append(torch.where(kept, dz @ w, 0.0))
            dw = dw + dz.T @ torch.where(kept, h, 0.0)
            if b is not None:
                db = db + dz.sum(0)
    grads = (torch.cat(dhs), dw, db) if row_grad is not None else None
    return torch.cat(losses), torch.cat(lses), grads


def _grads_out(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], dh: Tensor, dw: Tensor, db: Tensor
               ) -> tuple[Tensor, Tensor, Tensor]:
    """Rounded to the dtypes of hidden, weight and bias (empty ``dbias`` without bias)."""
    dbias = db.to(bias.dtype) if bias is not None else db.new_empty(0)
    return dh.to(hidden.dtype), dw.to(weight.dtype), dbias


def linear_cross_entropy_fwd(
    hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor], ignore_index: int, reduction: str,
    needs_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns ``(loss, dhidden, dweight, dbias, lse)``.

    ``dhidden``/``dweight``/``dbias`` (in the dtypes of hidden/weight/bias) are the gradients for an
    upstream gradient of 1 when ``reduction`` is "mean" or "sum" and ``needs_grad``; otherwise (and
    ``dbias`` without bias) they are empty. ``lse``: ``[N]`` in float32 (float64 for float64 input).
    """
    ct = compute_dtype(hidden.dtype)
    fused = needs_grad and reduction != "none"
    row_grad = _unit_grads(target, ignore_index, reduction, ct) if fused else None
    losses, lse, grads = _chunked(hidden, weight, bias, target, ignore_index, row_grad)
    loss = _reduce(losses, target, ignore_index, reduction)
    empty = (hidden.new_empty(0), hidden.new_empty(0), hidden.new_empty(0))
    return (loss, *(_grads_out(hidden, weight, bias, *grads) if grads is not None else empty), lse)


def linear_cross_entropy_bwd(
    hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor], ignore_index: int, reduction: str,
    needs_grad: bool, loss: Tensor, dhidden: Tensor, dweight: Tensor, dbias: Tensor, lse: Tensor,
    dloss: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns ``(dhidden, dweight, dbias)``; ``dbias`` is empty when ``bias`` is None.

    Scales the forward's gradients when it made them, else recomputes the logits chunk by chunk.
    """
    ct = lse.dtype
    if dloss is None:
        dloss = torch.zeros_like(loss)
    if needs_grad and reduction != "none":
        g = dloss.to(ct)
        return _grads_out(hidden, weight, bias, dhidden.to(ct) * g, dweight.to(ct) * g, dbias.to(ct) * g)
    row_grad = row_grads(dloss, target, ignore_index, reduction, ct)
    _, _, grads = _chunked(hidden, weight, bias, target, ignore_index, row_grad, lse)
    assert grads is not None  # _chunked computes them whenever it is given a row gradient
    return _grads_out(hidden, weight, bias, *grads)


def _cross_entropy_flops(a: Args) -> float:
    # per logit: subtract the maximum, exponentiate, accumulate
    return 3.0 * a["logits"].numel()


def _linear_cross_entropy_flops(a: Args) -> float:
    (n, k), v = a["hidden"].shape, a["weight"].shape[0]
    # the logits' matrix product; the fused gradients add two more of the same size
    return 2.0 * n * k * v


def _targets(g: torch.Generator, n: int, classes: int, ignored: float, ignore_index: int) -> Tensor:
    target = torch.randint(0, max(classes, 1), (n,), generator=g)
    drop = torch.rand(n, generator=g) < (ignored if classes else 1.0)
    return target.masked_fill(drop, ignore_index)


def _make_ce(g: torch.Generator, dtype: torch.dtype, *, shape: tuple[int, ...], scale: float = 1.0,
             layout=identity, reduction: str = "mean", ignored: float = 0.1, label_smoothing: float = 0.0,
             ignore_index: int = -100, masked: int = 0) -> Args:
    """``masked``: the first classes of every row have logit −inf (a masked head of the vocabulary),
    and no target is among them."""
    logits = randn(g, math.prod(shape[:-1]), shape[-1], dtype=dtype, scale=scale)
    logits[:, :masked] = -float("inf")
    target = _targets(g, logits.shape[0], logits.shape[1] - masked, ignored, ignore_index)
    target = torch.where(target == ignore_index, target, target + masked)
    return {"logits": layout(logits), "target": target,
            "ignore_index": ignore_index, "label_smoothing": label_smoothing, "reduction": reduction}


def _cross_entropy_cases() -> list[Case]:
    def case(name: str, **kw: Any) -> Case:
        return Case(name, lambda g, dtype: _make_ce(g, dtype, **kw))

    # logits of 1e3: one-hot softmax rows whose gradients cancel to float32's last bits; the float32
    # reference itself misses the default tolerance on about one seed in ten
    return row_cases(_make_ce, (8192, 128256), extreme_tolerance_scale=4.0) + [
        case("vocab_32000", shape=(32, 32000)),
        case("sum", shape=(17, 1000), reduction="sum"),
        case("none", shape=(17, 1000), reduction="none"),
        case("label_smoothing", shape=(17, 1000), label_smoothing=0.1),
        case("label_smoothing_none", shape=(3, 4097), label_smoothing=0.2, reduction="none"),
        # smoothing near and at 1: the target's weight 1 − ε vanishes and the uniform term
        # dominates, so an ε applied to the wrong term (or as 1 − ε) is wrong in loss and gradient
        case("label_smoothing_near_1", shape=(17, 1000), label_smoothing=0.95),
        case("label_smoothing_1", shape=(8, 100), label_smoothing=1.0, reduction="none"),
        # ignore_index may be a real class id (a padding token)
        case("ignore_class_0", shape=(64, 7), ignore_index=0, ignored=0.0),
        case("all_ignored", shape=(8, 100), ignored=1.0),
        case("all_ignored_none", shape=(8, 100), ignored=1.0, reduction="none"),
        case("zero_rows_sum", shape=(0, 512), reduction="sum"),
        case("transposed", shape=(65, 300), layout=transposed),
        # rows longer than a kernel holds at once, whose first 33000 logits are −inf (one row: cut
        # across programs): whole leading chunks add nothing to the log-sum-exp (not exp(−inf + inf))
        case("masked_head", shape=(3, 40000), masked=33000),
        case("masked_head_one_row", shape=(1, 40000), masked=33000, ignored=0.0),
        # an LM head's logits: more rows than GPUs have multiprocessors, each GPT-2's 50257 wide
        # (not a whole number of 16-byte vectors): where a kernel holds long rows on chip, it holds
        # these, heads and tails included. 16M logits: real devices only
        Case("gpt2_vocabulary", lambda g, dtype: _make_ce(g, dtype, shape=(320, 50257)), large=True),
    ]


def _make_lce(g: torch.Generator, dtype: torch.dtype, *, n: int, k: int, v: int, reduction: str = "mean",
              ignored: float = 0.1, bias: bool | torch.dtype = False, scale: float = 1.0,
              w_scale: float = 1.0, layout=identity) -> Args:
    """``bias``: True for a bias in hidden's dtype, or the bias dtype."""
    # weight ~ N(0, w_scale² / K): logits of the order of scale · w_scale
    return {"hidden": layout(randn(g, n, k, dtype=dtype, scale=scale)),
            "weight": layout(randn(g, v, k, dtype=dtype, scale=w_scale * max(k, 1) ** -0.5)),
            "target": _targets(g, n, v, ignored, -100),
            "bias": randn(g, v, dtype=dtype if bias is True else bias) if bias else None,
            "ignore_index": -100, "reduction": reduction}


def _linear_cross_entropy_cases() -> list[Case]:
    def case(name: str, dtypes: tuple[torch.dtype, ...] | None = None, **kw: Any) -> Case:
        return Case(name, lambda g, dtype: _make_lce(g, dtype, **kw), dtypes=dtypes)

    return [
        case("llm", n=64, k=256, v=1000),
        case("single", n=1, k=1, v=1),
        case("odd", n=17, k=3, v=33, reduction="sum"),
        case("none", n=17, k=64, v=1000, reduction="none"),
        case("long_vocab", n=4, k=64, v=4097),
        case("bias", n=33, k=64, v=300, bias=True),
        case("bias_none", n=33, k=64, v=300, bias=True, reduction="none"),
        # mixed precision training: float32 bias with 16-bit activations
        case("fp32_bias", n=33, k=64, v=300, bias=torch.float32, reduction="sum",
             dtypes=(torch.float16, torch.bfloat16)),
        case("strided", n=33, k=64, v=257, layout=strided),
        case("transposed", n=33, k=64, v=257, layout=transposed),
        case("zero_rows", n=0, k=64, v=100),
        case("zero_hidden", n=4, k=0, v=100, reduction="sum"),
        case("all_ignored", n=8, k=64, v=100, ignored=1.0),
        case("all_ignored_none", n=8, k=64, v=100, ignored=1.0, reduction="none"),
        # logits with a standard deviation of 20 (beyond 88, exp overflows float32 without the
        # maximum subtracted); larger logits would be ill-conditioned in float32 itself
        case("huge", n=16, k=64, v=512, scale=20.0),
        # logits of 1e-4, a nearly uniform softmax; hidden and weight share the smallness so that
        # both gradients stay normal float16 numbers
        case("tiny", n=16, k=64, v=512, scale=1e-2, w_scale=1e-2, reduction="sum"),
        # the cross_entropy perf shape (Llama 3 vocabulary) behind its 4096-wide hidden state
        Case("perf", lambda g, dtype: _make_lce(g, dtype, n=8192, k=4096, v=128256), perf=True),
    ]


def _bad_inputs_ce() -> list[BadInput]:
    def base(**kw: Any) -> Args:
        return {"logits": torch.randn(4, 10), "target": torch.tensor([1, 2, -100, 9]), "ignore_index": -100,
                "label_smoothing": 0.0, "reduction": "mean", **kw}

    return [
        BadInput("int_logits", lambda: base(logits=torch.ones(4, 10, dtype=torch.int64))),
        BadInput("logits_rank", lambda: base(logits=torch.randn(2, 2, 10))),
        BadInput("not_a_tensor", lambda: base(logits=[[1.0, 2.0]])),
        BadInput("float_target", lambda: base(target=torch.zeros(4))),
        BadInput("int32_target", lambda: base(target=torch.zeros(4, dtype=torch.int32))),
        BadInput("target_shape", lambda: base(target=torch.zeros(5, dtype=torch.int64))),
        BadInput("target_device", lambda: base(target=torch.zeros(4, dtype=torch.int64, device="meta"))),
        BadInput("reduction", lambda: base(reduction="avg")),
        BadInput("label_smoothing_high", lambda: base(label_smoothing=1.5)),
        BadInput("label_smoothing_negative", lambda: base(label_smoothing=-0.1)),
        BadInput("ignore_index_float", lambda: base(ignore_index=-100.0)),
    ]


def _bad_inputs_lce() -> list[BadInput]:
    def base(**kw: Any) -> Args:
        return {"hidden": torch.randn(4, 8), "weight": torch.randn(10, 8),
                "target": torch.tensor([1, 2, -100, 9]), "bias": None, "ignore_index": -100,
                "reduction": "mean", **kw}

    return [
        BadInput("int_hidden", lambda: base(hidden=torch.ones(4, 8, dtype=torch.int64))),
        BadInput("hidden_rank", lambda: base(hidden=torch.randn(2, 4, 8))),
        BadInput("weight_rank", lambda: base(weight=torch.randn(10))),
        BadInput("weight_in_features", lambda: base(weight=torch.randn(10, 9))),
        BadInput("weight_dtype", lambda: base(weight=torch.randn(10, 8, dtype=torch.float64))),
        BadInput("weight_device", lambda: base(weight=torch.randn(10, 8, device="meta"))),
        BadInput("bias_shape", lambda: base(bias=torch.zeros(9))),
        BadInput("bias_dtype", lambda: base(bias=torch.zeros(10, dtype=torch.float16))),
        BadInput("float_target", lambda: base(target=torch.zeros(4))),
        BadInput("target_shape", lambda: base(target=torch.zeros(3, dtype=torch.int64))),
        BadInput("reduction", lambda: base(reduction="batchmean")),
        BadInput("ignore_index_str", lambda: base(ignore_index="pad")),
    ]


def _bad_targets(make: Any, classes: int) -> list[BadIndices]:
    """Targets out of range among valid and ignored ones; ``make(target)`` builds the call."""
    def call(bad: list[int]) -> Args:
        g = torch.Generator().manual_seed(len(bad))
        target = _targets(g, 32, classes, 0.2, -100)
        target[torch.randperm(32, generator=g)[: len(bad)]] = torch.tensor(bad)
        return make(g, target)

    return [
        BadIndices("target_equals_classes", lambda: call([classes]), "target"),
        BadIndices("target_negative", lambda: call([-1, -5, -99]), "target"),
        BadIndices("target_int64_extremes", lambda: call([2**63 - 1, -(2**63), 2**31, -(2**31) - 1]), "target"),
    ]


def _bad_indices_ce() -> list[BadIndices]:
    def make(g: torch.Generator, target: Tensor) -> Args:
        return {"logits": randn(g, 32, 100, dtype=torch.float32), "target": target, "ignore_index": -100,
                "label_smoothing": 0.1, "reduction": "none"}

    return _bad_targets(make, 100)


def _bad_indices_lce() -> list[BadIndices]:
    def make(g: torch.Generator, target: Tensor) -> Args:
        return {"hidden": randn(g, 32, 64, dtype=torch.float32),
                "weight": randn(g, 100, 64, dtype=torch.float32, scale=0.125), "target": target,
                "bias": None, "ignore_index": -100, "reduction": "none"}

    return _bad_targets(make, 100)


def _rounded_logit_chunks(h: Tensor, w: Tensor, bias: Optional[Tensor],
                          dtype: torch.dtype) -> Iterator[tuple[slice, Tensor, Tensor, Tensor, Tensor]]:
    """For `linear_cross_entropy_rounded` and `linear_cross_entropy_loss_rounded`, ``CHUNK_ELEMENTS``
    logits at a time, as the reference: ``(rows, z, lse, moved, shift)`` in float64, the chunk's
    logits, their log-sum-exp (``[rows, 1]``), each logit's move ``u · |hidden · weightᵀ|`` when
    rounded to ``dtype``, and ``B = log Σ_j p_j exp(u · |z_j|)`` (``[rows, 1]``), the bound of the
    log-sum-exp's move either way. ``h`` and ``w`` are finite float64."""
    u = torch.finfo(dtype).eps / 2
    step = max(1, CHUNK_ELEMENTS // max(w.shape[0], 1))
    for start in range(0, h.shape[0], step):
        r = slice(start, start + step)
        product = h[r] @ w.T
        z = product if bias is None else product + finite(bias.detach().to(torch.float64))
        lse = torch.logsumexp(z, -1, keepdim=True)
        moved = u * product.abs()
        yield r, z, lse, moved, torch.logsumexp(z + moved, -1, keepdim=True) - lse


def linear_cross_entropy_rounded(args: Args, upstream: Args, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """linear_cross_entropy's `RoundingAllowance`: what two roundings to the inputs' ``dtype``, both
    those of ``cross_entropy(linear(hidden, weight, bias), target)`` composed in that dtype, move
    the gradients by:

    * the logits ``hidden · weightᵀ`` rounded as ``linear`` returns them: each logit moves by up to
      ``u · |z_i|`` (u the unit roundoff), the row's log-sum-exp by at most
      ``B = log Σ_j p_j exp(u · |z_j|)`` either way, so each probability by at most
      ``p_i · (exp(u · |z_i| + B) − 1)``; those bounds go through the products ``dz · weight`` and
      ``dzᵀ · hidden`` and dbias's sum whole (their signs are not independent);
    * the logits' gradient ``dz = g · (softmax(z) − onehot)`` rounded as the operand of those
      products, as linear's ``dpre``, bounded as `rounded_operand` does.

    Float64 from the oracle's checked arguments (hidden, weight, target, bias, ignore_index,
    reduction) and ``{"dloss": dloss}``; ``CHUNK_ELEMENTS`` logits at a time, as the reference."""
    h, w = (finite(args[n].detach().to(torch.float64)) for n in ("hidden", "weight"))
    bias, target, ignore_index = args["bias"], args["target"].to(h.device), args["ignore_index"]
    kept = target != ignore_index
    h_kept = torch.where(kept[:, None], h, 0.0)
    row_grad = finite(row_grads(upstream["dloss"].detach().to(h.device), target, ignore_index, args["reduction"],
                                 torch.float64))
    dh = torch.empty_like(h)
    # summed over the chunks, for dweight then dbias: dz's rounding (bounds, squares), the logits'
    sums = [h.new_zeros(w.shape if i < 3 else w.shape[:1]) for i in range(6)]
    for r, z, lse, moved, shift in _rounded_logit_chunks(h, w, bias, dtype):
        dz = finite(dlogits(z, target[r], lse[:, 0], 0.0, row_grad[r], kept[r]))
        (dh_bound, dh_squares), dw_sums, db_sums = rounding_sums(dz, h_kept[r], w, dtype)
        e = (z - lse).exp_().mul_(torch.expm1(moved.add_(shift))).mul_(row_grad[r].abs()[:, None])
        e = finite(torch.where(kept[r][:, None], e, 0.0))
        dh[r] = summed(dh_bound, dh_squares) + e @ w.abs()
        for total, part in zip(sums, (*dw_sums, e.T @ h_kept[r].abs(), *db_sums, e.sum(0))):
            total += part
    dw_bounds, dw_squares, dw_logits, db_bounds, db_squares, db_logits = sums
    allowance = {"hidden": dh, "weight": summed(dw_bounds, dw_squares) + dw_logits}
    return allowance if bias is None else {**allowance, "bias": summed(db_bounds, db_squares) + db_logits}


def linear_cross_entropy_loss_rounded(args: Args, dtype: torch.dtype) -> torch.Tensor:
    """The loss's counterpart of `linear_cross_entropy_rounded`: how far rounding the logits
    ``hidden · weightᵀ`` to ``dtype``, as ``linear`` returns them, moves the loss. Each kept row's
    target logit moves by up to ``u · |z_t|`` and its log-sum-exp by at most ``B`` either way (by
    Jensen's inequality the downward move is at most ``B`` too), so its loss by ``u · |z_t| + B``;
    summed or averaged over the kept rows as the loss is reduced. Float64, the loss's shape, from
    the oracle's checked arguments. A relative bound cannot hold here: a row whose target is its
    largest logit has a loss near 0 that logits near ±300 still move by whole units."""
    h, w = (finite(args[n].detach().to(torch.float64)) for n in ("hidden", "weight"))
    bias, target, ignore_index = args["bias"], args["target"].to(h.device), args["ignore_index"]
    kept = target != ignore_index
    rows = h.new_zeros(h.shape[0])
    for r, _, _, moved, shift in _rounded_logit_chunks(h, w, bias, dtype):
        t = torch.where(kept[r], target[r], 0).clamp(0, max(w.shape[0] - 1, 0))[:, None]
        at_target = moved.gather(1, t)[:, 0] if w.shape[0] else torch.zeros_like(shift[:, 0])
        rows[r] = torch.where(kept[r], finite(at_target + shift[:, 0]), 0.0)
    if args["reduction"] == "none":
        return rows
    total = rows.sum()
    return total / _kept(target, ignore_index) if args["reduction"] == "mean" else total


def _row_loss(a: Args, rows: tuple[str, ...], per_row_saved: tuple[str, ...],
              summed_saved: tuple[str, ...]) -> list[Strategy]:
    """Losses sharded over rows: the loss of each row ("none") or a partial sum ("sum"); a mean
    needs the count of every rank's counted rows, so it has no strategy. Saved gradients that are
    empty (no gradient prepared) stay replicated. A vocabulary sharded across ranks goes through
    `kpt.distributed.cross_entropy` instead."""
    if a["reduction"] == "mean":
        return []
    prepared = a["needs_grad"] and a["reduction"] != "none"
    loss: Placement = 0 if a["reduction"] == "none" else PARTIAL
    outputs: dict[str, Placement] = {"loss": loss, **{s: 0 for s in per_row_saved if prepared or s == "lse"}}
    if prepared:
        outputs.update({s: PARTIAL for s in summed_saved})
    return [(outputs, {r: 0 for r in rows})]


def _cross_entropy_sharding(a: Args) -> list[Strategy]:
    strategies = _row_loss(a, ("logits", "target"), (), ())
    if strategies and a["needs_grad"]:  # dlogits is prepared for every reduction
        strategies[0][0]["dlogits"] = 0
    return strategies


def _linear_cross_entropy_sharding(a: Args) -> list[Strategy]:
    return _row_loss(a, ("hidden", "target"), ("dhidden", "lse"), ("dweight", "dbias"))


CROSS_ENTROPY = KernelSpec(
    name="cross_entropy",
    signature=cross_entropy,
    validate=validate_cross_entropy,
    forward=cross_entropy_fwd,
    backward=cross_entropy_bwd,
    outputs=("loss",),
    saved=("dlogits",),
    differentiable=("logits",),
    needs_grad_arg=True,
    unsaved=("logits",),
    reusable=("dlogits",),
    flops=_cross_entropy_flops,
    cases=_cross_entropy_cases,
    bad_inputs=_bad_inputs_ce,
    check_indices=check_cross_entropy_indices,
    bad_indices=_bad_indices_ce,
    sharding=_cross_entropy_sharding,
    memory_bound=True,
    peers=("liger", "flag_gems"),
)

LINEAR_CROSS_ENTROPY = KernelSpec(
    name="linear_cross_entropy",
    signature=linear_cross_entropy,
    validate=validate_linear_cross_entropy,
    forward=linear_cross_entropy_fwd,
    backward=linear_cross_entropy_bwd,
    outputs=("loss",),
    saved=("dhidden", "dweight", "dbias", "lse"),
    differentiable=("hidden", "weight", "bias"),
    needs_grad_arg=True,
    reusable=("dhidden", "dweight", "dbias"),
    flops=_linear_cross_entropy_flops,
    cases=_linear_cross_entropy_cases,
    bad_inputs=_bad_inputs_lce,
    check_indices=check_linear_cross_entropy_indices,
    bad_indices=_bad_indices_lce,
    sharding=_linear_cross_entropy_sharding,
    rounding=linear_cross_entropy_rounded,
    peers=("liger",),
)

SPECS = (CROSS_ENTROPY, LINEAR_CROSS_ENTROPY)
