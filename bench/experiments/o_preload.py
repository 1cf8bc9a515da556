"""What the o projection's one-row GEMV adds after decode attention, by block: its first weight tile preloaded
before the PDL wait (kernels.gemv's 2 x 2048 at K = 4096: half the weight) or the whole K in one tile (all of it).

Attention at one token moves almost nothing (rope_cache, the split kernel and the combine: about 6 µs of
latency-bound work a Qwen3-30B-A3B layer), so the o GEMV that follows can stream its weight while they run; with
PDL its programs become resident under the combine kernel and load their first tile before they wait. At K = 4096
kernels.gemv's one-row block takes half the weight in that tile. Each figure is the chain a layer (rope_cache,
flash_decode at its default splits over 128 keys, the o GEMV at the block, the router's fold), 48 layers with a
distinct o weight each in one CUDA graph, the median of 9 replays, minus the same chain without the o GEMV (the
router's fold then reads a stand-in o output): what the o GEMV adds, the profile's "adds µs".

    python3 bench/experiments/o_preload.py          # JSON to $OUT/o_preload.json, a table on stdout

Run 85 (930d2db): the whole K lost. Qwen3-30B-A3B: o adds 5.52 µs at 2 x 2048 against 5.97 at 2 x 4096, 5.99 at
4 x 4096, 6.73 at 1 x 4096, 9.45 at 4 x 1024; v4-shape 9.40 against 9.68 / 9.39 / 9.85 / 11.64. The step agreed:
Qwen3 tg128 @ b1 398.3 t/s with the whole K (twice) against 402.8 with 2 x 2048, v4-shape 8802.7 / 8790.5 against
8799.4. kernels.gemv keeps its block.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench" / "experiments"))

import torch  # noqa: E402

from chains import Layers, draw, timer, write  # noqa: E402
from kernels.attention_decode import flash_decode  # noqa: E402
from kernels.gemv import gemv  # noqa: E402
from kernels.gemv_fused import Norm, Route, gemv_fused  # noqa: E402
from kernels.reference import MaskSpec  # noqa: E402
from kernels.rope_cache import rope_cache  # noqa: E402

# (D, Hq, Hkv, head dim, E, k): the o GEMV is [D, Hq * head dim]
SHAPES = {"qwen3-30b-a3b": (2048, 32, 4, 128, 128, 8), "v4-shape": (4096, 8, 1, 512, 256, 6)}
BLOCKS = ((2, 2048), (2, 4096), (1, 4096), (4, 1024), (4, 2048), (4, 4096))
KEYS, CAPACITY = 128, 256


def main() -> None:
    torch.manual_seed(0)
    device = torch.device("cuda")
    rows: list[dict] = []
    for shape, (hidden, heads, kv_heads, head_dim, experts, top_k) in SHAPES.items():
        width = heads * head_dim
        layers = Layers((hidden, width))
        w_router, g = draw(experts, hidden), (1 + draw(hidden, scale=0.1)).contiguous()
        x = draw(1, hidden, scale=1.0)
        qkv = draw(1, (heads + 2 * kv_heads) * head_dim, scale=1.0)
        k_cache = draw(1, CAPACITY, kv_heads, head_dim, scale=1.0)
        v_cache = draw(1, CAPACITY, kv_heads, head_dim, scale=1.0)
        start = torch.tensor([KEYS - 1], device=device)
        inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
        stand_in = draw(1, hidden, scale=1.0)
        time = timer(rows, shape, layers, width=34)

        def chain(block):
            def layer():
                q, positions = rope_cache(qkv, inv_freq, start, None, k_cache, v_cache, heads)
                attended = flash_decode(q.view(1, 1, heads, head_dim), k_cache, v_cache, None, MaskSpec("causal"),
                                        positions)
                o = gemv(attended.reshape(1, width), layers.next()[0], block=block) if block else stand_in
                gemv_fused(x, w_router, norm=Norm(g, 1e-6, residual=o, write_x=True, write_h=True, exact=True),
                           route=Route(top_k, torch.bfloat16))
            return layer

        w_o = layers.first()[0]
        expected = gemv(qkv[:, :width].contiguous(), w_o).float()
        for block in BLOCKS:  # every block computes the product (its fp32 sums in its own order)
            got = gemv(qkv[:, :width].contiguous(), w_o, block=block).float()
            error = ((got - expected).abs().max() / expected.abs().max()).item()
            assert error < 1e-2, f"{shape} {block}: {error:.3g} off the default block"
        base = time("attention + route", chain(None))
        for block in BLOCKS:
            took = time(f"attention + o {block[0]} x {block[1]} + route", chain(block)) - base
            print(f"{shape}: o at {block[0]} x {block[1]} adds {took:.2f} µs", flush=True)
        del w_o
        layers.stacks.clear()
        torch.cuda.empty_cache()
    write("o_preload", rows, keys=KEYS)


if __name__ == "__main__":
    main()
