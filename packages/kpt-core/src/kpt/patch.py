"""`kpt.patch`: run a loaded Hugging Face ``transformers`` causal LM on kpt's kernels.

    model = transformers.AutoModelForCausalLM.from_pretrained(name)
    print(kpt.patch(model))          # what was swapped, what was left and why
    kpt.unpatch(model)               # back to the model as loaded

In place, on this model only (not on its class nor on other models of its family): its RMSNorms
become `kpt.nn.RMSNorm` (Gemma's with the ``1 + weight`` offset), its gated MLPs `kpt.nn.GatedMLP`
(SwiGLU, or GeGLU with tanh gelu), and rotary embedding with attention, the MoE router and
experts, and the language-model loss run kpt's kernels in their modules' ``forward``. Parameters
are shared, not copied: ``state_dict``, optimizers and checkpoints see the same tensors.

Only what kpt's contract computes exactly is swapped; the rest is left, with the reason, in
the returned `PatchSummary`: attention with logit soft-capping or dropout, or whose masks are
built for an implementation other than ``sdpa``; a loss after logit soft-capping or with the
router's auxiliary loss. At run time a patched attention takes causal (or, for a bidirectional
module, unmasked) attention with any KV cache; a call with an explicit mask (padding, or a
sliding window shorter than the sequence) raises `kpt.KernelNotSupportedError`, never a silent
other computation. ``kpt.patch(model, attention=False)`` keeps transformers' attention (and its
masks) around kpt's rope: for padded batches. With labels, a patched model returns the loss of the fused
``linear_cross_entropy`` and no logits (they are never formed); call it without labels for
logits. An architecture kpt does not know raises before anything changes, and a failure while
patching undoes what was done.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from . import nn as knn
from .errors import KernelInputError, KernelNotSupportedError

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "mixtral", "qwen2_moe",
             "qwen3_moe")
"""The ``config.model_type`` values `patch` knows (their modules are checked, not assumed)."""
UNIT_OFFSET_NORMS = ("gemma", "gemma2", "gemma3_text")
"""Families whose RMSNorm multiplies by ``1 + weight``."""
ACTIVATION_OF = {"SiLUActivation": "silu", "SiLU": "silu", "GELUTanh": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh"}
"""transformers' activation modules -> the `kpt.nn.ACTIVATIONS` key that fuses them."""


@dataclass
class PatchSummary:
    """What `patch` did: ``swapped`` counts modules per kind; ``left`` gives, per kind, the count
    and the reason it was left as it was."""

    model_type: str
    swapped: dict[str, int] = field(default_factory=dict)
    left: dict[str, tuple[int, str]] = field(default_factory=dict)

    def table(self) -> str:
        rows = [f"kpt.patch({self.model_type}):"]
        rows += [f"  swapped  {n:3d} x {kind}" for kind, n in self.swapped.items()]
        rows += [f"  left     {n:3d} x {kind}: {why}" for kind, (n, why) in self.left.items()]
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()


@dataclass
class _Plan:
    """The changes to make, each a function that applies one and returns its undo."""

    summary: PatchSummary
    steps: list[Callable[[], Callable[[], None]]] = field(default_factory=list)

    def swap(self, kind: str, step: Callable[[], Callable[[], None]]) -> None:
        self.summary.swapped[kind] = self.summary.swapped.get(kind, 0) + 1
        self.steps.append(step)

    def leave(self, kind: str, why: str) -> None:
        n, _ = self.summary.left.get(kind, (0, why))
        self.summary.left[kind] = (n + 1, why)


def _replace(parent: nn.Module, attr: str, new: nn.Module) -> Callable[[], Callable[[], None]]:
    def apply() -> Callable[[], None]:
        old = getattr(parent, attr)
        setattr(parent, attr, new)
        return lambda: setattr(parent, attr, old)

    return apply


def _override(module: nn.Module, forward: Callable[..., Any]) -> Callable[[], Callable[[], None]]:
    def apply() -> Callable[[], None]:
        module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]
        return lambda: module.__dict__.pop("forward", None)  # the class's forward again

    return apply


def _norm(module: Any, unit_offset: bool) -> nn.Module:
    eps: Any = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    norm = knn.RMSNorm(module.weight.shape[0], float(eps), unit_offset, device="meta")
    norm.weight = module.weight
    return norm


def _attention_forward(self: Any, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor],
                       attention_mask: Tensor | None = None, past_key_values: Any = None,
                       **kwargs: Any) -> tuple[Tensor, Any]:
    """A transformers attention module's forward on kpt: projections, optional q/k norms, kpt's
    rope, cache update, kpt's attention (causal as the module is), output projection."""
    if attention_mask is not None:
        raise KernelNotSupportedError(
            f"kpt.patch: attention layer {self.layer_idx} was given an explicit mask (padding, or a sliding "
            "window shorter than the sequence), which kpt's attention kernel does not take; pass unpadded "
            "batches, or patch with kpt.patch(model, attention=False) (kpt's rope, transformers' attention)")
    q, k, v, shape = _rotated(self, hidden_states, position_embeddings, past_key_values)
    out = knn.backend(q).attention(q, k, v, getattr(self, "is_causal", True), self.scaling)
    return knn.project_heads(self.o_proj, out), None


def _rotary_forward(self: Any, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor],
                    attention_mask: Tensor | None = None, past_key_values: Any = None,
                    **kwargs: Any) -> tuple[Tensor, Any]:
    """As `_attention_forward` with the attention of the model's ``attn_implementation`` (masks,
    padding and sliding windows as transformers handles them): kpt's rope only."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    q, k, v, shape = _rotated(self, hidden_states, position_embeddings, past_key_values)
    eager = sys.modules[type(self).__module__].eager_attention_forward  # what the module itself falls back to
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager)
    # a layer's own window (Qwen2, Gemma 3: None on full-attention layers), else the model's (Mistral)
    window = getattr(self, "sliding_window", getattr(self.config, "sliding_window", None))
    out, weights = attend(self, q, k, v, attention_mask, dropout=self.attention_dropout if self.training else 0.0,
                          scaling=self.scaling, sliding_window=window, **kwargs)
    return self.o_proj(out.reshape(*shape, -1).contiguous()), weights


def _rotated(self: Any, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor],
             past_key_values: Any) -> tuple[Tensor, Tensor, Tensor, tuple[int, ...]]:
    """``(q, k, v, leading shape)``: the projections as ``[B, H, S, D]``, q and k normalized
    where the module has q/k norms and rotated by kpt's rope, k and v after the cache update."""
    shape = tuple(hidden_states.shape[:-1])
    heads = (*shape, -1, self.head_dim)
    q = self.q_proj(hidden_states).view(heads)
    k = self.k_proj(hidden_states).view(heads)
    v = self.v_proj(hidden_states).view(heads).transpose(1, 2)
    if hasattr(self, "q_norm"):
        q, k = self.q_norm(q), self.k_norm(k)
    cos, sin = position_embeddings
    if cos.dim() == 3 and cos.shape[0] == 1:  # one table for the batch: kpt's [S, D] form
        cos, sin = cos[0], sin[0]
    q, k = knn.backend(q).rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    if past_key_values is not None:
        k, v = past_key_values.update(k, v, self.layer_idx)
    return q, k, v, shape


def _router_forward(self: Any, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return knn.route(hidden_states.reshape(-1, self.hidden_dim), self.weight, self.top_k,
                     getattr(self, "norm_topk_prob", True))


def _experts_forward(self: Any, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    return knn.run_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                           ACTIVATION_OF[type(self.act_fn).__name__])


def _loss_forward(self: Any, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                  position_ids: Tensor | None = None, past_key_values: Any = None,
                  inputs_embeds: Tensor | None = None, labels: Tensor | None = None, use_cache: bool | None = None,
                  logits_to_keep: int | Tensor = 0, **kwargs: Any) -> Any:
    """A ``*ForCausalLM`` forward whose loss is kpt's ``linear_cross_entropy`` on the shifted labels
    (as transformers' ``ForCausalLMLoss``, ``num_items_in_batch`` included); without labels, the
    model's own forward."""
    if labels is None:
        return type(self).forward(self, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds,
                                  labels, use_cache, logits_to_keep, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    num_items = kwargs.pop("num_items_in_batch", None)
    shift_labels = kwargs.pop("shift_labels", None)
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
    hidden = outputs.last_hidden_state
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    head = self.get_output_embeddings()
    loss = knn.LinearCrossEntropyLoss(reduction="mean" if num_items is None else "sum")(
        hidden, head.weight, shift_labels.to(hidden.device), head.bias).float()
    if num_items is not None:
        loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
    return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                                  hidden_states=outputs.hidden_states, attentions=outputs.attentions)


def _plan(model: Any, attention: bool, loss: bool) -> _Plan:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        raise KernelNotSupportedError(
            f"kpt.patch does not know {type(model).__name__} (model_type {model_type!r}); it patches the "
            f"families {', '.join(SUPPORTED)}. Nothing was changed.")
    plan = _Plan(PatchSummary(model_type))
    unit_offset = model_type in UNIT_OFFSET_NORMS
    for name, module in model.named_modules():
        parent_name, _, attr = name.rpartition(".")
        parent: Any = model.get_submodule(parent_name) if name else None
        kind = type(module).__name__
        if kind.endswith("RMSNorm") and parent is not None:
            plan.swap("RMSNorm -> kpt.nn.RMSNorm" + (" (1 + weight)" if unit_offset else ""),
                      _replace(parent, attr, _norm(module, unit_offset)))
        elif kind.endswith("MLP") and all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj")):
            act = ACTIVATION_OF.get(type(getattr(module, "act_fn", None)).__name__)
            if act is None:
                plan.leave(f"{kind}", f"activation {type(module.act_fn).__name__} has no fused gated kernel")
            else:
                mlp = knn.GatedMLP.from_linears(module.gate_proj, module.up_proj, module.down_proj, act)
                plan.swap(f"{kind} -> kpt.nn.GatedMLP ({knn.ACTIVATIONS[act]})", _replace(parent, attr, mlp))
        elif kind.endswith("Attention") and hasattr(module, "q_proj"):
            if getattr(module, "attn_logit_softcapping", None) is not None:
                plan.leave(f"{kind} (rotary + attention)",
                           "attention logit soft-capping is not in kpt's attention contract")
                continue
            why = _attention_unsupported(module, config, attention)
            if why:
                plan.leave(f"{kind}: attention (rotary on kpt)", why)
                plan.swap(f"{kind}: rotary on kpt (rope)", _override(module, _rotary_forward))
            else:
                plan.swap(f"{kind}: rotary + attention on kpt (rope, attention)", _override(module, _attention_forward))
        elif kind.endswith("TopKRouter"):
            plan.swap(f"{kind}: moe_gating", _override(module, _router_forward))
        elif kind.endswith("Experts") and hasattr(module, "gate_up_proj"):
            if type(getattr(module, "act_fn", None)).__name__ in ACTIVATION_OF:
                plan.swap(f"{kind}: moe_dispatch, grouped_linear, gated activation, moe_combine",
                          _override(module, _experts_forward))
            else:
                plan.leave(kind, f"activation {type(module.act_fn).__name__} has no fused gated kernel")
    if hasattr(model, "lm_head") and hasattr(model, "model"):
        why = _loss_unsupported(config, loss)
        if why:
            plan.leave("loss", why)
        else:
            plan.swap("loss: linear_cross_entropy (no logits with labels)", _override(model, _loss_forward))
    return plan


def _attention_unsupported(module: Any, config: Any, wanted: bool) -> str | None:
    if not wanted:
        return "transformers' attention asked for (attention=False): masks and padding as it handles them"
    if getattr(config, "attention_dropout", 0.0):
        return f"attention dropout {config.attention_dropout} is not in kpt's attention contract"
    if config._attn_implementation != "sdpa":
        return (f"masks are built for attn_implementation={config._attn_implementation!r}; load the model with "
                "attn_implementation='sdpa' for kpt's")
    if not 16 <= module.head_dim <= 256:
        return f"head_dim {module.head_dim} is outside kpt's attention range 16..256"
    return None


def _loss_unsupported(config: Any, wanted: bool) -> str | None:
    if not wanted:
        return "not asked for (loss=False)"
    if getattr(config, "final_logit_softcapping", None) is not None:
        return "final logit soft-capping comes between the head and the loss; the fused loss has no place for it"
    if getattr(config, "output_router_logits", False):
        return "the router's auxiliary loss is added to it (output_router_logits=True)"
    return None


def patch(model: Any, *, attention: bool = True, loss: bool = True) -> PatchSummary:
    """Patch a transformers causal LM in place to run on kpt's kernels (see the module docstring);
    returns the `PatchSummary`, also kept as ``model.kpt_summary``. ``attention=False`` keeps
    transformers' attention (its masks, padding and sliding windows) around kpt's rope;
    ``loss=False`` keeps transformers' loss. Raises `kpt.KernelNotSupportedError` for an architecture it does
    not know and `kpt.KernelInputError` for a model patched already; in both cases and on any
    failure while patching, the model is left as it was."""
    if hasattr(model, "_kpt_undo"):
        raise KernelInputError("kpt.patch: this model is patched already (kpt.unpatch(model) first)")
    plan = _plan(model, attention, loss)
    undo: list[Callable[[], None]] = []
    try:
        for step in plan.steps:
            undo.append(step())
    except BaseException:
        for u in reversed(undo):
            u()
        raise
    model._kpt_undo = undo
    model.kpt_summary = plan.summary
    first = next(model.parameters(), None)
    if first is not None and first.device.type != "meta":
        knn.backend(first)  # resolved now, for a torch.compile of the model (`kpt.nn.backend`)
    return plan.summary


def unpatch(model: Any) -> None:
    """Undo `patch`: the model's own modules and forwards again (the parameters were never copied)."""
    undo = getattr(model, "_kpt_undo", None)
    if undo is None:
        raise KernelInputError("kpt.unpatch: this model was not patched by kpt.patch")
    for u in reversed(undo):
        u()
    del model._kpt_undo, model.kpt_summary


class AutoModelForCausalLM:
    """transformers' ``AutoModelForCausalLM``, patched: ``kpt.AutoModelForCausalLM.from_pretrained
    (name)`` or ``.from_config(config)`` load with ``attn_implementation="sdpa"`` (unless given) and
    return the model after `patch` (its summary in ``model.kpt_summary``)."""

    @staticmethod
    def from_pretrained(name_or_path: str, *args: Any, **kwargs: Any) -> Any:
        import transformers

        kwargs.setdefault("attn_implementation", "sdpa")
        model = transformers.AutoModelForCausalLM.from_pretrained(name_or_path, *args, **kwargs)
        patch(model)
        return model

    @staticmethod
    def from_config(config: Any, **kwargs: Any) -> Any:
        import transformers

        kwargs.setdefault("attn_implementation", "sdpa")
        model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
        patch(model)
        return model
