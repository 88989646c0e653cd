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
the returned `PatchSummary`: attention with logit soft-capping or dropout, or in a model loaded
with ``flex_attention`` or a paged implementation (they mask sequences their own way); a loss after
logit soft-capping or with the router's auxiliary loss. A patched attention takes every mask
transformers builds for ``sdpa`` or ``eager`` (`MASKS_TAKEN`): causal, key padding (left or right:
batched ``generate()``, padding collators), packed documents (``position_ids`` that restart, as
``DataCollatorWithFlattening`` gives), sliding windows, a static cache's slots; and a 4-D mask
given to the model, boolean or additive with 0 and -inf (or ``torch.finfo(dtype).min``), within
the causal mask. A model loaded with ``flash_attention_*`` also keeps the documents of
FlashAttention's varlen offsets apart (``cu_seq_lens_q``/``cu_seq_lens_k``, `VARLEN_TAKEN`); one
loaded with ``sdpa`` or ``eager`` ignores them, as transformers does there. A mask it cannot
compute exactly (a bias, a key after the query) raises
`kpt.KernelNotSupportedError` (under ``torch.compile``, an assert in the graph), never a silent
other computation; a query that sees no key gives zeros, as ``sdpa`` does (`_kernel_mask`).
``kpt.patch(model, attention=False)`` keeps transformers' attention around kpt's rope. With
labels, a patched model returns the float32 loss of the fused ``linear_cross_entropy`` and no
logits (they are never formed); call it without labels for logits. The patched forwards take
their arguments by keyword and follow the names of the installed transformers
(``past_key_values``, ``cache`` from 5.24), and compile with ``torch.compile(model)``: kpt's
kernels are custom ops, except those the backend's ``compiler_fuses`` gives Inductor to fuse.
An architecture kpt does not know raises before anything changes, and a failure while patching
undoes what was done.
"""

from __future__ import annotations

import inspect
import sys
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from . import nn as knn
from .errors import KernelInputError, KernelNotSupportedError
from .kernels.attention import visible_keys

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
                       attention_mask: Tensor | None = None, **kwargs: Any) -> tuple[Tensor, Any]:
    """A transformers attention module's forward on kpt: projections, optional q/k norms, kpt's
    rope, cache update, kpt's attention with the mask transformers built for ``sdpa`` (`_kernel_mask`),
    output projection. The cache comes as ``past_key_values`` (transformers < 5.24) or ``cache``."""
    q, k, v, shape = _rotated(self, hidden_states, position_embeddings, kwargs)
    causal, mask, k, v = _kernel_mask(self, attention_mask, q, k, v)
    out = knn.backend(q).attention(q, k, v, causal, self.scaling, mask)
    return knn.project_heads(self.o_proj, out), None


def _varlen_attention_forward(self: Any, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor],
                              attention_mask: Tensor | None = None, **kwargs: Any) -> tuple[Tensor, Any]:
    """`_attention_forward` for a model loaded with a ``flash_attention_*`` implementation, whose
    packed batches may come as FlashAttention's varlen inputs: ``cu_seq_lens_q``/``cu_seq_lens_k``
    (cumulative document lengths over the flattened batch, as ``DataCollatorWithFlattening(
    return_flash_attn_kwargs=True)`` gives them) keep the documents apart, as flash's varlen call
    does; restarting ``position_ids`` do through the mask transformers builds, and in a one-row
    batch with no mask as flash reads them (`_position_documents`).

    A batch of one row (the collator's flattened batch) runs its documents as a batch of their own
    (`_attend_documents`): no work across documents, and without another mask the causal kernels
    with no mask at all (on Hopper, kpt-cuda's fused ones). Otherwise (several rows, or under
    ``torch.compile`` without ``max_length_q``) the documents' mask is combined with the given one
    (`_document_mask`)."""
    q, k, v, shape = _rotated(self, hidden_states, position_embeddings, kwargs)
    causal, mask, k, v = _kernel_mask(self, attention_mask, q, k, v)
    offsets = _offsets(self.layer_idx, kwargs, q.shape[0], q.shape[2], k.shape[2], q.device)
    if offsets is None and mask is None and q.shape[0] == 1 and q.shape[2] == k.shape[2] > 1:
        found = _position_documents(kwargs.get("position_ids"), q.shape[2], q.device)
        if isinstance(found, Tensor):
            mask = found
        else:
            offsets = found
    backend = knn.backend(q)
    cu, longest = offsets if offsets is not None else (None, None)
    if cu is not None and longest is not None and causal and q.shape[0] == 1:
        out = _attend_documents(backend, q, k, v, mask, cu, longest, self.scaling)
    else:
        if cu is not None:
            documents = _document_mask(cu, q.shape[0], q.shape[2])
            mask = documents if mask is None else mask & documents
        out = backend.attention(q, k, v, causal, self.scaling, mask)
    return knn.project_heads(self.o_proj, out), None


def _position_documents(position_ids: Any, s: int, device: torch.device) -> tuple[Tensor, int] | Tensor | None:
    """The documents that flash finds in the ``position_ids`` of a one-row batch given no mask and
    no varlen offsets (transformers' ``_is_packed_sequence``, ``prepare_fa_kwargs_from_position_ids``):
    when the positions are not the row's smallest counting up, a document starts at each position
    equal to the smallest. transformers' ``sdpa`` masks separate the documents of restarting
    positions only without a KV cache, so with ``use_cache`` (the config's default outside the
    ``Trainer``) a patched model saw them as one sequence where flash keeps them apart.

    Outside ``torch.compile``: ``(cu, longest)`` as `_offsets` gives them where the positions restart
    (one host read a forward), else ``None``. Under ``torch.compile``, which cannot read whether
    they restart: the ``[1, 1, S, S]`` mask of their documents (all ``True`` where they do not)."""
    if not isinstance(position_ids, Tensor) or position_ids.shape != (1, s):
        return None
    positions = position_ids[0].to(device)
    smallest = positions.min()
    starts = positions == smallest
    starts[0] = True  # the tokens before a first smallest position are a document too (flash leaves them out)
    if torch.compiler.is_compiling():
        document = starts.cumsum(0)
        return (document[:, None] == document[None, :])[None, None]
    hit, found = _POSITIONS_READ.get((position_ids,), (s, device))
    if hit:
        return found
    if bool((positions != torch.arange(s, device=device) + smallest).any()):
        cu = torch.cat([starts.nonzero().view(-1), torch.tensor([s], device=device)]).to(torch.int32)
        found = cu, int((cu[1:] - cu[:-1]).max())
    _POSITIONS_READ.put((position_ids,), (s, device), found)
    return found


class _LastRead:
    """What the last host read of some tensors found (a forward's mask, varlen offsets or
    positions): every layer of a model gets the same tensors, so one read (a wait for the device)
    serves the forward. Found again while they are the same objects at the same in-place versions,
    with the same ``key``."""

    def __init__(self) -> None:
        self._last: tuple[tuple[weakref.ref[Tensor], ...], tuple[Any, ...], Any] | None = None

    def get(self, tensors: tuple[Tensor, ...], key: tuple[Any, ...]) -> tuple[bool, Any]:
        """``(True, what was found)`` for these tensors and ``key``, else ``(False, None)``."""
        if self._last is None:
            return False, None
        refs, last_key, found = self._last
        same = len(refs) == len(tensors) and all(r() is t for r, t in zip(refs, tensors))
        if same and last_key == (*(t._version for t in tensors), *key):
            return True, found
        return False, None

    def put(self, tensors: tuple[Tensor, ...], key: tuple[Any, ...], found: Any) -> None:
        self._last = tuple(weakref.ref(t) for t in tensors), (*(t._version for t in tensors), *key), found


_POSITIONS_READ = _LastRead()  # `_position_documents`
_OFFSETS_READ = _LastRead()  # `_offsets`
_MASK_READ = _LastRead()  # `_kernel_mask`


def _offsets(layer: int, kwargs: dict[str, Any], batch: int, sq: int, skv: int,
             device: torch.device) -> tuple[Tensor, int | None] | None:
    """``(cu, longest)`` from FlashAttention's varlen inputs in ``kwargs``, or ``None`` without them:
    the document offsets ``cu`` over the flattened ``B * S`` tokens (document ``d`` holds tokens
    ``cu[d] <= t < cu[d + 1]``) and the longest document's length as an int (``max_length_q``; read
    from ``cu`` outside ``torch.compile`` when not given, else ``None``). Packed documents have no
    cache: the offsets must be one for queries and keys, run from 0 to ``B * S`` and hold no document
    longer than ``longest`` (checked on the host, or in the graph under ``torch.compile``)."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_k is None:
        return None
    if cu_q is None or cu_k is None or sq != skv:
        raise KernelNotSupportedError(
            f"kpt.patch: attention layer {layer} was given cu_seq_lens_q and cu_seq_lens_k "
            f"({'one of them' if cu_q is None or cu_k is None else f'for {sq} queries and {skv} keys'}); kpt's "
            "attention takes packed documents with one set of offsets for queries and keys and no cache; pass "
            "both (as DataCollatorWithFlattening(return_flash_attn_kwargs=True) does), or position_ids that restart")
    message = (f"kpt.patch: attention layer {layer} was given cu_seq_lens_q and cu_seq_lens_k that differ, do "
               f"not run from 0 to the {batch * sq} tokens of the batch, or hold a document longer than "
               "max_length_q; kpt's attention takes one set of document offsets for queries and keys, covering "
               "the flattened batch")
    if not isinstance(cu_q, Tensor) or cu_q.dim() != 1 or cu_q.shape != cu_k.shape or cu_q.numel() < 2:
        raise KernelNotSupportedError(message)
    compiling = torch.compiler.is_compiling()
    given = kwargs.get("max_length_q")
    read, key = (cu_q, cu_k), (batch * sq, given, device)
    cached = not compiling and not isinstance(given, Tensor)
    if cached:
        hit, found = _OFFSETS_READ.get(read, key)
        if hit:
            return found
    cu_q, cu_k = cu_q.to(device), cu_k.to(device)
    longest = given
    if isinstance(longest, Tensor):
        longest = None if compiling else int(longest)
    if longest is None and not compiling:
        longest = int((cu_q[1:] - cu_q[:-1]).max())
    exact = (cu_q == cu_k).all() & (cu_q[0] == 0) & (cu_q[-1] == batch * sq)
    if longest is not None:
        exact &= ((cu_q[1:] - cu_q[:-1]) <= longest).all()
    if compiling:
        torch._assert_async(exact, message)  # a graph reads no value on the host: the run fails instead
    elif not bool(exact):
        raise KernelNotSupportedError(message)
    if cached:
        _OFFSETS_READ.put(read, key, (cu_q, longest))
    return cu_q, longest


def _document_of(cu: Tensor, batch: int, sq: int) -> Tensor:
    """``[B, S]``: the document of each token (its place in the flattened batch between offsets ``cu``)."""
    tokens = torch.arange(batch * sq, device=cu.device, dtype=cu.dtype)
    return torch.searchsorted(cu[1:], tokens, right=True).view(batch, sq)


def _document_mask(cu: Tensor, batch: int, sq: int) -> Tensor:
    """``[B, 1, S, S]`` bool, ``True`` where query and key lie in one document (offsets ``cu``)."""
    document = _document_of(cu, batch, sq)
    return (document[:, :, None] == document[:, None, :])[:, None]


def _attend_documents(backend: Any, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, cu: Tensor,
                      longest: int, scale: float) -> Tensor:
    """Causal attention within each document of one row (offsets ``cu``, none longer than
    ``longest``): the documents gathered as a batch of ``[len(cu) - 1, H, longest, D]``, each padded
    at its end, with the part of ``mask`` (``[1, H | 1, S, S]``) within each document, and the real
    rows scattered back. A real query sees only keys before it, all of its own document; the padding
    rows are never read back (their outputs get no gradient, so neither do the keys only they see)."""
    _, hq, s, d = q.shape
    starts = cu[:-1].long()
    lengths = cu[1:].long() - starts
    step = torch.arange(longest, device=q.device)
    rows = torch.where(step[None, :] < lengths[:, None], starts[:, None] + step[None, :], 0)  # [documents, longest]

    def gather(t: Tensor) -> Tensor:
        return t[0].transpose(0, 1)[rows].transpose(1, 2)  # [documents, H, longest, D]

    within = None if mask is None else mask[0][:, rows[:, :, None], rows[:, None, :]].transpose(0, 1)
    out = backend.attention(gather(q), gather(k), gather(v), True, scale, within)
    document = _document_of(cu, 1, s)[0].long()
    slot = document * longest + torch.arange(s, device=q.device) - starts[document]
    return out.transpose(1, 2).reshape(-1, hq, d)[slot].transpose(0, 1)[None]


IMPLEMENTATION = "kpt"
"""The ``attn_implementation`` name a patched model runs under: transformers' ``sdpa`` attention and
masks (`_mask`), registered with its ``AttentionInterface`` and ``AttentionMaskInterface``."""


def _mask(**named: Any) -> Tensor | None:
    """transformers' ``sdpa_mask`` (the masks an ``sdpa`` attention gets), except that a plain causal
    mask is ``None`` under ``torch.compile`` too, and a plain causal mask with key padding (the
    ``Trainer``'s and its collators' ``attention_mask``, and a padded prefill) is that ``[B, S]``
    padding mask itself, as transformers gives ``flash_attention_*``: kpt's attention applies it under
    its causal mask (`_kernel_mask`), where the whole ``[B, 1, S, S]`` mask costs a kernel a bias read
    at every query (`_key_padding`). transformers builds no mask when no key is padded,
    there is no window to apply and the queries are all the keys or one; below torch 2.14 it cannot
    tell while compiling (``torch.compiler.is_exporting()`` is a constant ``True`` there) and builds
    the whole causal mask, which a kernel must then read. The same test needs no value here: no
    padding mask at all (``attention_mask is None``), an integer query offset (not a static cache's
    tensor), no window the keys reach and ``q_length`` one or ``kv_length``. ``None`` is exact for kpt's
    attention, whose causal mask is aligned bottom-right (and for transformers' ``sdpa`` on layers
    left unpatched: equal lengths, or one query)."""
    from transformers.masking_utils import sdpa_mask

    q_length, kv_length, window = named.get("q_length"), named.get("kv_length"), named.get("local_size")
    if (named.get("allow_is_causal_skip", True) and named.get("attention_mask") is None
            and not isinstance(named.get("q_offset", 0), Tensor) and (window is None or kv_length < window)
            and (q_length == 1 or q_length == kv_length)):
        return None
    padding = _key_padding(named)
    return padding if padding is not None else sdpa_mask(**named)


def _key_padding(named: dict[str, Any]) -> Tensor | None:
    """The ``[B, S]`` boolean padding mask where transformers asks for the plain causal mask over a
    2-D ``attention_mask`` with the queries all the keys (no cache before them, no window the keys
    reach): the whole mask is then exactly that key padding under the causal mask. Else ``None``."""
    from transformers.masking_utils import causal_mask_function

    given, length, window = named.get("attention_mask"), named.get("kv_length"), named.get("local_size")
    offsets = (named.get("q_offset", 0), named.get("kv_offset", 0))
    if (named.get("mask_function") is causal_mask_function and isinstance(given, Tensor) and given.dim() == 2
            and named.get("q_length") == length == given.shape[1] and all(type(o) is int and o == 0 for o in offsets)
            and (window is None or length < window)):
        return given.bool()
    return None


def _implementation(model: Any) -> Callable[[], Callable[[], None]]:
    """Run ``model`` under `IMPLEMENTATION` (registered with transformers once), back to its own on undo."""

    def apply() -> Callable[[], None]:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        AttentionInterface.register(IMPLEMENTATION, sdpa_attention_forward)
        AttentionMaskInterface.register(IMPLEMENTATION, _mask)
        own = model.config._attn_implementation
        model.config._attn_implementation = IMPLEMENTATION

        def undo() -> None:
            model.config._attn_implementation = own

        return undo

    return apply


MASKS_TAKEN = ("causal", "key padding (left or right)", "packed documents", "sliding window", "static cache",
               "any 4-D boolean or additive (0 / -inf) mask within the causal one")
"""What a patched attention takes: the masks transformers builds for ``sdpa`` and ``eager``, and
a 4-D mask given to the model (`_kernel_mask`; `PatchSummary` says so)."""
VARLEN_TAKEN = ("packed documents as cu_seq_lens_q/cu_seq_lens_k",)
"""What a patched attention of a model loaded with ``flash_attention_*`` takes besides `MASKS_TAKEN`:
FlashAttention's varlen offsets (`_varlen_attention_forward`)."""

def _kernel_mask(self: Any, attention_mask: Any, q: Tensor, k: Tensor, v: Tensor
                 ) -> tuple[bool, Tensor | None, Tensor, Tensor]:
    """``(causal, mask, k, v)`` for kpt's attention from what transformers passes a ``sdpa`` attention.

    ``None``: no mask; transformers' ``sdpa`` then aligns a causal mask top-left, which differs from
    the contract's bottom-right only for a static cache's prefill (more key slots than queries, the
    cache empty before it): its first Sq slots are all those queries can see. A 4-D boolean mask
    (``True``: attend; padding, packed documents, sliding windows, a static cache's slots) goes to
    the kernel with ``causal`` kept, which lets the kernel skip the blocks above the diagonal: exact
    when the mask lies within the bottom-right causal one, as every mask transformers builds for a
    causal language model does. A 4-D float mask is additive, as ``sdpa`` and ``eager`` take one
    (transformers passes a 4-D mask given to the model through to the attention): it is the boolean
    ``mask == 0`` when its values are 0 (attend) or masked (``-inf``, or at most half the dtype's
    most negative value, as transformers' ``eager`` masks hold ``torch.finfo(dtype).min``).

    A query that sees no key (a padding query before a left-padded row's first token) outputs
    zeros, as transformers' ``sdpa`` gives under a boolean or -inf mask. transformers' own
    implementations disagree there: under a finite masked value (``finfo.min``, so in ``eager``)
    such a query spreads its attention over every key, and ``eager`` under -inf gives NaN. Only the
    outputs at padding queries differ, and through them only a loss term whose label follows
    padding (a left-padded row's first token, which no real token predicts).

    `_mask_conditions` says when a mask is not exact; outside ``torch.compile`` that is checked once
    per mask and raises `kpt.KernelNotSupportedError`. A compiled graph reads no value on the host
    without a break, so there each condition is a ``torch._assert_async``: the run fails with the
    same message as a ``RuntimeError`` (on a GPU, a device-side assert, which ends the process's
    CUDA context). kpt's own ``[B, S]`` key padding (`_mask`) goes to the kernel as ``[B, 1, 1, S]``
    under the causal mask. Any other mask raises `kpt.KernelNotSupportedError`."""
    causal = bool(getattr(self, "is_causal", True))
    sq, skv = q.shape[2], k.shape[2]
    if attention_mask is None:
        if causal and 1 < sq < skv:
            k, v = k[:, :, :sq], v[:, :, :sq]
        return causal, None, k, v
    if _is_key_padding(self, attention_mask, sq, skv):
        return True, attention_mask[:, None, None, :], k, v  # kpt's own (`_key_padding`): under the causal mask
    if (not isinstance(attention_mask, Tensor) or attention_mask.dim() != 4
            or not (attention_mask.dtype == torch.bool or attention_mask.is_floating_point())):
        kind = (f"a {attention_mask.dim()}-D {attention_mask.dtype} tensor" if isinstance(attention_mask, Tensor)
                else type(attention_mask).__name__)
        raise KernelNotSupportedError(
            f"kpt.patch: attention layer {self.layer_idx} was given {kind} as its mask; kpt's attention takes "
            "4-D boolean masks or additive float ones of 0 and -inf, as transformers builds them for "
            "attn_implementation='sdpa' or 'eager' (load the model with one), or patch with "
            "kpt.patch(model, attention=False) to keep transformers' attention")
    given = attention_mask[..., :skv]
    mask = given if given.dtype == torch.bool else given == 0
    compiling = torch.compiler.is_compiling()
    if not compiling and _MASK_READ.get((attention_mask,), ())[0]:
        return causal, mask, k, v
    for exact, message in _mask_conditions(self.layer_idx, given, mask, causal, sq, skv):
        if compiling:
            torch._assert_async(exact, message)  # a graph reads no value on the host: the run fails instead
        elif not bool(exact):
            raise KernelNotSupportedError(message)
    if not compiling:
        _MASK_READ.put((attention_mask,), (), True)
    return causal, mask, k, v


def _is_key_padding(self: Any, attention_mask: Any, sq: int, skv: int) -> bool:
    """Whether a causal layer of ``sq`` queries and as many keys was given `_key_padding`'s mask:
    transformers hands an ``sdpa``-style attention no other 2-D mask."""
    return (isinstance(attention_mask, Tensor) and attention_mask.dim() == 2 and attention_mask.dtype == torch.bool
            and bool(getattr(self, "is_causal", True)) and sq == skv == attention_mask.shape[1])


def _mask_conditions(layer: int, given: Tensor, mask: Tensor, causal: bool, sq: int, skv: int
                     ) -> list[tuple[Tensor, str]]:
    """``(condition, message)`` pairs, each condition a 0-D bool tensor, ``True`` when kpt's attention
    with the boolean ``mask`` computes what transformers computes with the mask ``given`` to
    attention layer ``layer`` (sliced to its ``skv`` keys): an additive mask holds only 0 and masked
    values, and a causal layer's mask lies within the causal one (one query, a decode step, sees
    every key under the bottom-right causal mask: nothing to check). The messages hold no double
    quote: a compiled graph writes them into its code."""
    conditions = []
    if given.dtype != torch.bool:
        masked = given <= torch.finfo(given.dtype).min / 2
        conditions.append(((mask | masked).all(), (
            f"kpt.patch: attention layer {layer} was given an additive mask with values other than 0 and -inf "
            f"(or at most torch.finfo({given.dtype}).min / 2), a bias kpt's attention does not add: it takes "
            "boolean masks or additive ones of 0 and -inf; patch with kpt.patch(model, attention=False) to keep "
            "transformers' attention for biased masks")))
    if causal and sq > 1:
        conditions.append(((mask & ~visible_keys(sq, skv, True, mask.device)).any().logical_not(), (
            f"kpt.patch: attention layer {layer} was given a mask that lets queries see keys after them (not "
            "within the causal mask), which a causal kpt attention does not compute; patch with "
            "kpt.patch(model, attention=False) to keep transformers' attention")))
    return conditions


def _cache(kwargs: dict[str, Any]) -> Any:
    """The KV cache a transformers module was given: ``cache`` from 5.24, ``past_key_values`` before."""
    cache = kwargs.pop("cache", None)
    legacy = kwargs.pop("past_key_values", None)
    return cache if cache is not None else legacy


def _rotary_forward(self: Any, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor],
                    attention_mask: Tensor | None = None, **kwargs: Any) -> tuple[Tensor, Any]:
    """As `_attention_forward` with the attention of the model's ``attn_implementation`` (masks,
    padding and sliding windows as transformers handles them): kpt's rope only."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    q, k, v, shape = _rotated(self, hidden_states, position_embeddings, kwargs)
    if attention_mask is not None and _is_key_padding(self, attention_mask, q.shape[2], k.shape[2]):
        # `_mask`'s key padding, as the [B, 1, S, S] mask transformers' sdpa attention takes
        attention_mask = attention_mask[:, None, None, :] & visible_keys(q.shape[2], k.shape[2], True, q.device)
    eager = sys.modules[type(self).__module__].eager_attention_forward  # what the module itself falls back to
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager)
    # a layer's own window (Qwen2, Gemma 3: None on full-attention layers), else the model's (Mistral)
    window = getattr(self, "sliding_window", getattr(self.config, "sliding_window", None))
    out, weights = attend(self, q, k, v, attention_mask, dropout=self.attention_dropout if self.training else 0.0,
                          scaling=self.scaling, sliding_window=window, **kwargs)
    return self.o_proj(out.reshape(*shape, -1).contiguous()), weights


def _rotated(self: Any, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor],
             kwargs: dict[str, Any]) -> tuple[Tensor, Tensor, Tensor, tuple[int, ...]]:
    """``(q, k, v, leading shape)``: the projections as ``[B, H, S, D]``, q and k normalized
    where the module has q/k norms and rotated by kpt's rope, k and v after the update of the cache
    (taken out of ``kwargs``)."""
    cache = _cache(kwargs)
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
    # under autocast (mixed precision: the Trainer's bf16=True) the projections give 16-bit q and k
    # while the tables stay float32: the rotation takes q's dtype, as autocast's attention then would
    cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    q, k = knn.backend(q).rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    if cache is not None:
        # transformers 5.24 hands the layer's keyword arguments to the cache; earlier caches ignore them
        k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
    return q, k, v, shape


def _router_forward(self: Any, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return knn.route(hidden_states.reshape(-1, self.hidden_dim), self.weight, self.top_k,
                     getattr(self, "norm_topk_prob", True))


def _experts_forward(self: Any, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    return knn.run_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                           ACTIVATION_OF[type(self.act_fn).__name__])


def _loss_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    """A ``*ForCausalLM`` forward whose loss in training is kpt's ``linear_cross_entropy`` on the
    shifted labels (as transformers' ``ForCausalLMLoss``, ``num_items_in_batch`` included; float32
    whatever the model's dtype), with no logits; the model's own forward without labels, in
    evaluation (``model.eval()``, as ``Trainer.evaluate`` sets it: metrics read the logits), and
    where the head is not a plain ``nn.Linear`` when the model runs (an adapter on it, as PEFT's
    LoRA: the fused loss reads the weight only). Positional arguments are matched to the
    names of the class's own ``forward`` (read when patching: `_positional`), so that a release that
    renames one (``past_key_values`` became ``cache`` in 5.24) is followed, and every argument
    reaches the model by keyword."""
    names = self._kpt_positional
    if len(args) > len(names):
        raise TypeError(f"{type(self).__name__}.forward takes at most {len(names)} positional arguments")
    named = {**dict(zip(names, args)), **kwargs}
    head = self.get_output_embeddings()
    if named.get("labels") is None or not self.training or not knn.plain_linear(head):
        return type(self).forward(self, **named)
    labels = named.pop("labels")
    from transformers.modeling_outputs import CausalLMOutputWithPast

    num_items = named.pop("num_items_in_batch", None)
    shift_labels = named.pop("shift_labels", None)
    named.pop("logits_to_keep", None)  # with labels there are no logits to keep
    return_dict = named.pop("return_dict", None)
    outputs = self.model(**named, return_dict=True)
    hidden = outputs.last_hidden_state
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    loss = knn.LinearCrossEntropyLoss(reduction="mean" if num_items is None else "sum")(
        hidden, head.weight, shift_labels.to(hidden.device), head.bias)
    if num_items is not None:
        loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
    rest = {name: value for name, value in outputs.items() if name != "last_hidden_state"}
    output = CausalLMOutputWithPast(loss=loss, logits=None, **rest)
    if not (getattr(self.config, "return_dict", True) if return_dict is None else return_dict):
        return output.to_tuple()  # as transformers gives it, without the logits there are none of
    return output


def _positional(cls: Any) -> tuple[str, ...]:
    """The names a class's ``forward`` takes positionally, after ``self``."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = list(inspect.signature(cls.forward).parameters.values())[1:]
    return tuple(p.name for p in params if p.kind in kinds)


def _loss_override(model: nn.Module) -> Callable[[], Callable[[], None]]:
    """`_loss_forward` as ``model.forward``, showing the class forward's signature: the Trainer
    reads it to keep the dataset's columns the model takes."""

    def apply() -> Callable[[], None]:
        own = type(model).forward.__get__(model)
        setattr(model, "_kpt_positional", _positional(type(model)))  # noqa: B010 (not a Module attribute)

        def forward(*args: Any, **kwargs: Any) -> Any:
            return _loss_forward(model, *args, **kwargs)

        forward.__signature__ = inspect.signature(own)  # type: ignore[attr-defined]
        forward.__doc__ = _loss_forward.__doc__
        model.forward = forward  # type: ignore[method-assign]

        def undo() -> None:
            model.__dict__.pop("forward", None)
            del model._kpt_positional

        return undo

    return apply


def _plan(model: Any, attention: bool, loss: bool) -> _Plan:
    config: Any = getattr(model, "config", None)  # a transformers config (its model_type checked next)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        raise KernelNotSupportedError(
            f"kpt.patch does not know {type(model).__name__} (model_type {model_type!r}); it patches the "
            f"families {', '.join(SUPPORTED)}. Nothing was changed.")
    plan = _Plan(PatchSummary(model_type))
    unit_offset = model_type in UNIT_OFFSET_NORMS
    attends = False
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
                varlen = _flash_style(config)
                masks = ", ".join((*MASKS_TAKEN, *VARLEN_TAKEN) if varlen else MASKS_TAKEN)
                plan.swap(f"{kind}: rotary + attention on kpt (rope, attention; masks: {masks})",
                          _override(module, _varlen_attention_forward if varlen else _attention_forward))
                attends = True
        elif kind.endswith("TopKRouter"):
            plan.swap(f"{kind}: moe_gating", _override(module, _router_forward))
        elif kind.endswith("Experts") and hasattr(module, "gate_up_proj"):
            if type(getattr(module, "act_fn", None)).__name__ in ACTIVATION_OF:
                plan.swap(f"{kind}: moe_dispatch, grouped_linear, gated activation, moe_combine",
                          _override(module, _experts_forward))
            else:
                plan.leave(kind, f"activation {type(module.act_fn).__name__} has no fused gated kernel")
    if attends:
        plan.swap(f"attn_implementation {config._attn_implementation!r} -> {IMPLEMENTATION!r} (its masks; plain causal "
                  "as no mask under torch.compile too)", _implementation(model))
    if hasattr(model, "lm_head") and hasattr(model, "model"):
        why = _loss_unsupported(config, loss)
        if why:
            plan.leave("loss", why)
        else:
            plan.swap("loss: linear_cross_entropy (training with labels: no logits, float32)", _loss_override(model))
    return plan


def _flash_style(config: Any) -> bool:
    """Whether the model was loaded with a FlashAttention implementation (``flash_attention_2``,
    ``flash_attention_3``, a hub kernel such as ``kernels-community/flash-attn2``), whose packed
    batches may come as varlen offsets (`_varlen_attention_forward`); not the paged ones of
    continuous batching."""
    implementation = str(config._attn_implementation)
    return "flash" in implementation and not implementation.startswith("paged")


def _attention_unsupported(module: Any, config: Any, wanted: bool) -> str | None:
    """Why a module's attention is left to transformers (``None``: it is patched). A model loaded with
    ``sdpa``, ``eager`` or a FlashAttention implementation is patched: ``eager``'s masks are
    ``sdpa``'s as 0 and ``finfo.min``, the two agree at every query that sees a key (`_kernel_mask`),
    and a patched model builds ``sdpa``'s (`IMPLEMENTATION`), which keep padded keys and packed
    documents (restarting ``position_ids``) apart as flash's unpadding and varlen calls do; flash's
    ``cu_seq_lens_*`` are read too (`_varlen_attention_forward`). ``flex_attention`` and the paged
    implementations mask sequences their own way (block masks, a paged cache)."""
    if not wanted:
        return "transformers' attention asked for (attention=False): masks and padding as it handles them"
    if getattr(config, "attention_dropout", 0.0):
        return f"attention dropout {config.attention_dropout} is not in kpt's attention contract"
    if config._attn_implementation not in ("sdpa", "eager") and not _flash_style(config):
        return (f"attn_implementation={config._attn_implementation!r} masks sequences its own way, not as sdpa or "
                "flash attention do; load the model with attn_implementation='sdpa', 'eager' or "
                "'flash_attention_2' for kpt's")
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
