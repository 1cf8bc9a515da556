"""One arm, one number: the GEMV arm at n = 1 on v4-shape as the sweep times it (cold, and the runtime's way)
beside what the same two kernels cost inside the runtime's graphed decode step, in one run on one GPU.

Prints, for the same arm (`gemv`: moe_gemv's gate-up and down), the same shape (E=256, top-6, D=4096, F=2048,
bf16) and n = 1:
    sweep --timing cold    one eager call after a 2x-L2 clean read and a spin (the sweep's figure until now)
    sweep --timing graph   back-to-back calls in one CUDA-graph replay (the sweep's default now)
    graph_call_us          the same inputs every call, 10 calls per graph (bench/moe_gemv_blocks.py's method),
                           and the same with the sweep's 4 rotating uniform routings
    runtime                a profiled v4-shape tg32 @ b1 (bench --profile, graphs of one step): the two kernels'
                           adds µs/step (what they add to the step's device span) and their own µs per call;
                           its routing is recorded (record_routing) and its distinct experts counted
    sweep --routing        the sweep's graph timing on that recording (windows of the runtime's own routing):
                           the sweep timing the arm the runtime's way, on the runtime's inputs
    sweep --timing neighbours   the same arm between the runtime's router and next norm (engine.sweep_neighbours),
                           uniform and on the recording: what it adds to them, the profile's definition
and the ratios of each figure to the runtime's adds (target: the sweep's graph figure on the runtime's routing
within 5 %; the uniform rows say by how much a uniform routing differs). An unprofiled tg32 @ b1 with the same
seed runs first to record the routing (greedy decoding: the profiled run routes the same), then the sweeps and
graph timings, and the profiled bench last: a profiler session slows the process's CUDA calls for good.

    python3 bench/sweep_vs_runtime.py      # ~1-2 minutes on an H200; JSON to $OUT/sweep_vs_runtime.json
Exit 0 when the graph figure on the runtime's routing is within 5 % of the runtime's, 1 when not, 2 for an invalid measurement.
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


def sweep_us(timing: str, scratch: Path, routing: Path | None = None) -> float:
    """The sweep's gemv figure at n = 1: its uniform row, or (with `routing`) the recorded layer's row."""
    result = run_sweep(SweepConfig(model="v4-shape", tokens=(1,), arms=("gemv",), timing=timing, routing=routing,
                                   calibration=scratch / f"calibration-{timing}.json"))
    row = result["rows"][0] if routing is None else result["routing"]["layers"][0]["rows"][0]
    entry = row["arms"]["gemv"]
    if entry.get("timing") != timing:
        raise MeasurementError(f"the sweep timed gemv {entry.get('timing')}, not {timing}: {entry.get('timing_note')}")
    torch.cuda.empty_cache()
    return entry["us"]


def v4_gemv_inputs(rotations: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    """v4-shape experts (E=256, D=4096, F=2048, bf16) and `rotations` one-token uniform top-6 routings (x, ids,
    bf16 weights), drawn on the GPU from seed 0: the inputs of blocks_us (and bench/experiments/sweep_spacing.py)."""
    E, D, F, K = 256, 4096, 2048, 6
    generator = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * F, D, generator=generator, device="cuda") / 64).bfloat16()
    w2 = (torch.randn(E, D, F, generator=generator, device="cuda") / 45).bfloat16()
    sets = [(torch.randn(1, D, generator=generator, device="cuda").bfloat16(),
             torch.randperm(E, generator=generator, device="cuda")[:K].view(1, K).int(),
             torch.softmax(torch.randn(1, K, generator=generator, device="cuda"), -1).bfloat16())
            for _ in range(rotations)]
    return w13, w2, sets


def blocks_us(rotations: int = 1) -> float:
    """bench/moe_gemv_blocks.py's method: one routing (or `rotations` uniform ones, cycled as the sweep cycles
    its sets), 10 calls per graph."""
    from kernels.moe_gemv import moe_gemv

    w13, w2, sets = v4_gemv_inputs(rotations)
    counter = iter(range(1 << 62))

    def call():
        x, ids, weights = sets[next(counter) % rotations]
        return moe_gemv(x, w13, w2, ids, weights)

    us = bench.graph_call_us(call, calls=10 if rotations == 1 else 3 * rotations)
    del w13, w2
    torch.cuda.empty_cache()
    return us


def _runtime_row(record: bool, profile: bool):
    config = from_name("v4-shape")
    device = torch.device("cuda")
    weights = bench.device_random_weights(config, 0, device, torch.bfloat16)
    engine = Engine(config, device, 0, weights=weights)
    settings = ["moe_gate=gemv"] + (["record_routing=on"] if record else [])
    flags = registry.resolve(settings)  # the arm under test on every step, whatever the calibration says
    report = bench.run_bench(engine, flags, bench.row_specs([], [32], [1], 32), 1, profile=profile)
    del engine, weights
    torch.cuda.empty_cache()
    return config, report.rows[0]


def record_routing(path: Path) -> dict:
    """The runtime's routing of tg32 @ b1 (unprofiled, same seed as runtime_us) saved to `path`, and how many
    distinct experts its steps woke."""
    from engine import routing_file

    _, row = _runtime_row(record=True, profile=False)
    if row.routing is None:
        raise MeasurementError("the runtime's row recorded no routing")
    routing_file.save(row.routing, path)
    ids = routing_file.load(path).ids  # [tokens, MoE layers, k]
    steps = [{int(e) for e in ids[t, 0]} for t in range(ids.shape[0])]
    shared = [len(steps[t] & steps[t - 1]) for t in range(1, len(steps))]
    return {"distinct_experts": len({int(e) for e in ids.reshape(-1)}), "recorded_tokens": int(ids.shape[0]),
            "shared_with_previous_step": statistics.fmean(shared) if shared else None}


def runtime_us() -> dict:
    """The profiled runtime row: the two kernels' adds µs per step and own µs per call."""
    config, row = _runtime_row(record=False, profile=True)
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
    recording = scratch / "routing.safetensors"
    routing = record_routing(recording)
    figures = {
        "cold": sweep_us("cold", scratch),
        "graph": sweep_us("graph", scratch),
        "graph_again": sweep_us("graph", scratch),  # twice: the spread of the sweep's own figure
        "graph_recorded": sweep_us("graph", scratch, routing=recording),
        "graph_recorded_again": sweep_us("graph", scratch, routing=recording),
        "neighbours": sweep_us("neighbours", scratch),
        "neighbours_recorded": sweep_us("neighbours", scratch, routing=recording),
        "same_inputs": blocks_us(),
        "rotating_inputs": blocks_us(rotations=4),
    }
    runtime = runtime_us()
    reference = runtime["adds_us"]
    ratios = {name: us / reference for name, us in figures.items()}
    ratios["own_time"] = runtime["own_us"] / reference
    labels = {
        "cold": "sweep --timing cold, uniform",
        "graph": "sweep --timing graph, uniform",
        "graph_again": "sweep --timing graph, uniform",
        "graph_recorded": "sweep graph, runtime's steps in order",
        "graph_recorded_again": "sweep graph, runtime's steps in order",
        "neighbours": "sweep --timing neighbours, uniform",
        "neighbours_recorded": "sweep neighbours, runtime's steps",
        "same_inputs": "graph_call_us, one routing",
        "rotating_inputs": "graph_call_us, 4 uniform",
    }
    print(f"GEMV arm, n = 1, v4-shape, {torch.cuda.get_device_name()}, commit {commit_label()}")
    for name, us in figures.items():
        print(f"  {labels[name]:<34} {us:8.2f} us   {ratios[name]:.3f} x runtime")
    shared = routing["shared_with_previous_step"]
    print(f"  runtime: adds to the step          {reference:8.2f} us   (gate-up + down, profiled tg32 @ b1; its "
          f"{routing['recorded_tokens']} tokens woke {routing['distinct_experts']} distinct experts, a step "
          f"{'?' if shared is None else f'{shared:.2f}'} of its experts the step before it woke)")
    print(f"  runtime: own time per call         {runtime['own_us']:8.2f} us   {ratios['own_time']:.3f} x (PDL: "
          "includes each kernel's wait for the one before)")
    worst = max(abs(ratios["graph_recorded"] - 1), abs(ratios["graph_recorded_again"] - 1))
    uniform = statistics.median([ratios["graph"], ratios["graph_again"]])
    verdict = "within" if worst <= TARGET else "NOT within"
    print(f"  the sweep's graph timing on the runtime's routing vs the runtime: {verdict} {100 * TARGET:.0f} % "
          f"(worst {100 * worst:.1f} %)")
    between = abs(ratios["neighbours_recorded"] - 1)
    print(f"  the sweep's neighbours timing (router before, next norm after) on the runtime's routing: "
          f"{'within' if between <= TARGET else 'NOT within'} {100 * TARGET:.0f} % ({100 * between:.1f} %)")
    print(f"  on a uniform routing the sweep reads {uniform:.3f} x: each call wakes 6 experts no call before it woke "
          f"(graph_call_us with 4 rotating uniform routings: {ratios['rotating_inputs']:.3f} x, one routing "
          f"{ratios['same_inputs']:.3f} x)")
    out = Path(os.environ.get("OUT", REPO / "bench" / "results" / "latest"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep_vs_runtime.json").write_text(json.dumps(
        {"commit": commit_label(), "device": torch.cuda.get_device_name(), "figures_us": figures, "runtime": runtime,
         "runtime_routing": routing, "ratios": ratios, "target": TARGET, "within": worst <= TARGET,
         "neighbours_within": between <= TARGET},
        indent=1, default=str))
    return 0 if worst <= TARGET else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (MeasurementError, UserError) as error:
        print(f"sweep_vs_runtime: invalid measurement: {error}", file=sys.stderr)
        sys.exit(2)
