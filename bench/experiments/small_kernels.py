"""What the latency-bound kernels of a Qwen3-30B-A3B decode layer add, and what their candidates would add, on a GPU.

Run 69 timed a ranked top-k here (every expert's rank from one [E, E] comparison, one reduction): the fold added
6.63 µs with it against 4.71 with the picks, so it was dropped; the picks since run with a copy of the row per
warp (kernels.parts.topk_softmax_row).

At one token a Qwen3 step spends about 720 µs of 2567 in kernels that move almost nothing (run 67: the router's
fold 290, attention's split 138 and combine 69, rms_norm 128, rope_cache 92). Each figure here is the difference of
two chains captured 48 times in one CUDA graph (one chain a layer, PDL on as the step runs it): the chain with the
kernel against the chain without it, so a figure is what the kernel adds between its neighbours, the profile's
"adds µs". The chains, at D 2048, Hq 32 over Hkv 4, head dim 128, E 128, top-8:

    o                  the o projection's GEMV ([2048, 4096]) alone: the base of the router rows
    o + route          + the router's fold as the step runs it (norm with the residual, fp32 logits, top-8)
    o + route top1     + the same fold routing one expert (the top-k's picks: 8 against 1)
    o + norm fold      + the fold without routing (kernels.gemv_norm with the same norm): the tail's whole cost
    o + rms_norm at W warps   + kernels.rms_norm with the residual at W warps (NORM_WARPS)
    qkv + o            the q/k/v GEMV then o's: the base of the attention rows
    qkv + rope + attn + o, S splits   + rope_cache and flash_decode at S splits (SPLIT_CANDIDATES: the default's, and
                       fewer, longer splits) at key lengths 256 and 1024 (the graph reads the cache's capacity; the
                       positions sit at half of it)
    qkv + attn + o, S splits   the same without rope_cache (q read unrotated): what rope_cache adds
    qkv + rope + attn + o, N keys x S stages   attention's key tiles and pipeline stages (CONFIG_CANDIDATES)

    python3 bench/experiments/small_kernels.py          # JSON to $OUT/small_kernels.json, a table on stdout
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from engine.bench import graph_call_us  # noqa: E402
from engine.provenance import commit_label  # noqa: E402
from kernels import rms_norm as rms_norm_module  # noqa: E402
from kernels.attention_decode import DecodeConfig, default_num_splits, flash_decode  # noqa: E402
from kernels.gemv import gemv  # noqa: E402
from kernels.gemv_fused import Norm, Route, gemv_fused  # noqa: E402
from kernels.reference import MaskSpec  # noqa: E402
from kernels.rms_norm import rms_norm  # noqa: E402
from kernels.rope_cache import rope_cache  # noqa: E402

D, HQ, HKV, HD, E, TOP_K = 2048, 32, 4, 128, 128, 8
LAYERS = 48
# Split counts tried at each capacity (None: the default's; one split writes the output without a merge; run 69: the
# default's "kernel" merge added 3.99 µs at 256 keys against 5.07 for the "last" merge, 4.37 against 6.44 at 1024)
SPLIT_CANDIDATES = {256: (None, 1, 2), 1024: (None, 1, 2, 4, 8)}
# Key tiles x stages tried at head dim 128 (kernels.attention_decode.CONFIGS[128] is 64 x 3), each at its default splits
CONFIG_CANDIDATES = (DecodeConfig(64, 3), DecodeConfig(64, 2), DecodeConfig(32, 2), DecodeConfig(32, 3),
                     DecodeConfig(16, 2), DecodeConfig(128, 2))
NORM_WARPS = (1, 2, 4)  # kernels.rms_norm.num_warps gives 4 at D = 2048


def _draw(*shape, scale=0.02):
    return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16)


def main() -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    w_o, w_qkv, w_router = _draw(D, HQ * HD), _draw((HQ + 2 * HKV) * HD, D), _draw(E, D)
    g_moe = (1 + _draw(D, scale=0.1)).contiguous()
    q_norm, k_norm = (1 + _draw(HD, scale=0.1)), (1 + _draw(HD, scale=0.1))
    x, attended = _draw(1, D, scale=1.0), _draw(1, HQ * HD, scale=1.0)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, HD, 2, device=device, dtype=torch.float32) / HD))
    rows: list[dict] = []

    def time(name: str, layer) -> float:
        us = graph_call_us(layer, LAYERS, warmup=3, replays=9)
        rows.append({"chain": name, "us_per_layer": us})
        print(f"{name:44s} {us:8.2f} µs a layer", flush=True)
        return us

    def route(top_k: int = TOP_K):
        def layer():
            o = gemv(attended, w_o)
            gemv_fused(x, w_router, norm=Norm(g_moe, 1e-6, residual=o, write_x=True, write_h=True, exact=True),
                       route=Route(top_k, torch.bfloat16))
        return layer

    def norm_fold():
        o = gemv(attended, w_o)
        gemv_fused(x, w_router, torch.float32, norm=Norm(g_moe, 1e-6, residual=o, write_x=True, write_h=True,
                                                          exact=True))

    base = time("o", lambda: gemv(attended, w_o))
    picks = time("o + route", route()) - base
    one = time("o + route top1", route(1)) - base
    fold = time("o + norm fold", norm_fold) - base
    print(f"the router's fold adds {picks:.2f} µs (top-1 {one:.2f}, no routing {fold:.2f})")

    default_warps = rms_norm_module.num_warps
    try:
        for warps in NORM_WARPS:
            rms_norm_module.num_warps = lambda hidden, warps=warps: warps
            norm = time(f"o + rms_norm at {warps} warps",
                        lambda: rms_norm(x, g_moe, 1e-6, residual=gemv(attended, w_o)))
            print(f"rms_norm at {warps} warps adds {norm - base:.2f} µs", flush=True)
    finally:
        rms_norm_module.num_warps = default_warps

    for capacity in (256, 1024):
        k_cache = _draw(1, capacity, HKV, HD, scale=1.0)
        v_cache = _draw(1, capacity, HKV, HD, scale=1.0)
        start = torch.tensor([capacity // 2], device=device)
        start32 = start.to(torch.int32)
        q_plain = _draw(1, 1, HQ, HD, scale=1.0)
        spec = MaskSpec("causal")
        splits = default_num_splits(q_plain, k_cache, spec)
        base_attn = time(f"qkv + o @{capacity}", lambda: (gemv(x, w_qkv), gemv(attended, w_o)))
        for config in CONFIG_CANDIDATES:
            def configured(config=config):
                qkv = gemv(x, w_qkv)
                q, positions = rope_cache(qkv, inv_freq, start, None, k_cache, v_cache, HQ, (q_norm, k_norm, 1e-6))
                a = flash_decode(q.view(1, 1, HQ, HD), k_cache, v_cache, None, spec, positions, config=config)
                gemv(a.reshape(1, HQ * HD), w_o)

            splits_at = default_num_splits(q_plain, k_cache, spec, config)
            took = time(f"qkv + rope + attn + o @{capacity}, {config.block_n} keys x {config.num_stages} stages "
                        f"({splits_at} splits)", configured) - base_attn
            print(f"@{capacity}, tiles of {config.block_n} keys at {config.num_stages} stages: rope + attention add "
                  f"{took:.2f} µs", flush=True)
        for count in SPLIT_CANDIDATES[capacity]:
            def full(count=count):
                qkv = gemv(x, w_qkv)
                q, positions = rope_cache(qkv, inv_freq, start, None, k_cache, v_cache, HQ, (q_norm, k_norm, 1e-6))
                a = flash_decode(q.view(1, 1, HQ, HD), k_cache, v_cache, None, spec, positions, num_splits=count)
                gemv(a.reshape(1, HQ * HD), w_o)

            def no_rope(count=count):
                gemv(x, w_qkv)
                a = flash_decode(q_plain, k_cache, v_cache, None, spec, start32, num_splits=count)
                gemv(a.reshape(1, HQ * HD), w_o)

            label = f"{count or splits} splits{' (default)' if count is None else ''}"
            with_rope = time(f"qkv + rope + attn + o @{capacity}, {label}", full) - base_attn
            without = time(f"qkv + attn + o @{capacity}, {label}", no_rope) - base_attn
            print(f"@{capacity}, {label}: attention adds {without:.2f} µs, rope_cache {with_rope - without:.2f}",
                  flush=True)
    out = Path(os.environ.get("OUT", "bench/results/latest"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "small_kernels.json").write_text(json.dumps({
        "commit": commit_label(), "device": torch.cuda.get_device_name(), "layers": LAYERS, "rows": rows,
    }, indent=1))


if __name__ == "__main__":
    main()
