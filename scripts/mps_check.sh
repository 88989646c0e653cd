#!/usr/bin/env bash
# Check kpt-mps on a Mac with Apple silicon (macOS 14 or newer for bfloat16, PyTorch >= 2.6 with
# MPS): install the packages in place, list the backends, run the conformance suite on the real GPU
# (numerics, then the speed tests, which kpt-mps promises nothing for yet) and, for comparison,
# the same numerics through the Metal emulator on the CPU. Results go to the directory given ($1).
#   bash scripts/mps_check.sh reports/m3 [numerics] [perf] [emulate]
set -uo pipefail
out=${1:?usage: mps_check.sh OUTDIR [stages...]}; shift
stages=${*:-numerics perf emulate}
mkdir -p "$out"
python3 -m pip install -q --no-deps -e packages/kpt-core -e packages/kpt-conformance -e packages/kpt-mps || exit 1
{ sw_vers; sysctl -n machdep.cpu.brand_string
  python3 -c "import torch; print('torch', torch.__version__, 'mps built', torch.backends.mps.is_built(), 'available', torch.backends.mps.is_available())"
  python3 -c "import kpt; print(kpt.list_backends())"
} 2>&1 | tee "$out/environment.txt"
for stage in $stages; do
  case $stage in
    numerics) kpt check --backend mps --xfails conformance/xfails --report "$out/numerics" -- -q -k "not test_speed" \
                2>&1 | tail -n 40 ;;
    perf) kpt check --backend mps --report "$out/perf" -- -q -rs -k test_speed 2>&1 | tail -n 40 ;;
    emulate) KPT_MPS_EMULATE=1 kpt check --backend mps --xfails conformance/xfails --report "$out/emulate" -- -q \
               2>&1 | tail -n 40 ;;
  esac
done
