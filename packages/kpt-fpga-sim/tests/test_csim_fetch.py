"""The ap_types download is safe: the pinned wheel only, no member outside its directory, and an
offline failure that says how to provide the headers."""

from __future__ import annotations

import subprocess
import zipfile

import pytest

from kpt_fpga_sim import csim

_DIR = "hls4ml/templates/vivado/ap_types/"


def _wheel(path, members: dict[str, bytes]):
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def test_unpack_keeps_the_directory_and_refuses_escapes(tmp_path) -> None:
    good = _wheel(tmp_path / "good.whl", {_DIR + "ap_fixed.h": b"// ok", _DIR + "etc/ap_int_base.h": b"// ok",
                                          "hls4ml/other.py": b"x"})
    out = tmp_path / "out"
    out.mkdir()
    csim.unpack_ap_types(good, out)
    assert (out / "ap_fixed.h").read_bytes() == b"// ok" and (out / "etc" / "ap_int_base.h").exists()
    assert not (out / "other.py").exists()
    for bad in (_DIR + "../../../../escaped.h", _DIR + "etc/../../escaped.h", _DIR + "/abs.h"):
        target = tmp_path / "bad"
        target.mkdir(exist_ok=True)
        with pytest.raises(csim.CsimIntegrityError, match="leaves"):
            csim.unpack_ap_types(_wheel(tmp_path / "bad.whl", {bad: b"!"}), target)
        assert not list(tmp_path.rglob("escaped.h")) and not list(tmp_path.rglob("abs.h"))


def test_only_the_pinned_wheel_is_accepted(tmp_path, monkeypatch) -> None:
    fake = _wheel(tmp_path / csim.WHEEL, {_DIR + "ap_fixed.h": b"// not the real one"})
    with pytest.raises(csim.CsimIntegrityError, match="sha256"):
        csim.check_wheel(fake)
    # a wheel placed in the cache is checked too, before anything is unpacked
    monkeypatch.setenv("KPT_FPGA_SIM_CACHE", str(tmp_path))
    with pytest.raises(csim.CsimIntegrityError):
        csim.ap_types_dir()
    assert not csim.cache_dir().exists()


def test_offline_error_names_the_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KPT_FPGA_SIM_CACHE", str(tmp_path))

    def no_network(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version (network unreachable)")

    monkeypatch.setattr(csim.subprocess, "run", no_network)
    with pytest.raises(csim.CsimUnavailable, match="KPT_FPGA_SIM_CACHE") as info:
        csim.ap_types_dir()
    assert csim.WHEEL_SHA256 in str(info.value)
