#!/usr/bin/env bash
# Every GPU test and benchmark in one call, for a lent H200 whose time is short.
#
#   bash bench/gpu_all.sh tests      GPU tests of every module, check-attention, attention bench, short sweep
#   bash bench/gpu_all.sh train      train the demo checkpoint (engine/weights/demo/), sample it, drop vs honor
#   bash bench/gpu_all.sh final      kernel and engine GPU tests, check-attention, attention bench, full sweep
#   bash bench/gpu_all.sh tune       the GPU tests of the step under TUNE_TESTS's settings, then v4 tg128 @ b1 under
#                                    each named setting of TUNE (environment switches), ROUNDS times interleaved
#   bash bench/gpu_all.sh confirm    v4 tg128 @ b1 three times, the graph, fused-step and MoE GEMV GPU tests, a
#                                    profiled v4 row (kernel shares), host step, the demo table
#   bash bench/gpu_all.sh host       the host's time per decode step against an older tree in $OLD (default ab_old/,
#                                    e.g. `git archive REV engine kernels inspector bench pyproject.toml`): v4 tg128
#                                    @ b1 and bench/host_step.py, the two trees interleaved ROUNDS times (default 3);
#                                    host_step --pieces; the runtime's and fused step's GPU tests, a profiled v4
#                                    row, the demo table (CHECKS=0: not these three)
#   bash bench/gpu_all.sh bench      batched-runtime GPU tests and the bench tables (bench/gpu_bench.sh)
#   bash bench/gpu_all.sh fused      fused decode step: its GPU tests, the GEMV bench, the v4-shape table
#   bash bench/gpu_all.sh attention  attention GPU tests, check-attention, attention bench, the demo table
#   bash bench/gpu_all.sh step       the decode step's and attention's GPU tests, attention bench, GEMV bench, v4 table
#   bash bench/gpu_all.sh decode     the decode step's GPU tests, the v4 table twice, without run-ahead, without PDL
#                                    and at one step per graph, v4 at batch 8 and 32, host step, demo
#   bash bench/gpu_all.sh ab         v4 tg128 with PDL on and off at batch 1, 8 and 32 (PRELOAD_AB=1: the PDL
#                                    preload on and off at batch 1, twice, with its GPU tests; PRELOAD_AB=fused:
#                                    the fused GEMVs' preload on and off, three times, with their GPU tests)
#   bash bench/gpu_all.sh steps      graphs of several decode steps (steps_per_graph): the runtime's, the decode
#                                    step's and attention decode's GPU tests, v4 tg128 at 1, 2, 4 and 8 steps per
#                                    graph (b1, twice each; b8 and b32 at 1 and 4), host step, the demo table
#
# Logs and results go under $WORK (default /tmp/moei-gpu), then into $OUT as one log and one
# tarball (the device tool brings back at most 8 files). Each stage has its own time limit.
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

{
    echo "commit $commit"
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader
    python3 -c "import torch, triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__)"
} > "$WORK/env.txt" 2>&1
cat "$WORK/env.txt"

if [ "$mode" = tests ]; then
    TAIL=25 stage 330 pytest_gpu python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
        tests/test_moe_kernels.py tests/test_attention_kernels.py tests/test_engine_gpu.py tests/test_runtime_gpu.py
    stage 60 check_honor python3 -m inspector check-attention --device cuda
    stage 60 check_drop python3 -m inspector check-attention --device cuda --mode drop
    TAIL=30 stage 150 attention_bench python3 bench/attention_bench.py
    stage 60 moe_compile_report python3 bench/moe_compile_report.py
    TAIL=30 stage 150 sweep_short python3 -m inspector sweep --model v4-shape --tokens 1,8,16,128,512,2048,8192
elif [ "$mode" = train ]; then
    TAIL=8 stage 330 train_demo python3 train/train_demo.py --minutes "${MINUTES:-4}" --out engine/weights/demo/model.safetensors
    cp engine/weights/demo/model.safetensors engine/weights/demo/training.json "$OUT"/ 2>/dev/null
    DOC="Python supports the usual logical conditions from mathematics: a comparison operator checks two values"
    TAIL=3 stage 60 sample_doc python3 -m inspector generate --model demo --prompt "$DOC" --max-tokens 64 --json
    python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['text'])" "$WORK/sample_doc.log" 2>/dev/null || true
    LONG=$(python3 -c "import pydoc_data.topics as t; print(t.topics['if'][:600])")
    TAIL=3 stage 60 drop_vs_honor python3 -m inspector compare --model demo --prompt "$LONG" --max-tokens 64 \
        --a fused_mask=drop --b fused_mask=honor --json
elif [ "$mode" = verify ]; then  # after kernel changes: their GPU tests, a short sweep, the attention bench
    TAIL=25 stage 240 pytest_gpu python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
        tests/test_moe_kernels.py tests/test_runtime_gpu.py tests/test_engine_gpu.py
    TAIL=24 stage 90 sweep_small python3 -m inspector sweep --model v4-shape \
        --tokens 1,2,4,8,16,32,64,85,128,512,2048,8192 --calibration "$WORK/calibration.json"
    TAIL=16 stage 100 attention_bench python3 bench/attention_bench.py
elif [ "$mode" = fused ]; then  # issue 7's fused decode step: its GPU tests, the GEMV bench, v4 and demo tables
    TAIL=25 stage 330 pytest_gpu python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
        tests/test_decode_fused.py tests/test_moe_kernels.py tests/test_runtime_gpu.py tests/test_engine_gpu.py \
        tests/test_attention_kernels.py
    TAIL=50 stage 90 gemv_bench python3 bench/gemv_bench.py
    TAIL=30 stage 120 moe_gemv_blocks python3 bench/moe_gemv_blocks.py
    TAIL=40 stage 120 bench_v4 python3 -m inspector bench --model v4-shape --pp 512 --tg 128 --batch 1 --reps 3 \
        --gpu-weights --profile --format md --json-out "$WORK/bench_v4.json"
    TAIL=12 MOEI_RUN_AHEAD=0 stage 90 bench_v4_no_run_ahead python3 -m inspector bench --model v4-shape --pp 512 \
        --tg 128 --batch 1 --reps 3 --gpu-weights --format md --json-out "$WORK/bench_v4_no_run_ahead.json"
    TAIL=40 stage 90 host_step python3 bench/host_step.py --device cuda --model v4-shape --steps 2000 --profile
elif [ "$mode" = attention ]; then  # issue 4: attention GPU tests, check-attention, the attention bench, demo table
    TAIL=25 stage 240 pytest_gpu python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_attention_kernels.py \
        tests/test_runtime_gpu.py
    stage 45 check_honor python3 -m inspector check-attention --device cuda
    stage 45 check_drop python3 -m inspector check-attention --device cuda --mode drop
    TAIL=30 stage 170 attention_bench python3 bench/attention_bench.py
    TAIL=30 stage 120 bench_demo python3 -m inspector bench --model demo --pp 128,512 --tg 128 --batch 1,8,32 \
        --reps 3 --format md --json-out "$WORK/bench_demo.json"
elif [ "$mode" = step ]; then  # issues 4 and 7 together: GPU tests of the step and attention, both benches
    TAIL=25 stage 220 pytest_gpu python3 -m pytest -m gpu -v -p no:cacheprovider -rf --durations=8 \
        tests/test_decode_fused.py tests/test_runtime_gpu.py tests/test_attention_kernels.py -k "not prefill"
    TAIL=40 stage 120 attention_bench python3 bench/attention_bench.py
    stage 45 check_honor python3 -m inspector check-attention --device cuda
    stage 45 check_drop python3 -m inspector check-attention --device cuda --mode drop
    TAIL=40 stage 120 bench_v4 python3 -m inspector bench --model v4-shape --pp 512 --tg 128 --batch 1 --reps 3 \
        --gpu-weights --profile --format md --json-out "$WORK/bench_v4.json"
    TAIL=12 MOEI_RUN_AHEAD=0 stage 90 bench_v4_no_run_ahead python3 -m inspector bench --model v4-shape --pp 512 \
        --tg 128 --batch 1 --reps 3 --gpu-weights --format md --json-out "$WORK/bench_v4_no_run_ahead.json"
    TAIL=30 stage 60 host_step python3 bench/host_step.py --device cuda --model v4-shape --steps 2000 --breakdown
    TAIL=30 stage 100 bench_demo python3 -m inspector bench --model demo --pp 128,512 --tg 128 --batch 1,8,32 \
        --reps 3 --format md --json-out "$WORK/bench_demo.json"
elif [ "$mode" = decode ]; then  # issue 7's decode step: GPU tests, the v4 table (twice) and its A/Bs, host step, demo
    TAIL=25 stage 240 pytest_gpu python3 -m pytest -m gpu -q -p no:cacheprovider -rf --durations=5 \
        tests/test_decode_fused.py tests/test_runtime_gpu.py tests/test_engine_gpu.py tests/test_moe_kernels.py \
        -k "not arms_match"
    TAIL=12 stage 150 pytest_attention python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
        tests/test_attention_kernels.py -k "decode or graph"
    TAIL=40 stage 100 bench_v4 python3 -m inspector bench --model v4-shape --pp 512 --tg 128 --batch 1 --reps 3 \
        --gpu-weights --profile --format md --json-out "$WORK/bench_v4.json"
    TAIL=12 stage 100 bench_v4_again python3 -m inspector bench --model v4-shape --pp 512 --tg 128 --batch 1 \
        --reps 3 --gpu-weights --format md --json-out "$WORK/bench_v4_again.json"
    TAIL=12 MOEI_RUN_AHEAD=0 stage 100 bench_v4_no_run_ahead python3 -m inspector bench --model v4-shape --pp 512 \
        --tg 128 --batch 1 --reps 3 --gpu-weights --format md --json-out "$WORK/bench_v4_no_run_ahead.json"
    TAIL=12 MOEI_PDL=0 stage 100 bench_v4_no_pdl python3 -m inspector bench --model v4-shape --pp 512 \
        --tg 128 --batch 1 --reps 3 --gpu-weights --format md --json-out "$WORK/bench_v4_no_pdl.json"
    TAIL=12 stage 100 bench_v4_one_step python3 -m inspector bench --model v4-shape --pp 512 --tg 128 --batch 1 \
        --reps 3 --gpu-weights --set steps_per_graph=1 --format md --json-out "$WORK/bench_v4_one_step.json"
    TAIL=12 stage 100 bench_v4_b8_b32 python3 -m inspector bench --model v4-shape --pp 128 --tg 128 --batch 8,32 \
        --reps 3 --gpu-weights --format md --json-out "$WORK/bench_v4_b8_b32.json"
    TAIL=30 stage 50 host_step python3 bench/host_step.py --device cuda --model v4-shape --steps 2000 --breakdown
    TAIL=30 stage 120 bench_demo python3 -m inspector bench --model demo --pp 128,512 --tg 128 --batch 1,8,32 \
        --reps 3 --format md --json-out "$WORK/bench_demo.json"
elif [ "$mode" = ab ]; then  # A/B of MOEI_PDL on v4 tg128 at batch 1, 8 and 32
    v4() {  # v4 NAME BATCH [ENV=VALUE ...]
        local name=$1 batch=$2; shift 2
        TAIL=8 stage 100 "$name" env "$@" python3 -m inspector bench --model v4-shape --tg 128 --pp 128 \
            --batch "$batch" --reps 3 --gpu-weights --format md --json-out "$WORK/$name.json"
    }
    if [ "${PRELOAD_AB:-}" = fused ]; then  # the fused GEMVs' preload (router, LM head) on and off, with their tests
        TAIL=8 stage 200 pytest_preload python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
            tests/test_decode_fused.py tests/test_runtime_gpu.py
        for round in 1 2 3; do
            v4 v4_b1_fused_preload_off_$round 1 MOEI_PDL_PRELOAD=gemv,down
            v4 v4_b1_fused_preload_on_$round 1 MOEI_PDL_PRELOAD=1
        done
    elif [ -n "${PRELOAD_AB:-}" ]; then  # the first weight tile before the wait (kernels.pdl.preload), with its tests
        TAIL=8 MOEI_PDL_PRELOAD=1 stage 150 pytest_preload python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
            tests/test_decode_fused.py tests/test_moe_kernels.py -k "v4 or widths or matches_torch"
        for round in 1 2; do
            v4 v4_b1_preload_off_$round 1 MOEI_PDL_PRELOAD=0
            v4 v4_b1_preload_on_$round 1 MOEI_PDL_PRELOAD=1
        done
    else
        for batch in 1 8 32; do
            v4 v4_b${batch}_pdl_off "$batch" MOEI_PDL=0
            v4 v4_b${batch}_pdl_on "$batch" MOEI_PDL=1
        done
    fi
    for f in "$WORK"/v4_*.log; do echo "== $(basename "$f")"; grep -E "^\\| tg128|^- host time" "$f" | cut -c1-150; done \
        > "$WORK/ab_summary.txt"
    cat "$WORK/ab_summary.txt"
elif [ "$mode" = steps ]; then  # steps_per_graph: tests, then v4 tg128 at each setting, interleaved
    TAIL=25 stage 300 pytest_gpu python3 -m pytest -m gpu -q -p no:cacheprovider -rf --durations=5 \
        tests/test_runtime_gpu.py tests/test_engine_gpu.py tests/test_decode_fused.py
    TAIL=12 stage 150 pytest_attention python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
        tests/test_attention_kernels.py -k "decode or graph"
    v4() {  # v4 NAME BATCH STEPS [more bench arguments]
        local name=$1 batch=$2 steps=$3; shift 3
        TAIL=8 stage 100 "$name" python3 -m inspector bench --model v4-shape --tg 128 --pp 128 --batch "$batch" \
            --reps 3 --gpu-weights --set "steps_per_graph=$steps" --format md --json-out "$WORK/$name.json" "$@"
    }
    for round in 1 2; do
        for steps in 1 2 4 8; do v4 "v4_b1_k${steps}_$round" 1 "$steps"; done
    done
    for batch in 8 32; do
        for steps in 1 4; do v4 "v4_b${batch}_k$steps" "$batch" "$steps"; done
    done
    TAIL=40 stage 100 v4_b1_k4_profile python3 -m inspector bench --model v4-shape --pp 512 --tg 128 --batch 1 \
        --reps 3 --gpu-weights --profile --set steps_per_graph=4 --format md --json-out "$WORK/v4_b1_k4_profile.json"
    TAIL=12 stage 50 host_step_k1 python3 bench/host_step.py --device cuda --model v4-shape --steps 2000
    TAIL=12 stage 50 host_step_k4 python3 bench/host_step.py --device cuda --model v4-shape --steps 2000 \
        --set steps_per_graph=4
    TAIL=30 stage 120 bench_demo python3 -m inspector bench --model demo --pp 128,512 --tg 128 --batch 1,8,32 \
        --reps 3 --set steps_per_graph=4 --format md --json-out "$WORK/bench_demo.json"
    for f in "$WORK"/v4_*.log; do echo "== $(basename "$f")"; grep -E "^\\| tg128|^- host time|^- the device" "$f" \
        | cut -c1-200; done > "$WORK/steps_summary.txt"
    cat "$WORK/steps_summary.txt"
elif [ "$mode" = tune ]; then  # named environment settings A/B'd on v4 tg128 @ b1, interleaved ROUNDS times
    # TUNE: "name:VAR=value+VAR=value name:..." ("base:" runs the defaults; a value may hold commas, as
    # MOEI_PDL_PRELOAD=gemv,down); TUNE_TESTS: the settings the GPU tests of the decode step, the runtime and
    # attention decode run under first (every switch of the settings on); TUNE_SKIP_TESTS=1: none of them.
    TUNE=${TUNE:-"base: nostream:MOEI_STREAM_WEIGHTS=0 nocarry:MOEI_CARRY_NORM=0 nopreload:MOEI_PDL_PRELOAD=0"}
    read -r -a tests_env <<< "${TUNE_TESTS:-}"
    [ -z "${TUNE_SKIP_TESTS:-}" ] && TAIL=25 stage 300 pytest_gpu env "${tests_env[@]}" python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
        --durations=5 tests/test_decode_fused.py tests/test_runtime_gpu.py
    [ -z "${TUNE_SKIP_TESTS:-}" ] && TAIL=12 stage 150 pytest_moe_gemv env "${tests_env[@]}" python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
        tests/test_moe_kernels.py -k "gemv and not arms_match"
    [ -n "${TUNE_ATTENTION:-}" ] && TAIL=12 stage 150 pytest_attention env "${tests_env[@]}" python3 -m pytest -m gpu \
        -q -p no:cacheprovider -rf tests/test_attention_kernels.py -k "$TUNE_ATTENTION"  # e.g. "decode or graph"
    for round in $(seq "${ROUNDS:-2}"); do
        for setting in $TUNE; do
            name=${setting%%:*}; settings=${setting#*:}
            IFS=+ read -r -a setting_env <<< "$settings"
            TAIL=6 stage 100 "v4_${name}_$round" env "${setting_env[@]}" python3 -m inspector bench --model v4-shape \
                --tg 128 --pp 128 --batch 1 --reps 3 --gpu-weights --format md --json-out "$WORK/v4_${name}_$round.json"
        done
    done
    for f in "$WORK"/v4_*.log; do echo "== $(basename "$f")"; grep -E "^\\| tg128|^- host time|^- the device" "$f" \
        | cut -c1-200; done > "$WORK/tune_summary.txt"
    cat "$WORK/tune_summary.txt"
elif [ "$mode" = confirm ]; then  # a short lease: the v4 tg128 @ b1 row three times, the graph tests, the demo table
    for round in 1 2 3; do
        TAIL=12 stage 100 "bench_v4_$round" python3 -m inspector bench --model v4-shape --pp 128 --tg 128 --batch 1 \
            --reps 3 --gpu-weights --format md --json-out "$WORK/bench_v4_$round.json"
    done
    TAIL=25 stage 200 pytest_gpu python3 -m pytest -m gpu -p no:cacheprovider -rf --durations=5 \
        tests/test_runtime_gpu.py tests/test_decode_fused.py -k "several_steps or eager or pick_norms or fused_decode"
    TAIL=12 stage 150 pytest_moe python3 -m pytest -m gpu -p no:cacheprovider -rf tests/test_moe_kernels.py \
        -k "gemv or arms"
    TAIL=40 stage 100 bench_v4_profile python3 -m inspector bench --model v4-shape --pp 128 --tg 128 --batch 1 \
        --reps 2 --gpu-weights --profile --format md --json-out "$WORK/bench_v4_profile.json"
    TAIL=12 stage 60 host_step python3 bench/host_step.py --device cuda --model v4-shape --steps 2000
    TAIL=30 stage 100 bench_demo python3 -m inspector bench --model demo --pp 128,512 --tg 128 --batch 1,8,32 \
        --reps 3 --format md --json-out "$WORK/bench_demo.json"
elif [ "$mode" = host ]; then  # issue 7's host time: this tree against $OLD, interleaved, then the checks
    OLD=${OLD:-ab_old}
    [ -d "$OLD/engine" ] || { echo "no older tree in $OLD"; exit 2; }
    for round in $(seq 1 "${ROUNDS:-3}"); do
        for tree in new old; do
            dir=.; [ $tree = old ] && dir=$OLD
            TAIL=4 stage 100 "v4_${tree}_$round" bash -c "cd '$dir' && python3 -m inspector bench --model v4-shape \
                --pp 128 --tg 128 --batch 1 --reps 3 --gpu-weights --format md --json-out '$WORK/v4_${tree}_$round.json'"
        done
        for tree in new old; do
            dir=.; [ $tree = old ] && dir=$OLD
            TAIL=4 stage 60 "host_step_${tree}_$round" bash -c "cd '$dir' && python3 bench/host_step.py --device cuda \
                --model v4-shape --steps 2000"
        done
    done
    TAIL=24 stage 90 host_pieces python3 bench/host_step.py --device cuda --model v4-shape --steps 2000 --pieces
    if [ "${CHECKS:-1}" != 0 ]; then  # CHECKS=0: the A/B alone
        TAIL=25 stage 240 pytest_gpu python3 -m pytest -m gpu -p no:cacheprovider -rf --durations=5 \
            tests/test_runtime_gpu.py tests/test_decode_fused.py
        TAIL=40 stage 100 bench_v4_profile python3 -m inspector bench --model v4-shape --pp 128 --tg 128 --batch 1 \
            --reps 2 --gpu-weights --profile --format md --json-out "$WORK/bench_v4_profile.json"
        TAIL=30 stage 100 bench_demo python3 -m inspector bench --model demo --pp 128,512 --tg 128 --batch 1,8,32 \
            --reps 3 --format md --json-out "$WORK/bench_demo.json"
    fi
elif [ "$mode" = bench ]; then  # issue 7: batched-runtime GPU tests, demo and v4-shape tables
    [ -n "${RECHECK:-}" ] && TAIL=12 stage 150 pytest_recheck python3 -m pytest -m gpu -q -p no:cacheprovider -rf $RECHECK
    TAIL=60 OUT=$WORK/bench stage 360 bench_all bash bench/gpu_bench.sh
else  # final: kernels and engine measured again on the committed tree
    TAIL=25 stage 200 pytest_gpu python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
        tests/test_moe_kernels.py tests/test_attention_kernels.py tests/test_engine_gpu.py
    stage 45 check_honor python3 -m inspector check-attention --device cuda
    stage 45 check_drop python3 -m inspector check-attention --device cuda --mode drop
    TAIL=14 stage 80 attention_bench python3 bench/attention_bench.py
    TAIL=24 stage 100 sweep_v4 python3 -m inspector sweep --model v4-shape \
        --tokens 1,2,4,8,9,16,32,64,128,256,512,683,1024,2048,4096,8192 --calibration "$WORK/calibration.json"
fi

echo "total $((SECONDS - started))s"

tar -czf "$OUT/results.tar.gz" -C "$WORK" . 2>/dev/null

