"""The rope spec against independent formulations (half-split and complex rotation, float64) and
the edge semantics of the contract."""

from __future__ import annotations

import pytest
import torch

import kpt

REF = kpt.get_backend("reference")
SPEC = kpt.SPECS["rope"]
CASES = [c for c in SPEC.cases() if not c.device_only]


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


def _half_split(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """out₁ = t₁ cos₁ − t₂ sin₁, out₂ = t₂ cos₂ + t₁ sin₂ (tables broadcast over heads)."""
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    t1, t2 = t.chunk(2, dim=-1)
    c1, c2 = cos.chunk(2, dim=-1)
    s1, s2 = sin.chunk(2, dim=-1)
    return torch.cat((t1 * c1 - t2 * s1, t2 * c2 + t1 * s2), dim=-1)


def _complex_rotation(t: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (t₁ᵢ, t₂ᵢ), read as the complex number t₁ᵢ + i·t₂ᵢ, by ``angles[..., i]``."""
    t1, t2 = t.chunk(2, dim=-1)
    z = torch.complex(t1, t2) * torch.polar(torch.ones_like(angles), angles)
    return torch.cat((z.real, z.imag), dim=-1)


def _angles(positions: torch.Tensor, dim: int) -> torch.Tensor:
    inv_freq = 1.0 / 10000.0 ** (torch.arange(dim // 2, dtype=torch.float64) * 2 / dim)
    return positions.to(torch.float64)[..., None] * inv_freq


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forward_and_backward_match_half_split_formula(case: kpt.Case) -> None:
    g = _generator()
    args = case.make(g, torch.float64)
    q, k = (args[n].detach().requires_grad_(True) for n in ("q", "k"))
    q_out, k_out = REF.rope(q, k, args["cos"], args["sin"])
    expected = (_half_split(q, args["cos"], args["sin"]), _half_split(k, args["cos"], args["sin"]))
    for got, want in zip((q_out, k_out), expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert got.is_contiguous() and got.dtype == want.dtype

    grads = [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in (q_out, k_out)]
    got = torch.autograd.grad((q_out, k_out), (q, k), grads)
    want = torch.autograd.grad(expected, (q, k), grads)
    for name, a, e in zip("qk", got, want):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12, msg=f"d{name}")


@pytest.mark.parametrize("per_sequence", [False, True])
def test_equals_complex_rotation_of_pairs(per_sequence: bool) -> None:
    g = _generator()
    b, s, d = 3, 20, 64
    q = torch.randn(b, 6, s, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, 2, s, d, generator=g, dtype=torch.float64)
    start = torch.randint(0, 5000, (b, 1) if per_sequence else (1,), generator=g)
    angles = _angles(start + torch.arange(s), d)
    table = torch.cat((angles, angles), dim=-1)
    q_out, k_out = REF.rope(q, k, table.cos(), table.sin())
    heads = angles.unsqueeze(1) if per_sequence else angles
    torch.testing.assert_close(q_out, _complex_rotation(q, heads))
    torch.testing.assert_close(k_out, _complex_rotation(k, heads))


def test_scores_depend_only_on_relative_position() -> None:
    g = _generator()
    q, k = torch.randn(2, 1, 4, 16, 128, generator=g, dtype=torch.float64)
    scores = []
    for offset in (0, 1234):
        table = _angles(offset + torch.arange(16), 128).repeat(1, 2)
        q_out, k_out = REF.rope(q, k, table.cos(), table.sin())
        scores.append(q_out @ k_out.transpose(-1, -2))
    torch.testing.assert_close(scores[0], scores[1], rtol=1e-9, atol=1e-9)


def test_backward_inverts_a_true_rotation() -> None:
    # a rotation is orthogonal: its transpose (the backward) undoes it
    g = _generator()
    q, k = torch.randn(2, 2, 3, 10, 32, generator=g, dtype=torch.float64)
    table = _angles(torch.arange(10), 32).repeat(1, 2)
    cos, sin = table.cos(), table.sin()
    q_out, k_out = SPEC.forward(q, k, cos, sin)
    dq, dk = SPEC.backward(q, k, cos, sin, q_out, k_out, q_out, k_out)
    torch.testing.assert_close(dq, q)
    torch.testing.assert_close(dk, k)


def test_missing_output_gradient_counts_as_zero() -> None:
    q, k = torch.randn(2, 1, 2, 5, 8)
    cos, sin = torch.randn(2, 5, 8)
    q_out, k_out = SPEC.forward(q, k, cos, sin)
    dk_out = torch.randn(k_out.shape)
    dq, dk = SPEC.backward(q, k, cos, sin, q_out, k_out, None, dk_out)
    assert torch.equal(dq, torch.zeros_like(q))
    _, dk_alone = SPEC.backward(q, k, cos, sin, q_out, k_out, torch.zeros_like(q_out), dk_out)
    assert torch.equal(dk, dk_alone)


def test_shared_tables_equal_repeated_per_sequence_tables() -> None:
    g = _generator()
    q, k = torch.randn(2, 4, 3, 9, 16, generator=g)
    cos, sin = torch.randn(2, 9, 16, generator=g)
    shared = REF.rope(q, k, cos, sin)
    repeated = REF.rope(q, k, cos.expand(4, 9, 16), sin.expand(4, 9, 16))
    for a, b in zip(shared, repeated):
        assert torch.equal(a, b)


def test_errors_name_the_argument() -> None:
    q, k, table = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16), torch.randn(8, 16)
    with pytest.raises(kpt.KernelInputError, match="rope: argument 'q' has head dimension 15"):
        REF.rope(q[..., :15], k[..., :15], table[:, :15], table[:, :15])
    with pytest.raises(kpt.KernelInputError, match="rope: argument 'cos' has shape"):
        REF.rope(q, k, table[:7], table[:7])
    with pytest.raises(kpt.KernelInputError, match="rope: argument 'sin' has dtype"):
        REF.rope(q, k, table, table.half())
