"""Any moe-inspector command with kernels.l2_prefetch's pace changed: each prefetch program pauses PAUSE_NS after
every CHUNK-byte bulk prefetch, so the flag l2_prefetch's side stream asks DRAM for about
PROGRAMS x CHUNK / PAUSE_NS bytes a nanosecond instead of all at once, and the latency-bound kernels beside it
queue behind less traffic.

    python3 bench/experiments/prefetch_pace.py --pause-ns 500 [--chunk 65536] [--programs 16] bench --model ... \
        --set l2_prefetch=routing

Not a flag: an experiment's switch (the module constants the launcher reads), not a choice a user makes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from inspector.cli import main  # noqa: E402
from kernels import l2_prefetch  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--pause-ns", type=int, required=True)
    parser.add_argument("--chunk", type=int, default=l2_prefetch.CHUNK_BYTES)
    parser.add_argument("--programs", type=int, default=l2_prefetch.PROGRAMS)
    pace, rest = parser.parse_known_args()
    l2_prefetch.PAUSE_NS, l2_prefetch.CHUNK_BYTES, l2_prefetch.PROGRAMS = pace.pause_ns, pace.chunk, pace.programs
    print(f"l2_prefetch paced: {pace.programs} programs, {pace.chunk} B chunks, {pace.pause_ns} ns pauses")
    sys.exit(main(rest))
