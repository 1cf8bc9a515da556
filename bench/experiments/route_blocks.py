"""What the router's one-row fold adds at narrow widths, by block: 2 outputs x the whole K a program
(kernels.gemv_norm's row_block) against fewer outputs or shorter tiles, so that more of the SMs take part.

At Qwen3-30B-A3B's router (E 128, D 2048) the fold runs 64 programs on a 132-SM H200, at DeepSeek-V2-Lite's (E 64) 32:
most SMs idle while its exact norm and product run, then the last program routes (kernels.arrivals). Run 81 found
the q/k/v fold faster at more, shorter programs. Each figure is the chain a layer (the o projection's GEMV, the
router's fold with its exact norm, residual and top-k as the step runs it), 48 layers with a distinct o and router
weight each in one CUDA graph, the median of 9 replays, minus the o GEMV alone: what the fold adds.

    python3 bench/experiments/route_blocks.py          # JSON to $OUT/route_blocks.json, a table on stdout

Run 86 (7e1a219): row_block's 2 x the whole K was best or level everywhere (Qwen3 5.04 µs against 5.02 at 1 x the
whole K, V2-Lite 3.85 against 3.91, v4-shape 5.35 against 5.43); tiles of 1024 or 512 lost 0.8-6.4 µs. Kept.
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
from kernels.gemv_fused import Norm, Route, gemv_fused  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (2048, 4096, 128, 8), "deepseek-v2-lite": (2048, 2048, 64, 6),
          "v4-shape": (4096, 4096, 256, 6)}  # (D, o's input width, E, k)
BLOCKS = ((2, 2048), (1, 2048), (1, 1024), (2, 1024), (1, 512), (2, 4096), (1, 4096))


def main() -> None:
    torch.manual_seed(0)
    rows: list[dict] = []
    for shape, (hidden, o_in, experts, top_k) in SHAPES.items():
        layers = Layers((hidden, o_in), (experts, hidden))
        g = (1 + draw(hidden, scale=0.1)).contiguous()
        x, attended = draw(1, hidden, scale=1.0), draw(1, o_in, scale=1.0)
        time = timer(rows, shape, layers, width=28)

        def fold(block):
            def chain():
                wo, wr = layers.next()
                o = gemv(attended, wo)
                if block is not None:
                    gemv_fused(x, wr, norm=Norm(g, 1e-6, residual=o, write_x=True, write_h=True, exact=True),
                               route=Route(top_k, torch.bfloat16), block=block)
            return chain

        w_o, w_router = layers.first()
        o = gemv(attended, w_o)
        reference = gemv_fused(x, w_router, norm=Norm(g, 1e-6, residual=o, write_x=True, write_h=True, exact=True),
                               route=Route(top_k, torch.bfloat16))
        for block in BLOCKS:  # the exact norm: the same h to the bit, the same experts (the logits' sums differ)
            if block[1] > 1 << (hidden - 1).bit_length():
                continue
            got = gemv_fused(x, w_router, norm=Norm(g, 1e-6, residual=o, write_x=True, write_h=True, exact=True),
                             route=Route(top_k, torch.bfloat16), block=block)
            assert torch.equal(got.h, reference.h) and torch.equal(got.x, reference.x), f"{shape} {block}"
            assert set(got.ids.tolist()[0]) == set(reference.ids.tolist()[0]), f"{shape} {block}: other experts"
        base = time("o", fold(None))
        for block in BLOCKS:
            if block[1] > 1 << (hidden - 1).bit_length():
                continue
            took = time(f"o + route {block[0]} x {block[1]}", fold(block)) - base
            print(f"{shape}: the fold at {block[0]} x {block[1]} ({-(-experts // block[0])} programs) adds "
                  f"{took:.2f} µs", flush=True)
        del w_o, w_router
        layers.stacks.clear()
        torch.cuda.empty_cache()
    write("route_blocks", rows)


if __name__ == "__main__":
    main()
