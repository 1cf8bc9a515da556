"""What a layer's attention norm costs on its own launch against folded into the q/k/v GEMV, at one token, on a GPU.

At Qwen3-30B-A3B's shape a decode step spends about 127 µs of 2555 in 49 rms_norm launches (run 70): the norm in
front of each layer's q/k/v product, with the residual add, on its own launch between MoE down and the GEMV. The
fold (kernels.gemv_fused with the norm, the flag qkv_norm_fold) computes it inside the GEMV: every program reads x,
the residual and the norm weight for its BLOCK_N outputs, so the fold's extra L2 reads are 3 / BLOCK_N of the
weight's bytes, and the rule before it (FOLD_RESIDUAL_MAX_N) kept wide products unfolded because the one-row fold's
2-output programs read twice the weight's bytes again. Here the block is the variable.

Each figure is one chain captured 48 times in one CUDA graph, a distinct weight a layer (so the weights stream
from DRAM as in the step, not from L2), PDL on as the step runs it, the median of 9 replays, per layer:

    o                                      the o projection's GEMV (its output is the norm's residual): the base
    o + rms_norm + qkv                     the step without the fold (kernels.rms_norm, kernels.gemv)
    o + fold (BLOCK_N x BLOCK_K)[ exact]   the fold at that block; exact: a first pass for the scale, h rounded

at Qwen3-30B-A3B (D 2048, q/k/v 5120 rows), DeepSeek-V2-Lite (D 2048, [q; kv_a] 3648 rows) and v4-shape
(D 4096, q/k/v 5120 rows, head dim 128) widths.

    python3 bench/experiments/qkv_fold.py          # JSON to $OUT/qkv_fold.json, a table on stdout
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench" / "experiments"))

import torch  # noqa: E402

from chains import Layers, draw, timer, write  # noqa: E402
from kernels.gemv import gemv  # noqa: E402
from kernels.gemv_fused import Norm, gemv_fused  # noqa: E402
from kernels.rms_norm import rms_norm  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (2048, 4096, 5120), "deepseek-v2-lite": (2048, 2048, 3648),
          "v4-shape": (4096, 4096, 5120)}  # (D, o's input width, the first product's rows)
BLOCKS = ((2, 2048), (4, 1024), (4, 2048), (8, 512), (8, 1024), (16, 256), (16, 512), (32, 256))


def main() -> None:
    torch.manual_seed(0)
    rows: list[dict] = []
    for shape, (hidden, o_in, qkv_rows) in SHAPES.items():
        layers = Layers((hidden, o_in), (qkv_rows, hidden))
        g = (1 + draw(hidden, scale=0.1)).contiguous()
        x, attended = draw(1, hidden, scale=1.0), draw(1, o_in, scale=1.0)
        time = timer(rows, shape, layers)

        def base():
            wo, _ = layers.next()
            gemv(attended, wo)

        def unfolded():
            wo, wqkv = layers.next()
            _, h = rms_norm(x, g, 1e-6, residual=gemv(attended, wo))
            gemv(h, wqkv)

        def folded(block, exact):
            def chain():
                wo, wqkv = layers.next()
                gemv_fused(x, wqkv, norm=Norm(g, 1e-6, residual=gemv(attended, wo), write_x=True, exact=exact),
                           block=block)
            return chain

        # the folded product against rms_norm + gemv (kernels.rms_norm rounds h before the product: compare with
        # the one-pass fold's tolerance, about one rounding of the output)
        w_o, w_qkv = layers.first()
        o = gemv(attended, w_o)
        x_new, h = rms_norm(x, g, 1e-6, residual=o)
        expected = gemv(h, w_qkv).float()
        for block in BLOCKS:
            got = gemv_fused(x, w_qkv, norm=Norm(g, 1e-6, residual=o, write_x=True), block=block)
            error = ((got.out.float() - expected).abs().max() / expected.abs().max()).item()
            assert torch.equal(got.x, x_new), "the fold's residual stream differs from rms_norm's"
            assert error < 2e-2, f"{shape} {block}: the fold's product is {error:.3g} off rms_norm + gemv"
        base_us = time("o", base)
        plain = time("o + rms_norm + qkv", unfolded) - base_us
        print(f"{shape}: rms_norm + qkv add {plain:.2f} µs", flush=True)
        for block in BLOCKS:
            for exact in (False, True):
                label = f"o + fold {block[0]} x {block[1]}{' exact' if exact else ''}"
                took = time(label, folded(block, exact)) - base_us
                print(f"{shape}: fold {block[0]} x {block[1]}{' exact' if exact else ''} adds {took:.2f} µs "
                      f"({took - plain:+.2f})", flush=True)
        del w_o, w_qkv
        layers.stacks.clear()
        torch.cuda.empty_cache()
    write("qkv_fold", rows)


if __name__ == "__main__":
    main()
