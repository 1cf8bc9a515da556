"""Per-layer µs of replayed CUDA-graph steps, read back from a profile of the run without touching its path.

A replayed kernel never passes through Python, so a replay's layers cannot be timed around their calls;
and events recorded inside the graph would cut the programmatic (PDL) edges between its kernels and slow
the step. Instead the run executes under torch.profiler (CUPTI: each kernel's device start and duration),
and each layer's arm is found again in the device timeline: every record lists the device kernels its arm
launched when the step was captured or run (`arm_kernels`, engine.dispatcher), and the records are in the
order the device ran them (steps in order; in a step, each layer's attention then its MoE). Walking the
timeline's kernels in start order, each record takes the next arm kernels, which must bear its arm's names in
its order; kernels of no arm (the norms, projections, RoPE, routing and LM head around the arms) are stepped
over. A
record whose arm launched nothing the profiler can name (a torch arm) is left as it is.

The walk is checked: every record's kernels must be found, in order, and no arm kernel may be left over at
the end; otherwise no replayed record gets a figure and the note says why (never a figure from a misread).
Knows nothing of the runtime: plain lists in, records updated in place.
"""

from __future__ import annotations

from collections.abc import Iterable

PROFILED = "profiled replay (CUPTI): the arm's kernels in the device timeline"


def _records_in_device_order(steps: list[dict]) -> Iterable[dict]:
    """Each step's layer records in the order its kernels ran: per layer, attention then MoE."""
    for step in steps:
        layers: dict[int, list[dict]] = {}
        for record in step["attention"]:
            layers.setdefault(record["layer"], []).append(record)
        for record in step["moe"]:
            layers.setdefault(record["layer"], []).append(record)
        for layer in sorted(layers):
            yield from layers[layer]


def attribute(steps: list[dict], kernels: list[tuple[str, float, float]]) -> str:
    """Fill `us` (and `us_method`) of every replayed layer record (`graph` == "replay") of `steps` from the
    profile's device kernels (name, start µs, duration µs). Records of eager steps keep what they measured;
    their kernels are walked over all the same. Returns a note: what was attributed, or why nothing was."""
    ordered = sorted(kernels, key=lambda kernel: kernel[1])
    arm_names = {name for step in steps for record in _records_in_device_order([step])
                 for name in record.get("arm_kernels") or ()}
    timeline = [kernel for kernel in ordered if kernel[0] in arm_names]
    position, pending = 0, []
    for record in _records_in_device_order(steps):
        names = record.get("arm_kernels") or []
        if not names:
            continue
        total = 0.0
        for name in names:
            found = timeline[position][0] if position < len(timeline) else "the end of the profile"
            if found != name:
                return (f"per-layer µs of replayed steps not attributed: step {record['step']} layer "
                        f"{record['layer']}'s arm launched {name}, but the profile's next arm kernel is {found}")
            total += timeline[position][2]
            position += 1
        if record.get("graph") == "replay":
            pending.append((record, total))
    if position != len(timeline):
        return (f"per-layer µs of replayed steps not attributed: {len(timeline) - position} arm kernels of the profile "
                f"are left over after the run's records (the profile holds work of another run)")
    for record, total in pending:
        record["us"], record["us_method"] = round(total, 1), PROFILED
    return f"{len(pending)} replayed layer records timed from the profile"
