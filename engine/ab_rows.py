"""The rows of an A/B: what one run of a workload measured, per row, and whether the two sides measured the
same thing. Plain functions over the JSON each side's own checkout printed (`bench --format json`,
`sweep --json`, a session's results file), so a side may be an older tree whose code this module never
imports.

A `Sample` is one row of one run: a time (lower is better) and what the run says it measured (the row's
window state, the arms its counters show, the tokens it generated, how the time was taken). `refusal`
compares the samples of a row over every round of both sides and names what differs, or returns None:

- a row only one side measured;
- the window: a steady decode window on one side and admission (or prefill) on the other, or a side whose
  rounds disagree;
- the executed arms against what the side's flags claim (a forced `moe_gate`, `grouped_variant`,
  `flash_512=off`; a sweep row's arm): a CPU run executes the reference arms, so a side claiming the
  grouped arm there is refused, not compared;
- the tokens at temperature 0 (the bench's `tokens_crc32`, a session's tokens), unless the caller allows
  them to differ (two arms that round differently may flip a near-tie; the report then says so per row);
- the sweep's timing method (a CUDA-graph replay against a cold eager call) and its reference check.

Knows nothing of processes or statistics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MOE_ARMS = ("gemv", "grouped_v0", "grouped_v1", "grouped_v2", "torch_grouped_mm", "reference")
ATTENTION_ARMS = ("fused", "unfused")


# A bench row whose host is busy for at least this share of the step is host-bound: its speed is the Python
# process's, which varies from process to process (up to 2x on the H200 hosts), so one process per side measures
# one process's speed, and a fresh process per run (--fresh) is the A/B that samples it.
HOST_BOUND_SHARE = 0.5
HOST_BOUND_NOTE = "host-bound: the host's busy time per step"


@dataclass(frozen=True)
class Sample:
    value: float  # a time, lower is better (unit in `unit`)
    unit: str
    state: str = ""  # bench: steady / admitting / prefill; sweep: the timing method
    arms: dict = field(default_factory=dict)  # executed arm -> launches (counters), or the sweep arm -> 1
    tokens: object = None  # a digest or a token list; None when the run did not report them
    notes: tuple = ()
    check_failed: str = ""  # a reference check the run itself failed


# --------------------------------------------------------------------------------------------------
# What a side's flags claim it runs
# --------------------------------------------------------------------------------------------------

def claimed_arms(flags: dict) -> dict[str, set[str] | None]:
    """The arms a side's resolved flag values allow, per family (None: no claim). Only flags that pin an
    arm claim one: a forced `moe_gate` (gemv, grouped, reference), the grouped variant of any grouped arm,
    and `flash_512=off` (unfused attention only)."""
    gate = flags.get("moe_gate")
    variant = flags.get("grouped_variant")
    moe: set[str] | None = None
    if gate == "gemv":
        moe = {"gemv"}
    elif gate == "reference":
        moe = {"reference"}
    elif gate == "grouped":
        moe = {f"grouped_v{variant}"} if variant is not None else {"grouped_v0", "grouped_v1", "grouped_v2"}
    elif variant is not None:
        moe = set(MOE_ARMS) - {f"grouped_v{other}" for other in (0, 1, 2) if other != variant}
    attention = {"unfused"} if flags.get("flash_512") is False else None
    return {"moe": moe, "attention": attention}


def arm_mismatch(arms: dict, claims: dict) -> str:
    """'' when every arm with launches is one the claims allow, else what ran that should not have."""
    problems = []
    for family, names in (("moe", MOE_ARMS), ("attention", ATTENTION_ARMS)):
        allowed = claims.get(family)
        if allowed is None:
            continue
        ran = sorted(name for name in names if arms.get(name, 0) and name not in allowed)
        if ran:
            problems.append(f"{', '.join(ran)} ran where the flags claim {' or '.join(sorted(allowed))}")
    return "; ".join(problems)


# --------------------------------------------------------------------------------------------------
# Samples from each workload's output
# --------------------------------------------------------------------------------------------------

def bench_samples(report: dict, clock: str = "device") -> dict[str, Sample]:
    """Rows of `bench --format json`: µs per token (1e6 / t/s, mean over the run's repetitions) on the device
    clock where the row has one (`clock="device"`), else the wall clock; an admitting row has no time."""
    samples = {}
    for row in report.get("rows", []):
        rate, unit = None, ""
        if row.get("state") != "admitting":
            device, wall = row.get("tps_device"), row.get("tps_wall")
            chosen = device if clock == "device" and device else wall
            unit = "device µs/token" if chosen is device and device else "wall µs/token"
            rate = chosen["mean"] if chosen else None
        value = 1e6 / rate if rate and math.isfinite(rate) and rate > 0 else math.nan
        counters = row.get("counters", {})
        notes = []
        if counters.get("graph_replays"):
            notes.append(f"{counters['graph_replays']} graph replays")
        share = row.get("host_share")
        if isinstance(share, (int, float)) and math.isfinite(share) and share >= HOST_BOUND_SHARE:
            notes.append(f"{HOST_BOUND_NOTE} ({100 * share:.0f} % of the step)")
        samples[row["test"]] = Sample(value, unit, row.get("state", ""), dict(counters.get("arms", {})),
                                      row.get("tokens_crc32"), tuple(notes))
    return samples


def sweep_samples(result: dict, arms_by_tokens: dict[int, str] | None = None) -> dict[str, Sample]:
    """Rows of `sweep --json`: µs per call. With `arms_by_tokens` (n -> the arm this side's flags decide),
    one row per n, named `n=N` (each side's own arm); else one row per (n, arm), named `n=N arm`. A row's
    state is its timing method (`timing`; 'cold eager' for a sweep that predates it)."""
    samples = {}
    default_timing = result.get("timing", {}).get("method", "cold eager") if isinstance(result.get("timing"), dict) \
        else result.get("timing") or "cold eager"
    tolerance = result.get("check_tolerance", 1e-2)
    for row in result.get("rows", []):
        tokens = row["tokens"]
        chosen = row.get("arms", {})
        if arms_by_tokens is not None:
            wanted = arms_by_tokens.get(tokens)
            if wanted is None:
                continue
            picks = {f"n={tokens}": (wanted, chosen.get(wanted))}
        else:
            picks = {f"n={tokens} {arm}": (arm, entry) for arm, entry in chosen.items()}
        for name, (arm, entry) in picks.items():
            if entry is None or entry.get("us") is None:
                why = (entry or {}).get("unavailable", "the sweep has no time for it")
                samples[name] = Sample(math.nan, "µs/call", default_timing, {}, None, (f"{arm}: {why}",))
                continue
            error = entry.get("rel_err")
            failed = "" if error is not None and error <= tolerance else \
                f"{arm}'s relative error {error} against the reference exceeds {tolerance}"
            timing = entry.get("timing", default_timing)
            launched = ", ".join(f"{kernel}×{count}" for kernel, count in sorted(entry.get("launches_per_call", {}).items()))
            samples[name] = Sample(entry["us"], "µs/call", timing, {arm: 1}, None,
                                   (f"{arm}: {launched}",) if launched else (), failed)
    return samples


def session_samples(steps: list[dict]) -> dict[str, Sample]:
    """Rows of a session's results lines: each prompt or compare step's run per configuration (µs: the
    per-layer MoE + attention µs the run recorded, else its wall time) and each bench step's rows."""
    samples = {}
    for step in steps:
        label = f"step {step['step']} {step['action']}"
        for run in step.get("runs", []):
            timings = run.get("timings", {})
            layers = [timings.get(key) for key in ("moe_us", "attention_us") if timings.get(key) is not None]
            value, unit = (sum(layers), "layer µs") if layers else (timings.get("wall_s", math.nan) * 1e6, "wall µs")
            arms: dict = {}
            for entry in run.get("decisions", []):
                if "moe" in entry:
                    moe = entry["moe"]
                    name = moe["executed"] if moe["executed"] != "grouped" else f"grouped_v{moe.get('variant')}"
                    arms[name] = arms.get(name, 0) + 1
                if "attention" in entry:
                    name = entry["attention"]["executed"]
                    arms[name] = arms.get(name, 0) + 1
            samples[f"{label} [{run.get('config', 'base')}]"] = Sample(value, unit, "run", arms,
                                                                       tuple(run.get("tokens", ())))
        if step.get("action") == "bench":
            for name, sample in bench_samples(step.get("numbers", {})).items():
                samples[f"{label} {name}"] = sample
    return samples


# --------------------------------------------------------------------------------------------------
# Did both sides measure the same thing?
# --------------------------------------------------------------------------------------------------

def refusal(row: str, a: list[Sample | None], b: list[Sample | None], claims_a: dict, claims_b: dict,
            allow_different_tokens: bool = False) -> tuple[str, list[str]]:
    """(why the row is refused, or ''; notes) over the row's samples of every round (None: the run had no
    such row)."""
    notes: list[str] = []
    for side, samples in (("A", a), ("B", b)):
        if not samples or any(sample is None for sample in samples):
            missing = sum(1 for sample in samples if sample is None)
            return f"{side} did not measure this row in {missing} of {len(samples)} rounds", notes
    for side, samples in (("A", a), ("B", b)):
        states = sorted({sample.state for sample in samples})
        if len(states) > 1:
            return f"{side}'s rounds measured different things: {' and '.join(states)}", notes
        for sample in samples:
            if sample.check_failed:
                return f"{side} failed its reference check: {sample.check_failed}", notes
            if not (math.isfinite(sample.value) and sample.value > 0):
                detail = "; ".join((sample.state or "no state", *sample.notes))
                return f"{side} has no time for this row ({detail})", notes
    state_a, state_b = a[0].state, b[0].state
    if state_a != state_b:
        return f"A measured {describe_state(state_a)}, B {describe_state(state_b)}: not the same window", notes
    if a[0].unit != b[0].unit:
        return f"A's time is {a[0].unit}, B's {b[0].unit}: not the same clock", notes
    for side, samples, claims in (("A", a, claims_a), ("B", b, claims_b)):
        for sample in samples:
            mismatch = arm_mismatch(sample.arms, claims)
            if mismatch:
                return f"{side} executed other arms than it claims: {mismatch}", notes
    tokens = [sample.tokens for sample in (*a, *b)]
    if all(token is None for token in tokens):
        notes.append("tokens not compared: neither side's runs report them")
    elif any(token is None for token in tokens):
        notes.append("tokens not compared: one side's runs do not report them (an older tree)")
    elif len({repr(token) for token in tokens}) > 1:
        where = "between A and B" if {repr(s.tokens) for s in a} != {repr(s.tokens) for s in b} else "between rounds"
        if not allow_different_tokens:
            return f"different tokens at temperature 0 {where}: the sides did not compute the same thing " \
                   "(--allow-different-tokens compares them anyway)", notes
        notes.append(f"different tokens at temperature 0 {where} (allowed by --allow-different-tokens)")
    return "", notes


def describe_state(state: str) -> str:
    return {"steady": "a steady decode window", "admitting": "admission (no steady window)",
            "prefill": "a prefill window"}.get(state, state or "an unknown window")
