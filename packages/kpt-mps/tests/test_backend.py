from __future__ import annotations

import sys
from importlib import resources

import kpt_mps
import pytest
import torch
from kpt_mps import device, metal, plugin
from kpt_mps.families import FAMILIES

import kpt
from kpt.kernels.attention import attention_hidden_pairs_add_nothing
from kpt.testing import check_backward, check_forward, compare


def test_plugin_returns_one_backend():
    (be,) = plugin.kpt_backends()
    assert isinstance(be, kpt_mps.MpsBackend) and be.name == "mps"


def test_every_contract_kernel_has_a_metal_body():
    kernels = kpt_mps.MpsBackend().kernels()
    assert set(kernels) == set(kpt.SPECS) and kpt.missing_kernels(kernels) == {}
    shaders = resources.files("kpt_mps").joinpath("shaders")
    for module in FAMILIES:
        family = module.__name__.rsplit(".", 1)[-1]
        assert shaders.joinpath(f"{family}.metal").is_file(), family


@pytest.mark.skipif(sys.platform == "darwin", reason="checks the reason given off macOS")
def test_listed_with_its_reason_off_macos(monkeypatch):
    monkeypatch.delenv("KPT_MPS_EMULATE", raising=False)
    info = {i.name: i for i in kpt.reload_backends(strict=True).list()}["mps"]
    assert (info.vendor, info.device_type, info.available) == ("Apple", "mps", False)
    assert info.reason.startswith("not macOS (KPT_MPS_EMULATE=1 runs the shaders")


def test_emulated_backend_is_a_simulator_on_cpu(emulated):
    be = kpt.reload_backends(strict=True).find("mps")
    assert be.is_available() == (True, "")
    assert be.simulator and be.device() == torch.device("cpu") and be.conformance_profile == "mps-emulate"
    assert "Metal emulator" in be.environment()["device"]
    assert kpt.get_backend() is not be  # a simulator is never picked automatically


def test_float64_is_refused(emulated):
    be = kpt.get_backend("mps")
    with pytest.raises(kpt.KernelInputError, match="float64"):
        be.rms_norm(torch.randn(2, 8, dtype=torch.float64))


def test_bfloat16_below_macos_14_is_not_supported(monkeypatch):
    monkeypatch.setattr(device, "bf16_supported", lambda: False)
    monkeypatch.setattr(metal, "emulated", lambda: False)
    be = kpt_mps.MpsBackend()
    assert be.unsupported("rms_norm", {"x": torch.ones(2, dtype=torch.bfloat16)}) == \
        "bfloat16 on MPS needs macOS 14 or newer"
    assert be.unsupported("dequantize_fp8", {"dtype": torch.bfloat16}) is not None
    assert be.unsupported("rms_norm", {"x": torch.ones(2)}) is None


def test_a_gradient_through_the_emulated_shaders(emulated):
    be = kpt.get_backend("mps")
    ref = kpt.get_backend("reference")
    x = torch.randn(3, 40, requires_grad=True)
    w = torch.randn(40, requires_grad=True)
    be.layer_norm(x, w).square().sum().backward()
    gx, gw = x.grad, w.grad
    x.grad = w.grad = None
    ref.layer_norm(x, w).square().sum().backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)


def test_moe_gating_ranks_nan_first_as_the_reference(emulated):
    # NaN ranks above +inf (torch.topk's and the reference's stable sort's order), NaNs and equal
    # logits among themselves by expert index; a row holding a NaN has NaN probabilities
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[1.0, nan, 3.0, nan, inf, -0.0, 0.0, -inf],
                           [0.5, 2.0, 2.0, -1.0, 0.5, 7.0, -inf, 2.0],
                           [nan, nan, nan, nan, nan, nan, nan, nan]])
    weights, indices = kpt.get_backend("mps").moe_gating(logits, k=8, renormalize=False)
    ref_weights, ref_indices = kpt.get_backend("reference").moe_gating(logits, k=8, renormalize=False)
    assert indices.tolist() == ref_indices.tolist()
    assert indices[0].tolist() == [1, 3, 4, 2, 0, 5, 6, 7]
    torch.testing.assert_close(weights, ref_weights, equal_nan=True)


def test_attention_scores_overflowing_float32_give_the_float32_softmax(emulated):
    # q·kᵀ overflows float32 in the rows holding ±max: the reference's float32 softmax is NaN there
    # (inf − inf), and so is the kernel's (a NaN softmax denominator is not a query without keys)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 13, 16, generator=g) for _ in range(3))
    q[0, 0, 3, 5], q[0, 1, 10, 0] = torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max
    for causal in (False, True):
        o = kpt.get_backend("mps").attention(q, k, v, causal=causal)
        ref = kpt.get_backend("reference").attention(q, k, v, causal=causal)
        assert ref.isnan().any()
        torch.testing.assert_close(o, ref, equal_nan=True)


def test_cross_entropy_of_large_logits_loses_no_precision_to_the_log_sum_exp(emulated):
    # logits near ±1e4 whose largest two lie within 2 of each other: half of the rows' targets are
    # their maximum (a loss of about log 2), the others the runner-up. The float32 sum m + log Σ exp
    # is up to 2^-11 off there, 1e-3 of those losses and of the two probabilities near 1/2
    g = torch.Generator().manual_seed(3)
    logits = (torch.rand(6, 40, generator=g) * 2 - 1) * 1e4
    top = logits.argmax(1)
    logits[:, 0] = logits[torch.arange(6), top] - torch.rand(6, generator=g) * 2
    args = {"logits": logits, "target": torch.where(torch.arange(6) % 2 == 0, top, 0), "ignore_index": -100,
            "label_smoothing": 0.0, "reduction": "none"}
    spec, mps = kpt.SPECS["cross_entropy"], kpt.get_backend("mps")
    forward = check_forward(mps, spec, args, torch.float32)
    assert forward.ok, forward.message
    backward = check_backward(mps, spec, args, torch.float32, g)
    assert backward.ok, backward.message


# (input, row, value, causal) for q [1, 2, 70, 32] and k, v [1, 1, 60, 32] (causal: queries 0..9 see
# no key): a NaN or ±inf score in a row; a key hidden from the first queries, in a key block that
# the forward loads for some of them (masked) and never loads for the others, with NaN in k (masked
# away) or inf or NaN in v (the reference's p · v gives 0 · inf = NaN in that column for every query
# the key is hidden from, those that see no key included)
ATTENTION_SPECIALS = {
    "nan_query": ("q", 30, float("nan"), False),
    "inf_key": ("k", 3, float("inf"), False),
    "neg_inf_key_causal": ("k", 40, float("-inf"), True),
    "hidden_nan_key": ("k", 55, float("nan"), True),
    "hidden_inf_value": ("v", 55, float("inf"), True),
    "hidden_nan_value": ("v", 50, float("nan"), True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ATTENTION_SPECIALS.values(), ids=ATTENTION_SPECIALS.keys())
def test_attention_forward_special_values_match_the_reference(emulated, case, dtype):
    """o and lse carry inf and NaN exactly where the float64 reference does (`kpt.kernels`), and
    their finite values are within the default tolerance."""
    from kpt_mps.attention import attention_fwd

    name, row, value, causal = case
    g = torch.Generator().manual_seed(13)
    a = {"q": torch.randn(1, 2, 70, 32, generator=g), "k": torch.randn(1, 1, 60, 32, generator=g),
         "v": torch.randn(1, 1, 60, 32, generator=g)}
    a = {n: t.to(dtype) for n, t in a.items()}
    a[name][0, 0, row, 5] = value
    scale = 32**-0.5
    o, lse = attention_fwd(a["q"], a["k"], a["v"], causal, scale, None)
    o64, lse64 = kpt.SPECS["attention"].forward(*(t.double() for t in a.values()), causal, scale, None)
    assert o64.isnan().any() or lse64.isinf().any() or lse64.isnan().any()  # the case holds a special value
    for out, ref, what in ((o, o64, "o"), (lse, lse64, "lse")):
        out = out.double()
        assert torch.equal(out.isnan(), ref.isnan()), f"{what}: NaN at other places than the reference's"
        assert torch.equal(out.isinf(), ref.isinf()), f"{what}: inf at other places than the reference's"
        assert torch.equal(out[ref.isinf()], ref[ref.isinf()]), f"{what}: infinities of other signs"
        check = compare(what, out[ref.isfinite()], ref[ref.isfinite()], kpt.default_tolerance(dtype))
        assert check.ok, check.message


@pytest.mark.parametrize("case", ATTENTION_SPECIALS.values(), ids=ATTENTION_SPECIALS.keys())
def test_attention_gradients_with_special_values_match_either_oracle(emulated, case):
    """Each gradient element is the reference's or the one where the pairs the causal mask hides
    add nothing (`kpt.kernels`, "Special values")."""
    name, row, value, causal = case
    g = torch.Generator().manual_seed(13)
    args = {"q": torch.randn(1, 2, 70, 32, generator=g), "k": torch.randn(1, 1, 60, 32, generator=g),
            "v": torch.randn(1, 1, 60, 32, generator=g), "causal": causal, "scale": None}
    args[name][0, 0, row, 5] = value
    report = check_backward(kpt.get_backend("mps"), kpt.SPECS["attention"], args, torch.float32, g,
                            alternative=attention_hidden_pairs_add_nothing)
    assert report.ok, report.message


def test_attention_gradients_of_a_query_whose_only_score_is_minus_inf(emulated):
    """A query whose visible scores are all -inf sees no key (lse = -inf): the backward's p is 0
    there, as the reference's, not exp(-inf + inf) = NaN, so its dq is 0."""
    g = torch.Generator().manual_seed(0)
    args = {"q": torch.randn(1, 2, 13, 16, generator=g), "k": torch.randn(1, 1, 1, 16, generator=g),
            "v": torch.randn(1, 1, 1, 16, generator=g), "causal": False, "scale": None}
    args["q"][0, 0, 3, 5] = -float("inf") * args["k"][0, 0, 0, 5].sign()
    report = check_backward(kpt.get_backend("mps"), kpt.SPECS["attention"], args, torch.float32, g,
                            alternative=attention_hidden_pairs_add_nothing)
    assert report.ok, report.message
