"""What the latency-bound kernels of a Qwen3-30B-A3B decode layer add, and what their candidates would add, on a GPU.

At one token a Qwen3 step spends about 720 µs of 2567 in kernels that move almost nothing (run 67: the router's
fold 290, attention's split 138 and combine 69, rms_norm 128, rope_cache 92). Each figure here is the difference of
two chains captured 48 times in one CUDA graph (one chain a layer, PDL on as the step runs it): the chain with the
kernel against the chain without it, so a figure is what the kernel adds between its neighbours, the profile's
"adds µs". The chains, at D 2048, Hq 32 over Hkv 4, head dim 128, E 128, top-8:

    o                  the o projection's GEMV ([2048, 4096]) alone: the base of the router rows
    o + route          + the router's fold as the step runs it (norm with the residual, fp32 logits, top-8)
    o + route top1     + the same fold routing one expert (the top-k's picks: 8 against 1)
    o + route ranked   + the fold with `ranked_topk_row` (every expert's rank in one reduction) in place of the picks
    o + norm fold      + the fold without routing (kernels.gemv_norm with the same norm): the tail's whole cost
    qkv + o            the q/k/v GEMV then o's: the base of the attention rows
    qkv + rope + attn(C) + o   + rope_cache and flash_decode with combine C ("kernel": split + combine launches;
                       "last": the last split merges) at key lengths 256 and 1024 (the graph reads the cache's
                       capacity; the positions sit at half of it)
    qkv + attn(C) + o  the same without rope_cache (q read unrotated): what rope_cache adds

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
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from engine.bench import graph_call_us  # noqa: E402
from engine.provenance import commit_label  # noqa: E402
from kernels.attention_decode import default_num_splits, flash_decode  # noqa: E402
from kernels.gemv import gemv  # noqa: E402
from kernels.gemv_fused import Norm, Route, gemv_fused  # noqa: E402
from kernels.reference import MaskSpec  # noqa: E402
from kernels.rope_cache import rope_cache  # noqa: E402

D, HQ, HKV, HD, E, TOP_K = 2048, 32, 4, 128, 128, 8
LAYERS = 48


@triton.jit
def ranked_topk_row(values, offs, experts, ids_row_ptr, weights_row_ptr,
                    E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, OVER_ALL: tl.constexpr, scale):
    """kernels.parts.topk_softmax_row's contract with every expert's rank from one [E_PAD, E_PAD] comparison:
    rank_i = how many experts beat i (a larger value, or an equal one at a lower id); the k of rank < k are
    stored at their rank."""
    values = tl.where(values == values, values, float("-inf")) + 0.0  # NaN never chosen; -0.0 as 0.0
    valid = offs < experts
    v_i, v_j = values[:, None], values[None, :]
    beats = ((v_j > v_i) | ((v_j == v_i) & (offs[None, :] < offs[:, None]))) & valid[None, :]
    rank = tl.sum(beats.to(tl.int32), axis=1)  # [E_PAD]
    chosen = valid & (rank < TOP_K)
    top = tl.max(tl.where(valid, values, float("-inf")), axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    exponent = tl.where(chosen, tl.exp(values - top), 0.0)
    if OVER_ALL:
        weights = exponent / tl.sum(tl.where(valid, tl.exp(values - top), 0.0), axis=0)
    else:
        weights = exponent / tl.sum(exponent, axis=0)
    weights = weights * scale
    tl.store(ids_row_ptr + rank, offs.to(tl.int32), mask=chosen)
    tl.store(weights_row_ptr + rank, weights.to(weights_row_ptr.dtype.element_ty), mask=chosen)


def _ranked_route_module():
    """kernels/gemv_route.py loaded as a module of its own whose kernel routes with ranked_topk_row (set before
    its first compile, so its JIT hash and cache are its own)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gemv_route_ranked", REPO / "kernels" / "gemv_route.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    module.topk_softmax_row = ranked_topk_row
    return module


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

    # the ranked top-k against the picks, on the same logits, before anything is timed
    logits = torch.randn(3, E, device=device)
    logits[1, 5] = logits[1, 9] = logits[1].max() + 1  # a tie: the lower id first
    reference = torch.sort(logits, dim=-1, descending=True, stable=True)  # ties: the lower id first

    base = time("o", lambda: gemv(attended, w_o))
    picks = time("o + route", route()) - base
    one = time("o + route top1", route(1)) - base
    fold = time("o + norm fold", norm_fold) - base
    ranked_module = _ranked_route_module()
    for row in range(3):  # the ranked top-k against torch.topk on the same logits, before it is timed
        got = ranked_module.gemv_route(logits[row:row + 1].contiguous(), torch.eye(E, device=device),
                                       route=Route(TOP_K, torch.float32))
        want_ids = reference.indices[row, :TOP_K].to(torch.int32)
        if not torch.equal(got.ids[0], want_ids):
            raise SystemExit(f"ranked top-k row {row}: ids {got.ids[0].tolist()} != {want_ids.tolist()}")

    def route_ranked():
        o = gemv(attended, w_o)
        ranked_module.gemv_route(x, w_router, route=Route(TOP_K, torch.bfloat16),
                                 norm=Norm(g_moe, 1e-6, residual=o, write_x=True, write_h=True, exact=True))

    ranked = time("o + route ranked", route_ranked) - base
    print(f"the router's fold adds {picks:.2f} µs (top-1 {one:.2f}, ranked {ranked:.2f}, no routing {fold:.2f})")

    for capacity in (256, 1024):
        k_cache = _draw(1, capacity, HKV, HD, scale=1.0)
        v_cache = _draw(1, capacity, HKV, HD, scale=1.0)
        start = torch.tensor([capacity // 2], device=device)
        start32 = start.to(torch.int32)
        q_plain = _draw(1, 1, HQ, HD, scale=1.0)
        spec = MaskSpec("causal")
        splits = default_num_splits(q_plain, k_cache, spec)
        base_attn = time(f"qkv + o @{capacity}", lambda: (gemv(x, w_qkv), gemv(attended, w_o)))
        for combine in ("kernel", "last"):
            def full(combine=combine):
                qkv = gemv(x, w_qkv)
                q, positions = rope_cache(qkv, inv_freq, start, None, k_cache, v_cache, HQ, (q_norm, k_norm, 1e-6))
                a = flash_decode(q.view(1, 1, HQ, HD), k_cache, v_cache, None, spec, positions, combine=combine)
                gemv(a.reshape(1, HQ * HD), w_o)

            def no_rope(combine=combine):
                gemv(x, w_qkv)
                a = flash_decode(q_plain, k_cache, v_cache, None, spec, start32, combine=combine)
                gemv(a.reshape(1, HQ * HD), w_o)

            with_rope = time(f"qkv + rope + attn({combine}) + o @{capacity}", full) - base_attn
            without = time(f"qkv + attn({combine}) + o @{capacity}", no_rope) - base_attn
            print(f"@{capacity} ({splits} splits) combine={combine}: attention adds {without:.2f} µs, rope_cache "
                  f"{with_rope - without:.2f}", flush=True)
    out = Path(os.environ.get("OUT", "bench/results/latest"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "small_kernels.json").write_text(json.dumps({
        "commit": commit_label(), "device": torch.cuda.get_device_name(), "layers": LAYERS, "rows": rows,
    }, indent=1))


if __name__ == "__main__":
    main()
