#!/usr/bin/env bash
# Routing record and replay on one H200, in one call of at most ~4 minutes (every stage has its own limit and
# the whole call a deadline, BUDGET_S, default 235 s):
#
#   1. GPU tests (tests/test_routing_gpu.py): a graphed run's recorded routing equals an eager run's (batch 1 and a
#      ragged batch of 4, one-step graphs and graphs of 8 steps); recording gets graphs of its own; the sweep
#      replays each recorded layer
#   2. a recording on the trained demo (real routing): the first 3500 bytes of README.md as the prompt, 64
#      generated tokens; `routing FILE` prints its summary (imbalance, woken against uniform, hottest experts)
#   3. the replay: `sweep --model demo --routing FILE`: every arm on each recorded layer's ids beside uniform
#      routing; prints per layer where the uniform formula's crossover and the recorded routing's differ
#   4. the cost of recording: `ab` of record_routing=off (A) against on (B), tg128 @ b1, wall clock, on v4-shape
#      (--gpu-weights) and on demo; target: B/A <= 1.03 on both
#   5. memory: demo runs of 128..1024 generated tokens (bytes per token: linear), and routing_cap_mb=1 on
#      4 prompts of 4000 tokens (stops at the cap, says from which step)
#
#   bash bench/gpu_routing.sh [STAGES]   # STAGES: a comma list of tests,record,sweep,ab,memory (default all);
#                                        # results under $OUT (default bench/results/latest): routing_summary.txt
set -uo pipefail
STAGES=",${1:-tests,record,sweep,ab,memory},"
want() { [[ "$STAGES" == *",$1,"* ]]; }
cd "$(dirname "$0")/.."
WORK=${WORK:-/tmp/moei-routing}
OUT=${OUT:-bench/results/latest}
rm -rf "$WORK"; mkdir -p "$WORK" "$OUT"
export PYTHONUNBUFFERED=1 MOEI_CALIBRATION="$WORK/calibration.json"
export MOEI_COMMIT=${MOEI_COMMIT:-$(cat bench/COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)}
DEADLINE=$((SECONDS + ${BUDGET_S:-235}))
SUMMARY="$OUT/routing_summary.txt"
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
left() { echo $((DEADLINE - SECONDS)); }
limit() { local want=$1 rest; rest=$(left); rest=$((rest < 1 ? 1 : rest)); echo $((rest < want ? rest : want)); }
say "gpu_routing.sh at $MOEI_COMMIT on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"

if want tests; then
  timeout "$(limit 75)" python3 -m pytest -m gpu -q tests/test_routing_gpu.py -p no:cacheprovider \
    > "$WORK/gpu_tests.log" 2>&1
  say "1. routing GPU tests: rc $? ($(tail -1 "$WORK/gpu_tests.log")), $SECONDS s"
fi

RECORDING="$WORK/demo_readme.safetensors"
if want record || want sweep; then
  PROMPT=$(python3 -c "print(open('README.md', encoding='utf-8').read()[:3500])")
  timeout "$(limit 40)" python3 -m inspector generate --model demo --prompt "$PROMPT" --max-tokens 64 \
    --record-routing "$RECORDING" > "$WORK/record.log" 2> "$WORK/record.err"
  say "2. recorded the demo's routing on README.md: rc $? ($(grep '^routing:' "$WORK/record.err")), $SECONDS s"
  timeout 30 python3 -m inspector routing "$RECORDING" --csv "$WORK/demo_loads.csv" 2>&1 | tee -a "$SUMMARY"
  timeout 30 python3 -m inspector routing "$RECORDING" --scope window:64 2>&1 | sed -n '3,8p' | tee -a "$SUMMARY"
fi

if want sweep; then
  timeout "$(limit 110)" python3 -m inspector sweep --model demo --routing "$RECORDING" \
    --tokens ${ROUTING_TOKENS:-1,2,4,8,16,32,64,128,256,512,1024,2048,4096} --arms gemv,grouped_v1,grouped_v2 \
    --calibration "$WORK/routing-calibration.json" --json > "$WORK/sweep_routing.json" 2> "$WORK/sweep_routing.err"
  rc=$?
  python3 -m inspector.commands.sweep "$WORK/sweep_routing.json" > "$WORK/sweep_routing.md" 2>&1
  say "3. sweep --routing (demo): rc $rc, $SECONDS s"
  grep -E "^(GEMV/grouped|the model's|layer [0-9]+[:]|layer [0-9]+ crossover|calibration)" "$WORK/sweep_routing.md" \
    | tee -a "$SUMMARY"
fi

if want ab; then
  for model in ${AB_MODELS:-v4-shape demo}; do
    extra=(); [ "$model" = v4-shape ] && extra=(--gpu-weights)
    timeout "$(limit 75)" python3 -m inspector ab --model "$model" "${extra[@]}" --pp none --tg 128 --batch 1 \
      --tg-prompt 32 --reps 1 --clock wall --a record_routing=off --b record_routing=on --rounds 5 --warmup 1 \
      --json-out "$WORK/ab_$model.json" --quiet > "$WORK/ab_$model.md" 2> "$WORK/ab_$model.err"
    say "4. ab record_routing off/on, $model tg128 @ b1: rc $?, $SECONDS s"
    python3 - "$WORK/ab_$model.json" <<'EOF' 2>&1 | tee -a "$SUMMARY"
import json, sys
try:
    row = json.load(open(sys.argv[1]))["rows"][0]
except (OSError, ValueError, KeyError, IndexError) as error:
    print(f"   no A/B report: {type(error).__name__}: {error}")
    sys.exit(0)
low, high = row.get("interval") or (float("nan"), float("nan"))
ratio = row.get("ratio", float("nan"))
print(f"   B/A (time per token, recording on over off) {ratio:.4f} [{low:.4f}, {high:.4f}], verdict "
      f"{row.get('verdict') or 'refused: ' + str(row.get('refused'))}; target B/A <= 1.03: {ratio <= 1.03}")
EOF
  done
fi

if want memory; then
  timeout "$(limit 40)" python3 - <<'EOF' 2>&1 | tee -a "$SUMMARY"
from engine import flags
from engine.runtime import Engine
demo = Engine.load("demo", "cuda", seed=0)
on = flags.resolve(["record_routing=on"], environ={})
print("5. memory (demo, 1 sequence of a 32-token prompt):")
for tokens in (128, 256, 512, 1024):
    run = demo.generate_batch([[7 + i % 200 for i in range(32)]], tokens, on)
    routing = run.routing
    row_bytes = 2 * (3 * len(routing.layers) * routing.top_k + 3)
    print(f"   {tokens:5d} generated: {routing.tokens:5d} routed tokens x {row_bytes} bytes = "
          f"{routing.tokens * row_bytes:8d} bytes of rows; {routing.memory_bytes:8d} allocated (chunks of 4096 rows); "
          f"truncated {routing.truncated}")
capped = flags.resolve(["record_routing=on", "routing_cap_mb=1"], environ={})
run = demo.generate_batch([[(5 * i + r) % 256 for i in range(4000)] for r in range(4)], 16, capped)
routing = run.routing
print(f"   cap 1 MiB, 4 x 4000-token prompts: {routing.n_steps} of {len(run.steps)} steps, {routing.tokens} tokens, "
      f"{routing.memory_bytes} bytes held (<= {1 << 20}: {routing.memory_bytes <= 1 << 20}); truncated {routing.truncated}")
EOF
  say "   memory stage done, $SECONDS s"
fi

say "done in $SECONDS s"
cp "$WORK"/*.json "$WORK"/*.md "$WORK"/*.log "$WORK"/*.err "$WORK"/*.csv "$OUT"/ 2>/dev/null
cp "$RECORDING" "$OUT"/ 2>/dev/null
exit 0
