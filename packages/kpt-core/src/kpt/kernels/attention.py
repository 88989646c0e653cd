"""Scaled dot-product attention with grouped-query heads, a bottom-right causal mask and an
optional boolean mask (padding, packed documents, sliding windows, a static cache's empty slots).

Query head h reads key/value head h // G, G = Hq / Hkv. For one (batch, query head):

    s   = q · kᵀ · scale                     [Sq, Skv]; causal: s[i, j] = −∞ unless j ≤ i + Skv − Sq;
                                              mask: s[i, j] = −∞ where mask[b, h, i, j] is False
    lse = log Σ_j exp(s[:, j])               (natural log; −∞ for a query that sees no key)
    p   = exp(s − lse)                       (0 for a query that sees no key; computed normalized,
                                              `probabilities`)
    o   = p · v

Backward, with dO the gradient of o:
    dv    = Σ_group pᵀ · dO
    dp    = dO · vᵀ
    ds    = p ⊙ (dp − rowsum(p ⊙ dp))        (rowsum(p ⊙ dp) = rowsum(dO ⊙ o))
    dq    = ds · k · scale
    dk    = Σ_group dsᵀ · q · scale
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor

from ..errors import KernelNotSupportedError
from ..spec import Args, BadInput, Case, Check, KernelSpec, Strategy, compute_dtype, each_dim, finite, randn

HEAD_DIMS = (16, 256)
"""The smallest and largest head dimension of the contract."""


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: Optional[float] = None,
              mask: Optional[Tensor] = None) -> Tensor:
    """Softmax attention ``softmax(q · kᵀ · scale) · v`` with grouped-query heads.

    ``q``: ``[B, Hq, Sq, D]``; ``k``, ``v``: ``[B, Hkv, Skv, D]`` with ``Hq % Hkv == 0`` (query head
    ``h`` uses key/value head ``h // (Hq // Hkv)``), all of one float dtype, ``D`` in 16..256.
    ``scale`` defaults to ``D ** -0.5``. ``causal`` masks bottom-right aligned: query ``i`` sees keys
    ``j <= i + Skv - Sq`` (``F.scaled_dot_product_attention(is_causal=True)`` when ``Sq == Skv``;
    with a KV cache the last query sees every key). ``mask``, a bool tensor broadcastable to
    ``[B, Hq, Sq, Skv]`` (each dimension its size or 1; ``True``: the query may attend the key), is
    combined with ``causal``: a pair is visible when both allow it. It expresses key padding (left
    or right), packed documents, sliding windows and a static cache's unwritten slots, as the 4-D
    masks of ``F.scaled_dot_product_attention`` do. A query that sees no key (``Skv == 0``, causal
    with ``Sq > Skv``, or a mask row of ``False``) outputs zeros, and its gradients are zero.
    Softmax statistics in float32 (float64 for float64). Returns ``o``: ``[B, Hq, Sq, D]`` in q's
    dtype. Differentiable with respect to ``q``, ``k``, ``v`` (not ``mask``).
    """
    raise AssertionError("signature only: call backend.attention")


def validate_attention(a: Args, dtypes: tuple[torch.dtype, ...]) -> Args:
    c = Check("attention", dtypes)
    q = c.tensor("q", a["q"], ndim=4)
    k = c.tensor("k", a["k"], ndim=4)
    v = c.tensor("v", a["v"], ndim=4)
    batch, hq, _, d = q.shape
    low, high = HEAD_DIMS
    if not low <= d <= high:
        raise c.fail("q", f"has head dimension {d} (shape {tuple(q.shape)}); expected {low}..{high}")
    for name, t in (("k", k), ("v", v)):
        c.same_dtype(name, t, q, "q")
        c.same_device(name, t, q)
    kb, hkv, _, kd = kshape = k.shape
    if kb != batch or kd != d:
        raise c.fail("k", f"has shape {tuple(kshape)}; expected [{batch}, Hkv, Skv, {d}] "
                          f"to match q {tuple(q.shape)}")
    if hkv == 0 or hq % hkv:
        raise c.fail("k", f"has {hkv} heads; expected a positive divisor of the {hq} query heads")
    c.shape("v", v, kshape)
    if not isinstance(a["causal"], bool):
        raise c.fail("causal", f"is {a['causal']!r}; expected a bool")
    if a["scale"] is None:
        a["scale"] = d**-0.5
    a["scale"] = float(c.number("scale", a["scale"], low=0.0, high=sys.float_info.max))
    mask = a["mask"]
    if mask is not None:
        c.tensor("mask", mask, ndim=4, dtypes=(torch.bool,))
        c.same_device("mask", mask, q)
        full = (batch, hq, q.shape[2], kshape[2])
        if any(m not in (1, n) for m, n in zip(mask.shape, full)):
            raise c.fail("mask", f"has shape {tuple(mask.shape)}; expected one that broadcasts to {list(full)} "
                                 "(each dimension its size or 1)")
        a["mask"] = mask.expand(full)  # a view: backends read it by its strides (0 where broadcast)
    return a


def visible_keys(sq: int, skv: int, causal: bool, device: torch.device | str | None = None) -> Tensor:
    """``[Sq, Skv]`` bool: whether query ``i`` sees key ``j`` (every pair without a causal mask;
    with one, bottom-right aligned: ``j <= i + Skv - Sq``)."""
    if not causal:
        return torch.ones(sq, skv, dtype=torch.bool, device=device)
    return torch.arange(skv, device=device)[None, :] <= torch.arange(sq, device=device)[:, None] + (skv - sq)


def _scores(q: Tensor, k: Tensor, causal: bool, scale: float,
            mask: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Masked scores ``[B, Hkv, G, Sq, Skv]`` (compute dtype); q, k grouped as ``[B, Hkv, G|1, S, D]``.

    Query heads are grouped by their key/value head so that keys are broadcast, never copied.
    """
    ct = compute_dtype(q.dtype)
    batch, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    qg = q.to(ct).reshape(batch, hkv, hq // hkv, sq, d)
    kg = k.to(ct)[:, :, None]
    s = (qg @ kg.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~visible_keys(sq, skv, causal, q.device), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask.reshape(batch, hkv, hq // hkv, sq, skv), float("-inf"))
    return s, qg, kg


def probabilities(s: Tensor) -> Tensor:
    """``p = exp(s − m) / Σ exp(s − m)`` along the last dimension of the scores ``s``, ``m`` each
    row's maximum: ``exp(s − lse)`` normalized.

    Normalized at any magnitude, where ``exp(s − lse)`` is not: at scores of 2e36 (a key holding
    bfloat16's max) ``lse = m + log Σ exp(s − m)`` loses the log, and two tied keys would each get
    1. Where the maximum is finite, a row's sum is at least 1 (the maximum's term). The other rows
    come out as ``exp(s − lse)`` has them: a query that sees no key (a row of −∞) gets 0, a row
    holding +inf gets NaN at the +inf and 0 elsewhere (its sum, without the NaN, is 0), and a row
    holding NaN gets NaN throughout."""
    if s.shape[-1] == 0:  # no keys: nothing to normalize (and no maximum)
        return s
    e = torch.exp(s - s.amax(-1, keepdim=True).clamp(min=torch.finfo(s.dtype).min))
    return e / torch.nansum(e, -1, keepdim=True).clamp(min=1.0)


SCORES_PER_CHUNK = 1 << 27
"""The reference materializes at most this many scores at a time (1 GiB in float64): a larger
problem is computed by batch entries and groups of key/value heads, one after another."""


def by_chunks(fn: Callable[..., tuple[Tensor, ...]], q: Tensor, k: Tensor, *per_query: Tensor,
               per_key: tuple[Tensor, ...] = ()) -> tuple[Tensor, ...]:
    """``fn(q, k, *per_query, *per_key)`` on slices of batch entries and key/value heads, with
    the results (laid out like q, then like k) concatenated back; one call when it is small."""
    batch, hq, sq, _ = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    group = hq // hkv
    heads = max(1, min(hkv, SCORES_PER_CHUNK // max(group * sq * skv, 1)))
    if batch <= 1 and heads == hkv:
        return fn(q, k, *per_query, *per_key)
    rows = []
    for b in range(batch):
        parts = [fn(q[b:b + 1, h * group:(h + heads) * group], k[b:b + 1, h:h + heads],
                    *(t[b:b + 1, h * group:(h + heads) * group] for t in per_query),
                    *(t[b:b + 1, h:h + heads] for t in per_key)) for h in range(0, hkv, heads)]
        rows.append([torch.cat(outs, dim=1) for outs in zip(*parts)])
    return tuple(torch.cat(outs, dim=0) for outs in zip(*rows))


def attention_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
                      mask: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """Returns ``(o, lse)``; ``lse`` is ``[B, Hq, Sq]`` in float32 (float64 for float64 input)."""

    def forward(q: Tensor, k: Tensor, *rest: Tensor) -> tuple[Tensor, Tensor]:
        m, v = (rest[0], rest[1]) if mask is not None else (None, rest[0])
        s, _, _ = _scores(q, k, causal, scale, m)
        lse = torch.logsumexp(s, -1)
        o = probabilities(s) @ v.to(s.dtype)[:, :, None]
        return o.reshape(q.shape).to(q.dtype), lse.reshape(q.shape[:3])

    o, lse = by_chunks(forward, q, k, *_present(mask), per_key=(v,))
    return o, lse


def _present(*tensors: Optional[Tensor]) -> tuple[Tensor, ...]:
    return tuple(t for t in tensors if t is not None)


def attention_bwd(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, mask: Optional[Tensor], o: Tensor, lse: Tensor,
    do: Optional[Tensor]
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns ``(dq, dk, dv)`` in the dtypes and shapes of ``q``, ``k``, ``v``. p is recomputed from
    the scores (`probabilities`), not from the saved ``lse``, which the reference does not read."""

    def backward(q: Tensor, k: Tensor, do: Tensor, *rest: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        m, v = (rest[0], rest[1]) if mask is not None else (None, rest[0])
        s, qg, kg = _scores(q, k, causal, scale, m)
        p = probabilities(s)
        dog = do.to(s.dtype).reshape(qg.shape)
        vg = v.to(s.dtype)[:, :, None]
        dv = (p.transpose(-1, -2) @ dog).sum(2)
        dp = dog @ vg.transpose(-1, -2)
        ds = p * (dp - (p * dp).sum(-1, keepdim=True))
        dq = (ds @ kg) * scale
        dk = (ds.transpose(-1, -2) @ qg).sum(2) * scale
        return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    dq, dk, dv = by_chunks(backward, q, k, do if do is not None else torch.zeros_like(o), *_present(mask),
                           per_key=(v,))
    return dq, dk, dv


def visible_pairs(sq: int, skv: int, causal: bool) -> int:
    """How many (query, key) pairs of one head the mask leaves visible."""
    if not causal:
        return sq * skv
    return sum(min(max(i + skv - sq + 1, 0), skv) for i in range(sq))


def _flops(a: Args) -> float:
    batch, hq, sq, d = a["q"].shape
    # two matrix products (q·kᵀ and p·v) over the visible pairs
    return 4.0 * batch * hq * d * visible_pairs(sq, a["k"].shape[2], a["causal"])


def _make(g: torch.Generator, dtype: torch.dtype, *, b: int, hq: int, hkv: int, sq: int, skv: int, d: int,
          causal: bool = False, qk_scale: float = 1.0, transposed: bool = False, masked: str | None = None,
          **extra: Any) -> Args:
    def draw(heads: int, seq: int, scale: float) -> Tensor:
        if transposed:
            # the layout a fused QKV projection produces: [B, S, H, D] viewed as [B, H, S, D]
            return randn(g, b, seq, heads, d, dtype=dtype, scale=scale).transpose(1, 2)
        return randn(g, b, heads, seq, d, dtype=dtype, scale=scale)

    args = {"q": draw(hq, sq, qk_scale), "k": draw(hkv, skv, qk_scale), "v": draw(hkv, skv, 1.0),
            "causal": causal, "scale": None, "mask": None, **extra}
    if masked is not None:
        args["mask"] = MASKS[masked](g, b, hq, sq, skv)
    return args


def _key_padding(lengths: Callable[[int, int], list[tuple[int, int]]]) -> Callable[..., Tensor]:
    """A ``[B, 1, 1, Skv]`` mask of each batch entry's real keys ``start:stop`` from
    ``lengths(batch, skv)`` (the rest padding), as transformers' 2-D ``attention_mask``."""

    def make(g: torch.Generator, b: int, hq: int, sq: int, skv: int) -> Tensor:
        mask = torch.zeros(b, 1, 1, skv, dtype=torch.bool)
        for i, (start, stop) in enumerate(lengths(b, skv)):
            mask[i, ..., start:stop] = True
        return mask

    return make


def _documents(lengths: tuple[int, ...]) -> Callable[..., Tensor]:
    """A ``[1, 1, S, S]`` block-diagonal mask of documents of ``lengths`` packed into one row
    (as transformers builds it from ``position_ids`` that restart); with ``causal``, causal within each."""

    def make(g: torch.Generator, b: int, hq: int, sq: int, skv: int) -> Tensor:
        doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        assert len(doc) == sq == skv, "the documents fill the row"
        return (doc[:, None] == doc[None, :])[None, None]

    return make


def _window(width: int) -> Callable[..., Tensor]:
    """Query i (at key position i + Skv − Sq) sees the ``width`` keys up to its own: a sliding window."""

    def make(g: torch.Generator, b: int, hq: int, sq: int, skv: int) -> Tensor:
        pos = torch.arange(sq)[:, None] + (skv - sq)
        return ((pos - torch.arange(skv)[None, :]) < width)[None, None]

    return make


def _static_cache(filled: int) -> Callable[..., Tensor]:
    """A static cache of ``Skv`` slots whose first ``filled`` hold keys and the Sq queries come next:
    query i sees slots ``j <= filled + i``, and left padding hides the first slots of batch entry 1."""

    def make(g: torch.Generator, b: int, hq: int, sq: int, skv: int) -> Tensor:
        mask = (torch.arange(skv)[None, :] <= filled + torch.arange(sq)[:, None]).expand(b, 1, sq, skv).clone()
        mask[1:, ..., :3] = False
        return mask

    return make


def _random(g: torch.Generator, b: int, hq: int, sq: int, skv: int) -> Tensor:
    """Any pattern, a different one per head, with a query row that sees no key."""
    mask = torch.rand(b, hq, sq, skv, generator=g) < 0.6
    mask[:, :, sq // 2] = False
    return mask


MASKS: dict[str, Callable[..., Tensor]] = {
    # real keys: entry 0 all, entry 1 after 5 pads, entry 2 only the last key (its other queries see none)
    "left_padding": _key_padding(lambda b, skv: [(0, skv), (5, skv), (skv - 1, skv)][:b]),
    "right_padding": _key_padding(lambda b, skv: [(0, skv), (0, skv - 7)][:b]),
    "packed": _documents((7, 1, 20, 12)),
    "window": _window(8),
    "static_cache": _static_cache(10),
    "random": _random,
}
"""The masks of the conformance cases (`MASKS[name](generator, B, Hq, Sq, Skv)`): the forms
transformers hands an attention (``F.scaled_dot_product_attention``'s boolean masks), and any pattern."""


def _cases() -> list[Case]:
    def case(name: str, perf: bool = False, tolerance_scale: float = 1.0, **kw: Any) -> Case:
        return Case(name, lambda g, dtype: _make(g, dtype, **kw), perf=perf, tolerance_scale=tolerance_scale)

    llm: dict[str, Any] = dict(b=2, hq=4, hkv=4, sq=128, skv=128, d=64)
    return [
        case("llm", **llm),
        case("llm_causal", **{**llm, "causal": True}),
        case("gqa_causal", b=2, hq=8, hkv=2, sq=64, skv=64, d=128, causal=True),
        case("mqa", b=1, hq=4, hkv=1, sq=33, skv=33, d=32),
        # decoding with a KV cache: one query sees every key
        case("decode", b=2, hq=4, hkv=2, sq=1, skv=100, d=64, causal=True),
        # chunked prefill: the queries are the last Sq positions of the keys
        case("prefill_chunk", b=1, hq=2, hkv=2, sq=17, skv=100, d=64, causal=True),
        # more queries than keys: the first Sq − Skv queries see no key and output zeros
        case("causal_more_queries", b=1, hq=2, hkv=1, sq=20, skv=8, d=16, causal=True),
        case("odd", b=1, hq=3, hkv=3, sq=3, skv=17, d=80),
        case("head_dim_256", b=1, hq=2, hkv=1, sq=17, skv=17, d=256, causal=True),
        case("long", b=1, hq=1, hkv=1, sq=1000, skv=1000, d=64, causal=True),
        case("strided", b=2, hq=4, hkv=2, sq=64, skv=64, d=64, causal=True, transposed=True),
        case("explicit_scale", b=1, hq=2, hkv=2, sq=16, skv=16, d=64, scale=0.3),
        # the extremes of scale: 0 (uniform weights, o = mean(v); a backend that reads 0 as "not
        # given" applies D^-0.5) and 1 at D = 16, four times the default (near one-hot rows, whose
        # 16-bit gradients reach 1.12x the default tolerance at some inputs: seed 1566592, bfloat16
        # dq, on every backend sharing kpt-triton's kernel)
        case("scale_zero", b=1, hq=2, hkv=1, sq=16, skv=24, d=32, scale=0.0),
        case("scale_large", b=1, hq=2, hkv=1, sq=16, skv=24, d=16, causal=True, scale=1.0, tolerance_scale=2.0),
        # one key: every row of p is exactly 1, so dq and dk are exactly 0 (rounding of dp − Σ p·dp)
        case("single_key", b=2, hq=4, hkv=2, sq=1, skv=1, d=64, causal=True),
        case("zero_batch", b=0, hq=4, hkv=2, sq=16, skv=16, d=64),
        case("zero_queries", b=2, hq=2, hkv=2, sq=0, skv=16, d=64, causal=True),
        case("zero_keys", b=2, hq=2, hkv=2, sq=16, skv=0, d=64),
        # scores with standard deviation 16: near one-hot rows, whose exp overflows 16-bit types
        # unless the maximum is subtracted; float32 exp and sums (PyTorch's own float32 attention
        # included) land at 1.6-3.3e-5, above the default 2e-5
        case("huge_scores", b=1, hq=2, hkv=2, sq=64, skv=64, d=64, causal=True, qk_scale=4.0, tolerance_scale=4.0),
        case("tiny_scores", b=1, hq=2, hkv=2, sq=64, skv=64, d=64, qk_scale=1e-3),
        # masks: key padding (a row that sees no key outputs zeros), packed documents, a sliding
        # window, a static cache's slots, and any per-head pattern
        case("left_padding", b=3, hq=4, hkv=2, sq=24, skv=24, d=32, causal=True, masked="left_padding"),
        case("right_padding", b=2, hq=2, hkv=1, sq=24, skv=24, d=64, causal=True, masked="right_padding"),
        case("padding_bidirectional", b=2, hq=2, hkv=2, sq=24, skv=24, d=32, masked="right_padding"),
        case("decode_left_padding", b=3, hq=4, hkv=1, sq=1, skv=40, d=64, causal=True, masked="left_padding"),
        case("packed", b=1, hq=4, hkv=2, sq=40, skv=40, d=32, causal=True, masked="packed"),
        case("sliding_window", b=2, hq=2, hkv=1, sq=48, skv=48, d=32, causal=True, masked="window"),
        case("static_cache", b=2, hq=4, hkv=2, sq=3, skv=32, d=64, causal=True, masked="static_cache"),
        case("mask_random", b=2, hq=4, hkv=2, sq=20, skv=33, d=16, masked="random"),
        case("perf", b=4, hq=32, hkv=32, sq=4096, skv=4096, d=128, causal=True, perf=True),
    ]


def _bad_inputs() -> list[BadInput]:
    def base(**kw: Any) -> Args:
        return {"q": torch.randn(2, 4, 8, 16), "k": torch.randn(2, 2, 8, 16), "v": torch.randn(2, 2, 8, 16),
                "causal": False, "scale": None, "mask": None, **kw}

    return [
        BadInput("int_q", lambda: base(q=torch.ones(2, 4, 8, 16, dtype=torch.int64))),
        BadInput("q_rank", lambda: base(q=torch.randn(4, 8, 16))),
        BadInput("not_a_tensor", lambda: base(v=[[1.0]])),
        BadInput("head_dim_small", lambda: base(q=torch.randn(2, 4, 8, 8), k=torch.randn(2, 2, 8, 8),
                                                v=torch.randn(2, 2, 8, 8))),
        BadInput("head_dim_large", lambda: base(q=torch.randn(1, 1, 2, 512), k=torch.randn(1, 1, 2, 512),
                                                v=torch.randn(1, 1, 2, 512))),
        BadInput("k_head_dim", lambda: base(k=torch.randn(2, 2, 8, 32))),
        BadInput("batch_mismatch", lambda: base(k=torch.randn(3, 2, 8, 16), v=torch.randn(3, 2, 8, 16))),
        BadInput("heads_not_divisible", lambda: base(k=torch.randn(2, 3, 8, 16), v=torch.randn(2, 3, 8, 16))),
        BadInput("v_shape", lambda: base(v=torch.randn(2, 2, 9, 16))),
        BadInput("k_dtype", lambda: base(k=torch.randn(2, 2, 8, 16, dtype=torch.float64))),
        BadInput("v_device", lambda: base(v=torch.randn(2, 2, 8, 16, device="meta"))),
        BadInput("causal_not_bool", lambda: base(causal="yes")),
        BadInput("negative_scale", lambda: base(scale=-1.0)),
        BadInput("infinite_scale", lambda: base(scale=float("inf"))),
        BadInput("mask_dtype", lambda: base(mask=torch.zeros(2, 1, 8, 8))),
        BadInput("mask_rank", lambda: base(mask=torch.ones(2, 8, 8, dtype=torch.bool))),
        BadInput("mask_shape", lambda: base(mask=torch.ones(2, 1, 8, 9, dtype=torch.bool))),
        BadInput("mask_device", lambda: base(mask=torch.ones(2, 1, 8, 8, dtype=torch.bool, device="meta"))),
    ]


def attention_hidden_pairs_add_nothing(args: Args, upstream: Args) -> dict[str, torch.Tensor]:
    """Attention's gradients (float64) as if the pairs that the causal mask hides were never
    computed: the contract's alternative to the reference's dense products for an inf or NaN met
    only in hidden pairs (`kpt.kernels`, "Special values"), an `AlternativeGradients`.

    The reference (`kpt.kernels.attention`) multiplies every (query, key) pair, so an inf or NaN of
    a hidden key, value or score row reaches other pairs' gradients as ``0 · inf = NaN``; a tiled
    kernel that skips hidden tiles does not. Here nothing of a hidden pair is ever multiplied into
    a sum: p, dp and ds are exactly 0 there (``torch.where``, not a product with 0), and the sums
    over pairs (``ds · k``, ``dsᵀ · q``, ``pᵀ · dO``, ``rowsum(p ⊙ dp)``) add elementwise products
    selected with the mask. Grouped-query heads add into their key/value head as in the reference.
    A query whose visible scores hold NaN or +inf has NaN gradients here too.

    ``args``: the checked arguments of the oracle (q, k, v, ``causal``, ``scale``); ``upstream``:
    ``{"do": dO}``. Its ``[.., Sq, Skv, D]`` products make it for small shapes only (the fuzzing's).
    """
    q, k, v, do = (t.detach().to(torch.float64) for t in (args["q"], args["k"], args["v"], upstream["do"]))
    batch, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    grouped = (batch, hkv, hq // hkv, sq, d)  # query heads by their key/value head
    qg, dog, kg, vg = q.reshape(grouped), do.reshape(grouped), k[:, :, None], v[:, :, None]
    visible = visible_keys(sq, skv, args["causal"], q.device)
    if args.get("mask") is not None:
        visible = visible & args["mask"].reshape(grouped[:-1] + (skv,))
    # q·kᵀ and dO·vᵀ hold one product per pair: a hidden pair's is selected away before any sum
    s = torch.where(visible, (qg @ kg.mT) * args["scale"], -math.inf)
    p = torch.where(visible, probabilities(s), 0.0)
    dp = torch.where(visible, dog @ vg.mT, 0.0)
    delta = torch.where(visible, p * dp, 0.0).sum(-1, keepdim=True)
    ds = torch.where(visible, p * (dp - delta), 0.0)

    def pair_sum(weights: torch.Tensor, rows: torch.Tensor, over: int) -> torch.Tensor:
        # Σ over keys (over=-2: rows of k) or queries (over=-3: rows of q, dO) of weights[i, j] · rows
        rows = rows[..., None, :, :] if over == -2 else rows[..., :, None, :]
        return torch.where(visible[..., None], weights[..., None] * rows, 0.0).sum(over)

    dq = pair_sum(ds, kg, -2) * args["scale"]
    dk = pair_sum(ds, qg, -3).sum(2) * args["scale"]
    dv = pair_sum(p, dog, -3).sum(2)
    return {"q": dq.reshape(q.shape), "k": dk, "v": dv}


def attention_rounded_o(args: Args, upstream: Args, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Attention's `RoundingAllowance`: what FlashAttention's ``rowsum(dO ⊙ o)``, taken from ``o``
    in the inputs' ``dtype``, typically moves dq and dk by (`kpt.tolerance`).

    ``o`` carries the rounding of p before ``p · v`` and its own, up to ``u · (|o| + p · |v|)`` per
    element (u the unit roundoff of ``dtype``); rounding errors of independent signs add in
    quadrature, so query i's row sum errs by about ``ε_i = u · ‖dO_i ⊙ (|o_i| + (p·|v|)_i)‖₂``.
    Every ``ds_ij = p_ij (dp_ij − rowsum_i)`` then moves by ``−p_ij ε_i``: dq_i by
    ``scale · ε_i · (p·k)_i`` (one direction), dk_j by ``scale · Σ_i p_ij ε_i q_i`` (in quadrature
    over i). Where dp_ij and the row sum nearly cancel (two keys of very unequal probability) that
    is far above the tolerance's share of the gradient; elsewhere it is a small part of it. Float64
    from the oracle's arguments (the checked q, k, v, ``causal``, ``scale``) and ``{"do": dO}``."""
    u, scale = torch.finfo(dtype).eps / 2, args["scale"]

    def rounded(q: torch.Tensor, k: torch.Tensor, do: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        batch, hq, sq, d = q.shape
        hkv, skv = k.shape[1], k.shape[2]
        grouped = (batch, hkv, hq // hkv, sq, d)
        v = rest[-1]
        qg, dog, kg, vg = (finite(t) for t in (q.reshape(grouped), do.reshape(grouped), k[:, :, None], v[:, :, None]))
        visible = visible_keys(sq, skv, args["causal"], q.device)
        if len(rest) == 2:  # the mask, sliced with q
            visible = visible & rest[0].reshape(batch, hkv, hq // hkv, sq, skv)
        s = torch.where(visible, (qg @ kg.mT) * scale, -math.inf)
        p = finite(probabilities(s))
        eps = u * torch.linalg.vector_norm(dog * ((p @ vg).abs() + p @ vg.abs()), dim=-1, keepdim=True)
        dq = scale * eps * (p @ kg).abs()
        dk = scale * ((p * eps).square().mT @ qg.square()).sum(2).sqrt()
        return dq.reshape(q.shape), dk

    # by batch entries and key/value heads, as the reference's attention: [.., Sq, Skv] scores in float64
    q, k, v, do = (t.detach().to(torch.float64) for t in (args["q"], args["k"], args["v"], upstream["do"]))
    mask = () if args.get("mask") is None else (args["mask"],)
    dq, dk = by_chunks(rounded, q, k, do, *mask, per_key=(v,))
    return {"q": dq, "k": dk}


def _sharding(a: Args) -> list[Strategy]:
    """Batch or heads sharded (query and key/value heads together, each count a multiple of the
    ranks), and query positions when not causal; a mask shards with q."""
    for mesh_dim, p in enumerate(a["q"].placements):
        n = a["q"].mesh.size(mesh_dim)
        if p.is_shard(1) and (a["q"].shape[1] % n or a["k"].shape[1] % n):
            raise KernelNotSupportedError(
                f"attention: query heads sharded Shard(1) over {n} ranks need query and key/value head "
                f"counts that are multiples of {n}, got {a['q'].shape[1]} and {a['k'].shape[1]}")
    masked = a.get("mask") is not None  # the mask [B, Hq, Sq, Skv]
    qkv = ("q", "k", "v", "mask") if masked else ("q", "k", "v")
    strategies = each_dim((0, 1), ("o", "lse"), qkv)
    if not a["causal"]:  # causal masks align queries to keys by their counts: the shard's would differ
        strategies.append(({"o": 2, "lse": 2}, {"q": 2, **({"mask": 2} if masked else {})}))
    return strategies


ATTENTION = KernelSpec(
    name="attention",
    signature=attention,
    validate=validate_attention,
    forward=attention_fwd,
    backward=attention_bwd,
    outputs=("o",),
    saved=("lse",),
    differentiable=("q", "k", "v"),
    flops=_flops,
    cases=_cases,
    bad_inputs=_bad_inputs,
    sharding=_sharding,
    rounding=attention_rounded_o,
    alternative_gradients=attention_hidden_pairs_add_nothing,
)

SPECS = (ATTENTION,)
