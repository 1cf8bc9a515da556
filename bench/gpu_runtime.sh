#!/usr/bin/env bash
# GPU runs of the one runtime (an H200, or any CUDA machine):
#   bash bench/gpu_runtime.sh runtime   the GPU tests of the runtime, the fused step, the MoE arms and every HF
#                                        family; v4-shape and demo tg128 @ b1 (their figures must hold)
#   bash bench/gpu_runtime.sh models    the Qwen3-30B-A3B shape (48 layers, random weights from config.json):
#                                        pp512, tg128 @ b1/b8/b32 against its active-weight bound; transformers'
#                                        own generate on the same shape; the TUI's generation path headless
# Logs go to $WORK; $OUT gets summary.txt, the JSON reports and logs.tgz. Textual travels as wheels in .whl/.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-runtime}
WORK=${WORK:-/tmp/moei-gpu}
OUT=${OUT:-bench/results/latest}
rm -rf "$WORK"; mkdir -p "$WORK" "$OUT"
export PYTHONUNBUFFERED=1 MOEI_CALIBRATION="$WORK/calibration.json"
started=$SECONDS
summary="$OUT/summary.txt"

stage() {  # stage LIMIT_S NAME COMMAND... ; output to $WORK/NAME.log, its tail to the summary
    local limit=$1 name=$2; shift 2
    echo "== $name (limit ${limit}s, at $((SECONDS - started))s)" | tee -a "$summary"
    timeout --kill-after=10 "$limit" "$@" > "$WORK/$name.log" 2>&1
    local rc=$?
    echo "   exit $rc$([ $rc -eq 124 ] && echo ' (time limit)')" | tee -a "$summary"
    tail -n "${TAIL:-8}" "$WORK/$name.log" | sed 's/^/   | /' | tee -a "$summary"
}

{
    echo "commit $(cat bench/COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)"
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader
    python3 -c "import torch, triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__)"
} 2>&1 | tee "$summary"

if [ "$mode" = runtime ]; then
    TAIL=30 stage 330 pytest_gpu python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
        tests/test_families_gpu.py tests/test_moe_gemv_clamped.py tests/test_runtime_gpu.py tests/test_engine_gpu.py \
        tests/test_decode_fused.py
    TAIL=30 stage 120 bench_v4 python3 -m inspector bench --model v4-shape --pp 512 --tg 128 --batch 1 --reps 3 \
        --gpu-weights --no-progress --format md --json-out "$OUT/bench_v4.json"
    TAIL=16 stage 100 bench_demo python3 -m inspector bench --model demo --pp 128 --tg 128 --batch 1,8 --reps 3 \
        --no-progress --format md --json-out "$OUT/bench_demo.json"
elif [ "$mode" = models ]; then
    QWEN=bench/configs/qwen3-30b-a3b
    if [ -n "${TESTS:-}" ]; then  # GPU tests to run first (a list of files)
        TAIL=20 stage 150 pytest_gpu python3 -m pytest -m gpu -q -p no:cacheprovider -rf $TESTS
    fi
    TAIL=40 stage 240 bench_qwen3 python3 -m inspector bench --model "$QWEN" --weights random --pp 512 --tg 128 \
        --batch 1,8,32 --reps 3 --no-progress --format md --json-out "$OUT/bench_qwen3.json"
    TAIL=4 stage 100 hf_peer python3 bench/hf_generate_peer.py --model "$QWEN" --tokens 128 --prompt 32 --reps 2 \
        --out "$OUT/hf_peer_qwen3.json"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        > "$WORK/wheels.log" 2>&1
    TAIL=4 PYTHONPATH=/tmp/site stage 100 tui_stream python3 bench/tui_stream.py --model "$QWEN" --weights random \
        --tokens 128 --out "$OUT/tui_stream_qwen3.json"
fi
echo "done at $((SECONDS - started))s" | tee -a "$summary"
tar -czf "$OUT/logs.tgz" -C "$WORK" . 2>/dev/null
