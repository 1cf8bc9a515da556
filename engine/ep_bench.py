"""The bench's view of an expert-parallel run (engine.expert_parallel): the exchange's share of a step, and its
bound from the all-to-all bandwidth this group measures in the same run.

- `measure_bandwidth(group, device)`: `all_to_all_single` of a large buffer (each rank sending `megabytes` to
  the others in equal parts), warm-up then timed repetitions between barriers; bytes a rank sends to its peers
  over the median time, in GB/s. The bound of a step's exchange is its bytes over this.
- `repetition_exchange(steps)`: over a repetition's steps, rank 0's exchange µs and bytes per step (every MoE
  layer's dispatch, combine and gather) against the steps' wall time.

Knows nothing of rows' tables; engine.bench calls both and prints what they return.
"""

from __future__ import annotations

import statistics
import time

import torch

BANDWIDTH_REPS = 5


def measure_bandwidth(group, device: torch.device, megabytes: int | None = None) -> dict:
    """All-to-all bandwidth per rank of `group` (module docstring): {"GBps", "bytes_per_rank", "reps", "method"}.
    Default size: 256 MiB per rank on GPUs (past NVLink's latency-bound range), 8 MiB on CPUs."""
    import torch.distributed as dist

    megabytes = megabytes or (256 if device.type == "cuda" else 8)
    ranks = group.size
    elements = (megabytes << 20) // 4 // ranks * ranks  # fp32 elements, a multiple of the ranks
    send = torch.randn(elements, device=device)
    receive = torch.empty_like(send)
    peers_bytes = send.numel() * 4 * (ranks - 1) // ranks  # what leaves this rank (its own part stays)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    for repetition in range(2 + BANDWIDTH_REPS):
        dist.barrier(group=group.group)
        synchronize()
        started = time.perf_counter()
        dist.all_to_all_single(receive, send, group=group.group)
        synchronize()
        if repetition >= 2:
            times.append(time.perf_counter() - started)
    median = statistics.median(times)
    return {"GBps": round(peers_bytes / median / 1e9, 2), "bytes_per_rank": send.numel() * 4,
            "reps": BANDWIDTH_REPS,
            "method": f"all_to_all_single of {megabytes} MiB per rank, median of {BANDWIDTH_REPS} after 2 warm-up, "
                      f"between barriers; bytes to the {ranks - 1} peers / time"}


def repetition_exchange(steps: list[dict]) -> dict:
    """Rank 0's exchange over one repetition's steps: µs and bytes (summed over its MoE layers), the steps' wall µs."""
    exchange_us = exchange_bytes = 0.0
    wall_us = sum((step["ended"] - step["started"]) * 1e6 for step in steps)
    for step in steps:
        for record in step["moe"]:
            exchange = record.get("ep", {}).get("exchange")
            if exchange is None:
                continue
            exchange_bytes += exchange["bytes"]
            exchange_us += (exchange["dispatch"]["us"] or 0.0) + (exchange["combine"]["us"] or 0.0)
    return {"steps": len(steps), "exchange_us": exchange_us, "exchange_bytes": exchange_bytes, "wall_us": wall_us}


def row_exchange(repetitions: list[dict], bandwidth: dict | None) -> dict:
    """A row's exchange over its timed repetitions: µs and bytes per step, its share of the steps' wall time, and
    its bound (bytes over the measured bandwidth) with the measured µs over that bound."""
    steps = sum(rep["steps"] for rep in repetitions) or 1
    us = sum(rep["exchange_us"] for rep in repetitions) / steps
    moved = sum(rep["exchange_bytes"] for rep in repetitions) / steps
    wall = sum(rep["wall_us"] for rep in repetitions) / steps
    summary = {"us_per_step": round(us, 1), "bytes_per_step": round(moved), "step_us": round(wall, 1),
               "share": round(us / wall, 4) if wall else None}
    if bandwidth and bandwidth.get("GBps"):
        bound = moved / (bandwidth["GBps"] * 1e9) * 1e6
        summary["bound_us"] = round(bound, 2)
        summary["over_bound"] = round(us / bound, 2) if bound else None
    return summary


def markdown_lines(rows: list[dict], footer: dict) -> list[str]:
    """The rows' exchange lines and the group's bandwidth, for the bench's markdown (empty on one device)."""
    parallel = footer.get("expert_parallel")
    if not parallel:
        return []
    lines = ["", f"expert parallel: {parallel['ep']} ranks ({parallel['backend']}), {parallel['local_experts']} experts "
                 f"per rank; exchange = rank 0's all-to-all dispatch, combine and gather of every MoE layer "
                 f"(its wait for the slowest rank included), per step, over the timed repetitions:"]
    bandwidth = parallel.get("bandwidth")
    for data in rows:
        exchange = data.get("exchange")
        if not exchange:
            continue
        bound = (f"; bound {exchange['bound_us']:.1f} µs at {bandwidth['GBps']:.1f} GB/s "
                 f"({exchange['over_bound']:.1f}x)" if exchange.get("bound_us") else "")
        share = "n/a" if exchange["share"] is None else f"{100 * exchange['share']:.1f} %"
        lines.append(f"- {data['test']}: {exchange['us_per_step']:.0f} µs/step of {exchange['step_us']:.0f} "
                     f"({share}), {exchange['bytes_per_step'] / 1e6:.3f} MB/step{bound}")
    if bandwidth:
        lines.append(f"bandwidth: {bandwidth['GBps']:.2f} GB/s per rank ({bandwidth['method']})")
    return lines
