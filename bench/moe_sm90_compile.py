"""Compile the MoE kernels for sm_90 on a machine WITHOUT a GPU and report what ptxas made of them:
registers, stack (spills), shared memory, and whether the MMAs are wgmma and the loads pipelined
(cp.async). A CPU-only check that the Hopper build of every kernel exists and has the intended
shape, before the lead spends H200 minutes on it.

    python3 bench/moe_sm90_compile.py          (uses the ptxas and cuobjdump shipped in the triton wheel)

Specialisations follow the v4-shape launch (D=4096, F=2048, k=6, tile_m=16): pointers and the
sizes and strides that are multiples of 16 get Triton's divisibility hint, as the JIT gives them
on the GPU (without it nothing is vectorised or pipelined). Built on triton.compiler.ASTSource,
whose arguments have changed between Triton releases: written against 3.9 (this machine); the
GPU machine's 3.6 compiles through the normal JIT path (bench/moe_compile_report.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels import moe_align, moe_gemv, moe_grouped  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
# runtime ints that are not multiples of 16 at v4-shape (token-dependent counts, grid walk)
NOT_MULTIPLE_OF_16 = {"num_pairs", "max_windows", "num_programs", "num_experts", "num_chunks", "max_tiles",
                      "num_tile_blocks"}


def _types(name: str) -> str:
    if not name.endswith("_ptr"):
        return "i32"
    if any(part in name for part in ("sorted", "tile_expert", "window", "padded", "topk_ids", "rank", "chunk",
                                     "counts", "offsets", "pair_rows", "used", "counters")):
        return "*i32"
    return "*fp32" if "topk_weights" in name or "partials" in name else "*bf16"


def compile_sm90(fn, constexprs: dict, num_warps: int, num_stages: int):
    signature, attrs = {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        signature[name] = _types(name)
        if signature[name].startswith("*") or name not in NOT_MULTIPLE_OF_16:
            attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})


def describe(label: str, kernel) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as handle:
        handle.write(kernel.asm["cubin"])
    usage = subprocess.run([str(CUOBJDUMP), "-res-usage", handle.name], capture_output=True, text=True).stdout
    os.unlink(handle.name)
    registers = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
    return (f"{label:30s} regs={registers.group(1) if registers else '?':>3} stack={stack.group(1) if stack else '?':>3} "
            f"shared={kernel.metadata.shared / 1024:5.0f}KB warps={kernel.metadata.num_warps} "
            f"stages={kernel.metadata.num_stages} wgmma={len(re.findall(r'wgmma.mma_async', ptx))} "
            f"mma.sync={len(re.findall(r'mma.sync', ptx))} cp.async={ttgir.count('async_copy_global_to_local')} "
            f"v4-loads={len(re.findall(r'ld.global[.a-zA-Z0-9:_]*v4', ptx))} "
            f"bar.sync={len(re.findall(r'bar.sync', ptx))}")


def main() -> int:
    tile_m = moe_grouped.DEFAULT_TILE_M
    for variant, schedule in moe_grouped._SCHEDULES.items():
        window_rows = tile_m if schedule.one_tile_per_program else moe_grouped.ROWS_PER_PROGRAM
        common = dict(TILE_M=tile_m, WINDOW_ROWS=window_rows, BLOCK_M=moe_grouped.ROWS_PER_PROGRAM,
                      BLOCK_K=moe_grouped.BLOCK_K, GROUP_WINDOWS=schedule.group_windows,
                      PERSISTENT=schedule.persistent, EVEN_K=True, DOT_PRECISION="tf32")
        kernel = compile_sm90(moe_grouped._gate_up_kernel, dict(common, TOP_K=6, BLOCK_N=schedule.gate_up_block_n),
                              schedule.num_warps, schedule.num_stages)
        print(describe(f"grouped gate_up v{variant}", kernel))
        kernel = compile_sm90(moe_grouped._down_kernel, dict(common, BLOCK_N=schedule.down_block_n),
                              schedule.num_warps, schedule.num_stages)
        print(describe(f"grouped down v{variant}", kernel))
    print(describe("grouped reduce", compile_sm90(moe_grouped._reduce_kernel, dict(TOP_K=6, BLOCK_D=moe_grouped.REDUCE_BLOCK_D), 4, 3)))
    print(describe("gemv gate_up", compile_sm90(moe_gemv._gate_up_kernel, dict(
        TOP_K=6, BLOCK_F=moe_gemv.GATE_UP_BLOCK_F, BLOCK_D=moe_gemv.GATE_UP_BLOCK_D, F_STEPS=moe_gemv.GATE_UP_F_STEPS,
        USE_GDC=True,
        WEIGHT_EVICTION="evict_first"), moe_gemv.NUM_WARPS, 3)))
    print(describe("gemv down", compile_sm90(moe_gemv._down_kernel, dict(
        TOP_K=6, BLOCK_D=moe_gemv.DOWN_BLOCK_D, BLOCK_F=moe_gemv.DOWN_BLOCK_F, USE_GDC=True, PRELOAD=True,
        WEIGHT_EVICTION="evict_first"), moe_gemv.NUM_WARPS, 3)))
    warps = moe_align.NUM_WARPS
    print(describe("align count", compile_sm90(moe_align._count_kernel, dict(CHUNK=moe_align.CHUNK_PAIRS, E_PAD=256), warps, 3)))
    print(describe("align scan", compile_sm90(moe_align._scan_kernel, dict(SCAN_BLOCK=moe_align.SCAN_CHUNKS, E_PAD=256), warps, 3)))
    print(describe("align place", compile_sm90(moe_align._place_kernel, dict(
        TILE_M=tile_m, WINDOW_TILES=moe_grouped.ROWS_PER_PROGRAM // tile_m, CHUNK=moe_align.CHUNK_PAIRS,
        BLOCK_TILES=moe_align.TILES_PER_PROGRAM, E_PAD=256, SINGLE_CHUNK=False), warps, 3)))
    # the single-launch path: num_pairs is a runtime argument and every program reads
    # FUSED_MAX_PAIRS ids, so this one build per tile_m serves every N <= 512 at E <= 256
    for tile_m_fused in moe_grouped.TILE_M_CHOICES:
        print(describe(f"align fused tile_m={tile_m_fused}", compile_sm90(moe_align._fused_kernel, dict(
            TILE_M=tile_m_fused, WINDOW_TILES=max(1, moe_grouped.ROWS_PER_PROGRAM // tile_m_fused),
            MAX_PAIRS=moe_align.FUSED_MAX_PAIRS, CHUNK=moe_align.FUSED_CHUNK_PAIRS,
            BLOCK=moe_align.FUSED_BLOCK_TILES, E_PAD=256), warps, 3)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
