"""Where the host's time per decode step goes inside `moe-inspector bench` (cProfile), on any device.

Runs generate_batch (the bench's decode loop, without the bench's own bookkeeping) under cProfile
after a warm-up that compiles and captures, and prints functions by their own time (tottime) per
decode step: a C call that blocks on the device (a launch, a copy, an event) shows up with a large
own time, where bench/host_step.py's stub loop cannot see it. cProfile slows pure-Python code
several-fold, so read the shares, not the absolute µs.

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
    import torch

    from engine import flags as flag_module
    from engine.batch_runner import BatchRunner
    from engine.bench import device_random_weights
    from engine.config import PRESETS
    from engine.runtime import Engine

    config = PRESETS[args.model]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    weights = device_random_weights(config, 0, device, torch.bfloat16) if args.gpu_weights else None
    engine = Engine(config, device, 0, weights=weights)
    flags = flag_module.resolve()
    prompt = [[(7 * i + 3) % config.vocab_size for i in range(16)]]
    runner = BatchRunner(engine, 1, 16 + args.tg - 1, None)
    engine.generate_batch(prompt, args.tg, flags, runner=runner, timed=False)  # warm-up: compiles, captures the graph
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.reps):
        engine.generate_batch(prompt, args.tg, flags, runner=runner, timed=False)
    profiler.disable()
    steps = args.reps * args.tg  # decode steps profiled (and one prefill step per repetition)
    stats = pstats.Stats(profiler).stats
    rows = [(tt, nc, ct, f"{Path(file).name}:{line}({name})") for (file, line, name), (cc, nc, tt, ct, _) in
            stats.items()]
    rows.sort(reverse=True)
    total = sum(row[0] for row in rows)
    out = io.StringIO()
    print(f"{args.model} on {device}; generate_batch x {args.reps} of {args.tg} tokens under cProfile, after a "
          f"warm-up; {total / steps * 1e6:.1f} us of profiled host time per decode step; by own time", file=out)
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
