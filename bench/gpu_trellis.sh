#!/usr/bin/env bash
# Trellis-coded experts on the H200: GPU tests of the trellis kernels, the one-run benchmark against the bf16
# arms and the bounds (bench/trellis_bench.py), and the v4-shape sweep of the trellis arms (writes the
# calibration entry with the format's crossovers). Read with docs/trellis-kernels.md.
#
#   bash bench/gpu_trellis.sh            results in $OUT, or bench/results/<UTC time> when OUT is unset
#   STAGES=grouped bash bench/gpu_trellis.sh     the grouped and dequantize decode alone, about 3 minutes:
#                                        its GPU tests, then the bench's grouped rows (--grouped-only)
#
# Budget: about 11 minutes on an H200 (tests ~3 min, bench ~4 min, sweep ~4 min), each stage under its own
# timeout so a hang cannot eat the others' time; `STAGES="tests bench"` runs a subset.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results/$(date -u +%Y%m%dT%H%M%SZ)}"
STAGES="${STAGES:-tests bench sweep}"
mkdir -p "$OUT"
started=$(date +%s)
stage() { echo; echo "== $1 ($(( $(date +%s) - started )) s)"; }

{
    git rev-parse HEAD 2>/dev/null || echo "commit unknown"
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv,noheader 2>/dev/null
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
status=0

if [[ " $STAGES " == *" tests "* ]]; then
    stage "GPU tests (decode bit for bit, arms vs reference in bf16, graph replay)"
    timeout 420 python3 -m pytest -m gpu tests/test_trellis_kernels.py tests/test_trellis_gemv_unrolled.py \
        tests/test_trellis_grouped_decode.py -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [[ " $STAGES " == *" grouped "* ]]; then
    stage "grouped decode GPU tests (tile decode bit for bit through the PTX forms, K = 3 / 4 on wgmma, auto graph)"
    timeout 150 python3 -m pytest -m gpu tests/test_trellis_grouped_decode.py -q -p no:cacheprovider 2>&1 \
        | tee "$OUT/pytest_grouped_gpu.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    stage "trellis bench, grouped rows only (n = 2048 / 8192: every schedule, the decode bound, fused == dequantize)"
    timeout 240 python3 bench/trellis_bench.py --grouped-only --out "$OUT/grouped" 2>&1 | tee "$OUT/trellis_bench_grouped.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [[ " $STAGES " == *" bench "* ]]; then
    stage "trellis bench (n = 1 GEMV, n = 2048 / 8192 grouped and dequantize, v4-shape)"
    OUT="$OUT" timeout 420 python3 bench/trellis_bench.py --out "$OUT" 2>&1 | tee "$OUT/trellis_bench.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [[ " $STAGES " == *" sweep "* ]]; then
    stage "sweep v4-shape, trellis:K=2,code=hyb"
    timeout 420 python3 -m inspector sweep --model v4-shape --experts trellis:K=2,code=hyb \
        --tokens 1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192 --json \
        --calibration "$OUT/calibration.json" > "$OUT/sweep_trellis.json" 2> "$OUT/sweep_trellis.stderr"
    sweep_rc=$?
    tail -n 3 "$OUT/sweep_trellis.stderr"
    echo "sweep exit status $sweep_rc (0 ok, 1 an arm failed its check, 2 invalid environment/measurement)"
    [ "$sweep_rc" -eq 0 ] || status=1
    if [ -s "$OUT/sweep_trellis.json" ]; then
        python3 -m inspector.commands.sweep "$OUT/sweep_trellis.json" | tee "$OUT/sweep_trellis.txt"
    fi
fi
echo "results in $OUT; total $(( $(date +%s) - started )) s; exit $status"
exit $status
