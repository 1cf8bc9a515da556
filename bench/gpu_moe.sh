#!/usr/bin/env bash
# MoE kernels on the H200 (issue 3): GPU tests, compile resource report, the v4-shape sweep as
# JSON and as a table, then a compact summary against the targets (read with bench/MOE_NOTES.md).
#
#   bash bench/gpu_moe.sh            results in $OUT, or bench/results/<UTC time> when OUT is unset
#
# Budget: well under 8 minutes on an H200 (tests ~2-3 min, mostly Triton compiles; report ~30 s;
# sweep ~2-3 min). Each stage has its own timeout so a hang cannot eat the others' time.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results/$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$OUT"
TOKENS=1,2,4,8,9,16,32,64,128,256,512,683,1024,2048,4096,8192
started=$(date +%s)
stage() { echo; echo "== $1 ($(( $(date +%s) - started )) s)"; }

{
    git rev-parse HEAD 2>/dev/null || echo "commit unknown"
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader 2>/dev/null
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

stage "GPU tests"
timeout 300 python3 -m pytest -m gpu tests/test_moe_kernels.py -x -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.txt"
tests_rc=${PIPESTATUS[0]}

stage "compile report (registers, spills, shared memory, MMA instructions)"
timeout 120 python3 bench/moe_compile_report.py 2>&1 | tee "$OUT/compile_report.txt"

stage "sweep v4-shape"
timeout 360 python3 -m inspector sweep --model v4-shape --tokens "$TOKENS" --json \
    --calibration "$OUT/calibration.json" > "$OUT/sweep_v4.json" 2> "$OUT/sweep_v4.stderr"
sweep_rc=$?
tail -n 3 "$OUT/sweep_v4.stderr"
echo "sweep exit status $sweep_rc (0 ok, 1 an arm failed its check, 2 invalid environment/measurement)"
if [ -s "$OUT/sweep_v4.json" ]; then
    python3 -m inspector.commands.sweep "$OUT/sweep_v4.json" | tee "$OUT/sweep_v4.txt"
fi

stage "summary"
python3 bench/moe_summary.py "$OUT/sweep_v4.json" --tests-rc "$tests_rc" | tee "$OUT/summary.txt"
echo "results in $OUT; total $(( $(date +%s) - started )) s"
