"""The trellis rotations' error on a GPU, against float64 butterflies, for each dot precision.

`kernels.trellis_rotate` multiplies by +-1 Sylvester matrices on tensor cores. Run 90 had the GPU fail a 1e-6
bound on the relative error of the "split" form (x's tf32 high part and its rest, two tf32 dots) where the CPU
(the interpreter's exact dot) passes it. This prints, per block size, the relative error of the rotation
kernel with "split", with Triton's "tf32x3" (the form before) and with plain "tf32", and of the float32
reference (kernels.trellis_reference.rotate), all against the same butterflies in float64: which error
is the tensor cores' and which the split's.

    python3 bench/experiments/rotation_error.py        # a table on stdout
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from kernels import trellis_rotate  # noqa: E402
from kernels.trellis_reference import (  # noqa: E402
    _walsh_hadamard,
    hadamard_block,
    hadamard_signs,
    rotate,
)

SIZES = (48, 384, 2048, 4096)
PRECISIONS = ("split", "tf32x3", "tf32")


def kernel_rotation(x, signs, block, precision):
    rows, size = x.shape
    grid, meta = trellis_rotate._grid_and_meta(rows, size, block, "rotate")
    meta["PRECISION"] = precision
    out = torch.empty_like(x)
    trellis_rotate._rotate_kernel[grid](x, signs, out, size, rows * size // block, x.stride(0), out.stride(0),
                                        **meta, USE_GDC=False)
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("rotation_error needs a CUDA GPU", file=sys.stderr)
        return 2
    print("| size | block | " + " | ".join(PRECISIONS) + " | fp32 reference |")
    print("|---:|---:|" + "---:|" * (len(PRECISIONS) + 1))
    for size in SIZES:
        generator = torch.Generator(device="cuda").manual_seed(size)
        x = torch.randn(64, size, device="cuda", generator=generator)
        block = hadamard_block(size)
        signs = hadamard_signs(7, size).cuda()
        truth = _walsh_hadamard(x.double() * signs.double(), block, torch.float64)
        errors = []
        for precision in PRECISIONS + ("reference",):
            got = rotate(x, signs, block) if precision == "reference" else kernel_rotation(x, signs, block, precision)
            errors.append(((got.double() - truth).norm() / truth.norm()).item())
        print(f"| {size} | {block} | " + " | ".join(f"{e:.2e}" for e in errors) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
