"""scripts/train_llama.py end to end on a CPU with ``--tiny``: each training mode kpt can run
here, the loss plot, and the forward on the fpga-sim backend with its U280 estimate."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "scripts" / "train_llama.py"
spec = importlib.util.spec_from_file_location("train_llama", SCRIPT)
assert spec is not None and spec.loader is not None
train_llama = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train_llama)


def test_tiny_runs_plot_and_fpga(tmp_path: Path) -> None:
    runs = []
    for mode in ("hf", "kpt"):
        out = tmp_path / f"{mode}.json"
        assert train_llama.main(["--tiny", "--mode", mode, "--steps", "3", "--warmup", "1", "--out", str(out)]) == 0
        runs.append(json.loads(out.read_text()))
    # the same model, corpus and step: the two implementations agree on the losses
    assert all(abs(a - b) < 1e-3 for a, b in zip(runs[0]["loss"], runs[1]["loss"]))
    assert runs[1]["tokens_per_s"] > 0 and len(runs[1]["loss"]) == 3
    png = tmp_path / "loss.png"
    train_llama.main(["--plot", str(tmp_path / "hf.json"), str(tmp_path / "kpt.json"), "--out", str(png)])
    assert png.read_bytes()[:4] == b"\x89PNG"
    fpga = tmp_path / "fpga.json"
    train_llama.main(["--tiny", "--fpga", "--fpga-seq", "16", "--out", str(fpga)])
    report = json.loads(fpga.read_text())
    assert report["finite"] and report["latency_ms"] > 0 and {"rms_norm", "attention", "linear"} <= set(
        report["latency_us_by_kernel"])
