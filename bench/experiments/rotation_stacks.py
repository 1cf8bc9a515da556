"""The trellis rotations at wide launches: blocks stacked per program (kernels.trellis_rotate.STACKED) and warps.

Run 96 profiled the grouped arm at n = 8192 (v4-shape, F 2048, D 4096): swiglu_between took 1448 us of its
14.2 ms, about ten times its 604 MB at copy bandwidth; rotate 205 and unrotate_sum 246. One program a block
builds its +-1 matrices (about 40 % of its instructions) and runs a chain of small dots for one block of
2048 values. This times each kernel at each (blocks a program, warps) beside one block a program, with
every output against the reference rotation and against the one-block output.

    python3 bench/experiments/rotation_stacks.py
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

from kernels import trellis_rotate  # noqa: E402
from kernels.trellis_reference import hadamard_block, hadamard_signs, rotate, unrotate  # noqa: E402

D, F, K_TOP = 4096, 2048, 6
CONFIGS = ((1, 8), (2, 4), (2, 8), (4, 4), (4, 8), (8, 8))
CALLS = 20
NO_PDL = {"USE_GDC": False}


def per_call_us(call) -> float:
    call()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(CALLS):
            call()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / CALLS)
    return best


def relative(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def cases(tokens: int, generator) -> dict:
    """{kernel: (call(out), out, fp32 reference)} at `tokens` tokens (the grouped arm's rows: k a token)."""
    rows = tokens * K_TOP
    x = torch.randn(tokens, D, device="cuda", generator=generator).bfloat16()
    y = torch.randn(rows, 2 * F, device="cuda", generator=generator).bfloat16()
    z = torch.randn(rows, D, device="cuda", generator=generator).bfloat16()
    ids = torch.randint(0, 256, (rows,), device="cuda", dtype=torch.int32, generator=generator)
    s_d, s_f2, s_f = hadamard_signs(7, D).cuda(), hadamard_signs(8, 2 * F).cuda(), hadamard_signs(9, F).cuda()
    bd, bf = hadamard_block(D), hadamard_block(F)
    back = unrotate(y.float().view(rows, 2, F), s_f2.view(2, F), bf)
    out = {}
    o1 = torch.empty(tokens, D, device="cuda", dtype=torch.bfloat16)
    out["rotate"] = (lambda: trellis_rotate.rotate_rows(x, s_d, bd, o1, NO_PDL), o1, rotate(x.float(), s_d, bd))
    o2 = torch.empty(rows, F, device="cuda", dtype=torch.bfloat16)
    out["swiglu_between"] = (lambda: trellis_rotate.swiglu_between(y, s_f2, s_f, bf, o2, NO_PDL), o2,
                             rotate(torch.nn.functional.silu(back[:, 0]) * back[:, 1], s_f, bf))
    o3 = torch.empty(tokens, D, device="cuda", dtype=torch.bfloat16)
    out["unrotate_sum"] = (lambda: trellis_rotate.unrotate_sum(z, ids, 256, K_TOP, s_d, bd, o3, NO_PDL), o3,
                           unrotate(z.float().view(tokens, K_TOP, D).sum(1), s_d, bd))
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("rotation_stacks needs a CUDA GPU", file=sys.stderr)
        return 2
    generator = torch.Generator(device="cuda").manual_seed(0)
    defaults = dict(trellis_rotate.STACKED)
    rows, failed = [], []
    for tokens in (1, 2048, 8192):
        for kind, (call, out, want) in cases(tokens, generator).items():
            first = None
            line = []
            for stacked, warps in CONFIGS:
                trellis_rotate.STACKED[kind] = (stacked, warps)
                try:
                    us = per_call_us(call)
                except Exception as problem:  # noqa: BLE001 - a config that does not build is a cell, not a lost run
                    line.append(f"{stacked}x{warps} {type(problem).__name__}")
                    continue
                error = relative(out, want)
                first = out.clone() if first is None else first
                versus = relative(out, first)
                line.append(f"{stacked}x{warps} {us:7.1f}")
                rows.append({"tokens": tokens, "kernel": kind, "stacked": stacked, "warps": warps, "us": us,
                             "rel_err": error, "vs_one_block": versus})
                if not error <= 1e-2:  # bf16 out
                    failed.append(f"{kind} n={tokens} {stacked}x{warps} rel err {error:.2e}")
            trellis_rotate.STACKED[kind] = defaults[kind]
            print(f"n={tokens:5d} {kind:15s} " + " | ".join(line), flush=True)
    Path(os.environ.get("OUT", ".")).joinpath("rotation_stacks.json").write_text(json.dumps(rows, indent=1))
    print("all within bf16 tolerance" if not failed else "FAILED: " + "; ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
