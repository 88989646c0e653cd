"""The kernel methods of every backend (``backend.rms_norm(x, weight)``...): one per kernel of
the contract, with its signature, types and docstring. Each validates the call against the
kernel's spec and runs it on the backend (`kpt.Backend.call`).

Generated from ``kpt.SPECS`` by ``python -m kpt.codegen``: do not edit.
"""

from __future__ import annotations

import abc
from typing import Any, Optional

import torch
from torch import Tensor


class KernelMethods(abc.ABC):
    """The kernel methods of `kpt.Backend`."""

    @abc.abstractmethod
    def call(self, kernel: str, *args: Any, **kwargs: Any) -> Any:
        """Validate a call of ``kernel`` against its spec and run it on this backend."""

    def rms_norm(self, x: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-06) -> Tensor:
        """Root-mean-square normalization over the last dimension.

        ``y = x * rsqrt(mean(x², -1) + eps) * weight``; statistics in float32 (float64 for float64).
        ``x``: ``[..., D]``; ``weight``: ``[D]``, ``x.dtype`` or float32, or None. Returns ``y`` like x.
        Differentiable with respect to ``x`` and ``weight``.
        """
        return self.call("rms_norm", x, weight, eps)

    def add_rms_norm(
        self,
        x: Tensor,
        residual: Tensor,
        weight: Optional[Tensor] = None,
        eps: float = 1e-06,
    ) -> tuple[Tensor, Tensor]:
        """Residual add fused with RMS normalization.

        ``h = x + residual`` (rounded to ``x.dtype``), ``y = rms_norm(h, weight, eps)``.
        Returns ``(y, h)``. Differentiable with respect to ``x``, ``residual`` and ``weight``.
        """
        return self.call("add_rms_norm", x, residual, weight, eps)

    def layer_norm(
        self,
        x: Tensor,
        weight: Tensor | None = None,
        bias: Tensor | None = None,
        eps: float = 1e-05,
    ) -> Tensor:
        """Layer normalization over the last dimension, like ``F.layer_norm(x, (D,), weight, bias, eps)``.

        ``y = (x − mean(x, -1)) * rsqrt(var(x, -1) + eps) * weight + bias`` with the biased variance;
        statistics in float32 (float64 for float64). ``x``: ``[..., D]``; ``weight`` and ``bias``:
        ``[D]``, each ``x.dtype`` or float32, or None. Returns ``y`` like x.
        Differentiable with respect to ``x``, ``weight`` and ``bias``.
        """
        return self.call("layer_norm", x, weight, bias, eps)

    def softmax(self, x: Tensor, dim: int = -1) -> Tensor:
        """Softmax along ``dim``, like ``F.softmax(x, dim)``, numerically stable (max-subtracted).

        ``y = exp(x − max(x, dim)) / Σ_dim exp(x − max(x, dim))`` computed in float32 (float64 for
        float64). ``x``: any shape with at least one dimension; ``dim`` in ``[-x.dim(), x.dim())``
        (core passes it to kernel bodies normalized to ``[0, x.dim())``). Returns ``y`` like x.
        Differentiable with respect to ``x``.
        """
        return self.call("softmax", x, dim)

    def gelu(self, x: Tensor, approximate: str = 'none') -> Tensor:
        """Gaussian error linear unit, like ``F.gelu(x, approximate=approximate)``.

        ``approximate="none"``: ``x · Φ(x)`` with the exact normal CDF (erf);
        ``approximate="tanh"``: ``½ x (1 + tanh(√(2/π) (x + 0.044715 x³)))``.
        ``x``: any shape with at least one dimension. Returns ``y`` like x.
        Differentiable with respect to ``x``.
        """
        return self.call("gelu", x, approximate)

    def silu(self, x: Tensor) -> Tensor:
        """Sigmoid linear unit (swish), like ``F.silu(x)``: ``x · sigmoid(x)``.

        ``x``: any shape with at least one dimension. Returns ``y`` like x.
        Differentiable with respect to ``x``.
        """
        return self.call("silu", x)

    def swiglu(self, gate: Tensor, up: Tensor) -> Tensor:
        """SwiGLU gating of a gated MLP (Llama): ``silu(gate) · up``.

        ``gate`` and ``up``: the same shape (at least one dimension), dtype and device.
        Returns ``y`` like gate. Differentiable with respect to ``gate`` and ``up``.
        """
        return self.call("swiglu", gate, up)

    def geglu(self, gate: Tensor, up: Tensor, approximate: str = 'tanh') -> Tensor:
        """GeGLU gating of a gated MLP (Gemma): ``gelu(gate, approximate) · up``.

        ``gate`` and ``up``: the same shape (at least one dimension), dtype and device;
        ``approximate``: ``"tanh"`` (the default, as Gemma uses) or ``"none"``, as for `gelu`.
        Returns ``y`` like gate. Differentiable with respect to ``gate`` and ``up``.
        """
        return self.call("geglu", gate, up, approximate)

    def rope(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Rotary position embedding of queries and keys (rotate-half convention).

        ``out = t * cos + rotate_half(t) * sin`` for ``t`` in ``(q, k)``, with
        ``rotate_half([t₁, t₂]) = [−t₂, t₁]`` over the halves of the last dimension; computed in
        float32 (float64 for float64). ``q``: ``[B, Hq, S, D]``; ``k``: ``[B, Hk, S, D]`` (any number
        of heads); D even; ``cos`` and ``sin``: ``[S, D]`` (shared by the batch) or ``[B, S, D]``
        (per sequence), one shape for both. All four share a dtype and device.
        Returns ``(q_out, k_out)`` like q and k. Differentiable with respect to ``q`` and ``k``.
        """
        return self.call("rope", q, k, cos, sin)

    def attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool = False,
        scale: Optional[float] = None,
        mask: Optional[Tensor] = None,
    ) -> Tensor:
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
        return self.call("attention", q, k, v, causal, scale, mask)

    def linear(
        self,
        x: Tensor,
        weight: Tensor,
        bias: Optional[Tensor] = None,
        activation: Optional[str] = None,
    ) -> Tensor:
        """``act(x @ weight.T + bias)``, the activation fused in the epilogue.

        ``x``: ``[..., K]`` float; ``weight``: ``[N, K]``, x's dtype; ``bias``: ``[N]``, x's dtype or
        float32, or None; ``activation``: None, ``"relu"``, ``"gelu"`` (erf), ``"gelu_tanh"`` or
        ``"silu"``. Accumulation in float32 (float64 for float64). Returns ``y``: ``[..., N]`` in x's
        dtype. Differentiable with respect to ``x``, ``weight`` and ``bias``.
        """
        return self.call("linear", x, weight, bias, activation)

    def cross_entropy(
        self,
        logits: Tensor,
        target: Tensor,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        reduction: str = 'mean',
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
        return self.call("cross_entropy", logits, target, ignore_index, label_smoothing, reduction)

    def linear_cross_entropy(
        self,
        hidden: Tensor,
        weight: Tensor,
        target: Tensor,
        bias: Optional[Tensor] = None,
        ignore_index: int = -100,
        reduction: str = 'mean',
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
        return self.call("linear_cross_entropy", hidden, weight, target, bias, ignore_index, reduction)

    def moe_gating(self, logits: Tensor, k: int, renormalize: bool = True) -> tuple[Tensor, Tensor]:
        """Top-k expert routing.

        ``p = softmax(logits, -1)`` in float32; the k experts with the largest logits (larger first;
        equal logits: lower expert index first) give ``indices`` and ``weights = p[indices]``,
        divided by their sum when ``renormalize``. Ranking by logit is ranking by probability
        except where probabilities round to equal values, which the logit order still separates.
        ``logits``: ``[T, E]``; ``1 <= k <= E``. Returns ``(weights, indices)``: weights float32
        ``[T, k]`` (float64 for float64 logits), indices int32 ``[T, k]``.
        Differentiable with respect to ``logits`` (through ``weights``).
        """
        return self.call("moe_gating", logits, k, renormalize)

    def moe_dispatch(self, x: Tensor, indices: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
        """Permute token rows into expert order.

        Every token row is repeated once per slot and the ``T·k`` copies are grouped by expert,
        stably (within an expert, in order of ``t·k + slot``). ``x``: ``[T, H]``; ``indices``:
        int32 ``[T, k]`` with values in ``[0, num_experts)`` (checked in checked mode; unchecked, a
        pair out of range goes to no expert and sorts after the last expert's rows). Returns
        ``(x_sorted [T·k, H], offsets int32 [E+1], order int32 [T·k])`` where expert e owns rows
        ``offsets[e]:offsets[e+1]`` and ``order[r] = t·k + slot`` of sorted row r.
        Differentiable with respect to ``x``.
        """
        return self.call("moe_dispatch", x, indices, num_experts)

    def grouped_linear(self, x_sorted: Tensor, offsets: Tensor, weight: Tensor) -> Tensor:
        """One matmul per expert over its contiguous block of rows.

        ``y[r] = x_sorted[r] @ weight[e].T`` for ``offsets[e] <= r < offsets[e+1]``, float32
        accumulation. ``x_sorted``: ``[M, K]``; ``offsets``: int32 ``[E+1]``, non-decreasing, in
        ``[0, M]`` (checked in checked mode; unchecked, read as clamped to ``[0, M]`` and made
        non-decreasing); rows outside ``[offsets[0], offsets[E])`` give 0; ``weight``: ``[E, N, K]``, dtype of x_sorted.
        Returns ``y [M, N]`` in x_sorted's dtype. Differentiable with respect to ``x_sorted`` and
        ``weight``.
        """
        return self.call("grouped_linear", x_sorted, offsets, weight)

    def moe_combine(self, y_sorted: Tensor, order: Tensor, weights: Tensor) -> Tensor:
        """Un-permute expert outputs and sum each token's k slots, weighted.

        ``y[t] = Σ_slot weights[t, slot] · y_sorted[r]`` where ``order[r] = t·k + slot``; float32
        accumulation. ``y_sorted``: ``[T·k, H]``; ``order``: int32 ``[T·k]``, a permutation (as
        `moe_dispatch` returns; checked in checked mode; unchecked, a value out of range is ignored, a
        pair no row names gives 0 and a pair named twice takes the later row); ``weights``:
        ``[T, k]``, float32 or y_sorted's dtype. Returns ``y [T, H]`` in y_sorted's dtype.
        Differentiable with respect to ``y_sorted`` and ``weights``.
        """
        return self.call("moe_combine", y_sorted, order, weights)

    def quantize_fp8(
        self,
        x: Tensor,
        granularity: str = 'tensor',
        fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    ) -> tuple[Tensor, Tensor]:
        """Scale ``x`` into the float8 range and round it.

        ``scale = amax(|x|) / fp8_max`` (per tensor or per row; 1 where amax is 0) and
        ``xq = saturate(x / scale)`` rounded to nearest even. ``x``: ``[..., D]``, float;
        ``granularity``: ``"tensor"`` or ``"row"``; ``fp8_dtype``: ``torch.float8_e4m3fn`` or
        ``torch.float8_e5m2``. Returns ``(xq, scale)``: xq like x in ``fp8_dtype``, scale float32
        (float64 for float64 x) of shape ``[]`` (tensor) or ``x.shape[:-1] + (1,)`` (row).
        Not differentiable.
        """
        return self.call("quantize_fp8", x, granularity, fp8_dtype)

    def dequantize_fp8(self, xq: Tensor, scale: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
        """``y = xq · scale``, computed in float32 (float64 for float64) and rounded to ``dtype``.

        ``xq``: ``[..., D]`` float8 (e4m3fn or e5m2); ``scale``: float32, shape ``[]`` or
        ``xq.shape[:-1] + (1,)``; ``dtype``: a float dtype of the backend. Returns ``y`` like xq in
        ``dtype``. Not differentiable.
        """
        return self.call("dequantize_fp8", xq, scale, dtype)

    def fp8_linear(
        self,
        xq: Tensor,
        x_scale: Tensor,
        wq: Tensor,
        w_scale: Tensor,
        bias: Optional[Tensor] = None,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> Tensor:
        """Scaled float8 matmul: ``y = (xq · x_scale) @ (wq · w_scale).T + bias``, float32 accumulation.

        ``xq``: ``[..., K]`` float8; ``x_scale``: float32, ``[]`` or ``xq.shape[:-1] + (1,)``;
        ``wq``: ``[N, K]`` float8 (either float8 dtype, independently of xq); ``w_scale``: float32,
        ``[]`` or ``[N, 1]``; ``bias``: ``[N]`` in ``out_dtype`` or float32, or None; ``out_dtype``:
        a float dtype of the backend. Returns ``y [..., N]`` in ``out_dtype``. Not differentiable.
        """
        return self.call("fp8_linear", xq, x_scale, wq, w_scale, bias, out_dtype)
