"""``kpt fpga-report``: one-line mistakes, its own name in --help, and how estimate reads a
network (a torch.export program, a state dict with --factory, a pickle only with --trust-pickle)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from kpt_fpga_sim import estimate_model
from kpt_fpga_sim.__main__ import main
from kpt_fpga_sim.loading import example_model, from_program


def _kpt(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kpt", "fpga-report", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("args, words", [
    (("compare", "linear", "--shape", "4096,4096"), "--shape 4096,4096: expected M,N,K"),
    (("compare", "linear", "--shape", "64,64,64", "--device", "u999"), "unknown device profile 'u999'"),
    (("estimate", "model.pt", "--input-shape", "1,16"), "model.pt: no such file (kpt fpga-report example-model"),
])
def test_a_mistake_is_one_line(tmp_path: Path, args: tuple[str, ...], words: str) -> None:
    done = _kpt(*args, cwd=tmp_path)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("kpt fpga-report: error: ") and words in done.stderr


@pytest.mark.parametrize("args, words", [
    (["compare", "rms_norm", "--shape", "8,8,8"], "--shape is for linear and fp8_linear"),
    (["compare", "linear", "--case", "nope"], "linear has no case 'nope'"),
    (["compare", "linear", "--shape", "64,64,64", "--reuse", "two"], "--reuse two: expected comma-separated integers"),
    (["compare", "linear", "--shape", "64,64,64", "--dtype", "nope"], "--dtype nope: not a floating-point"),
    (["compare", "linear", "--shape", "64,64,64", "--clock", "-3"], "clock_mhz=-3.0"),
    (["compare", "linear", "--shape", "64,64,64", "--format", "ap_fixed<"], "number format 'ap_fixed<'"),
    (["estimate", "{model}", "--input-shape", "16"], "--input-shape 16: expected the example input's shape"),
    (["estimate", "{model}", "--input-shape", "1,17"], "--input-shape 1,17 does not fit the model"),
    (["estimate", "{model}", "--input-shape", "1,16", "--device", "u999"], "unknown device profile 'u999'"),
    (["estimate", "{model}", "--input-shape", "1,16", "--factory", "nope"], "--factory nope: expected module:callable"),
    (["estimate", "{model}", "--input-shape", "1,16", "--factory", "nope_nope:make"], "No module named 'nope_nope'"),
    (["example-model", "{model}"], "exists: give --force to replace it"),
])
def test_mistakes_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], words: str) -> None:
    model = tmp_path / "model.pt2"
    assert main(["example-model", str(model)]) == 0
    capsys.readouterr()
    assert main([a.format(model=model) for a in args]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err


def test_help_names_kpt_fpga_report(capsys: pytest.CaptureFixture[str]) -> None:
    from kpt.cli import main as kpt_main

    for args in (["fpga-report", "--help"], ["fpga-report", "estimate", "--help"]):
        with pytest.raises(SystemExit) as exit_info:
            kpt_main(args)
        out = capsys.readouterr().out
        assert exit_info.value.code == 0 and out.startswith(f"usage: kpt {' '.join(args[:-1])} ")
    assert "--trust-pickle" in out and "runs any code" in out and "example-model" in out


def test_the_example_model_is_estimated(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "model.pt2"
    assert main(["example-model", str(path)]) == 0
    assert f"kpt fpga-report estimate {path} --input-shape 1,16" in capsys.readouterr().out
    assert main(["estimate", str(path), "--input-shape", "1,16", "--json"]) == 0
    read = json.loads(capsys.readouterr().out)
    direct = estimate_model(example_model(), torch.zeros(1, 16)).as_dict()
    assert [layer["op"] for layer in read["layers"]] == ["Linear", "relu", "Linear", "softmax"]
    assert {k: v for k, v in read.items() if k != "model"} == {k: v for k, v in json.loads(
        json.dumps(direct, default=str)).items() if k != "model"}


def test_a_program_becomes_the_modules_it_was_made_of() -> None:
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Dropout(0.1), nn.Linear(64, 8), nn.Sigmoid(), nn.Linear(8, 4),
                          nn.Softmax(dim=1)).eval()
    with torch.no_grad():
        model[1].running_mean.uniform_()
        model[1].running_var.uniform_(0.5, 2.0)
    x = torch.randn(1, 1, 8, 8)
    rebuilt = from_program(torch.export.export(model, (x,)))
    torch.testing.assert_close(rebuilt(x), model(x))
    assert [type(m) for m in rebuilt.children()] == [type(m) for m in model if not isinstance(m, nn.Dropout)]
    same = estimate_model(rebuilt, x).as_dict(), estimate_model(model, x).as_dict()
    assert same[0]["layers"] == same[1]["layers"]


def test_an_operator_without_a_layer_is_refused() -> None:
    import kpt

    class Residual(nn.Module):
        def forward(self, x):
            return x + torch.relu(x)

    with pytest.raises(kpt.KernelNotSupportedError, match="is not a layer the estimate models"):
        from_program(torch.export.export(Residual(), (torch.zeros(1, 4),)))


class _Payload:
    """Unpickling this creates the marker file: the code a pickle runs."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_pickle_runs_nothing_without_trust_pickle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    marker, path = tmp_path / "ran", tmp_path / "model.pt"
    torch.save({"weight": _Payload(marker)}, path)
    assert main(["estimate", str(path), "--input-shape", "1,16"]) == 2
    assert "not a torch.export program" in capsys.readouterr().err
    factory = ["--factory", "kpt_fpga_sim.loading:example_model"]
    assert main(["estimate", str(path), "--input-shape", "1,16", *factory]) == 2
    assert "is not a state dict of tensors (a weights-only torch.load refused it)" in capsys.readouterr().err
    assert not marker.exists()
    assert main(["estimate", str(path), "--input-shape", "1,16", "--trust-pickle"]) == 2  # it ran, as the help warns
    assert marker.exists() and "is a dict, not a torch.nn.Module" in capsys.readouterr().err


def test_a_state_dict_with_a_factory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "weights.pt"
    torch.save(example_model().state_dict(), path)
    factory = ["--factory", "kpt_fpga_sim.loading:example_model"]
    assert main(["estimate", str(path), "--input-shape", "1,16", *factory, "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["layers"]) == 4
    torch.save(nn.Linear(3, 2).state_dict(), path)
    assert main(["estimate", str(path), "--input-shape", "1,16", *factory]) == 2
    assert "does not fit --factory kpt_fpga_sim.loading:example_model's module" in capsys.readouterr().err


def _rewrite(source: Path, target: Path, change) -> None:
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w") as dst:
        for name in src.namelist():
            data = change(name, src.read(name))
            if data is not None:
                dst.writestr(name, data)


@pytest.mark.parametrize("kind", ["pickled weight", "opaque constant", "aoti library"])
def test_a_program_that_would_unpickle_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  kind: str) -> None:
    plain, crafted = tmp_path / "plain.pt2", tmp_path / "crafted.pt2"
    assert main(["example-model", str(plain)]) == 0

    def change(name: str, data: bytes) -> bytes:
        if kind == "pickled weight" and name.endswith("weights/model_weights_config.json"):
            return data.replace(b'"use_pickle": false', b'"use_pickle": true', 1)
        if kind == "opaque constant" and name.endswith("constants/model_constants_config.json"):
            return json.dumps({"config": {"c": {"path_name": "opaque_obj_0", "use_pickle": False}}}).encode()
        return data

    _rewrite(plain, crafted, change)
    if kind == "aoti library":
        with zipfile.ZipFile(crafted, "a") as archive:
            archive.writestr("plain/data/aotinductor/model/model.so", b"\x7fELF")
    capsys.readouterr()
    assert main(["estimate", str(crafted), "--input-shape", "1,16"]) == 2
    assert "holds members that reading it would unpickle or load as code" in capsys.readouterr().err
