"""Compile the MLA split kernel (kernels.attention_mla) for sm_90 on a machine WITHOUT a GPU and report,
per launch config, what the compiler made of it: registers, spills (ptxas -v), shared memory, the wgmma
count in the PTX, each dot's warp layout (warpsPerCTA of its MMA encoding in the TTGIR: [8, 1] over 64
rows means both warpgroups compute the same rows) and the main loop's SASS by pipe (bench/sass_loops.py).
A candidate that spills or needs more than 227 KB of shared memory is marked DROP: the H200 gives a block
at most 227 KB, and a spill puts local-memory traffic in the loop; so is an unchained one whose scratch P
load the pipeliner made asynchronous (it would read the tile before the barrier: wrong, not slow).

    python3 bench/mla_sm90_compile.py                          (this machine's Triton)
    PYTHONPATH=/path/to/triton-3.6 python3 bench/mla_sm90_compile.py   (the H200's Triton, pip --target)

The specialisation is the benchmark's launch (batch 64, 128 heads, one query, latent 512 + 64, bf16,
one split: the "direct" output): pointers and the ints that are multiples of 16 get Triton's
divisibility hint, as the JIT gives them on the GPU, and num_splits = 1 is a constant as the JIT makes
it. Built on triton.compiler.ASTSource (its arguments change between releases; written against 3.6 and
3.9). The GPU run (bench/mla_bench.py --sweep) prints the registers and spills of what it timed.
"""

from __future__ import annotations

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
from kernels.attention_mla import MlaConfig, _mla_split_kernel  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
SHARED_LIMIT = 227 * 1024
POINTERS = {"q_ptr": "*bf16", "cache_ptr": "*bf16", "out_ptr": "*bf16", "partial_ptr": "*fp32", "lse_ptr": "*fp32",
            "q_start_ptr": "*i32", "scratch_ptr": "*bf16", "alpha_ptr": "*fp32"}
FLOATS = {"qk_scale_log2"}
# The configs bench/mla_bench.py's SWEEP times, and the structure candidates this table dropped.
CANDIDATES = [
    MlaConfig(64, 32, 8, 2),
    MlaConfig(64, 32, 8, 3),
    MlaConfig(64, 32, 8, 4),
    MlaConfig(64, 64, 8, 2),
    MlaConfig(64, 64, 8, 2, lazy_rescale=True),
    MlaConfig(64, 32, 8, 3, lazy_rescale=True),
    MlaConfig(64, 64, 8, 2, unchained=True),
    MlaConfig(64, 32, 8, 3, unchained=True),
    MlaConfig(64, 32, 8, 4, unchained=True),
    MlaConfig(64, 64, 8, 2, lazy_rescale=True, unchained=True),
    MlaConfig(64, 32, 8, 3, lazy_rescale=True, unchained=True),
    MlaConfig(64, 128, 8, 1, unchained=True),
    MlaConfig(64, 64, 8, 3),
    MlaConfig(64, 64, 8, 2, tma=True),
    MlaConfig(64, 32, 8, 3, tma=True),
    MlaConfig(64, 32, 8, 4, tma=True),
    MlaConfig(64, 64, 8, 2, unchained=True, tma=True),
    MlaConfig(64, 32, 8, 3, unchained=True, tma=True),
    MlaConfig(64, 32, 8, 4, unchained=True, tma=True),
    MlaConfig(64, 64, 8, 2, lazy_rescale=True, tma=True),
    MlaConfig(64, 64, 8, 2, lazy_rescale=True, unchained=True, tma=True),
]


def compile_sm90(config: MlaConfig, latent: int = 512, rope: int = 64):
    fn = _mla_split_kernel
    constexprs = dict(LATENT=latent, ROPE=rope, BLOCK_M=config.block_m, BLOCK_N=config.block_n, OUTPUT="direct",
                      DOT_PRECISION="tf32", LAZY_RESCALE=config.lazy_rescale, UNCHAINED=config.unchained,
                      PTX=True, WIDE_OFFSETS=False, TMA=config.tma, USE_GDC=True, num_splits=1)
    signature, attrs = {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        signature[name] = POINTERS.get(name, "fp32" if name in FLOATS else "i32")
        if name not in FLOATS:  # 128 heads and rows, 4096 keys, 64-multiple tiles and strides
            attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=TARGET,
                          options={"num_warps": config.num_warps, "num_stages": config.num_stages})


def _ptxas() -> str:
    """The ptxas Triton itself runs for sm_90 (3.9 ships a second one for new PTX versions)."""
    from triton.backends.nvidia import compiler as nvidia

    getter = getattr(nvidia, "get_ptxas", None)
    if getter is not None:
        try:
            return getter(90).path
        except TypeError:
            return getter().path
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas")


def ptxas_usage(ptx: str) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        log = subprocess.run([_ptxas(), "-v", "--gpu-name=sm_90a", str(source), "-o", str(Path(folder) / "k.o")],
                             capture_output=True, text=True)
    text = log.stdout + log.stderr
    registers = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return {"registers": int(registers.group(1)) if registers else None,
            "spill_stores": int(spills.group(1)) if spills else None,
            "spill_loads": int(spills.group(2)) if spills else None,
            "error": None if registers else text.strip().splitlines()[-1][:120] if text.strip() else "no output"}


def main_loop(sass: str) -> list[str]:
    """Opcodes of the longest loop closed by a CONDITIONAL backward branch. bench/sass_loops.main_loop takes
    any backward branch, and a TMA build's out-of-line mbarrier retry block jumps back into the walk with an
    unconditional one, which would count that block and everything between as the loop."""
    lines = [(int(match.group(1), 16), match.group(2).strip()) for match in map(sass_loops._LINE.match, sass.splitlines())
             if match]
    index_of = {address: index for index, (address, _) in enumerate(lines)}
    best: list[str] = []
    for index, (address, text) in enumerate(lines):
        branch = re.match(r"@!?U?P[T0-9]+\s+BRA\s+(?:`\()?(?:0x([0-9a-f]+))", text)
        if branch and int(branch.group(1), 16) < address and int(branch.group(1), 16) in index_of:
            body = lines[index_of[int(branch.group(1), 16)]:index + 1]
            if len(body) > len(best):
                best = [sass_loops._OPCODE.match(op).group(1) for _, op in body if sass_loops._OPCODE.match(op)]
    return best or sass_loops.main_loop(sass)  # a latch written as a label: bench/sass_loops.py's reading


def dot_layouts(ttgir: str) -> list[str]:
    """warpsPerCTA and instrShape of each warp_group_dot's result encoding, in program order."""
    encodings = {name: body for name, body in re.findall(r"^(#mma\d*) = #ttg\.nvidia_mma<\{(.*?)\}>", ttgir, re.M)}
    layouts = []
    for shape, encoding in re.findall(r"warp_group_dot .*?-> tensor<([0-9x]+)xf32, (#mma\d*)>", ttgir):
        body = encodings.get(encoding, "")
        warps = re.search(r"warpsPerCTA = \[([0-9, ]+)\]", body)
        layouts.append(f"{shape}:[{warps.group(1).replace(' ', '') if warps else '?'}]")
    return layouts


def describe(config: MlaConfig) -> dict:
    try:
        kernel = compile_sm90(config)
    except Exception as error:  # noqa: BLE001 - a candidate the compiler refuses is a row, not a crash
        return {"config": config.label(), "failed": f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"}
    ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
    usage = ptxas_usage(ptx)
    loop = main_loop(sass_loops.sass_of(kernel.asm["cubin"]))
    pipes = sass_loops.pipe_counts(loop)
    shared = kernel.metadata.shared
    spills = usage["spill_stores"]
    # the unchained P must be read after the barrier: an async (prefetched) volatile load would be stale
    prefetched = len(re.findall(r"async_copy_global_to_local[^\n]*isVolatile", ttgir))
    drop = [why for why, bad in (("spills", bool(spills)), ("shared > 227 KB", shared > SHARED_LIMIT),
                                 ("P prefetched past the barrier", prefetched > 0)) if bad]
    return {"config": config.label(), **usage, "shared_bytes": shared,
            "wgmma": len(re.findall(r"wgmma.mma_async", ptx)), "dots": dot_layouts(ttgir),
            "loop_instructions": pipes["issue"], "loop_mufu": loop.count("MUFU"), "loop_bar": loop.count("BAR"),
            "p_prefetched": prefetched, "drop": ", ".join(drop)}


def format_row(row: dict) -> str:
    if "failed" in row:
        return f"{row['config']:<30} FAILED {row['failed']}"
    return (f"{row['config']:<30} regs={row['registers']!s:>3} spills={row['spill_stores']!s:>4}B "
            f"shared={row['shared_bytes'] / 1024:5.0f}KB wgmma={row['wgmma']:3d} loop={row['loop_instructions']:5d} "
            f"mufu={row['loop_mufu']:3d} bar={row['loop_bar']:2d} dots {' '.join(row['dots'])}"
            f"{'  DROP: ' + row['drop'] if row['drop'] else ''}")


def main() -> int:
    print(f"MLA split kernel for sm_90, Triton {triton.__version__}, ptxas {_ptxas()}; batch 64 x 128 heads, "
          "latent 512 + 64, bf16, one split. dots: result shape and warpsPerCTA of each wgmma chain")
    for config in CANDIDATES:
        print(format_row(describe(config)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
