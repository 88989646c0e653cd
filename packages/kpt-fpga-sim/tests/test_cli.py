"""``python -m kpt_fpga_sim compare``: one row per directive choice, as a table or JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kpt_fpga_sim.__main__ import main


def test_compare_reuse_as_a_table(capsys) -> None:
    assert main(["compare", "linear", "--shape", "256,512,1024", "--reuse", "1,2,4"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "u250 @ 300 MHz, float32"
    rows = [line for line in lines if line.startswith("reuse=")]
    assert [r.split()[0] for r in rows] == ["reuse=1", "reuse=2", "reuse=4"]
    assert [int(r.split()[4]) for r in rows] == [1, 2, 4]          # the II column


def test_compare_as_json_on_a_conformance_case(capsys) -> None:
    assert main(["compare", "rms_norm", "--case", "llm", "--unroll", "8,64", "--device", "zynq7020",
                 "--format", "ap_fixed<16,6>", "--json"]) == 0
    reports = json.loads(capsys.readouterr().out)
    assert [r["variant"] for r in reports] == ["unroll=8", "unroll=64"]
    assert all(r["device"] == "zynq7020" and r["format"] == "ap_fixed<16,6,AP_TRN,AP_WRAP>" for r in reports)
    assert reports[1]["dsp"] > reports[0]["dsp"]


def test_module_entry_point() -> None:
    done = subprocess.run([sys.executable, "-m", "kpt_fpga_sim", "compare", "softmax", "--case", "odd",
                           "--dataflow", "on,off"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "dataflow=True" in done.stdout and "dataflow=False" in done.stdout


def test_kpt_fpga_report_is_the_same_table(capsys) -> None:
    from kpt.cli import main as kpt_main

    args = ["linear", "--shape", "256,512,1024", "--reuse", "1,2", "--device", "u280"]
    assert kpt_main(["fpga-report", "compare", *args]) == 0
    via_kpt = capsys.readouterr().out
    assert main(["compare", *args]) == 0
    assert via_kpt == capsys.readouterr().out and via_kpt.startswith("u280 @ 300 MHz, float32")


def test_kpt_fpga_report_help_is_the_simulators(capsys) -> None:
    from kpt.cli import main as kpt_main

    with pytest.raises(SystemExit) as exit_info:
        kpt_main(["fpga-report", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert all(command in out for command in ("compare", "estimate", "calibrate"))
