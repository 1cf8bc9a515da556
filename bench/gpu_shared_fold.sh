#!/usr/bin/env bash
# The shared experts inside the routed MoE GEMV launches (the flag shared_fold), on a lent H200 (about 12 minutes):
#   1. GPU tests: the fold's kernel at DeepSeek-V2-Lite's widths eager and in a CUDA graph; the fused decode step
#      with the fold against the torch glue (3 layers of V2-Lite, bf16); graphed equal to eager with the fold
#   2. moe-inspector ab: DeepSeek-V2-Lite tg128 @ b1, random weights, shared_fold=off (A) against on (B), rounds
#      A B / B A in one process per side: B/A with a 95 % interval and a verdict (faster / slower / no change)
#   3. the bench with shared_fold=on under --profile: the kernel shares (gate-up and down 27 launches a step,
#      were 53; no vectorized_elementwise add) and the ratio to the active-weight bound
# Logs and JSON under $OUT (default bench/results/latest). Stages: STAGES="tests ab profile" (default all).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/latest}
STAGES=${STAGES:-tests ab profile}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
want() { [[ " $STAGES " == *" $1 "* ]]; }
stage() {  # stage LIMIT_S NAME COMMAND...
    local limit=$1 name=$2; shift 2
    echo "== $name (limit ${limit}s)"
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "   exit $?"
    tail -n "${TAIL:-12}" "$OUT/$name.log" | sed 's/^/   | /'
}
git rev-parse HEAD > "$OUT/COMMIT" 2>/dev/null || true
MODEL=(--model bench/configs/deepseek-v2-lite --weights random --pp none --tg 128 --batch 1)
if want tests; then
    TAIL=20 stage 300 pytest_gpu_shared_fold python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
        tests/test_moe_gemv_shared.py tests/test_decode_fused_mla.py
fi
if want ab; then
    # the fold rounds the layer's output once where the separate path rounds three times: a near tie can flip a
    # greedy token, so the row is compared with its tokens marked rather than refused
    TAIL=30 stage 480 ab_shared_fold python3 -m inspector ab "${MODEL[@]}" --reps 2 \
        --a shared_fold=off --b shared_fold=on --rounds 6 --warmup 1 --allow-different-tokens \
        --json-out "$OUT/ab_shared_fold.json" --report "$OUT/ab_shared_fold.md"
fi
if want profile; then
    TAIL=60 stage 300 v2_lite_tg128_fold python3 -m inspector bench "${MODEL[@]}" --reps 2 --profile \
        --set shared_fold=on --json-out "$OUT/v2_lite_tg128_fold.json"
fi
