"""Compact summary of a v4-shape sweep (the JSON of `moe-inspector sweep --json`) against the
MoE targets (bench/RESULTS.md); bench/gpu_all.sh tests prints it after the sweep.

    python3 bench/moe_summary.py SWEEP.json [--tests-rc N]

Each target line says MET or MISSED with the numbers behind it, never a bare verdict; a target
whose rows were not measured says so.
"""

from __future__ import annotations

import argparse
import json

GROUPED = ("grouped_v0", "grouped_v1", "grouped_v2")


def _us(row: dict, arm: str) -> float | None:
    entry = row["arms"].get(arm)
    return None if entry is None else entry.get("us")


def _best_grouped(row: dict) -> tuple[str | None, float | None]:
    timed = [(arm, _us(row, arm)) for arm in GROUPED if _us(row, arm) is not None]
    return min(timed, key=lambda item: item[1]) if timed else (None, None)


def _verdict(ok: bool | None) -> str:
    return "n/a   " if ok is None else ("MET   " if ok else "MISSED")


def summarize(result: dict) -> list[str]:
    rows = {row["tokens"]: row for row in result["rows"]}
    lines = [f"{result['device']}: copy {result['copy_bandwidth_gbs']:.0f} GB/s, matmul {result['matmul_tflops']:.0f} TFLOP/s, "
             f"crossover {result['crossover_tokens']}, commit {(result.get('commit') or 'unknown')[:12]}"]
    lines.append(f"{'n':>5} {'woken':>6} {'bound µs':>9}  {'gemv':>6} {'v0':>6} {'v1':>6} {'v2':>6} {'tgmm':>6}  {'align µs':>8}  (ratios to the larger bound)")
    for n, row in sorted(rows.items()):
        ratios = []
        for arm in ("gemv", *GROUPED, "torch_grouped_mm"):
            entry = row["arms"].get(arm) or {}
            ratios.append("-" if entry.get("ratio") is None else f"{entry['ratio']:.2f}")
        lines.append(f"{n:>5} {row['woken_experts']:>6.1f} {row['bound_us']:>9.1f}  " + " ".join(f"{r:>6}" for r in ratios)
                     + f"  {row['align_us']:>8.1f}")

    def ratio(n, arm):
        entry = rows.get(n, {}).get("arms", {}).get(arm) or {}
        return entry.get("ratio")

    checks = []
    gemv1 = ratio(1, "gemv")
    checks.append((None if gemv1 is None else gemv1 <= 1.2, f"GEMV n=1 <= 1.2x bandwidth bound: {gemv1 and f'{gemv1:.2f}x'}"))
    band = [n for n in rows if 16 <= n <= 2048]
    worst = max(((n, _best_grouped(rows[n])[1] / rows[n]["bound_us"]) for n in band if _best_grouped(rows[n])[1]),
                key=lambda item: item[1], default=None)
    checks.append((None if worst is None else worst[1] <= 1.25,
                   f"best grouped <= 1.25x bound for 16<=n<=2048: worst {worst and f'{worst[1]:.2f}x at n={worst[0]}'}"))
    peer_losses = [n for n in band if _best_grouped(rows[n])[1] and _us(rows[n], "torch_grouped_mm")
                   and _best_grouped(rows[n])[1] >= _us(rows[n], "torch_grouped_mm")]
    measured_peer = [n for n in band if _us(rows[n], "torch_grouped_mm")]
    checks.append((None if not measured_peer else not peer_losses,
                   f"best grouped faster than torch_grouped_mm for 16<=n<=2048: losses at {peer_losses or 'none'}"))
    if 8192 in rows and _best_grouped(rows[8192])[1]:
        tc = _best_grouped(rows[8192])[1] / rows[8192]["tensor_core_bound_us"]
        checks.append((tc <= 1.6, f"n=8192 best grouped <= 1.6x tensor-core bound: {tc:.2f}x"))
    else:
        checks.append((None, "n=8192 not measured"))
    speedups = [(n, _us(rows[n], "grouped_v0") / _us(rows[n], "grouped_v2")) for n in sorted(rows)
                if n >= 512 and _us(rows[n], "grouped_v0") and _us(rows[n], "grouped_v2")]
    checks.append((None if not speedups else all(s >= 1.15 for _, s in speedups),
                   "v2 >= 1.15x faster than v0 for n>=512: " + ", ".join(f"n={n} {s:.2f}x" for n, s in speedups)))
    aligns = [(n, rows[n]["align_us"]) for n in sorted(rows) if n <= 64]
    checks.append((None if not aligns else all(us <= 15 for _, us in aligns),
                   f"align <= 15 µs for n<=64: max {max((us for _, us in aligns), default=0):.1f} µs"))
    checks.append((not result.get("check_failed"), "every arm within 1e-2 of the reference at every n"))
    lines.append("")
    lines.extend(f"{_verdict(ok)} {text}" for ok, text in checks)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_json")
    parser.add_argument("--tests-rc", type=int, default=None, help="exit status of the GPU pytest run")
    args = parser.parse_args()
    try:
        with open(args.sweep_json) as handle:
            result = json.load(handle)
    except (OSError, ValueError) as error:
        print(f"no sweep result to summarize ({error})")
        result = None
    if args.tests_rc is not None:
        print(f"GPU tests: {'passed' if args.tests_rc == 0 else f'FAILED (exit {args.tests_rc})'}")
    if result is not None:
        print("\n".join(summarize(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
