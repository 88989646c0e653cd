"""Numerically stable softmax along one dimension: ``softmax``.

    m = max(x, dim)
    y = exp(x − m) / Σ_dim exp(x − m)

Subtracting the maximum keeps every exponent ≤ 0 (no overflow) and the largest term equal to 1
(the sum never underflows to 0). Backward:
    dx = y · (dy − Σ_dim dy · y)
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..spec import (
    Args,
    BadInput,
    Case,
    Check,
    KernelSpec,
    Strategy,
    compute_dtype,
    each_dim,
    finite,
    identity,
    neighbors,
    randn,
    row_cases,
)


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """Softmax along ``dim``, like ``F.softmax(x, dim)``, numerically stable (max-subtracted).

    ``y = exp(x − max(x, dim)) / Σ_dim exp(x − max(x, dim))`` computed in float32 (float64 for
    float64). ``x``: any shape with at least one dimension; ``dim`` in ``[-x.dim(), x.dim())``
    (core passes it to kernel bodies normalized to ``[0, x.dim())``). Returns ``y`` like x.
    Differentiable with respect to ``x``.
    """
    raise AssertionError("signature only: call backend.softmax")


def validate_softmax(a: Args, dtypes: tuple[torch.dtype, ...]) -> Args:
    c = Check("softmax", dtypes)
    x = c.tensor("x", a["x"], min_ndim=1)
    dim = c.number("dim", a["dim"], low=-x.dim(), high=x.dim() - 1, integer=True)
    return {"x": x, "dim": dim % x.dim()}


def softmax_fwd(x: Tensor, dim: int) -> tuple[Tensor]:
    """Returns ``(y,)``."""
    if x.shape[dim] == 0:
        # the maximum of an empty dimension is undefined; the result is empty anyway
        return (torch.empty(x.shape, dtype=x.dtype, device=x.device),)
    xc = x.to(compute_dtype(x.dtype))
    e = torch.exp(xc - xc.amax(dim, keepdim=True))
    return ((e / e.sum(dim, keepdim=True)).to(x.dtype).contiguous(),)


def softmax_bwd(x: Tensor, dim: int, y: Tensor, dy: Tensor) -> tuple[Tensor]:
    """Returns ``(dx,)``, from the saved output ``y``."""
    ct = compute_dtype(x.dtype)
    yc, dyc = y.to(ct), dy.to(ct)
    dx = yc * (dyc - (dyc * yc).sum(dim, keepdim=True))
    return (dx.to(x.dtype).contiguous(),)


def _flops(a: Args) -> float:
    # max, subtract, exp, sum, divide
    return 5.0 * a["x"].numel()


def _make(g: torch.Generator, dtype: torch.dtype, *, shape: tuple[int, ...], scale: float = 1.0,
          layout=identity, dim: int = -1, offset: float = 0.0, masked: int = 0) -> Args:
    """``masked``: the first elements of every row are −inf (a masked head)."""
    x = (randn(g, *shape, dtype=torch.float64, scale=scale) + offset).to(dtype)
    x[..., :masked] = -float("inf")
    return {"x": layout(x), "dim": dim}



def _cases() -> list[Case]:
    def case(name: str, grad: bool = True, eager_factor: float = 0.0, dtypes=None, **kw) -> Case:
        return Case(name, lambda g, dtype: _make(g, dtype, **kw), grad=grad, eager_factor=eager_factor,
                    dtypes=dtypes)

    return row_cases(_make, (16384, 8192), extreme=False) + [
        # |x| up to 5e4: exp(x) overflows without the max subtraction. Forward only: every row is
        # saturated, so the gradient (of the size of the runner-up probabilities) lies below
        # float16's smallest subnormal and no float16 result can carry it
        case("huge", shape=(8, 2048), scale=1e4, grad=False),
        # large logits with an O(1) spread at the top: overflow-prone and a well-conditioned gradient
        case("shifted", shape=(8, 2048), scale=10.0, offset=1e4),
        # inputs x1000: near one-hot rows whose gradient y·(dy − Σ dy·y) cancels where y → 1, so
        # float32 (PyTorch eager included) errs by up to 100% of it: judged against eager too. In
        # float32 only: a 16-bit y rounds the cancellation differently from eager's float32 one
        case("sharp", shape=(8, 256), scale=1e3, eager_factor=4.0, dtypes=(torch.float32,)),
        case("tiny", shape=(8, 2048), scale=1e-4),
        # rows longer than a kernel holds at once, whose first 33000 elements are −inf: whole
        # leading chunks of a chunked row add nothing to its running sum (not exp(−inf + inf) = NaN)
        case("masked_head", shape=(3, 40000), masked=33000),
        # rows wider than a program's tile whose width is not a multiple of 16 (an odd vocabulary):
        # nine rows start at every offset within a 16-byte vector, so a kernel that reads them in
        # aligned vectors handles each row's own head and tail
        case("odd_width", shape=(9, 4099)),
        # a softmax over a vocabulary: more rows than GPUs have multiprocessors, each 50257 wide,
        # where a kernel holds long rows on chip (kpt-cuda's). 16M elements: real devices only
        Case("vocabulary", lambda g, dtype: _make(g, dtype, shape=(320, 50257)), large=True),
        case("dim0", shape=(257, 33), dim=0),
        case("middle_dim", shape=(4, 129, 16), dim=1),
        case("negative_dim", shape=(3, 100, 5), dim=-2),
        # a dense transposed view: the softmax dimension is not the innermost one in memory
        case("transposed", shape=(100, 64), layout=torch.t),
        case("zero_size_dim", shape=(4, 0, 8), dim=1),
    ]


def _bad_inputs() -> list[BadInput]:
    base = {"x": torch.randn(4, 8), "dim": -1}
    return [
        BadInput("int_x", lambda: {**base, "x": torch.ones(4, 8, dtype=torch.int64)}),
        BadInput("scalar_x", lambda: {**base, "x": torch.tensor(1.0)}),
        BadInput("not_a_tensor", lambda: {**base, "x": [[1.0, 2.0]]}),
        BadInput("dim_too_large", lambda: {**base, "dim": 2}),
        BadInput("dim_too_negative", lambda: {**base, "dim": -3}),
        BadInput("dim_float", lambda: {**base, "dim": 1.0}),
        BadInput("dim_bool", lambda: {**base, "dim": True}),
    ]


def softmax_rounded_y(args: Args, upstream: Args, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """softmax's `RoundingAllowance`: what taking ``dx = y · (dy − Σ_dim dy · y)`` from the saved
    output ``y`` in the inputs' ``dtype`` (either neighbour of the exact probability: GPUs round to
    nearest, Triton's interpreter truncates), which the oracle holds exact, moves dx by.

    With ``|ŷ_j − y_j| ≤ δ_j``, the step of ``dtype`` at ``y_j``, ``dx_i`` moves by at most
    ``δ_i · |dy_i − Σ_j y_j dy_j| + (y_i + δ_i) · Σ_j δ_j |dy_j|``. The rounded probabilities of a
    short row need not sum to 1: where ``dy_i`` nearly equals the row's ``Σ_j y_j dy_j`` (two
    probabilities far apart) that is far above the tolerance's share of dx; elsewhere it is about
    one step of ``dtype`` relative to dx."""
    dim = args["dim"]
    y = finite(torch.softmax(args["x"].detach().to(torch.float64), dim))
    dy = finite(upstream["dy"].detach().to(torch.float64).to(y.device))
    below, above = neighbors(y, dtype)
    step = above - below
    dot = (y * dy).sum(dim, keepdim=True)
    return {"x": step * (dy - dot).abs() + (y + step) * (step * dy.abs()).sum(dim, keepdim=True)}


def _sharding(a: Args) -> list[Strategy]:
    """Any dimension but the one normalized over sharded."""
    dim = a["dim"] % a["x"].ndim
    return each_dim([d for d in range(a["x"].ndim) if d != dim], ("y",), ("x",))


SOFTMAX = KernelSpec(
    name="softmax",
    signature=softmax,
    validate=validate_softmax,
    forward=softmax_fwd,
    backward=softmax_bwd,
    outputs=("y",),
    differentiable=("x",),
    flops=_flops,
    cases=_cases,
    bad_inputs=_bad_inputs,
    sharding=_sharding,
    memory_bound=True,
    rounding=softmax_rounded_y,
    peers=("liger", "flag_gems"),
)

SPECS = (SOFTMAX,)
