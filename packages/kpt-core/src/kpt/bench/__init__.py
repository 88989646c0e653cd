"""kpt.bench: kpt's kernels timed beside torch eager, torch.compile and the libraries, the
docs/performance.md way (``python -m kpt.bench``, or ``kpt bench``).

Its modules, each importing only those listed before it:

- `kpt.bench.timing`: the clocks (device events, the wall clock, CUDA-graph replays) and the
  device's `Ceilings` (copy bandwidth, bf16 matrix product) measured in the same run;
- `kpt.bench.peers`: what kpt is compared with: torch eager, torch.compile, the libraries
  (SDPA, cuBLAS, ``torch._scaled_mm``, ``torch._grouped_mm``, Liger-Kernel);
- `kpt.bench.measure`: one kernel at one shape in one mode, gated on correctness (`Measurement`);
- `kpt.bench.host`: the host's share of a small call, beside an empty kernel's launch;
- `kpt.bench.report`: each kernel's worst ratio and the Markdown report (``bench.md``);
- `kpt.bench.sweeps`: the shapes of each sweep and `run_sweep`, which measures them;
- `kpt.bench.roofline`: the roofline picture of a recorded run (``python -m kpt.bench.roofline``);
- `kpt.bench.command`: the command line (``python -m kpt.bench`` and ``kpt bench``).
"""
