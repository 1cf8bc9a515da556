"""The decode step's dense products on an H200: kernels.gemv against cuBLAS and the bandwidth bound.

Shapes are v4-shape's (D = 4096): the packed q/k/v projection [5120, 4096], the output projection
[4096, 4096], the router and the LM head [256, 4096] (fp32 logits, as the model computes them).
For M = 1, 2, 8, 32 rows, each product is checked against torch in fp32, then timed replayed from a
CUDA graph of 20 calls (how the engine runs decode): kernels.gemv with its default blocks and a
few others, and the peer torch computes in the unfused model (x @ w.t(), or x.float() @
w.float().t() for logits). The bound is the weight bytes over the device-to-device copy bandwidth
measured in this run (engine.bench.copy_bandwidth, as `moe-inspector bench` measures it). Prints
a table; JSON to $OUT/gemv_bench.json. Exit 1 when a check fails, 2 when a timing is not a
measurement.

    python3 bench/gemv_bench.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from engine.bench import copy_bandwidth, graph_call_us  # noqa: E402
from engine.errors import MeasurementError  # noqa: E402
from engine.provenance import commit_label  # noqa: E402
from kernels.gemv import block_sizes, gemv  # noqa: E402

SHAPES = [("qkv", 5120, 4096, None), ("wo", 4096, 4096, None), ("router", 256, 4096, torch.float32),
          ("lm_head", 256, 4096, torch.float32)]
BLOCKS = [None, (8, 512), (4, 1024), (2, 2048), (16, 256), (8, 1024), (1, 4096)]
WIDE_BLOCKS = [None, (16, 256), (16, 512), (32, 256)]  # >= 9 rows: tensor-core tiles, blocks >= 16
CALLS = 20


def main() -> int:
    bandwidth = copy_bandwidth(torch.device("cuda"))["bytes_per_s"]  # as `moe-inspector bench` measures it
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; commit {commit_label()}; {torch.cuda.get_device_name()}")
    rows_out, failed = [], False
    generator = torch.Generator(device="cuda").manual_seed(0)
    for name, n_out, k_in, out_dtype in SHAPES:
        # Rotate through several weight copies so the 50 MB L2 does not serve a repeated read.
        copies = max(2, (200 << 20) // (n_out * k_in * 2))
        weights = [(torch.randn(n_out, k_in, generator=generator, device="cuda") / 64).bfloat16()
                   for _ in range(copies)]
        bound_us = n_out * k_in * 2 / bandwidth * 1e6
        for rows in (1, 2, 8, 32):
            x = torch.randn(rows, k_in, generator=generator, device="cuda").bfloat16()
            expected = x.float() @ weights[0].float().t()
            turn = iter(range(10**9))

            def peer():
                w = weights[next(turn) % copies]
                return x.float() @ w.float().t() if out_dtype == torch.float32 else x @ w.t()

            entries = [("torch", peer, None)]
            for block in (BLOCKS if rows < 9 else WIDE_BLOCKS):
                def ours(block=block):
                    return gemv(x, weights[next(turn) % copies], out_dtype, block=block)
                label = f"gemv {block_sizes(n_out, k_in, 2, x.device, rows) if block is None else block}"
                entries.append((label + (" (default)" if block is None else ""), ours, block))
            for label, fn, block in entries:
                out = (x.float() @ weights[0].float().t() if label == "torch" else
                       gemv(x, weights[0], out_dtype, block=block))
                error = ((out.float() - expected).abs().max() / expected.abs().max()).item()
                ok = error < 2e-2
                failed |= not ok
                us = graph_call_us(fn, CALLS, warmup=3)
                rows_out.append({"product": name, "n": n_out, "k": k_in, "rows": rows, "kernel": label,
                                 "us": round(us, 2), "bound_us": round(bound_us, 2),
                                 "ratio_to_bound": round(us / bound_us, 3), "max_rel_error": error, "ok": ok})
    print("| product | rows | kernel | us | x bound | rel err |\n|---|---:|---|---:|---:|---:|")
    for row in rows_out:
        print(f"| {row['product']} {row['n']}x{row['k']} | {row['rows']} | {row['kernel']} | {row['us']:.2f} | "
              f"{row['ratio_to_bound']:.2f} | {row['max_rel_error']:.1e}{'' if row['ok'] else ' FAILED'} |")
    out_dir = Path(os.environ.get("OUT", REPO / "bench" / "results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gemv_bench.json").write_text(json.dumps(
        {"commit": commit_label(), "device": torch.cuda.get_device_name(), "copy_bandwidth": bandwidth,
         "rows": rows_out}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except MeasurementError as error:
        print(f"invalid measurement: {error}", file=sys.stderr)
        sys.exit(2)
