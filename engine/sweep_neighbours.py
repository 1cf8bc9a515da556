"""The kernels the fused decode step launches on either side of a MoE arm, for `sweep --timing neighbours`.

In the step (engine.decode_fused) the arm runs between the router (at one row kernels.gemv_fused's fold:
residual add, RMSNorm, the router's fp32 logits and the top-k in one launch; at more rows kernels.rms_norm, the
router's product and kernels.router.topk_softmax) and the next layer's input RMSNorm over the arm's output
(kernels.rms_norm with the residual add). Timed between them, an arm's kernels start under the router's tail
(programmatic dependent launch) and hand over to the norm as they do in the step, so the time the arm adds to a
graph of (router, arm, norm) calls, over one of (router, norm) calls, is what the runtime's profile calls the
arm's "adds µs" (bench's kernel-share table). At one row with the flag qkv_norm_fold the step's next kernel is
the next layer's q/k/v GEMV with that norm folded in (engine.decode_fused): `after` launches it on a stand-in
weight of NEXT_ROWS_PER_D x D rows (the real width is the model's attention's, which a MoE shape does not give).

    before()       the router of an n-row step at the shape's D and E (its outputs discarded: the arm keeps
                   the sweep's own routings)
    after(out)     the next layer's input norm over the arm's output out [n, D] (folded: and its product)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The stand-in q/k/v width of a folded `after`, in multiples of D (Qwen3-30B-A3B 2.5, DeepSeek-V2-Lite 1.78,
# v4-shape 1.25)
NEXT_ROWS_PER_D = 2


@dataclass
class Neighbours:
    before: object  # () -> None
    after: object  # (out [n, D]) -> None
    stand_in: torch.Tensor  # [n, D]: what `after` reads in the graph without the arm
    describe: str


def runtime_neighbours(hidden: int, experts: int, top_k: int, tokens: int, dtype: torch.dtype,
                       device: torch.device, generator: torch.Generator, fold_next: bool = False) -> Neighbours:
    """The router before and the next norm after an arm at n = `tokens`, on fresh random inputs; `fold_next`
    (the flag qkv_norm_fold): at one row that norm folded into the next q/k/v GEMV, as the step launches it."""
    from engine.decode_fused import dense, fused_rows, qkv_fold_block
    from kernels.gemv_fused import Norm, Route, gemv_fused
    from kernels.rms_norm import rms_norm
    from kernels.router import topk_softmax

    def draw(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=generator, device=device)).to(dtype)

    x = draw(tokens, hidden)
    residual = draw(tokens, hidden)
    router = draw(experts, hidden, scale=hidden ** -0.5)
    moe_norm = (1 + 0.1 * torch.randn(hidden, generator=generator, device=device)).to(dtype)
    next_norm = (1 + 0.1 * torch.randn(hidden, generator=generator, device=device)).to(dtype)
    eps = 1e-6
    if fused_rows(tokens):
        norm = Norm(moe_norm, eps, residual=residual, write_x=True, write_h=True, exact=True)

        def before():
            gemv_fused(x, router, norm=norm, route=Route(top_k, dtype))

        describe = "the router's fold (kernels.gemv_fused: residual add, RMSNorm, logits, top-k), one launch"
    else:
        def before():
            _, h = rms_norm(x, moe_norm, eps, residual=residual)
            topk_softmax(dense(h, router, torch.float32), top_k, dtype, woken=True)

        describe = "the router unfolded: rms_norm, the logits' product, topk_softmax"

    if fold_next and fused_rows(tokens):
        next_product = draw(NEXT_ROWS_PER_D * hidden, hidden, scale=hidden ** -0.5)
        block = qkv_fold_block(hidden)

        def after(out):
            gemv_fused(x, next_product, norm=Norm(next_norm, eps, residual=out, write_x=True), block=block)

        following = (f"; after it the next layer's q/k/v GEMV with its norm folded in (a stand-in of "
                     f"{NEXT_ROWS_PER_D} x D rows)")
    else:
        def after(out):
            rms_norm(x, next_norm, eps, residual=out)

        following = "; after it the next layer's rms_norm"
    return Neighbours(before, after, draw(tokens, hidden), describe + following)
