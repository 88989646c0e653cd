"""kpt across devices: DTensor sharding rules for every kernel's ops, and vocabulary-parallel losses.

**Sharding rules.** Every kernel's custom ops (``kpt_<backend>::<kernel>`` and its
``_backward``, see `kpt.ops`) get a DTensor sharding rule, so that a kernel called on DTensors
(tensor or sequence parallelism with ``parallelize_module``) runs on each rank's shard:

* row-wise kernels (norms, softmax, activations, GLUs, rope, fp8 scaling) keep the sharding of
  any dimension they do not reduce over (batch, sequence, heads), with no communication;
* ``linear`` (and ``fp8_linear``, ``grouped_linear``) follow the column-wise plan (weight rows
  sharded, output sharded over features) and the row-wise plan (input features and weight
  columns sharded, output a partial sum; a bias is added once);
* ``attention`` shards over batch and heads (query and key/value heads together, each count a
  multiple of the mesh size), and over query positions when not causal;
* ``cross_entropy`` and ``linear_cross_entropy`` shard over rows for ``reduction="none"`` or
  ``"sum"``; a vocabulary sharded across ranks goes through `cross_entropy` and
  `linear_cross_entropy` of this module.

A rule is written once per kernel, for its forward op (its spec's `kpt.KernelSpec.sharding`); the backward op's rule is
derived from it (a sharded input has a gradient sharded alike, a replicated input used by
sharded work a partial-sum gradient, see `_backward_strategy`). Row statistics that a kernel
saves for its backward (``rstd``, ``mean``) are flattened rows; they are placed ``Shard(0)``
whenever a leading dimension is sharded, which only the kernel's own backward reads. An input
sharded over a dimension no strategy shards raises `KernelNotSupportedError` naming the kernel,
the argument and its placement (DTensor would otherwise gather it without a word). Partial
inputs are reduced by DTensor first, as for any op.

The backward of ``rope`` and ``cross_entropy`` on DTensors needs torch 2.13: their backward ops
do not take a tensor first (q and the logits are not kept), and torch 2.11's DTensor looks for the
device mesh in the first argument only ("Cannot find device mesh from args").

Rules are registered when this module is imported (for every backend whose ops are registered so
far, and for every one registered later), and by `Backend.call` the first time it meets a DTensor, so
``backend.rms_norm(dtensor)`` needs no set-up.

**Vocabulary-parallel cross-entropy.** `cross_entropy` takes logits sharded over the vocabulary
(``Shard(1)``, as a column-wise ``lm_head`` leaves them) and computes the exact loss and its
gradient on each rank's shard with one all-reduce of per-row statistics (each rank's
log-sum-exp, the target logit, the sum of logits); `linear_cross_entropy` does the same from
hidden states and a weight sharded over its vocabulary rows.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.experimental import register_sharding

from .errors import KernelInputError, KernelNotSupportedError
from .kernels import SPECS
from .ops import _OPS, gradient_results
from .spec import PARTIAL, KernelSpec
from .spec import Placement as SpecPlacement

Placements = dict[str, Placement]
Strategy = tuple[Placements, Placements]
"""`kpt.spec.Strategy` in torch's placements (a dimension as ``Shard``, a partial sum as ``Partial``)."""

R = Replicate()


def _placement(p: SpecPlacement) -> Placement:
    if isinstance(p, int):
        return Shard(p)
    if p == PARTIAL:
        return Partial()
    raise ValueError(f"a sharding strategy places a tensor {p!r}; expected a dimension or kpt.spec.PARTIAL")


def forward_strategies(kernel: KernelSpec, args: dict[str, Any]) -> list[Strategy]:
    """The forward strategies of ``kernel`` (its `KernelSpec.sharding`) in torch's placements."""
    return [({n: _placement(p) for n, p in outs.items()}, {n: _placement(p) for n, p in ins.items()})
            for outs, ins in kernel.sharding(args)]


_HINTS = {
    "cross_entropy": "for logits sharded over the vocabulary use kpt.distributed.cross_entropy; "
                     "over rows, reduction 'none' or 'sum'",
    "linear_cross_entropy": "for a weight sharded over the vocabulary use kpt.distributed.linear_cross_entropy; "
                            "over rows, reduction 'none' or 'sum'",
}
"""What a refused placement's error suggests: this module's vocabulary-parallel losses (kept here,
beside the functions they name, rather than on the specs)."""


def _names(spec: KernelSpec) -> list[str]:
    return list(inspect.signature(spec.forward).parameters)


def _dual_gradient(p: Placement, split: bool) -> Placement:
    """The placement of the gradient of a tensor placed ``p``: a sharded tensor's gradient is
    sharded alike; a partial sum's is replicated (each share gets the whole gradient); a
    replicated tensor's is a partial sum when the work using it is split (``split``)."""
    if isinstance(p, Partial):
        return R
    if isinstance(p, Replicate):
        return Partial() if split else R
    return p


def _backward_strategy(spec: KernelSpec, strategy: Strategy) -> Strategy:
    outputs, inputs = strategy
    split = any(not isinstance(p, Replicate) for p in (*outputs.values(), *inputs.values()))
    # the gradient of a partial-sum output reaches every share whole
    grads = {f"grad_{n}": R if isinstance(outputs.get(n, R), Partial) else outputs.get(n, R) for n in spec.outputs}
    b_inputs = {**inputs, **{f"out_{n}": p for n, p in outputs.items()}, **grads}
    b_outputs = {n: _dual_gradient(inputs.get(n, R), split) for n in spec.differentiable}
    return b_outputs, b_inputs


def _check_placements(kernel: str, args: dict[str, Any], strategies: list[Strategy]) -> None:
    """Raise if a sharded input is sharded over a dimension no strategy shards it over."""
    for name, value in args.items():
        if not hasattr(value, "placements"):
            continue
        for p in value.placements:
            if not isinstance(p, Shard):
                continue
            wanted = Shard(p.dim % value.ndim)
            if not any(s[1].get(name) == wanted for s in strategies):
                allowed = sorted({str(s[1][name]) for s in strategies if name in s[1]})
                hint = f"; {_HINTS[kernel]}" if kernel in _HINTS else ""
                raise KernelNotSupportedError(
                    f"{kernel}: argument '{name}' (shape {tuple(value.shape)}) placed {tuple(value.placements)} "
                    f"cannot be sharded over dimension {wanted.dim} here; shardings of '{name}' it supports: "
                    f"{', '.join(allowed) or 'none (replicate it)'}{hint}")


def _placement_lists(strategies: list[Strategy], outputs: list[str], inputs: list[str],
                     args: dict[str, Any]) -> list[tuple[list[Placement | None], list[Placement | None]]]:
    """DTensor's form: one placement per output, one per argument (None where not a tensor)."""
    tensor = [hasattr(args[n], "placements") for n in inputs]
    every = [({}, {}), *strategies]
    return [([outs.get(n, R) for n in outputs], [ins.get(n, R) if t else None for n, t in zip(inputs, tensor)])
            for outs, ins in every]


def _register_kernel(op: Any, spec: KernelSpec, backward: bool) -> None:
    names = _names(spec)
    fwd_outputs = list(spec.outputs + spec.saved)
    if backward:
        inputs = names + [f"out_{n}" for n in fwd_outputs] + [f"grad_{n}" for n in spec.outputs]
        # one result per differentiable input, except where ``spec.grads`` shares one: the first
        # input that takes a result names it
        taken = gradient_results(spec)
        outputs = [spec.differentiable[taken.index(i)] for i in range(max(taken) + 1)]
    else:
        inputs, outputs = names, fwd_outputs

    def sharding(*values: Any) -> list[tuple[list[Placement | None], list[Placement | None]]]:
        args = dict(zip(inputs, values))
        strategies = forward_strategies(spec, {n: args[n] for n in names})
        if backward:
            strategies = [_backward_strategy(spec, s) for s in strategies]
        _check_placements(spec.name + ("_backward" if backward else ""), args, strategies)
        return _placement_lists(strategies, outputs, inputs, args)

    register_sharding(op)(sharding)
    # register_sharding keys its cache on arguments from the first int only; every non-tensor
    # argument can change the rule here (``reduction``, ``granularity``, ``activation``)
    first = next((i for i, a in enumerate(op._schema.arguments) if not _is_tensor(a.type)), len(inputs))
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.op_to_schema_info[op] = RuntimeSchemaInfo(static_argnum=first, needs_pytree=True)


def _is_tensor(t: Any) -> bool:
    return isinstance(t, torch.TensorType) or (isinstance(t, torch.OptionalType) and _is_tensor(t.getElementType()))


_REGISTERED: set[str] = set()


def register_rules(namespace: str) -> None:
    """Register the sharding rules of every kernel's ops in ``namespace`` (once)."""
    if namespace in _REGISTERED:
        return
    ops = getattr(torch.ops, namespace)
    for name, spec in SPECS.items():
        _register_kernel(getattr(ops, name).default, spec, backward=False)
        if spec.differentiable:
            _register_kernel(getattr(ops, f"{name}_backward").default, spec, backward=True)
    _REGISTERED.add(namespace)


for _namespace in list(_OPS):  # the op namespaces registered before this import; `kpt.ops` registers later ones
    register_rules(_namespace)


def replicated(value: Any, mesh: Any) -> Any:
    """``value`` as a replicated DTensor on ``mesh`` if it is a plain tensor (every rank holds the
    whole of it); anything else as it is."""
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
        return DTensor.from_local(value, mesh, [R] * mesh.ndim, run_check=False)
    return value


# -- vocabulary-parallel cross-entropy -------------------------------------------------------


def _vocab_sharded(name: str, t: Any, dim: int) -> tuple[Any, int]:
    """``t``'s mesh and the mesh dimension that shards ``dim`` (every other mesh dim replicates)."""
    if not isinstance(t, DTensor):
        raise KernelInputError(f"{name} must be a DTensor sharded over the vocabulary, got {type(t).__name__}")
    sharded = [i for i, p in enumerate(t.placements) if p == Shard(dim) or p == Shard(dim - t.ndim)]
    others = [p for i, p in enumerate(t.placements) if i not in sharded]
    if len(sharded) != 1 or any(not isinstance(p, Replicate) for p in others):
        raise KernelNotSupportedError(
            f"{name} placed {tuple(t.placements)}: vocabulary-parallel cross-entropy needs Shard({dim}) on "
            "one mesh dimension and Replicate on the others")
    return t.device_mesh, sharded[0]


def _replicated_local(name: str, t: Any) -> torch.Tensor:
    if isinstance(t, DTensor):
        if any(not isinstance(p, Replicate) for p in t.placements):
            raise KernelNotSupportedError(f"{name} placed {tuple(t.placements)}: it must be replicated")
        return t.to_local()
    return t


class _VocabParallelLoss(torch.autograd.Function):
    """Cross-entropy of logits whose columns ``[start, start + V_local)`` of ``vocab`` live on this
    rank; gradients are computed in the forward (they need the global statistics) and scaled in
    the backward."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, start: int, vocab: int, group: Any,
                ignore_index: int, smoothing: float, reduction: str) -> torch.Tensor:
        x = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
        n, v_local = x.shape
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        local = (target >= start) & (target < start + v_local)
        t_local = torch.where(local, target - start, 0)
        stats = x.new_zeros(n, world + 2)
        stats[:, rank] = torch.logsumexp(x, 1) if v_local else -math.inf
        stats[:, world] = torch.where(local, x.gather(1, t_local[:, None])[:, 0], 0)
        stats[:, world + 1] = x.sum(1)
        dist.all_reduce(stats, group=group)  # each rank's column: its log-sum-exp; the rest: sums
        lse = torch.logsumexp(stats[:, :world], 1)
        ignored = target == ignore_index
        out_of_range = ~ignored & ((target < 0) | (target >= vocab))
        loss = (1 - smoothing) * (lse - stats[:, world]) + smoothing * (lse - stats[:, world + 1] / vocab)
        loss = torch.where(ignored, 0, torch.where(out_of_range, math.nan, loss))
        grad = torch.exp(x - lse[:, None]) - smoothing / vocab
        grad[local.nonzero()[:, 0], t_local[local]] -= 1 - smoothing
        grad[ignored] = 0
        if reduction == "mean":
            count = (~ignored).sum().clamp(min=1)
            loss, grad = loss.sum() / count, grad / count
        elif reduction == "sum":
            loss = loss.sum()
        ctx.save_for_backward(grad)
        ctx.dtype, ctx.per_row = logits.dtype, reduction == "none"
        return loss  # float32 (float64 for float64 logits), as the contract's cross_entropy

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[Any, ...]:
        (grad,) = ctx.saved_tensors
        scale = grad_loss[:, None] if ctx.per_row else grad_loss
        return (grad * scale).to(ctx.dtype), None, None, None, None, None, None, None


def _check_loss_args(kernel: str, n: int, target: torch.Tensor, smoothing: float, reduction: str) -> None:
    if target.dtype != torch.int64 or target.shape != (n,):
        raise KernelInputError(f"{kernel}: argument 'target' must be int64 of shape ({n},), "
                               f"got {target.dtype} {tuple(target.shape)}")
    if reduction not in ("mean", "sum", "none"):
        raise KernelInputError(f"{kernel}: argument 'reduction' is {reduction!r}; expected one of "
                               "['mean', 'sum', 'none']")
    if not 0 <= smoothing <= 1:
        raise KernelInputError(f"{kernel}: argument 'label_smoothing' is {smoothing!r}; expected a number in [0, 1]")


def cross_entropy(logits: DTensor, target: torch.Tensor, ignore_index: int = -100, label_smoothing: float = 0.0,
                  reduction: str = "mean") -> DTensor:
    """`kpt` ``cross_entropy`` of ``[N, V]`` logits sharded over the vocabulary (``Shard(1)``).

    Exact (the contract's loss and gradient, float32 statistics, float64 for float64) with one
    all-reduce of ``[N, world + 2]`` row statistics in the forward and no communication in the
    backward. ``target``: int64 ``[N]``, a plain tensor or a replicated DTensor. Returns the loss
    as a replicated DTensor (a scalar, ``[N]`` for ``"none"``).
    """
    mesh, mesh_dim = _vocab_sharded("cross_entropy: logits", logits, 1)
    target = _replicated_local("cross_entropy: target", target)
    _check_loss_args("cross_entropy", logits.shape[0], target, label_smoothing, reduction)
    _, (_, start) = compute_local_shape_and_global_offset(logits.shape, mesh, logits.placements)
    loss = _VocabParallelLoss.apply(logits.to_local(), target, start, logits.shape[1], mesh.get_group(mesh_dim),
                                    ignore_index, label_smoothing, reduction)
    return DTensor.from_local(loss, mesh, [R] * mesh.ndim, run_check=False)


class _HiddenGradReduced(torch.autograd.Function):
    """Identity forward; all-reduces the gradient (hidden states used by every vocabulary shard)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def linear_cross_entropy(hidden: torch.Tensor, weight: DTensor, target: torch.Tensor, bias: DTensor | None = None,
                         ignore_index: int = -100, reduction: str = "mean") -> DTensor:
    """`kpt` ``linear_cross_entropy`` with ``weight`` ``[V, K]`` (and ``bias`` ``[V]``) sharded over
    the vocabulary (``Shard(0)``, a column-wise ``lm_head``).

    Each rank computes its logits ``hidden @ weight_shard.T`` (``[N, V / world]``, float32
    accumulation) and the loss as `cross_entropy`; the gradient of the replicated ``hidden`` is
    all-reduced in the backward (a partial-sum DTensor where ``hidden`` is a DTensor).
    ``hidden``: ``[N, K]``, a plain tensor (identical on every rank) or a replicated DTensor.
    """
    mesh, mesh_dim = _vocab_sharded("linear_cross_entropy: weight", weight, 0)
    group = mesh.get_group(mesh_dim)
    target = _replicated_local("linear_cross_entropy: target", target)
    if isinstance(hidden, DTensor):
        _replicated_local("linear_cross_entropy: hidden", hidden)
        h = hidden.to_local(grad_placements=[Partial()] * hidden.device_mesh.ndim)
    else:
        h = _HiddenGradReduced.apply(hidden, group)
    if h.dim() != 2 or h.shape[1] != weight.shape[1]:
        raise KernelInputError(f"linear_cross_entropy: argument 'hidden' has shape {tuple(h.shape)}; "
                               f"expected (N, {weight.shape[1]})")
    _check_loss_args("linear_cross_entropy", h.shape[0], target, 0.0, reduction)
    _, (start, _) = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)
    compute = torch.float64 if h.dtype == torch.float64 else torch.float32
    logits = h.to(compute) @ weight.to_local().to(compute).T
    if bias is not None:
        _vocab_sharded("linear_cross_entropy: bias", bias, 0)
        logits = logits + bias.to_local().to(compute)
    loss = _VocabParallelLoss.apply(logits, target, start, weight.shape[0], group, ignore_index, 0.0, reduction)
    return DTensor.from_local(loss, mesh, [R] * mesh.ndim, run_check=False)
