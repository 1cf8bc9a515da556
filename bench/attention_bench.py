"""Benchmark the fused sinks attention kernels on an H200 against their peers, on the problem of docs/attention-kernels.md.

Prefill: head_dim 512, 8 query heads over 8 kv heads, 8192 tokens, composite mask W=1024, B=64,
sinks, bf16. Rows, all in this one run and each checked against the reference before it is
timed: the fused Triton kernel (its config table entry plus a small sweep), FlexAttention
compiled with hand-set blocks (64 x 32, 2 stages, 8 warps; its default does not compile at
head_dim 512) with the sink applied through its log-sum-exp, and SDPA with a dense boolean mask
(no sinks: SDPA has no sink, it is checked against the sink-less reference). TFLOP/s are counted
on visible work only: visible (i, j) pairs x 4 x head_dim per head.

Decode: one query per head at position 8191 against 8192 keys (causal: every key is read), split
KV, timed eagerly and replayed from a CUDA graph (how the engine runs decode); the bound is the KV
bytes read over the copy bandwidth measured in this run. The table's config runs both ways on the
same problem: the default single launch (the last split of each kv head merges, "1 launch": the
target row) and the split kernel plus the combine kernel ("2 launches", for comparison).

Decode at the engine's v4 shape ("v4" rows, informational): one sequence, 8 query heads over ONE
kv head, head_dim 512, bf16, sinks; composite W=1024 B=64 and causal; a 640-key cache with the
query at 639 and an 8192-key cache with the query at 8191; the default split count (printed in
the row) both ways, plus the 640-key composite problem at one 32-key tile per split (what the
one-wave rule chose before the split count became adaptive). Their KV (1.3 to 16.8 MB) fits in
the H200's L2, so besides the usual graph replay of one call ("median", L2-warm) each row reports
"cold": one graph of N calls over N copies of the KV (> 2x the L2 size in all), timed per call,
as a decode step meets a layer's KV after the rest of the step has streamed through L2.

Needs only torch, triton and numpy (the GPU machine has no textual). Prints the compiler's
resource report, writes JSON to $OUT/attention_bench.json (else bench/results/), and prints a
compact table last. Exit 0: every row correct; 1: a correctness check failed; 2: a measurement
was invalid (zero or non-finite time). Targets (prefill <= 1.0 ms, decode <= 1.3x bound) are
reported as met or missed, not turned into the exit code.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the imports below need it: E402 is intended

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from engine.provenance import commit_label  # noqa: E402
from kernels import launches  # noqa: E402
from kernels.attention import CONFIGS as PREFILL_CONFIGS  # noqa: E402
from kernels.attention import MASK_CONFIGS, PrefillConfig, flash_attention  # noqa: E402
from kernels.attention_common import format_resource_report, resource_report  # noqa: E402
from kernels.attention_decode import CONFIGS as DECODE_CONFIGS  # noqa: E402
from kernels.attention_decode import DecodeConfig, default_num_splits, flash_decode  # noqa: E402
from kernels.reference import MaskSpec, attention_reference, visible_mask  # noqa: E402

TOKENS, HEADS, KV_HEADS, HEAD_DIM, WINDOW, BLOCK = 8192, 8, 8, 512, 1024, 64
SPEC = MaskSpec("composite", window=WINDOW, block=BLOCK)
TOLERANCE = 1e-2  # bf16, as tests/test_attention_kernels.py
PREFILL_TARGET_MS = 1.0
DECODE_TARGET_RATIO = 1.3
# H200 SXM ceilings quoted beside the results: ~790 TFLOP/s dense bf16 achievable (989 on the
# datasheet), ~4.2 TB/s copy (4.8 TB/s HBM3e on the datasheet); the copy rate is re-measured here.
BF16_DENSE_TFLOPS = 790.0
STEADY_CALLS = 20  # calls per graph for the steady-state per-call time of the decode rows
BUDGET_S = 150.0  # stop sweeping past this, so the whole run stays under 3 minutes

PREFILL_SWEEP = [
    None,  # the config table's entry for head_dim 512 (see kernels/attention.py)
    PrefillConfig(block_m=64, block_n=32, block_dv=256, num_warps=8, num_stages=2),  # split output columns
    PrefillConfig(block_m=64, block_n=16, block_dv=512, num_warps=8, num_stages=3),  # deeper pipeline, 160 KB
]
DECODE_SWEEP = [  # (config, waves of programs: None = the launcher's one wave); all single-launch
    (None, None),  # table entry, one wave of programs (also timed with the two-launch combine)
    (DecodeConfig(block_n=32, num_stages=4), None),  # 3 tiles in flight: 16 + 3 x 64 = 208 KB
    (DecodeConfig(block_n=16, num_stages=3, programs_per_sm=2), None),  # 80 KB: two programs per SM, 33 splits
    (DecodeConfig(block_n=16, num_stages=5), None),  # 4 half-size tiles in flight: 144 KB
    (DecodeConfig(block_n=32, num_stages=2, programs_per_sm=2), None),  # 80 KB, two programs per SM
]

# The engine's v4 decode step (informational rows): Hq 8 over Hkv 1, the same head_dim and mask.
V4_HEADS, V4_KV_HEADS = 8, 1
V4_PROBLEMS = [  # (keys in the cache, mask); the query at the last position
    (160, SPEC),  # `bench --tg 128`'s cache: a 32-token prompt plus 128 generated
    (640, SPEC),
    (640, MaskSpec("causal")),
    (8192, SPEC),
    (8192, MaskSpec("causal")),
]

START = time.perf_counter()


def commit() -> str:
    return commit_label()


class InvalidMeasurement(Exception):
    pass


# A spin before each timed call (torch.cuda._sleep cycles, ~0.5 ms at the H200's ~1.9 GHz): longer than
# any host launch timed here, so the call is queued before its start event fires.
SPIN_CYCLES = 1_000_000


def time_cuda(fn, warmup: int = 5, repetitions: int = 30, warmup_s: float = 0.0) -> dict:
    """Median of per-call CUDA-event times (warm-up excluded) and the wall clock over the same
    number of back-to-back calls; both reported, a disagreement over 5 % flagged. Each call is timed
    behind a spin kernel (busy stream: the device time of the call alone), and also on an idle stream
    as runs up to 14 did (`idle_stream_median_ms`: the host's launch included: ~70 us of a Triton
    launch's Python in the prefill's 0.97 ms there, against 0.90 ms per call back to back). The warm-up is
    `warmup` calls and then, with `warmup_s`, calls until that much wall time has passed: a GPU
    just out of idle runs below its clocks for a while (run 13, a freshly started machine: the
    prefill's 30 calls spread 1.04 +- 0.07 ms against +- 0.01 in warm runs)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    warm_until = time.perf_counter() + warmup_s
    while time.perf_counter() < warm_until:
        fn()
        torch.cuda.synchronize()
    device_ms, idle_ms = [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(repetitions):
        # Busy stream (the figure): a spin kernel first, so the start event fires only once the host has
        # queued fn behind it; the interval is fn's time on the device, its launch ramp included.
        torch.cuda._sleep(SPIN_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        device_ms.append(start.elapsed_time(end))
        # Idle stream (runs <= 14's figure, kept beside it): the start event fires at once, so the
        # interval also holds the host's launch of fn (a Triton launch from Python, a graph launch).
        start.record()
        fn()
        end.record()
        end.synchronize()
        idle_ms.append(start.elapsed_time(end))
    torch.cuda.synchronize()
    wall_start = time.perf_counter()
    for _ in range(repetitions):
        fn()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - wall_start) * 1e3 / repetitions
    median = statistics.median(device_ms)
    if not (math.isfinite(median) and median > 0 and math.isfinite(wall_ms) and wall_ms > 0):
        raise InvalidMeasurement(f"non-positive or non-finite time: events {median} ms, wall {wall_ms} ms")
    return {
        "median_ms": median,
        "mean_ms": statistics.fmean(device_ms),
        "stdev_ms": statistics.stdev(device_ms),
        "wall_ms": wall_ms,
        "clocks_disagree": abs(wall_ms - median) > 0.05 * median,
        "idle_stream_median_ms": statistics.median(idle_ms),
    }


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def reference_in_chunks(q, k, v, sinks, spec, q_start=0, chunk=1024) -> torch.Tensor:
    """attention_reference over query chunks (its fp32 score matrix at 8192^2 x 8 heads is 2 GB
    per copy); float32 inputs, so the reference carries no bf16 rounding."""
    q32, k32, v32 = q.float(), k.float(), v.float()
    parts = [
        attention_reference(q32[:, c0 : c0 + chunk], k32, v32, sinks, spec, q_start + c0)
        for c0 in range(0, q.shape[1], chunk)
    ]
    return torch.cat(parts, dim=1)


def visible_pairs_per_head() -> int:
    """Exact count of visible (i, j): window keys min(i + 1, W) plus block starts j <= i - W."""
    i = np.arange(TOKENS, dtype=np.int64)
    window_keys = np.minimum(i + 1, WINDOW)
    summary_keys = np.where(i >= WINDOW, (i - WINDOW) // BLOCK + 1, 0)
    return int((window_keys + summary_keys).sum())


def computed_pairs_per_head(config: PrefillConfig) -> int:
    """Pairs the fused kernel's walk computes (tile-rounded band + gathered block starts), as
    kernels/attention_common._key_walk_bounds: the waste the tiling leaves."""
    total = 0
    for m0 in range(0, TOKENS, config.block_m):
        p_first, p_last = m0, min(m0 + config.block_m, TOKENS) - 1
        band = min(p_last + 1, TOKENS) - max(p_first - WINDOW + 1, 0)
        summaries = min((p_last - WINDOW) // BLOCK + 1, triton.cdiv(TOKENS, BLOCK)) if p_last >= WINDOW else 0
        total += config.block_m * triton.cdiv(band + summaries, config.block_n) * config.block_n
    return total


def row(name: str, timing: dict | None, error: float | None, flops: float | None, note: str, **extra) -> dict:
    result = {"name": name, "error": error, "note": note, **extra}
    if timing:
        result.update(timing)
        if flops:
            result["tflops_visible"] = flops / (timing["median_ms"] * 1e-3) / 1e12
    return result


def failure_note(error: Exception) -> str:
    """One table cell: the exception's type and the start of its message on one line."""
    return f"failed: {type(error).__name__}: {' '.join(str(error).split())}"[:200]


def checked(label: str, produce, reference: torch.Tensor, rows: list, failures: list) -> float | None:
    """Run `produce` once and compare it with the reference before anything is timed. A failure
    to compile or run becomes a row (an OutOfResources at head_dim 512 is a result, not a crash);
    a wrong answer becomes a row and a failure. Returns the relative error when it may be timed."""
    try:
        out = produce()
        torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 - any failure to compile or run is a row, not a crash
        rows.append(row(label, None, None, None, failure_note(error)))
        return None
    error = relative_error(out, reference)
    if not error <= TOLERANCE:
        failures.append(f"{label}: relative error {error:.3g} > {TOLERANCE}")
        rows.append(row(label, None, error, None, "WRONG: not timed"))
        return None
    return error


def bench_prefill(q, k, v, sinks, reference, visible_flops: float, rows: list, failures: list, configs) -> None:
    for config in configs:
        if config is not None and time.perf_counter() - START > BUDGET_S:
            rows.append(row(f"fused prefill {config}", None, None, None, "skipped: time budget"))
            continue
        label = "fused prefill " + ("(table)" if config is None else f"bm{config.block_m} bn{config.block_n} "
                                    f"dv{config.block_dv} w{config.num_warps} s{config.num_stages}")
        def run(config=config):
            return flash_attention(q, k, v, sinks, SPEC, 0, None, config=config)

        error = checked(label, run, reference, rows, failures)
        if error is None:
            continue
        timing = time_cuda(run, warmup_s=0.5 if config is None else 0.0)  # the target row: clocks up first
        used = config or MASK_CONFIGS.get((HEAD_DIM, SPEC.kind)) or PREFILL_CONFIGS[HEAD_DIM]
        rows.append(row(label, timing, error, visible_flops, "sinks, composite mask",
                        computed_over_visible=computed_pairs_per_head(used) / visible_pairs_per_head(),
                        target_ms=PREFILL_TARGET_MS, target_met=timing["median_ms"] <= PREFILL_TARGET_MS))


def bench_flex(q, k, v, sinks, reference, visible_flops: float, rows: list, failures: list) -> None:
    label = "flex_attention compiled (64x32, s2, w8), sinks via LSE"
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        try:
            from torch.nn.attention.flex_attention import AuxRequest

            def flex_lse(qf, kf, vf, block_mask, options):
                out, aux = flex_attention(qf, kf, vf, block_mask=block_mask, kernel_options=options,
                                          return_aux=AuxRequest(lse=True))
                return out, aux.lse
        except ImportError:
            def flex_lse(qf, kf, vf, block_mask, options):
                return flex_attention(qf, kf, vf, block_mask=block_mask, kernel_options=options, return_lse=True)

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & ((q_idx - kv_idx < WINDOW) | (kv_idx % BLOCK == 0))

        block_mask = create_block_mask(mask_mod, B=None, H=None, Q_LEN=TOKENS, KV_LEN=TOKENS, device="cuda")
        options = {"BLOCK_M": 64, "BLOCK_N": 32, "num_stages": 2, "num_warps": 8}

        def flex_with_sinks(qf, kf, vf, sink_logits):
            out, lse = flex_lse(qf, kf, vf, block_mask, options)  # lse: natural log, [B, H, T]
            # p_ij with a sink = p_ij without it * sum / (sum + e^sigma) = p_ij * sigmoid(lse - sigma)
            return out * torch.sigmoid(lse - sink_logits[None, :, None]).unsqueeze(-1).to(out.dtype)

        compiled = torch.compile(flex_with_sinks, dynamic=False)
    except Exception as error:  # noqa: BLE001 - a peer that cannot be built is a row, not a crash
        rows.append(row(label, None, None, None, failure_note(error)))
        return
    qf, kf, vf = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # [B, H, T, hd]
    error = checked(label, lambda: compiled(qf, kf, vf, sinks).transpose(1, 2), reference, rows, failures)
    if error is None:
        return
    timing = time_cuda(lambda: compiled(qf, kf, vf, sinks))
    rows.append(row(label, timing, error, visible_flops, "peer"))


def bench_sdpa(q, k, v, visible_flops: float, rows: list, failures: list) -> None:
    label = "SDPA dense bool mask (no sinks)"
    positions = torch.arange(TOKENS, device="cuda")
    dense_mask = visible_mask(SPEC, positions, positions)  # [T, T] bool, True = attend
    qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, hd] views
    error = checked(label, lambda: F.scaled_dot_product_attention(qs, ks, vs, attn_mask=dense_mask).transpose(1, 2),
                    reference_in_chunks(q, k, v, None, SPEC), rows, failures)
    if error is None:
        return
    timing = time_cuda(lambda: F.scaled_dot_product_attention(qs, ks, vs, attn_mask=dense_mask))
    rows.append(row(label, timing, error, visible_flops, "peer; checked against the sink-less reference"))


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write counted)."""
    source = torch.empty(2**29, dtype=torch.bfloat16, device="cuda").normal_()
    destination = torch.empty_like(source)
    timing = time_cuda(lambda: destination.copy_(source), warmup=3, repetitions=20)
    return 2 * source.numel() * source.element_size() / (timing["median_ms"] * 1e-3)


def decode_runs(variants) -> list[tuple]:
    """(config, waves, combine) for each variant: the table's config with one wave is timed both as
    the default single launch ("last") and with the combine kernel ("kernel"), the rest single-launch."""
    runs = []
    for config, splits in variants:
        runs.append((config, splits, "last"))
        if config is None and splits is None:
            runs.append((config, splits, "kernel"))
    return runs


def bench_decode(k, v, sinks, rows: list, failures: list, bandwidth: float, variants, with_composite: bool) -> None:
    generator = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(1, 1, HEADS, HEAD_DIM, generator=generator, device="cuda").to(torch.bfloat16)  # [1, 1, Hq, hd]
    q_start = torch.tensor([TOKENS - 1], device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    problems = [(MaskSpec("causal"), TOKENS)]  # every key read: the target's problem
    if with_composite:  # informational: the window plus the block starts older than it
        problems.append((SPEC, WINDOW + (TOKENS - 1 - WINDOW) // BLOCK + 1))
    for spec, keys_read in problems:
        kv_bytes = 2 * keys_read * KV_HEADS * HEAD_DIM * k.element_size()
        bound_ms = kv_bytes / bandwidth * 1e3
        reference = attention_reference(q.float(), k.float(), v.float(), sinks, spec, q_start)
        for config, splits, combine in decode_runs(variants):
            num_splits = None if splits is None else min(128, splits * max(1, sms // KV_HEADS))
            parts = ["table" if config is None else f"bn{config.block_n} s{config.num_stages}"
                     + (f" w{config.num_warps}" if config.num_warps else "")
                     + (f" {config.programs_per_sm}/SM" if config.programs_per_sm > 1 else "")]
            parts += [f"{splits} waves"] if splits else []
            parts += ["1 launch" if combine == "last" else "2 launches"]
            label = f"fused decode {spec.describe()} ({', '.join(parts)})"  # e.g. "(table, 1 launch)"
            if time.perf_counter() - START > BUDGET_S and (config or splits):
                rows.append(row(label, None, None, None, "skipped: time budget"))
                continue
            out = torch.empty_like(q)
            # The target is the default path's: the single launch at the table's config.
            is_target = spec.kind == "causal" and combine == "last" and config is None and splits is None

            def run(out=out, spec=spec, config=config, num_splits=num_splits, combine=combine):
                return flash_decode(q, k, v, sinks, spec, q_start, None, out=out, config=config, num_splits=num_splits,
                                    combine=combine)

            error = checked(label, run, reference, rows, failures)
            if error is None:
                continue
            rows.append(timed_decode_row(
                label, run, error, kv_bytes, bound_ms, combine,
                num_splits=num_splits or default_num_splits(q, k, spec, config),
                target_ratio=DECODE_TARGET_RATIO if is_target else None,
            ))


def timed_decode_row(label: str, run, error: float, kv_bytes: int, bound_ms: float, combine: str, *,
                     num_splits: int, target_ratio: float | None = None, cold_run=None, cold_calls: int = 0,
                     **extra) -> dict:
    """Time `run` eagerly and replayed from a CUDA graph (the row's median: how the engine runs
    decode); with `cold_run` (N calls over N KV copies) also one graph of those, per call."""
    eager = time_cuda(run, repetitions=50)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graphed = time_cuda(graph.replay, repetitions=50)
    note = f"CUDA graph replay; eager {eager['median_ms'] * 1e3:.1f} us; {num_splits} splits"
    # Steady state: one graph of STEADY_CALLS calls, per call (a decode kernel inside a larger step
    # graph, without each single replay's launch at both ends). Reported beside the target's row
    # figure, which stays the single-replay median.
    steady_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(steady_graph):
        for _ in range(STEADY_CALLS):
            run()
    steady_ms = time_cuda(steady_graph.replay, warmup=2, repetitions=10)["median_ms"] / STEADY_CALLS
    extra.update(steady_median_ms=steady_ms, steady_ratio_to_bound=steady_ms / bound_ms)
    note += f"; steady {steady_ms * 1e3:.1f} us ({steady_ms / bound_ms:.2f}x bound, {STEADY_CALLS} calls per graph)"
    if cold_run is not None:
        cold_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cold_graph):
            cold_run()
        cold_ms = time_cuda(cold_graph.replay, warmup=2, repetitions=10)["median_ms"] / cold_calls
        extra.update(cold_median_ms=cold_ms, cold_ratio_to_bound=cold_ms / bound_ms, cold_calls=cold_calls)
        note += f"; cold {cold_ms * 1e3:.1f} us ({cold_ms / bound_ms:.2f}x bound, {cold_calls} KV copies)"
    ratio = graphed["median_ms"] / bound_ms
    return row(
        label, graphed, error, None, note,
        kv_bytes=kv_bytes, bound_ms=bound_ms, ratio_to_bound=ratio, eager_median_ms=eager["median_ms"],
        combine=combine, launches_per_call=1 if combine == "last" else 2, num_splits=num_splits,
        target_ratio=target_ratio, target_met=(ratio <= target_ratio) if target_ratio else None, **extra,
    )


def v4_keys_read(spec: MaskSpec, keys: int) -> int:
    """Keys the query at position keys - 1 sees: the window plus the block starts older than it."""
    if spec.kind != "composite":
        return keys
    return min(keys, WINDOW) + max(0, (keys - 1 - WINDOW) // BLOCK + 1)


def bench_decode_v4(rows: list, failures: list, bandwidth: float) -> None:
    """The engine's v4 decode step (Hq 8 over Hkv 1): default split count both ways, and the
    640-key composite problem at one tile per split (the previous rule's choice), for comparison."""
    generator = torch.Generator(device="cuda").manual_seed(2)

    def draw(*shape):
        return torch.randn(*shape, generator=generator, device="cuda").to(torch.bfloat16)

    q = draw(1, 1, V4_HEADS, HEAD_DIM)  # [1, 1, Hq, hd]
    sinks = torch.randn(V4_HEADS, generator=generator, device="cuda")  # [Hq] float32
    l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20) or 50 * 2**20
    for keys in sorted({keys for keys, _ in V4_PROBLEMS}):
        # N copies of the cache, > 2x the L2 in all; copy 0 is the one checked against the reference.
        copies = min(256, max(2, math.ceil(2 * l2_bytes / (2 * keys * V4_KV_HEADS * HEAD_DIM * 2))))
        k_all = draw(copies, 1, keys, V4_KV_HEADS, HEAD_DIM)  # [N, B=1, Tk, Hkv, hd]
        v_all = draw(copies, 1, keys, V4_KV_HEADS, HEAD_DIM)
        k, v = k_all[0], v_all[0]
        q_start = torch.tensor([keys - 1], device="cuda")
        for spec in [spec for problem_keys, spec in V4_PROBLEMS if problem_keys == keys]:
            keys_read = v4_keys_read(spec, keys)
            kv_bytes = 2 * keys_read * V4_KV_HEADS * HEAD_DIM * k.element_size()
            bound_ms = kv_bytes / bandwidth * 1e3
            reference = attention_reference(q.float(), k.float(), v.float(), sinks, spec, q_start)
            default_splits = default_num_splits(q, k, spec)
            variants = [(None, "last"), (None, "kernel")]
            if keys <= 640 and spec.kind == "composite":
                # The launcher's walk bound in tiles: the window band plus every block start.
                walk_tiles = triton.cdiv(min(keys, WINDOW) + triton.cdiv(keys, BLOCK), DECODE_CONFIGS[HEAD_DIM].block_n)
                # one 32-key tile per split (the old one-wave rule), merged both ways
                variants += [(walk_tiles, "last"), (walk_tiles, "kernel")]
            for num_splits, combine in variants:
                splits = num_splits or default_splits
                label = (f"fused decode v4 Hq{V4_HEADS}/Hkv{V4_KV_HEADS} {keys} keys {spec.describe()} "
                         f"(table, {splits} splits{' = 1 tile each' if num_splits else ''}, "
                         f"{'1 launch' if combine == 'last' else '2 launches'})")
                out = torch.empty_like(q)

                def run(out=out, spec=spec, num_splits=num_splits, combine=combine, k=k, v=v, q_start=q_start):
                    return flash_decode(q, k, v, sinks, spec, q_start, None, out=out, num_splits=num_splits,
                                        combine=combine)

                def cold_run(out=out, spec=spec, num_splits=num_splits, combine=combine, k_all=k_all, v_all=v_all,
                             q_start=q_start):
                    for copy in range(k_all.shape[0]):
                        flash_decode(q, k_all[copy], v_all[copy], sinks, spec, q_start, None, out=out,
                                     num_splits=num_splits, combine=combine)

                error = checked(label, run, reference, rows, failures)
                if error is None:
                    continue
                rows.append(timed_decode_row(
                    label, run, error, kv_bytes, bound_ms, combine, num_splits=splits, cold_run=cold_run,
                    cold_calls=copies, shape="v4", keys=keys,
                ))
        del k_all, v_all


def format_table(header: dict, rows: list) -> str:
    lines = [
        (f"attention bench  {header['gpu']}  torch {header['torch']}  triton {header['triton']}  "
         f"commit {header['commit']}"),
        (f"problem: T={TOKENS} Hq={HEADS} Hkv={KV_HEADS} hd={HEAD_DIM} {SPEC.describe()} sinks bf16; "
         f"visible pairs/head "
         f"{header['visible_pairs_per_head'] / 1e6:.2f} M ({header['visible_fraction_of_square']:.1%} of T^2); visible "
         f"FLOPs {header['visible_flops'] / 1e9:.1f} G; copy bandwidth {header['copy_tb_s']:.2f} TB/s"),
        (f"v4 decode rows: B=1 Hq={V4_HEADS} Hkv={V4_KV_HEADS} hd={HEAD_DIM} sinks bf16, query at the last position; "
         f"'cold' = per call in one graph of calls over KV copies > 2x L2"),
        "",
        ("median ms: CUDA events around one call queued behind a spin kernel (the call's device time); "
         "idle ms: the same call on an idle stream, the host's launch inside (the figure of runs <= 14); "
         "wall ms: back-to-back calls"),
        "",
        "| row | median ms | ± stdev | idle ms | wall ms | TFLOP/s visible | rel err | vs target | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        error = "-" if r["error"] is None else f"{r['error']:.2e}"
        if "median_ms" not in r:
            lines.append(f"| {r['name']} | - | - | - | - | - | {error} | - | {r['note']} |")
            continue
        tflops = f"{r['tflops_visible']:.0f}" if "tflops_visible" in r else "-"
        if "ratio_to_bound" in r:
            target = f"{r['ratio_to_bound']:.2f}x bound ({r['bound_ms'] * 1e3:.1f} us)"
            if r.get("target_ratio"):
                target += " MET" if r["target_met"] else " MISSED"
        elif "target_ms" in r:
            target = "MET" if r["target_met"] else "MISSED"
        else:
            target = "-"
        clocks = " (clocks disagree >5%)" if r["clocks_disagree"] else ""
        lines.append(f"| {r['name']} | {r['median_ms']:.4f} | {r['stdev_ms']:.4f} | {r['idle_stream_median_ms']:.4f} | "
                     f"{r['wall_ms']:.4f}{clocks} | "
                     f"{tflops} | {error} | {target} | {r['note']} |")
    return "\n".join(lines)


def main() -> int:
    if not torch.cuda.is_available():
        print("attention_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    generator = torch.Generator(device="cuda").manual_seed(0)

    def draw(*shape):
        return torch.randn(*shape, generator=generator, device="cuda").to(torch.bfloat16)

    q = draw(1, TOKENS, HEADS, HEAD_DIM)  # [B, T, Hq, hd]
    k = draw(1, TOKENS, KV_HEADS, HEAD_DIM)  # [B, T, Hkv, hd]
    v = draw(1, TOKENS, KV_HEADS, HEAD_DIM)
    sinks = torch.randn(HEADS, generator=generator, device="cuda")  # [Hq] float32

    pairs = visible_pairs_per_head()
    positions = torch.arange(TOKENS, device="cuda")
    assert pairs == int(visible_mask(SPEC, positions, positions).sum()), "visible-pair formula disagrees with the mask"
    visible_flops = float(pairs) * HEADS * 4 * HEAD_DIM
    rows, failures = [], []
    try:
        bandwidth = copy_bandwidth()
        reference = reference_in_chunks(q, k, v, sinks, SPEC)  # [B, T, Hq, hd] float32
        # The table's configs and both peers first; the sweep spends what is left of the budget.
        bench_prefill(q, k, v, sinks, reference, visible_flops, rows, failures, PREFILL_SWEEP[:1])
        bench_decode(k, v, sinks, rows, failures, bandwidth, DECODE_SWEEP[:1], with_composite=True)
        bench_decode_v4(rows, failures, bandwidth)
        bench_flex(q, k, v, sinks, reference, visible_flops, rows, failures)
        bench_sdpa(q, k, v, visible_flops, rows, failures)
        bench_prefill(q, k, v, sinks, reference, visible_flops, rows, failures, PREFILL_SWEEP[1:])
        bench_decode(k, v, sinks, rows, failures, bandwidth, DECODE_SWEEP[1:], with_composite=False)
    except InvalidMeasurement as error:
        print(f"attention_bench: invalid measurement, no table: {error}", file=sys.stderr)
        return 2

    header = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": commit(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "visible_pairs_per_head": pairs,
        "visible_fraction_of_square": pairs / TOKENS**2,
        "visible_flops": visible_flops,
        "copy_tb_s": bandwidth / 1e12,
        "bf16_dense_tflops_ceiling": BF16_DENSE_TFLOPS,
        "elapsed_s": time.perf_counter() - START,
    }
    report = {"header": header, "rows": rows, "failures": failures, "resources": resource_report(),
              "launches": launches.snapshot()}
    output = Path(os.environ["OUT"]) / "attention_bench.json" if os.environ.get("OUT") else \
        REPO / "bench" / "results" / f"attention_bench_{time.strftime('%Y%m%d_%H%M%S')}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2))

    print("compiler resource report (registers per thread, spills, shared memory):")
    print(format_resource_report(report["resources"]))
    print(f"launches: {report['launches']}")
    for failure in failures:
        print(f"CORRECTNESS FAILURE: {failure}")
    print(f"json: {output}  ({header['elapsed_s']:.0f} s)")
    print()
    print(format_table(header, rows))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
