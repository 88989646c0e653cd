"""`kpt.nn`: ``torch.nn`` layers whose math runs on kpt's kernels.

Each layer asks `kpt.backend_for` for the backend of its input's device at every call: a model
on ``cuda`` runs the cuda backend, the same model on the CPU the reference backend, and
``with kpt.use_backend("fpga-sim"):`` pins one. Parameters, buffers and ``state_dict`` keys are
those of the modules they replace, so a checkpoint loads unchanged:

| layer | replaces | parameters |
|---|---|---|
| `RMSNorm` | ``torch.nn.RMSNorm``, ``LlamaRMSNorm`` (``unit_offset=True``: ``GemmaRMSNorm``) | ``weight`` |
| `LayerNorm` | ``torch.nn.LayerNorm`` over the last dimension | ``weight``, ``bias`` |
| `GatedMLP` | ``LlamaMLP`` (silu: SwiGLU), ``GemmaMLP`` (gelu_tanh: GeGLU) | ``{gate,up,down}_proj`` |
| `RotaryEmbedding` | ``LlamaRotaryEmbedding`` with ``apply_rotary_pos_emb`` | ``inv_freq`` (not saved) |
| `Attention` | ``LlamaAttention`` (grouped-query, causal, a `KVCache`) | ``{q,k,v,o}_proj`` |
| `LinearCrossEntropyLoss` | ``lm_head`` followed by ``nn.CrossEntropyLoss`` | none (the head's weight is an argument) |
| `MoE` | ``MixtralSparseMoeBlock`` | ``gate.weight``, ``experts.gate_up_proj``, ``experts.down_proj`` |
| `FP8Linear` | ``torch.nn.Linear`` for inference | ``weight``, ``bias`` |
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .backend import Backend
from .errors import KernelInputError, KernelNotSupportedError
from .ops import as_tuple
from .registry import backend_for

ACTIVATIONS = {"silu": "swiglu", "gelu_tanh": "geglu"}
"""A gated MLP's activation -> the kpt kernel that fuses it with the product by ``up``."""
_ACTIVATION_ARGS = {"silu": (), "gelu_tanh": ("tanh",)}
"""What that kernel takes after ``gate`` and ``up``: geglu's approximation."""


_RESOLVED: dict[str, Backend] = {}
"""The backend each device last resolved to in an eager call: what a traced call reads."""


def backend(t: Tensor) -> Backend:
    """The backend for ``t``'s device (`kpt.backend_for`). Under ``torch.compile`` the one that
    device's last eager call resolved (the compiler cannot trace the lookup: `use_backend`'s
    context variable, the registry's lock), so a model run once, or patched by `kpt.patch`,
    compiles with ``fullgraph=True``."""
    key = str(t.device)
    if torch.compiler.is_compiling() and key in _RESOLVED:
        return _RESOLVED[key]
    found = _RESOLVED[key] = backend_for(t.device)
    return found


def _autocast(*tensors: Tensor) -> list[Tensor]:
    """``tensors`` as autocast would give them to a matrix product (``F.linear``): in its 16-bit
    dtype where it is on for their device (mixed precision: the Trainer's ``bf16=True``), else as
    they are. kpt's kernels take what they are given (autocast stops at `kpt.Backend.call`), so the
    layers built on products cast their operands here, and a float32 model under autocast runs its
    loss head and experts in 16 bits as transformers' layers do."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return list(tensors)
    dtype = torch.get_autocast_dtype(device)
    return [t.to(dtype) for t in tensors]


def _width(layer: str, x: Any, size: int) -> None:
    """A norm layer's input ends in the layer's size: the error names the input, not the weight."""
    if isinstance(x, Tensor) and (x.dim() == 0 or x.shape[-1] != size):
        raise KernelInputError(f"kpt.nn.{layer}({size}): input has shape {tuple(x.shape)}; expected [..., {size}]")


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x², -1) + eps) * weight`` (``* (1 + weight)`` with ``unit_offset``, as
    Gemma's; its weight then starts at 0). Statistics in float32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, unit_offset: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        init = torch.zeros if unit_offset else torch.ones
        self.weight = nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: Tensor) -> Tensor:
        _width("RMSNorm", x, self.weight.shape[0])
        # the offset weight in float32, as Gemma adds it (a float32 weight is within the contract)
        weight = 1.0 + self.weight.float() if self.unit_offset else self.weight
        return backend(x).rms_norm(x, weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}" + (", unit_offset=True" if self.unit_offset else "")


class LayerNorm(nn.Module):
    """``torch.nn.LayerNorm`` over the last dimension (one ``normalized_shape``)."""

    def __init__(self, normalized_shape: int | tuple[int], eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if len(shape) != 1:
            raise KernelNotSupportedError(f"kpt.nn.LayerNorm normalizes the last dimension only; got "
                                          f"normalized_shape={shape}")
        self.normalized_shape = shape
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(shape, device=device, dtype=dtype)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(shape, device=device, dtype=dtype)) if elementwise_affine and bias \
            else None

    def forward(self, x: Tensor) -> Tensor:
        _width("LayerNorm", x, self.normalized_shape[0])
        return backend(x).layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.weight is not None}"


class GatedMLP(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``: SwiGLU for ``activation="silu"``, GeGLU
    (tanh gelu) for ``"gelu_tanh"``; the gate and the product are one kpt kernel.

    With ``recompute`` (the default), training keeps ``gate`` and ``up`` for the backward but not
    their product, the input of ``down_proj``: the backward runs the kernel again to get it. That
    product is a ``[tokens, intermediate]`` tensor in every layer, so the activations held for the
    backward shrink by about a sixth of a Llama block's, for one elementwise pass per layer. The
    product and ``down_proj`` are one custom op (``kpt_nn::gated_down``), so ``torch.compile`` keeps
    this choice too (its partitioner keeps a product that a matrix product of the backward reads). It
    applies where ``down_proj`` is a plain ``nn.Linear`` (no hooks, no replaced ``forward``, as an
    adapter or an offloading wrapper would set); otherwise, without gradients and under autocast,
    the layer calls ``down_proj`` as it is (`_linear_in_op`).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu", bias: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 recompute: bool = True) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise KernelNotSupportedError(f"kpt.nn.GatedMLP: activation {activation!r} has no fused kernel; "
                                          f"expected one of {', '.join(ACTIVATIONS)}")
        kw: dict[str, Any] = {"bias": bias, "device": device, "dtype": dtype}
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)
        self.activation = activation
        self.recompute = recompute

    @classmethod
    def from_linears(cls, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear,
                     activation: str) -> GatedMLP:
        """A GatedMLP over existing projections (shared, not copied): how `kpt.patch` swaps one in."""
        mlp = cls(1, 1, activation, device="meta")
        mlp.gate_proj, mlp.up_proj, mlp.down_proj = gate_proj, up_proj, down_proj
        return mlp

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        down = self.down_proj
        if self.recompute and _linear_in_op(down, gate):
            return torch.ops.kpt_nn.gated_down(gate, up, down.weight, down.bias, self.activation)
        return down(_product(gate, up, self.activation))

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}" + ("" if self.recompute else ", recompute=False")


def plain_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` as torch defines it: no subclass, no hooks, no ``forward`` set on it (an
    adapter or an offloading wrapper), so that its math can run inside another function."""
    return (type(module) is nn.Linear and not module._forward_hooks and not module._forward_pre_hooks
            and "forward" not in module.__dict__)


def _linear_in_op(module: nn.Module, x: Tensor) -> bool:
    """Whether ``module``'s product with ``x`` may run inside one of kpt's custom ops, which keep
    less for the backward (`GatedMLP`, `project_heads`): gradients wanted, no autocast on ``x``'s
    device (the mixed precision of the Trainer's ``bf16=True``: its casts do not reach an op's
    backward, where a 16-bit gradient would meet the float32 weight), and a `plain_linear` module."""
    return torch.is_grad_enabled() and not torch.is_autocast_enabled(x.device.type) and plain_linear(module)


def project_heads(o_proj: nn.Module, out: Tensor) -> Tensor:
    """``o_proj`` of attention's output ``out [B, H, S, D]`` with the heads side by side per token.

    That layout is a copy of ``out``, which the attention already keeps for its backward: under
    autograd, a plain ``nn.Linear`` keeps ``out`` only and the backward copies it again
    (``kpt_nn::heads_projection``, a custom op, so that ``torch.compile`` keeps that choice too), so
    a layer holds one ``[B, S, H·D]`` activation less. Otherwise (`_linear_in_op`) ``o_proj`` is
    called as it is."""
    if _linear_in_op(o_proj, out):
        return torch.ops.kpt_nn.heads_projection(out, o_proj.weight, o_proj.bias)
    b, _, s, _ = out.shape
    return o_proj(out.transpose(1, 2).reshape(b, s, -1))


# The two products above as custom ops with their own autograd: eager and compiled, the backward
# keeps what they save (a compiled graph's partitioner would otherwise keep the copy and the product
# that the backward's matrix products read). A gradient not wanted (a frozen weight, as under an
# adapter; an absent bias) is not computed and comes back empty.

def _side_by_side(out: Tensor) -> Tensor:
    b, h, s, d = out.shape
    return out.transpose(1, 2).reshape(b * s, h * d)


@torch.library.custom_op("kpt_nn::heads_projection", mutates_args=())
def _heads_projection(out: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    b, _, s, _ = out.shape
    return nn.functional.linear(_side_by_side(out), weight, bias).view(b, s, -1)


@_heads_projection.register_fake
def _(out: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return out.new_empty((out.shape[0], out.shape[2], weight.shape[0]))


@torch.library.custom_op("kpt_nn::heads_projection_backward", mutates_args=())
def _heads_projection_backward(dy: Tensor, out: Tensor, weight: Tensor, weight_grad: bool, bias_grad: bool
                               ) -> tuple[Tensor, Tensor, Tensor]:
    """``(dout [B, S, H, D], dweight, dbias)``: the caller turns dout's heads back."""
    b, h, s, d = out.shape
    rows = dy.reshape(-1, dy.shape[-1])
    dweight = rows.t().mm(_side_by_side(out)) if weight_grad else rows.new_empty(0)
    dbias = rows.sum(0) if bias_grad else rows.new_empty(0)
    return rows.mm(weight).view(b, s, h, d), dweight, dbias


@_heads_projection_backward.register_fake
def _(dy: Tensor, out: Tensor, weight: Tensor, weight_grad: bool, bias_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    b, h, s, d = out.shape
    return (out.new_empty((b, s, h, d)), weight.new_empty(weight.shape if weight_grad else 0),
            dy.new_empty(weight.shape[0] if bias_grad else 0))


def _heads_projection_save(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    out, weight, bias = inputs
    ctx.save_for_backward(out, weight)
    ctx.has_bias = bias is not None


def _heads_projection_grad(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
    out, weight = ctx.saved_tensors
    wanted = ctx.needs_input_grad
    bias_grad = ctx.has_bias and wanted[2]
    dout, dweight, dbias = torch.ops.kpt_nn.heads_projection_backward(dy, out, weight, wanted[1], bias_grad)
    return dout.transpose(1, 2), dweight if wanted[1] else None, dbias if bias_grad else None


_heads_projection.register_autograd(_heads_projection_grad, setup_context=_heads_projection_save)


def _product(gate: Tensor, up: Tensor, activation: str) -> Tensor:
    """``act(gate) * up``: the backend's fused kernel for ``activation`` (`ACTIVATIONS`)."""
    return getattr(backend(gate), ACTIVATIONS[activation])(gate, up, *_ACTIVATION_ARGS[activation])


@torch.library.custom_op("kpt_nn::gated_down", mutates_args=())
def _gated_down(gate: Tensor, up: Tensor, weight: Tensor, bias: Tensor | None, activation: str) -> Tensor:
    with torch.no_grad():
        return nn.functional.linear(_product(gate, up, activation), weight, bias)


@_gated_down.register_fake
def _(gate: Tensor, up: Tensor, weight: Tensor, bias: Tensor | None, activation: str) -> Tensor:
    return gate.new_empty((*gate.shape[:-1], weight.shape[0]))


@torch.library.custom_op("kpt_nn::gated_down_backward", mutates_args=())
def _gated_down_backward(dout: Tensor, gate: Tensor, up: Tensor, weight: Tensor, activation: str,
                         weight_grad: bool, bias_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dgate, dup, dweight, dbias)``, the product computed again. The activation's forward and
    backward bodies are called directly (`Backend.bodies`; the forward's call checked these tensors),
    not through autograd: 60 µs of host time a call where that took 146 (reference backend, CPU,
    4 x 48), which a compiled training step of a small model spends in every layer."""
    body = backend(gate).bodies(ACTIVATIONS[activation])
    assert body.backward is not None, "the gated activations are differentiable"
    extra = _ACTIVATION_ARGS[activation]
    product = as_tuple(body.forward(gate, up, *extra))[0]
    rows = dout.reshape(-1, dout.shape[-1])
    dweight = rows.t().mm(product.reshape(-1, product.shape[-1])) if weight_grad else rows.new_empty(0)
    dbias = rows.sum(0) if bias_grad else rows.new_empty(0)
    dgate, dup = body.backward(gate, up, *extra, product, dout.matmul(weight))
    return dgate.contiguous(), dup.contiguous(), dweight, dbias


@_gated_down_backward.register_fake
def _(dout: Tensor, gate: Tensor, up: Tensor, weight: Tensor, activation: str, weight_grad: bool, bias_grad: bool
      ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return (gate.new_empty(gate.shape), up.new_empty(up.shape), weight.new_empty(weight.shape if weight_grad else 0),
            dout.new_empty(weight.shape[0] if bias_grad else 0))


def _gated_down_save(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    gate, up, weight, bias, activation = inputs
    ctx.save_for_backward(gate, up, weight)
    ctx.has_bias, ctx.activation = bias is not None, activation


def _gated_down_grad(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
    gate, up, weight = ctx.saved_tensors
    wanted = ctx.needs_input_grad
    bias_grad = ctx.has_bias and wanted[3]
    dgate, dup, dweight, dbias = torch.ops.kpt_nn.gated_down_backward(dout, gate, up, weight, ctx.activation,
                                                                      wanted[2], bias_grad)
    return dgate, dup, dweight if wanted[2] else None, dbias if bias_grad else None, None


_gated_down.register_autograd(_gated_down_grad, setup_context=_gated_down_save)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, rotate-half convention: angles ``position · base^(-2i/D)``.
    ``cos_sin(positions)`` gives the tables (as ``LlamaRotaryEmbedding`` does);
    ``forward(q, k, positions)`` rotates q ``[B, Hq, S, D]`` and k ``[B, Hk, S, D]``."""

    inv_freq: Tensor

    def __init__(self, head_dim: int, base: float = 10000.0, device: torch.device | str | None = None) -> None:
        super().__init__()
        if head_dim % 2:
            raise KernelInputError(f"kpt.nn.RotaryEmbedding: head_dim {head_dim} must be even")
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
        self.register_buffer("inv_freq", 1.0 / base**exponents, persistent=False)

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``(cos, sin)`` of shape ``positions.shape + (D,)`` in ``dtype``, computed in float32."""
        angles = positions.float()[..., None] * self.inv_freq.float()
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = self.cos_sin(positions, q.dtype)
        return backend(q).rope(q, k, cos, sin)


@dataclass
class KVCache:
    """Keys and values of earlier calls, per layer: `Attention` appends to it and attends over all
    of it (decoding one token at a time, or a prompt in chunks)."""

    keys: dict[int, Tensor] = field(default_factory=dict)
    values: dict[int, Tensor] = field(default_factory=dict)

    def length(self, layer: int) -> int:
        return self.keys[layer].shape[2] if layer in self.keys else 0

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``k``/``v`` ``[B, Hkv, S, D]`` to the layer's and return everything it holds."""
        if layer in self.keys:
            k = torch.cat((self.keys[layer], k), dim=2)
            v = torch.cat((self.values[layer], v), dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


class Attention(nn.Module):
    """Multi-head self-attention with grouped-query heads (``num_heads % num_kv_heads == 0``),
    rotary positions and an optional `KVCache`; causal by default (a query sees the keys up to
    its own position, counting the cached ones). The projections are named as in Llama."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int | None = None,
                 head_dim: int | None = None, bias: bool = False, rope_base: float = 10000.0,
                 causal: bool = True, layer: int = 0, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        if num_heads % self.num_kv_heads:
            raise KernelInputError(f"kpt.nn.Attention: num_heads {num_heads} is not a multiple of "
                                   f"num_kv_heads {self.num_kv_heads}")
        self.head_dim = head_dim or hidden_size // num_heads
        self.causal = causal
        self.layer = layer
        kw: dict[str, Any] = {"bias": bias, "device": device, "dtype": dtype}
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, **kw)
        self.k_proj = nn.Linear(hidden_size, self.num_kv_heads * self.head_dim, **kw)
        self.v_proj = nn.Linear(hidden_size, self.num_kv_heads * self.head_dim, **kw)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, **kw)
        self.rotary = RotaryEmbedding(self.head_dim, rope_base, device=device)

    def forward(self, x: Tensor, positions: Tensor | None = None, cache: KVCache | None = None) -> Tensor:
        """``x``: ``[B, S, hidden]``; ``positions``: ``[S]`` or ``[B, S]`` (default: after what
        ``cache`` holds). Returns ``[B, S, hidden]``."""
        batch, seq, _ = x.shape
        if positions is None:
            start = cache.length(self.layer) if cache is not None else 0
            positions = torch.arange(start, start + seq, device=x.device)

        def heads(t: Tensor) -> Tensor:
            return t.view(batch, seq, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        q, k = self.rotary(q, k, positions)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
        out = backend(q).attention(q, k, v, self.causal, self.head_dim**-0.5)
        return project_heads(self.o_proj, out)


class LinearCrossEntropyLoss(nn.Module):
    """``cross_entropy(hidden @ weight.T + bias, target)`` without holding the ``[N, V]`` logits:
    call it with the last hidden states and the language-model head's weight."""

    def __init__(self, ignore_index: int = -100, reduction: str = "mean") -> None:
        super().__init__()
        self.ignore_index = ignore_index
        self.reduction = reduction

    def forward(self, hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None) -> Tensor:
        """``hidden``: ``[..., K]``; ``weight``: ``[V, K]``; ``target``: ``hidden.shape[:-1]``, int64.
        Under autocast the product takes its 16-bit dtype (`_autocast`); the loss is float32."""
        hidden, weight, *rest = _autocast(hidden, weight, *([] if bias is None else [bias]))
        bias = rest[0] if rest else None
        return backend(hidden).linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1), bias, self.ignore_index,
            self.reduction)


def route(x: Tensor, weight: Tensor, k: int, renormalize: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Router of a mixture of experts: ``(logits [T, E], weights [T, k] float32, indices [T, k]
    int32)`` for tokens ``x`` ``[T, H]`` and the router's ``weight`` ``[E, H]``."""
    logits = x @ weight.T
    weights, indices = backend(logits).moe_gating(logits, k, renormalize)
    return logits, weights, indices


def run_experts(x: Tensor, indices: Tensor, weights: Tensor, gate_up_proj: Tensor, down_proj: Tensor,
                activation: str) -> Tensor:
    """Gated-MLP experts: each token through its k experts, summed by its routing weights.
    ``x`` ``[T, H]``; ``gate_up_proj`` ``[E, 2I, H]`` (gate rows, then up rows); ``down_proj``
    ``[E, H, I]``. Dispatch, two grouped GEMMs around the fused activation, and combine (under
    autocast in its 16-bit dtype: `_autocast`)."""
    x, gate_up_proj, down_proj = _autocast(x, gate_up_proj, down_proj)
    be = backend(x)
    x_sorted, offsets, order = be.moe_dispatch(x, indices.to(torch.int32), gate_up_proj.shape[0])
    gate, up = be.grouped_linear(x_sorted, offsets, gate_up_proj).chunk(2, dim=-1)
    product = getattr(be, ACTIVATIONS[activation])(gate, up, *_ACTIVATION_ARGS[activation])
    y_sorted = be.grouped_linear(product, offsets, down_proj)
    return be.moe_combine(y_sorted, order, weights)


class Router(nn.Module):
    """Top-k softmax router: ``weight`` ``[E, H]``; returns what `route` returns."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=hidden_size**-0.5)
        self.top_k = top_k
        self.renormalize = renormalize

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return route(x, self.weight, self.top_k, self.renormalize)


class Experts(nn.Module):
    """Gated-MLP experts stored as 3-D tensors, as in Mixtral and Qwen-MoE (`run_experts`)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, activation: str = "silu",
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise KernelNotSupportedError(f"kpt.nn.Experts: activation {activation!r} has no fused kernel; "
                                          f"expected one of {', '.join(ACTIVATIONS)}")
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, **kw))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, **kw))
        nn.init.normal_(self.gate_up_proj, std=hidden_size**-0.5)
        nn.init.normal_(self.down_proj, std=intermediate_size**-0.5)
        self.activation = activation

    def forward(self, x: Tensor, indices: Tensor, weights: Tensor) -> Tensor:
        return run_experts(x, indices, weights, self.gate_up_proj, self.down_proj, self.activation)


class MoE(nn.Module):
    """Sparse mixture-of-experts block: `Router` (``gate``) then `Experts` (``experts``);
    ``x`` ``[..., H]`` -> ``[..., H]``. The router's logits of the last call are kept in
    ``router_logits`` (for an auxiliary load-balancing loss)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool = True, activation: str = "silu", device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.gate = Router(hidden_size, num_experts, top_k, renormalize, device=device, dtype=dtype)
        self.experts = Experts(hidden_size, intermediate_size, num_experts, activation, device=device, dtype=dtype)
        self.router_logits: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        self.router_logits, weights, indices = self.gate(tokens)
        return self.experts(tokens, indices, weights).reshape(x.shape)


class FP8Linear(nn.Module):
    """``torch.nn.Linear`` computed in float8 for inference: the input quantized per row, the
    weight per output row (``float8_e4m3fn``), scaled matmul with float32 accumulation, output in
    the input's dtype. Not differentiable: a call that needs a gradient raises
    `kpt.KernelNotSupportedError` (train in bf16, then load the weights here)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        bound = 1 / math.sqrt(in_features)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, self.weight, self.bias)):
            raise KernelNotSupportedError("kpt.nn.FP8Linear is for inference (fp8_linear has no backward): call it "
                                          "under torch.no_grad() or torch.inference_mode()")
        be = backend(x)
        xq, x_scale = be.quantize_fp8(x, "row")
        wq, w_scale = be.quantize_fp8(self.weight, "row")
        return be.fp8_linear(xq, x_scale, wq, w_scale, self.bias, x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
