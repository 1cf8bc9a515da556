#!/usr/bin/env bash
# The A/B and trace targets on one H200, in one call of at most ~8 minutes (every stage has its own limit and
# the no-op loop stops at the deadline):
#
#   1. GPU tests of the traces and the sweep's graph timing (tests/test_trace.py, tests/test_sweep_timing.py -m gpu):
#      a bench trace of demo tg128 @ b32 with every kernel inside a graph replay attributed to a layer, < 20 MB
#   2. bench/sweep_vs_runtime.py: the GEMV arm at n = 1 on v4-shape, sweep (cold, graph) against the runtime's
#      profiled decode step, ratios printed (target: graph within 5 %)
#   3. changes of known size on v4-shape decode (tg32 @ b1, 5 rounds): `ab` of moe_gate=measured (A) against
#      moe_gate=grouped (B, stage known), and against moe_gate=reference with --fresh (stage known_reference); then
#      each side benched on its own ("measured directly"); prints whether the verdict is slower and whether the
#      direct ratio lies inside the interval
#   4. a change of nothing: the n where grouped v1 and v2 take the same time (a sweep of both picks it among
#      NOOP_TOKENS, default 2048,2560,3072: they cross between 2048 and 4096 on v4-shape; below 2048 v1 is 2-3 %
#      faster at every n, which the A/B reports as slower every time, run 60), then
#      `ab --workload sweep` of grouped_variant=1 against 2 at that n, up to 20 times until the deadline;
#      prints how many said "no change" (target: at least 19 of 20)
#
#   bash bench/gpu_ab.sh [STAGES]   # STAGES: a comma list of tests,arm,known,known_reference,noop (default all of them); results
#                                   # under $OUT (default bench/results/latest): ab_summary.txt and the files
# BUDGET_S (default 470) is the deadline of the whole call; the no-op loop runs until 20 A/Bs or the deadline,
# whichever comes first (`bash bench/gpu_ab.sh noop` gives it the whole budget).
set -uo pipefail
STAGES=",${1:-tests,arm,known,known_reference,noop},"
want() { [[ "$STAGES" == *",$1,"* ]]; }
cd "$(dirname "$0")/.."
WORK=${WORK:-/tmp/moei-ab}
OUT=${OUT:-bench/results/latest}
rm -rf "$WORK"; mkdir -p "$WORK" "$OUT"
export PYTHONUNBUFFERED=1 MOEI_CALIBRATION="$WORK/calibration.json"
export MOEI_COMMIT=${MOEI_COMMIT:-$(cat bench/COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)}
DEADLINE=$((SECONDS + ${BUDGET_S:-470}))
SUMMARY="$OUT/ab_summary.txt"
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
left() { echo $((DEADLINE - SECONDS)); }
limit() { local want=$1 rest; rest=$(left); echo $((rest < want ? rest : want)); }
say "gpu_ab.sh at $MOEI_COMMIT on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"

# 1. GPU tests of the traces and the sweep's graph timing
if want tests; then
t=$(limit 150)
timeout "$t" python3 -m pytest -m gpu -q tests/test_trace.py tests/test_sweep_timing.py -p no:cacheprovider \
  > "$WORK/gpu_tests.log" 2>&1
say "1. trace + sweep-timing GPU tests: rc $? ($(tail -1 "$WORK/gpu_tests.log")), $SECONDS s"
fi

# 2. one arm, one number
if want arm; then
t=$(limit 150)
OUT="$WORK" timeout "$t" python3 bench/sweep_vs_runtime.py > "$WORK/sweep_vs_runtime.log" 2>&1
rc=$?
cat "$WORK/sweep_vs_runtime.log" | tee -a "$SUMMARY"
say "2. sweep_vs_runtime: rc $rc, $SECONDS s"
fi

# 3. changes of known size on v4-shape decode, each A/B'd and then each side benched on its own ("measured
#    directly", a fresh process per side): moe_gate=grouped against measured (device-bound: graphs on both sides),
#    then moe_gate=reference against measured with --fresh (the reference arm is host-bound: its speed is the
#    process's, so only fresh processes per round sample what a fresh direct run sees)
known_ab() {  # known_ab NAME B_GATE LIMIT_S [ab options...]
  local name=$1 gate=$2 budget=$3; shift 3
  local BENCH=(--model v4-shape --gpu-weights --pp none --tg 32 --batch 1 --tg-prompt 32)
  t=$(limit "$budget")
  timeout "$t" python3 -m inspector ab "${BENCH[@]}" --reps 1 --a moe_gate=measured --b moe_gate=$gate \
    --rounds 5 --warmup 1 --allow-different-tokens "$@" --json-out "$WORK/$name.json" --quiet > "$WORK/$name.md" \
    2> "$WORK/$name.err"
  say "3. ab measured vs $gate ($name): rc $?, $SECONDS s"
  cat "$WORK/$name.md" >> "$SUMMARY"
  for side in measured $gate; do
    t=$(limit 60)
    timeout "$t" python3 -m inspector bench "${BENCH[@]}" --reps 3 --format json --no-progress --set moe_gate=$side \
      > "$WORK/${name}_direct_$side.json" 2> "$WORK/${name}_direct_$side.err"
  done
  python3 - "$WORK" "$name" "$gate" <<'EOF2' 2>&1 | tee -a "$SUMMARY"
import json, sys
work, name, gate = sys.argv[1:]
try:
    report = json.load(open(f"{work}/{name}.json"))
    row = report["rows"][0]
    rates = [json.load(open(f"{work}/{name}_direct_{side}.json"))["rows"][0]["tps_device"]["mean"]
             for side in ("measured", gate)]
except (OSError, ValueError, KeyError, IndexError, TypeError) as error:
    print(f"   {name}: known-size A/B incomplete: {type(error).__name__}: {error}")
    sys.exit(0)
direct = rates[0] / rates[1]  # device µs per token of B over A's
low, high = row["interval"] if row.get("interval") else (float("nan"), float("nan"))
print(f"   {name} ({report.get('processes')}): verdict {row.get('verdict')} ({row.get('refused') or row.get('why')}); "
      f"ratio {row.get('ratio', float('nan')):.3f} [{low:.3f}, {high:.3f}]; measured directly {direct:.3f}: "
      f"{'inside' if low <= direct <= high else 'OUTSIDE'} the interval; target met: "
      f"{row.get('verdict') == 'slower' and low <= direct <= high}; notes: {row.get('notes')}")
EOF2
}
if want known; then
  known_ab known_grouped grouped 150
fi
if want known_reference; then
  known_ab known_reference reference 240 --fresh
fi

# 4. a change of nothing: grouped v1 against v2 where both take the same time
if want noop; then
t=$(limit 90)
timeout "$t" python3 -m inspector sweep --model v4-shape --tokens "${NOOP_TOKENS:-2048,2560,3072}" --arms grouped_v1,grouped_v2 \
  --json --calibration "$WORK/pick-calibration.json" > "$WORK/pick.json" 2> "$WORK/pick.err"
read -r N PICKED < <(python3 - "$WORK/pick.json" <<'EOF'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["rows"]
    best = min(rows, key=lambda row: abs(row["arms"]["grouped_v1"]["us"] / row["arms"]["grouped_v2"]["us"] - 1))
    print(best["tokens"], f"v1 {best['arms']['grouped_v1']['us']:.1f} us, v2 {best['arms']['grouped_v2']['us']:.1f} us")
except (OSError, ValueError, KeyError, TypeError):
    print(2048, "the sweep that picks n failed: n = 2048 from run 3 (v1 3352.9, v2 3392.8 us)")
EOF
)
say "4. grouped v1 against v2 at n = $N ($PICKED)"
runs=0
for i in $(seq 1 20); do
  if [ "$(left)" -lt 25 ]; then say "   deadline: $runs of 20 no-op A/Bs ran"; break; fi
  t=$(limit 60)
  timeout "$t" python3 -m inspector ab --workload sweep --model v4-shape --tokens "$N" --set moe_gate=grouped \
    --a grouped_variant=1 --b grouped_variant=2 --rounds 5 --warmup 1 --json-out "$WORK/noop_$i.json" --quiet \
    > "$WORK/noop_$i.md" 2> "$WORK/noop_$i.err"
  runs=$i
done
python3 - "$WORK" <<'EOF' 2>&1 | tee -a "$SUMMARY"
import glob, json, sys
verdicts = []
for path in sorted(glob.glob(f"{sys.argv[1]}/noop_*.json")):
    try:
        row = json.load(open(path))["rows"][0]
        verdicts.append(row.get("verdict") or f"refused: {row.get('refused')}")
        print(f"   {path.rsplit('/', 1)[1]}: {verdicts[-1]}, B/A {row.get('ratio', float('nan')):.4f} {row.get('interval')}")
    except (OSError, ValueError, KeyError, IndexError) as error:
        verdicts.append(f"failed: {error}")
done = len(verdicts)
same = verdicts.count("no change")
print(f"   no change in {same} of {done} runs (target: at least 19 of 20)")
EOF
fi
say "done in $SECONDS s"
cp "$WORK"/*.json "$WORK"/*.md "$WORK"/*.log "$OUT"/ 2>/dev/null
tar -C "$WORK" -czf "$OUT/ab_work.tar.gz" . 2>/dev/null
exit 0
