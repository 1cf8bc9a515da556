"""Each fold of the decode step against the launches it replaces, at the v4 widths on a GPU.

engine.decode_fused folds the glue of a one-row decode step into its GEMVs (kernels.gemv_fused). The
step's profile names one kernel for all three folded sites, so it cannot say which fold pays. Here
each site is timed both ways, one row, bf16 weights, D = 4096, each call reading a different weight
copy (> 200 MB in all, so the L2 does not serve a repeat):

    qkv      gather + RMSNorm, [5120, 4096] product, RoPE + cache write
             unfolded: rms_norm (gather), gemv, rope_cache            folded: gemv_fused(gather, rope)
    router   residual + RMSNorm, [256, 4096] fp32 logits, top-6 softmax + woken count
             unfolded: rms_norm (residual), gemv fp32, topk_softmax   folded: exact norm / one-pass norm
    lm_head  residual + RMSNorm, [256, 4096] fp32 logits
             unfolded: rms_norm (residual), gemv fp32                  folded: exact norm / one-pass norm

Per call: steady (engine.bench.graph_call_us: 20 calls in one CUDA graph, how a step graph runs them)
and single (one call per graph replay, queued behind a spin kernel so the host's launch is not in it;
the same weight copy each time, so an L2-sized weight is read warm there).
Bound: the weight bytes over the copy bandwidth measured in this run. Prints a table; JSON to
$OUT/gemv_fused_bench.json. Every variant is checked against the unfolded result before it is timed.

    python3 bench/gemv_fused_bench.py
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from engine.bench import copy_bandwidth, graph_call_us  # noqa: E402
from engine.provenance import commit_label  # noqa: E402
from kernels.gemv import gemv  # noqa: E402
from kernels.gemv_fused import Norm, Rope, Route, gemv_fused  # noqa: E402
from kernels.rms_norm import rms_norm  # noqa: E402
from kernels.rope_cache import rope_cache  # noqa: E402
from kernels.router import topk_softmax  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, TOP_K, VOCAB = 4096, 8, 1, 512, 256, 6, 256
CALLS = 20
EPS = 1e-6


def single_us(fn, repetitions: int = 30) -> float:
    """One call per graph replay, behind a spin kernel (its device time, launch ramp included)."""
    graph = torch.cuda.CUDAGraph()
    fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        fn()
    samples = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(repetitions):
        torch.cuda._sleep(1_000_000)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples)


def main() -> int:
    if not torch.cuda.is_available():
        print("gemv_fused_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)["bytes_per_s"]
    generator = torch.Generator(device=device).manual_seed(0)

    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator, device=device) * scale).bfloat16()

    g = 1 + draw(HIDDEN, scale=0.1)
    x_prev, residual = draw(1, HIDDEN), draw(1, HIDDEN)
    table = draw(VOCAB, HIDDEN)
    index = torch.tensor([17], device=device)
    position = torch.tensor([300], device=device)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, device=device).float() / HEAD_DIM))
    k_cache = torch.zeros(1, 1024, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    v_cache = torch.zeros_like(k_cache)
    qkv_rows = (HEADS + 2 * KV_HEADS) * HEAD_DIM

    sites = {  # name -> (weight rows, {variant: fn(w)}, compare(outputs))
        "qkv": (qkv_rows, {
            "unfolded (rms_norm, gemv, rope_cache)": lambda w: rope_cache(
                gemv(rms_norm(None, g, EPS, table=table, index=index)[1], w), inv_freq, position, None,
                k_cache, v_cache, HEADS)[0],
            "folded (gather, rope)": lambda w: gemv_fused(
                None, w, norm=Norm(g, EPS, table=table, index=index, write_x=True),
                rope=Rope(inv_freq, position, None, k_cache, v_cache, HEADS)).q,
        }),
        "router": (EXPERTS, {
            "unfolded (rms_norm, gemv fp32, topk_softmax)": lambda w: topk_softmax(
                gemv(rms_norm(x_prev, g, EPS, residual=residual)[1], w, torch.float32), TOP_K, torch.bfloat16,
                woken=True)[1],
            "folded, exact norm": lambda w: gemv_fused(
                x_prev, w, norm=Norm(g, EPS, residual=residual, write_x=True, write_h=True, exact=True),
                route=Route(TOP_K, torch.bfloat16)).weights,
            "folded, one-pass norm": lambda w: gemv_fused(
                x_prev, w, norm=Norm(g, EPS, residual=residual, write_x=True, write_h=True),
                route=Route(TOP_K, torch.bfloat16)).weights,
        }),
        "lm_head": (VOCAB, {
            "unfolded (rms_norm, gemv fp32)": lambda w: gemv(
                rms_norm(x_prev, g, EPS, residual=residual)[1], w, torch.float32),
            "folded, exact norm": lambda w: gemv_fused(
                x_prev, w, torch.float32, norm=Norm(g, EPS, residual=residual, exact=True)).out,
            "folded, one-pass norm": lambda w: gemv_fused(
                x_prev, w, torch.float32, norm=Norm(g, EPS, residual=residual)).out,
        }),
    }
    results, failed = [], False
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; commit {commit_label()}; {torch.cuda.get_device_name()}")
    print("| site | variant | weight MB | bound us | steady us | x bound | single us | check |")
    print("|---|---|---|---|---|---|---|---|")
    for site, (rows, variants) in sites.items():
        copies = max(2, (200 << 20) // (rows * HIDDEN * 2))
        weights = [draw(rows, HIDDEN, scale=1 / 64) for _ in range(copies)]
        bound_us = rows * HIDDEN * 2 / bandwidth * 1e6
        expected = None
        for variant, fn in variants.items():
            out = fn(weights[0]).float()
            torch.cuda.synchronize()
            if expected is None:
                expected = out
            error = ((out - expected).norm() / expected.norm()).item()
            ok = error <= 2e-2
            failed |= not ok
            turn = iter(range(10**9))

            def call(fn=fn):
                return fn(weights[next(turn) % copies])

            steady = graph_call_us(call, CALLS) if ok else float("nan")
            single = single_us(lambda fn=fn: fn(weights[0])) if ok else float("nan")
            results.append({"site": site, "variant": variant, "bytes": rows * HIDDEN * 2, "bound_us": bound_us,
                            "steady_us": steady, "single_us": single, "rel_error": error})
            print(f"| {site} | {variant} | {rows * HIDDEN * 2 / 1e6:.1f} | {bound_us:.1f} | {steady:.1f} | "
                  f"{steady / bound_us:.2f} | {single:.1f} | {'ok' if ok else 'WRONG'} {error:.1e} |")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gemv_fused_bench.json").write_text(json.dumps(results, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
