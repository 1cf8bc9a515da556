#!/usr/bin/env bash
# The DeepSeek / MLA GPU work in one call, for a lent H200 (about 8 minutes):
#   1. GPU tests: the MLA kernel in bf16 on odd sizes and under a CUDA graph, check-attention --mla,
#      the three families against transformers' own bf16 error (fused MLA arm executing), the fused
#      decode step at V2-Lite's widths against the torch glue, graphed equal to eager
#   2. check-attention --mla at DeepSeek-V3's shape (must say: causal), and --mode drop (must say: unmasked)
#   3. bench/mla_bench.py --sweep: batch 64, 128 heads, latent 512 + 64, caches 4096 and 8192
#   4. DeepSeek-V2-Lite shape, random weights drawn on the GPU: tg128 @ b1 against the active-weight bound
# Logs and JSON under $OUT (default bench/results/latest).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/latest}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
stage() {  # stage LIMIT_S NAME COMMAND...
    local limit=$1 name=$2; shift 2
    echo "== $name (limit ${limit}s)"
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "   exit $?"
    tail -n "${TAIL:-12}" "$OUT/$name.log" | sed 's/^/   | /'
}
git rev-parse HEAD > "$OUT/COMMIT" 2>/dev/null || true
TAIL=20 stage 240 pytest_gpu_deepseek python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
    tests/test_attention_mla.py tests/test_hf_deepseek.py tests/test_decode_fused_mla.py
stage 90 check_mla_honor python3 -m inspector check-attention --mla --device cuda
stage 90 check_mla_drop python3 -m inspector check-attention --mla --device cuda --mode drop
TAIL=40 stage 240 mla_bench python3 bench/mla_bench.py --sweep --out "$OUT/mla_bench.json"
TAIL=25 stage 300 v2_lite_tg128 python3 -m inspector bench --model bench/configs/deepseek-v2-lite --weights random \
    --pp 128 --tg 128 --batch 1 --reps 3 --json-out "$OUT/v2_lite_tg128.json"
