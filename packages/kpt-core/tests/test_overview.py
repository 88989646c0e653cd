"""What a newcomer reads first: `kpt info`, and the error for a kernel name that does not exist."""

from __future__ import annotations

import sys

import pytest
import torch

import kpt
from kpt.cli import main


def test_kpt_info_shows_backends_choice_and_kernels(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "rich", None)  # without the cli extra: the plain table
    monkeypatch.setenv("KPT_BACKEND", "reference")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"kpt {kpt.__version__} (kernel contract v{kpt.CONTRACT_VERSION}), torch {torch.__version__}" in out
    assert kpt.list_backends().table() in out
    assert "kpt.get_backend() here: reference" in out
    assert "  rms_norm(x, weight=None, eps=1e-06)\n" in out
    assert f"kernels ({len(kpt.SPECS)};" in out


def test_kpt_info_draws_a_rich_table_with_the_cli_extra(capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KPT_BACKEND", "reference")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert kpt.list_backends().table() not in out
    assert all(f"│ {i.name} " in out for i in kpt.list_backends())
    assert "kpt.get_backend() here: reference" in out and "  rms_norm(x, weight=None, eps=1e-06)\n" in out


def test_kpt_info_names_the_variable_that_breaks_the_choice(capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KPT_BACKEND", "nope")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "kpt.get_backend() here: none: unknown kpt backend 'nope' (named by the KPT_BACKEND" in out


def test_unknown_kernel_is_a_kpt_error_listing_the_kernels() -> None:
    be = kpt.get_backend("reference")
    with pytest.raises(kpt.KernelInputError, match=r"unknown kpt kernel 'flash_attn'; the kernels: rms_norm, ") as info:
        be.call("flash_attn", torch.randn(2, 4))
    assert all(name in str(info.value) for name in kpt.SPECS)
    with pytest.raises(kpt.KernelInputError, match=r"'rms_nrom' \(did you mean 'rms_norm' or"):
        be.call("rms_nrom", torch.randn(2, 4))
