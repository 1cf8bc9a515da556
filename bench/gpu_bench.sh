#!/usr/bin/env bash
# Issue 7 on one GPU (run by the lead on the H200): the batched-runtime GPU tests, then the demo
# and v4-shape benchmark tables (markdown + JSON), v4-shape with a kernel profile. Every command
# has its own time limit so the whole script ends in under 6 minutes even when one hangs.
#
#   OUT=/some/dir bash bench/gpu_bench.sh        # results land in $OUT (default bench/results/<commit>)
#
# Exit code: 0 when every command succeeded, else the first failing command's code (2 = a row was
# refused as an invalid measurement: read its .err file).
set -uo pipefail
cd "$(dirname "$0")/.."
commit=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
OUT=${OUT:-bench/results/$commit}
mkdir -p "$OUT"
status=0
started=$SECONDS

step() {  # step LIMIT_S NAME COMMAND...: stdout to $OUT/NAME.out (or as redirected), stderr to $OUT/NAME.err
    local limit=$1 name=$2
    shift 2
    echo "== $name (limit ${limit}s, at $((SECONDS - started))s)" >&2
    timeout --kill-after=10 "$limit" "$@" 2> "$OUT/$name.err"
    local rc=$?
    if [ "$rc" -ne 0 ]; then
        echo "!! $name exited $rc$([ "$rc" -eq 124 ] && echo ' (time limit)'); tail of $OUT/$name.err:" >&2
        tail -n 15 "$OUT/$name.err" >&2
        [ "$status" -eq 0 ] && status=$rc
    fi
}

echo "commit $commit; results in $OUT" >&2
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1 || true

# 1. GPU tests of the batched runtime: graph decode == eager, replays counted, launches per
#    decode step equal at batch 1 and 32, bench end to end with a profile.
step 110 gpu_tests python3 -m pytest -m gpu tests/test_runtime_gpu.py -q -p no:cacheprovider -rA > "$OUT/gpu_tests.txt"

# 2. demo: pp and tg rows at batch 1, 8, 32 (JSON and the markdown table from one run).
step 120 bench_demo python3 -m inspector bench --model demo --pp 128,512,2048 --tg 128 --batch 1,8,32 \
    --reps 3 --format md --json-out "$OUT/bench_demo.json" > "$OUT/bench_demo.md"

# 3. v4-shape: one layer at DeepSeek-V4-Flash width (12.9 GB of bf16 experts), weights drawn on
#    the GPU (timing only; labelled in the footer), with the kernel profile. Prints the targets:
#    tg128 @ b1 against the weight-bandwidth bound, host time per decode step with graphs on.
step 100 bench_v4 python3 -m inspector bench --model v4-shape --pp 512 --tg 128 --batch 1 --reps 3 \
    --gpu-weights --profile --format md --json-out "$OUT/bench_v4.json" > "$OUT/bench_v4.md"

for table in bench_demo bench_v4; do
    [ -s "$OUT/$table.md" ] && { echo; echo "### $table"; cat "$OUT/$table.md"; }
done
tail -n 3 "$OUT/gpu_tests.txt" 2>/dev/null
echo "total $((SECONDS - started))s; exit $status" >&2
exit "$status"
