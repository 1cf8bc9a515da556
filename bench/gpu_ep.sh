#!/usr/bin/env bash
# Expert parallelism on a multi-GPU H200 host (nvidia-h200-x2, -x4 or -x8), NCCL over NVLink, in one call of at
# most ~9.5 minutes (every stage has its own limit and the whole call a deadline, BUDGET_S, default 570 s).
# NOT RUN YET: written on a machine without GPUs (docs/expert-parallel.md says what ran where).
#
#   1. GPU tests (tests/test_expert_parallel_gpu.py): EP = 2, 4, 8 (as many as there are GPUs) against one GPU,
#      gemv and grouped forced: the prefill's logits within bf16 tolerance, its greedy tokens identical, the
#      forced Triton arm counted on the ranks
#   2. v4-shape (--gpu-weights: E=256, top-6, D=4096, F=2048) at EP = 1 (one GPU, CUDA graphs on), 2, 4, 8:
#      pp512 and tg128 at batch 1 and 32; each EP row says the exchange's µs per step, its share of the step, its
#      bytes, and its bound (bytes over the all_to_all_single bandwidth the group measured in the same run)
#   3. the Qwen3-30B-A3B shape (bench/configs/qwen3-30b-a3b, random weights drawn on each GPU: 48 layers, E=128,
#      top-8; every rank draws the whole model, ~61 GB, then keeps its experts) at the same EPs and rows
#   4. the summary: one line per (model, EP, row): t/s (and its ratio to EP = 1), the exchange's µs/step, share,
#      MB/step, bound µs and measured/bound, and the bandwidth
#
#   bash bench/gpu_ep.sh [STAGES]   # STAGES: a comma list of tests,v4,qwen3 (default all); EPS="1 2 4 8" by
#                                   # default, those above the GPU count dropped; results under $OUT
#                                   # (default bench/results/latest): ep_summary.txt and one JSON per bench
set -uo pipefail
STAGES=",${1:-tests,v4,qwen3},"
want() { [[ "$STAGES" == *",$1,"* ]]; }
cd "$(dirname "$0")/.."
WORK=${WORK:-/tmp/moei-ep}
OUT=${OUT:-bench/results/latest}
rm -rf "$WORK"; mkdir -p "$WORK" "$OUT"
# NVLink multicast stays off on these hosts (a program that uses it can take the shared GPUs out of service)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 MOEI_CALIBRATION="$WORK/calibration.json"
export MOEI_COMMIT=${MOEI_COMMIT:-$(cat bench/COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)}
DEADLINE=$((SECONDS + ${BUDGET_S:-570}))
SUMMARY="$OUT/ep_summary.txt"
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
left() { echo $((DEADLINE - SECONDS)); }
limit() { local want=$1 rest; rest=$(left); rest=$((rest < 1 ? 1 : rest)); echo $((rest < want ? rest : want)); }
GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
say "gpu_ep.sh at $MOEI_COMMIT on $GPUS x $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
nvidia-smi topo -m > "$WORK/topology.txt" 2>&1 && say "GPU links: $(grep -c NV "$WORK/topology.txt") rows name NVLink (topology.txt)"
EPS_RUN=()
for ep in ${EPS:-1 2 4 8}; do
  if [ "$ep" -le "$GPUS" ]; then EPS_RUN+=("$ep"); else say "EP=$ep skipped: $GPUS GPUs here"; fi
done
[ "$GPUS" -ge 2 ] || say "fewer than 2 GPUs: every EP > 1 stage is skipped (run this on nvidia-h200-x2/x4/x8)"

if want tests; then
  timeout "$(limit 200)" python3 -m pytest -m gpu -q tests/test_expert_parallel_gpu.py -p no:cacheprovider \
    > "$WORK/gpu_tests.log" 2>&1
  say "1. expert-parallel GPU tests: rc $? ($(tail -1 "$WORK/gpu_tests.log")), $SECONDS s"
  cp "$WORK/gpu_tests.log" "$OUT/ep_gpu_tests.log"
fi

# bench_one NAME EP ARGS...: one bench (EP=1: one GPU, no --ep), its JSON kept; a failure is said, never fatal
bench_one() {
  local name=$1 ep=$2; shift 2
  local extra=(); [ "$ep" -gt 1 ] && extra=(--ep "$ep")
  local json="$OUT/ep_${name}_ep${ep}.json"
  timeout "$(limit 240)" python3 -m inspector bench "$@" "${extra[@]}" --pp 512 --tg 128 --batch 1,32 \
    --tg-prompt 32 --reps 3 --no-progress --json-out "$json" > "$WORK/${name}_ep${ep}.md" 2> "$WORK/${name}_ep${ep}.err"
  local rc=$?
  say "$name EP=$ep: rc $rc, $SECONDS s$( [ $rc -ne 0 ] && echo " ($(tail -1 "$WORK/${name}_ep${ep}.err"))")"
  cp "$WORK/${name}_ep${ep}.md" "$OUT/ep_${name}_ep${ep}.md" 2>/dev/null
}

if want v4; then
  for ep in "${EPS_RUN[@]}"; do bench_one v4-shape "$ep" --model v4-shape --gpu-weights; done
fi
if want qwen3; then
  for ep in "${EPS_RUN[@]}"; do bench_one qwen3-30b-a3b "$ep" --model bench/configs/qwen3-30b-a3b --weights random; done
fi

python3 - "$OUT" <<'EOF' 2>&1 | tee -a "$SUMMARY"
import glob, json, os, re, sys

reports = {}
for path in sorted(glob.glob(os.path.join(sys.argv[1], "ep_*_ep*.json"))):
    match = re.search(r"ep_(.+)_ep(\d+)\.json$", path)
    try:
        reports[(match.group(1), int(match.group(2)))] = json.load(open(path))
    except (OSError, ValueError) as error:
        print(f"{path}: unreadable ({type(error).__name__}: {error})")
if not reports:
    print("4. no bench report to summarise")
    sys.exit(0)
print("4. model | EP | row | t/s (wall) | vs EP=1 | exchange µs/step | share of step | MB/step | bound µs | "
      "measured/bound | all-to-all GB/s")
for (model, ep), report in sorted(reports.items()):
    base = {row["test"]: row for row in reports.get((model, 1), {}).get("rows", [])}
    bandwidth = report["footer"].get("expert_parallel", {}).get("bandwidth", {}).get("GBps")
    for row in report["rows"]:
        rate = (row.get("tps_wall") or {}).get("mean")
        reference = (base.get(row["test"], {}).get("tps_wall") or {}).get("mean")
        ratio = f"{rate / reference:.2f}x" if rate and reference else "-"
        exchange = row.get("exchange") or {}
        share = exchange.get("share")
        cells = [model, str(ep), row["test"], f"{rate:.1f}" if rate else row.get("state", "-"), ratio,
                 f"{exchange['us_per_step']:.0f}" if exchange else "-",
                 f"{100 * share:.1f} %" if share is not None else "-",
                 f"{exchange['bytes_per_step'] / 1e6:.2f}" if exchange else "-",
                 f"{exchange['bound_us']:.1f}" if exchange.get("bound_us") else "-",
                 f"{exchange['over_bound']:.1f}x" if exchange.get("over_bound") else "-",
                 f"{bandwidth:.0f}" if bandwidth else "-"]
        print("   " + " | ".join(cells))
EOF
say "done in $SECONDS s; reports in $OUT"
