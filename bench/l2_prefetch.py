"""What an L2 prefetch beside decode attention buys the GEMV after it (kernels/prefetch.py), H200.

The v4 decode step reads wo (4096 x 4096 bf16, 33.5 MB) right after decode attention, which at a
short cache is latency-bound (~8 us) and leaves the HBM idle. Here, per iteration of one CUDA graph
(20 iterations, median of 5 replays, per iteration):

    flush    zero a 128 MB buffer (> 2x the L2): what the previous step's MoE stream does to the L2
    attn     flash_decode at the v4 shape (Hq 8 over Hkv 1, hd 512, 640 keys, composite mask, sinks)
    gemv     kernels.gemv(x [1, 4096], w)            w = wo, and the packed qkv (5120 x 4096) as a second case

rows:  flush+attn (the baseline to subtract), flush+attn+gemv, flush+[attn | prefetch(w)]+gemv with the
prefetch on a second stream forked before attention and joined before the GEMV; the GEMV's share is
the row minus the baseline, printed beside w's bytes over the copy bandwidth measured in the same run.

Run: python3 bench/l2_prefetch.py  (CUDA only; prints a table, writes $OUT/l2_prefetch.json if $OUT is set)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from engine.bench import copy_bandwidth, graph_call_us  # noqa: E402
from kernels.attention_decode import flash_decode  # noqa: E402
from kernels.gemv import gemv  # noqa: E402
from kernels.prefetch import prefetch_l2  # noqa: E402
from kernels.reference import MaskSpec  # noqa: E402

ITERATIONS = 20


def main() -> int:
    if not torch.cuda.is_available():
        print("l2_prefetch: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)

    def draw(*shape):
        return torch.randn(*shape, generator=generator, device=device).to(torch.bfloat16)

    hidden, heads, head_dim, keys = 4096, 8, 512, 640
    q = draw(1, 1, heads, head_dim)
    k, v = draw(1, keys, 1, head_dim), draw(1, keys, 1, head_dim)
    sinks = torch.randn(heads, generator=generator, device=device)
    q_start = torch.tensor([keys - 1], device=device)
    spec = MaskSpec("composite", window=1024, block=64)
    attention_out = torch.empty_like(q)
    x = draw(1, hidden)
    flush = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    side = torch.cuda.Stream()
    bandwidth = copy_bandwidth(device)["bytes_per_s"]

    def attention():
        flash_decode(q, k, v, sinks, spec, q_start, None, out=attention_out)

    results = []
    for name, rows in (("wo", hidden), ("qkv", hidden + 2 * head_dim)):
        w = draw(rows, hidden)
        expected = x.float() @ w.float().t()
        assert torch.allclose(gemv(x, w).float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())

        def baseline():
            flush.zero_()
            attention()

        def plain():
            baseline()
            gemv(x, w)

        def prefetched():
            flush.zero_()
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                prefetch_l2(w)
            attention()
            main.wait_stream(side)
            gemv(x, w)

        base = graph_call_us(baseline, ITERATIONS)
        without = graph_call_us(plain, ITERATIONS)
        with_prefetch = graph_call_us(prefetched, ITERATIONS)
        weight_bytes = w.numel() * w.element_size()
        bound_us = weight_bytes / bandwidth * 1e6
        results.append({
            "weight": name, "bytes": weight_bytes, "bound_us": bound_us, "flush_attention_us": base,
            "gemv_after_attention_us": without - base, "gemv_after_attention_with_prefetch_us": with_prefetch - base,
            "step_without_us": without, "step_with_us": with_prefetch,
        })
    print(f"L2 prefetch beside decode attention; copy bandwidth {bandwidth / 1e12:.2f} TB/s; "
          f"{ITERATIONS} iterations per graph, per iteration")
    print("| weight | MB | bytes/bandwidth us | flush+attn us | gemv, plain | gemv, prefetched | saved us |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['weight']} | {r['bytes'] / 1e6:.1f} | {r['bound_us']:.1f} | {r['flush_attention_us']:.1f} | "
              f"{r['gemv_after_attention_us']:.1f} | {r['gemv_after_attention_with_prefetch_us']:.1f} | "
              f"{r['step_without_us'] - r['step_with_us']:.1f} |")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "l2_prefetch.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
