"""`kpt.nn`: each layer against the torch computation it replaces (outputs and gradients), its
``state_dict`` against the module it replaces, and the backend it runs on (`kpt.backend_for`,
`kpt.use_backend`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kpt
from kpt.kernels.rope import rope_fwd

TOL = kpt.default_tolerance(torch.float32)


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.isfinite().all()
    torch.testing.assert_close(actual, expected, atol=TOL.atol, rtol=TOL.rtol)


def grads(out: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Gradients for a random upstream gradient, the same one for every output of one shape."""
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    return torch.autograd.grad(out, tensors, upstream)


def test_rms_norm_loads_torch_rms_norm_and_agrees() -> None:
    torch.manual_seed(0)
    ref = nn.RMSNorm(48, eps=1e-6)
    nn.init.normal_(ref.weight)
    ours = kpt.nn.RMSNorm(48, eps=1e-6)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(3, 5, 48, requires_grad=True)
    y, y_ref = ours(x), ref(x)
    close(y, y_ref)
    for a, b in zip(grads(y, x, ours.weight), grads(y_ref, x, ref.weight)):
        close(a, b)


def test_rms_norm_unit_offset_multiplies_by_one_plus_weight() -> None:
    torch.manual_seed(0)
    gemma = kpt.nn.RMSNorm(32, unit_offset=True)
    assert torch.equal(gemma.weight, torch.zeros(32))
    nn.init.normal_(gemma.weight)
    plain = kpt.nn.RMSNorm(32)
    with torch.no_grad():
        plain.weight.copy_(1 + gemma.weight)
    x = torch.randn(4, 32)
    close(gemma(x), plain(x))


def test_layer_norm_loads_torch_layer_norm_and_agrees() -> None:
    torch.manual_seed(0)
    ref = nn.LayerNorm(40)
    nn.init.normal_(ref.weight)
    nn.init.normal_(ref.bias)
    ours = kpt.nn.LayerNorm(40)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(6, 40, requires_grad=True)
    y, y_ref = ours(x), ref(x)
    close(y, y_ref)
    for a, b in zip(grads(y, x, ours.weight, ours.bias), grads(y_ref, x, ref.weight, ref.bias)):
        close(a, b)
    assert kpt.nn.LayerNorm(40, bias=False).bias is None
    with pytest.raises(kpt.KernelNotSupportedError, match="last dimension"):
        kpt.nn.LayerNorm((4, 40))


@pytest.mark.parametrize(("activation", "act"),
                         [("silu", F.silu), ("gelu_tanh", lambda t: F.gelu(t, approximate="tanh"))])
def test_gated_mlp(activation: str, act) -> None:
    torch.manual_seed(0)
    mlp = kpt.nn.GatedMLP(32, 64, activation)
    assert list(mlp.state_dict()) == ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
    x = torch.randn(2, 7, 32, requires_grad=True)
    y = mlp(x)
    y_ref = mlp.down_proj(act(mlp.gate_proj(x)) * mlp.up_proj(x))
    close(y, y_ref)
    for a, b in zip(grads(y, x, mlp.gate_proj.weight), grads(y_ref, x, mlp.gate_proj.weight)):
        close(a, b)
    with pytest.raises(kpt.KernelNotSupportedError, match="relu"):
        kpt.nn.GatedMLP(32, 64, "relu")


def _saved_shapes(fn) -> list[tuple[int, ...]]:
    """The shapes of the tensors autograd keeps for the backward of ``fn()``."""
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        fn()
    return shapes


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_gated_mlp_recomputes_the_product(bias: bool) -> None:
    """The default keeps gate and up but not their product for the backward, with every gradient
    as the plain path gives it; a down_proj with a hook runs as a module."""
    torch.manual_seed(1)
    mlp = kpt.nn.GatedMLP(16, 40, bias=bias, dtype=torch.float64)
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(3, 5, 16, dtype=torch.float64)
    runs = {}
    for recompute in (True, False):
        mlp.recompute = recompute
        saved = _saved_shapes(lambda r=recompute: runs.setdefault(r, mlp(x)))
        runs[recompute] = (runs[recompute], torch.autograd.grad(runs[recompute], [x, *mlp.parameters()], dy))
        products = [s for s in saved if s == (3, 5, 40)]  # gate, up (and the product without recompute)
        assert len(products) == (2 if recompute else 3)
    (y, g), (y_plain, g_plain) = runs[True], runs[False]
    torch.testing.assert_close(y, y_plain, rtol=0, atol=0)
    for a, b in zip(g, g_plain):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    mlp.recompute = True
    calls = []
    mlp.down_proj.register_forward_hook(lambda *args: calls.append(1))
    mlp(x)
    assert calls == [1]


def _products(fn) -> int:
    """How many matrix products ``fn()`` runs, those inside custom ops included (torch's profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.name in ("aten::mm", "aten::addmm", "aten::bmm") for e in prof.events())


def test_frozen_projections_get_no_gradient_and_cost_no_product() -> None:
    """A frozen down_proj or o_proj (an adapter's base weights) in kpt's custom ops: the backward
    computes no gradient for it, one matrix product fewer than with it trainable, and the input's
    gradient is the same."""
    torch.manual_seed(2)
    mlp = kpt.nn.GatedMLP(16, 40, bias=True, dtype=torch.float64)
    attn = kpt.nn.Attention(64, num_heads=4, num_kv_heads=2, bias=True, dtype=torch.float64)
    for layer, projection, width in ((mlp, mlp.down_proj, 16), (attn, attn.o_proj, 64)):
        x = torch.randn(3, 5, width, dtype=torch.float64, requires_grad=True)
        dy = torch.randn(3, 5, width, dtype=torch.float64)
        counts, dxs = [], []
        for trainable in (True, False):
            projection.requires_grad_(trainable)
            projection.zero_grad(set_to_none=True)
            y = layer(x)
            counts.append(_products(lambda y=y, dy=dy: y.backward(dy)))
            dxs.append(x.grad)
            x.grad = None
        assert projection.weight.grad is None and projection.bias.grad is None
        assert counts[0] - counts[1] == 1, counts
        torch.testing.assert_close(dxs[0], dxs[1], rtol=0, atol=0)


def test_rotary_tables_and_rotation() -> None:
    rotary = kpt.nn.RotaryEmbedding(16, base=500.0)
    positions = torch.arange(6)
    cos, sin = rotary.cos_sin(positions, torch.float32)
    i = torch.arange(8)
    angles = positions[:, None] * 500.0 ** (-2 * i / 16)
    close(cos, torch.cat((angles, angles), -1).cos())
    q, k = torch.randn(2, 4, 6, 16), torch.randn(2, 2, 6, 16)
    for got, want in zip(rotary(q, k, positions), rope_fwd(q, k, cos, sin)):
        close(got, want)
    assert "inv_freq" not in rotary.state_dict()


def reference_attention(attn: kpt.nn.Attention, x: torch.Tensor) -> torch.Tensor:
    b, s, _ = x.shape
    q = attn.q_proj(x).view(b, s, -1, attn.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(b, s, -1, attn.head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(b, s, -1, attn.head_dim).transpose(1, 2)
    cos, sin = attn.rotary.cos_sin(torch.arange(s), x.dtype)
    q, k = rope_fwd(q, k, cos, sin)
    groups = attn.num_heads // attn.num_kv_heads
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                         is_causal=True)
    return attn.o_proj(out.transpose(1, 2).reshape(b, s, -1))


def test_grouped_query_attention_agrees_with_sdpa() -> None:
    torch.manual_seed(0)
    attn = kpt.nn.Attention(64, num_heads=4, num_kv_heads=2)
    assert [k for k in attn.state_dict()] == [f"{p}_proj.weight" for p in "qkvo"]
    x = torch.randn(2, 9, 64, requires_grad=True)
    y, y_ref = attn(x), reference_attention(attn, x)
    close(y, y_ref)
    for a, b in zip(grads(y, x, attn.k_proj.weight), grads(y_ref, x, attn.k_proj.weight)):
        close(a, b)
    with pytest.raises(kpt.KernelInputError, match="multiple"):
        kpt.nn.Attention(64, num_heads=4, num_kv_heads=3)


def test_kv_cache_decoding_equals_the_full_sequence() -> None:
    torch.manual_seed(0)
    attn = kpt.nn.Attention(64, num_heads=4, num_kv_heads=1, layer=3)
    x = torch.randn(1, 8, 64)
    full = attn(x)
    cache = kpt.nn.KVCache()
    parts = [attn(x[:, :5], cache=cache)] + [attn(x[:, t:t + 1], cache=cache) for t in range(5, 8)]
    assert cache.length(3) == 8
    close(torch.cat(parts, dim=1), full)


def test_linear_cross_entropy_loss_agrees_with_the_logits_path() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(2, 6, 32, requires_grad=True)
    weight = torch.randn(50, 32, requires_grad=True)
    target = torch.randint(0, 50, (2, 6))
    target[0, :2] = -100
    loss = kpt.nn.LinearCrossEntropyLoss()(hidden, weight, target)
    loss_ref = F.cross_entropy((hidden @ weight.T).view(-1, 50), target.view(-1), ignore_index=-100)
    close(loss, loss_ref)
    for a, b in zip(grads(loss, hidden, weight), grads(loss_ref, hidden, weight)):
        close(a, b)


def test_moe_agrees_with_a_loop_over_tokens_and_experts() -> None:
    torch.manual_seed(0)
    moe = kpt.nn.MoE(32, 24, num_experts=4, top_k=2)
    assert list(moe.state_dict()) == ["gate.weight", "experts.gate_up_proj", "experts.down_proj"]
    x = torch.randn(3, 5, 32, requires_grad=True)
    y = moe(x)
    tokens = x.reshape(-1, 32)
    probs = (tokens @ moe.gate.weight.T).softmax(-1)
    top, idx = probs.topk(2, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    rows = []
    for t in range(tokens.shape[0]):
        row = 0
        for w, e in zip(top[t], idx[t]):
            gate, up = (moe.experts.gate_up_proj[e] @ tokens[t]).chunk(2)
            row = row + w * (moe.experts.down_proj[e] @ (F.silu(gate) * up))
        rows.append(row)
    y_ref = torch.stack(rows).view_as(x)
    close(y, y_ref)
    assert moe.router_logits is not None and moe.router_logits.shape == (15, 4)
    params = (x, moe.gate.weight, moe.experts.gate_up_proj, moe.experts.down_proj)
    for a, b in zip(grads(y, *params), grads(y_ref, *params)):
        close(a, b)


def test_fp8_linear_is_close_to_linear_and_refuses_training() -> None:
    torch.manual_seed(0)
    ref = nn.Linear(64, 32)
    fp8 = kpt.nn.FP8Linear(64, 32)
    fp8.load_state_dict(ref.state_dict())
    x = torch.randn(5, 64)
    with torch.no_grad():
        y, y_ref = fp8(x), ref(x)
    assert y.dtype == x.dtype
    # two e4m3 roundings (input and weight, 3-bit mantissas) in each product
    assert ((y - y_ref).norm() / y_ref.norm()).item() < 0.1
    with pytest.raises(kpt.KernelNotSupportedError, match="inference"):
        fp8(x)


def test_layers_run_on_the_backend_of_their_device_and_use_backend_pins_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KPT_BACKEND", raising=False)
    assert kpt.backend_for("cpu").name == "reference"
    calls = []
    reference = kpt.get_backend("reference")

    class Spy(type(reference)):  # the reference backend under another name, recording its calls
        name = "spy"

        def call(self, kernel, *args, **kwargs):
            calls.append(kernel)
            return super().call(kernel, *args, **kwargs)

    spy = Spy()
    norm = kpt.nn.RMSNorm(16)
    with kpt.use_backend(spy) as pinned:
        assert pinned is spy and kpt.get_backend() is spy and kpt.backend_for("cpu") is spy
        norm(torch.randn(2, 16))
    assert calls == ["rms_norm"]
    assert kpt.backend_for("cpu").name == "reference" and kpt.get_backend().name != "spy"
    with kpt.use_backend("reference") as pinned:
        assert pinned.name == "reference"
    with pytest.raises(kpt.BackendError, match="unknown kpt backend 'nope'"):
        with kpt.use_backend("nope"):
            pass
    monkeypatch.setenv("KPT_BACKEND", "nope")
    with pytest.raises(kpt.BackendError, match="KPT_BACKEND"):
        norm(torch.randn(2, 16))


def test_layers_compile_in_one_graph() -> None:
    """Once a device's backend is resolved (an eager call, or `kpt.patch`), kpt.nn layers trace
    under ``torch.compile(fullgraph=True)``, forward and backward, with the eager gradients."""
    torch.manual_seed(2)
    block = torch.nn.Sequential(kpt.nn.RMSNorm(64), kpt.nn.GatedMLP(64, 96))
    attention = kpt.nn.Attention(64, num_heads=4, num_kv_heads=2)
    for layer in (block, attention):
        x = torch.randn(2, 6, 64, requires_grad=True)
        eager = grads(layer(x), x)[0]
        torch._dynamo.reset()
        compiled = grads(torch.compile(layer, fullgraph=True)(x), x)[0]
        close(compiled, eager)


@pytest.mark.parametrize("layer", [kpt.nn.RMSNorm, kpt.nn.LayerNorm])
def test_a_norm_given_the_wrong_width_names_its_input(layer: type) -> None:
    with pytest.raises(kpt.KernelInputError, match=r"input has shape \(8, 32\); expected \[\.\.\., 64\]"):
        layer(64)(torch.randn(8, 32))


def test_a_kernel_call_under_autocast_computes_as_the_contract_says() -> None:
    """Autocast (mixed precision) stops at a kernel call: a float32 call gives the float32 result it
    gives without autocast, though the reference's body runs torch products autocast would take in
    bfloat16."""
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(5, 16, generator=g), torch.randn(8, 16, generator=g)
    reference = kpt.get_backend("reference")
    plain = reference.linear(x, weight, activation="gelu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = reference.linear(x, weight, activation="gelu")
    assert mixed.dtype == torch.float32 and torch.equal(mixed, plain)


def test_layers_built_on_products_take_autocasts_dtype() -> None:
    """Under autocast, `kpt.nn.LinearCrossEntropyLoss` multiplies bfloat16 operands, as ``F.linear``
    would (into the float32 logits the contract takes; its gradients reach the float32
    parameters), and returns a float32 loss."""
    torch.manual_seed(0)
    hidden = torch.randn(6, 16, requires_grad=True)
    weight = torch.randn(32, 16, requires_grad=True)
    target = torch.randint(0, 32, (6,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = kpt.nn.LinearCrossEntropyLoss()(hidden, weight, target)
    expected = F.cross_entropy(F.linear(hidden.bfloat16().float(), weight.bfloat16().float()), target)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected, atol=1e-4, rtol=1e-4)
    loss.backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.float32 and weight.grad.abs().sum() > 0
