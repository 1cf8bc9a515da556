#!/usr/bin/env bash
# The GPU work this project has had waiting, in calls of under ten minutes each (BUDGET_S, default 560 s a call;
# every stage has its own limit, cut to what is left). Runs 65-74 ran check, shared, trellis, demo, walk, confirm,
# sweep, small, spacing, fresh and preload (bench/RESULTS.md, runs 65-74). confirm is the one to re-run after a
# change to the decode step.
#   check    GPU tests of kernels refactored since their last GPU run (the split argmax's best-key walk, the router's
#            woken-count epilogue, the unrolled trellis GEMV's hyb gather), then Qwen3-30B-A3B tg128 @ b1 profiled:
#            its figure must hold (run 64: 1.87x the bound, 371.9 t/s)
#   shared   bench/gpu_shared_fold.sh: the shared experts inside the routed GEMV launches (shared_fold), its GPU
#            tests, the DeepSeek-V2-Lite A/B of off against on, the profiled row with it on (run 64: 2.27x)
#   trellis  STAGES=grouped bench/gpu_trellis.sh: the grouped and dequantize arms' unrolled decode, its GPU tests and
#            the bench's grouped rows at n = 2048 / 8192 (run 59: HYB 8.9x / 16.4x the bf16 grouped arm)
#   demo     demo tg128 @ b1 (run 63: 21196 t/s)
#   walk     down's walk TILES tiles at a time (kernels.moe_gemv DOWN_TILES): its GPU tests, then
#            bench/experiments/down_walk.py --steps (the arm's candidates at Qwen3, V2-Lite and v4-shape widths, then
#            the tg128 rows of the best two against bench/experiments/baseline_moe_gemv.py, the revision before, when
#            that file is in the tree: `git show REV:kernels/moe_gemv.py > bench/experiments/baseline_moe_gemv.py`)
#   confirm  the defaults since (down's narrow walk, shared_fold=on): their GPU tests, then the profiled tg128 @ b1 rows
#            of Qwen3-30B-A3B and DeepSeek-V2-Lite and v4-shape's row (run 57: 1.268x; its down is the one-tile walk)
#   sweep    the sweep's timings' GPU tests, then bench/sweep_vs_runtime.py: graph and neighbours timing against the
#            runtime's adds µs (run 74: graph 1.001-1.003x, met; runs 60-62, 69: 1.107-1.112x)
#   small    bench/experiments/small_kernels.py: what the router's fold, attention's split and combine and rope_cache
#            add to a Qwen3-30B-A3B layer, and attention at fewer, longer splits
#   spacing  bench/experiments/sweep_spacing.py: the GEMV arm's calls with a spin or a copy between them, against
#            back to back (run 72: not why the sweep read 1.11x the runtime's adds)
#   preload  Qwen3-30B-A3B tg128 @ b1 at pdl_preload on, down+fused, gemv+fused, off, on again, a process each: the
#            preload was measured on v4-shape's one layer; at 48 narrow layers the dense GEMVs' preload runs under
#            the short kernels (rms_norm before q/k/v), which may wait on it
#   fresh    bench/experiments/sweep_fresh.py: sweep_vs_runtime's figures each in a process of its own, then the
#            sweep and the runtime in one process in both orders
#   mla      latent attention at one token: the split kernel with PDL, one-tile splits merged inside unabsorb (no
#            combine launch); its GPU tests, bench/experiments/mla_short.py (split counts,
#            merges and configs, beside bench/experiments/baseline_attention_mla.py's kernel
#            when the tree has it: `git show REV:kernels/attention_mla.py > bench/experiments/baseline_attention_mla.py`), bench/mla_bench.py's 128-head rows, DeepSeek-V2-Lite tg128
#            @ b1 profiled (run 70: 1.84x, the split 9.3 us a layer)
#   qkvfold  each layer's attention norm folded into its q/k/v GEMV (the flag qkv_norm_fold):
#            bench/experiments/qkv_fold.py, the fold's blocks against rms_norm + gemv at three widths (run 81)
#   foldab   the fold's GPU tests, then tg128 @ b1 of Qwen3-30B-A3B, DeepSeek-V2-Lite (profiled) and v4-shape with
#            qkv_norm_fold on and off (the tg128 lines in summary.txt; FOLD_MODELS="demo v4-shape" picks others)
#   foldrows foldab's tg128 rows alone
#   opreload the o projection's one-row GEMV after attention by block: bench/experiments/o_preload.py (run 85: the
#            whole K in one tile, all of the weight preloaded before the PDL wait, lost: Qwen3-30B-A3B tg128 @ b1
#            398.3 against 402.8 t/s with kernels.gemv's 2 x 2048; it was not kept)
#   foldall  the GPU tests of everything that runs the fused step's glue (families against transformers, DeepSeek,
#            the engine, check-decode, sessions, traces, the sweep's timings, routing)
#   routeblk bench/experiments/route_blocks.py: the router's one-row fold by block at Qwen3, V2-Lite and v4-shape widths
#   tprobe   bench/experiments/trellis_probe.py --profile (PROBE_SCHEDULES), the trellis GPU tests, trellis_bench.py
#            --gemv-only: the trellis GEMV arm at n = 1 by launch and schedule (run 63: 1mad and
#            3inst at the same 91 us for loops a quarter apart)
#   tcheck   the rotations' error by dot precision (bench/experiments/rotation_error.py), trellis_bench.py --gemv-only
#            at the per-code defaults, ncu on the trellis arm, then the trellis kernels' GPU tests
#   tconfirm the rotations' error and GPU tests, the arm by launch at the defaults, trellis_bench.py's n = 1 rows and
#            its grouped rows (the rotations run in the grouped arms too)
#   ncu      Nsight Compute's counters (speed of light, occupancy, warp states, scheduler, memory) on the trellis
#            arm's launches and the bf16 GEMV arm at v4-shape (trellis_probe.py --window), then on a Qwen3-30B-A3B
#            decode step's kernels (NCU_SKIP matching launches skipped, NCU_COUNT profiled)
#   gcand    the trellis grouped arm's candidate schedules at n = 2048 / 8192 (bench/experiments/grouped_candidates.py:
#            256-row windows, 16 warps) beside the bf16 grouped arm, then ncu on 1mad's gate-up and down at m64, m128
#            and m256 (run 92: 1mad 1.33x / 1.92x the bf16 arm, 2.96x / 3.24x its decode bound)
#   rstack   the rotations with several blocks a program (kernels.trellis_rotate.STACKED) by config
#            (bench/experiments/rotation_stacks.py), their GPU tests, then the grouped candidates at m64, m128, m256
#   gfuse    the grouped candidates with the gate-up's two tiles in one dot (m64f, m128f, m256f) beside m64, m128
#            and m256, then the grouped decode's and the rotations' GPU tests
#   gptoss   gpt-oss on the fused decode step (biases in the GEMV epilogues, YaRN in rope_cache, the router bias, norms
#            rounded once): the GPU tests of the glue and the families, gpt-oss-20b's shape tg128 @ b1 with the fused
#            glue (profiled) and with the torch forward's (bench/experiments/torch_glue.py), and
#            bench/family_numerics.py on the GPU (gpt-oss now through the fused step)
#   gptoss2  the GPU tests of the runtime, DeepSeek's fused step and the engine, gpt-oss-20b tg128 @ b8 both ways, and
#            the Qwen3-30B-A3B and v4-shape rows, whose kernels build as before (run 84: 1.74x, 1.25x)
#   qwen2    Qwen2-MoE on the fused glue (q/k/v biases, the gated shared expert): its GPU test against transformers'
#            bf16 error, then Qwen1.5-MoE-A2.7B's shape tg128 @ b1 with the fused glue and with the torch forward's
#   olmoe    OLMoE on the fused glue (its whole-projection q/k norms and clip_qkv between the q/k/v GEMV and
#            rope_cache): the family-architecture GPU tests and the families' runtime tests, OLMoE-1B-7B's shape
#            tg128 @ b1 with the fused glue (profiled) and with the torch forward's, bench/family_numerics.py on the GPU
#   prefetch the flag l2_prefetch (known weights asked into L2 on a side stream while a one-row layer's latency-bound
#            kernels run): its GPU tests, then Qwen3-30B-A3B tg128 @ b1 at off, attention+routing, attention, routing,
#            off and attention+routing again, a process each (PREFETCH_VALUES picks others; the first two profiled)
#   pace     the same rows with the prefetch paced (bench/experiments/prefetch_pace.py: a pause after each 64 KB
#            chunk of each of 16 programs; PACES lists value:pause_ns pairs)
#   prefetchab  l2_prefetch off against routing, twice interleaved, tg128 @ b1 on PREFETCH_MODELS (default
#            Qwen3-30B-A3B's shape, demo and v4-shape): whether routing can be the default
#   families OLMoE-1B-7B's, Qwen1.5-MoE-A2.7B's and gpt-oss-20b's shapes tg128 @ b1 with the fused glue and with the
#            torch forward's (runs 101-103 measured them on an H100), then bench/family_numerics.py on the GPU
#   b2model  the GPU tests of compare --b-model source and check-quant's one-layer read of its source (a Qwen2-MoE
#            checkpoint quantized on the GPU), the L2 prefetch's (its support asked once per device), then the README's
#            trellis workflow on the demo: quantize on the GPU, compare --b-model source, check-quant
#   head     tg128 @ b1 of Qwen3-30B-A3B's shape, DeepSeek-V2-Lite's, v4-shape and demo at the commit measured, a
#            process each (the targets' rows)
#   bash bench/gpu_next.sh check            # about 3 minutes
#   bash bench/gpu_next.sh shared           # about 9 minutes
#   bash bench/gpu_next.sh trellis,demo     # about 5 minutes
#   bash bench/gpu_next.sh walk             # about 3 minutes
#   bash bench/gpu_next.sh confirm          # about 4 minutes
#   bash bench/gpu_next.sh sweep            # about 3 minutes
#   bash bench/gpu_next.sh small            # about 1 minute
#   bash bench/gpu_next.sh spacing          # about 1 minute
#   bash bench/gpu_next.sh fresh            # about 3 minutes
#   bash bench/gpu_next.sh preload          # about 3 minutes
#   bash bench/gpu_next.sh mla              # about 6 minutes
#   bash bench/gpu_next.sh qkvfold          # about 1 minute
#   bash bench/gpu_next.sh foldab           # about 6 minutes
# Logs under $OUT (default bench/results/latest); a nested script's files under $OUT/<stage>/.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/stages.sh
stages_begin gpu_next.sh check,shared,trellis,demo,walk,confirm,sweep,small,spacing,fresh,preload,mla,qkvfold,foldab,foldrows,foldall,opreload,routeblk,tprobe,ncu,tcheck,tconfirm,gcand,rstack,gfuse,gptoss,gptoss2,qwen2,olmoe,prefetch,pace,families,prefetchab,b2model,head 560 "$@"
BENCH=(python3 -m inspector bench --pp none --tg 128 --batch 1 --no-progress --format md)
GPT_OSS=(--model bench/configs/gpt-oss-20b --weights random --pp none --tg 128 --no-progress --format md)
want gptoss && TAIL=8 stage 230 pytest_gptoss python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
    tests/test_decode_fused.py tests/test_families_gpu.py tests/test_moe_gemv_clamped.py
want gptoss && TAIL=30 stage 100 gptoss_fused python3 -m inspector bench "${GPT_OSS[@]}" --batch 1 --reps 2 --profile
want gptoss && TAIL=6 stage 90 gptoss_torch python3 bench/experiments/torch_glue.py bench "${GPT_OSS[@]}" --batch 1 \
    --reps 2
want gptoss && TAIL=40 stage 150 family_numerics python3 bench/family_numerics.py --device cuda \
    --out "$OUT/family_numerics.json"
QWEN2=(--model bench/configs/qwen1.5-moe-a2.7b --weights random --pp none --tg 128 --batch 1 --reps 2 --no-progress
       --format md)
want qwen2 && TAIL=6 stage 150 pytest_qwen2 python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
    tests/test_hf_deepseek.py -k "qwen2"
want qwen2 && TAIL=6 stage 90 qwen2_fused python3 -m inspector bench "${QWEN2[@]}"
want qwen2 && TAIL=6 stage 90 qwen2_torch python3 bench/experiments/torch_glue.py bench "${QWEN2[@]}"
OLMOE=(--model bench/configs/olmoe-1b-7b --weights random --pp none --tg 128 --batch 1 --reps 2 --no-progress
       --format md)
want olmoe && TAIL=8 stage 200 pytest_olmoe python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
    tests/test_decode_fused.py tests/test_families_gpu.py -k "family_architecture or olmoe or qk_norm"
want olmoe && TAIL=30 stage 90 olmoe_fused python3 -m inspector bench "${OLMOE[@]}" --profile
want olmoe && TAIL=6 stage 90 olmoe_torch python3 bench/experiments/torch_glue.py bench "${OLMOE[@]}"
want olmoe && TAIL=12 stage 120 family_numerics python3 bench/family_numerics.py --device cuda \
    --families ${NUMERICS_FAMILIES:-qwen3-moe,mixtral,olmoe,gpt-oss} --out "$OUT/family_numerics.json"
want gptoss2 && TAIL=8 stage 240 pytest_glue python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
    tests/test_runtime_gpu.py tests/test_decode_fused_mla.py tests/test_engine_gpu.py tests/test_hf_deepseek.py
want gptoss2 && TAIL=6 stage 80 gptoss_fused_b8 python3 -m inspector bench "${GPT_OSS[@]}" --batch 8 --reps 2
want gptoss2 && TAIL=6 stage 80 gptoss_torch_b8 python3 bench/experiments/torch_glue.py bench "${GPT_OSS[@]}" \
    --batch 8 --reps 2
want gptoss2 && TAIL=6 stage 70 qwen3_tg128 "${BENCH[@]}" --model bench/configs/qwen3-30b-a3b --weights random --reps 2
want gptoss2 && TAIL=6 stage 60 v4_tg128 python3 -m inspector bench --model v4-shape --pp 128 --tg 128 --batch 1 \
    --reps 3 --gpu-weights --no-progress --format md
want check && TAIL=8 stage 200 pytest_refactored python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
    tests/test_decode_fused.py tests/test_trellis_gemv_unrolled.py tests/test_moe_kernels.py
want check && TAIL=30 stage 70 qwen3_tg128 "${BENCH[@]}" --model bench/configs/qwen3-30b-a3b --weights random \
    --reps 2 --profile --json-out "$OUT/qwen3_tg128.json"
want shared && TAIL=40 stage 550 shared env OUT="$OUT/shared" BUDGET_S=540 bash bench/gpu_shared_fold.sh
want trellis && TAIL=30 stage 420 trellis env OUT="$OUT/trellis" STAGES=grouped bash bench/gpu_trellis.sh
want demo && TAIL=8 stage 45 demo_tg128 "${BENCH[@]}" --model demo --reps 3 --json-out "$OUT/demo_tg128.json"
want walk && TAIL=8 stage 90 pytest_walk python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
    tests/test_moe_gemv_walk.py tests/test_moe_gemv_shared.py tests/test_moe_gemv_clamped.py
BASELINE=bench/experiments/baseline_moe_gemv.py
want walk && TAIL=60 stage 470 down_walk env OUT="$OUT" python3 bench/experiments/down_walk.py --steps \
    $([ -f $BASELINE ] && echo --baseline $BASELINE)
want confirm && TAIL=8 stage 150 pytest_confirm python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
    tests/test_moe_gemv_walk.py tests/test_moe_gemv_shared.py tests/test_moe_gemv_clamped.py tests/test_decode_fused_mla.py
want confirm && TAIL=30 stage 80 qwen3_tg128 "${BENCH[@]}" --model bench/configs/qwen3-30b-a3b --weights random \
    --reps 2 --profile --json-out "$OUT/qwen3_tg128.json"
want confirm && TAIL=30 stage 80 dsv2_tg128 "${BENCH[@]}" --model bench/configs/deepseek-v2-lite --weights random \
    --reps 2 --profile --json-out "$OUT/dsv2_tg128.json"
want confirm && TAIL=8 stage 80 v4_tg128 python3 -m inspector bench --model v4-shape --pp 128 --tg 128 --batch 1 \
    --reps 3 --gpu-weights --no-progress --format md --json-out "$OUT/v4_tg128.json"
want sweep && TAIL=6 stage 90 pytest_sweep python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_sweep_timing.py
want sweep && TAIL=20 stage 240 sweep_vs_runtime env OUT="$OUT" python3 bench/sweep_vs_runtime.py
want small && TAIL=30 stage 150 small_kernels env OUT="$OUT" python3 bench/experiments/small_kernels.py
want spacing && TAIL=20 stage 150 sweep_spacing env OUT="$OUT" python3 bench/experiments/sweep_spacing.py
want fresh && TAIL=12 stage 400 sweep_fresh env OUT="$OUT" python3 bench/experiments/sweep_fresh.py
want mla && TAIL=8 stage 200 pytest_mla python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
    tests/test_decode_fused_mla.py tests/test_attention_mla.py tests/test_hf_deepseek.py
want mla && TAIL=60 stage 150 mla_short env OUT="$OUT" python3 bench/experiments/mla_short.py
want mla && TAIL=12 stage 90 mla_bench python3 bench/mla_bench.py --out "$OUT/mla_bench.json"
want mla && TAIL=30 stage 80 dsv2_tg128 "${BENCH[@]}" --model bench/configs/deepseek-v2-lite --weights random \
    --reps 2 --profile --json-out "$OUT/dsv2_tg128.json"
want qkvfold && TAIL=60 stage 150 qkv_fold env OUT="$OUT" python3 bench/experiments/qkv_fold.py
want foldall && TAIL=8 stage 360 pytest_glue python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
    tests/test_families_gpu.py tests/test_hf_deepseek.py tests/test_engine_gpu.py tests/test_check_decode.py \
    tests/test_session_steps.py tests/test_trace.py tests/test_sweep_timing.py tests/test_routing_gpu.py
want foldab && TAIL=8 stage 240 pytest_fold python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
    tests/test_decode_fused.py tests/test_decode_fused_mla.py tests/test_runtime_gpu.py tests/test_sweep_timing.py
(want foldab || want foldrows) && for model in ${FOLD_MODELS:-qwen3-30b-a3b deepseek-v2-lite v4-shape}; do  # logs only
    source=$([ -d bench/configs/$model ] && echo "bench/configs/$model --weights random" || echo "$model")
    [ $model = v4-shape ] && source="$model --gpu-weights"
    for fold in on off; do
        TAIL=0 stage 80 "${model%%-*}_fold_$fold" "${BENCH[@]}" --model $source --reps 2 \
            --set qkv_norm_fold=$fold $([ $fold = on ] && [ $model != v4-shape ] && echo --profile) \
            && say "   | $(grep -h 'tg128 @ b1:' "$OUT/${model%%-*}_fold_$fold.log" | cut -c1-200)" \
            && say "   | $(grep -h 'GPU busy' "$OUT/${model%%-*}_fold_$fold.log" | cut -c1-200)"
    done
done
want opreload && TAIL=30 stage 120 o_preload env OUT="$OUT" python3 bench/experiments/o_preload.py
want routeblk && TAIL=30 stage 120 route_blocks env OUT="$OUT" python3 bench/experiments/route_blocks.py
want tprobe && TAIL=20 stage 240 trellis_probe env OUT="$OUT" python3 bench/experiments/trellis_probe.py --profile \
    --schedules ${PROBE_SCHEDULES:-u2c16,u2c16r80,u1c16,u1c32,u2c32}
want tprobe && TAIL=8 stage 150 pytest_trellis python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
    tests/test_trellis_kernels.py tests/test_trellis_gemv_unrolled.py
want tprobe && TAIL=14 stage 150 trellis_gemv python3 bench/trellis_bench.py --gemv-only
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
NCU_ARGS=(--clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats
          --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis)
want ncu && TAIL=4 stage 200 ncu_trellis "$NCU" "${NCU_ARGS[@]}" --profile-from-start off \
    python3 bench/experiments/trellis_probe.py --window --codes ${NCU_CODES:-hyb,1mad}
want ncu && TAIL=4 stage 200 ncu_qwen3 "$NCU" "${NCU_ARGS[@]}" --launch-skip ${NCU_SKIP:-3000} \
    --launch-count ${NCU_COUNT:-16} -k "regex:_gate_up_kernel|_down_kernel|_gemv_kernel|_gemv_norm_kernel|_gemv_route_kernel|_flash_decode|_rope_cache" \
    "${BENCH[@]}" --model bench/configs/qwen3-30b-a3b --weights random --tg 32 --reps 1
want tcheck && TAIL=8 stage 60 rotation_error python3 bench/experiments/rotation_error.py
want tcheck && TAIL=14 stage 120 trellis_gemv python3 bench/trellis_bench.py --gemv-only
want tcheck && TAIL=2 stage 60 ncu_trellis "$NCU" "${NCU_ARGS[@]}" --profile-from-start off \
    python3 bench/experiments/trellis_probe.py --window --codes hyb,1mad --schedules u2c16,u1c16
want tcheck && TAIL=12 stage 330 pytest_trellis python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
    tests/test_trellis_kernels.py
want tconfirm && TAIL=8 stage 40 rotation_error python3 bench/experiments/rotation_error.py
want tconfirm && TAIL=6 stage 90 pytest_rotations python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
    tests/test_trellis_kernels.py -k "rotations or graph_replay"
want tconfirm && TAIL=6 stage 90 trellis_probe env OUT="$OUT" python3 bench/experiments/trellis_probe.py --profile
want tconfirm && TAIL=12 stage 90 trellis_gemv python3 bench/trellis_bench.py --gemv-only --out "$OUT/gemv"
want tconfirm && TAIL=20 stage 240 trellis_grouped python3 bench/trellis_bench.py --grouped-only --out "$OUT/grouped"
want gcand && TAIL=30 stage 300 grouped_candidates env OUT="$OUT" python3 bench/experiments/grouped_candidates.py \
    --time --schedules ${GCAND_SCHEDULES:-m64,m128,m256,m256d64,m128w16,m64w16,m64w16r64}
want gcand && TAIL=2 stage 200 ncu_grouped "$NCU" "${NCU_ARGS[@]}" --profile-from-start off \
    -k "regex:_trellis_gate_up_kernel|_trellis_down_kernel" \
    python3 bench/experiments/grouped_candidates.py --window --codes 1mad --schedules m64,m128,m256
want rstack && TAIL=12 stage 120 rotation_stacks env OUT="$OUT" python3 bench/experiments/rotation_stacks.py
want rstack && TAIL=4 stage 180 pytest_rotations python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
    tests/test_trellis_kernels.py -k "rotations or graph_replay or several"
want rstack && TAIL=12 stage 200 grouped_candidates env OUT="$OUT" python3 bench/experiments/grouped_candidates.py \
    --time --schedules ${GCAND_SCHEDULES:-m64,m128,m256}
want gfuse && TAIL=40 stage 260 grouped_candidates env OUT="$OUT" python3 bench/experiments/grouped_candidates.py \
    --time --schedules ${GCAND_SCHEDULES:-m64,m64f,m128,m128f,m256,m256f}
want gfuse && TAIL=6 stage 260 pytest_grouped python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
    tests/test_trellis_grouped_decode.py tests/test_trellis_kernels.py -k "grouped or rotations or several"
index=0
for preload in on down+fused gemv+fused off on; do  # the logs only (the device returns few files)
    index=$((index + 1))
    want preload && TAIL=0 stage 70 "qwen3_preload${index}_${preload/+/_}" "${BENCH[@]}" \
        --model bench/configs/qwen3-30b-a3b --weights random --reps 2 --set pdl_preload=$preload \
        && say "   | $(grep -h 'tg128 @ b1:' "$OUT/qwen3_preload${index}_${preload/+/_}.log" | cut -c1-160)"
done
want prefetch && TAIL=8 stage 150 pytest_prefetch python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
    tests/test_l2_prefetch.py
index=0
for value in ${PREFETCH_VALUES:-off attention+routing attention routing off attention+routing}; do  # logs only
    index=$((index + 1))
    want prefetch && TAIL=0 stage 80 "qwen3_prefetch${index}_${value/+/_}" "${BENCH[@]}" \
        --model bench/configs/qwen3-30b-a3b --weights random --reps 2 --set l2_prefetch=$value \
        $([ $index -le 2 ] && echo --profile) \
        && say "   | $(grep -h 'tg128 @ b1:' "$OUT/qwen3_prefetch${index}_${value/+/_}.log" | cut -c1-160)" \
        && say "   | $(grep -h 'GPU busy' "$OUT/qwen3_prefetch${index}_${value/+/_}.log" | cut -c1-160)"
done
for family in olmoe qwen2 gptoss; do  # the families' fused glue against the torch forward's, tg128 @ b1, one call
    case $family in olmoe) args=("${OLMOE[@]}");; qwen2) args=("${QWEN2[@]}");; gptoss) args=("${GPT_OSS[@]}" --batch 1 --reps 2);; esac
    want families && TAIL=0 stage 90 "${family}_fused" python3 -m inspector bench "${args[@]}" \
        && say "   | $(grep -h 'tg128 @ b1:' "$OUT/${family}_fused.log" | cut -c1-160)"
    want families && TAIL=0 stage 90 "${family}_torch" python3 bench/experiments/torch_glue.py bench "${args[@]}" \
        && say "   | $(grep -h 'tg128 @ b1:' "$OUT/${family}_torch.log" | cut -c1-160)"
done
want families && TAIL=12 stage 150 family_numerics python3 bench/family_numerics.py --device cuda \
    --out "$OUT/family_numerics.json"
for model in ${PREFETCH_MODELS:-qwen3-30b-a3b demo v4-shape}; do  # logs only
    source=$([ -d bench/configs/$model ] && echo "bench/configs/$model --weights random" || echo "$model")
    [ $model = v4-shape ] && source="$model --gpu-weights"
    for value in off routing off routing; do
        index=$((index + 1))
        want prefetchab && TAIL=0 stage 80 "${model%%-*}_ab${index}_$value" "${BENCH[@]}" --model $source --reps 2 \
            --set l2_prefetch=$value \
            && say "   | $(grep -h 'tg128 @ b1:' "$OUT/${model%%-*}_ab${index}_$value.log" | cut -c1-120)"
    done
done
index=0
for paced in ${PACES:-routing:500 routing:1000 attention+routing:500 attention+routing:1000 off:0}; do  # logs only
    index=$((index + 1)) value=${paced%%:*} pause=${paced##*:}
    want pace && TAIL=0 stage 80 "qwen3_pace${index}_${value/+/_}_${pause}" python3 bench/experiments/prefetch_pace.py \
        --pause-ns $pause "${BENCH[@]:3}" --model bench/configs/qwen3-30b-a3b --weights random --reps 2 \
        --set l2_prefetch=$value \
        && say "   | $(grep -h 'tg128 @ b1:' "$OUT/qwen3_pace${index}_${value/+/_}_${pause}.log" | cut -c1-160)"
done
want b2model && TAIL=6 stage 200 pytest_b2model python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
    tests/test_trellis_gpu.py tests/test_l2_prefetch.py
want b2model && TAIL=4 stage 150 demo_quantize python3 -m inspector quantize demo --experts trellis:K=2,code=hyb \
    --out "$OUT/demo-2bit" --device cuda
want b2model && TAIL=40 stage 60 demo_compare python3 -m inspector compare --model "$OUT/demo-2bit" --b-model source \
    --device cuda --prompt "The if statement" --max-tokens 32 --no-progress
want b2model && TAIL=12 stage 60 demo_check_quant python3 -m inspector check-quant --model "$OUT/demo-2bit" \
    --device cuda
rm -rf "$OUT/demo-2bit"  # the device returns few files
for model in ${HEAD_MODELS:-qwen3-30b-a3b deepseek-v2-lite v4-shape demo}; do  # logs only
    source=$([ -d bench/configs/$model ] && echo "bench/configs/$model --weights random" || echo "$model")
    [ $model = v4-shape ] && source="$model --gpu-weights"
    want head && TAIL=0 stage 90 "${model%%-*}_head" "${BENCH[@]}" --model $source --reps 2 \
        && say "   | $(grep -h 'tg128 @ b1:' "$OUT/${model%%-*}_head.log" | cut -c1-200)"
done
say "done in ${SECONDS}s"
exit 0
