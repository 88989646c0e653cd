"""`kpt.patch` on tiny random-initialised transformers models of every supported family.

A patched copy and the model as transformers builds it run the same forward, loss, backward
and AdamW step; logits, loss, every parameter's gradient and the parameters after the step agree
within float32's tolerance. Backends: reference, and cuda (through Triton's interpreter on a CPU
machine: `nox -s models` sets TRITON_INTERPRET=1; without it the cuda case fails, it is not skipped).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import transformers

import kpt

TINY = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 64}
MOE = {"num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
       "shared_expert_intermediate_size": 24}
CONFIGS = {
    "llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config, "gemma": transformers.GemmaConfig, "gemma2": transformers.Gemma2Config,
    "gemma3_text": transformers.Gemma3TextConfig, "mixtral": transformers.MixtralConfig,
    "qwen2_moe": transformers.Qwen2MoeConfig, "qwen3_moe": transformers.Qwen3MoeConfig,
}
TOL = kpt.default_tolerance(torch.float32)
# what each family keeps as transformers has it: the reasons are the summary's (checked below)
LEFT = {"gemma2": {"Gemma2Attention (rotary + attention)", "loss"}}
ATTENTION = (True, False)  # kpt's attention kernel, or transformers' attention around kpt's rope


def tiny(family: str, seed: int = 0) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    config = CONFIGS[family](**TINY, **MOE)
    return transformers.AutoModelForCausalLM.from_config(config).float()


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.isfinite().all(), f"{what}: not finite"
    torch.testing.assert_close(actual, expected, atol=TOL.atol, rtol=TOL.rtol, msg=lambda m: f"{what}: {m}")


def step(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor | None = None,
         **batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Logits (no labels), loss (``labels``, the tokens unless given), gradients; then one SGD step.
    ``batch``: more arguments of both calls (``attention_mask``)."""
    logits = model(tokens, **batch).logits
    loss = model(tokens, labels=tokens if labels is None else labels, **batch).loss
    loss.backward()
    # a compiled model names its parameters after the module it wraps (``_orig_mod.``)
    grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    # SGD: Adam would divide the near-zero gradients by their own size, amplifying their rounding
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return logits.detach(), loss.detach(), grads


@pytest.mark.parametrize("backend", ["reference", "cuda"])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_patched_agrees_with_transformers(family: str, backend: str) -> None:
    hf = tiny(family)
    patched = copy.deepcopy(hf)
    summary = kpt.patch(patched)
    assert set(summary.left) == LEFT.get(family, set()) and summary.swapped, summary.table()
    agrees(hf, patched, backend)


BF16 = kpt.default_tolerance(torch.bfloat16)


@pytest.mark.parametrize(("family", "backend"), [*((f, "reference") for f in CONFIGS), ("llama", "cuda"),
                                                 ("mixtral", "cuda")])
def test_bfloat16_patched_is_as_accurate_as_transformers(family: str, backend: str) -> None:
    """In bfloat16 the two differ by roundings, so each is measured against the float32 model:
    the patched model's logits and gradients are as close to it as transformers' own bfloat16
    computation is (within 1.5x), or within twice bfloat16's relative-norm bound of one kernel (a
    weight's gradient passes through several kernels that each round their output to bfloat16, and
    the cuda backend's flash-attention backward rounds P and dS as FlashAttention does: measured up
    to 0.026 on these models); its loss, which the fused kernel returns in bfloat16, within one
    rounding (bfloat16's atol + rtol·loss)."""
    oracle = tiny(family)
    hf = copy.deepcopy(oracle).to(torch.bfloat16)
    patched = copy.deepcopy(hf)
    kpt.patch(patched)
    tokens = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    logits, loss, grads = step(oracle, tokens)
    h_logits, h_loss, h_grads = step(hf, tokens)
    with kpt.use_backend(backend):
        p_logits, p_loss, p_grads = step(patched, tokens)

    def error(t: torch.Tensor, ref: torch.Tensor) -> float:
        assert t.isfinite().all()
        return ((t.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()

    pairs = [("logits", p_logits, h_logits, logits), *((n, p_grads[n], h_grads[n], g) for n, g in grads.items())]
    for what, ours, theirs, ref in pairs:
        assert error(ours, ref) <= max(1.5 * error(theirs, ref), 2 * BF16.rel_norm), what
    assert abs(p_loss.item() - loss.item()) <= BF16.atol + BF16.rtol * abs(loss.item())


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text", "qwen2_moe"])
def test_rotary_only_patch_agrees_and_takes_padding(family: str) -> None:
    hf = tiny(family)
    patched = copy.deepcopy(hf)
    summary = kpt.patch(patched, attention=False)
    assert any("rotary on kpt" in kind for kind in summary.swapped), summary.table()
    assert not any("rotary + attention" in kind for kind in summary.swapped), summary.table()
    agrees(hf, patched, "reference")
    tokens = torch.randint(0, TINY["vocab_size"], (2, 7))
    mask = torch.ones_like(tokens)
    mask[0, :3] = 0
    with torch.no_grad():
        close(patched(tokens, attention_mask=mask).logits, hf(tokens, attention_mask=mask).logits, "padded logits")


def test_a_layer_left_on_transformers_attention_takes_kpts_padding_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """A patched model runs under kpt's mask function, which gives a padded batch as its ``[B, S]``
    key padding (`kpt.patch._key_padding`); a layer whose attention stays transformers' (here the
    first, by a reason made up for the test) gets it back as the whole ``[B, 1, S, S]`` mask."""
    patch_module = sys.modules["kpt.patch"]
    unsupported = patch_module._attention_unsupported
    monkeypatch.setattr(patch_module, "_attention_unsupported",
                        lambda module, config, attention: "left for the test" if module.layer_idx == 0
                        else unsupported(module, config, attention))
    hf = tiny("llama")
    patched = copy.deepcopy(hf)
    summary = kpt.patch(patched)
    assert any("rotary on kpt" in kind for kind in summary.swapped), summary.table()
    assert any("rotary + attention" in kind for kind in summary.swapped), summary.table()
    tokens = torch.randint(0, TINY["vocab_size"], (2, 7))
    for side in (slice(0, 3), slice(4, 7)):
        mask = torch.ones_like(tokens)
        mask[0, side] = 0
        with torch.no_grad():
            close(patched(tokens, attention_mask=mask).logits[mask.bool()],
                  hf(tokens, attention_mask=mask).logits[mask.bool()], "padded logits")


def agrees(hf: torch.nn.Module, patched: torch.nn.Module, backend: str) -> None:
    """`step` on both (the patched model on ``backend``): everything agrees within float32's tolerance."""
    tokens = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    logits, loss, grads = step(hf, tokens)
    with kpt.use_backend(backend):
        p_logits, p_loss, p_grads = step(patched, tokens)
    close(p_logits, logits, "logits")
    close(p_loss, loss, "loss")
    assert p_grads.keys() == grads.keys() and len(grads) == len(list(hf.parameters()))
    for name, g in grads.items():
        close(p_grads[name], g, f"gradient of {name}")
    for (name, p), q in zip(patched.named_parameters(), hf.parameters()):
        close(p.detach(), q.detach(), f"{name} after the SGD step")


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text", "mixtral"])
def test_unpatch_restores_the_model(family: str) -> None:
    model = tiny(family)
    keys = list(model.state_dict())
    tokens = torch.randint(0, TINY["vocab_size"], (1, 9))
    before = model(tokens).logits
    kinds = [type(m) for m in model.modules()]
    kpt.patch(model)
    assert list(model.state_dict()) == keys  # a checkpoint loads into the patched model unchanged
    assert any(isinstance(m, kpt.nn.RMSNorm) for m in model.modules())
    kpt.unpatch(model)
    assert [type(m) for m in model.modules()] == kinds
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert torch.equal(model(tokens).logits, before)
    with pytest.raises(kpt.KernelInputError, match="not patched"):
        kpt.unpatch(model)


def test_unknown_architecture_is_refused_untouched() -> None:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    kinds = [type(m) for m in model.modules()]
    with pytest.raises(kpt.KernelNotSupportedError, match="gpt2.*Nothing was changed"):
        kpt.patch(model)
    assert [type(m) for m in model.modules()] == kinds and not hasattr(model, "kpt_summary")


def test_failure_while_patching_undoes_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny("llama")
    kinds = [type(m) for m in model.modules()]

    setattr_ = torch.nn.Module.__setattr__

    def failing(self: torch.nn.Module, name: str, value: object) -> None:
        if isinstance(value, kpt.nn.GatedMLP):  # after the first layer's attention was patched
            raise RuntimeError("boom")
        setattr_(self, name, value)

    monkeypatch.setattr(torch.nn.Module, "__setattr__", failing)
    with pytest.raises(RuntimeError, match="boom"):
        kpt.patch(model)
    assert [type(m) for m in model.modules()] == kinds and not hasattr(model, "_kpt_undo")
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_patching_twice_is_a_clear_error() -> None:
    model = tiny("llama")
    kpt.patch(model)
    with pytest.raises(kpt.KernelInputError, match="patched already"):
        kpt.patch(model)
    tokens = torch.randint(0, TINY["vocab_size"], (2, 6))
    # an all-ones mask is no mask
    torch.testing.assert_close(model(tokens, attention_mask=torch.ones_like(tokens)).logits, model(tokens).logits)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_generation_with_the_kv_cache_matches(family: str) -> None:
    hf = tiny(family)
    patched = copy.deepcopy(hf)
    kpt.patch(patched)
    prompt = torch.randint(0, TINY["vocab_size"], (1, 5), generator=torch.Generator().manual_seed(2))
    kw = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(patched.generate(prompt, **kw), hf.generate(prompt, **kw))


def test_auto_loader_and_trainer(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = kpt.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY))
    assert "loss" in " ".join(model.kpt_summary.swapped)
    data = [{"input_ids": torch.randint(0, TINY["vocab_size"], (12,))} for _ in range(4)]
    for row in data:
        row["labels"] = row["input_ids"]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2,
                                          report_to=[], use_cpu=True, logging_steps=1, save_strategy="no")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    before = [p.detach().clone() for p in model.parameters()]
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_a_sliding_window_shorter_than_the_sequence() -> None:
    """kpt's attention takes the window as transformers' mask; transformers' attention around
    kpt's rope takes it too."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.MistralConfig(**TINY, sliding_window=4))
    tokens = torch.randint(0, TINY["vocab_size"], (1, 10))
    kernel, rotary = copy.deepcopy(hf), copy.deepcopy(hf)
    kpt.patch(kernel)
    kpt.patch(rotary, attention=False)
    with torch.no_grad():
        close(kernel(tokens).logits, hf(tokens).logits, "logits with a window of 4 (kpt's attention)")
        close(rotary(tokens).logits, hf(tokens).logits, "logits with a window of 4")


def test_a_saved_checkpoint_loads_into_the_patched_model(tmp_path: Path) -> None:
    hf = tiny("qwen3")
    hf.save_pretrained(tmp_path)
    patched = kpt.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert patched.kpt_summary.swapped and any(isinstance(m, kpt.nn.RMSNorm) for m in patched.modules())
    tokens = torch.randint(0, TINY["vocab_size"], (1, 8))
    with torch.no_grad():
        close(patched(tokens).logits, hf(tokens).logits, "logits after a save and a patched load")
    patched.save_pretrained(tmp_path / "again")  # and a patched model saves what transformers loads
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "again"))
    assert again.state_dict().keys() == hf.state_dict().keys()
    with torch.no_grad():
        close(again(tokens).logits, hf(tokens).logits, "logits after saving the patched model")


def padded(side: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, their 2-D attention mask and labels: rows of 9 and 5 real tokens, padded on ``side``.

    The labels ignore padding and each token right after it: the position that predicts that
    token is a padding query, which (left padding) sees no key and which transformers' own
    implementations compute differently (``sdpa``: zeros, as kpt; ``eager`` or a ``finfo.min``
    mask: its attention spread over every key)."""
    tokens = torch.randint(1, TINY["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(3))
    real = torch.ones_like(tokens, dtype=torch.bool)
    if side == "left":
        real[1, :4] = False
    else:
        real[1, 5:] = False
    tokens = tokens.masked_fill(~real, 0)
    return tokens, real.long(), tokens.masked_fill(~(real & real.roll(1, -1)), -100)


def additive(real: torch.Tensor, masked: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 4-D additive mask of causal attention and key padding, as a user gives it to the model
    (and as transformers' ``eager`` masks are, with ``masked`` = ``torch.finfo(dtype).min``): 0 where a
    query attends a key, ``masked`` elsewhere."""
    seen = torch.ones(real.shape[1], real.shape[1], dtype=torch.bool).tril() & real.bool()[:, None, None, :]
    return torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, masked)


def agrees_on_real_tokens(hf: torch.nn.Module, patched: torch.nn.Module, tokens: torch.Tensor,
                          real: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> None:
    """`step` on both with ``attention_mask=mask``: logits on real tokens, loss and every gradient agree."""
    logits, loss, grads = step(hf, tokens, labels, attention_mask=mask)
    p_logits, p_loss, p_grads = step(patched, tokens, labels, attention_mask=mask)
    close(p_logits[real.bool()], logits[real.bool()], "logits on real tokens")
    close(p_loss, loss, "loss")
    assert p_grads.keys() == grads.keys() and len(grads) == len(list(hf.parameters()))
    for name, g in grads.items():
        close(p_grads[name], g, f"gradient of {name}")


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("masked", [float("-inf"), torch.finfo(torch.float32).min], ids=["-inf", "finfo.min"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_an_additive_padding_mask_gives_what_transformers_gives(family: str, masked: float, side: str) -> None:
    """A 4-D float mask of 0 and -inf (or the dtype's most negative value) given to the model is
    the boolean mask kpt's attention takes: the patched model gives what transformers' ``sdpa``
    gives with the same mask."""
    hf = tiny(family)
    patched = copy.deepcopy(hf)
    kpt.patch(patched)
    tokens, real, labels = padded(side)
    agrees_on_real_tokens(hf, patched, tokens, real, labels, additive(real, masked))


def test_an_additive_mask_kpt_cannot_compute_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bias (any value but 0 and a masked one) or a mask beyond the causal one raises, checked
    once per mask and again after the mask changes in place; an integer mask raises."""
    model = tiny("llama")
    kpt.patch(model)
    tokens, real, _ = padded("right")
    patch_module = sys.modules["kpt.patch"]
    checks, conditions = [], patch_module._mask_conditions

    def counted(*args: object) -> object:
        checks.append(args[0])
        return conditions(*args)

    monkeypatch.setattr(patch_module, "_mask_conditions", counted)
    mask = additive(real, float("-inf"))
    with torch.no_grad():
        model(tokens, attention_mask=mask)
        assert checks == [0], "a mask shared by both layers was not checked once, by the first"
        for bias in (-1.5, 0.3):
            mask[0, 0, 3, 1] = bias  # in place: the mask checked before is checked again
            with pytest.raises(kpt.KernelNotSupportedError, match=r"values other than 0 and -inf.*attention=False"):
                model(tokens, attention_mask=mask)
        with pytest.raises(kpt.KernelNotSupportedError, match="not within the causal mask"):
            model(tokens, attention_mask=torch.zeros(2, 1, 9, 9))
        with pytest.raises(kpt.KernelNotSupportedError, match="4-D boolean masks or additive"):
            model(tokens, attention_mask=(mask == 0).long())


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_model_loaded_with_eager_attention_is_patched_and_agrees(side: str) -> None:
    """A model loaded with ``attn_implementation="eager"`` runs kpt's attention with the masks
    transformers builds (under kpt's implementation, the ``sdpa`` ones) and gives what the unpatched
    ``eager`` model gives on a padded batch; unpatched, it is ``eager`` again. The summary lists the
    masks a patched attention takes."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY), attn_implementation="eager")
    patched = copy.deepcopy(hf)
    summary = kpt.patch(patched)
    attention = [kind for kind in summary.swapped if "rotary + attention on kpt" in kind]
    assert len(attention) == 1 and not summary.left, summary.table()
    masks = attention[0].partition("masks: ")[2].removesuffix(")")
    assert masks == ", ".join(sys.modules["kpt.patch"].MASKS_TAKEN) and "additive" in masks, summary.table()
    assert "attn_implementation 'eager' -> 'kpt'" in " ".join(summary.swapped), summary.table()
    tokens, real, labels = padded(side)
    agrees_on_real_tokens(hf, patched, tokens, real, labels, real)
    kpt.unpatch(patched)
    assert patched.config._attn_implementation == "eager"


def test_flex_attention_keeps_its_attention() -> None:
    """flex attention masks sequences its own way (block masks): its attention is left to transformers,
    with the reason. (A model loaded with flash_attention_2 is patched: models/test_flows.py.)"""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY),
                                                          attn_implementation="flex_attention")
    summary = kpt.patch(model)
    (why,) = (why for kind, (_, why) in summary.left.items() if "attention" in kind)
    assert "flex_attention" in why and "attn_implementation='sdpa'" in why, summary.table()
    assert not any("rotary + attention on kpt" in kind for kind in summary.swapped), summary.table()


def test_the_compiled_model_takes_an_additive_mask_with_no_graph_break() -> None:
    """Under ``torch.compile(fullgraph=True)`` an additive mask is checked in the graph, with no graph
    break (training, with labels): an exact one gives what transformers gives, and a bias or a key
    after the query still fails the run, with the message of the eager check."""
    hf = tiny("llama")
    patched = copy.deepcopy(hf)
    kpt.patch(patched)
    tokens, real, labels = padded("left")
    mask = additive(real, float("-inf"))
    explained = torch._dynamo.explain(patched)(tokens, attention_mask=mask, labels=labels)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(patched, fullgraph=True)
    agrees_on_real_tokens(hf, compiled, tokens, real, labels, mask)
    biased = mask.masked_fill(mask == 0, -1.5)
    with pytest.raises(RuntimeError, match="values other than 0 and -inf"):
        compiled(tokens, attention_mask=biased, labels=labels)
    with pytest.raises(RuntimeError, match="not within the causal mask"):
        compiled(tokens, attention_mask=torch.zeros_like(mask), labels=labels)
