#!/usr/bin/env bash
# Where a real model's decode step spends its time, for a lent H200 (about 4 minutes): the Qwen3-30B-A3B and
# DeepSeek-V2-Lite shapes from bench/configs (random weights drawn on the GPU), tg128 @ b1 through the runtime
# every entry point uses, with the profiled repetition's kernel-share table (bench --profile).
#   bash bench/gpu_models_profile.sh [qwen3,dsv2]     # logs and JSON under $OUT (default bench/results/latest)
set -uo pipefail
cd "$(dirname "$0")/.."
MODELS=",${1:-qwen3,dsv2},"
OUT=${OUT:-bench/results/latest}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export MOEI_COMMIT=${MOEI_COMMIT:-$(cat bench/COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)}
stage() {  # stage LIMIT_S NAME COMMAND...
    local limit=$1 name=$2; shift 2
    echo "== $name (limit ${limit}s, at ${SECONDS}s)" | tee -a "$OUT/summary.txt"
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "   exit $?" | tee -a "$OUT/summary.txt"
    tail -n "${TAIL:-40}" "$OUT/$name.log" | sed 's/^/   | /' | tee -a "$OUT/summary.txt"
}
echo "commit $MOEI_COMMIT on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)" > "$OUT/summary.txt"
row() {  # row NAME CONFIG_DIR
    stage "${LIMIT:-200}" "$1" python3 -m inspector bench --model "$2" --weights random --pp none --tg 128 \
        --batch 1 --reps "${REPS:-2}" --profile --no-progress --format md --json-out "$OUT/$1.json"
}
[[ "$MODELS" == *",qwen3,"* ]] && row qwen3_tg128_profile bench/configs/qwen3-30b-a3b
[[ "$MODELS" == *",dsv2,"* ]] && row dsv2_lite_tg128_profile bench/configs/deepseek-v2-lite
exit 0
