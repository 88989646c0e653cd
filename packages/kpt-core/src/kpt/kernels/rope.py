"""Rotary position embedding, rotate-half convention (Llama, GPT-NeoX): ``rope``.

With t = [t₁, t₂] split into halves along the head dimension D:
    rotate_half(t) = [−t₂, t₁]
    rope(t)        = t · cos + rotate_half(t) · sin

applied to q and to k with the same cos/sin tables. For tables built from angles θ with
cos = [cos θ, cos θ] and sin = [sin θ, sin θ] this rotates each pair (t₁ᵢ, t₂ᵢ) by θᵢ; the
kernel uses the full tables as given and does not assume that their halves are equal.

rotate_half is a linear map R with Rᵀ = −R, so the backward is
    dt = dout · cos − rotate_half(dout · sin)
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..spec import Args, BadInput, Case, Check, KernelSpec, Placement, Strategy, compute_dtype, randn, strided


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotary position embedding of queries and keys (rotate-half convention).

    ``out = t * cos + rotate_half(t) * sin`` for ``t`` in ``(q, k)``, with
    ``rotate_half([t₁, t₂]) = [−t₂, t₁]`` over the halves of the last dimension; computed in
    float32 (float64 for float64). ``q``: ``[B, Hq, S, D]``; ``k``: ``[B, Hk, S, D]`` (any number
    of heads); D even; ``cos`` and ``sin``: ``[S, D]`` (shared by the batch) or ``[B, S, D]``
    (per sequence), one shape for both. All four share a dtype and device.
    Returns ``(q_out, k_out)`` like q and k. Differentiable with respect to ``q`` and ``k``.
    """
    raise AssertionError("signature only: call backend.rope")


def validate_rope(a: Args, dtypes: tuple[torch.dtype, ...]) -> Args:
    c = Check("rope", dtypes)
    q = c.tensor("q", a["q"], ndim=4)
    k = c.tensor("k", a["k"], ndim=4)
    c.same_dtype("k", k, q, "q")
    c.same_device("k", k, q)
    batch, _, seq, dim = q.shape
    if dim % 2:
        raise c.fail("q", f"has head dimension {dim}; expected an even number (shape {tuple(q.shape)})")
    c.shape("k", k, (batch, k.shape[1], seq, dim))
    cos = c.tensor("cos", a["cos"])
    if cos.dim() not in (2, 3):
        raise c.fail("cos", f"must be [S, D] or [B, S, D], got shape {tuple(cos.shape)}")
    c.shape("cos", cos, (seq, dim) if cos.dim() == 2 else (batch, seq, dim))
    c.same_dtype("cos", cos, q, "q")
    c.same_device("cos", cos, q)
    sin = c.tensor("sin", a["sin"])
    c.shape("sin", sin, cos.shape)
    c.same_dtype("sin", sin, q, "q")
    c.same_device("sin", sin, q)
    return a


def _rotate_half(t: Tensor) -> Tensor:
    half = t.shape[-1] // 2
    return torch.cat((-t[..., half:], t[..., :half]), dim=-1)


def _tables(cos: Tensor, sin: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin in the compute dtype, broadcastable against ``[B, H, S, D]``."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    ct = compute_dtype(dtype)
    return cos.to(ct), sin.to(ct)


def _rotate(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    tc = t.to(cos.dtype)
    # contiguous: a transposed q ([B, S, H, D] storage) would otherwise give a transposed output
    return (tc * cos + _rotate_half(tc) * sin).to(t.dtype).contiguous()


def _rotate_backward(t: Tensor, dout: Tensor | None, cos: Tensor, sin: Tensor) -> Tensor:
    if dout is None:
        return torch.zeros(t.shape, dtype=t.dtype, device=t.device)
    d = dout.to(cos.dtype)
    return (d * cos - _rotate_half(d * sin)).to(t.dtype).contiguous()


def rope_fwd(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Returns ``(q_out, k_out)``."""
    c, s = _tables(cos, sin, q.dtype)
    return _rotate(q, c, s), _rotate(k, c, s)


def rope_bwd(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor,
    q_out: Tensor, k_out: Tensor, dq_out: Tensor | None, dk_out: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """Returns ``(dq, dk)``; a missing output gradient counts as zero. ``q`` and ``k`` are not saved
    for the backward (it is a rotation by -θ): they come as None, ``q_out``/``k_out`` give the shapes."""
    c, s = _tables(cos, sin, q_out.dtype)
    return _rotate_backward(q_out, dq_out, c, s), _rotate_backward(k_out, dk_out, c, s)


def _flops(a: Args) -> float:
    # two multiplies and an add per output element
    return 3.0 * (a["q"].numel() + a["k"].numel())


def _rope_tables(positions: Tensor, dim: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The Llama tables (base 10000) for integer ``positions`` of any shape: ``[..., dim]``, equal halves."""
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = positions.to(torch.float64)[..., None] * inv_freq
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _make(g: torch.Generator, dtype: torch.dtype, *, b: int, hq: int, hk: int, s: int, d: int,
          per_sequence: bool = False, transposed: bool = False, strided_tables: bool = False,
          general_tables: bool = False) -> Args:
    def heads(h: int) -> Tensor:
        if transposed:
            # the usual layout after the QKV projection: [B, S, H, D] storage viewed as [B, H, S, D]
            return randn(g, b, s, h, d, dtype=dtype).transpose(1, 2)
        return randn(g, b, h, s, d, dtype=dtype)

    q, k = heads(hq), heads(hk)
    table_shape = (b, s) if per_sequence else (s,)
    if general_tables:
        cos, sin = randn(g, *table_shape, d, dtype=dtype), randn(g, *table_shape, d, dtype=dtype)
    else:
        # a random starting position per sequence (a KV cache of random length)
        start = torch.randint(0, 8192, (b, 1) if per_sequence else (1,), generator=g)
        cos, sin = _rope_tables(start + torch.arange(s), d, dtype)
    if strided_tables:
        cos, sin = strided(cos), strided(sin)
    return {"q": q, "k": k, "cos": cos, "sin": sin}


def _cases() -> list[Case]:
    def case(name: str, perf: bool = False, **kw) -> Case:
        return Case(name, lambda g, dtype: _make(g, dtype, **kw), perf=perf)

    return [
        case("llama_gqa", b=2, hq=8, hk=2, s=128, d=128),
        case("per_sequence", b=3, hq=4, hk=4, s=33, d=64, per_sequence=True),
        case("decode", b=4, hq=32, hk=8, s=1, d=128, per_sequence=True),
        case("odd", b=1, hq=3, hk=1, s=17, d=80),
        case("single", b=1, hq=1, hk=1, s=1, d=2),
        case("long_seq", b=1, hq=2, hk=1, s=1000, d=64),
        case("transposed", b=2, hq=4, hk=2, s=64, d=128, transposed=True, strided_tables=True),
        case("general_tables", b=2, hq=3, hk=2, s=17, d=64, general_tables=True),
        case("general_tables_per_sequence", b=2, hq=2, hk=1, s=9, d=32, per_sequence=True,
             general_tables=True),
        case("zero_seq", b=2, hq=4, hk=2, s=0, d=64),
        case("zero_batch", b=0, hq=4, hk=2, s=8, d=64),
        case("perf", b=8, hq=32, hk=8, s=4096, d=128, perf=True),
    ]


def _bad_inputs() -> list[BadInput]:
    def base(**kw) -> Args:
        args = {"q": torch.randn(2, 4, 8, 16), "k": torch.randn(2, 2, 8, 16), "cos": torch.randn(8, 16),
                    "sin": torch.randn(8, 16)}
        return {**args, **kw}

    return [
        BadInput("int_q", lambda: base(q=torch.ones(2, 4, 8, 16, dtype=torch.int64))),
        BadInput("not_a_tensor", lambda: base(q=[[1.0, 2.0]])),
        BadInput("q_rank", lambda: base(q=torch.randn(4, 8, 16))),
        BadInput("k_rank", lambda: base(k=torch.randn(2, 2, 8, 16, 1))),
        BadInput("odd_head_dim", lambda: base(q=torch.randn(2, 4, 8, 15), k=torch.randn(2, 2, 8, 15),
                                              cos=torch.randn(8, 15), sin=torch.randn(8, 15))),
        BadInput("k_head_dim", lambda: base(k=torch.randn(2, 2, 8, 32))),
        BadInput("k_seq", lambda: base(k=torch.randn(2, 2, 9, 16))),
        BadInput("k_batch", lambda: base(k=torch.randn(1, 2, 8, 16))),
        BadInput("k_dtype", lambda: base(k=torch.randn(2, 2, 8, 16, dtype=torch.float64))),
        BadInput("k_device", lambda: base(k=torch.randn(2, 2, 8, 16, device="meta"))),
        BadInput("cos_rank", lambda: base(cos=torch.randn(16), sin=torch.randn(16))),
        BadInput("cos_seq", lambda: base(cos=torch.randn(9, 16), sin=torch.randn(9, 16))),
        BadInput("cos_batch", lambda: base(cos=torch.randn(3, 8, 16), sin=torch.randn(3, 8, 16))),
        BadInput("cos_dtype", lambda: base(cos=torch.randn(8, 16, dtype=torch.float64))),
        BadInput("cos_device", lambda: base(cos=torch.randn(8, 16, device="meta"))),
        BadInput("sin_shape", lambda: base(sin=torch.randn(2, 8, 16))),
        BadInput("sin_dtype", lambda: base(sin=torch.randn(8, 16, dtype=torch.float16))),
        BadInput("int_sin", lambda: base(sin=torch.ones(8, 16, dtype=torch.int64))),
    ]


def _sharding(a: Args) -> list[Strategy]:
    """Batch, heads or sequence sharded; cos and sin go with the batch when per sequence
    (``[B, S, D]``) and always with the sequence."""
    per_sequence = a["cos"].ndim == 3
    tables = ("cos", "sin")
    batch: dict[str, Placement] = {"q": 0, "k": 0, **({t: 0 for t in tables} if per_sequence else {})}
    heads: dict[str, Placement] = {"q": 1, "k": 1}
    seq: dict[str, Placement] = {"q": 2, "k": 2, **{t: a["cos"].ndim - 2 for t in tables}}
    return [({"q_out": p["q"], "k_out": p["k"]}, p) for p in (batch, heads, seq)]


ROPE = KernelSpec(
    name="rope",
    signature=rope,
    validate=validate_rope,
    forward=rope_fwd,
    backward=rope_bwd,
    outputs=("q_out", "k_out"),
    differentiable=("q", "k"),
    unsaved=("q", "k"),
    flops=_flops,
    cases=_cases,
    bad_inputs=_bad_inputs,
    sharding=_sharding,
    memory_bound=True,
    peers=("liger",),
)

SPECS = (ROPE,)
