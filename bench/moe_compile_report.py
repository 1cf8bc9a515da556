"""Resource report of the compiled MoE kernels on this GPU: registers, spills, shared memory,
warps, pipeline stages, what that allows per SM, and which MMA instructions the PTX uses.

Run on the GPU machine (bench/gpu_all.sh tests does): `python3 bench/moe_compile_report.py`. It runs
each arm once at v4-shape widths (D=4096, F=2048, k=6; 8 experts suffice, the expert count is not
a compile-time specialisation) so the kernels compile exactly as in the sweep, then reads the
handles Triton cached for each launch. A miss in the sweep can then be read against the numbers:
spills or one program per SM where several were planned, or mma.sync where wgmma was expected.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kernels import moe_align, moe_gemv, moe_grouped  # noqa: E402

SHARED_PER_SM = 227 * 1024  # Hopper: what one SM can give its resident blocks
REGISTERS_PER_SM = 65536


def _cached_kernels(jit_function) -> dict:
    """{cache key: CompiledKernel} for every device this JIT function compiled for."""
    found = {}
    for caches in getattr(jit_function, "device_caches", {}).values():
        kernel_cache = caches[0] if isinstance(caches, tuple) else caches
        if isinstance(kernel_cache, dict):
            found.update(kernel_cache)
    return found


def _describe(label: str, kernel) -> str:
    if hasattr(kernel, "_init_handles"):
        kernel._init_handles()
    metadata = kernel.metadata
    regs, spills = getattr(kernel, "n_regs", None), getattr(kernel, "n_spills", None)
    shared, warps = metadata.shared, metadata.num_warps
    by_shared = SHARED_PER_SM // shared if shared else 32
    by_regs = REGISTERS_PER_SM // (regs * 32 * warps) if regs else 0
    ptx = kernel.asm.get("ptx", "") if hasattr(kernel, "asm") else ""
    mma = f"wgmma={len(re.findall(r'wgmma.mma_async', ptx))} mma.sync={len(re.findall(r'mma.sync', ptx))}"
    copies = f"cp.async={len(re.findall(r'cp.async.(?:ca|cg)', ptx))} v4-loads={len(re.findall(r'ld.global[.a-z0-9]*v4', ptx))}"
    return (f"{label:32s} regs={regs} spills={spills} shared={shared / 1024:.0f}KB warps={warps} "
            f"stages={metadata.num_stages} blocks/SM<=min(smem {by_shared}, regs {by_regs}) {mma} {copies}")


def main() -> int:
    if not torch.cuda.is_available():
        print("moe_compile_report needs a CUDA GPU", file=sys.stderr)
        return 2
    generator = torch.Generator(device="cuda").manual_seed(0)
    tokens, top_k, experts, hidden, intermediate = 512, 6, 8, 4096, 2048
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=generator)
    w13 = torch.randn(experts, 2 * intermediate, hidden, device="cuda", dtype=torch.bfloat16, generator=generator)
    w2 = torch.randn(experts, hidden, intermediate, device="cuda", dtype=torch.bfloat16, generator=generator)
    topk_ids = torch.rand(tokens, experts, device="cuda", generator=generator).topk(top_k, dim=1).indices.to(torch.int32)
    topk_weights = torch.softmax(torch.randn(tokens, top_k, device="cuda", generator=generator), dim=1)

    watched = {
        "grouped gate_up": moe_grouped._gate_up_kernel,
        "grouped down": moe_grouped._down_kernel,
        "grouped reduce": moe_grouped._reduce_kernel,
        "gemv gate_up": moe_gemv._gate_up_kernel,
        "gemv down": moe_gemv._down_kernel,
        "align count": moe_align._count_kernel,
        "align scan": moe_align._scan_kernel,
        "align place": moe_align._place_kernel,
    }
    seen = {name: set() for name in watched}
    runs = [(f"v{variant}", lambda v=variant: moe_grouped.moe_grouped(x, w13, w2, topk_ids, topk_weights, variant=v))
            for variant in moe_grouped.GROUPED_VARIANTS]
    runs.append(("gemv", lambda: moe_gemv.moe_gemv(x, w13, w2, topk_ids, topk_weights)))
    print(f"compiled at n={tokens}, k={top_k}, D={hidden}, F={intermediate}, bf16, tile_m={moe_grouped.DEFAULT_TILE_M} "
          f"on {torch.cuda.get_device_name()}")
    for run_label, run in runs:
        run()
        torch.cuda.synchronize()
        for name, function in watched.items():
            for key, kernel in _cached_kernels(function).items():
                if key in seen[name]:
                    continue
                seen[name].add(key)
                print(_describe(f"{name} ({run_label})", kernel))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
