#!/usr/bin/env bash
# Check kpt-cuda on a GPU machine that has torch and triton preinstalled and no network:
# install the packages in place, then run the conformance suite (numerics, then speed),
# the benchmark and a memory check of every kernel. Results go to the directory given ($1).
#   bash scripts/gpu_check.sh reports/h100 [numerics] [perf] [bench] [memcheck] [sanitizers]
# (sanitizers: racecheck, synccheck and initcheck over every kernel, each report counted by the
# call and function that made it, the same tools over torch's own SDPA as the control for cuDNN's
# kernels, and racecheck over the valid-call fuzzing; not run by default: the slowest stage)
set -uo pipefail
out=${1:?usage: gpu_check.sh OUTDIR [stages...]}; shift
stages=${*:-numerics perf bench memcheck}
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation \
  -e packages/kpt-core -e packages/kpt-conformance -e packages/kpt-triton -e packages/kpt-cuda || exit 1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} | tee "$out/environment.txt"
for stage in $stages; do
  case $stage in
    numerics) kpt check --backend cuda --xfails conformance/xfails --report "$out/numerics" -- -q -k "not test_speed" \
                2>&1 | tail -n 40 ;;
    perf) kpt check --backend cuda --report "$out/perf" -- -q -rs -k test_speed 2>&1 | tail -n 40 ;;
    bench) python3 -m kpt.bench --backend cuda --out "$out/bench" 2>&1 | tail -n 60 ;;
    memcheck) compute-sanitizer --tool memcheck --print-limit 20 python3 scripts/every_kernel.py --backend cuda \
                2>&1 | tail -n 30 | tee "$out/memcheck.txt" ;;
    sanitizers) for tool in racecheck synccheck initcheck; do
                  compute-sanitizer --tool "$tool" --print-limit 0 --show-backtrace no python3 scripts/every_kernel.py \
                    --backend cuda --each 2>&1 | awk -f scripts/sanitizer_summary.awk > "$out/$tool.txt"
                  compute-sanitizer --tool "$tool" --print-limit 0 --show-backtrace no python3 \
                    scripts/sdpa_sanitizer_control.py 2>&1 | awk -f scripts/sanitizer_summary.awk > "$out/$tool-sdpa.txt"
                  grep -h "SUMMARY" "$out/$tool.txt" "$out/$tool-sdpa.txt"
                done
                compute-sanitizer --tool racecheck --print-limit 20 kpt check --backend cuda --report "$out/fuzz" \
                  -- -q -k test_fuzz_valid 2>&1 | tail -n 30 | tee "$out/racecheck-fuzz.txt" ;;
  esac
done
