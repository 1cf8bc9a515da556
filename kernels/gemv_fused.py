"""The decode step's fused GEMVs behind one call: the RMSNorm in front folded in, and behind it at most one
epilogue, each fusion its own kernel.

    gemv_fused(x, w, out_dtype, norm=Norm(...))              kernels.gemv_norm   the product (store)
    gemv_fused(x, w, norm=..., route=Route(k, dtype))        kernels.gemv_route  + the top-k routing
    gemv_fused(x, w, torch.float32, norm=..., pick=Pick(..)) kernels.gemv_pick   + the argmax (and feed)

engine.decode_fused calls this; it checks that one epilogue is asked for and hands the launch to the
fusion's launcher, which checks its own inputs (ValueError naming the problem). Shapes, rounding and
launch names: the three modules. The @triton.jit functions they share: kernels.parts.
"""

from __future__ import annotations

import torch

from kernels.gemv_norm import MAX_ROWS, ROW_TILE_ELEMENTS, Fused, Norm, gemv_norm, row_block  # noqa: F401
from kernels.gemv_pick import NextNorm, Pick, gemv_pick, next_norm_fits  # noqa: F401
from kernels.gemv_route import Route, gemv_route  # noqa: F401


def gemv_fused(x: torch.Tensor | None, w: torch.Tensor, out_dtype: torch.dtype | None = None, *,
               norm: Norm | None = None, bias: torch.Tensor | None = None, route: Route | None = None,
               pick: Pick | None = None, block: tuple[int, int] | None = None, preload: bool | None = None) -> Fused:
    """out = x @ w^T (or RMSNorm(x) @ w^T with `norm`) for M <= MAX_ROWS rows, fp32 accumulation, one
    launch, plus `bias` [N] as torch adds it to a rounded product; with `route` the top-k routing of the
    logits, with `pick` each row's argmax (and the next replay's inputs). `preload`: load the first weight tile
    before the PDL wait (None: as kernels.pdl.preload says for the device; the same result either way)."""
    if route is not None and pick is not None:
        raise ValueError("gemv_fused: one epilogue per launch (route or pick)")
    if route is not None:
        return gemv_route(x, w, route=route, norm=norm, bias=bias, block=block, preload=preload)
    if pick is not None:
        return gemv_pick(x, w, out_dtype, pick=pick, norm=norm, bias=bias, block=block, preload=preload)
    return gemv_norm(x, w, out_dtype, norm=norm, bias=bias, block=block, preload=preload)
