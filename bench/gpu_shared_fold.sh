#!/usr/bin/env bash
# The shared experts inside the routed MoE GEMV launches (the flag shared_fold), for a lent H200, in one call of at
# most BUDGET_S seconds (default 600; every stage has its own limit, cut to what is left; most needed first):
#   tests    GPU tests: the fold's kernel at DeepSeek-V2-Lite's widths eager and replayed in a CUDA graph; the
#            fused decode step (V2-Lite widths cut to 3 layers, bf16) with the fold and without, against the torch
#            glue; graphed equal to eager with the fold, every decode record saying "routed launches"
#   ab       moe-inspector ab: the DeepSeek-V2-Lite shape tg128 @ b1 (random weights), shared_fold=off (A) against
#            on (B), rounds A B / B A in one process per side: B/A with a 95 % interval and a verdict
#   profile  the same row with shared_fold=on under --profile: _gate_up_kernel and _down_kernel 27 launches a step
#            (53 apart), no elementwise add per MoE layer, and the ratio to the active-weight bound
#   bash bench/gpu_shared_fold.sh [STAGES]     # logs and JSON under $OUT (default bench/results/latest)
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/stages.sh
stages_begin gpu_shared_fold.sh tests,ab,profile 600 "$@"
MODEL=(--model bench/configs/deepseek-v2-lite --weights random --pp none --tg 128 --batch 1)
want tests && TAIL=8 stage 200 pytest_gpu_shared_fold python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
    tests/test_moe_gemv_shared.py tests/test_decode_fused_mla.py
# the fold rounds a layer's output once where the separate path rounds three times: a near tie can flip a greedy
# token, so the row is compared with its tokens marked rather than refused
want ab && TAIL=24 stage 330 ab_shared_fold python3 -m inspector ab "${MODEL[@]}" --reps 2 \
    --a shared_fold=off --b shared_fold=on --rounds 6 --warmup 1 --allow-different-tokens \
    --json-out "$OUT/ab_shared_fold.json" --report "$OUT/ab_shared_fold.md"
want profile && TAIL=40 stage 70 v2_lite_tg128_fold python3 -m inspector bench "${MODEL[@]}" --reps 2 --profile \
    --no-progress --format md --set shared_fold=on --json-out "$OUT/v2_lite_tg128_fold.json"
