"""Where the trellis GEMV arm's time goes at n = 1, v4-shape (E 256, k 6, D 4096, F 2048), on a GPU.

Run 63 timed the arm (five launches: rotate, gate-up, between, down, unrotate) at 90.7 us for 3inst and 91.7 for
1mad, whose main loops count 9.06 and 7.05 instructions a weight: the same time for loops a quarter apart, so the
products' issue rate is not what holds the arm. This splits the arm by launch.

    --profile   torch.profiler over graph replays of the arm, GEMV_CALLS calls a graph on disjoint experts (as
                bench/trellis_bench.py times it, PDL on): each launch's mean device time a call, for every code
                and every schedule of --schedules, beside the bf16 GEMV arm's launches
    --window    one call of each code's arm, and of the bf16 arm, between torch.cuda.profiler.start() and stop(),
                after every kernel has compiled: the window `ncu --profile-from-start off` reads

    python3 bench/experiments/trellis_probe.py --profile
    ncu --clock-control none --profile-from-start off --section ... python3 bench/experiments/trellis_probe.py --window
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

from kernels import settings, trellis_gemv  # noqa: E402
from kernels.moe_gemv import moe_gemv  # noqa: E402
from kernels.trellis_reference import TrellisCode, hadamard_block, random_trellis_matrix  # noqa: E402

E, K_TOP, D, F = trellis_bench.E, trellis_bench.K_TOP, trellis_bench.D, trellis_bench.F


def build(device, codes, schedules):
    generator = torch.Generator(device=device).manual_seed(0)
    w13 = torch.randn(E, 2 * F, D, device=device, dtype=torch.bfloat16, generator=generator).mul_(D ** -0.5)
    w2 = torch.randn(E, D, F, device=device, dtype=torch.bfloat16, generator=generator).mul_(F ** -0.5)
    x = torch.randn(1, D, device=device, generator=generator).bfloat16()
    weights = torch.softmax(torch.randn(1, K_TOP, device=device, generator=generator), dim=1).bfloat16()
    ids = [torch.arange(6 * c, 6 * c + 6, device=device, dtype=torch.int32).view(1, K_TOP)
           for c in range(trellis_bench.GEMV_CALLS)]
    arms = {"bf16": [lambda i=i: moe_gemv(x, w13, w2, i, weights) for i in ids]}
    for index, code in enumerate(codes):
        trellis = TrellisCode.of(code, 2)
        t13 = random_trellis_matrix(E, 2 * F, D, trellis, seed=10 * index, device=device, row_block=hadamard_block(F))
        t2 = random_trellis_matrix(E, D, F, trellis, seed=10 * index + 1, device=device)
        for schedule in schedules:
            arms[f"{code}/{schedule}"] = [
                lambda i=i, a=t13, b=t2, s=schedule: trellis_gemv.moe_trellis_gemv(x, a, b, i, weights, schedule=s)
                for i in ids]
    return arms


def profile(arms: dict) -> dict:
    """{arm: {kernel: mean us a call}} from one profiled replay of a graph of the arm's calls."""
    from torch.profiler import ProfilerActivity
    result = {}
    for name, calls in arms.items():
        graph = trellis_bench.captured(calls)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        wall = start.elapsed_time(end) * 1e3 / len(calls)
        with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        kernels = collections.defaultdict(float)
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                kernels[event.name[:60]] += event.device_time / len(calls)
        result[name] = {"graph_us_per_call": wall, "kernels_us_per_call": dict(kernels)}
        del graph
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--profile", action="store_true")
    mode.add_argument("--window", action="store_true")
    parser.add_argument("--codes", default="hyb,3inst,1mad")
    parser.add_argument("--preload", choices=("on", "off"), default="on",
                        help="the trellis products' PDL preload (kernels.settings' 'trellis' preloader)")
    parser.add_argument("--schedules", default=f"{trellis_gemv.TABLE_SCHEDULE},{trellis_gemv.COMPUTED_SCHEDULE}",
                        help="comma-separated kernels.trellis_gemv.SCHEDULES names, each timed for every code")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("trellis_probe needs a CUDA GPU", file=sys.stderr)
        return 2
    preloaders = set(settings.PRELOADERS) - ({"trellis"} if args.preload == "off" else set())
    settings.apply(settings.LaunchSettings(pdl_preload=frozenset(preloaders)))
    arms = build(torch.device("cuda"), args.codes.split(","), args.schedules.split(","))
    if args.profile:
        result = profile(arms)
        for name, row in result.items():
            parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(row["kernels_us_per_call"].items(), key=lambda kv: -kv[1]))
            print(f"{name}: graph {row['graph_us_per_call']:.1f} us a call; {parts}")
        out = Path(os.environ.get("OUT", "."))
        (out / "trellis_probe.json").write_text(json.dumps(result, indent=1))
        return 0
    for calls in arms.values():  # compile everything outside the window
        calls[0]()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for calls in arms.values():
        calls[1]()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("window done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
