"""`kpt.patch` in the flows model builders run, against the same transformers model unpatched.

Padded batches (left and right), packed documents, sliding windows, `torch.compile` of the whole
model, batched `generate()` with the dynamic and the static cache (eager, and compiled as transformers
compiles it on a GPU), gradient checkpointing, mixed precision (autocast), PEFT adapters, the
`Trainer` with a padding and a packing collator and in evaluation, and the loss of a bfloat16
model: each on a tiny random-initialised Llama
and Qwen2 (and Mistral for its window) on the reference backend, in float32 and float64.
transformers in float64 still computes its RMSNorm in float32, so the two agree to float32's
tolerance, not float64's.
"""

from __future__ import annotations

import copy
import gc
import sys
import weakref
from pathlib import Path

import pytest
import torch
import transformers

import kpt

TINY = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64}
CONFIGS = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}
TOL = kpt.default_tolerance(torch.float32)
GREEDY = {"do_sample": False, "pad_token_id": 0}


def pair(family: str, dtype: torch.dtype = torch.float32, **config: object) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The model as transformers builds it (``sdpa``), and a patched copy."""
    torch.manual_seed(0)
    cls = transformers.MistralConfig if family == "mistral" else CONFIGS[family]
    hf = transformers.AutoModelForCausalLM.from_config(cls(**{**TINY, **config}), attn_implementation="sdpa")
    hf = hf.to(dtype)
    patched = copy.deepcopy(hf)
    kpt.patch(patched)
    return hf, patched


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.isfinite().all(), f"{what}: not finite"
    torch.testing.assert_close(actual, expected.to(actual.dtype), atol=TOL.atol, rtol=TOL.rtol,
                               msg=lambda m: f"{what}: {m}")


def padded_batch(side: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, attention mask and labels of three sequences of 12, 7 and 1 real tokens, padded on
    ``side``; the one-token row's other queries (left padding) see no key."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, TINY["vocab_size"], (3, 12), generator=g)
    mask = torch.zeros_like(tokens)
    for row, n in enumerate((12, 7, 1)):
        mask[row, 12 - n:] = 1 if side == "left" else 0
        if side == "right":
            mask[row, :n] = 1
    tokens = tokens.masked_fill(mask == 0, 0)
    return tokens, mask, tokens.masked_fill(mask == 0, -100)


def run(model: torch.nn.Module, **batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Logits (no labels), loss (labels) and every parameter's gradient."""
    model.zero_grad()
    labels = batch.pop("labels")
    with torch.no_grad():
        logits = model(**batch).logits
    loss = model(**batch, labels=labels).loss
    loss.backward()
    # a compiled model names its parameters after the module it wraps (``_orig_mod.``)
    return logits, loss.detach(), {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()
                                   if p.grad is not None}


def agree(hf: torch.nn.Module, patched: torch.nn.Module, real: torch.Tensor, **batch: torch.Tensor) -> None:
    logits, loss, grads = run(hf, **batch)
    p_logits, p_loss, p_grads = run(patched, **batch)
    close(p_logits[real], logits[real], "logits on real tokens")
    close(p_loss, loss, "loss")
    assert p_grads.keys() == grads.keys()
    for name, g in grads.items():
        close(p_grads[name], g, f"gradient of {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_padded_batches_agree(family: str, side: str, dtype: torch.dtype) -> None:
    hf, patched = pair(family, dtype)
    tokens, mask, labels = padded_batch(side)
    agree(hf, patched, mask.bool(), input_ids=tokens, attention_mask=mask, labels=labels)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_agrees(reentrant: bool) -> None:
    """``model.gradient_checkpointing_enable()`` (fine-tuning's memory saver: each layer's forward runs
    again in the backward), non-reentrant and reentrant, on a left-padded batch."""
    hf, patched = pair("llama")
    for model in (hf, patched):
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    tokens, mask, labels = padded_batch("left")
    agree(hf, patched, mask.bool(), input_ids=tokens, attention_mask=mask, labels=labels)


LORA_TARGETS = {"projections": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                "and the head": ["q_proj", "down_proj", "lm_head"]}


@pytest.mark.parametrize("saved_head", [False, True], ids=["", "modules_to_save"])
@pytest.mark.parametrize("targets", list(LORA_TARGETS))
@pytest.mark.parametrize("order", ["patch, then adapters", "adapters, then patch"])
def test_peft_adapters_agree(order: str, targets: str, saved_head: bool) -> None:
    """PEFT's LoRA adapters (non-zero from the start) on the projections, and on the language-model
    head too, or a trainable copy of the head (``modules_to_save``, as when tokens are added), put
    on before or after patching: the loss and the adapters' gradients are those of transformers'
    model with the same adapters. The fused loss reads only a plain head's weight, so a wrapped head
    makes its own logits."""
    peft = pytest.importorskip("peft")

    def adapted(model: torch.nn.Module) -> torch.nn.Module:
        torch.manual_seed(1)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS[targets], lora_dropout=0.0,
                                 init_lora_weights=False, modules_to_save=["lm_head"] if saved_head else None)
        return peft.get_peft_model(model, config)

    hf, patched = pair("llama")
    if order == "patch, then adapters":
        patched = adapted(patched)
    else:
        kpt.unpatch(patched)
        patched = adapted(patched)
        kpt.patch(patched.base_model.model)
    tokens, mask, labels = padded_batch("left")
    agree(adapted(hf), patched, mask.bool(), input_ids=tokens, attention_mask=mask, labels=labels)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_packed_documents_agree(family: str) -> None:
    """Documents concatenated in one row with ``position_ids`` that restart (what
    ``DataCollatorWithFlattening`` gives): the patched model gives what transformers' ``sdpa`` gives."""
    hf, patched = pair(family)
    tokens = torch.randint(1, TINY["vocab_size"], (1, 15), generator=torch.Generator().manual_seed(3))
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6]])
    labels = tokens.clone()
    labels[0, [0, 5, 8]] = -100  # each document's first token, as the collator marks it
    agree(hf, patched, torch.ones_like(tokens, dtype=torch.bool), input_ids=tokens, position_ids=positions,
          labels=labels)


def flash_pair(family: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The model as transformers builds it (``sdpa``), and a patched copy as a model loaded with
    ``flash_attention_2`` is patched (the implementation set on its config as loading sets it: the
    flash-attn package, which needs a GPU, is not needed for patching)."""
    hf, _ = pair(family)
    flash = copy.deepcopy(hf)
    flash.config._attn_implementation = "flash_attention_2"
    kpt.patch(flash)
    return hf, flash


DOCUMENTS = (0, 5, 8, 15)
"""Offsets of three documents of 5, 3 and 7 tokens packed in one row, as FlashAttention's varlen
``cu_seq_lens_*`` give them."""


@pytest.mark.parametrize(("family", "positions"), [("llama", "running"), ("llama", "restarting"),
                                                   ("qwen2", "restarting")])
def test_flash_varlen_offsets_keep_packed_documents_apart(family: str, positions: str) -> None:
    """A model loaded with ``flash_attention_2`` and given FlashAttention's varlen offsets
    (``cu_seq_lens_q``/``cu_seq_lens_k``): each document attends only to itself, as flash's varlen
    call computes; the oracle runs each document alone through the unpatched model at the same
    positions: ``running`` on through the row (no ``position_ids``: transformers builds no mask), or
    ``restarting`` at each document as ``DataCollatorWithFlattening`` gives them (transformers then
    builds the packed documents' mask too). Logits, loss (labels masked at each document's first
    token, as the collator marks them) and gradients agree: the documents as a batch of their own
    (eager, compiled, and on the cuda backend through Triton's interpreter on a CPU machine), and as
    a mask (compiled without ``max_length_q``, which the graph cannot read from the offsets)."""
    hf, flash = flash_pair(family)
    summary = str(flash.kpt_summary)
    assert "cu_seq_lens" in summary and "flash_attention_2' -> 'kpt'" in summary, summary
    tokens = torch.randint(1, TINY["vocab_size"], (1, DOCUMENTS[-1]), generator=torch.Generator().manual_seed(5))
    labels = tokens.clone()
    labels[0, list(DOCUMENTS[:-1])] = -100
    cu = torch.tensor(DOCUMENTS, dtype=torch.int32)
    spans = list(zip(DOCUMENTS[:-1], DOCUMENTS[1:]))
    at = {span: torch.arange(*span)[None] - (span[0] if positions == "restarting" else 0) for span in spans}
    varlen = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 7, "max_length_k": 7}
    if positions == "restarting":
        varlen["position_ids"] = torch.cat(list(at.values()), dim=1)

    hf.zero_grad()
    logits = torch.cat([hf(tokens[:, a:b], position_ids=at[a, b]).logits for a, b in spans], dim=1)
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in hf.named_parameters()}
    compiled = torch.compile(flash, fullgraph=True)
    lengths = {k: v for k, v in varlen.items() if not k.startswith("max_length")}
    for model, backend, given in ((flash, "reference", varlen), (flash, "reference", lengths),
                                  (compiled, "reference", varlen), (compiled, "reference", lengths),
                                  (flash, "cuda", varlen)):
        with kpt.use_backend(backend):
            p_logits, p_loss, p_grads = run(model, input_ids=tokens, labels=labels, **given)
        close(p_logits, logits.detach(), "logits")
        close(p_loss, loss.detach(), "loss")
        for name, g in grads.items():
            close(p_grads[name], g, f"gradient of {name}")


@pytest.mark.parametrize("use_cache", [None, False])
def test_flash_loaded_model_reads_restarting_positions_as_flash_does(use_cache: bool | None) -> None:
    """A model loaded with ``flash_attention_2`` given packed documents as restarting ``position_ids``
    only (``DataCollatorWithFlattening()``'s default) in one row: each document attends only to
    itself, as flash computes, also with the KV cache the config's ``use_cache`` makes outside the
    ``Trainer`` (where transformers' ``sdpa`` masks do not separate them), eager and compiled; the
    oracle runs each document alone. Positions that count up from any start are one sequence. In a
    batch of several rows, restarting positions separate the documents as transformers' ``sdpa``
    does without a cache (the one difference kept: flash separates them only in a one-row batch)."""
    hf, flash = flash_pair("llama")
    kw = {} if use_cache is None else {"use_cache": use_cache}
    tokens = torch.randint(1, TINY["vocab_size"], (2, 15), generator=torch.Generator().manual_seed(6))
    at = {span: torch.arange(*span)[None] - span[0] for span in zip(DOCUMENTS[:-1], DOCUMENTS[1:])}
    positions = torch.cat(list(at.values()), dim=1)
    compiled = torch.compile(flash, fullgraph=True)
    with torch.no_grad():
        alone = torch.cat([hf(tokens[:1, a:b], position_ids=p).logits for (a, b), p in at.items()], dim=1)
        for model in (flash, compiled):
            close(model(tokens[:1], position_ids=positions, **kw).logits, alone, "logits of packed documents")
            counting = torch.arange(3, 18)[None]
            close(model(tokens[:1], position_ids=counting, **kw).logits,
                  hf(tokens[:1], position_ids=counting, use_cache=False).logits, "logits of one sequence")
        rows = torch.cat([positions, torch.arange(15)[None]])
        close(flash(tokens, position_ids=rows, use_cache=False).logits,
              hf(tokens, position_ids=rows, use_cache=False).logits, "logits of two rows")


def test_flash_varlen_offsets_kpt_cannot_follow_are_refused() -> None:
    """Offsets that do not cover the batch's tokens, differ for queries and keys, or hold a document
    longer than ``max_length_q`` raise; a model loaded with ``sdpa`` ignores the offsets, as
    transformers' ``sdpa`` does."""
    hf, flash = flash_pair("llama")
    tokens = torch.randint(1, TINY["vocab_size"], (1, DOCUMENTS[-1]))
    cu = torch.tensor(DOCUMENTS, dtype=torch.int32)
    short, other = torch.tensor((0, 5, 8), dtype=torch.int32), torch.tensor((0, 6, 8, 15), dtype=torch.int32)
    for given in ({"cu_seq_lens_q": short, "cu_seq_lens_k": short}, {"cu_seq_lens_q": cu, "cu_seq_lens_k": other},
                  {"cu_seq_lens_q": cu}, {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 5}):
        with pytest.raises(kpt.KernelNotSupportedError, match="cu_seq_lens_q and cu_seq_lens_k"):
            flash(tokens, **given)
    _, patched = pair("llama")
    with torch.no_grad():
        close(patched(tokens, cu_seq_lens_q=cu, cu_seq_lens_k=cu).logits, hf(tokens).logits, "sdpa ignores offsets")


def test_a_sliding_window_shorter_than_the_sequence_agrees() -> None:
    hf, patched = pair("mistral", sliding_window=4)
    tokens, mask, labels = padded_batch("left")
    agree(hf, patched, mask.bool(), input_ids=tokens, attention_mask=mask, labels=labels)


def test_a_mask_kpt_cannot_compute_is_refused() -> None:
    """A 4-D mask that lets queries see later keys (not within the causal mask), or an additive
    float mask with values other than 0 and -inf (a bias), raises; nothing is computed differently."""
    _, patched = pair("llama")
    tokens = torch.randint(1, TINY["vocab_size"], (1, 6))
    future = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    with pytest.raises(kpt.KernelNotSupportedError, match="not within the causal mask"):
        patched(tokens, attention_mask=future)
    with pytest.raises(kpt.KernelNotSupportedError, match="not within the causal mask"):
        patched(tokens, attention_mask=torch.zeros(1, 1, 6, 6))  # additive: 0 attends every key
    biased = torch.full((1, 1, 6, 6), -1.5).triu(1)
    with pytest.raises(kpt.KernelNotSupportedError, match="values other than 0 and -inf"):
        patched(tokens, attention_mask=biased)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_the_compiled_model_trains_and_infers_with_no_graph_break(family: str) -> None:
    hf, patched = pair(family)
    tokens, mask, labels = padded_batch("left")
    explained = torch._dynamo.explain(patched)(input_ids=tokens, attention_mask=mask, labels=labels)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(patched, fullgraph=True)
    agree(hf, compiled, mask.bool(), input_ids=tokens, attention_mask=mask, labels=labels)


def saved_bytes(model: torch.nn.Module, **batch: torch.Tensor) -> int:
    """Bytes of the activations a training step keeps for its backward (parameters not counted)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch).loss
    loss.backward()
    return sum(storages.values())


def test_the_compiled_model_keeps_no_more_for_its_backward_than_the_eager_one() -> None:
    """A compiled graph's partitioner chooses what the backward keeps: it kept the gated MLP's
    product and the heads' side-by-side copy that the eager patched model computes again (the
    backward's matrix products read them), which cost a compiled Llama-125M about 1 GiB at 8 x 2048
    tokens. Both are kpt custom ops now, which keep what they save, compiled or not."""
    _, patched = pair("llama")
    tokens = torch.randint(1, TINY["vocab_size"], (2, 32))
    eager = saved_bytes(patched, input_ids=tokens, labels=tokens)
    compiled = torch.compile(patched, fullgraph=True)
    saved_bytes(compiled, input_ids=tokens, labels=tokens)  # compiles
    assert saved_bytes(compiled, input_ids=tokens, labels=tokens) <= eager


def test_a_compiled_model_gives_its_attention_no_mask_for_an_unpadded_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers (5.17 always, newer releases under torch < 2.14) builds the whole causal mask
    while compiling; a patched model runs under kpt's mask function (`kpt.patch.IMPLEMENTATION`),
    which gives none, so the kernel's unmasked causal path runs. A padded batch still brings its
    mask, as the key padding alone (``[B, 1, 1, S]`` under the causal mask, not the whole
    ``[B, 1, S, S]``), and both agree with transformers."""
    patch_module = sys.modules["kpt.patch"]
    given, kernel_mask = [], patch_module._kernel_mask

    def spy(*args: object) -> object:
        causal, mask, k, v = kernel_mask(*args)
        given.append(None if mask is None else (causal, mask.shape[2]))
        return causal, mask, k, v

    monkeypatch.setattr(patch_module, "_kernel_mask", spy)
    # what torch < 2.14 does while compiling (torch.compiler.is_exporting() a constant True there);
    # transformers 5.17 never skips the mask while compiling, on any torch
    monkeypatch.setattr(transformers.masking_utils, "is_torchdynamo_exporting", torch.compiler.is_compiling,
                        raising=False)
    hf, patched = pair("llama")
    compiled = torch.compile(patched, fullgraph=True)
    tokens, mask, labels = padded_batch("left")
    agree(hf, compiled, torch.ones_like(tokens, dtype=torch.bool), input_ids=tokens, labels=tokens)
    assert given and not any(given), "an unpadded batch's attention was given a mask"
    given.clear()
    agree(hf, compiled, mask.bool(), input_ids=tokens, attention_mask=mask, labels=labels)
    assert given and all(g == (True, 1) for g in given), f"a padded batch's attention was given {given}"
    kpt.unpatch(patched)
    assert patched.config._attn_implementation == "sdpa"


def test_dynamic_compile_over_many_lengths_recompiles_a_handful_of_times() -> None:
    hf, patched = pair("llama")
    torch._dynamo.reset()
    counts = torch._dynamo.utils.counters
    counts.clear()
    compiled = torch.compile(patched, dynamic=True, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        for length in range(3, 53):
            tokens = torch.randint(1, TINY["vocab_size"], (2, length), generator=torch.Generator().manual_seed(length))
            mask = torch.ones_like(tokens)
            mask[1, : length // 3] = 0
            logits = compiled(input_ids=tokens, attention_mask=mask).logits
            if length % 10 == 3:
                close(logits[mask.bool()], hf(input_ids=tokens, attention_mask=mask).logits[mask.bool()],
                      f"logits at length {length}")
    assert counts["stats"]["unique_graphs"] <= 4, dict(counts["stats"])


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_padded_generation_gives_transformers_tokens(family: str, dtype: torch.dtype, cache: str) -> None:
    """Batched greedy decoding of a left-padded batch (as a tokenizer pads for generation), with
    the dynamic cache and with ``cache_implementation="static"``."""
    hf, patched = pair(family, dtype)
    tokens, mask, _ = padded_batch("left")
    kw = {**GREEDY, "max_new_tokens": 8, "attention_mask": mask}
    if cache == "static":
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        assert torch.equal(patched.generate(tokens, **kw), hf.generate(tokens, **kw))


@pytest.mark.parametrize("family", list(CONFIGS))
def test_static_cache_generation_compiles_as_on_a_gpu(family: str) -> None:
    """On a GPU, ``generate(cache_implementation="static")`` compiles the model's forward
    (transformers' ``CompileConfig``: mode "reduce-overhead", its decode step a CUDA graph); a CPU
    compiles it only when asked (``_compile_all_devices``, transformers' flag for tests). With
    ``fullgraph=True`` the patched model compiles with no graph break and gives the tokens of
    transformers' model, compiled and not (float64: no near tie of the tiny model's logits flips)."""
    from torch._dynamo.utils import counters

    hf, patched = pair(family, torch.float64)
    tokens, mask, _ = padded_batch("left")
    kw = {**GREEDY, "max_new_tokens": 6, "min_new_tokens": 6, "attention_mask": mask,
          "cache_implementation": "static"}
    with torch.no_grad():
        expected = hf.generate(tokens, **kw)
        compiled = {}
        for name, model in (("transformers", hf), ("patched", patched)):
            config = transformers.CompileConfig(fullgraph=True)
            config._compile_all_devices = True
            torch._dynamo.reset()
            counters.clear()
            compiled[name] = model.generate(tokens, compile_config=config, **kw)
            assert counters["stats"]["unique_graphs"] >= 1, f"{name}: generate() compiled nothing"
            assert not counters["graph_break"], dict(counters["graph_break"])
    assert torch.equal(compiled["transformers"], expected)
    assert torch.equal(compiled["patched"], expected)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_each_decode_step_runs_the_split_kv_decode_kernel(cache: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the cuda backend (through Triton's interpreter on a CPU machine, where kpt-cuda runs its
    portable kernels), batched greedy ``generate()`` of a left-padded batch gives transformers' tokens,
    and every decode step's attention (one query against the cache, with its padding mask) runs
    kpt-triton's split-KV decode kernel. (On Hopper a single query goes to cuDNN instead:
    kpt_cuda.attention.)"""
    attention = pytest.importorskip("kpt_triton.attention")
    decoded: list[tuple[int, ...]] = []
    decode = attention._decode

    def spy(q: torch.Tensor, *args: object, **kwargs: object) -> object:
        decoded.append(tuple(q.shape))
        return decode(q, *args, **kwargs)

    monkeypatch.setattr(attention, "_decode", spy)
    hf, patched = pair("llama")
    tokens, mask, _ = padded_batch("left")
    new = 4
    kw = {**GREEDY, "max_new_tokens": new, "min_new_tokens": new, "attention_mask": mask}
    if cache == "static":
        kw["cache_implementation"] = "static"
    with torch.no_grad(), kpt.use_backend("cuda"):
        assert torch.equal(patched.generate(tokens, **kw), hf.generate(tokens, **kw))
    steps = [shape for shape in decoded if shape[2] == 1]
    # every step after the prompt's, in each of the model's layers
    assert len(steps) == (new - 1) * TINY["num_hidden_layers"], decoded


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_kpt_generate_gives_transformers_tokens(family: str, compiled: bool) -> None:
    """`kpt.generate` on a left-padded batch gives ``generate()``'s greedy tokens, for the patched
    model and the unpatched one, with the model's end id (2: Llama's middle row ends early and is
    padded after it); compiled, the decode step is one graph with no break. A second call of the
    same shapes, with a shorter prompt, compiles nothing again."""
    from torch._dynamo.utils import counters

    hf, patched = pair(family, torch.float64)
    tokens, mask, _ = padded_batch("left")
    kw = {**GREEDY, "max_new_tokens": 8, "attention_mask": mask}
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        expected = hf.generate(tokens, **kw)
        shorter = hf.generate(tokens[:, 2:], **{**kw, "attention_mask": mask[:, 2:], "max_new_tokens": 10})
        for model in (hf, patched):
            got = kpt.generate(model, tokens, mask, max_new_tokens=8, pad_token_id=0, compile=compiled)
            assert torch.equal(got, expected), (got, expected)
            graphs = counters["stats"]["unique_graphs"]
            got = kpt.generate(model, tokens[:, 2:], mask[:, 2:], max_new_tokens=10, pad_token_id=0,
                               compile=compiled)
            assert torch.equal(got, shorter), (got, shorter)
            assert counters["stats"]["unique_graphs"] == graphs, "the second call compiled again"
    assert (counters["stats"]["unique_graphs"] >= 1) == compiled
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("check_every", [1, 32])
def test_kpt_generate_stops_where_every_row_ended(check_every: int) -> None:
    """With each row's first generated token as an end id, every row ends at once: ``generate()``
    stops after one token, and so does `kpt.generate`, whether it looks at the rows on the host
    after that token (``check_every=1``) or only at the end."""
    hf, patched = pair("llama", torch.float64)
    tokens, mask, _ = padded_batch("left")
    with torch.no_grad():
        first = hf.generate(tokens, **GREEDY, attention_mask=mask, max_new_tokens=1)[:, -1].tolist()
        kw = {"max_new_tokens": 6, "eos_token_id": first}
        expected = hf.generate(tokens, **GREEDY, attention_mask=mask, **kw)
        got = kpt.generate(patched, tokens, mask, pad_token_id=0, compile=False, check_every=check_every, **kw)
    assert expected.shape[1] == tokens.shape[1] + 1
    assert torch.equal(got, expected), (got, expected)


def test_kpt_generate_with_a_sliding_window_gives_transformers_tokens() -> None:
    """A window shorter than the sequence (Mistral's): its static cache counts tokens on the host, so
    no CUDA graph is asked for it (`kpt.generate` refuses one) and the tokens are ``generate()``'s."""
    hf, patched = pair("mistral", torch.float64, sliding_window=4)
    tokens, mask, _ = padded_batch("left")
    with torch.no_grad():
        expected = hf.generate(tokens, **GREEDY, attention_mask=mask, max_new_tokens=8)
        assert torch.equal(kpt.generate(patched, tokens, mask, max_new_tokens=8, pad_token_id=0, compile=False),
                           expected)
        with pytest.raises(ValueError, match="sliding-window"):
            kpt.generate(patched, tokens, mask, max_new_tokens=8, cuda_graph=True)


def test_kpt_generate_keeps_nothing_of_a_freed_model() -> None:
    """The cache, compiled step and graph a model keeps for its next call go with the model."""
    hf, _ = pair("llama")
    tokens, mask, _ = padded_batch("left")
    kpt.generate(hf, tokens, mask, max_new_tokens=2, compile=False)
    model = weakref.ref(hf)
    del hf
    gc.collect()
    assert model() is None, "kpt.generate keeps the model alive"


def test_kpt_generate_refuses_what_it_cannot_decode() -> None:
    hf, _ = pair("llama")
    tokens, mask, _ = padded_batch("left")
    with pytest.raises(ValueError, match="max_new_tokens"):
        kpt.generate(hf, tokens, mask, max_new_tokens=0)
    with pytest.raises(ValueError, match="check_every"):
        kpt.generate(hf, tokens, mask, max_new_tokens=2, check_every=0)
    with pytest.raises(ValueError, match="token ids"):
        kpt.generate(hf, tokens.float(), mask, max_new_tokens=2)
    with pytest.raises(ValueError, match="attention_mask"):
        kpt.generate(hf, tokens, mask[:, 1:], max_new_tokens=2)
    with pytest.raises(ValueError, match="CUDA device"):
        kpt.generate(hf, tokens, mask, max_new_tokens=2, cuda_graph=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph needs a CUDA device")
@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_kpt_generate_replays_a_cuda_graph_with_transformers_tokens(backend: str) -> None:
    """On a GPU (float32), the decode step is captured once and replayed for every later token and
    call, and the tokens are ``generate()``'s, for a patched model on the given backend."""
    if backend not in {b.name for b in kpt.list_backends() if b.available}:
        pytest.skip(f"backend {backend!r} is not installed or cannot run here")
    hf, patched = pair("llama")
    hf, patched = hf.cuda(), patched.cuda()
    tokens, mask, _ = padded_batch("left")
    tokens, mask = tokens.cuda(), mask.cuda()
    with torch.no_grad(), kpt.use_backend(backend):
        expected = hf.generate(tokens, **GREEDY, attention_mask=mask, max_new_tokens=16, eos_token_id=None)
        for _ in range(2):
            got = kpt.generate(patched, tokens, mask, max_new_tokens=16, eos_token_id=[], pad_token_id=0)
            assert torch.equal(got, expected), (got, expected)
    from kpt.generate import _DECODERS

    assert _DECODERS[patched].replay is not None, "no CUDA graph was captured"


@pytest.mark.parametrize("family", list(CONFIGS))
def test_the_loss_of_a_bfloat16_model_is_float32(family: str) -> None:
    oracle, _ = pair(family, torch.float64)
    hf, patched = pair(family, torch.bfloat16)
    tokens, mask, labels = padded_batch("right")
    loss = patched(input_ids=tokens, attention_mask=mask, labels=labels).loss
    expected = hf(input_ids=tokens, attention_mask=mask, labels=labels).loss
    assert loss.dtype == expected.dtype == torch.float32
    exact = oracle(input_ids=tokens, attention_mask=mask, labels=labels).loss.item()
    # as close to the float64 model as transformers' own bfloat16 loss is, within 1.5x (or 2e-3)
    assert abs(loss.item() - exact) <= max(1.5 * abs(expected.item() - exact), 2e-3)


def test_positional_arguments_follow_the_installed_forward() -> None:
    """The patched loss forward matches positions to the class's own names (``past_key_values``,
    or ``cache`` from transformers 5.24) and passes everything on by keyword."""
    hf, patched = pair("llama")
    tokens, mask, labels = padded_batch("right")
    with torch.no_grad():
        close(patched(tokens, mask, labels=labels).loss, hf(tokens, mask, labels=labels).loss, "positional call")
        with pytest.raises(TypeError, match="positional"):
            patched(*([None] * 40))


def _tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer of the tiny vocabulary, made here (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, TINY["vocab_size"])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")


def _train(model: torch.nn.Module, collator: object, data: list[dict], out: Path
           ) -> tuple[list[float], list[torch.Tensor]]:
    # SGD: Adam divides the near-zero gradients by their own size, amplifying their rounding
    args = transformers.TrainingArguments(output_dir=str(out), per_device_train_batch_size=3, max_steps=3,
                                          optim="sgd", learning_rate=0.1, report_to=[], use_cpu=True,
                                          logging_steps=1, save_strategy="no", seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=collator)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("family", list(CONFIGS))
def test_mixed_precision_training_agrees(family: str, tmp_path: Path) -> None:
    """A float32 model trained under autocast to bfloat16 (mixed precision, as ``Trainer(bf16=True)``
    runs it; on a CPU machine, CPU autocast): the loss is float32 and the gradients are as near the
    float32 model's as transformers' own under autocast are (within twice their error, the bfloat16
    rounding of each). Before, rope refused float32 tables beside the projections' bfloat16 q, and
    the loss came back in bfloat16. Then three steps of ``Trainer(bf16=True)`` give transformers' losses."""
    hf, patched = pair(family)
    tokens, mask, labels = padded_batch("left")
    grads = []
    for model, autocast in ((hf, True), (patched, True), (copy.deepcopy(hf), False)):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=tokens, attention_mask=mask, labels=labels).loss
        assert loss.dtype == torch.float32
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    hf_grads, patched_grads, exact = grads
    assert patched_grads.keys() == exact.keys()
    for name, g in exact.items():
        own = float((hf_grads[name] - g).norm() / g.norm())
        assert float((patched_grads[name] - g).norm() / g.norm()) <= 2 * own + 1e-3, name
    losses = []
    for model in (hf, patched):
        args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=3, max_steps=3,
                                              optim="sgd", learning_rate=0.1, report_to=[], use_cpu=True, bf16=True,
                                              logging_steps=1, save_strategy="no", seed=0)
        data = [{"input_ids": t[m.bool()].tolist()} for t, m in zip(tokens, mask)] * 3
        tokenizer = _tokenizer()
        collate = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
        trainer.train()
        losses.append(torch.tensor([log["loss"] for log in trainer.state.log_history if "loss" in log]))
    assert len(losses[0]) == 3
    torch.testing.assert_close(losses[1], losses[0], rtol=2e-2, atol=2e-2)


def test_a_tuple_output_in_training_holds_the_loss_first() -> None:
    """``return_dict=False`` (or a config's ``return_dict=False``) with labels in training: a tuple
    whose first element is the loss, as transformers gives it (before, the patched loss asked the
    base model for its hidden states by name and failed on its tuple)."""
    hf, patched = pair("llama")
    tokens, mask, labels = padded_batch("left")
    expected = hf(input_ids=tokens, attention_mask=mask, labels=labels).loss
    got = patched(input_ids=tokens, attention_mask=mask, labels=labels, return_dict=False)
    assert isinstance(got, tuple)
    close(got[0], expected, "loss")
    patched.config.return_dict = False
    got = patched(input_ids=tokens, attention_mask=mask, labels=labels)
    assert isinstance(got, tuple)
    close(got[0], expected, "loss")


def test_trainer_evaluation_with_metrics_matches(tmp_path: Path) -> None:
    """``Trainer.evaluate`` with ``compute_metrics`` (which reads the logits): the patched model in
    evaluation gives its logits and loss, as transformers' model does (training, the fused loss
    gives no logits; before, evaluating a patched model failed in the Trainer's prediction step)."""
    hf, patched = pair("llama")
    tokenizer = _tokenizer()
    g = torch.Generator().manual_seed(4)
    texts = [" ".join(f"w{int(t)}" for t in torch.randint(2, TINY["vocab_size"], (n,), generator=g))
             for n in (9, 4, 13, 6, 11)]
    data = [{"input_ids": tokenizer(t)["input_ids"]} for t in texts]

    def metrics(prediction: transformers.EvalPrediction) -> dict[str, float]:
        logits, labels = torch.as_tensor(prediction.predictions), torch.as_tensor(prediction.label_ids)
        kept = labels[:, 1:] != -100
        return {"accuracy": float((logits[:, :-1].argmax(-1) == labels[:, 1:])[kept].float().mean()),
                "logit_sum": float(logits[:, :-1][kept].double().sum())}

    results = []
    for model in (hf, patched):
        args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=2, report_to=[],
                                              use_cpu=True)
        trainer = transformers.Trainer(model=model, args=args, eval_dataset=data, compute_metrics=metrics,
                                       data_collator=transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False))
        results.append(trainer.evaluate())
    for key in ("eval_loss", "eval_accuracy", "eval_logit_sum"):
        torch.testing.assert_close(results[1][key], results[0][key], rtol=1e-5, atol=1e-4, msg=key)


@pytest.mark.parametrize("collator", ["padding", "packing", "varlen"])
def test_trainer_with_a_padding_and_a_packing_collator_matches(collator: str, tmp_path: Path) -> None:
    """Three Trainer steps, patched against unpatched: a padding collator, a packing one (restarting
    ``position_ids``), and a packing one with FlashAttention's varlen offsets as well, given to a model
    loaded with ``flash_attention_2`` (the unpatched ``sdpa`` model keeps the documents apart by the
    positions, which the collator gives too)."""
    hf, patched = flash_pair("llama") if collator == "varlen" else pair("llama")
    g = torch.Generator().manual_seed(4)
    lengths = (9, 4, 13, 6, 11, 2, 8, 5, 12)
    tokenizer = _tokenizer()
    texts = [" ".join(f"w{int(t)}" for t in torch.randint(2, TINY["vocab_size"], (n,), generator=g)) for n in lengths]
    data = [{"input_ids": tokenizer(t)["input_ids"]} for t in texts]
    if collator == "padding":
        collate = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    else:
        collate = transformers.DataCollatorWithFlattening()
    losses, params = _train(hf, collate, data, tmp_path / "hf")
    if collator == "varlen":
        collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    p_losses, p_params = _train(patched, collate, data, tmp_path / "kpt")
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    torch.testing.assert_close(torch.tensor(p_losses), torch.tensor(losses), atol=1e-4, rtol=1e-4)
    for (name, _), p, q in zip(patched.named_parameters(), p_params, params):
        close(p, q, f"{name} after three steps")
