"""Trellis MoE arms on an H200 at v4-shape (E = 256, k = 6, D = 4096, F = 2048), against the bf16 arms and
their own bounds, in ONE run (about 3 minutes, most of it Triton compiling):

  (i)   n = 1: trellis GEMV (each code at K = 2 with the default schedule and the baseline one, hyb with every
        schedule)
        against the bf16 GEMV arm (target: >= 3x faster) and against its own bound
        max(packed bytes / copy bandwidth, issue time of its main loop) (target: <= 1.5x)
  (ii)  n = 2048 and 8192: the fused-decode grouped arm (hyb with every schedule, the other codes with the
        default, "auto" and the tensor-form baseline) against the bf16 grouped arm (target: <= 1.3x its time)
        and against its decode's issue bound (the windows this routing makes, times each weight's loop
        instructions, read from this run's SASS)
  (iii) the dequantize-then-grouped arm at the same n (hyb, default schedule)

Measurement. Packed codes are drawn at random on the device with the format's real shapes
(kernels.trellis_reference.random_trellis_matrix: the decode's cost does not depend on the codes'
values). The copy bandwidth (engine.bench.copy_bandwidth) and the SM clock (clock64 against
globaltimer in a busy kernel, before and after the timings; the higher is used, which makes the bound
the stricter) are measured in this run. n = 1: a CUDA graph of 42 calls, each on its own 6 experts (42
disjoint sets: 1.6 GB between two reads of one expert, so L2 never serves one), replayed 2 times as
warm-up and 10 times timed; a replay's mean per call is one sample. n = 2048 / 8192: every expert is
woken (1.6 GB packed, 12.9 GB bf16: far over L2); each call between CUDA events, 1 warm-up and 5 timed,
two routing sets alternating. Mean +- stddev over the samples.

The issue bound: the arm's two products' main loops, read from the SASS of the kernels this run
compiled (bench/sass_loops.py: instructions per weight by pipe), times the weights the call decodes
(6 experts x 3 D F at n = 1), over each pipe's rate at the measured clock; the bound is the largest
pipe's time (docs/trellis-kernels.md derives the counts and states the pipe rates, which are leads).

Checks (exit 1 when one fails): every arm's output against the MoE over dequantized experts in its
rotated-basis torch form (kernels.trellis_reference.moe_trellis_rotated: the model-basis reference's
function without rotating any weights, so much cheaper at v4-shape; the GPU tests hold the arms to the
model-basis one), at n >= 2048 on the first 4 tokens' rows (whose outputs depend on those tokens only),
relative error <= 2e-2 in bf16; the bf16 arms against moe_reference; the fused and dequantize grouped
arms equal bit for bit, for every schedule of the dequantize arm's block shapes (the unrolled decode with and
without the register cap, and the tensor-form baseline: the same weights, tiles and K order).

    python3 bench/trellis_bench.py [--out DIR] [--gemv-only | --grouped-only]
                              # table on stdout, JSON to DIR/trellis_bench.json (DIR: --out, else $OUT,
                              # else bench/results); --grouped-only: (ii) and (iii) alone, about 2 minutes
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import sass_loops  # noqa: E402
from engine.bench import copy_bandwidth  # noqa: E402
from engine.provenance import commit_label  # noqa: E402
from kernels import trellis_gemv, trellis_grouped  # noqa: E402
from kernels.moe_gemv import moe_gemv  # noqa: E402
from kernels.moe_grouped import moe_grouped  # noqa: E402
from kernels.reference import moe_reference  # noqa: E402
from kernels.trellis_reference import (TrellisCode, hadamard_block, moe_trellis_rotated,  # noqa: E402
                                       random_trellis_matrix)

E, K_TOP, D, F = 256, 6, 4096, 2048
CODES = ("hyb", "3inst", "1mad")
GEMV_CALLS = 42  # calls per graph at n = 1: 42 disjoint sets of 6 experts
GEMV_WARMUP, GEMV_REPLAYS = 2, 10
GROUPED_TOKENS = (2048, 8192)
GROUPED_WARMUP, GROUPED_REPS = 1, 5
TOLERANCE = 2e-2  # bf16: the weights and four intermediates rounded to bf16 (tests/test_trellis_kernels.py)
CHECK_TOKENS = 4  # rows checked against the reference at n >= 2048


@triton.jit
def _clock_kernel(out_ptr, spins):
    """One program: (clock64, globaltimer) before and after a dependent integer chain of `spins` steps."""
    zero = tl.zeros([1], dtype=tl.int32)
    clock0 = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [zero], dtype=tl.int64, is_pure=False, pack=1)
    time0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [zero], dtype=tl.int64, is_pure=False,
                                      pack=1)
    # the chain depends on both first reads and the last reads on the chain: nothing can move across them
    x = (zero + tl.program_id(0)).to(tl.uint32) + ((clock0 ^ time0) & 1).to(tl.uint32)
    for _ in range(spins):
        x = x * 1103515245 + 12345
    clock1 = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [x.to(tl.int32, bitcast=True)],
                                       dtype=tl.int64, is_pure=False, pack=1)
    time1 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [x.to(tl.int32, bitcast=True)],
                                      dtype=tl.int64, is_pure=False, pack=1)
    offs = tl.arange(0, 1)
    tl.store(out_ptr + offs, clock1 - clock0)
    tl.store(out_ptr + 1 + offs, time1 - time0)
    tl.store(out_ptr + 2 + offs, x.to(tl.int64))  # keeps the chain


def sm_clock_hz() -> float:
    """The SM clock now: cycles over nanoseconds of one busy program (~10 ms), best of three."""
    out = torch.zeros(3, dtype=torch.int64, device="cuda")
    best = 0.0
    for _ in range(3):
        _clock_kernel[(1,)](out, 2_000_000, num_warps=1)
        torch.cuda.synchronize()
        cycles, nanoseconds = out[0].item(), out[1].item()
        if nanoseconds > 0:
            best = max(best, cycles / (nanoseconds * 1e-9))
    if not (math.isfinite(best) and best > 1e8):
        raise RuntimeError(f"the SM clock read back as {best} Hz: not a measurement")
    return best


def sm_clock(note: str) -> tuple[float, str]:
    """(Hz, how it was read): measured by `sm_clock_hz`, else nvidia-smi's current SM clock, else the H200's
    1.98 GHz boost clock (each fallback named in the output)."""
    try:
        return sm_clock_hz(), "measured (clock64 / globaltimer)"
    except Exception as error:  # noqa: BLE001 - a clock read that fails must not cost the run
        print(f"  SM clock probe failed {note} ({type(error).__name__}: {str(error)[:120]})", file=sys.stderr)
    try:
        import subprocess

        text = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20).stdout.split()[0]
        return float(text) * 1e6, "nvidia-smi clocks.sm"
    except Exception:  # noqa: BLE001
        return 1.98e9, "assumed 1.98 GHz (the H200's boost clock): no reading"


def stats(samples: list[float]) -> dict:
    if not samples or not all(math.isfinite(s) and s > 0 for s in samples):
        raise RuntimeError(f"timings {samples} are not a measurement")
    return {"mean_us": statistics.mean(samples), "std_us": statistics.stdev(samples) if len(samples) > 1 else 0.0,
            "samples": len(samples)}


def captured(calls: list) -> torch.cuda.CUDAGraph:
    """The calls in one CUDA graph, after two of them ran eagerly (compiled, scratch allocated)."""
    for call in calls[:2]:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return graph


def graph_per_call_us(calls: list) -> dict:
    """The calls captured in one CUDA graph; per-call mean of each timed replay (warm-up replays excluded)."""
    graph = captured(calls)
    samples = []
    for replay in range(GEMV_WARMUP + GEMV_REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if replay >= GEMV_WARMUP:
            samples.append(start.elapsed_time(end) * 1e3 / len(calls))
    del graph
    return stats(samples)


def events_per_call_us(calls: list) -> dict:
    """Each call between CUDA events (warm-up excluded), cycling through `calls`."""
    for index in range(GROUPED_WARMUP):
        calls[index % len(calls)]()
    torch.cuda.synchronize()
    samples = []
    for index in range(GROUPED_REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        calls[index % len(calls)]()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return stats(samples)


def grouped_inputs(device, tokens: int, hidden: int, experts: int, generator) -> list:
    """Two (x [T, D] bf16, top-k ids [T, k] of uniform random scores, softmax weights [T, k] bf16) sets: the
    grouped rows alternate between them, so no call reads the one before's activations from L2."""
    sets = []
    for _ in range(2):
        x = torch.randn(tokens, hidden, device=device, generator=generator).bfloat16()
        scores = torch.rand(tokens, experts, device=device, generator=generator)
        ids = scores.topk(K_TOP, dim=1).indices.to(torch.int32)
        weights = torch.softmax(torch.randn(tokens, K_TOP, device=device, generator=generator), dim=1).bfloat16()
        sets.append((x, ids, weights))
    return sets


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def compiled_since(jit_function, before: set) -> list:
    """CompiledKernels this JIT function cached since `before` (its keys then)."""
    found = []
    for caches in getattr(jit_function, "device_caches", {}).values():
        kernel_cache = caches[0] if isinstance(caches, tuple) else caches
        if isinstance(kernel_cache, dict):
            found.extend(kernel for key, kernel in kernel_cache.items() if key not in before)
    return found


def cache_keys(jit_function) -> set:
    keys = set()
    for caches in getattr(jit_function, "device_caches", {}).values():
        kernel_cache = caches[0] if isinstance(caches, tuple) else caches
        if isinstance(kernel_cache, dict):
            keys.update(kernel_cache)
    return keys


def loop_counts(kernels: list, weights_per_thread: float) -> dict | None:
    """Mean instructions per weight by pipe over the kernels' main loops (gate-up's and down's, the same
    loop); None when no SASS could be read (then the bound is the bytes alone, and the row says so)."""
    per_kernel = []
    for kernel in kernels:
        try:
            loop = sass_loops.main_loop(sass_loops.sass_of(kernel.asm["cubin"]))
        except (RuntimeError, KeyError, OSError) as error:
            print(f"  SASS unavailable: {error}", file=sys.stderr)
            return None
        if loop:
            per_kernel.append(sass_loops.per_weight(loop, weights_per_thread))
    if not per_kernel:
        return None
    return {pipe: statistics.mean(counts[pipe] for counts in per_kernel) for pipe in per_kernel[0]}


GROUPED_KERNELS = (trellis_grouped._trellis_gate_up_kernel, trellis_grouped._trellis_down_kernel)


def grouped_loop_counts(before: dict, schedule) -> dict | None:
    """{"gate_up": per-weight counts, "down": ...} of the grouped products compiled since `before` (kernel ->
    cache keys), a weight being one a thread decodes per K step (paid once per window); None without SASS."""
    counts = {}
    gate = trellis_grouped.gate_up_shapes(schedule)
    for label, kernel, shapes, block_n, tiles in (("gate_up", GROUPED_KERNELS[0], gate, gate.gate_up_block_n, 2),
                                                  ("down", GROUPED_KERNELS[1], schedule, schedule.down_block_n, 1)):
        counts[label] = loop_counts(compiled_since(kernel, before[kernel]),
                                    tiles * block_n * shapes.block_k / (32 * shapes.num_warps))
        if counts[label] is None:
            return None
    return counts


def block_shape(schedule: str) -> tuple:
    """What fixes a grouped product's rounding: its windows, blocks and K step (not its decode or registers)."""
    chosen = trellis_grouped.SCHEDULES[schedule]
    return chosen.block_m, chosen.gate_up_block_n, chosen.down_block_n, chosen.block_k


@dataclass
class Setup:
    """What one run measures on: the device and its ceilings, the shape, and the timers (bench/ on a GPU;
    tests/test_trellis_bench.py runs the same flow on a CPU, interpreted, at a small shape with host timers)."""

    device: torch.device
    name: str
    sms: int
    bandwidth: float  # bytes / s
    clock: Callable[[str], tuple[float, str]]  # note -> (SM clock in Hz, how it was read)
    graph_timer: Callable[[list], dict] = graph_per_call_us
    event_timer: Callable[[list], dict] = events_per_call_us
    experts: int = E
    hidden: int = D
    intermediate: int = F
    gemv_calls: int = GEMV_CALLS
    grouped_tokens: tuple = GROUPED_TOKENS
    codes: tuple = CODES
    gemv_schedules: tuple = tuple(trellis_gemv.SCHEDULES)
    grouped_schedules: tuple = trellis_grouped.SCHEDULE_NAMES
    gemv: bool = True  # part (i) (False: --grouped-only)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", str(REPO / "bench" / "results")))
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--gemv-only", action="store_true",
                      help="part (i) alone, each code at the default and the baseline schedule (no other "
                           "schedules, no grouped rows): a minute where the whole run takes several")
    only.add_argument("--grouped-only", action="store_true",
                      help="parts (ii) and (iii) alone (no n = 1 rows): about 2 minutes, most of it compiling")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("trellis_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    setup = Setup(device, torch.cuda.get_device_name(), torch.cuda.get_device_properties(device).multi_processor_count,
                  copy_bandwidth(device)["bytes_per_s"], sm_clock)
    if args.gemv_only:
        setup = dataclasses.replace(setup, gemv_schedules=(), grouped_tokens=())
    if args.grouped_only:
        setup = dataclasses.replace(setup, gemv=False)
    result = measure(setup)
    print(report(result))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "trellis_bench.json").write_text(json.dumps(result, indent=1, default=str))
    failed = result["failed"]
    print(f"\n{'CHECKS FAILED: ' + '; '.join(failed) if failed else 'all checks passed'}; "
          f"{result['seconds']:.0f} s; JSON in {out_dir / 'trellis_bench.json'}")
    return 1 if failed else 0


def measure(setup: Setup) -> dict:
    """Every row of the run (module docstring), as the JSON it writes; `failed` lists what did not pass."""
    started = time.time()
    device, sms, bandwidth = setup.device, setup.sms, setup.bandwidth
    E, D, F = setup.experts, setup.hidden, setup.intermediate  # noqa: N806 - the shape legend's names
    clock_before, clock_source = setup.clock("before")
    print(f"{setup.name}: {sms} SMs, copy {bandwidth / 1e12:.2f} TB/s, SM clock "
          f"{clock_before / 1e9:.3f} GHz ({clock_source}); commit {commit_label()}; torch {torch.__version__} "
          f"triton {triton.__version__}")
    generator = torch.Generator(device=device).manual_seed(0)
    w13_bf16 = torch.randn(E, 2 * F, D, device=device, dtype=torch.bfloat16, generator=generator).mul_(D ** -0.5)
    w2_bf16 = torch.randn(E, D, F, device=device, dtype=torch.bfloat16, generator=generator).mul_(F ** -0.5)
    stacks = {}
    for index, code in enumerate(setup.codes):
        trellis = TrellisCode.of(code, 2)
        stacks[code] = (random_trellis_matrix(E, 2 * F, D, trellis, seed=10 * index, device=device,
                                              row_block=hadamard_block(F)),
                        random_trellis_matrix(E, D, F, trellis, seed=10 * index + 1, device=device))
    first = setup.codes[0]
    packed_bytes = stacks[first][0].bytes_per_expert + stacks[first][1].bytes_per_expert
    failed = []
    result = {"device": setup.name, "sms": sms, "copy_bandwidth_bytes_per_s": bandwidth,
              "commit": commit_label(), "versions": {"torch": torch.__version__, "triton": triton.__version__},
              "shape": {"experts": E, "top_k": K_TOP, "hidden": D, "intermediate": F},
              "packed_bytes_per_expert": packed_bytes, "bf16_bytes_per_expert": 3 * D * F * 2}

    references: dict = {}  # (code, n) -> the MoE over dequantized experts (slow: computed once)

    def reference(code, x, ids, weights, tokens):
        if (code, tokens) not in references:
            references[(code, tokens)] = moe_trellis_rotated(x, *stacks[code], ids, weights)
        return references[(code, tokens)]

    # ---- (i) n = 1 ------------------------------------------------------------------------------
    gemv_rows, configs, bf16_gemv = [], [], None
    if setup.gemv:
        x1 = torch.randn(1, D, device=device, generator=generator).bfloat16()
        ids_sets = [torch.arange(6 * c, 6 * c + 6, device=device, dtype=torch.int32).view(1, K_TOP)
                    for c in range(setup.gemv_calls)]
        weights1 = torch.softmax(torch.randn(1, K_TOP, device=device, generator=generator), dim=1).bfloat16()
        ref_bf16 = moe_reference(x1, w13_bf16, w2_bf16, ids_sets[0], weights1).float()
        out = moe_gemv(x1, w13_bf16, w2_bf16, ids_sets[0], weights1)
        bf16_error = relative_error(out, ref_bf16)
        bf16_gemv = setup.graph_timer([lambda ids=ids: moe_gemv(x1, w13_bf16, w2_bf16, ids, weights1)
                                       for ids in ids_sets])
        bf16_gemv.update(rel_err=bf16_error, bound_us=(6 * 3 * D * F * 2 + 2 * D * 2) / bandwidth * 1e6)
        if not bf16_error <= TOLERANCE:
            failed.append(f"bf16 gemv rel err {bf16_error:.2e}")
        configs = [(code, trellis_gemv.default_schedule(TrellisCode.of(code, 2))) for code in setup.codes]
        configs += [(code, trellis_gemv.BASELINE_SCHEDULE) for code in setup.codes]  # old against new, every code
        configs += [(first, name) for name in setup.gemv_schedules if (first, name) not in configs]
    for code, schedule in configs:
        w13, w2 = stacks[code]
        chosen = trellis_gemv.SCHEDULES[schedule]
        kernel = trellis_gemv._trellis_gemv_steps_kernel if chosen.unrolled else trellis_gemv._trellis_gemv_kernel
        before = cache_keys(kernel)
        try:
            out = trellis_gemv.moe_trellis_gemv(x1, w13, w2, ids_sets[0], weights1, schedule=schedule)
            error = relative_error(out, reference(code, x1, ids_sets[0], weights1, 1))
            timing = setup.graph_timer([lambda ids=ids: trellis_gemv.moe_trellis_gemv(x1, w13, w2, ids, weights1,
                                                                                      schedule=schedule)
                                        for ids in ids_sets])
        except Exception as problem:  # noqa: BLE001 - a configuration that fails is a row, not a lost run
            failed.append(f"trellis gemv {code}/{schedule}: {type(problem).__name__}: {str(problem)[:200]}")
            gemv_rows.append({"code": code, "schedule": schedule, "error": failed[-1]})
            torch.cuda.synchronize()
            continue
        per_thread = chosen.block_tile_rows * chosen.block_tile_columns * 256 / (32 * chosen.num_warps)
        counts = loop_counts(compiled_since(kernel, before), per_thread)
        weights = 6 * 3 * D * F
        bytes_us = (6 * packed_bytes + 2 * D * 2) / bandwidth * 1e6
        gemv_rows.append({"code": code, "schedule": schedule, **timing, "rel_err": error, "bytes_bound_us": bytes_us,
                          "per_weight": counts, "weights": weights})
        if not error <= TOLERANCE:
            failed.append(f"trellis gemv {code}/{schedule} rel err {error:.2e}")

    # ---- (ii), (iii) n = 2048, 8192 ---------------------------------------------------------------
    grouped_rows = []
    grouped_counts: dict = {}  # (code, schedule run) -> {"gate_up": per-weight counts, "down": ...} or None
    for tokens in setup.grouped_tokens:
        sets = grouped_inputs(device, tokens, D, E, generator)
        x, ids, weights = sets[0]
        head = (x[:CHECK_TOKENS], ids[:CHECK_TOKENS], weights[:CHECK_TOKENS])
        out = moe_grouped(x, w13_bf16, w2_bf16, ids, weights)
        error = relative_error(out[:CHECK_TOKENS], moe_reference(*head[:1], w13_bf16, w2_bf16, *head[1:]))
        timing = setup.event_timer([lambda s=s: moe_grouped(s[0], w13_bf16, w2_bf16, s[1], s[2]) for s in sets])
        bf16 = {**timing, "rel_err": error}
        if not error <= TOLERANCE:
            failed.append(f"bf16 grouped n={tokens} rel err {error:.2e}")
        row = {"tokens": tokens, "bf16_grouped": bf16, "arms": []}
        pairs_per_expert = torch.bincount(ids.flatten().long(), minlength=E).cpu()
        configs = [("grouped", first, name) for name in setup.grouped_schedules]
        for code in setup.codes[1:]:  # the default, the pairs-per-expert pick and the tensor-form baseline
            for name in dict.fromkeys((trellis_grouped.DEFAULT_SCHEDULE, trellis_grouped.AUTO_SCHEDULE,
                                       trellis_grouped.BASELINE_SCHEDULE)):
                configs.append(("grouped", code, name))
        configs += [("dequant", first, trellis_grouped.DEFAULT_SCHEDULE)]
        outputs = {}
        for arm, code, schedule in configs:
            w13, w2 = stacks[code]
            function = trellis_grouped.moe_trellis_grouped if arm == "grouped" else trellis_grouped.moe_trellis_dequant
            resolved = trellis_grouped.resolve_schedule(schedule, tokens, K_TOP, E, w13.code.K, w13.code.needs_table)
            before = {kernel: cache_keys(kernel) for kernel in GROUPED_KERNELS}
            try:
                out = function(x, w13, w2, ids, weights, schedule=schedule)
                outputs[(arm, code, schedule)] = out.clone()
                error = relative_error(out[:CHECK_TOKENS], reference(code, *head, tokens))
                del out
                timing = setup.event_timer([lambda s=s: function(s[0], w13, w2, s[1], s[2], schedule=schedule)
                                             for s in sets])
            except Exception as problem:  # noqa: BLE001 - a configuration that fails is a row, not a lost run
                failed.append(f"trellis {arm} {code}/{schedule} n={tokens}: {type(problem).__name__}: "
                              f"{str(problem)[:200]}")
                row["arms"].append({"arm": arm, "code": code, "schedule": schedule, "error": failed[-1]})
                torch.cuda.synchronize()
                continue
            arm_row = {"arm": arm, "code": code, "schedule": schedule, "runs": resolved, **timing, "rel_err": error,
                       "x_bf16_grouped": timing["mean_us"] / bf16["mean_us"]}
            if arm == "grouped":
                chosen = trellis_grouped.SCHEDULES[resolved]
                if (code, resolved) not in grouped_counts:  # this run's SASS of the two products, once per build
                    grouped_counts[(code, resolved)] = grouped_loop_counts(before, chosen)
                arm_row["per_weight"] = grouped_counts[(code, resolved)]
                # a weight is decoded once per window (the gate-up's: once per part of one): sum over experts of
                # ceil(pairs / rows a program)
                part_rows = trellis_grouped.gate_up_shapes(chosen).block_m
                arm_row["windows"] = int(((pairs_per_expert + chosen.block_m - 1) // chosen.block_m).sum())
                parts = int(((pairs_per_expert + part_rows - 1) // part_rows).sum())
                arm_row["weights"] = {"gate_up": parts * 2 * F * D, "down": arm_row["windows"] * D * F}
            row["arms"].append(arm_row)
            if not error <= TOLERANCE:
                failed.append(f"trellis {arm} {code}/{schedule} n={tokens} rel err {error:.2e}")
        # the same weights, tiles and K order: every fused schedule with the dequantize arm's block shapes
        dequantized = outputs.get(("dequant", first, trellis_grouped.DEFAULT_SCHEDULE))
        shape, bits = block_shape(trellis_grouped.DEFAULT_SCHEDULE), stacks[first][0].code.K
        table = stacks[first][0].code.needs_table
        compared = [schedule for arm, code, schedule in outputs if arm == "grouped" and code == first
                    and block_shape(trellis_grouped.resolve_schedule(schedule, tokens, K_TOP, E, bits, table)) == shape]
        differing = [schedule for schedule in compared
                     if dequantized is None or not torch.equal(outputs[("grouped", first, schedule)], dequantized)]
        row["fused_equals_dequant"] = bool(compared) and not differing
        row["fused_equals_dequant_schedules"] = compared
        if not row["fused_equals_dequant"]:
            failed.append(f"n={tokens}: fused ({', '.join(differing) or 'none compared'}) and dequantize arms differ")
        del outputs, sets
        grouped_rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    clock_after, _ = setup.clock("after")
    clock = max(clock_before, clock_after)
    for row in gemv_rows:
        if "error" in row:
            continue
        if row["per_weight"] is not None:
            issue = sass_loops.issue_bound_us(row["per_weight"], row["weights"], sms, clock)
        else:
            issue = {"bound": 0.0, "limit": "no SASS"}
        row["issue_bound_us"], row["issue_limit"] = issue["bound"], issue["limit"]
        row["bound_us"] = max(row["bytes_bound_us"], issue["bound"])
        row["x_bound"] = row["mean_us"] / row["bound_us"]
        row["speedup_vs_bf16"] = bf16_gemv["mean_us"] / row["mean_us"]
    for row in grouped_rows:
        for arm in row["arms"]:
            if arm.get("per_weight"):  # the decode's issue time: both products' loops over their windows' weights
                bounds = [sass_loops.issue_bound_us(arm["per_weight"][label], arm["weights"][label], sms, clock)
                          for label in ("gate_up", "down")]
                arm["issue_bound_us"] = sum(bound["bound"] for bound in bounds)
                arm["x_issue_bound"] = arm["mean_us"] / arm["issue_bound_us"]
    result.update(sm_clock_hz={"before": clock_before, "after": clock_after, "source": clock_source},
                  bf16_gemv=bf16_gemv,
                  trellis_gemv=gemv_rows, grouped=grouped_rows, failed=failed, seconds=time.time() - started)

    return result


def report(result: dict) -> str:
    """The tables of `measure`'s result, as markdown."""
    lines = []
    clock = max(result["sm_clock_hz"]["before"], result["sm_clock_hz"]["after"])
    clock_before, clock_after = result["sm_clock_hz"]["before"], result["sm_clock_hz"]["after"]
    bf16_gemv, gemv_rows, grouped_rows = result["bf16_gemv"], result["trellis_gemv"], result["grouped"]
    if bf16_gemv is not None:
        lines.append(f"\n(i) n = 1, SM clock {clock / 1e9:.3f} GHz (before {clock_before / 1e9:.3f}, after "
                     f"{clock_after / 1e9:.3f})")
        lines.append(f"bf16 gemv: {bf16_gemv['mean_us']:.1f} +- {bf16_gemv['std_us']:.1f} us "
                     f"({bf16_gemv['mean_us'] / bf16_gemv['bound_us']:.2f}x its bytes bound "
                     f"{bf16_gemv['bound_us']:.1f} us)")
        lines.append("| code | schedule | us | vs bf16 gemv (target >= 3) | bytes bound | issue bound (limit) | x bound "
                     "(target <= 1.5) | instr/weight issue alu fma fmaheavy lsu | rel err |")
        lines.append("|---|---|---:|---:|---:|---:|---:|---|---:|")
    for row in gemv_rows:
        if "error" in row:
            lines.append(f"| {row['code']} | {row['schedule']} | failed: {row['error'][:100]} | | | | | | |")
            continue
        counts = row["per_weight"]
        pipes = " ".join(f"{counts[p]:.2f}" for p in ("issue", "alu", "fma", "fmaheavy", "lsu")) if counts else "-"
        lines.append(f"| {row['code']} | {row['schedule']} | {row['mean_us']:.1f} +- {row['std_us']:.1f} | "
                     f"{row['speedup_vs_bf16']:.2f}x | {row['bytes_bound_us']:.1f} | {row['issue_bound_us']:.1f} "
                     f"({row['issue_limit']}) | {row['x_bound']:.2f} | {pipes} | {row['rel_err']:.1e} |")
    lines.append(f"\n(ii)/(iii) grouped, target trellis <= 1.3x bf16 grouped (SM clock {clock / 1e9:.3f} GHz); decode "
                 "bound: the windows' weights times the loops' instructions (gate-up, down: issue / lsu per weight "
                 "per window, this run's SASS) at 4 a clock a SM")
    lines.append("| n | arm | code | schedule (runs) | us | x bf16 grouped | windows | decode bound us | x decode bound "
                 "| instr/weight gate-up, down | rel err (first 4 rows) |")
    lines.append("|---:|---|---|---|---:|---:|---:|---:|---:|---|---:|")
    for row in grouped_rows:
        bf16 = row["bf16_grouped"]
        lines.append(f"| {row['tokens']} | bf16 grouped v2 | - | - | {bf16['mean_us']:.0f} +- {bf16['std_us']:.0f} | "
                     f"1.00 | | | | | {bf16['rel_err']:.1e} |")
        for arm in row["arms"]:
            if "error" in arm:
                lines.append(f"| {row['tokens']} | trellis {arm['arm']} | {arm['code']} | {arm['schedule']} | "
                             f"failed: {arm['error'][:100]} | | | | | | |")
                continue
            runs = arm["schedule"] if arm["runs"] == arm["schedule"] else f"{arm['schedule']} ({arm['runs']})"
            bound = counts = windows = ""
            if arm.get("per_weight"):
                per_weight = arm["per_weight"]
                counts = ", ".join(f"{per_weight[label]['issue']:.2f} / {per_weight[label]['lsu']:.2f}"
                                   for label in ("gate_up", "down"))
            if "issue_bound_us" in arm:
                bound = f"{arm['issue_bound_us']:.0f} | {arm['x_issue_bound']:.2f}"
            else:
                bound = " | "
            if "windows" in arm:
                windows = str(arm["windows"])
            lines.append(f"| {row['tokens']} | trellis {arm['arm']} | {arm['code']} | {runs} | "
                         f"{arm['mean_us']:.0f} +- {arm['std_us']:.0f} | {arm['x_bf16_grouped']:.2f} | {windows} | "
                         f"{bound} | {counts} | {arm['rel_err']:.1e} |")
        compared = ", ".join(row.get("fused_equals_dequant_schedules", [])) or "none"
        lines.append(f"| {row['tokens']} | fused ({compared}) == dequantize bit for bit | | | | "
                     f"{row['fused_equals_dequant']} | | | | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RuntimeError as error:
        print(f"invalid measurement: {error}", file=sys.stderr)
        sys.exit(2)
