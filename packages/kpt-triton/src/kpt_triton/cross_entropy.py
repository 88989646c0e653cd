"""Cross-entropy (``cross_entropy``) and cross-entropy fused with its linear layer
(``linear_cross_entropy``).

For one row of logits z ∈ ℝ^V with target t (rows with t = ignore_index give 0)::

    lse  = log Σ exp(z)                                   (online over chunks of V)
    loss = (1 − ε) · (lse − z_t) + ε · (lse − mean(z))     (ε = label_smoothing)
    dz   = g · (exp(z − lse) − (1 − ε) · onehot(t) − ε / V)

where g is the gradient reaching the row's loss (g/n_kept for "mean"). One kernel does both
halves: pass 1 reads the row once, keeping a running maximum m and a running sum rescaled
whenever m grows (``s ← s · exp(m − m') + Σ exp(z − m')``), so no float32 ``[N, V]`` copy is
ever made; pass 2 reads the row again and writes dz. The loss and dz subtract m and log s one
after the other (``exp((z − m) − log s)``), not their float32 sum, which at logits of 1e4 is
2^-11 off. ``cross_entropy`` runs both in its
forward when a gradient is wanted (dz for an upstream gradient of 1); its backward only scales
dz in place (`scale_rows_`), and does nothing at all when the upstream gradient is 1, the
``loss.backward()`` of a mean loss. The grid is persistent, a few programs per multiprocessor,
so that the rows in flight stay few enough for pass 2 to find its row still in the L2 cache.
Rows too few to give every multiprocessor a program (a decode step's one token) are cut into
spans instead: a first kernel writes each span's partial (m, s, Σz), the second merges them per
row and writes the row's gradient span by span, one program each.

``linear_cross_entropy`` works through chunks of rows of z = hidden · weightᵀ (+ bias, added
in float32 inside the kernel). Each chunk's logits come from one GEMM into a reused buffer, in
hidden's dtype as ``linear`` gives them (the float32 accumulator rounded once, as transformers'
``lm_head`` hands them to its loss), and the kernel writes dz over them in place: 2 bytes a logit
for 16-bit models, against 6 for float32 logits beside a 16-bit dz, so a chunk holds three times
the rows in the same memory. For "mean"/"sum" with gradients wanted the forward then runs the two
gradient GEMMs on that chunk (dhidden = dz · weight, dweight += dzᵀ · hidden), so the whole loss
costs three GEMMs and the ``[N, V]`` logits never exist; the backward scales those gradients in
place. For "none" the forward keeps lse and the backward recomputes each chunk's logits.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from .launch import cached_launch
from .linear import mm
from .softmax import lse_parts_kernel, lse_stats, lse_terms, merged_stats
from .tiling import (
    aligned,
    aligned_span,
    cdiv,
    edge_columns,
    next_pow2,
    persistent_programs,
    row_split,
    row_vector,
    vector,
    warps,
)

_LSE_ROW, _LSE_SAVED, _LSE_PARTS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
"""Where the cross-entropy kernel takes a row's log-sum-exp from: the row itself, ``LSE``, or the
row's partial statistics in ``PARTS`` (`kpt_triton.softmax.lse_parts_kernel`)."""


@cached_launch
@triton.jit
def _cross_entropy_kernel(
    Z, TARGET, BIAS, GRAD, LOSS, LSE, DZ, PARTS,  # BIAS only with HAS_BIAS; DZ (contiguous) may be Z
    N, V,
    stride_zn, stride_zv, stride_g, stride_dzn,  # stride_g is 0 for one gradient shared by all rows
    ignore_index,
    label_smoothing,
    span,  # columns of the gradient per program along the grid's second axis
    HAS_BIAS: tl.constexpr,
    SMOOTHING: tl.constexpr,  # label_smoothing > 0: mean(z) is needed
    LSE_FROM: tl.constexpr,  # _LSE_ROW, _LSE_SAVED or _LSE_PARTS
    WRITE_LOSS: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_P: tl.constexpr,  # ≥ the partial statistics per row (_LSE_PARTS)
    VEC: tl.constexpr,  # > 1: rows of Z and DZ read in aligned vectors (kpt_triton.tiling.row_vector)
):
    for row in range(tl.program_id(0), N, tl.num_programs(0)):
        _cross_entropy_row(Z, TARGET, BIAS, GRAD, LOSS, LSE, DZ, PARTS, tl.cast(row, tl.int64), V, stride_zn,
                           stride_zv, stride_g, stride_dzn, ignore_index, label_smoothing, span, HAS_BIAS, SMOOTHING,
                           LSE_FROM, WRITE_LOSS, WRITE_GRAD, BLOCK_V, BLOCK_P, VEC)


@triton.jit
def _write_grad(Z_AT, BIAS, col0, DZ_AT, cols, mask, stride_zv, target, kept, g, top, log_s, label_smoothing, V,
                HAS_BIAS: tl.constexpr):
    """``dz`` at columns ``cols`` of the row at ``Z_AT``, which is column ``col0`` of the vocabulary;
    the row's log-sum-exp is ``top + log_s`` (`kpt_triton.softmax.lse_terms`)."""
    z = tl.load(Z_AT + cols * stride_zv, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    if HAS_BIAS:
        z += tl.load(BIAS + col0 + cols, mask=mask, other=0.0).to(tl.float32)
    d = tl.exp((z - top) - log_s) - label_smoothing / V
    d -= tl.where(cols == target - col0, 1.0 - label_smoothing, 0.0)
    # selected: an ignored row's inf or NaN logits reach nothing (0 · NaN)
    tl.store(DZ_AT + cols, tl.where(kept, g * d, 0.0).to(DZ_AT.dtype.element_ty), mask=mask,
             eviction_policy="evict_first")


@triton.jit
def _cross_entropy_row(
    Z, TARGET, BIAS, GRAD, LOSS, LSE, DZ, PARTS, row, V, stride_zn, stride_zv, stride_g, stride_dzn, ignore_index,
    label_smoothing, span, HAS_BIAS: tl.constexpr, SMOOTHING: tl.constexpr, LSE_FROM: tl.constexpr,
    WRITE_LOSS: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_P: tl.constexpr,
    VEC: tl.constexpr,
):
    start = row * stride_zn
    z_row = Z + start
    target = tl.load(TARGET + row)
    kept = target != ignore_index
    cols = tl.arange(0, BLOCK_V)
    first = tl.program_id(1) == 0  # the program along the row that writes its loss and lse

    if WRITE_LOSS:
        # Read before the statistics, whose reductions are barriers of the whole program: where dz is
        # written over z (linear_cross_entropy), no warp may overwrite z_t before every warp has read it.
        # A target outside [0, V) that is not ignored gives NaN rather than reading out of bounds.
        in_range = (target >= 0) & (target < V)
        z_t = tl.load(z_row + target * stride_zv, mask=kept & in_range, other=float("nan")).to(tl.float32)
        if HAS_BIAS:
            z_t += tl.load(BIAS + target, mask=kept & in_range, other=0.0).to(tl.float32)

    z_sum = 0.0
    if LSE_FROM == _LSE_ROW:
        m, s, z_sum = lse_stats(Z, start, BIAS, 0, V, stride_zv, HAS_BIAS, SMOOTHING, BLOCK_V, VEC)
        top, log_s = lse_terms(m, s)
    elif LSE_FROM == _LSE_PARTS:
        m, s, z_sum = merged_stats(PARTS, row, tl.cdiv(V, span), SMOOTHING, BLOCK_P)
        top, log_s = lse_terms(m, s)
    else:
        top = tl.load(LSE + row)
        log_s = 0.0
    if LSE_FROM != _LSE_SAVED:
        tl.store(LSE + row, top + log_s, mask=first)

    if WRITE_LOSS:
        loss = (1.0 - label_smoothing) * ((top - z_t) + log_s)
        if SMOOTHING:
            loss += label_smoothing * ((top - z_sum / V) + log_s)
        tl.store(LOSS + row, tl.where(kept, loss, 0.0), mask=first)

    if WRITE_GRAD:
        g = tl.load(GRAD + row * stride_g).to(tl.float32)  # an ignored row's dz is 0 (the store's select)
        lo = tl.program_id(1) * span
        hi = tl.minimum(lo + span, V)
        dz_row = DZ + row * stride_dzn
        a, n = aligned_span(start, lo, hi, VEC)
        if VEC > 1:
            edge, edge_mask = edge_columns(lo, a, n, hi, VEC)
            _write_grad(z_row, BIAS, 0, dz_row, edge, edge_mask, stride_zv, target, kept, g, top, log_s,
                        label_smoothing, V, HAS_BIAS)
        z_at = Z + aligned(start, a, stride_zv, VEC)
        dz_at = DZ + aligned(row * stride_dzn, a, 1, VEC)
        # last chunk first: the chunks the log-sum-exp pass read last are the likeliest still in L2
        for c_rev in range(0, n, BLOCK_V):
            c = (tl.cdiv(n, BLOCK_V) - 1) * BLOCK_V - c_rev
            _write_grad(z_at, BIAS, a, dz_at, c + cols, c + cols < n, stride_zv, target, kept, g, top, log_s,
                        label_smoothing, V, HAS_BIAS)


ALIGNED_CHUNK = 4096
"""The most logits in a chunk (in warps of at most 512) where rows are read in aligned vectors
(`kpt_triton.tiling.row_vector`: an odd vocabulary), whose head and tail take registers: on the H100
chunks of 16384 in 16 warps spilled 120 bytes a thread, and loss with gradient of 8192 × 50257 took
1521 µs against 1289 in chunks of 4096 in 8 warps (eager 2646, Liger 1939;
``benchmarks/h100-2026-11-27d.md``)."""


def _rows(z, target, bias, grad, loss, lse, dz, ignore_index, label_smoothing, *, compute_lse, write_loss,
          block_v, elems_per_warp, programs_per_sm):
    """Run the kernel over the rows of ``z``; ``grad`` (None: no gradient pass) is ``[N]`` or 0-dim."""
    n, v = z.shape
    if n == 0:
        return
    if v == 0:
        # no classes: lse = log 0; every row must be ignored, so losses and gradients are empty or 0
        if compute_lse:
            lse.fill_(-float("inf"))
        if write_loss:
            loss.zero_()
        return
    vec = row_vector(v, (z, z.stride(0), z.stride(1)), *([(dz, dz.stride(0), 1)] if grad is not None else []))
    if vec > 1:
        block_v, elems_per_warp = min(block_v, ALIGNED_CHUNK), min(elems_per_warp, 512)
    block = min(next_pow2(v), block_v)
    # A row cut into spans across programs only where dz has its own buffer: written over z, one
    # span's gradient could overwrite the target's logit before the program writing the loss reads it.
    block, span = (block, v) if dz is z else row_split(n, v, block, z.device)
    n_parts = cdiv(v, span)
    smoothing = label_smoothing > 0
    parts = None
    if compute_lse and n_parts > 1:
        parts = torch.empty(n, n_parts, 3, dtype=torch.float32, device=z.device)
        lse_parts_kernel[(n, n_parts)](z, vector(bias), parts, v, z.stride(0), z.stride(1), span,
                                        HAS_BIAS=bias is not None, SMOOTHING=smoothing, BLOCK_V=block, VEC=vec,
                                        num_warps=warps(block, elems_per_warp))
    lse_from = _LSE_SAVED if not compute_lse else _LSE_PARTS if parts is not None else _LSE_ROW
    grid = (persistent_programs(n, z.device, programs_per_sm), n_parts if grad is not None else 1)
    _cross_entropy_kernel[grid](
        z, vector(target), vector(bias), grad, loss, lse, dz, parts, n, v,
        z.stride(0), z.stride(1), grad.stride(0) if grad is not None and grad.dim() else 0,
        dz.stride(0) if dz is not None else 0, ignore_index, label_smoothing, span,
        HAS_BIAS=bias is not None, SMOOTHING=smoothing, LSE_FROM=lse_from,
        WRITE_LOSS=write_loss, WRITE_GRAD=grad is not None,
        BLOCK_V=block, BLOCK_P=next_pow2(n_parts), VEC=vec, num_warps=warps(block, elems_per_warp),
    )


def _kept(target, ignore_index):
    """Rows counted by "mean", at least 1 so that all-ignored gives 0 (kept on the device: no sync)."""
    return (target != ignore_index).sum().clamp(min=1)


@cached_launch
@triton.jit
def _reduce_kernel(LOSS, TARGET, OUT, N, ignore_index, HAS_LOSS: tl.constexpr, MEAN: tl.constexpr,
                   BLOCK: tl.constexpr):
    """One program: ``OUT = Σ LOSS`` (1 without ``HAS_LOSS``), divided with ``MEAN`` by the rows whose
    target is not ``ignore_index`` (at least 1, so that all-ignored gives 0), rounded to OUT's dtype."""
    total = tl.zeros([BLOCK], dtype=tl.float32)
    kept = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, N, BLOCK):
        i = start + tl.arange(0, BLOCK)
        if HAS_LOSS:
            total += tl.load(LOSS + i, mask=i < N, other=0.0)
        if MEAN:
            kept += (tl.load(TARGET + i, mask=i < N, other=ignore_index) != ignore_index).to(tl.int32)
    out = tl.sum(total, axis=0) if HAS_LOSS else tl.full([], 1.0, tl.float32)
    if MEAN:
        out = out / tl.maximum(tl.sum(kept, axis=0), 1).to(tl.float32)
    tl.store(OUT, out.to(OUT.dtype.element_ty))


def _reduce(losses, target, ignore_index, mean, dtype):
    """`_reduce_kernel` as a 0-dim tensor of ``dtype``: one launch where torch would take five operations."""
    out = torch.empty((), dtype=dtype, device=target.device)
    n = target.shape[0]
    block = min(max(next_pow2(n), 128), 8192)
    _reduce_kernel[(1,)](losses, target, out, n, ignore_index, HAS_LOSS=losses is not None, MEAN=mean,
                         BLOCK=block, num_warps=warps(block, 1024))
    return out


def reduce_losses(losses, target, ignore_index, reduction, dtype):
    """The loss as ``reduction`` asks, from the float32 loss of each row."""
    if reduction == "none":
        return losses.to(dtype)
    return _reduce(losses, vector(target), ignore_index, reduction == "mean", dtype)


def _row_grad(dloss, target, ignore_index, reduction):
    """The gradient reaching each row's loss, as the kernel reads it: ``[N]`` or one shared value."""
    if reduction == "none":
        return dloss
    g = dloss.to(torch.float32)
    return g / _kept(target, ignore_index) if reduction == "mean" else g


def unit_grad(target, ignore_index, reduction):
    """The gradient reaching each row's loss for an upstream gradient of 1, as one 0-dim float32
    tensor: 1 / n_kept for "mean", 1 for "sum" and "none"."""
    return _reduce(None, vector(target), ignore_index, reduction == "mean", torch.float32)


@cached_launch
@triton.jit
def _scale_rows_kernel(X, G, R, D, stride_g, BLOCK_D: tl.constexpr):
    """``X[r, :] *= G[r · stride_g]`` in place for a contiguous ``[R, D]`` X; a factor of 1 is
    not applied at all (one shared factor of 1: no tile is visited)."""
    col_blocks = tl.cdiv(D, BLOCK_D)
    n_tiles = R * col_blocks
    if stride_g == 0:
        n_tiles = tl.where(tl.load(G).to(tl.float32) == 1.0, 0, n_tiles)
    for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        row = t // col_blocks
        cols = (t % col_blocks) * BLOCK_D + tl.arange(0, BLOCK_D)
        g = tl.load(G + row * stride_g).to(tl.float32)
        mask = (cols < D) & (tl.zeros([BLOCK_D], tl.float32) + g != 1.0)
        ptrs = X + tl.cast(row, tl.int64) * D + cols
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs, (x * g).to(X.dtype.element_ty), mask=mask)


def scale_rows_(x, g, *, block: int = 8192, programs_per_sm: int = 4):
    """``x`` (contiguous) times ``g`` in place, and returned: ``g`` one value (0-dim) or one per
    row of ``x`` (``[x.shape[0]]``); products in float32, rounded to x's dtype."""
    if x.numel():
        x2 = x.view(1, -1) if g.dim() == 0 else x.view(x.shape[0], -1)
        r, d = x2.shape
        block_d = min(next_pow2(d), block)
        tiles = r * cdiv(d, block_d)
        _scale_rows_kernel[(persistent_programs(tiles, x.device, programs_per_sm),)](
            x2, g, r, d, g.stride(0) if g.dim() else 0, BLOCK_D=block_d, num_warps=warps(block_d, 512))
    return x


def cross_entropy_fwd(logits, target, ignore_index, label_smoothing, reduction, needs_grad, *,
                      block_v: int = 8192, elems_per_warp: int = 512,
                      programs_per_sm: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, dlogits)``, ``dlogits`` empty without ``needs_grad``. Tuning: the row is read in
    chunks of ``block_v`` logits, one warp per ``elems_per_warp`` of a chunk, ``programs_per_sm``
    rows at a time per multiprocessor."""
    n = logits.shape[0]
    losses = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    dlogits = torch.empty(logits.shape if needs_grad else (0,), dtype=logits.dtype, device=logits.device)
    unit = unit_grad(target, ignore_index, reduction) if needs_grad else None
    _rows(logits, target, None, unit, losses, lse, dlogits, ignore_index,
          label_smoothing, compute_lse=True, write_loss=True, block_v=block_v, elems_per_warp=elems_per_warp,
          programs_per_sm=programs_per_sm)
    return reduce_losses(losses, target, ignore_index, reduction, torch.float32), dlogits


def cross_entropy_bwd(logits, target, ignore_index, label_smoothing, reduction, needs_grad, loss, dlogits,
                      dloss) -> tuple[torch.Tensor]:
    """``(dlogits · dloss,)``: the forward's gradient, scaled in place (``logits`` is None)."""
    if dloss is None:
        return (torch.zeros_like(dlogits),)
    return (scale_rows_(dlogits, dloss),)


FREE_MEMORY_SHARE = 4
"""A chunk's buffers take at most 1 / ``FREE_MEMORY_SHARE`` of the device memory free when the loss
starts (`chunk_rows`)."""


_HOLDABLE: dict[Any, int] = {}
"""Per device: the bytes torch could hold there when the driver was last asked (its free memory
plus what torch's allocator had reserved then)."""


def _allocator_bytes(device: Any, kind: str) -> int:
    """The ``kind`` bytes (``"allocated"``, ``"reserved"``) torch's allocator holds now on ``device``,
    as ``torch.cuda.memory_allocated`` / ``memory_reserved`` give them: read from the nested
    statistics, which those two flatten and sort (over a hundred entries) at every call: 0.3 ms of
    host time a loss in a compiled training step under cProfile on an H100 host."""
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    return stats.get(f"{kind}_bytes", {}).get("all", {}).get("current", 0)


def _free_bytes(device: Any, ask: bool) -> int:
    """The bytes torch can still allocate on ``device``: what it could hold when the driver was last
    asked (``ask``: now; else only the first time), less what it has allocated now. Asking the driver
    (``cudaMemGetInfo``) costs microseconds of host time at every loss, and is reported to wait for
    the device on some drivers, a wait in the middle of a training step; memory that torch reserves
    or frees later is counted without asking, memory another process takes is not."""
    if ask or device not in _HOLDABLE:
        free, _ = torch.cuda.mem_get_info(device)
        _HOLDABLE[device] = free + _allocator_bytes(device, "reserved")
    return _HOLDABLE[device] - _allocator_bytes(device, "allocated")


def chunk_rows(n: int, k: int, v: int, hidden: torch.Tensor, chunk_elems: int, gradient_share: float = 1.0) -> int:
    """How many rows of the ``[n, v]`` logits one chunk of ``linear_cross_entropy`` holds.

    The chunk's one buffer is its logits in hidden's dtype, which the gradient overwrites: 2 or 4
    bytes a logit. It takes the tuning's ``chunk_elems // v`` rows (2^28 logits: 2,048 rows of Llama
    3's 128,256 vocabulary, 0.49 GiB in bfloat16), or fewer: at most ``gradient_share`` times the
    room of the gradients the loss returns, ``[n, k]`` and ``[v, k]``, which every fused loss
    allocates (``(n + v) · k / v`` rows, 128 at least: 851 of Qwen3's 151,936 words at hidden 768
    and 16,384 rows). So the loss's peak above its inputs is at most ``1 + gradient_share`` times
    those gradients. The rows are halved, on a CUDA or ROCm device, until the buffer fits in a
    quarter of the free memory (`_free_bytes`: the driver's free memory and what torch's allocator
    holds unused, the driver asked again where that looks short; not while a CUDA graph is
    captured); halving keeps the plans few, so a loss's rounding changes only where memory runs
    short. Then at least 1 row and at most ``n``, in whole multiples of 128 rows above 128 (the
    chunk GEMMs on full tiles). Fewer rows cost time: each chunk reads and writes the ``[v, k]``
    weight gradient once (`scripts/lce_memory.py` measures both). Chunks within twice the memory of
    Liger-Kernel's (256 of Qwen3's rows above, 384 of Llama 3's 8192 × 4096 × 128256) made a compiled
    Qwen3 step 20% slower on an H100, with the same peak (``benchmarks/models/h100.md``)."""
    per_row = v * hidden.element_size()
    # the tuning's rows, at most those in the gradients' room (128 at least)
    step = int(min(max(1, chunk_elems // max(v, 1)), max(128, gradient_share * (n + v) * k / max(v, 1))))
    if hidden.is_cuda and per_row and not torch.cuda.is_current_stream_capturing():
        free = _free_bytes(hidden.device, ask=False)
        if step * per_row * FREE_MEMORY_SHARE > free:  # short, or short since the driver was asked
            free = _free_bytes(hidden.device, ask=True)
        while step > 1 and step * per_row * FREE_MEMORY_SHARE > free:
            step //= 2
    step = min(n, step)
    return step - step % 128 if step > 128 else max(step, 1)


def _chunked(hidden, weight, target, bias, ignore_index, lse, losses, grad, *, chunk_elems, gradient_share,
             block_v, elems_per_warp, programs_per_sm):
    """One pass over chunks of rows of the logits (`chunk_rows`): writes ``lse`` and ``losses`` when
    ``losses`` is given (else reads ``lse``), and with ``grad`` returns ``(dhidden, dweight, dbias)``."""
    n, k = hidden.shape
    v = weight.shape[0]
    step = chunk_rows(n, k, v, hidden, chunk_elems, gradient_share)
    z_buf = torch.empty(step, v, dtype=hidden.dtype, device=hidden.device)  # the gradient overwrites it
    if grad is not None:
        dhidden = torch.empty(n, k, dtype=hidden.dtype, device=hidden.device)
        dweight = torch.zeros(v, k, dtype=weight.dtype, device=weight.device)
        dbias = torch.zeros(v if bias is not None else 0, dtype=torch.float32, device=hidden.device)
    for start in range(0, n, step):
        r = slice(start, min(start + step, n))
        h = hidden[r]
        # the logits as linear gives them: accumulated in float32, rounded once to hidden's dtype
        z = torch.mm(h, weight.t(), out=z_buf[: h.shape[0]])
        dz = z if grad is not None else None
        _rows(z, target[r], bias, grad[r] if grad is not None and grad.dim() else grad,
              losses[r] if losses is not None else None, lse[r], dz, ignore_index, 0.0,
              compute_lse=losses is not None, write_loss=losses is not None, block_v=block_v,
              elems_per_warp=elems_per_warp, programs_per_sm=programs_per_sm)
        if grad is not None:
            # an ignored row adds nothing, also where its hidden state or a weight holds inf or NaN
            # (its dz is 0, and 0 · inf would be NaN in the products)
            ignored = (target[r] == ignore_index)[:, None]
            mm(dz, weight, out=dhidden[r]).masked_fill_(ignored, 0.0)
            dweight.addmm_(dz.t(), h.masked_fill(ignored, 0.0))
            if bias is not None:
                dbias += dz.sum(0, dtype=torch.float32)
    if grad is None:
        return None
    return dhidden, dweight, dbias.to(bias.dtype) if bias is not None else dbias


def linear_cross_entropy_fwd(
    hidden, weight, target, bias, ignore_index, reduction, needs_grad, *, chunk_elems: int = 1 << 28,
    gradient_share: float = 1.0, block_v: int = 8192, elems_per_warp: int = 512, programs_per_sm: int = 4,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, dhidden, dweight, dbias, lse)``. Tuning: ``chunk_elems`` logits per chunk at most, and
    at most ``gradient_share`` times the room of the gradients (the only ``[rows, V]`` buffers held;
    `chunk_rows`), ``block_v`` / ``elems_per_warp`` as for
    `cross_entropy_fwd`."""
    n = hidden.shape[0]
    losses = torch.empty(n, dtype=torch.float32, device=hidden.device)
    lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
    fused = needs_grad and reduction != "none"
    grad = unit_grad(target, ignore_index, reduction) if fused else None
    grads = _chunked(hidden, weight, target, bias, ignore_index, lse, losses, grad, chunk_elems=chunk_elems,
                     gradient_share=gradient_share, block_v=block_v, elems_per_warp=elems_per_warp,
                     programs_per_sm=programs_per_sm)
    return (reduce_losses(losses, target, ignore_index, reduction, torch.float32),
            *(grads if grads is not None else (hidden.new_empty(0) for _ in range(3))), lse)


def linear_cross_entropy_bwd(
    hidden, weight, target, bias, ignore_index, reduction, needs_grad, loss, dhidden, dweight, dbias, lse,
    dloss, *, chunk_elems: int = 1 << 28, gradient_share: float = 1.0, block_v: int = 8192, elems_per_warp: int = 512,
    programs_per_sm: int = 4,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dhidden, dweight, dbias)``: the forward's gradients scaled in place by ``dloss`` when it
    made them, else recomputed chunk by chunk from the saved ``lse``."""
    if needs_grad and reduction != "none":
        return tuple(scale_rows_(t, dloss) for t in (dhidden, dweight, dbias))
    return _chunked(hidden, weight, target, bias, ignore_index, lse, None,
                    _row_grad(dloss, target, ignore_index, reduction), chunk_elems=chunk_elems,
                    gradient_share=gradient_share, block_v=block_v, elems_per_warp=elems_per_warp,
                    programs_per_sm=programs_per_sm)
