"""Where the host's time per decode step goes inside `moe-inspector bench` (cProfile), on any device.

Runs the bench's tg row under cProfile and prints the functions called at least once per decode
step, by their own time (tottime) per step: a C call that blocks on the device (a launch, a copy or
an event) shows up here with a large own time, where bench/host_step.py's stub loop cannot see it.
cProfile slows pure-Python code several-fold, so read the shares, not the absolute µs.

    python3 bench/host_profile.py --model v4-shape --gpu-weights     (prints a table; $OUT/host_profile.txt)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="v4-shape")
    parser.add_argument("--tg", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--gpu-weights", action="store_true")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    from inspector.cli import main as cli_main

    argv = ["bench", "--model", args.model, "--pp", "16", "--tg", str(args.tg), "--batch", "1", "--reps",
            str(args.reps), "--format", "md", "--no-progress"] + (["--gpu-weights"] if args.gpu_weights else [])
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        code = cli_main(argv)
    finally:
        profiler.disable()
    steps = (args.reps + 2) * args.tg  # timed repetitions, the warm-up and the profiled one: decode steps run
    stats = pstats.Stats(profiler).stats
    rows = [(tt, nc, ct, f"{Path(file).name}:{line}({name})") for (file, line, name), (cc, nc, tt, ct, _) in
            stats.items() if nc >= steps * 0.9]
    rows.sort(reverse=True)
    out = io.StringIO()
    print(f"bench exit {code}; ~{steps} decode steps; functions called >= once per step, by own time", file=out)
    print(f"{'own us/step':>12} {'cum us/step':>12} {'calls/step':>10}  function", file=out)
    for tt, nc, ct, where in rows[:args.top]:
        print(f"{tt / steps * 1e6:12.2f} {ct / steps * 1e6:12.2f} {nc / steps:10.2f}  {where}", file=out)
    text = out.getvalue()
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "host_profile.txt").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
