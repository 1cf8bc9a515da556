"""Candidate schedules of the trellis grouped arm at n = 2048 and 8192, v4-shape (E 256, k 6, D 4096, F 2048).

Run 92 timed 1mad at 1.33x the bf16 grouped arm at n = 2048 (m64, 2.96x its decode bound) and 1.92x at 8192
(m128, 3.24x): a weight is decoded once per window, and at 8192 an expert's 192 pairs take two 128-row windows.
The candidates here change what a window holds and how many warps share an SM's decode:

    m256      256-row windows (one per expert up to 256 pairs), 16 warps, BLOCK_K 128, 2 stages (run 96;
              kernels.trellis_grouped.SCHEDULES holds it fused, m256f)
    m256d64   m256 with down's BLOCK_N 64 (half its accumulators)
    m128w16   128-row windows at 16 warps, gate-up BLOCK_N 128
    m64f, m128f, m256f   (kernels.trellis_grouped.SCHEDULES) the gate-up's two tiles in one dot of twice the
              columns (fuse_gate_up): each warpgroup reads its A rows from shared memory once (run 98)
    m64w16    64-row windows at 16 warps (96 / 72 registers); m64w16r64 capped at 64 (two programs a SM)

    --time      each (code, schedule, n) between CUDA events beside the bf16 grouped arm, its rows checked against
                the reference, and one profiled call's device time per kernel (gate-up, down, the rest)
    --window    one call of each, after compiling, between torch.cuda.profiler.start() and stop() (for ncu)

    python3 bench/experiments/grouped_candidates.py --time [--codes 1mad,3inst,hyb] [--schedules m64,m128,m256]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
import trellis_bench  # noqa: E402

from kernels import trellis_grouped  # noqa: E402
from kernels.moe_grouped import moe_grouped  # noqa: E402
from kernels.trellis_grouped import GroupedSchedule  # noqa: E402
from kernels.trellis_reference import (  # noqa: E402
    TrellisCode,
    hadamard_block,
    moe_trellis_rotated,
    random_trellis_matrix,
)

E, K_TOP, D, F = trellis_bench.E, trellis_bench.K_TOP, trellis_bench.D, trellis_bench.F

CANDIDATES = {
    "m256": GroupedSchedule(block_m=256, gate_up_block_n=64, down_block_n=128, block_k=128, num_warps=16,
                            num_stages=2, group_windows=4, max_registers=128),
    "m256d64": GroupedSchedule(block_m=256, gate_up_block_n=64, down_block_n=64, block_k=128, num_warps=16,
                               num_stages=2, group_windows=4, max_registers=128),
    "m128w16": GroupedSchedule(block_m=128, gate_up_block_n=128, down_block_n=128, block_k=64, num_warps=16,
                               num_stages=3, group_windows=4, max_registers=128),
    "m64w16": GroupedSchedule(block_m=64, gate_up_block_n=128, down_block_n=128, block_k=64, num_warps=16,
                              num_stages=3, group_windows=4, max_registers=128),
    "m64w16r64": GroupedSchedule(block_m=64, gate_up_block_n=128, down_block_n=128, block_k=64, num_warps=16,
                                 num_stages=3, group_windows=4, max_registers=64),
}


def register() -> None:
    """Make the candidates launchable by name (this process only)."""
    for name, schedule in CANDIDATES.items():
        trellis_grouped.SCHEDULES.setdefault(name, schedule)
    trellis_grouped.SCHEDULE_NAMES = (*trellis_grouped.SCHEDULES, trellis_grouped.AUTO_SCHEDULE)


def kernel_times(call) -> dict:
    """{kernel name: device us} of one call (after it ran once)."""
    from torch.profiler import ProfilerActivity
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    kernels = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name[:48]] += event.device_time
    return dict(kernels)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--time", action="store_true")
    mode.add_argument("--window", action="store_true")
    parser.add_argument("--codes", default="1mad,3inst,hyb")
    parser.add_argument("--schedules", default="m64,m128,m256,m256d64,m128w16,m64w16,m64w16r64")
    parser.add_argument("--tokens", default="2048,8192")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("grouped_candidates needs a CUDA GPU", file=sys.stderr)
        return 2
    register()
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    codes, schedules = args.codes.split(","), args.schedules.split(",")
    stacks = {}
    for index, code in enumerate(codes):
        trellis = TrellisCode.of(code, 2)
        stacks[code] = (random_trellis_matrix(E, 2 * F, D, trellis, seed=10 * index, device=device,
                                              row_block=hadamard_block(F)),
                        random_trellis_matrix(E, D, F, trellis, seed=10 * index + 1, device=device))
    rows, failed = [], []
    w13_bf16 = w2_bf16 = None
    if args.time:
        w13_bf16 = torch.randn(E, 2 * F, D, device=device, dtype=torch.bfloat16, generator=generator).mul_(D ** -0.5)
        w2_bf16 = torch.randn(E, D, F, device=device, dtype=torch.bfloat16, generator=generator).mul_(F ** -0.5)
    token_sets = {tokens: trellis_bench.grouped_inputs(device, tokens, D, E, generator)
                  for tokens in map(int, args.tokens.split(","))}
    for tokens, sets in token_sets.items():
        x, ids, weights = sets[0]
        if args.time:
            bf16 = trellis_bench.events_per_call_us([lambda s=s: moe_grouped(s[0], w13_bf16, w2_bf16, s[1], s[2])
                                                     for s in sets])
            print(f"n={tokens} bf16 grouped {bf16['mean_us']:.0f} +- {bf16['std_us']:.0f} us", flush=True)
            rows.append({"tokens": tokens, "arm": "bf16", **bf16})
        for code in codes:
            w13, w2 = stacks[code]
            head = tuple(t[:trellis_bench.CHECK_TOKENS] for t in (x, ids, weights))
            reference = moe_trellis_rotated(head[0], w13, w2, head[1], head[2]) if args.time else None
            for schedule in schedules:
                def call(s=sets[0], c=code, name=schedule):
                    return trellis_grouped.moe_trellis_grouped(s[0], *stacks[c], s[1], s[2], schedule=name)
                try:
                    out = call()
                    torch.cuda.synchronize()
                    if args.window:
                        continue
                    error = trellis_bench.relative_error(out[:trellis_bench.CHECK_TOKENS], reference)
                    timing = trellis_bench.events_per_call_us(
                        [lambda s=s, c=code, name=schedule: trellis_grouped.moe_trellis_grouped(
                            s[0], *stacks[c], s[1], s[2], schedule=name) for s in sets])
                    parts = kernel_times(call)
                except Exception as problem:  # noqa: BLE001 - a candidate that fails is a row, not a lost run
                    failed.append(f"{code}/{schedule} n={tokens}: {type(problem).__name__}: {str(problem)[:300]}")
                    print(failed[-1], flush=True)
                    torch.cuda.synchronize()
                    continue
                ratio = timing["mean_us"] / bf16["mean_us"]
                gate_up = sum(v for k, v in parts.items() if "gate_up" in k)
                down = sum(v for k, v in parts.items() if "down" in k)
                rest = sum(parts.values()) - gate_up - down
                print(f"n={tokens} {code:5s} {schedule:10s} {timing['mean_us']:8.0f} +- {timing['std_us']:4.0f} us "
                      f"{ratio:5.2f}x bf16; gate-up {gate_up:7.0f} down {down:7.0f} rest {rest:5.0f}; "
                      f"rel err {error:.1e}", flush=True)
                if not error <= trellis_bench.TOLERANCE:
                    failed.append(f"{code}/{schedule} n={tokens} rel err {error:.2e}")
                rows.append({"tokens": tokens, "code": code, "schedule": schedule, **timing, "x_bf16": ratio,
                             "rel_err": error, "kernels_us": parts})
    if args.window:
        torch.cuda.profiler.start()
        for sets in token_sets.values():
            x, ids, weights = sets[0]
            for code in codes:
                for schedule in schedules:
                    trellis_grouped.moe_trellis_grouped(x, *stacks[code], ids, weights, schedule=schedule)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print("window done")
        return 0
    out = Path(os.environ.get("OUT", "."))
    (out / "grouped_candidates.json").write_text(json.dumps({"rows": rows, "failed": failed}, indent=1))
    print("all rows within tolerance" if not failed else "FAILED: " + "; ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
