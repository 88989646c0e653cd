#!/usr/bin/env bash
# What CI runs (README.md's test command): the same nox sessions as
#     nox -s lint wheels conformance install example aot usage models newest docs
# but lint first, then the rest in two streams at once, one for each core of a 2-core CI machine
# (most of their time is one Python thread: Triton's interpreter, the Metal emulator, the FPGA
# simulator). A line per session as it starts and as it ends (with its time) comes while the streams
# run; each stream's full output goes to build/ci/<0 or 1>.log, printed when every stream has ended,
# then every session's result; exits non-zero when any session failed.
#
# Disk: every session's virtualenv holds its own torch (about 0.9 GB), so the thirteen sessions
# would keep about 13 GB on disk to the end; a stream runs its sessions one at a time in its own
# envdir and deletes the virtualenv when the session ends, so at most two exist at once.
set -uo pipefail
cd "$(dirname "$0")/.."
echo "free disk at the start: $(df -h --output=avail . | tail -1 | tr -d ' ')"
mkdir -p build/ci
nox --envdir build/ci/env-lint -s lint || exit 1
rm -rf build/ci/env-lint
# nox -k matches substrings of session names: "cuda" is conformance(profile='cuda') on a machine
# with an NVIDIA GPU, conformance(profile='cuda-interpret') on one without; "newest" is the session
# `newest` and models(transformers='newest')
# balanced by a fresh-clone run on a 2-core machine with nothing else running (2026-12-05, seconds; 28
# minutes in all): stream 0 cuda-interpret 202, installs 113, example 81, aot 345, usage 168, models
# oldest 260, wheels 467, docs 40 (1,676); stream 1 the other profiles 677, newest 363, installs 111,
# models newest 247 (1,398)
streams=(
  "wheels or (conformance and cuda) or (aot and not aot_all) or example or docs or (models and oldest) or usage or (install and (reference or cuda or rocm))"
  "(conformance and not cuda) or newest or (install and (xpu or fpga or mps))"
)

# run_stream INDEX EXPRESSION: every session that `nox -k EXPRESSION` selects, one at a time, its
# output to build/ci/INDEX.log; a line on the terminal as each session starts and as it ends
run_stream() {
  local envdir="build/ci/env$1" log="build/ci/$1.log" status=0 name names start result
  : > "$log"
  names=$(nox -k "$2" --list --json 2>>"$log" | python3 -c 'import json, sys; print(*(s["session"] for s in json.load(sys.stdin)), sep="\n")') || return 1
  while IFS= read -r name; do
    echo "[$(date -u +%H:%M:%S)] stream $1: $name started"
    start=$SECONDS result=ok
    nox --envdir "$envdir" -s "$name" >>"$log" 2>&1 || { status=1 result=FAILED; }
    echo "[$(date -u +%H:%M:%S)] stream $1: $name $result in $((SECONDS - start)) s"
    rm -rf "$envdir"
  done <<< "$names"
  return $status
}

# one thread each: two streams of torch's default two OpenMP threads each, busy-waiting for one
# another on two cores, ran the reference and fpga-sim conformance in 365 s side by side (55 s
# alone); with one thread each, 52 s
pids=()
for i in "${!streams[@]}"; do
  OMP_NUM_THREADS=1 run_stream "$i" "${streams[$i]}" &
  pids[i]=$!
done
status=0
for i in "${!streams[@]}"; do
  wait "${pids[i]}" || status=1
  echo "===== stream $i: nox -k \"${streams[$i]}\""
  cat "build/ci/$i.log"
done
echo "===== every session"
grep -h -E '^nox > Session .* (was successful|failed|skipped)' build/ci/*.log
exit $status
