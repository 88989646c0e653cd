"""`kpt.generate`: greedy decoding of a transformers causal LM, each step on a GPU one CUDA graph.

    tokens = kpt.generate(model, input_ids, attention_mask, max_new_tokens=128)

gives what ``model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=128,
do_sample=False)`` gives, for a model patched with `kpt.patch` or not. transformers' ``generate()``
runs milliseconds of Python per token (its inputs, logits processors and stopping criteria) and
reads a value on the host at every step (whether every row has finished), so that the GPU waits
for the host at each token; at small batch that, not the GPU, sets the pace. Here:

1. the prompt fills a ``StaticCache`` of ``prompt + max_new_tokens`` slots (an eager forward:
   prompt lengths vary);
2. a decode step is the model's forward on the last tokens under ``torch.compile`` (one graph,
   static shapes, the masks transformers builds included), the argmax, and the bookkeeping of
   finished rows, appended tokens and positions, all in device tensors updated in place;
3. on a GPU, after two steps run as they are (compiling), one step is captured in a CUDA graph and
   replayed for every later token: the host does one call per token and reads nothing back, except
   every ``check_every`` tokens whether all rows have finished. Not for a model with sliding-window
   layers (Mistral's window, Gemma 2 and 3, Qwen2's ``use_sliding_window``): their static cache
   counts tokens on the host, so their steps run compiled without a graph.

What it follows of ``generate()``: positions from the attention mask (left-padded batches), the end
of sequence (``eos_token_id``, by default the model's ``generation_config``; a finished row gets
``pad_token_id``) and stopping once every row has finished. Greedy only: no sampling, beams, logits
processors or ``min_new_tokens``. The model must be able to use a ``StaticCache`` (transformers'
``cache_implementation="static"``).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


def generate(model: Any, input_ids: Tensor, attention_mask: Tensor | None = None, *, max_new_tokens: int,
             eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
             compile: bool = True, cuda_graph: bool | None = None, check_every: int = 32) -> Tensor:
    """Greedy decoding (see the module docstring): ``[B, prompt + new]`` token ids, ``new`` at most
    ``max_new_tokens`` (fewer where every row ended). ``eos_token_id``: ``None`` for the model's,
    ``[]`` for none. ``compile``: the decode step under ``torch.compile`` (needed for ``cuda_graph``);
    ``cuda_graph`` (default: on a CUDA device, unless the model has sliding-window layers) replays the
    step from a CUDA graph.

    The model keeps the last call's cache, compiled step and graph (one set per model): a call of
    the same batch size, ``prompt + max_new_tokens`` and end ids replays them, with nothing compiled
    or captured again. The graph reads the parameters where they were when it was captured: update
    them in place (an optimizer step, ``load_state_dict``) between calls, do not replace them."""
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"kpt.generate: input_ids must be [batch, prompt] with a prompt, got {tuple(input_ids.shape)}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"kpt.generate: attention_mask {tuple(attention_mask.shape)} is not the shape of input_ids "
                         f"{tuple(input_ids.shape)}")
    if input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"kpt.generate: input_ids must hold token ids (int64 or int32), got {input_ids.dtype}")
    if max_new_tokens < 1:
        raise ValueError(f"kpt.generate: max_new_tokens must be at least 1, got {max_new_tokens}")
    if check_every < 1:
        raise ValueError(f"kpt.generate: check_every must be at least 1, got {check_every}")
    eos, pad = _special_tokens(model, eos_token_id, pad_token_id)
    batch, prompt = input_ids.shape
    key = (batch, prompt + max_new_tokens, input_ids.dtype, input_ids.device, tuple(eos), pad, compile, cuda_graph)
    decoder = _DECODERS.get(model)
    if decoder is None or decoder.key != key:
        _DECODERS.pop(model, None)  # the last one's cache goes before the next one's is made
        _DECODERS[model] = decoder = _Decoder(model, key)
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.device)
    with torch.no_grad():
        return decoder.run(model, input_ids, mask, max_new_tokens, check_every)


class _Decoder:
    """What a `generate` call decodes with, kept for the next call of the same ``key``: the static
    cache, the state of decoding in device tensors (updated in place by a step, so that a captured
    step replays for every later token and call), the compiled forward and the step's CUDA graph."""

    def __init__(self, model: Any, key: tuple[Any, ...]) -> None:
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        batch, total, dtype, device, eos, pad, compile, cuda_graph = key
        self.key, self.pad = key, pad  # not the model: `_DECODERS` would keep it alive
        self.cache = StaticCache(config=model.config, max_cache_len=total)
        # a sliding window's static layer counts its tokens on the host: a replayed graph would not
        plain = all(type(layer) is StaticLayer for layer in self.cache.layers)
        if cuda_graph is None:
            cuda_graph = compile and device.type == "cuda" and plain
        elif cuda_graph and not (compile and device.type == "cuda" and plain):
            raise ValueError(
                "kpt.generate: cuda_graph needs compile=True (transformers' masks read values on the host outside "
                "torch.compile, which a captured graph cannot), a CUDA device, and a model whose static cache has "
                "no sliding-window layers (they count their tokens on the host)")
        self.cuda_graph = cuda_graph
        self.cache_name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
        self.tokens = torch.empty((batch, total), dtype=dtype, device=device)
        self.mask = torch.empty((batch, total), dtype=torch.long, device=device)
        self.last = torch.empty((batch, 1), dtype=dtype, device=device)
        self.position = torch.empty((batch, 1), dtype=torch.long, device=device)
        self.slot = torch.empty(1, dtype=torch.long, device=device)
        self.unfinished = torch.empty(batch, dtype=torch.bool, device=device)
        self.produced = torch.empty((), dtype=torch.long, device=device)  # tokens generate() would have made
        self.eos = torch.tensor(eos, dtype=dtype, device=device)
        self.forward: Callable[..., Tensor] = (
            torch.compile(_next_tokens, fullgraph=True, dynamic=False) if compile else _next_tokens)
        self.replay: Callable[[], None] | None = None

    def record(self, chosen: Tensor) -> None:
        """Append the tokens ``chosen`` (a finished row's: the pad) and mark the rows they end."""
        chosen = torch.where(self.unfinished, chosen, self.pad)
        self.tokens.index_copy_(1, self.slot, chosen[:, None])
        self.produced.add_(self.unfinished.any().long())
        self.unfinished.logical_and_(~torch.isin(chosen, self.eos))
        self.last.copy_(chosen[:, None])
        self.slot.add_(1)

    def step(self, model: Any) -> None:
        self.record(self.forward(model, self.cache_name, self.cache, self.last, self.position, self.mask))
        self.position.add_(1)

    def run(self, model: Any, input_ids: Tensor, mask: Tensor, new: int, check_every: int) -> Tensor:
        prompt = input_ids.shape[1]
        self.cache.reset()
        # the prompt, with positions as generate() gives them (a left-padded row's first real token at 0)
        positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
        first = _next_tokens(model, self.cache_name, self.cache, input_ids, positions, mask)
        self.tokens.fill_(self.pad)
        self.tokens[:, :prompt] = input_ids
        self.mask.fill_(1)  # the slots after the prompt: hidden by the causal mask until filled
        self.mask[:, :prompt] = mask
        self.position.copy_(positions[:, -1:] + 1)
        self.slot.fill_(prompt)
        self.unfinished.fill_(True)
        self.produced.zero_()
        self.record(first)
        for made in range(1, new):
            if len(self.eos) and made % check_every == 0 and not bool(self.unfinished.any()):
                break
            if self.replay is not None:
                self.replay()
            elif self.cuda_graph and made == 3:  # two steps compiled it: this one runs, the next replay it
                self.replay = _captured(lambda: self.step(model))
            else:
                self.step(model)
        return self.tokens[:, : prompt + int(self.produced)].clone()


def _next_tokens(model: Any, cache_name: str, cache: Any, ids: Tensor, positions: Tensor, mask: Tensor) -> Tensor:
    """The argmax of ``model``'s logits at each row's last position, its KV ``cache`` filled."""
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                **{cache_name: cache})
    return out.logits[:, -1].argmax(-1)


_DECODERS: weakref.WeakKeyDictionary[Any, _Decoder] = weakref.WeakKeyDictionary()
"""The `_Decoder` of each model's last `generate` call, freed with the model."""


def _special_tokens(model: Any, eos_token_id: int | list[int] | None, pad_token_id: int | None
                    ) -> tuple[list[int], int]:
    """The end-of-sequence ids (none: decode to ``max_new_tokens``) and the id a finished row gets,
    defaulting as ``generate()`` does: to the model's ``generation_config``, then the first end id."""
    config = getattr(model, "generation_config", None)
    if eos_token_id is None:
        eos_token_id = getattr(config, "eos_token_id", None)
    eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if pad_token_id is None:
        pad_token_id = getattr(config, "pad_token_id", None)
    if pad_token_id is None:
        pad_token_id = eos[0] if eos else 0
    return eos, int(pad_token_id)


def _captured(step: Callable[[], None]) -> Callable[[], None]:
    """Run ``step`` once on a side stream (as CUDA graphs ask before a capture), capture it in a CUDA
    graph (the capture runs nothing) and return the graph's replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay
