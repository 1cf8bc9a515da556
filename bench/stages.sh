# Sourced by the bench/gpu_*.sh scripts that run one device call as named stages under one deadline:
#
#   source bench/stages.sh
#   stages_begin SCRIPT_NAME "a,b,c" 400 "$@"   # stages: $1 or the default list; deadline: BUDGET_S or 400 s
#   want a && TAIL=20 stage 60 a_log python3 ...  # $OUT/a_log.log; its tail (TAIL lines) into the summary
#
# Every stage has its own limit, cut to what is left of the deadline, and is skipped when under 10 s are left,
# so a hang costs its own limit and never the later stages. $OUT (default bench/results/latest) gets one log per
# stage and summary.txt; MOEI_COMMIT (the commit the footers name) is bench/COMMIT in a copied tree without git.
# `timeout` runs commands, not shell functions: pass `python3 ...`, `bash ...` or `env VAR=... python3 ...`.

stages_begin() {  # stages_begin NAME DEFAULT_STAGES DEFAULT_BUDGET_S [STAGES]
    STAGES=",${4:-$2},"
    OUT=${OUT:-bench/results/latest}
    mkdir -p "$OUT"
    export PYTHONUNBUFFERED=1
    export MOEI_COMMIT=${MOEI_COMMIT:-$(cat bench/COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)}
    DEADLINE=$((SECONDS + ${BUDGET_S:-$3}))
    SUMMARY="$OUT/summary.txt"
    echo "$1 at $MOEI_COMMIT on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)" \
        "(stages ${STAGES:1:-1}, deadline ${BUDGET_S:-$3} s)" > "$SUMMARY"
}

want() { [[ "$STAGES" == *",$1,"* ]]; }

say() { echo "$*" | tee -a "$SUMMARY"; }

stage() {  # stage LIMIT_S NAME COMMAND...  (the limit cut to the time left; skipped under 10 s)
    local wanted=$1 name=$2 left=$((DEADLINE - SECONDS)); shift 2
    local limit=$((left < wanted ? left : wanted))
    if [ "$limit" -lt 10 ]; then say "== $name: skipped, ${left}s left"; return; fi
    say "== $name (limit ${limit}s, at ${SECONDS}s)"
    timeout --kill-after=5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    say "   exit $rc$([ $rc -eq 124 ] && echo ' (time limit)')"
    tail -n "${TAIL:-12}" "$OUT/$name.log" | cut -c1-400 | sed 's/^/   | /' | tee -a "$SUMMARY"
}
