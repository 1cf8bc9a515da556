"""Is the sweep's 1.11x over the runtime a property of the process rather than of the timing? In
bench/sweep_vs_runtime.py every figure is taken in one process, in a fixed order (the runtime's routing recorded,
the sweeps, the graph timings, the profiled runtime last), and the graph timing of 4 rotating uniform routings read
84.0 µs there (run 69) but 76.4 µs in a fresh process of bench/experiments/sweep_spacing.py (run 72). This takes
each figure of sweep_vs_runtime.py (GEMV arm, n = 1, v4-shape) in a process of its own, twice, and then the sweep
and the runtime in one process in both orders:

    sweep graph          engine.sweep's --timing graph figure, uniform routings
    blocks x4            graph_call_us over 4 rotating uniform routings
    runtime              what gate-up + down add to a profiled tg32 @ b1 step

    python3 bench/experiments/sweep_fresh.py      # ~3 minutes on an H200; JSON to $OUT/sweep_fresh.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import json, sys, tempfile
from pathlib import Path
sys.path.insert(0, {bench!r})
import sweep_vs_runtime as s
scratch = Path(tempfile.mkdtemp())
out = []
for what in {order!r}:
    if what == "sweep graph":
        out.append((what, s.sweep_us("graph", scratch)))
    elif what == "blocks x4":
        out.append((what, s.blocks_us(rotations=4)))
    else:
        out.append((what, s.runtime_us()["adds_us"]))
print("RESULT " + json.dumps(out))
"""

PROCESSES = [["sweep graph"], ["blocks x4"], ["runtime"], ["sweep graph"], ["blocks x4"], ["runtime"],
             ["sweep graph", "runtime"], ["runtime", "sweep graph"], ["runtime", "blocks x4"]]


def main() -> int:
    rows = []
    for order in PROCESSES:
        code = CHILD.format(bench=str(REPO / "bench"), order=order)
        done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=240)
        line = next((text for text in done.stdout.splitlines() if text.startswith("RESULT ")), None)
        if line is None:
            print(f"{' then '.join(order)}: failed (exit {done.returncode}): {done.stderr.strip()[-400:]}", flush=True)
            rows.append({"order": order, "error": done.stderr.strip()[-400:]})
            continue
        figures = json.loads(line[len("RESULT "):])
        rows.append({"order": order, "us": figures})
        print(f"one process, {' then '.join(order)}: " + ", ".join(f"{what} {us:.2f} µs" for what, us in figures),
              flush=True)
    out = Path(os.environ.get("OUT", "bench/results/latest"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep_fresh.json").write_text(json.dumps({"commit": os.environ.get("MOEI_COMMIT"), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
