"""The vendor-native bodies' own logic, on the CPU: the unfused linear (cuBLAS's product on a GPU,
torch's CPU product here) against the float64 reference, and which library each attention call
goes to. Their GPU runs are checked by the conformance suite on a GPU."""

from __future__ import annotations

import pytest
import torch

import kpt
from kpt_cuda import attention, linear


@pytest.mark.parametrize("activation", [None, "relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_unfused_linear_matches_the_reference(activation, bias):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 24, generator=g)
    w = torch.randn(40, 24, generator=g) / 5
    b = torch.randn(40, generator=g) if bias else None
    y, pre = linear.linear_fwd(x, w, b, activation, block_m=16)  # GEMM tiles are accepted, unused
    expected = kpt.get_backend("reference").linear(x.double(), w.double(), None if b is None else b.double(),
                                                   activation=activation)
    torch.testing.assert_close(y, expected.float(), rtol=1e-5, atol=1e-5)
    assert y.shape == (3, 5, 40)
    assert pre.numel() == (0 if activation is None else y.numel())


def _lib(sq, skv, causal, d=128, dtype=torch.bfloat16, scale=0.1):
    return attention._library(torch.empty(1, 8, sq, d, dtype=dtype), torch.empty(1, 2, skv, d, dtype=dtype), causal,
                              scale)


def test_attention_library_choice():
    assert _lib(64, 64, True) == "cudnn"  # equal lengths: cuDNN's top-left mask is kpt's
    assert _lib(1, 4096, True) == "flash"  # a KV cache: FlashAttention's bottom-right mask
    assert _lib(8, 4096, False) == "flash"
    assert _lib(100, 10, True) is None  # queries that see no key: the portable kernel's zeros
    assert _lib(100, 10, False) == "flash"
    assert _lib(64, 0, False) is None
    assert _lib(64, 64, True, d=36) is None  # head dim not a multiple of 8
    assert _lib(64, 64, True, dtype=torch.float32) is None
    assert _lib(64, 64, True, scale=0.0) is None
    assert attention.available() is (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9)
