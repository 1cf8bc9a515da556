"""Compile the trellis kernels for sm_90 on a machine WITHOUT a GPU and report, per code and schedule, the
registers, spills (stack bytes), shared memory, whether the grouped products are wgmma, the main loop's
instructions per weight by pipe (bench/sass_loops.py) and a hash of the kernel's SASS: the numbers
docs/trellis-kernels.md derives the issue bound from, and a way to show that a change left a kernel's
code as it was (equal hashes). The GPU run (bench/trellis_bench.py) recounts them on the kernels it
times, built by the GPU machine's Triton.

    python3 bench/trellis_sm90_compile.py [--only gemv|grouped|dequant ...]   (Triton's ptxas; no GPU)

Specialisations follow the v4-shape launch (D = 4096, F = 2048, k = 6): pointers and the sizes that
are multiples of 16 get Triton's divisibility hint, as the JIT gives them on the GPU. Built on
triton.compiler.ASTSource, whose arguments change between releases (written against 3.9).
"""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import sass_loops  # noqa: E402
from kernels import trellis_decode, trellis_gemv, trellis_grouped  # noqa: E402
from kernels.trellis_decode import CODE_IDS, unit_geometry  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
NOT_MULTIPLE_OF_16 = {"num_experts", "num_pairs", "max_windows"}
POINTERS = {"codes_ptr": "*i32", "scales_ptr": "*fp32", "table_ptr": "*fp32", "vec_ptr": "*fp32", "ids_ptr": "*i32",
            "weights_ptr": "*fp32", "out_ptr": "*fp32", "topk_weights_ptr": "*fp32", "x_ptr": "*bf16", "y_ptr": "*bf16",
            "h_ptr": "*bf16", "pair_out_ptr": "*bf16", "sorted_pair_ids_ptr": "*i32", "tile_expert_ids_ptr": "*i32",
            "window_first_tiles_ptr": "*i32", "padded_offsets_ptr": "*i32"}


def compile_sm90(fn, constexprs: dict, num_warps: int, num_stages: int, maxnreg: int | None = None,
                 pointers: dict | None = None):
    """The sm_90 build of `fn` (`pointers` overrides POINTERS' element types by argument name)."""
    types = {**POINTERS, **(pointers or {})}
    signature, attrs = {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        signature[name] = types.get(name, "i32")
        if signature[name].startswith("*") or name not in NOT_MULTIPLE_OF_16:
            attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return triton.compile(source, target=TARGET, options=options)


def usage(kernel) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(kernel.asm["cubin"])
        handle.flush()
        text = subprocess.run([sass_loops.cuobjdump(), "-res-usage", handle.name], capture_output=True,
                              text=True).stdout
    registers, stack = re.search(r"REG:(\d+)", text), re.search(r"STACK:(\d+)", text)
    return f"regs={registers.group(1) if registers else '?':>3} stack={stack.group(1) if stack else '?'}"


def code_constants(code: str, bits: int) -> dict:
    group, words = unit_geometry(bits)
    return dict(K=bits, V=2 if code == "hyb" else 1, G=group, WU=words, CODE=CODE_IDS[code], PTX=True)


def gemv_kernel(schedule, code: str, bits: int) -> tuple:
    """(kernel function, constexprs) of the GEMV product `schedule` launches at v4-shape, as
    kernels.trellis_gemv._product chooses them (D = 4096: the column tiles divide every schedule's step)."""
    constants = dict(VECTOR_PER_TOKEN=True, TOP_K=6, ROUTED=False, BLOCK_TR=schedule.block_tile_rows,
                     BLOCK_TC=schedule.block_tile_columns, USE_GDC=True, WEIGHT_EVICTION="evict_first",
                     **code_constants(code, bits))
    if not schedule.unrolled:
        return trellis_gemv._trellis_gemv_kernel, constants
    constants.update(TABLE_IN_SHARED=code == "hyb" and schedule.hyb_table == "shared", EVEN_COLUMNS=True)
    return trellis_gemv._trellis_gemv_steps_kernel, constants


def sass_hash(sass: str) -> str:
    """12 hex digits of the kernel's instructions (cuobjdump's listing without its file header): equal hashes,
    equal SASS, so a change that only moves jit helpers between modules can be shown to compile the same."""
    instructions = [match.group(2) for match in map(sass_loops._LINE.match, sass.splitlines()) if match]
    return hashlib.sha256("\n".join(instructions).encode()).hexdigest()[:12]


def describe(label: str, kernel, weights_per_thread: float) -> str:
    sass = sass_loops.sass_of(kernel.asm["cubin"])
    loop = sass_loops.main_loop(sass)
    counts = sass_loops.per_weight(loop, weights_per_thread)
    pipes = " ".join(f"{pipe}={counts[pipe]:.2f}" for pipe in sass_loops.RATES)
    wgmma = len(re.findall(r"wgmma.mma_async", kernel.asm["ptx"]))
    return (f"{label:34s} {usage(kernel)} shared={kernel.metadata.shared // 1024:3d}KB wgmma={wgmma:2d} "
            f"loop={len(loop):4d} per weight: {pipes} sass={sass_hash(sass)}  top {sass_loops.top_opcodes(loop, 6)}")


def grouped_kernels(schedule, code: str, bits: int) -> list:
    """[(product, kernel function, constexprs, weights a thread decodes per K step)] of the grouped arm's two
    products as kernels.trellis_grouped._run launches them at v4-shape (D = 4096, F = 2048: every block
    divides, so EVEN)."""
    gate = trellis_grouped.gate_up_shapes(schedule)
    products = (("gate_up", trellis_grouped._trellis_gate_up_kernel, gate, gate.gate_up_block_n,
                 {"TOP_K": 6, "FUSED": gate.fuse_gate_up, "PARTS": schedule.block_m // gate.block_m}, 2),
                ("down", trellis_grouped._trellis_down_kernel, schedule, schedule.down_block_n, {}, 1))
    return [(label, fn, dict(TILE_M=16, BLOCK_M=shapes.block_m, BLOCK_N=block_n, BLOCK_K=shapes.block_k,
                             GROUP_WINDOWS=shapes.group_windows, DENSE=False, STEPS=shapes.decode == "steps",
                             EVEN=True, DOT_PRECISION="tf32", USE_GDC=True, **extra, **code_constants(code, bits)),
             tiles * block_n * shapes.block_k / (32 * shapes.num_warps))
            for label, fn, shapes, block_n, extra, tiles in products]


DEQUANT_POINTERS = {"out_ptr": "*bf16", "experts_ptr": "*i32"}


def dequant_kernel(code: str, bits: int) -> tuple:
    """(kernel function, constexprs, weights a thread decodes per step) of the dequantize launch into bf16."""
    constants = dict(BLOCK_N=trellis_decode.DECODE_BLOCK_ROWS, BLOCK_K=trellis_decode.DECODE_BLOCK_COLUMNS,
                     SELECTED=True, **code_constants(code, bits))
    return (trellis_decode._trellis_dequantize_kernel, constants,
            constants["BLOCK_N"] * constants["BLOCK_K"] / (32 * trellis_decode.DECODE_NUM_WARPS))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", choices=("gemv", "grouped", "dequant"),
                        help="one section (repeatable); default all three")
    sections = parser.parse_args().only or ("gemv", "grouped", "dequant")
    codes = [("hyb", 2), ("3inst", 2), ("1mad", 2), ("hyb", 3), ("hyb", 4)]
    every_k = codes + [("1mad", 3), ("3inst", 4)]
    if "gemv" in sections:
        print("trellis GEMV (gate-up; down runs the same loop), per weight = loop instructions / weights a thread "
              "decodes per trip")
        for name, schedule in trellis_gemv.SCHEDULES.items():
            for code, bits in codes:
                kernel = compile_sm90(*gemv_kernel(schedule, code, bits), schedule.num_warps, 3)
                weights = schedule.block_tile_rows * schedule.block_tile_columns * 256 / (32 * schedule.num_warps)
                print(describe(f"gemv {name} {code} K={bits}", kernel, weights))
    if "grouped" in sections:
        print("\ntrellis grouped (fused decode), per weight = loop instructions / weights a thread decodes per K "
              "step (paid once per window)")
        for name, schedule in trellis_grouped.SCHEDULES.items():
            for code, bits in every_k if name == trellis_grouped.DEFAULT_SCHEDULE else codes[:3]:
                for label, fn, constants, weights in grouped_kernels(schedule, code, bits):
                    shapes = trellis_grouped.product_schedules(name)[0 if label == "gate_up" else 1]
                    kernel = compile_sm90(fn, constants, shapes.num_warps, shapes.num_stages, shapes.max_registers)
                    print(describe(f"grouped {name} {label} {code} K={bits}", kernel, weights))
    if "dequant" in sections:
        print("\ntrellis dequantize (bf16 out), per weight = loop instructions / weights a thread decodes per step")
        for code, bits in every_k:
            fn, constants, weights = dequant_kernel(code, bits)
            kernel = compile_sm90(fn, constants, trellis_decode.DECODE_NUM_WARPS, 3, pointers=DEQUANT_POINTERS)
            print(describe(f"dequant {code} K={bits}", kernel, weights))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
