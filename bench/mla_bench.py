"""Benchmark the fused MLA decode kernel (kernels.attention_mla.mla_decode) on an H200 against the bounds
and torch SDPA, all measured in this run.

Problem (DeepSeek-V3's attention, decode): batch 64, 128 query heads, one query each at the cache's last
position, a latent cache of 512 + 64 bf16 values per token, 4096 and 8192 tokens. Rows, each checked
against kernels.reference.mla_latent_reference (two batch rows, float32) before it is timed:

  kernel       mla_decode at its default config and split count; its device time per call, the median of
               graph replays of 20 calls (engine.bench.graph_call_us: the steady figure a decode step sees)
  arm          the engine's whole fused arm: q W_UK (einsum), the kernel, W_UV (einsum), W_UK/W_UV random
  sdpa         torch's scaled_dot_product_attention on the DECOMPRESSED cache (K [B, H, T, 192] and V
               [B, H, T, 128] bf16, materialised once before timing, as a naive cache would hold them):
               the peer the latent form replaces; skipped, saying so, when the GPU lacks the memory
  bytes bound  the latent cache's bytes (B x T x 576 x 2) over the copy bandwidth of a device-to-device copy
               of that many bytes timed the same way ((read + write) bytes / time, as engine.bench)
  flops bound  the kernel's tensor-core work, B x H x T x (2 x 576 + 2 x 512) FLOP, over a bf16 matmul's
               throughput measured here (8192^3): at 128 heads the walk does 242 FLOP per cache byte, past the
               H200's ridge (989 TFLOP/s dense bf16 over 4.8 TB/s: 206 FLOP/B), so the FLOP bound may be the
               larger one and the bytes-bound target (<= 1.2x) out of reach for any kernel; both ratios print

Each row prints both ratios and a target line: the issue's bytes target (<= 1.2x) beside the ratio to the
roofline (the larger bound), saying so when the FLOP bound measured in the run lies above 1.2x the bytes
bound (then no kernel meets the bytes target; the roofline ratio is the figure to push down).

`--sweep` also times other block configs, the structure candidates of kernels.attention_mla.MlaConfig
(SWEEP) and split counts (each in its own try: a config that does not compile or does not match the
reference is reported, not fatal), every row with both ratios, and prints the compiler's registers,
spills and shared memory of everything launched (bench/mla_sm90_compile.py predicts them without a GPU).

Needs torch, triton, numpy (no textual). JSON to --out (default $OUT/mla_bench.json, else bench/results/).
Exit 0: every row correct; 1: a correctness check of a default row failed, or a launch broke the device
(the rows measured before it are still printed and written); 2: no GPU or an invalid measurement. A
sweep config that fails (compile, fit, correctness) is a row saying so; each sweep row is also printed
as a JSON line the moment it is measured.
Run: python bench/mla_bench.py [--sweep] [--out FILE]   (about 2-3 minutes on an H200 with --sweep, most of it
Triton compiling the sweep's configs)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

TARGET_RATIO = 1.2
LATENT, ROPE, NOPE, V = 512, 64, 128, 128
# Relative max error of the kernel's bf16 output against the float32 reference (tests/test_attention_mla.py)
TOLERANCE = 1.6e-2
# (block_m, block_n, warps, stages[, MlaConfig's structure flags]): the old 64 x 32 default, deeper pipelines
# of 32-key tiles, the 64 x 64 default, the unchained walk (P through a scratch: the score dot no longer
# computed twice), the key tiles through TMA, both, and a smaller row block (kernels/attention_mla.py).
# bench/mla_sm90_compile.py's table dropped the lazy-rescale builds (they spill at this shape), 64 x 64 at
# 3 stages (288 KB of shared memory), 64 x 16 (spilled in run 59), 128 x 32 at 16 warps (ptxas refuses it).
UNCHAINED, TMA, BOTH = {"unchained": True}, {"tma": True}, {"unchained": True, "tma": True}
SWEEP = [
    (64, 32, 8, 2), (64, 32, 8, 3), (64, 32, 8, 4), (64, 64, 8, 2),
    (64, 64, 8, 2, UNCHAINED), (64, 32, 8, 3, UNCHAINED), (64, 32, 8, 4, UNCHAINED),
    (64, 64, 8, 2, TMA), (64, 32, 8, 4, TMA), (64, 64, 8, 2, BOTH), (64, 32, 8, 4, BOTH),
    (32, 32, 4, 2),
]
SWEEP_SPLITS = (1, 2)  # run 59: more splits were slower at every config (128 programs already fill 132 SMs)

def _relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max()).item()


def _copy_bandwidth(nbytes: int, graph_call_us, device: str = "cuda") -> dict:
    source = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    target = torch.empty_like(source)
    us = graph_call_us(lambda: target.copy_(source), calls=10)
    del source, target
    return {"bytes": nbytes, "us": us, "bytes_per_s": 2 * nbytes / (us * 1e-6)}


def _matmul_flops(graph_call_us) -> dict:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    us = graph_call_us(lambda: a @ b, calls=5)
    del a, b
    return {"shape": "8192^3 bf16", "us": us, "flops_per_s": 2 * 8192 ** 3 / (us * 1e-6)}


def _problem(batch: int, heads: int, tokens: int, device: str, latent: int, rope: int) -> dict:
    """Fresh random q and cache (seeded by the cache length), the output buffer and the float32 reference of
    the first two batch rows."""
    from kernels.reference import mla_latent_reference

    generator = torch.Generator(device=device).manual_seed(tokens)
    scale = (NOPE + rope) ** -0.5
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter's bf16 tl.dot is wrong
    q = torch.randn(batch, 1, heads, latent + rope, generator=generator, device=device).to(dtype)
    cache = torch.randn(batch, tokens, 1, latent + rope, generator=generator, device=device).to(dtype)
    q_start = torch.full((batch,), tokens - 1, dtype=torch.int32, device=device)
    out = torch.empty(batch, 1, heads, latent, dtype=dtype, device=device)
    expected = mla_latent_reference(q[:2].float(), cache[:2].float(), latent, scale, q_start[:2])
    return {"q": q, "cache": cache, "q_start": q_start, "out": out, "expected": expected, "scale": scale,
            "latent": latent, "cuda": device == "cuda"}


def _launch(problem: dict, config=None, splits=None):
    from kernels.attention_mla import mla_decode

    return mla_decode(problem["q"], problem["cache"], problem["latent"], problem["scale"], problem["q_start"],
                      out=problem["out"], config=config, num_splits=splits)


def _checked(problem: dict, label: str, config=None, splits=None) -> float:
    """The relative error of one launch (output poisoned first); AssertionError past TOLERANCE."""
    problem["out"].fill_(float("nan"))
    _launch(problem, config, splits)
    if problem["cuda"]:
        torch.cuda.synchronize()
    error = _relative(problem["out"][:2], problem["expected"])
    if not (math.isfinite(error) and error <= TOLERANCE):
        raise AssertionError(f"{label}: relative error {error:.3e} > {TOLERANCE} against the reference")
    return error


def sweep_configs(problem: dict, bytes_bound_us: float, flops_bound_us: float, graph_call_us,
                  report=None) -> list[dict]:
    """SWEEP x SWEEP_SPLITS on one problem, each checked then timed in its own try (a config that does not
    compile, fit or match is a row saying why); `report(row)` sees each row as it is made (a log that a
    hung candidate cuts short still names the ones before it)."""
    from kernels.attention_mla import MlaConfig

    rows, roofline_us = [], max(bytes_bound_us, flops_bound_us)
    for entry in SWEEP:
        for split_count in SWEEP_SPLITS:
            label = f"{'x'.join(map(str, entry[:2]))} w{entry[2]} s{entry[3]} splits {split_count}"
            try:
                candidate = MlaConfig(*entry[:4], **(entry[4] if len(entry) > 4 else {}))
                label = f"{candidate.label()} splits {split_count}"
                error = _checked(problem, label, candidate, split_count)
                us = graph_call_us(lambda: _launch(problem, candidate, split_count), calls=10)
                rows.append({"config": label, "us": us, "ratio_to_bytes_bound": us / bytes_bound_us,
                             "ratio_to_roofline": us / roofline_us, "error": error})
            except Exception as error:  # noqa: BLE001 - reported, not fatal
                rows.append({"config": label, "failed": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"})
            if report is not None:
                report(rows[-1])
    return rows


def bench_cache(batch: int, heads: int, tokens: int, sweep: bool, graph_call_us, flops: dict,
                device: str = "cuda", latent: int = LATENT, rope: int = ROPE) -> dict:
    """One cache length's rows (and its sweep when `sweep`). `device`, `latent`, `rope` and a stub
    `graph_call_us` let tests/test_attention_mla.py run every path at a small shape on a CPU (no timing
    meaning there)."""
    from kernels.attention_mla import default_config, default_num_splits, mla_decode

    cuda = device == "cuda"
    problem = _problem(batch, heads, tokens, device, latent, rope)
    q, cache, q_start, out, scale = (problem[name] for name in ("q", "cache", "q_start", "out", "scale"))
    dtype = q.dtype
    cache_bytes = batch * tokens * (latent + rope) * cache.element_size()
    copy = _copy_bandwidth(cache_bytes, graph_call_us, device)
    bytes_bound_us = cache_bytes / copy["bytes_per_s"] * 1e6
    kernel_flops = batch * heads * tokens * (2 * (latent + rope) + 2 * latent)
    flops_bound_us = kernel_flops / flops["flops_per_s"] * 1e6
    config = default_config(latent, heads)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if cuda else None
    splits = default_num_splits(batch, heads, tokens, config, sms)
    error = _checked(problem, "kernel")
    kernel_us = graph_call_us(lambda: _launch(problem), calls=20)
    row = {"tokens": tokens, "batch": batch, "heads": heads, "cache_bytes": cache_bytes, "copy": copy,
           "bytes_bound_us": bytes_bound_us, "flops": kernel_flops, "flops_bound_us": flops_bound_us,
           "kernel": {"us": kernel_us, "config": vars(config), "label": config.label(), "splits": splits,
                      "error": error,
                      "achieved_bytes_per_s": cache_bytes / (kernel_us * 1e-6),
                      "achieved_flops_per_s": kernel_flops / (kernel_us * 1e-6)},
           "ratio_to_bytes_bound": kernel_us / bytes_bound_us,
           "ratio_to_roofline": kernel_us / max(bytes_bound_us, flops_bound_us),
           "target_ratio": TARGET_RATIO, "bytes_target_reachable": flops_bound_us <= TARGET_RATIO * bytes_bound_us}

    # The engine's whole fused arm: absorption and the value projection around the kernel.
    w_uk = (torch.randn(heads, NOPE, latent, device=device) / latent ** 0.5).to(dtype)
    w_uv = (torch.randn(heads, V, latent, device=device) / latent ** 0.5).to(dtype)
    q_nope = torch.randn(batch, 1, heads, NOPE, device=device).to(dtype)

    def arm():
        absorbed = torch.cat([torch.einsum("bthn,hnr->bthr", q_nope, w_uk), q[..., latent:]], dim=-1)
        out_latent = mla_decode(absorbed, cache, latent, scale, q_start)
        return torch.einsum("bthr,hvr->bthv", out_latent, w_uv)

    row["arm"] = {"us": graph_call_us(arm, calls=10)}

    # The peer: SDPA over the decompressed K and V.
    needed = batch * heads * tokens * (NOPE + rope + V) * cache.element_size()
    free = torch.cuda.mem_get_info()[0] if cuda else needed * 2
    if needed > 0.8 * free:
        row["sdpa"] = {"skipped": f"the decompressed cache needs {needed / 1e9:.1f} GB, {free / 1e9:.1f} GB free"}
    else:
        key = torch.randn(batch, heads, tokens, NOPE + rope, device=device, dtype=dtype)
        value = torch.randn(batch, heads, tokens, V, device=device, dtype=dtype)
        query = torch.randn(batch, heads, 1, NOPE + rope, device=device, dtype=dtype)
        attend = torch.nn.functional.scaled_dot_product_attention
        try:
            sdpa_us = graph_call_us(lambda: attend(query, key, value, scale=scale), calls=5)
            row["sdpa"] = {"us": sdpa_us, "decompressed_bytes": needed, "kernel_speedup": sdpa_us / kernel_us}
        except RuntimeError as error:  # a backend that cannot take head dims 192 / 128: say so
            row["sdpa"] = {"skipped": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"}
        del key, value, query

    if sweep:
        row["sweep"] = sweep_configs(problem, bytes_bound_us, flops_bound_us, graph_call_us)
    del q, cache, out, problem
    if cuda:
        torch.cuda.empty_cache()
    return row


def target_line(row: dict) -> str:
    """The issue's bytes target and the roofline ratio side by side, and whether the bytes target is reachable
    at all: when the FLOP bound measured in this run exceeds the bytes bound, no kernel gets under
    flops_bound / bytes_bound times the bytes bound."""
    met = "met" if row["ratio_to_bytes_bound"] <= TARGET_RATIO else "missed"
    line = (f"target <= {TARGET_RATIO}x bytes: {met} ({row['ratio_to_bytes_bound']:.3f}x); "
            f"roofline max(bytes, FLOP): {row['ratio_to_roofline']:.3f}x")
    floor = row["flops_bound_us"] / row["bytes_bound_us"]
    if floor > TARGET_RATIO:
        line += (f"; the bytes target lies below the FLOP bound measured here ({row['flops_bound_us']:.1f} us > "
                 f"{TARGET_RATIO} x {row['bytes_bound_us']:.1f} us): no kernel gets under {floor:.2f}x bytes")
    return line


def format_rows(rows: list[dict], flops: dict) -> str:
    lines = [f"\nbf16 matmul {flops['flops_per_s'] / 1e12:.0f} TFLOP/s ({flops.get('shape', '')}); "
             f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu'}, torch {torch.__version__}",
             f"{'tokens':>7} {'kernel us':>10} {'bytes bnd':>10} {'x bytes':>8} {'flop bnd':>9} {'x roof':>7} "
             f"{'GB/s':>7} {'TFLOP/s':>8} {'arm us':>8} {'sdpa us':>9} {'sdpa/kern':>9}  config"]
    for row in rows:
        kernel, sdpa = row["kernel"], row["sdpa"]
        sdpa_us = f"{sdpa['us']:.1f}" if "us" in sdpa else "skip"
        speedup = f"{sdpa['kernel_speedup']:.2f}x" if "us" in sdpa else "-"
        lines.append(f"{row['tokens']:>7} {kernel['us']:>10.1f} {row['bytes_bound_us']:>10.1f} "
                     f"{row['ratio_to_bytes_bound']:>7.3f}x {row['flops_bound_us']:>9.1f} "
                     f"{row['ratio_to_roofline']:>6.3f}x {kernel['achieved_bytes_per_s'] / 1e9:>7.0f} "
                     f"{kernel['achieved_flops_per_s'] / 1e12:>8.1f} {row['arm']['us']:>8.1f} {sdpa_us:>9} "
                     f"{speedup:>9}  {kernel.get('label', '')} splits {kernel['splits']}")
        lines.append(f"        {target_line(row)}")
        if "skipped" in sdpa:
            lines.append(f"        sdpa skipped: {sdpa['skipped']}")
        for entry in row.get("sweep", []):
            result = (f"{entry['us']:.1f} us, {entry['ratio_to_bytes_bound']:.3f}x bytes, "
                      f"{entry['ratio_to_roofline']:.3f}x roofline" if "us" in entry else f"FAILED {entry['failed']}")
            lines.append(f"        sweep {entry['config']:<34} {result}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--tokens", default="4096,8192", help="cache lengths (default 4096,8192)")
    parser.add_argument("--sweep", action="store_true", help="also time other block configs and split counts")
    parser.add_argument("--sweep-quick", action="store_true",
                        help="with --sweep: one split, and only the 64 x 64 default and the structure candidates "
                             "(unchained, tma, both): about a third of the sweep")
    parser.add_argument("--out", default=None, help="JSON path (default $OUT/mla_bench.json, else bench/results/)")
    args = parser.parse_args(argv)
    if args.sweep_quick:
        global SWEEP, SWEEP_SPLITS
        SWEEP = [entry for entry in SWEEP if len(entry) > 4 or tuple(entry[:4]) == (64, 64, 8, 2)]
        SWEEP_SPLITS = (1,)
    if not torch.cuda.is_available():
        print("mla_bench: no CUDA GPU visible: this benchmark runs on a GPU", file=sys.stderr)
        return 2
    from engine.bench import graph_call_us
    from engine.errors import MeasurementError
    from kernels.attention_common import format_resource_report, resource_report

    rows, stopped = [], None
    try:
        flops = _matmul_flops(graph_call_us)
        rows = [bench_cache(args.batch, args.heads, int(tokens), False, graph_call_us, flops)
                for tokens in args.tokens.split(",")]
        if args.sweep:  # after every default row: a candidate that breaks the CUDA context costs only the sweep
            for row in rows:
                problem = _problem(args.batch, args.heads, row["tokens"], "cuda", LATENT, ROPE)
                row["sweep"] = sweep_configs(problem, row["bytes_bound_us"], row["flops_bound_us"], graph_call_us,
                                             report=lambda entry, tokens=row["tokens"]: print(
                                                 f"sweep {tokens}: {json.dumps(entry)}", flush=True))
                del problem
                torch.cuda.empty_cache()
    except AssertionError as error:
        print(f"mla_bench: correctness check failed: {error}", file=sys.stderr)
        return 1
    except MeasurementError as error:
        print(f"mla_bench: {error}", file=sys.stderr)
        return 2
    except Exception as error:  # noqa: BLE001 - a launch that broke the device: keep what was measured
        stopped = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        print(f"mla_bench: stopped after {len(rows)} rows: {stopped}", file=sys.stderr)
        if not rows:
            return 1
    resources = resource_report()
    print(format_resource_report(resources))
    print(format_rows(rows, flops))
    out = Path(args.out) if args.out else Path(os.environ.get("OUT") or ROOT / "bench" / "results") / "mla_bench.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "matmul": flops, "resources": resources, "stopped": stopped,
                               "device": torch.cuda.get_device_name(0), "torch": torch.__version__}, indent=2))
    print(f"\nJSON: {out}")
    return 1 if stopped else 0

if __name__ == "__main__":
    raise SystemExit(main())
