#!/usr/bin/env bash
# The GPU runs the project uses, each stage under its own time limit (bench/README.md says what each prints;
# A/B runs of flag values or source trees are `moe-inspector ab`'s).
#
#   bash bench/gpu_all.sh tests     every GPU test, check-attention honoured and dropped, the attention bench,
#                                   the MoE compile report, a short v4 sweep and its summary against the targets
#   bash bench/gpu_all.sh decode    the decode step's GPU tests, v4 tg128 @ b1 three times (the headline figure),
#                                   a profiled v4 row (kernel shares), the host step, the demo table
#   bash bench/gpu_all.sh train     train the demo checkpoint (engine/weights/demo/), sample it, drop vs honor
#
# Logs go under $WORK (default /tmp/moei-gpu), then into $OUT as one tarball. Each log's footer names the
# commit measured ($MOEI_COMMIT, or bench/COMMIT in a copied tree without git).
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-tests}
WORK=${WORK:-/tmp/moei-gpu}
OUT=${OUT:-bench/results/latest}
rm -rf "$WORK"; mkdir -p "$WORK" "$OUT"
export PYTHONUNBUFFERED=1 MOEI_CALIBRATION="$WORK/calibration.json"
commit=$(cat bench/COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)
export MOEI_COMMIT=$commit
started=$SECONDS

stage() {  # stage LIMIT_S NAME COMMAND... ; output to $WORK/NAME.log
    local limit=$1 name=$2; shift 2
    echo "== $name (limit ${limit}s, at $((SECONDS - started))s)"
    timeout --kill-after=10 "$limit" "$@" > "$WORK/$name.log" 2>&1
    local rc=$?
    echo "   exit $rc$([ $rc -eq 124 ] && echo ' (time limit)')"
    tail -n "${TAIL:-6}" "$WORK/$name.log" | sed 's/^/   | /'
}

v4() {  # v4 NAME [bench arguments]: the v4 tg128 @ b1 row (the decode target), markdown and JSON
    local name=$1; shift
    TAIL=${TAIL:-12} stage 100 "$name" python3 -m inspector bench --model v4-shape --pp 128 --tg 128 --batch 1 \
        --reps 3 --gpu-weights --format md --json-out "$WORK/$name.json" "$@"
}

summary() {  # the tg128 rows and host lines of every v4 log, into $WORK/summary.txt
    for f in "$WORK"/v4_*.log; do echo "== $(basename "$f")"; grep -E "^\\| tg128|^- host time|^- the device" "$f" \
        | cut -c1-200; done > "$WORK/summary.txt"
    cat "$WORK/summary.txt"
}

{
    echo "commit $commit"
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader
    python3 -c "import torch, triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__)"
} > "$WORK/env.txt" 2>&1
cat "$WORK/env.txt"

if [ "$mode" = tests ]; then
    TAIL=25 stage 360 pytest_gpu python3 -m pytest -m gpu -q -p no:cacheprovider -rf --durations=5
    stage 60 check_honor python3 -m inspector check-attention --device cuda
    stage 60 check_drop python3 -m inspector check-attention --device cuda --mode drop
    TAIL=30 stage 150 attention_bench python3 bench/attention_bench.py
    stage 60 moe_compile_report python3 bench/moe_compile_report.py
    TAIL=10 stage 150 sweep_short bash -c "python3 -m inspector sweep --model v4-shape --tokens 1,8,16,128,512,2048,8192 \
        --json --calibration '$WORK/calibration.json' > '$WORK/sweep_short.json'"
    [ -s "$WORK/sweep_short.json" ] && TAIL=20 stage 30 moe_summary python3 bench/moe_summary.py "$WORK/sweep_short.json"
elif [ "$mode" = decode ]; then
    TAIL=25 stage 300 pytest_gpu python3 -m pytest -m gpu -q -p no:cacheprovider -rf --durations=5 \
        tests/test_decode_fused.py tests/test_runtime_gpu.py tests/test_engine_gpu.py
    TAIL=12 stage 150 pytest_moe python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_moe_kernels.py \
        -k "gemv or arms"
    for round in 1 2 3; do v4 "v4_$round"; done
    TAIL=40 v4 v4_profile --profile
    TAIL=12 stage 60 host_step python3 bench/host_step.py --device cuda --model v4-shape --steps 2000
    TAIL=30 stage 100 bench_demo python3 -m inspector bench --model demo --pp 128,512 --tg 128 --batch 1,8,32 \
        --reps 3 --format md --json-out "$WORK/bench_demo.json"
    summary
elif [ "$mode" = train ]; then
    TAIL=8 stage 330 train_demo python3 train/train_demo.py --minutes "${MINUTES:-4}" --out engine/weights/demo/model.safetensors
    cp engine/weights/demo/model.safetensors engine/weights/demo/training.json "$OUT"/ 2>/dev/null
    DOC="Python supports the usual logical conditions from mathematics: a comparison operator checks two values"
    TAIL=3 stage 60 sample_doc python3 -m inspector generate --model demo --prompt "$DOC" --max-tokens 64 --json
    LONG=$(python3 -c "import pydoc_data.topics as t; print(t.topics['if'][:600])")
    TAIL=3 stage 60 drop_vs_honor python3 -m inspector compare --model demo --prompt "$LONG" --max-tokens 64 \
        --a fused_mask=drop --b fused_mask=honor --json
else
    echo "unknown mode $mode: tests, decode or train"; exit 2
fi

echo "total $((SECONDS - started))s"

tar -czf "$OUT/results.tar.gz" -C "$WORK" . 2>/dev/null
