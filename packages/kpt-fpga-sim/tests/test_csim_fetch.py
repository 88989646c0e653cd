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


def _headers(path, files: dict[str, bytes]):
    path.mkdir(parents=True, mode=0o700)
    for name, data in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    return path


def test_a_prefilled_header_directory_is_used_only_with_the_pinned_digest(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KPT_FPGA_SIM_CACHE", str(tmp_path))
    planted = _headers(csim.cache_dir(), {"ap_fixed.h": b"#error planted", "etc/ap_int_base.h": b"// ok"})
    with pytest.raises(csim.CsimIntegrityError, match="expected " + csim.AP_TYPES_SHA256):
        csim.ap_types_dir()
    monkeypatch.setattr(csim, "AP_TYPES_SHA256", csim.tree_digest(planted))  # the digest, not the name, decides
    assert csim.ap_types_dir() == planted
    (planted / "etc" / "ap_int_base.h").write_bytes(b"// changed after the fact")
    with pytest.raises(csim.CsimIntegrityError, match="digest"):
        csim.ap_types_dir()


def test_a_header_directory_with_a_link_or_open_to_others_is_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KPT_FPGA_SIM_CACHE", str(tmp_path))
    headers = _headers(csim.cache_dir(), {"ap_fixed.h": b"// ok"})
    (tmp_path / "elsewhere.h").write_bytes(b"// anyone's")
    (headers / "ap_int.h").symlink_to(tmp_path / "elsewhere.h")
    with pytest.raises(csim.CsimIntegrityError, match="ap_int.h is not a regular file"):
        csim.ap_types_dir()
    (headers / "ap_int.h").unlink()
    monkeypatch.setattr(csim, "AP_TYPES_SHA256", csim.tree_digest(headers))
    headers.chmod(0o777)
    with pytest.raises(csim.CsimIntegrityError, match="can be written by others"):
        csim.ap_types_dir()


def test_a_cache_others_can_write_is_refused(tmp_path, monkeypatch) -> None:
    tmp_path.chmod(0o777)
    monkeypatch.setenv("KPT_FPGA_SIM_CACHE", str(tmp_path))
    with pytest.raises(PermissionError, match="can be written by others"):
        csim.ap_types_dir()


def test_pip_downloads_only_a_wheel_under_a_timeout(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KPT_FPGA_SIM_CACHE", str(tmp_path))
    calls = []

    def pip(cmd, **kwargs):
        calls.append((cmd, kwargs))
        return subprocess.CompletedProcess(cmd, 1, "", "offline")

    monkeypatch.setattr(csim.subprocess, "run", pip)
    with pytest.raises(csim.CsimUnavailable):
        csim.ap_types_dir()
    [(cmd, kwargs)] = calls
    assert "--only-binary=:all:" in cmd and kwargs["timeout"] > 0  # an sdist's build code never runs


def test_the_compiler_and_the_program_run_under_a_timeout(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(csim, "ap_types_dir", lambda: tmp_path)
    monkeypatch.setattr(csim, "compiler", lambda: "g++")
    calls = []

    def hangs(cmd, **kwargs):
        calls.append(kwargs.get("timeout"))
        if len(calls) == 1:
            return subprocess.CompletedProcess(cmd, 0, "", "")  # g++ "built" the program
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])

    monkeypatch.setattr(csim.subprocess, "run", hangs)
    with pytest.raises(RuntimeError, match="kernel ran past its 120 s timeout"):
        csim.run("int main() { for (;;); }")
    assert calls == [csim.COMPILE_TIMEOUT_S, csim.RUN_TIMEOUT_S]
