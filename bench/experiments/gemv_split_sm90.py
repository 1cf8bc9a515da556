"""Check on a machine WITHOUT a GPU that splitting kernels/gemv_fused.py into one kernel per fusion
(kernels/gemv_norm.py, gemv_route.py, gemv_pick.py over kernels/parts.py) left the sm_90 code of every
specialisation the decode step launches unchanged.

    python3 bench/experiments/gemv_split_sm90.py OLD_TREE      e.g. OLD_TREE from
        mkdir /tmp/old && git archive cc943f1 kernels | tar -x -C /tmp/old

Compiles, for sm_90 through triton.compiler.ASTSource (written against triton 3.9), the v4-shape one-row
specialisations (K = 4096, bf16, PDL and the preload on) of the old single kernel from OLD_TREE and of the
new per-fusion kernels from this tree (and of kernels.router, kernels.next_tokens and kernels.rms_norm,
whose shared jit functions moved to kernels.parts), and compares for each: the PTX text of the kernel's body, registers
included, with each register a parameter is loaded into named after its argument (the kernels' parameter
lists differ, so parameter offsets, load order and those registers may), and the registers and stack
cuobjdump reports. Prints one line per specialisation; exit 1 if any
differs. A finished check: it knows the old kernel's argument names.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Specialisations of the v4-shape decode step at one row (engine.decode_fused): K = 4096, N = 256.
K, N, TOP_K = 4096, 256, 6
COMMON = dict(M_PAD=1, BLOCK_N=2, BLOCK_K=4096, SLICE=32, NORM=True, EXACT=True, GATHER=False, RESIDUAL=True,
              USE_GDC=True, PRELOAD=True)
SPECS = {
    "router (norm, top-k, woken)": ("route", dict(WRITE_X=True, WRITE_H=True, TOP_K=TOP_K, K_PAD=8, E_PAD=256,
                                                  WOKEN=True, COUNT_BLOCK=8, OVER_ALL=False)),
    "LM head (norm, argmax, feed)": ("pick", dict(WRITE_X=False, WRITE_H=False, FEED=True, PICK_BLOCK=256,
                                                  NEXT_NORM=False, NEXT_BLOCK=4096)),
    "LM head (norm, argmax, feed, next norm)": ("pick", dict(WRITE_X=False, WRITE_H=False, FEED=True, PICK_BLOCK=256,
                                                             NEXT_NORM=True, NEXT_BLOCK=4096)),
    "LM head (norm, logits only)": ("store", dict(WRITE_X=False, WRITE_H=False)),
}
# The kernels whose per-row work moved into kernels.parts (the same jit functions, called from there now).
MOVED = {
    "router: topk_softmax": ("router", "_topk_softmax_kernel",
                             dict(E_PAD=256, TOP_K=TOP_K, K_PAD=8, WOKEN=True, COUNT_BLOCK=8, OVER_ALL=False,
                                  USE_GDC=True), 1),
    "next_tokens": ("next_tokens", "_next_tokens_kernel", dict(BLOCK=256, FEED=True, USE_GDC=True), 4),
    "rms_norm (residual)": ("rms_norm", "_rms_norm_kernel",
                            dict(BLOCK_D=4096, HAS_RESIDUAL=True, GATHER=False, USE_GDC=True), 4),
}
OLD_OFF = dict(ROUTE=False, TOP_K=1, K_PAD=1, E_PAD=1, WOKEN=False, COUNT_BLOCK=1, ROPE=False, HEAD_DIM=1,
               HAS_SLOTS=False, PICK=False, FEED=False, PICK_BLOCK=1, NEXT_NORM=False, NEXT_BLOCK=1)


def _type(name: str) -> str:
    if not name.endswith("_ptr"):
        return "fp32" if name in ("eps", "next_eps", "scale", "route_scale") else "i32"
    if name in ("ids_ptr", "arrivals_ptr", "position32_ptr"):
        return "*i32"
    if name in ("woken_ptr", "tokens_ptr", "feed_ptr", "index_ptr", "position_ptr", "slot_ptr", "observed_ptr",
                "inputs_ptr"):
        return "*i64"
    if name in ("out_ptr", "weights_ptr", "inv_freq_ptr", "logits_ptr"):
        return "*fp32"
    return "*bf16"


def _compile(fn, constexprs: dict, num_warps: int = 4):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs = {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        signature[name] = _type(name)
        if signature[name].startswith("*") or name.startswith("stride") or name in ("k_in", "n_out"):
            attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": 3})


def _describe(kernel, arguments: list[str]) -> dict:
    """`arguments`: the kernel's non-constexpr argument names, in order (PTX parameter i is arguments[i])."""
    import triton

    ptx = kernel.asm["ptx"]
    body = ptx[ptx.index("{", ptx.index(".entry")):]
    body = body[:re.search(r"^}", body, re.MULTILINE).start()]  # the kernel's body, not the debug sections after
    lines = [line.strip() for line in body.splitlines()
             if line.strip() and not line.strip().startswith(("//", ".loc", ".file", "$L__tmp", "$L__func"))]
    # The parameter lists differ, so parameter offsets, the order they are loaded in and the registers they land
    # in may: each register a parameter is loaded into is named after the argument, then everything must match.
    names = {}
    for line in lines:
        match = re.match(r"ld\.param\.\w+\s+(%\w+), \[\w+_param_(\d+)\];", line)
        if match:
            names[match.group(1)] = f"<{arguments[int(match.group(2))]}>"
    rename = re.compile(r"%\w+\b")
    params = sorted(names.values())
    code = [rename.sub(lambda found: names.get(found.group(0), found.group(0)), line)
            for line in lines if not line.startswith("ld.param")]
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as handle:
        handle.write(kernel.asm["cubin"])
    usage = subprocess.run([str(cuobjdump), "-res-usage", handle.name], capture_output=True, text=True).stdout
    os.unlink(handle.name)
    registers, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    return {"code": code, "params": params, "registers": registers and int(registers.group(1)),
            "stack": stack and int(stack.group(1))}


def _build(tree: str) -> dict:
    """Run inside a process whose sys.path starts at `tree`: every spec's description."""
    sys.path.insert(0, tree)
    new = (Path(tree) / "kernels" / "gemv_route.py").exists()
    out = {}
    for label, (fusion, extra) in SPECS.items():
        constexprs = {**COMMON, **extra}
        if new:
            from kernels import gemv_norm, gemv_pick, gemv_route

            fn = {"route": gemv_route._gemv_route_kernel, "pick": gemv_pick._gemv_pick_kernel,
                  "store": gemv_norm._gemv_norm_kernel}[fusion]
        else:
            from kernels import gemv_fused

            fn = gemv_fused._gemv_fused_kernel
            constexprs = {**OLD_OFF, **constexprs, "ROUTE": fusion == "route", "PICK": fusion == "pick"}
            constexprs = {name: value for name, value in constexprs.items() if name in fn.arg_names}
        out[label] = _describe(_compile(fn, constexprs), [name for name in fn.arg_names if name not in constexprs])
    import importlib

    for label, (module, kernel, constexprs, warps) in MOVED.items():
        fn = getattr(importlib.import_module(f"kernels.{module}"), kernel)
        out[label] = _describe(_compile(fn, constexprs, warps), [name for name in fn.arg_names if name not in constexprs])
    return out


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--build":
        print(json.dumps(_build(sys.argv[2])))
        return 0
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    results = []
    for tree in (sys.argv[1], str(REPO)):
        done = subprocess.run([sys.executable, __file__, "--build", tree], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": tree})
        if done.returncode:
            print(done.stderr, file=sys.stderr)
            return 2
        results.append(json.loads(done.stdout))
    old, new = results
    status = 0
    for label in [*SPECS, *MOVED]:
        same = old[label]["code"] == new[label]["code"] and old[label]["params"] == new[label]["params"]
        status |= not same
        print(f"{label:42s} PTX lines {len(old[label]['code'])} -> {len(new[label]['code'])} "
              f"{'identical' if same else 'DIFFER'}; registers {old[label]['registers']} -> "
              f"{new[label]['registers']}, stack {old[label]['stack']} -> {new[label]['stack']}")
    return status


if __name__ == "__main__":
    sys.exit(main())
