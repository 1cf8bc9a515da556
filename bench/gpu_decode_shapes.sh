#!/usr/bin/env bash
# The decode work on real model shapes, for a lent H200, in one call of at most BUDGET_S seconds (default 400;
# every stage has its own limit, cut to what is left; they run in this order, most needed first):
#   qwen3    Qwen3-30B-A3B shape tg128 @ b1 with its kernel profile (random weights from bench/configs)
#   dsv2     the DeepSeek fused step's GPU tests (V2-Lite widths cut to 3 layers, against the torch glue, graphed),
#            and the DeepSeek-V2-Lite shape tg128 @ b1 with its kernel profile
#   blocks   bench/experiments/moe_gemv_blocks.py --shapes qwen3,dsv2: every GEMV schedule candidate beside the pick
#   tests    GPU tests of the split argmax (a 151936-token row, graphed) and the Qwen3-MoE family (graphed decode
#            equals eager, every replay counted)
#   trellis  bench/trellis_bench.py --gemv-only (each code at the new default and the old schedule, each row
#            checked against the reference decode); later, the unrolled GEMV's GPU tests
#   mla      bench/mla_bench.py --sweep --sweep-quick at 4096 keys (every row checked against the reference: the
#            default and the structure candidates); later, the MLA GPU tests
#   demo     demo tg128 @ b1 (its figure must hold: run 57 read 21591 t/s)
#   bash bench/gpu_decode_shapes.sh [STAGES]     # logs and JSON under $OUT (default bench/results/latest)
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/stages.sh
stages_begin gpu_decode_shapes.sh qwen3,dsv2,blocks,tests,trellis,mla,demo 400 "$@"
BENCH=(python3 -m inspector bench --pp none --tg 128 --batch 1 --no-progress --format md)  # timeout runs no function
want qwen3 && TAIL=30 stage 65 qwen3_tg128 "${BENCH[@]}" --model bench/configs/qwen3-30b-a3b --weights random \
    --reps 2 --profile --json-out "$OUT/qwen3_tg128.json"
want dsv2 && TAIL=6 stage 60 pytest_dsv2 python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
    tests/test_decode_fused_mla.py
want dsv2 && TAIL=30 stage 55 dsv2_tg128 "${BENCH[@]}" --model bench/configs/deepseek-v2-lite --weights random \
    --reps 2 --profile --json-out "$OUT/dsv2_tg128.json"
want blocks && TAIL=16 stage 45 moe_gemv_blocks env OUT="$OUT" python3 bench/experiments/moe_gemv_blocks.py \
    --shapes qwen3,dsv2
want tests && TAIL=6 stage 50 pytest_gpu python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
    tests/test_decode_fused.py::test_gpu_next_tokens_splits_a_large_vocabulary_and_replays_in_a_graph \
    tests/test_families_gpu.py -k "next_tokens or qwen3"
want trellis && TAIL=30 stage 85 trellis_bench python3 bench/trellis_bench.py --gemv-only --out "$OUT"
want mla && TAIL=40 stage 110 mla_bench python3 bench/mla_bench.py --sweep --sweep-quick --tokens 4096 \
    --out "$OUT/mla_bench.json"
want demo && TAIL=8 stage 40 demo_tg128 "${BENCH[@]}" --model demo --reps 3 --json-out "$OUT/demo_tg128.json"
want mla && TAIL=6 stage 45 pytest_mla python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_attention_mla.py
want trellis && TAIL=6 stage 45 pytest_trellis python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
    tests/test_trellis_gemv_unrolled.py
echo "done in ${SECONDS}s" | tee -a "$SUMMARY"
exit 0
