"""bench/sass_loops.py, which turns a kernel's SASS into the issue bound the trellis bench prints: its loop
finding and pipe counts on a known listing, and on the sm_90 build of the trellis GEMV (no GPU needed:
Triton's bundled ptxas and cuobjdump)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import sass_loops  # noqa: E402

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   ISETP.GE.AND P0, PT, R2, 0x10, PT ;
        /*0020*/                   IMAD R3, R3, R4, 0x5 ;
        /*0030*/                   LOP3.LUT R3, R3, 0xff, RZ, 0xc0, !PT ;
        /*0040*/                   FFMA R5, R3, R6, R5 ;
        /*0050*/                   LDG.E R7, desc[UR4][R8.64] ;
        /*0060*/              @!P0 BRA 0x20 ;
        /*0070*/                   EXIT ;
"""


def test_main_loop_and_pipe_counts_of_a_known_listing():
    loop = sass_loops.main_loop(LISTING)
    assert loop == ["IMAD", "LOP3", "FFMA", "LDG", "BRA"]
    counts = sass_loops.pipe_counts(loop)
    assert counts == {"issue": 5, "alu": 1, "fma": 1, "fmaheavy": 1, "lsu": 1, "xu": 0}
    # 5 instructions a trip for 2 weights a thread: 2.5 per weight; 64 weights on 1 SM at 1 GHz
    bound = sass_loops.issue_bound_us(sass_loops.per_weight(loop, 2), 64, sms=1, clock_hz=1e9)
    assert bound["issue"] == pytest.approx(2.5 * 64 / 32 / 4 / 1e9 * 1e6)
    assert bound["limit"] == "issue" and bound["bound"] == bound["issue"]


_COMPILE = """
import json, sys
sys.path.insert(0, "bench")
import sass_loops, trellis_sm90_compile as report
from kernels import trellis_gemv
schedule = trellis_gemv.SCHEDULES[trellis_gemv.TABLE_SCHEDULE]
function, constants = report.gemv_kernel(schedule, "hyb", 2)
kernel = report.compile_sm90(function, dict(constants, USE_GDC=False), schedule.num_warps, 3)
loop = sass_loops.main_loop(sass_loops.sass_of(kernel.asm["cubin"]))
weights = schedule.block_tile_rows * schedule.block_tile_columns * 256 / (32 * schedule.num_warps)
print(json.dumps(sass_loops.per_weight(loop, weights)))
"""


def test_the_gemv_loop_of_the_sm90_build_is_found():
    """Compiled in a child process: the tests' interpreter (TRITON_INTERPRET=1) cannot build for a GPU."""
    pytest.importorskip("triton")
    if sass_loops.cuobjdump() is None:
        pytest.skip("no cuobjdump in this Triton")
    counts = sass_loops.compiled_in_child(_COMPILE)
    # hyb: two FFMAs per step of two weights, and at least a shift, the hash and the table read per state:
    # the loop found is the decode loop (about 3.5 a weight at the least, docs/trellis-kernels.md)
    assert counts["fma"] == pytest.approx(1.0, abs=0.1)
    assert 3.0 < counts["issue"] < 12.0
