#!/usr/bin/env bash
# One GPU-machine session: GPU tests, then the benchmarks named on the command line, logs and JSON
# into $OUT (the device tool's return folder). Run from the repo root with `.peers` carried:
#   ATTN_GIT_COMMIT=<hash> bash benchmarks/gpu_session.sh "tests/..." bench_cascade.py bench_decode.py ...
# The first argument is the pytest selection for `-m gpu` ("-" skips the tests; "all" runs them all).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source .peers/install_bundle.sh >/dev/null 2>&1 || echo "no .peers bundle: FlashInfer and CUTLASS unavailable"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
tests=$1
shift
if [ "$tests" != "-" ]; then
    [ "$tests" = "all" ] && tests=tests
    # -n 8: the >2^31-element cache tests hold up to ~60 GB each (README)
    timeout 420 python -m pytest -m gpu -n 8 -q -p no:cacheprovider $tests >"$OUT/gpu_tests.log" 2>&1
    echo "gpu tests: exit $?"
    grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -3
    grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
fi
for bench in "$@"; do
    name=${bench%%.py*}
    echo "== $bench"
    python benchmarks/$bench --out "$OUT" >"$OUT/$name.log" 2>&1
    echo "exit $?"
    tail -15 "$OUT/$name.log"
done
