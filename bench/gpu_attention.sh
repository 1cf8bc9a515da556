#!/usr/bin/env bash
# The attention GPU run for the lead (H200): bf16 kernel tests, the magnitude check honoured and
# dropped, then the benchmark. Everything printed is kept under $OUT (or bench/results/) with the
# commit measured. Exit status: the first failing step's, after running all of them.
# Usage: MOEI_COMMIT=$(git rev-parse HEAD) bash bench/gpu_attention.sh
set -u
cd "$(dirname "$0")/.."
export MOEI_COMMIT="${MOEI_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
results="${OUT:-bench/results}"
mkdir -p "$results"
status=0

step() {  # step NAME EXPECTED_EXIT COMMAND...
    local name=$1 expected=$2; shift 2
    echo "=== $name: $*"
    "$@" 2>&1 | tee "$results/$name.log"
    local code=${PIPESTATUS[0]}
    echo "=== $name: exit $code (expected $expected)"
    if [ "$code" != "$expected" ] && [ "$status" = 0 ]; then status=1; fi
}

step gpu_tests 0 python3 -m pytest -m gpu tests/test_attention_kernels.py -x -q
step check_honor 0 python3 -m inspector check-attention --device cuda --json
step check_drop 1 python3 -m inspector check-attention --device cuda --json --mode drop  # the incident: exit 1, verdict causal
step bench 0 python3 bench/attention_bench.py
echo "commit $MOEI_COMMIT; logs in $results"
exit $status
