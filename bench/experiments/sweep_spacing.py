"""Does the GEMV arm cost more back to back than between other work? The sweep's graph timing of the arm (v4-shape,
n = 1) reads 1.11x what the same kernels add to the runtime's step (run 69: 82.6 against 74.4 µs, on the runtime's
own routing), and timing it between the runtime's neighbours (the router before, the next norm after) did not close
the gap (82.7). Back to back, the arm streams 300 MB a call with nothing between; in the step it runs between ~40 µs
of other kernels. This times the arm's calls in one CUDA graph with a spacer between calls and subtracts the graph of
the spacers alone (per call):

    back to back         arm, arm, ...
    sleep S µs           arm, spin S µs, arm, ...  (torch.cuda._sleep: the SMs idle, no memory traffic)
    copy C MB            arm, a C MB device copy, arm, ...  (memory traffic, as the step's dense GEMVs stream ~76 MB)

at one routing and at 4 rotating uniform routings (each call wakes experts the call before did not). If the arm
between spacers reads what the runtime adds, the gap is how the arm is surrounded, not the arm.

    python3 bench/experiments/sweep_spacing.py       # ~1 minute on an H200; JSON to $OUT/sweep_spacing.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402

from engine.bench import graph_call_us  # noqa: E402
from engine.provenance import commit_label  # noqa: E402
from kernels.moe_gemv import moe_gemv  # noqa: E402
from sweep_vs_runtime import v4_gemv_inputs  # noqa: E402

SLEEPS_US = (10, 40)
COPIES_MB = (8, 76)


def main() -> None:
    w13, w2, sets = v4_gemv_inputs(4)  # the inputs sweep_vs_runtime.py's graph_call_us rows time
    copy_source = torch.empty(max(COPIES_MB) << 18, device="cuda")  # float32: MB << 18 elements
    copy_target = torch.empty_like(copy_source)
    # cycles a µs, from the clock a spin of a known count takes
    probe = graph_call_us(lambda: torch.cuda._sleep(100_000), calls=10)
    cycles_per_us = 100_000 / probe
    rows = []

    def spacer(kind: str, size: int):
        if kind == "sleep":
            cycles = int(size * cycles_per_us)
            return lambda: torch.cuda._sleep(cycles)
        elements = size << 18
        return lambda: copy_target[:elements].copy_(copy_source[:elements])

    for rotations in (1, 4):
        counter = iter(range(1 << 62))

        def arm(rotations=rotations, counter=counter):
            x, ids, weights = sets[next(counter) % rotations]
            moe_gemv(x, w13, w2, ids, weights)

        calls = 12
        plain = graph_call_us(arm, calls=calls)
        rows.append({"routings": rotations, "spacer": "none", "us": plain})
        print(f"{rotations} routing(s), back to back: {plain:.2f} µs a call", flush=True)
        for kind, sizes in (("sleep", SLEEPS_US), ("copy", COPIES_MB)):
            for size in sizes:
                gap = spacer(kind, size)
                alone = graph_call_us(gap, calls=calls)

                def spaced(gap=gap):
                    arm()
                    gap()

                both = graph_call_us(spaced, calls=calls)
                rows.append({"routings": rotations, "spacer": f"{kind} {size}", "spacer_us": alone, "us": both - alone})
                print(f"{rotations} routing(s), {kind} {size} {'µs' if kind == 'sleep' else 'MB'} between "
                      f"(the spacer alone {alone:.2f} µs): the arm adds {both - alone:.2f} µs a call "
                      f"({(both - alone) / plain:.3f} x back to back)", flush=True)
    out = Path(os.environ.get("OUT", "bench/results/latest"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep_spacing.json").write_text(json.dumps({
        "commit": commit_label(), "device": torch.cuda.get_device_name(), "cycles_per_us": cycles_per_us,
        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
