#!/usr/bin/env bash
# The GPU work of one integration of several branches, in two calls of under ten minutes each on one H200
# (every stage under its own limit, the whole call under a deadline, BUDGET_S, default 555 s):
#
#   bash bench/gpu_integrate.sh 1   every GPU test file (the new families, MLA, trellis and routing tests first,
#                                   then the kernels', the decode step's and the runtime's), the trellis bench
#                                   (bench/trellis_bench.py) and v4 tg128 @ b1 (the decode headline, unchanged?)
#   bash bench/gpu_integrate.sh 2   the families' GPU tests with their tracebacks, routing record, replay and
#                                   recording cost (bench/gpu_routing.sh without its tests and memory stage), the
#                                   v4-shape trellis sweep, the runtime's GPU tests, check-attention --mla and
#                                   the MLA kernel bench
#
# Logs under $OUT (default bench/results/latest), one per stage, and summary.txt; the commit measured is
# bench/COMMIT (a copied tree has no git).
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${1:-1}
OUT=${OUT:-bench/results/latest}
WORK=${WORK:-/tmp/moei-integrate}
rm -rf "$WORK"; mkdir -p "$WORK" "$OUT"
export PYTHONUNBUFFERED=1 MOEI_CALIBRATION="$WORK/calibration.json"
export MOEI_COMMIT=${MOEI_COMMIT:-$(cat bench/COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)}
DEADLINE=$((SECONDS + ${BUDGET_S:-555}))
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }

stage() {  # stage LIMIT_S NAME COMMAND... ; output to $OUT/NAME.log; the limit shrinks to the time left
    local want=$1 name=$2; shift 2
    local left=$((DEADLINE - SECONDS - 5))
    if [ "$left" -lt 15 ]; then say "== $name: not run (deadline)"; return; fi
    local limit=$((want < left ? want : left))
    local begun=$SECONDS
    timeout --kill-after=5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    say "== $name: exit $rc$([ $rc -eq 124 ] && echo ' (time limit)') in $((SECONDS - begun)) s (limit $limit s)"
    tail -n "${TAIL:-6}" "$OUT/$name.log" | cut -c1-220 | sed 's/^/   | /' | tee -a "$SUMMARY"
}

say "gpu_integrate.sh part $PART at $MOEI_COMMIT"
say "$(nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader 2>&1 | head -1)"
say "$(python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1)"

PYTEST=(python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --durations=12)
routing() {  # bench/gpu_routing.sh without its tests (part 1 runs them) and its memory stage; logs in $OUT/routing
    local budget=${ROUTING_S:-165}
    mkdir -p "$OUT/routing"
    TAIL=40 stage $((budget + 5)) routing env ROUTING_TOKENS=1,4,16,64,256,1024,4096 BUDGET_S=$budget \
        OUT="$OUT/routing" WORK="$WORK/routing" bash bench/gpu_routing.sh record,sweep,ab
}
if [ "$PART" = 1 ]; then
    TAIL=30 stage 280 pytest_new "${PYTEST[@]}" tests/test_trellis_kernels.py tests/test_trellis_gpu.py \
        tests/test_routing_gpu.py tests/test_families_gpu.py tests/test_attention_mla.py tests/test_hf_deepseek.py \
        tests/test_session_steps.py tests/test_sweep_timing.py tests/test_trace.py
    TAIL=20 stage 190 pytest_old "${PYTEST[@]}" tests/test_attention_kernels.py tests/test_decode_fused.py \
        tests/test_engine_gpu.py tests/test_moe_gemv_clamped.py tests/test_moe_kernels.py tests/test_runtime_gpu.py
    TAIL=40 stage 160 trellis_bench python3 bench/trellis_bench.py --out "$OUT"
    TAIL=14 stage 70 v4_tg128 python3 -m inspector bench --model v4-shape --pp none --tg 128 --batch 1 --reps 3 \
        --gpu-weights --format md --json-out "$OUT/v4_tg128.json"
elif [ "$PART" = 2 ]; then
    TAIL=40 stage 100 pytest_families "${PYTEST[@]}" --tb=short tests/test_families_gpu.py
    routing
    TAIL=30 stage 110 trellis_sweep bash -c "python3 -m inspector sweep --model v4-shape \
        --experts trellis:K=2,code=hyb --tokens 1,64,2048,8192 --json \
        --calibration $WORK/trellis-calibration.json > $OUT/sweep_trellis.json"
    [ -s "$OUT/sweep_trellis.json" ] && python3 -m inspector.commands.sweep "$OUT/sweep_trellis.json" \
        > "$OUT/sweep_trellis.txt" 2>&1
    TAIL=20 stage 110 pytest_runtime "${PYTEST[@]}" --tb=short tests/test_runtime_gpu.py
    TAIL=12 stage 35 check_mla python3 -m inspector check-attention --mla --device cuda
    TAIL=30 stage 90 mla_bench python3 bench/mla_bench.py --out "$OUT/mla_bench.json"
elif [ "$PART" = routing ]; then
    TAIL=30 stage 40 pytest_gpt_oss "${PYTEST[@]}" --tb=short -x tests/test_families_gpu.py -k "gpt-oss and graphed"
    ROUTING_S=$((DEADLINE - SECONDS - 20)) routing
fi
say "done in $SECONDS s"
exit 0
