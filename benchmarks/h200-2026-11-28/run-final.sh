python3 -m pip install -q --no-deps --no-build-isolation -e packages/kpt-core -e packages/kpt-conformance -e packages/kpt-triton -e packages/kpt-cuda liger_kernel-0.8.5-py3-none-any.whl > $OUT/install.txt 2>&1
timeout 75 compute-sanitizer --tool memcheck python3 benchmarks/h200-2026-11-28/decode-sanitize.py > $OUT/memcheck-decode.txt 2>&1; echo memcheck $?
timeout 165 kpt check --backend cuda --kernels attention --no-progress > $OUT/conformance-attention.txt 2>&1; echo conformance $?
timeout 110 kpt bench --backend cuda --kernels attention --sweep attention --graphs --no-host --out $OUT/sweep-attention-graphs > $OUT/sweep-attention-graphs.txt 2>&1; echo sweep $?
timeout 40 python3 -m pytest -q -p no:warnings packages/kpt-cuda/tests > $OUT/kpt-cuda-tests.txt 2>&1; echo cudatests $?
for f in $OUT/*.txt; do echo "== $f"; tail -n 3 $f; done
sed -n 9,10p $OUT/sweep-attention-graphs/bench.md; grep "decode" $OUT/sweep-attention-graphs/bench.md | grep "^| attention" | cut -d'|' -f3,6,9,12,13
