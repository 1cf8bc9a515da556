"""The sm_90 builds of kernels.moe_gemv with and without shared experts, on a machine WITHOUT a GPU: registers of
each, and whether the routed-only build (SHARED_CHUNKS = 0, the launch every model without shared experts makes)
issues the same SASS as the kernels of another revision (default: main) — the fold then costs Qwen3 and
v4-shape nothing.

    python3 bench/moe_shared_fold_sass.py [--against REV] [--json]

Builds at the shapes the decode step launches: gate-up with F_STEPS 1 (a one-token V2-Lite or Qwen3 layer, below
MIN_GATE_UP_PROGRAMS) and 2 (v4-shape), down with PDL and its preload; the fold's builds with S = 2 chunks
(V2-Lite: Fs = 2816 = 2 x 1408). `--against`'s file is read with `git show REV:kernels/moe_gemv.py` and built
beside this tree's; the SASS is compared instruction by instruction (addresses dropped). Triton's bundled ptxas
and cuobjdump (bench/moe_sm90_compile.py, bench/sass_loops.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import moe_sm90_compile as report  # noqa: E402
import sass_loops  # noqa: E402

from kernels import moe_gemv  # noqa: E402

# the kernels' arguments added for shared experts: absent from an older revision, constexpr defaults in the
# routed-only build (as the JIT makes None and an unused default)
SHARED_ARGS = {"ws13_ptr": None, "ws2_ptr": None, "shared_intermediate": 0, "stride_wsr": 0, "stride_ws2r": 0,
               "num_routed_pairs": 0}
# runtime ints of the fold's builds that are not multiples of 16 at a one-token V2-Lite layer (N = 6 pairs)
FOLD_NOT_MULTIPLE_OF_16 = {"num_routed_pairs"}
_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(.*?);")


def _module_at(revision: str):
    """kernels/moe_gemv.py at `revision`, loaded as its own module (its imports resolve to this tree's kernels)."""
    text = subprocess.run(["git", "show", f"{revision}:kernels/moe_gemv.py"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout
    handle = tempfile.NamedTemporaryFile("w", suffix="_moe_gemv_at_rev.py", delete=False)
    handle.write(text)
    handle.close()
    spec = importlib.util.spec_from_file_location("moe_gemv_at_rev", handle.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(fn, constexprs: dict, fold: bool):
    """compile_sm90 with the shared arguments: constexpr defaults (routed-only) or typed (the fold)."""
    present = [name for name in SHARED_ARGS if name in fn.arg_names]
    # every constexpr left at its default, as a launch that does not pass it compiles it (CLAMPED, HAS_B13, ...)
    defaults = {param.name: param.default for param in fn.params
                if param.is_constexpr and param.name not in constexprs and param.has_default}
    constexprs = dict(defaults, **constexprs)
    if not fold:
        constexprs = dict(constexprs, **{name: SHARED_ARGS[name] for name in present})
    saved = set(report.NOT_MULTIPLE_OF_16)
    report.NOT_MULTIPLE_OF_16.update(FOLD_NOT_MULTIPLE_OF_16)
    try:
        return report.compile_sm90(fn, constexprs, moe_gemv.NUM_WARPS, 3)
    finally:
        report.NOT_MULTIPLE_OF_16.clear()
        report.NOT_MULTIPLE_OF_16.update(saved)


def _configs(module) -> dict[str, tuple]:
    common = dict(USE_GDC=True, WEIGHT_EVICTION="evict_first")
    return {
        "gate_up F_STEPS=1": (module._gate_up_kernel, dict(common, TOP_K=6, BLOCK_F=module.GATE_UP_BLOCK_F,
                                                           BLOCK_D=module.GATE_UP_BLOCK_D, F_STEPS=1)),
        "gate_up F_STEPS=2": (module._gate_up_kernel, dict(common, TOP_K=6, BLOCK_F=module.GATE_UP_BLOCK_F,
                                                           BLOCK_D=module.GATE_UP_BLOCK_D, F_STEPS=2)),
        "down": (module._down_kernel, dict(common, TOP_K=6, BLOCK_D=module.DOWN_BLOCK_D, BLOCK_F=module.DOWN_BLOCK_F,
                                           PRELOAD=True)),
    }


def _instructions(kernel) -> list[str]:
    return [match.group(1).strip() for line in sass_loops.sass_of(kernel.asm["cubin"]).splitlines()
            if (match := _INSTRUCTION.match(line))]


def _usage(kernel) -> dict:
    """{registers, stack}: cuobjdump -res-usage of the build (stack > 0: spills)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as handle:
        handle.write(kernel.asm["cubin"])
    usage = subprocess.run([str(report.CUOBJDUMP), "-res-usage", handle.name], capture_output=True, text=True).stdout
    Path(handle.name).unlink()
    found = {name: re.search(rf"{name.upper()}:(\d+)", usage) for name in ("reg", "stack")}
    return {"registers": int(found["reg"].group(1)) if found["reg"] else None,
            "stack": int(found["stack"].group(1)) if found["stack"] else None}


def compare(against: str) -> dict:
    """{label: {registers, instructions, and for the routed-only builds same_sass_as_<rev>}}."""
    other = _module_at(against)
    rows = {}
    for label, (fn, constexprs) in _configs(moe_gemv).items():
        routed = _build(fn, constexprs, fold=False)
        other_fn, other_constexprs = _configs(other)[label]
        theirs = _build(other_fn, other_constexprs, fold=False)
        mine = _instructions(routed)
        rows[f"{label} routed-only"] = {**_usage(routed), "instructions": len(mine),
                                        f"same_sass_as_{against}": mine == _instructions(theirs),
                                        f"registers_{against}": _usage(theirs)["registers"]}
        fold = _build(fn, dict(constexprs, SHARED_CHUNKS=2), fold=True)
        rows[f"{label} fold S=2"] = {**_usage(fold), "instructions": len(_instructions(fold))}
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="main", help="the revision whose kernels the routed-only builds match")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON line")
    args = parser.parse_args()
    rows = compare(args.against)
    if args.json:
        print(json.dumps(rows))
        return 0
    for label, row in rows.items():
        print(f"{label:32s} " + " ".join(f"{key}={value}" for key, value in row.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
