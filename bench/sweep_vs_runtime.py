"""One arm, one number: the GEMV arm at n = 1 on v4-shape as the sweep times it (cold, and the runtime's way)
beside what the same two kernels cost inside the runtime's graphed decode step, in one run on one GPU.

Prints, for the same arm (`gemv`: moe_gemv's gate-up and down), the same shape (E=256, top-6, D=4096, F=2048,
bf16) and n = 1:
    sweep --timing cold    one eager call after a 2x-L2 clean read and a spin (the sweep's figure until now)
    sweep --timing graph   back-to-back calls in one CUDA-graph replay (the sweep's default now)
    graph_call_us          the same inputs every call, 10 calls per graph (bench/moe_gemv_blocks.py's method)
    runtime                a profiled v4-shape tg32 @ b1 (bench --profile, graphs of one step): the two kernels'
                           adds µs/step (what they add to the step's device span) and their own µs per call
and the ratios of each sweep figure to the runtime's adds (target: graph within 5 %). The sweeps run first: a
profiler session slows the process's CUDA calls for good (engine.bench), and the profiled bench runs last.

    python3 bench/sweep_vs_runtime.py      # ~1-2 minutes on an H200; JSON to $OUT/sweep_vs_runtime.json
Exit 0 when the graph figure is within 5 % of the runtime's, 1 when not, 2 for an invalid measurement.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from engine import bench  # noqa: E402
from engine import flags as registry  # noqa: E402
from engine.config import from_name  # noqa: E402
from engine.errors import MeasurementError, UserError  # noqa: E402
from engine.provenance import commit_label  # noqa: E402
from engine.runtime import Engine  # noqa: E402
from engine.sweep import SweepConfig, run_sweep  # noqa: E402

TARGET = 0.05
KERNELS = ("_gate_up_kernel", "_down_kernel")  # kernels.moe_gemv's two launches


def sweep_us(timing: str, scratch: Path) -> float:
    result = run_sweep(SweepConfig(model="v4-shape", tokens=(1,), arms=("gemv",), timing=timing,
                                   calibration=scratch / f"calibration-{timing}.json"))
    entry = result["rows"][0]["arms"]["gemv"]
    if entry.get("timing") != timing:
        raise MeasurementError(f"the sweep timed gemv {entry.get('timing')}, not {timing}: {entry.get('timing_note')}")
    torch.cuda.empty_cache()
    return entry["us"]


def blocks_us() -> float:
    """bench/moe_gemv_blocks.py's method: one routing, 10 calls per graph."""
    from kernels.moe_gemv import moe_gemv

    E, D, F, K = 256, 4096, 2048, 6
    generator = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * F, D, generator=generator, device="cuda") / 64).bfloat16()
    w2 = (torch.randn(E, D, F, generator=generator, device="cuda") / 45).bfloat16()
    x = torch.randn(1, D, generator=generator, device="cuda").bfloat16()
    ids = torch.randperm(E, generator=generator, device="cuda")[:K].view(1, K).int()
    weights = torch.softmax(torch.randn(1, K, generator=generator, device="cuda"), -1).bfloat16()
    us = bench.graph_call_us(lambda: moe_gemv(x, w13, w2, ids, weights), calls=10)
    del w13, w2
    torch.cuda.empty_cache()
    return us


def runtime_us() -> dict:
    config = from_name("v4-shape")
    device = torch.device("cuda")
    weights = bench.device_random_weights(config, 0, device, torch.bfloat16)
    engine = Engine(config, device, 0, weights=weights)
    flags = registry.resolve(["moe_gate=gemv"])  # the arm under test on every step, whatever the calibration says
    report = bench.run_bench(engine, flags, bench.row_specs([], [32], [1], 32), 1, profile=True)
    row = report.rows[0]
    entries = {entry["kernel"]: entry for entry in row.profile or []}
    missing = [name for name in KERNELS if name not in entries]
    if missing:
        raise MeasurementError(f"the profiled decode step has no {', '.join(missing)} (kernels: {sorted(entries)})")
    layers = config.n_layers
    adds = sum(entries[name].get("critical_us_per_step", float("nan")) for name in KERNELS) / layers
    own = sum(entries[name]["us_per_call"] for name in KERNELS)
    arms = row.counters["arms"]
    if set(name for name, count in arms.items() if count and name in ("gemv", "grouped_v0", "grouped_v1",
                                                                       "grouped_v2", "reference")) != {"gemv"}:
        raise MeasurementError(f"the decode steps did not run the gemv arm alone: {arms}")
    return {"adds_us": adds, "own_us": own, "note": row.profile_note,
            "kernels": {name: entries[name] for name in KERNELS}}


def main() -> int:
    if not torch.cuda.is_available():
        print("sweep_vs_runtime: needs a CUDA GPU", file=sys.stderr)
        return 2
    scratch = Path(tempfile.mkdtemp(prefix="moei-sweep-vs-runtime-"))
    cold = sweep_us("cold", scratch)
    graph = sweep_us("graph", scratch)
    again = sweep_us("graph", scratch)  # twice: the spread of the sweep's own figure, beside the ratio
    same_inputs = blocks_us()
    runtime = runtime_us()
    reference = runtime["adds_us"]
    ratios = {"cold": cold / reference, "graph": graph / reference, "graph_again": again / reference,
              "same_inputs": same_inputs / reference, "own_time": runtime["own_us"] / reference}
    print(f"GEMV arm, n = 1, v4-shape, {torch.cuda.get_device_name()}, commit {commit_label()}")
    print(f"  sweep --timing cold           {cold:8.2f} us   {ratios['cold']:.3f} x runtime")
    print(f"  sweep --timing graph          {graph:8.2f} us   {ratios['graph']:.3f} x runtime")
    print(f"  sweep --timing graph (again)  {again:8.2f} us   {ratios['graph_again']:.3f} x runtime")
    print(f"  graph_call_us, same inputs    {same_inputs:8.2f} us   {ratios['same_inputs']:.3f} x runtime")
    print(f"  runtime: adds to the step     {reference:8.2f} us   (gate-up + down, profiled tg32 @ b1)")
    print(f"  runtime: own time per call    {runtime['own_us']:8.2f} us   {ratios['own_time']:.3f} x (PDL: includes "
          "each kernel's wait for the one before)")
    worst = max(abs(ratios["graph"] - 1), abs(ratios["graph_again"] - 1))
    verdict = "within" if worst <= TARGET else "NOT within"
    print(f"  graph vs runtime: {verdict} {100 * TARGET:.0f} % (worst {100 * worst:.1f} %)")
    out = Path(os.environ.get("OUT", REPO / "bench" / "results" / "latest"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep_vs_runtime.json").write_text(json.dumps(
        {"commit": commit_label(), "device": torch.cuda.get_device_name(), "cold_us": cold, "graph_us": [graph, again],
         "same_inputs_us": same_inputs, "runtime": runtime, "ratios": ratios,
         "graph_median_us": statistics.median([graph, again]), "target": TARGET, "within": worst <= TARGET},
        indent=1, default=str))
    return 0 if worst <= TARGET else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (MeasurementError, UserError) as error:
        print(f"sweep_vs_runtime: invalid measurement: {error}", file=sys.stderr)
        sys.exit(2)
