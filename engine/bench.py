"""Benchmarks that cannot silently measure nothing: llama-bench rows over the batched engine.

Rows (one per test and batch size B; `@ bB` is left off at B = 1):
    ppN        B sequences, each an N-token prompt and one generated token: prompt tokens / the
               time from the first prefill step's start to the end of the step that finished
               the last prompt.
    tgN        B sequences, each a short prompt then N generated tokens: generated tokens / time
               inside the steady window (below), or `admitting` when there is none.
Each row runs a warm-up repetition (compilation, graph capture) that is excluded, then `reps`
timed ones: t/s is their mean +- sample stddev, llama-bench style.

The rules, each enforced here rather than trusted:
- Refusal: a repetition with zero prompt tokens, fewer tokens than asked, zero time or a
  non-finite rate raises MeasurementError (exit 2) before anything is printed.
- Stamps: each step is stamped before it runs (engine.runtime), so a request that finishes inside
  the step that processed it (every pp request) still has a start time.
- Two clocks: wall (perf_counter around whole steps) and device (CUDA events around each step's
  work, summed over the window). On a CPU there is no separate device clock: "n/a", not a copy
  of the wall clock. Disagreement over 5 % is flagged.
- Steady state: a decode rate only from the window in which every sequence is admitted and has at
  least `depth_floor` generated tokens, while the whole cohort still decodes
  (`steady_window`, a plain function over a timeline). Aggregate generated tokens/s in 2-second
  bins over the whole run give the trajectory.
- Counters: every row carries each arm's launch counter, the Triton kernel launches and the
  CUDA-graph replays of its timed repetitions.
- Profile: kernel-level device time, calls, share of the window's device time and launches per
  step from torch.profiler over the same window of one extra repetition per row, run once every
  row's timed repetitions are done (a profiler session leaves the process's CUDA calls slower, so
  nothing is timed after one); an empty profile is an error, not a table of zeros.

Knows nothing of argument parsing or of the TUI: `run_bench` returns a report; `format_*` print it.
"""

from __future__ import annotations

import csv
import io
import json
import collections
import math
import platform
import random
import statistics
import time
import zlib
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterable

import torch

from engine.errors import MeasurementError, UserError
from engine.model import tensor_shapes
from engine.provenance import commit_label

CLOCK_TOLERANCE = 0.05  # wall and device clocks may differ by this fraction before a row is flagged
TRAJECTORY_BIN_S = 2.0
SPARK = "▁▂▃▄▅▆▇█"
TIME_SOURCE: Callable[[], float] = time.perf_counter  # tests replace it to inject timings


# --------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RowSpec:
    kind: str  # "pp" or "tg"
    tokens: int  # N: prompt tokens (pp) or generated tokens (tg)
    batch: int
    prompt_len: int
    max_tokens: int

    @property
    def name(self) -> str:
        return f"{self.kind}{self.tokens}" + (f" @ b{self.batch}" if self.batch > 1 else "")


def row_specs(pp: Iterable[int], tg: Iterable[int], batches: Iterable[int], tg_prompt: int) -> list[RowSpec]:
    batches = list(batches)
    rows = [RowSpec("pp", n, b, n, 1) for n in pp for b in batches]
    rows += [RowSpec("tg", n, b, tg_prompt, n) for n in tg for b in batches]
    return rows


def default_depth_floor(generated: int) -> int:
    """8 generated tokens per sequence, or a quarter of the row's tokens when that is fewer."""
    return min(8, max(1, generated // 4))


def prompts_for(spec: RowSpec, seed: int, repetition: int, vocab_size: int) -> list[list[int]]:
    """Distinct, deterministic prompts: identical rows would route identically and wake fewer experts."""
    prompts = []
    for index in range(spec.batch):
        generator = random.Random(zlib.crc32(f"{seed}:{spec.name}:{repetition}:{index}".encode()))
        prompts.append([generator.randrange(vocab_size) for _ in range(spec.prompt_len)])
    return prompts


# --------------------------------------------------------------------------------------------
# Steady state and the trajectory: plain functions over a timeline
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepEvent:
    started: float
    ended: float
    emitted: tuple[int, ...]  # request ids that received a token in this step
    # False for a later step of a graph of several steps (steps_per_graph): computed with the launch's first
    # step, its tokens reach the host at that step's sync, before the step's own `ended`
    opens_launch: bool = True


@dataclass(frozen=True)
class SteadyWindow:
    first: int  # index of the first event inside the window
    last: int  # index of the last event inside the window
    started: float  # the end of the event at which every sequence reached the floor
    ended: float
    tokens: int

    @property
    def seconds(self) -> float:
        return self.ended - self.started

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else math.nan


def steady_window(events: list[StepEvent], request_ids: Iterable[int], depth_floor: int) -> SteadyWindow | None:
    """The window in which every sequence is admitted and has >= depth_floor generated tokens and
    the whole cohort still decodes; None while any sequence is still admitting (then a row says
    `admitting`, never a number). It opens at the end of the step where the last sequence reached
    the floor and closes at the last step in which every sequence received a token. Where that step is
    inside a graph of several steps (steps_per_graph), the window's steps begin after the graph's last
    step and its time at the end of the graph's first: the tokens of all a graph's steps reach the host
    at that step's sync, after which the next launch, already in flight, runs; a window opening inside
    the graph would count tokens with no time, one opening at its last step's end would miss the time
    the next launch ran while the host served the graph's later steps."""
    wanted = set(request_ids)
    depth = dict.fromkeys(wanted, 0)
    opening = None
    for index, event in enumerate(events):
        for request_id in event.emitted:
            if request_id in depth:
                depth[request_id] += 1
        if min(depth.values(), default=0) >= depth_floor:
            opening = index
            break
    if opening is None:
        return None
    while opening + 1 < len(events) and not events[opening + 1].opens_launch:
        opening += 1
    synced = opening  # the step whose sync brought the opening step's tokens: its launch's first
    while synced > 0 and not events[synced].opens_launch:
        synced -= 1
    last, tokens = None, 0
    for index in range(opening + 1, len(events)):
        if not wanted <= set(events[index].emitted):
            break
        last, tokens = index, tokens + sum(1 for request_id in events[index].emitted if request_id in wanted)
    if last is None:
        return None
    return SteadyWindow(opening + 1, last, events[synced].ended, events[last].ended, tokens)


def trajectory(events: list[StepEvent], origin: float, bin_s: float = TRAJECTORY_BIN_S) -> list[float]:
    """Aggregate generated tokens/s in bins of `bin_s` seconds from `origin` to the last step's end
    (the last bin is divided by the part of it the run covered)."""
    if not events or not all(math.isfinite(event.ended) for event in events) or not math.isfinite(origin):
        return []
    end = max(event.ended for event in events)
    count = max(1, math.ceil((end - origin) / bin_s - 1e-9))
    tokens = [0] * count
    for event in events:  # a step ending on a boundary belongs to the bin it ends
        index = math.ceil((event.ended - origin) / bin_s - 1e-9) - 1
        tokens[min(count - 1, max(0, index))] += len(event.emitted)
    rates = []
    for index, total in enumerate(tokens):
        covered = min(bin_s, end - (origin + index * bin_s))
        rates.append(total / covered if covered > 0 else 0.0)
    return rates


def sparkline(values: list[float]) -> str:
    top = max(values, default=0.0)
    if top <= 0:
        return SPARK[0] * len(values)
    return "".join(SPARK[min(len(SPARK) - 1, int(value / top * (len(SPARK) - 1) + 0.5))] for value in values)


# --------------------------------------------------------------------------------------------
# One repetition: measured, or refused
# --------------------------------------------------------------------------------------------

@dataclass
class Repetition:
    wall_s: float
    device_s: float | None
    tokens: int
    ttft_s: float  # mean over the sequences
    steady: SteadyWindow | None = None
    steps: int = 0  # steps inside the measured window
    # per step, mean over the window: launched ahead, the host's busy time per step; else start to launch
    host_us: float | None = None
    host_us_p50: float | None = None  # the same, the median over the window's steps: the mean less its slow tail
    host_us_p90: float | None = None
    device_us: float | None = None  # per step, mean over the window
    graph_steps: int = 0  # window steps served by a graph replay
    graph_launches: int = 0  # the launches that ran them (fewer with steps_per_graph > 1)
    trajectory: list[float] = field(default_factory=list)
    trajectory_span_s: float = 0.0  # from the first arrival to the last step's end: the trajectory's x extent
    window_steps: list[int] = field(default_factory=list)  # step numbers inside the window
    phases: dict[str, int] = field(default_factory=dict)  # the repetition's steps by phase (prefill, mixed, decode)
    latencies: dict[str, list[float]] = field(default_factory=dict)  # request_latencies of its sequences

    @property
    def device_rate(self) -> float | None:
        return None if not self.device_s else self.tokens / self.device_s


def _refuse(spec: RowSpec, label: str, reason: str) -> None:
    raise MeasurementError(f"{spec.name}, {label}: {reason}; refusing to print a number (no table)")


def _quantile(values: list[float], q: float) -> float:
    """The q-quantile of `values` (linear between the two nearest ranks); the value itself for one."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms")


def request_latencies(sequences) -> dict[str, list[float]]:
    """vllm bench's three latencies in ms, from the sequences' time stamps: per request its TTFT (arrival to
    first token) and TPOT (first to last token over the tokens after the first), and every inter-token gap
    (ITL). A request with one generated token has no TPOT and no gaps."""
    ttft, tpot, itl = [], [], []
    for sequence in sequences:
        times = sequence.token_times
        ttft.append((sequence.first_token_at - sequence.arrived_at) * 1e3)
        if len(times) > 1:
            tpot.append((times[-1] - times[0]) / (len(times) - 1) * 1e3)
            itl += [(later - earlier) * 1e3 for earlier, later in zip(times, times[1:])]
    return {"ttft_ms": ttft, "tpot_ms": tpot, "itl_ms": itl}


def latency_summary(values: list[float]) -> dict | None:
    """mean ± sample stddev and p50/p90/p99 (linear between ranks) of one latency over every request of
    every timed repetition; None when there is none (a pp row has no TPOT or ITL)."""
    if not values:
        return None
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "p50": _quantile(values, 0.5), "p90": _quantile(values, 0.9), "p99": _quantile(values, 0.99),
            "count": len(values)}


def events_of(steps: list[dict]) -> list[StepEvent]:
    return [StepEvent(step["started"], step["ended"],
                      tuple(row["request_id"] for row in step["rows"] if row["emitted"] is not None),
                      not step.get("span_index"))
            for step in steps]


def measure(spec: RowSpec, sequences: list, steps: list[dict], depth_floor: int, label: str = "rep",
            bin_s: float = TRAJECTORY_BIN_S) -> Repetition:
    """One repetition's numbers from its sequences (time stamps, tokens) and step records, or a
    MeasurementError naming what makes it invalid."""
    asked_prompt = spec.prompt_len * spec.batch
    prompt_tokens = sum(row["tokens"] for step in steps for row in step["rows"] if row.get("prefill", step["phase"] == "prefill"))
    if spec.kind == "pp" and prompt_tokens == 0:
        _refuse(spec, label, "zero prompt tokens were processed")
    if prompt_tokens < asked_prompt:
        _refuse(spec, label, f"{prompt_tokens} prompt tokens processed, fewer than the {asked_prompt} asked")
    if len(sequences) != spec.batch:
        _refuse(spec, label, f"{len(sequences)} sequences ran, fewer than the {spec.batch} asked")
    for sequence in sequences:
        if len(sequence.generated) < spec.max_tokens:
            _refuse(spec, label, f"request {sequence.request_id} generated {len(sequence.generated)} tokens, "
                                 f"fewer than the {spec.max_tokens} asked")
        if None in (sequence.arrived_at, sequence.first_scheduled_at, sequence.first_token_at):
            _refuse(spec, label, f"request {sequence.request_id} has no time stamp for its first step or token")
    ttft = statistics.fmean(sequence.first_token_at - sequence.arrived_at for sequence in sequences)
    latencies = request_latencies(sequences)
    events = events_of(steps)
    origin = min(sequence.arrived_at for sequence in sequences)
    bins = trajectory(events, origin, bin_s)
    finite = [event.ended for event in events if math.isfinite(event.ended)]
    span = max(finite) - origin if finite and math.isfinite(origin) else 0.0  # where the last bin ends
    phases = dict(collections.Counter(step["phase"] for step in steps))

    if spec.kind == "pp":
        window = [step for step in steps if step["phase"] in ("prefill", "mixed")]
        tokens = prompt_tokens
        wall = max(sequence.first_token_at for sequence in sequences) - min(step["started"] for step in window)
        steady = None
    else:
        request_ids = [sequence.request_id for sequence in sequences]
        steady = steady_window(events, request_ids, depth_floor)
        if steady is None:
            return Repetition(0.0, None, 0, ttft, None, trajectory=bins, trajectory_span_s=span, phases=phases,
                              latencies=latencies)
        window = steps[steady.first:steady.last + 1]
        tokens, wall = steady.tokens, steady.seconds
    if tokens <= 0:
        _refuse(spec, label, "zero tokens inside the measured window")
    if not wall > 0 and not math.isnan(wall):
        _refuse(spec, label, f"zero time: the window measured {wall:.3g} s")
    rate = tokens / wall if wall else math.nan
    if not math.isfinite(rate) or rate <= 0:
        _refuse(spec, label, f"the rate is {rate} (tokens {tokens}, time {wall} s), not a finite positive number")
    device_values = [step["device_us"] for step in window]
    device_s = None if any(value is None for value in device_values) else sum(device_values) / 1e6
    if device_s is not None and not device_s > 0:
        _refuse(spec, label, f"zero device time over {len(window)} steps")
    host_values = [step["host_us"] for step in window]
    return Repetition(
        wall_s=wall, device_s=device_s, tokens=tokens, ttft_s=ttft, steady=steady, steps=len(window),
        host_us=statistics.fmean(host_values), host_us_p50=statistics.median(host_values),
        host_us_p90=_quantile(host_values, 0.9), device_us=None if device_s is None else device_s * 1e6 / len(window),
        graph_steps=sum(step["graph"] == "replay" for step in window),
        graph_launches=sum(step["graph"] == "replay" and not step.get("span_index") for step in window),
        trajectory=bins, trajectory_span_s=span, window_steps=[step["step"] for step in window], phases=phases,
        latencies=latencies)


# --------------------------------------------------------------------------------------------
# Rows over repetitions
# --------------------------------------------------------------------------------------------

def mean_std(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "values": values}


def _add_counts(total: dict, counters: dict) -> None:
    for family in ("arms", "kernels"):
        for name, count in counters.get(family, {}).items():
            total[family][name] = total[family].get(name, 0) + count
    total["graph_replays"] += counters.get("graph_replays", 0)
    total["graph_launches"] += counters.get("graph_launches", 0)


@dataclass
class Row:
    spec: RowSpec
    repetitions: list[Repetition]
    counters: dict  # summed over the timed repetitions
    depth_floor: int
    profile: list[dict] | None = None
    profile_note: str = ""
    # crc32 of every timed repetition's generated tokens, in order: an A/B (engine.ab_rows) refuses a row whose
    # two sides computed different tokens at temperature 0
    tokens_crc32: int | None = None
    # With the flag record_routing: the last timed repetition's routing (engine.routing_record), never in the JSON
    routing: object = field(default=None, repr=False)
    exchange: dict | None = None  # an expert-parallel run's exchange per step (engine.ep_bench.row_exchange)

    @property
    def admitting(self) -> bool:
        return self.spec.kind == "tg" and any(rep.steady is None for rep in self.repetitions)

    def to_json(self) -> dict:
        reps = self.repetitions
        payload = {"test": self.spec.name, "kind": self.spec.kind, "tokens": self.spec.tokens,
                   "batch": self.spec.batch, "prompt_tokens": self.spec.prompt_len,
                   "generated_tokens": self.spec.max_tokens, "reps": len(reps), "depth_floor": self.depth_floor,
                   "counters": self.counters, "ttft_ms": mean_std([rep.ttft_s * 1e3 for rep in reps]),
                   "trajectory": {"bin_s": TRAJECTORY_BIN_S, "tokens_per_s": reps[-1].trajectory,
                                  "span_s": reps[-1].trajectory_span_s, "phases": reps[-1].phases},
                   "tokens_crc32": self.tokens_crc32,
                   "latency": {name: latency_summary([value for rep in reps for value in rep.latencies.get(name, ())])
                               for name in LATENCIES}}
        if self.admitting:
            payload.update(state="admitting", tps_wall=None, tps_device=None, clock_disagreement=None,
                           clock_flag=False, ms_per_token=None, ms_per_step=None)
        else:
            wall = [rep.tokens / rep.wall_s for rep in reps]
            device = None if any(rep.device_s is None for rep in reps) else [rep.tokens / rep.device_s for rep in reps]
            disagreement = None
            if device is not None:
                disagreement = max(abs(rep.wall_s - rep.device_s) / rep.wall_s for rep in reps)
            payload.update(
                state="prefill" if self.spec.kind == "pp" else "steady",
                tps_wall=mean_std(wall), tps_device=None if device is None else mean_std(device),
                clock_disagreement=disagreement,
                clock_flag=disagreement is not None and disagreement > CLOCK_TOLERANCE,
                ms_per_token=1e3 / statistics.fmean(wall),
                ms_per_step=statistics.fmean(rep.wall_s / rep.steps * 1e3 for rep in reps),
                window_steps=statistics.fmean(rep.steps for rep in reps),
                host_us_per_step=statistics.fmean(rep.host_us for rep in reps),
                host_us_p50=statistics.fmean(rep.host_us_p50 for rep in reps),
                host_us_p90=statistics.fmean(rep.host_us_p90 for rep in reps),
                device_us_per_step=None if device is None else statistics.fmean(rep.device_us for rep in reps),
                graph_steps=sum(rep.graph_steps for rep in reps),
                graph_launches=sum(rep.graph_launches for rep in reps))
            if payload["device_us_per_step"]:
                payload["host_share"] = payload["host_us_per_step"] / payload["device_us_per_step"]
        if self.profile is not None:
            payload["profile"] = {"note": self.profile_note, "kernels": self.profile}
        if self.exchange is not None:
            payload["exchange"] = self.exchange
        return payload


# --------------------------------------------------------------------------------------------
# Kernel shares from a profile: a plain function over events
# --------------------------------------------------------------------------------------------

def kernel_shares(kernels: list[tuple[str, float, float]], step_ranges: dict[int, tuple[float, float]],
                  window: set[int], window_device_us: float | None, run_steps: int = 0) -> tuple[list[dict], str]:
    """Per-kernel device time, calls, share and launches per step over the window's steps.

    kernels: (name, start_us, duration_us) device events; step_ranges: step -> (start_us, end_us)
    of each step on the host, in the profiler's clock (a step ends after its sync, so its kernels
    start inside it). Without a window or step ranges every kernel of the run (`run_steps` steps)
    counts and the note says so. An empty profile is a MeasurementError, never a table of zeros."""
    if not kernels:
        raise MeasurementError("--profile: the profiler recorded no device kernels (no CUDA activity: a CPU run, "
                               "or a profiler without CUPTI); refusing to print a table of zeros")
    if window and step_ranges:
        note, steps = f"steps {min(window)}-{max(window)} ({len(window)} steps)", len(window)
        inside = [(start, end) for step, (start, end) in step_ranges.items() if step in window]
        chosen = [kernel for kernel in kernels if any(start <= kernel[1] <= end for start, end in inside)]
    else:
        why = "no measured window: the run was admitting" if not window else "no step markers in the profile"
        note, steps, chosen = f"whole run ({why})", max(1, run_steps or len(step_ranges)), kernels
        window_device_us = None  # the window's device time does not cover the whole run
    if not chosen:
        raise MeasurementError(f"--profile: no device kernel started inside the measured window ({note})")
    totals: dict[str, list[float]] = {}
    for name, _, duration in chosen:
        entry = totals.setdefault(name, [0.0, 0])
        entry[0] += duration
        entry[1] += 1
    busy = sum(entry[0] for entry in totals.values())
    denominator = window_device_us if window_device_us else busy
    ranges = [range_ for step, range_ in step_ranges.items() if step in window] if window and step_ranges else []
    by_step = _step_kernels(chosen, ranges)
    sites = _per_site_us(by_step)
    critical = _critical_path_us(by_step)
    rows = [{"kernel": name, "device_us": round(total, 1), "calls": calls, "us_per_call": round(total / calls, 2),
             "share": total / denominator, "launches_per_step": calls / steps}
            | ({"critical_us_per_step": round(critical[name][0], 2)} if name in critical else {})
            | ({"us_per_call_by_site": sites[name]} if name in sites else {})
            | ({"critical_us_by_site": [round(value, 2) for value in critical[name][1:]]}
               if name in sites and name in critical else {})
            for name, (total, calls) in sorted(totals.items(), key=lambda item: -item[1][0])]
    return rows, note


def _step_kernels(kernels: list[tuple[str, float, float]], ranges: list[tuple[float, float]]
                  ) -> list[list[tuple[str, float, float]]]:
    """Each step's kernels (those starting inside its host range; a step ends after its sync), in start order."""
    return [sorted((kernel for kernel in kernels if start <= kernel[1] <= end), key=lambda kernel: kernel[1])
            for start, end in sorted(ranges)]


def _critical_path_us(by_step: list[list[tuple[str, float, float]]]) -> dict[str, list[float]]:
    """What each kernel adds to a step's device span, per step (mean over the steps of `by_step`), in total
    and at each of its sites (the i-th launch of it in a step): the step's kernels in start order, the first
    adding its own duration and each later one its end minus the latest end before it (never below 0).
    Kernels on one stream end in launch order, so the additions sum to the step's span from its first
    kernel's start to its last one's end. Unlike a kernel's own time, this stays a share of the step when
    programmatic dependent launch starts a kernel while the one before it runs (its time then includes that
    wait), and it charges a launch gap to the kernel that waited for it. name -> [total, site 1, site 2, ...]."""
    added: dict[str, list[float]] = {}
    for step in by_step:
        previous_end, seen = None, {}
        for name, begin, duration in step:
            finish = begin + duration
            gain = duration if previous_end is None else max(0.0, finish - previous_end)
            previous_end = finish if previous_end is None else max(previous_end, finish)
            site = seen[name] = seen.get(name, 0) + 1
            entry = added.setdefault(name, [0.0])
            entry.extend([0.0] * (site + 1 - len(entry)))
            entry[0] += gain
            entry[site] += gain
    return {name: [total / len(by_step) for total in entry] for name, entry in added.items()}


def _per_site_us(step_kernels: list[list[tuple[str, float, float]]]) -> dict[str, list[float]]:
    """For a kernel launched several times in every step of the window, the same number of times in
    each, its mean µs per call at each site: the i-th launch of it within a step (in start order), so
    one kernel serving several call sites (a GEMV for q/k/v, the router and the LM head) shows what
    each costs. Kernels with one launch per step, or a count that differs between steps, get none."""
    by_step: list[dict[str, list[float]]] = []
    for step in step_kernels:
        launched: dict[str, list[float]] = {}
        for name, _, duration in step:
            launched.setdefault(name, []).append(duration)
        by_step.append(launched)
    sites: dict[str, list[float]] = {}
    for name in set(kernels_name for step in by_step for kernels_name in step):
        counts = {len(step.get(name, ())) for step in by_step}
        if len(counts) == 1 and (count := counts.pop()) > 1:
            sites[name] = [round(sum(step[name][site] for step in by_step) / len(by_step), 2) for site in range(count)]
    return sites


def _profile_events(prof) -> tuple[list[tuple[str, float, float]], dict[int, tuple[float, float]]]:
    kernels, steps = [], {}
    for event in prof.events():
        name = event.name
        if name.startswith("moei.step."):
            if event.device_type == torch.autograd.DeviceType.CPU:
                steps[int(name.rsplit(".", 1)[1])] = (event.time_range.start, event.time_range.end)
            continue
        if event.device_type == torch.autograd.DeviceType.CUDA and not getattr(event, "is_user_annotation", False):
            kernels.append((name, event.time_range.start, event.time_range.elapsed_us()))
    return kernels, steps


# --------------------------------------------------------------------------------------------
# The bound and the copy bandwidth (the decode targets)
# --------------------------------------------------------------------------------------------

def active_weight_bytes(config, element_bytes: int) -> dict:
    """Weights one decode token reads: every dense weight, k of E experts, one embedding row (the whole
    embedding when it is also the output head, tied)."""
    experts = dense = 0
    for name, shape in tensor_shapes(config).items():
        elements = math.prod(shape)
        if name.endswith(("w13", "w2")):
            experts += elements * config.top_k // config.n_experts
        elif name == "embed" and not config.tie_embeddings:
            dense += shape[1]
        else:
            dense += elements
    return {"experts": experts * element_bytes, "dense": dense * element_bytes,
            "total": (experts + dense) * element_bytes}


def graph_call_us(fn, calls: int, warmup: int = 2, replays: int = 5) -> float:
    """Per-call device time of `fn` in microseconds: `calls` calls captured in one CUDA graph, the
    median over `replays` replays (CUDA events), divided by `calls`. The steady per-call figure of a
    kernel inside a larger graph, without one launch's ramp at each end. GPU only."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    value = statistics.median(samples)
    if not (math.isfinite(value) and value > 0):
        raise MeasurementError(f"a CUDA-graph timing gave {value} us per call: not a measurement")
    return value


def copy_bandwidth(device: torch.device) -> dict:
    """Device-to-device copy bandwidth, (read + write) bytes / time, measured now."""
    cuda = device.type == "cuda"
    size = (1 << 30) if cuda else (64 << 20)
    if cuda:
        size = min(size, torch.cuda.mem_get_info(device)[0] // 4)
    source = torch.empty(size // 4, dtype=torch.float32, device=device).fill_(1.0)
    target = torch.empty_like(source)
    target.copy_(source)
    repeats = 10 if cuda else 3
    if cuda:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(repeats):
            target.copy_(source)
        end.record()
        end.synchronize()
        seconds = begin.elapsed_time(end) / 1e3
    else:
        started = time.perf_counter()
        for _ in range(repeats):
            target.copy_(source)
        seconds = time.perf_counter() - started
    moved = 2 * source.numel() * 4 * repeats
    del source, target
    return {"bytes_per_s": moved / seconds, "buffer_bytes": size,
            "clock": "CUDA events" if cuda else "wall (CPU)"}


# --------------------------------------------------------------------------------------------
# The harness
# --------------------------------------------------------------------------------------------

@dataclass
class Report:
    model: str
    device: str
    rows: list[Row]
    footer: dict
    targets: dict

    def to_json(self) -> dict:
        return {"model": self.model, "device": self.device, "rows": [row.to_json() for row in self.rows],
                "targets": self.targets, "footer": self.footer}


def run_bench(engine, flags, specs: list[RowSpec], reps: int, *, graphs: bool | None = None,
              profile: bool = False, depth_floor: int | None = None, token_budget: int | None = None,
              progress=None, weights_note: str = "", clock: Callable[[], float] | None = None,
              on_row: Callable[[Row], None] | None = None, trace=None) -> Report:
    """Every row: one warm-up repetition and `reps` timed ones; with `profile`, then one profiled repetition
    per row, all after the last timed one (a profiler session slows the process's CUDA calls for good).
    `on_row` is called with each row once its timed repetitions are done (before any profile: the TUI
    shows rows as they arrive). Raises MeasurementError (exit 2) on the first invalid repetition; nothing
    is printed here. `trace` (an engine.trace.Trace) receives every repetition's steps and, with `profile`, the
    profiled repetition's kernels."""
    from engine.batch_runner import BatchRunner

    if reps < 1:
        raise UserError(f"--reps must be >= 1, got {reps}")
    for spec in specs:
        engine.check_length(list(range(spec.prompt_len)), spec.max_tokens)
    clock = clock or TIME_SOURCE
    rows, profiled = [], []
    group = getattr(engine, "expert_group", None)
    bandwidth = None
    if group is not None:  # the exchange's bound: this group's all-to-all bandwidth, measured before the rows
        from engine import ep_bench

        bandwidth = ep_bench.measure_bandwidth(group, engine.device)
    for spec in specs:
        exchanges = []
        floor = depth_floor if depth_floor is not None else default_depth_floor(spec.max_tokens)
        runner = BatchRunner(engine, spec.batch, spec.prompt_len + spec.max_tokens - 1, graphs, run_ahead=flags["run_ahead"])
        repetitions, counts = [], {"arms": {}, "kernels": {}, "graph_replays": 0, "graph_launches": 0}
        tokens_crc = 0
        routing = None
        run_once = partial(_run_once, engine, flags, spec, runner, token_budget, clock)
        for repetition in range(reps + 1):
            result = run_once(repetition)
            label = "warm-up" if repetition == 0 else f"rep {repetition}"
            measured = measure(spec, result.sequences, result.steps, floor, label)
            if trace is not None:
                trace.add_run(flags.describe(), f"{spec.name} {label}", result.steps)
            if repetition > 0:  # the warm-up (compilation, graph capture) is excluded
                repetitions.append(measured)
                _add_counts(counts, result.counters)
                tokens_crc = zlib.crc32(repr([list(s.generated) for s in result.sequences]).encode(), tokens_crc)
                routing = result.routing
                if group is not None:
                    exchanges.append(ep_bench.repetition_exchange(result.steps))
            if progress is not None:
                progress.advance(note=f"{spec.name} {label}")
        row = Row(spec, repetitions, counts, floor, tokens_crc32=tokens_crc, routing=routing,
                  exchange=ep_bench.row_exchange(exchanges, bandwidth) if group is not None else None)
        row.counters["steps"] = sum(rep.steps for rep in repetitions)
        row.counters["graphs"] = runner.graphs_note
        if runner.block_notes:  # steps_per_graph asked for a graph this runner could not capture: say so
            row.counters["graph_notes"] = sorted(set(runner.block_notes.values()))
        if profile:
            profiled.append((row, runner, run_once, floor))
        rows.append(row)
        del runner
        if on_row is not None:
            on_row(row)
    # Every profiled repetition after every timed one: a torch.profiler session leaves the process's CUDA
    # calls slower for good (bench/experiments/probe_launch.py; bench/RESULTS.md, "Host time per decode step"),
    # so a row timed after another row's profile would carry that cost in its host time.
    for row, runner, run_once, floor in profiled:
        traced = {} if trace is None else {"traced": partial(trace.add_profiled, flags.describe())}
        row.profile, row.profile_note = _profiled_repetition(row.spec, runner, run_once, reps + 1, floor, **traced)
        if progress is not None:
            progress.advance(note=f"{row.spec.name} profile")
    del profiled
    targets = _targets(engine, rows)
    foot = footer(engine, flags, graphs_note(engine, graphs, flags), weights_note)
    if bandwidth is not None:
        foot["expert_parallel"]["bandwidth"] = bandwidth
    return Report(engine.config.name, engine.device_label, rows, foot, targets)


def _run_once(engine, flags, spec: RowSpec, runner, token_budget, clock, repetition: int):
    """One repetition of a row: its prompts (fresh per repetition) through `generate_batch` on its runner."""
    prompts = prompts_for(spec, engine.seed, repetition, engine.config.vocab_size)
    return engine.generate_batch(prompts, spec.max_tokens, flags, runner=runner, token_budget=token_budget,
                                 clock=clock, timed=False)


def _profiled_repetition(spec: RowSpec, runner, run_once, repetition: int, floor: int,
                         traced: Callable | None = None) -> tuple[list[dict], str]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if runner.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    runner.label_steps = True
    try:
        with profile(activities=activities) as prof:
            result = run_once(repetition)
    finally:
        runner.label_steps = False
    kernels, step_ranges = _profile_events(prof)
    if traced is not None:
        traced(f"{spec.name} profiled rep", result.steps, kernels, step_ranges)
    measured = measure(spec, result.sequences, result.steps, floor, "profiled rep")
    window = set(measured.window_steps)
    device_us = None if measured.device_s is None else measured.device_s * 1e6
    rows, note = kernel_shares(kernels, step_ranges, window, device_us, len(result.steps))
    return rows, profile_note(note, runner.device)


def profile_note(note: str, device: torch.device) -> str:
    """What a kernel-share table's heading says of its profile; with programmatic dependent launch on, that
    a kernel's span starts at its early launch (kernels.pdl), so spans overlap and add to more than the step."""
    from kernels import pdl

    note = f"{note} of one extra repetition under torch.profiler (not in the timings)"
    if pdl.enabled(device):
        note += ("; programmatic dependent launch on: a kernel launches while the one before it runs and its time "
                 "includes that wait, so the times overlap and add up to more than the step (pdl=off: without)")
    return note


# The project's tg128 @ b1 targets, by the model's name (a preset, or a checkpoint directory's): the ratio to the
# active-weight bound. Other models get the bound and no target.
DECODE_TARGETS = {"v4-shape": 1.3, "qwen3-30b-a3b": 1.35, "deepseek-v2-lite": 1.4}


def decode_target(model_name: str) -> float | None:
    """The tg128 @ b1 target ratio for a model named `model_name` ("family:name" or a preset's name), or None."""
    return DECODE_TARGETS.get(model_name.rsplit(":", 1)[-1].lower())


def _targets(engine, rows: list[Row]) -> dict:
    """The decode targets, printed for the batch-1 decode rows: the ratio to the weight-bandwidth
    bound, and host time per decode step as a share of its device time."""
    singles = [row for row in rows if row.spec.kind == "tg" and row.spec.batch == 1 and not row.admitting]
    if not singles:
        return {}
    element_bytes = torch.empty((), dtype=engine.dtype).element_size()
    weights = active_weight_bytes(engine.config, element_bytes)
    bandwidth = copy_bandwidth(engine.device)
    bound = bandwidth["bytes_per_s"] / weights["total"]
    targets = {"active_weight_bytes_per_token": weights, "copy_bandwidth": bandwidth, "rows": []}
    for row in singles:
        data = row.to_json()
        measured = data["tps_wall"]["mean"]
        entry = {"test": row.spec.name, "tps": measured, "bound_tps": bound, "ratio_to_bound": bound / measured,
                 "target_ratio": decode_target(engine.config.name), "host_us_per_step": data["host_us_per_step"],
                 "host_us_p50": data.get("host_us_p50"), "host_us_p90": data.get("host_us_p90"),
                 "device_us_per_step": data["device_us_per_step"], "host_share": data.get("host_share"),
                 "target_host_share": 0.20, "graph_steps": data["graph_steps"],
                 "graph_launches": data["graph_launches"],
                 "window_steps": data["window_steps"] * len(row.repetitions),
                 # what the host costs the critical path: the wall step beyond the device step (the device
                 # idle, waiting on the host), beside the host's busy time, which may run under the device
                 "wall_us_per_step": data["ms_per_step"] * 1e3}
        if data["device_us_per_step"]:
            waits = entry["wall_us_per_step"] - data["device_us_per_step"]
            entry.update(device_waits_us_per_step=waits, device_waits_share=max(0.0, waits) / entry["wall_us_per_step"])
        targets["rows"].append(entry)
    return targets


def graphs_note(engine, graphs: bool | None, flags=None) -> str:
    """How the decode steps launched, in words, as `flags` (None: the registry's defaults and environment) decide."""
    if engine.device.type != "cuda":
        return "off (CPU: no CUDA graphs)"
    if getattr(engine, "expert_group", None) is not None:
        return "off (expert parallel: each MoE layer reads its exchange's sizes on the host)"
    if graphs is False:
        return "off (--graphs off)"
    from engine.flags import from_environment, launch_settings
    from kernels import pdl

    flags = flags if flags is not None else from_environment()
    launch = launch_settings(flags)
    return ("on for decode steps" + ("; run-ahead on: a steady cohort's next replay launches before the step's "
                                      "sync, two in flight (run_ahead=off turns it off)" if flags["run_ahead"]
                                      else "; run-ahead off")
            + ("; programmatic dependent launch on (pdl=off turns it off)" if pdl.enabled(engine.device, launch)
               else "")
            + (f"; {_preloading(engine.device, launch)} load their first weight tile before that wait (pdl_preload=off "
               "turns it off)" if pdl.preload(engine.device, launch=launch) else ""))


def _preloading(device, launch) -> str:
    """Which kernels preload under PDL (kernels.pdl.preload), in words."""
    from kernels import pdl

    names = {"gemv": "the dense GEMVs", "down": "MoE down", "fused": "the router's and the LM head's fused GEMVs",
             "trellis": "the trellis GEMV's products"}
    chosen = [names[kernel] for kernel in pdl.PRELOADERS if pdl.preload(device, kernel, launch)]
    return ", ".join(chosen[:-1]) + (" and " if len(chosen) > 1 else "") + chosen[-1]


def footer(engine, flags, graphs: str, weights_note: str) -> dict:
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        versions["triton"] = "absent"
    try:
        import numpy

        versions["numpy"] = numpy.__version__
    except ImportError:
        versions["numpy"] = "absent"
    if engine.device.type == "cuda":
        versions["cuda"] = torch.version.cuda
    return {
        "commit": commit_label(), "device": engine.device_label, "versions": versions,
        "model": engine.config.name, "dtype": str(engine.dtype).replace("torch.", ""), "flags": flags.describe(),
        "graphs": graphs, "decode_glue": engine.decode_glue,
        "weights": weights_note or f"random, seed {engine.seed}, drawn on the CPU",
        **({"checkpoint": engine.checkpoint} if getattr(engine, "checkpoint", None) else {}),
        **({"expert_parallel": engine.expert_parallel_summary()}
           if getattr(engine, "expert_group", None) is not None else {}),
        "clocks": ("wall = perf_counter around whole steps; device = CUDA events around each step's work"
                   if engine.device.type == "cuda" else
                   "wall = perf_counter around whole steps; device = n/a (a CPU has no separate device clock)"),
    }


def device_random_weights(config, seed: int, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Weights drawn on the GPU from a seeded CUDA generator per tensor (engine.model.random_weights_on):
    seconds instead of the CPU draw's minutes at v4-shape width. For timing only: they are NOT the weights
    `random_weights` gives on the CPU, and the report says so."""
    from engine.model import random_weights_on

    return random_weights_on(config, seed, device, dtype)


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------

ARM_COLUMNS = (("gemv", "gemv"), ("grouped_v0", "grp0"), ("grouped_v1", "grp1"), ("grouped_v2", "grp2"),
               ("torch_grouped_mm", "tgmm"), ("reference", "ref"), ("fused", "fused"), ("unfused", "unfused"))


def spread_cell(stats: dict, digits: int = 2) -> str:
    """'mean ± stddev' of a mean_std or latency_summary; 'mean ± n/a' over one value, which has no spread (the
    stored std of 0.0 is not a measured one)."""
    count = stats.get("count", len(stats.get("values", ())) or None)
    spread = "n/a" if count == 1 else f"{stats['std']:.{digits}f}"
    return f"{stats['mean']:.{digits}f} ± {spread}"


def _rate_cell(stats: dict | None) -> str:
    return "n/a" if stats is None else spread_cell(stats)


def _row_cells(data: dict) -> list[str]:
    if data["state"] == "admitting":
        wall = device = "admitting"
        clocks = ms_token = ms_step = host = "—"
    else:
        wall, device = _rate_cell(data["tps_wall"]), _rate_cell(data["tps_device"])
        disagreement = data["clock_disagreement"]
        clocks = "n/a" if disagreement is None else f"{100 * disagreement:.1f} %"
        clocks += " ⚠" if data["clock_flag"] else ""
        ms_token = f"{data['ms_per_token']:.3f}"
        ms_step = f"{data['ms_per_step']:.2f}"
        host = f"{data['host_us_per_step']:.0f}"
        if data.get("device_us_per_step"):
            host += f" / {data['device_us_per_step']:.0f} ({100 * data['host_share']:.0f} %)"
    arms = data["counters"]["arms"]
    return ([data["test"], wall, device, clocks, f"{data['ttft_ms']['mean']:.1f}", ms_token, ms_step, host]
            + [str(arms.get(name, 0)) for name, _ in ARM_COLUMNS]
            + [replays_cell(data["counters"]), str(sum(data["counters"]["kernels"].values()))])


def replays_cell(counters: dict) -> str:
    """Replayed steps, and the graph launches that ran them where fewer (graphs of several steps)."""
    replays, launched = counters["graph_replays"], counters.get("graph_launches", counters["graph_replays"])
    return str(replays) if launched == replays else f"{replays} in {launched} launches"



HEADER = (["test", "t/s (wall)", "t/s (device)", "Δclock", "TTFT ms", "ms/tok", "ms/step", "host µs/step"]
          + [short for _, short in ARM_COLUMNS] + ["replays", "kernels"])


def format_markdown(report: Report) -> str:
    payload = report.to_json()
    lines = [f"| {' | '.join(HEADER)} |", "|" + "|".join("---:" if i else ":---" for i in range(len(HEADER))) + "|"]
    for data in payload["rows"]:
        lines.append(f"| {' | '.join(_row_cells(data))} |")
    lines.append("")
    lines.append("t/s: mean ± stddev over the timed repetitions (warm-up excluded); pp: prompt tokens/s, "
                 "tg: generated tokens/s in the steady window (every sequence admitted with at least the depth "
                 "floor of tokens, whole cohort decoding), else `admitting`. ms/tok = 1000 / t/s; ms/step = wall "
                 "time per step in the window. Δclock: worst |wall - device| / wall over the repetitions, ⚠ over "
                 f"{100 * CLOCK_TOLERANCE:.0f} %. Arm columns: launches of each arm over the timed repetitions "
                 "(CUDA-graph replays counted); kernels: Triton launches.")
    lines += latency_markdown(payload["rows"])
    for data in payload["rows"]:
        for note in data["counters"].get("graph_notes", []):
            lines.append(f"{data['test']}: {note}; its steps replayed one per launch")
    trajectories = [(data["test"], data["trajectory"]["tokens_per_s"], data["trajectory"].get("phases", {}))
                    for data in payload["rows"] if data["kind"] == "tg"]
    if trajectories:
        lines += ["", f"Generated tokens/s in {TRAJECTORY_BIN_S:g}-second bins over the last repetition:"]
        for name, values, phases in trajectories:
            peak = max(values, default=0.0)
            steps = ", ".join(f"{count} {phase}" for phase, count in phases.items())
            lines.append(f"- {name}: {sparkline(values)}  ({len(values)} bins, peak {peak:.1f} t/s; steps: {steps})")
    targets = payload["targets"]
    if targets:
        weights, bandwidth = targets["active_weight_bytes_per_token"], targets["copy_bandwidth"]
        lines += ["", "Targets:"]
        for entry in targets["rows"]:
            lines.append(
                f"- {entry['test']} @ b1: {entry['tps']:.1f} t/s against a bound of {entry['bound_tps']:.1f} t/s "
                f"(active weights {weights['total'] / 1e6:.1f} MB per token over a copy bandwidth of "
                f"{bandwidth['bytes_per_s'] / 1e9:.1f} GB/s measured in this run, {bandwidth['clock']}): "
                f"{entry['ratio_to_bound']:.2f}x the bound "
                + (f"(target <= {entry['target_ratio']}x)" if entry.get("target_ratio")
                   else "(no target for this model)"))
            if entry["host_share"] is None:
                lines.append(f"- host time per decode step @ b1: {entry['host_us_per_step']:.0f} µs; device time n/a "
                             f"on this device, so no share")
            else:
                graph_state = "graphs OFF"
                if entry["graph_steps"]:
                    launched = entry.get("graph_launches", entry["graph_steps"])
                    graph_state = (f"graphs on ({entry['graph_steps']} of {entry['window_steps']:.0f} window steps "
                                   "replayed" + (f", by {launched} launches" if launched != entry["graph_steps"]
                                                 else "") + ")")
                spread = "" if entry.get("host_us_p50") is None else (
                    f" (median {entry['host_us_p50']:.1f}, p90 {entry['host_us_p90']:.1f}: the mean counts the "
                    "slow tail)")
                lines.append(f"- host time per decode step @ b1, {graph_state}: {entry['host_us_per_step']:.1f} µs"
                             f"{spread} of {entry['device_us_per_step']:.1f} µs device = "
                             f"{100 * entry['host_share']:.1f} % of the mean (target < "
                             f"{100 * entry['target_host_share']:.0f} %); host time = a step launched "
                             "ahead (two in flight): the host's busy time per step, from the previous step's sync "
                             "(or served step's end) to this step's wait for its own (all but waiting on the "
                             "device); a later step of a graph of several steps (steps_per_graph), served with the "
                             "others in one loop: from the step before's end to the end of its own work, its record "
                             "made (nothing to launch or wait for); else from the step's start to its launch")
                lines.append("- the device's wait for the host per decode step @ b1: wall "
                             f"{entry['wall_us_per_step']:.1f} µs - device {entry['device_us_per_step']:.1f} µs = "
                             f"{entry['device_waits_us_per_step']:.1f} µs = {100 * entry['device_waits_share']:.1f} % "
                             "of the step (the host's share of the critical path; the busy time above counts the "
                             "host's work whether or not the device waits for it)")
    for data in payload["rows"]:
        if "profile" not in data:
            continue
        lines += ["", f"Kernel shares, {data['test']} ({data['profile']['note']}):", "",
                  "| kernel | device µs | calls | µs/call | share | launches/step | adds µs/step |",
                  "|:---|---:|---:|---:|---:|---:|---:|"]
        kernels = data["profile"]["kernels"]
        for entry in kernels[:20]:
            name = entry["kernel"] if len(entry["kernel"]) <= 64 else entry["kernel"][:61] + "..."
            lines.append(f"| {name.replace('|', '/')} | {entry['device_us']:.1f} | {entry['calls']} | "
                         f"{entry['us_per_call']:.2f} | {100 * entry['share']:.1f} % | "
                         f"{entry['launches_per_step']:.2f} | {critical_cell(entry)} |")
            by_site = entry.get("critical_us_by_site", ())
            for site, us in enumerate(entry.get("us_per_call_by_site", ()), 1):
                adds = f"{by_site[site - 1]:.2f}" if site <= len(by_site) else ""
                lines.append(f"| ↳ launch {site} of the step | | | {us:.2f} | | | {adds} |")
        if len(kernels) > 20:
            lines.append(f"| ({len(kernels) - 20} more kernels in the JSON) | | | | | | |")
        busy, calls = sum(entry["device_us"] for entry in kernels), sum(entry["calls"] for entry in kernels)
        share, per_step = sum(entry["share"] for entry in kernels), sum(entry["launches_per_step"] for entry in kernels)
        span = sum(entry.get("critical_us_per_step", 0.0) for entry in kernels)
        lines.append(f"| **GPU busy** | {busy:.1f} | {calls} | | {100 * share:.1f} % | {per_step:.2f} | "
                     f"{span:.2f} |" if any("critical_us_per_step" in entry for entry in kernels) else
                     f"| **GPU busy** | {busy:.1f} | {calls} | | {100 * share:.1f} % | {per_step:.2f} | — |")
        lines.append("")
        lines.append("adds µs/step: what the kernel adds to the step's device span (its end minus the end of the "
                     "kernel before it, the step's first its own time), mean over the window's steps; the column "
                     "sums to the span from the step's first kernel's start to its last one's end")
    foot = payload["footer"]
    lines += ["", f"{foot['model']} ({foot['dtype']}) on {foot['device']} · commit {foot['commit']} · "
              + " · ".join(f"{name} {version}" for name, version in foot["versions"].items()),
              f"flags: {foot['flags']} · graphs {foot['graphs']} · decode glue: {foot.get('decode_glue', 'n/a')} · "
              f"weights: {foot['weights']}",
              f"clocks: {foot['clocks']}"]
    from engine.ep_bench import markdown_lines

    lines += markdown_lines(payload["rows"], foot)
    if "checkpoint" in foot:
        checkpoint = foot["checkpoint"]
        lines.append(f"checkpoint: {checkpoint['path']} ({checkpoint['family']}, config.json sha256 "
                     f"{checkpoint['config_sha256']}, weights {describe_weights(checkpoint['weights'])})")
    return "\n".join(lines) + "\n"


def latency_cell(stats: dict | None) -> str:
    return "—" if stats is None else spread_cell(stats)


def latency_markdown(rows: list[dict]) -> list[str]:
    """The latency table (vllm bench's): TTFT, TPOT and ITL in ms, mean ± stddev beside p50/p90/p99, over
    every request (ITL: every gap) of the timed repetitions."""
    names = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"))
    header = ["test"] + [f"{label} {column}" for _, label in names for column in ("ms", "p50", "p90", "p99")]
    lines = ["", f"| {' | '.join(header)} |", "|:---|" + "---:|" * (len(header) - 1)]
    for data in rows:
        cells = [data["test"]]
        for name, _ in names:
            stats = (data.get("latency") or {}).get(name)
            cells += [latency_cell(stats)] + (["—"] * 3 if stats is None else
                                               [f"{stats[q]:.2f}" for q in ("p50", "p90", "p99")])
        lines.append(f"| {' | '.join(cells)} |")
    lines.append("TTFT: arrival to first token per request; TPOT: first to last token over the tokens after the "
                 "first, per request; ITL: every gap between a request's tokens (a graph of several steps hands "
                 "its tokens over together); ms mean ± stddev, pNN percentiles, over the timed repetitions.")
    return lines


def describe_weights(source: dict) -> str:
    """A checkpoint's weights source (engine.model_source.describe_checkpoint) in a few words."""
    if source["source"] == "random":
        return f"random, seed {source['seed']}, drawn on the {source['drawn_on']}"
    from engine.limits import gib

    files = len(source["files"])
    return f"{files} safetensors file{'' if files == 1 else 's'}, {gib(sum(entry['bytes'] for entry in source['files']))}"


def critical_cell(entry: dict) -> str:
    """A kernel-share entry's adds µs/step as printed (the markdown table, the TUI), or a dash without step markers."""
    value = entry.get("critical_us_per_step")
    return "—" if value is None else f"{value:.2f}"


def csv_model(footer: dict) -> str:
    """The model a CSV row ran: a checkpoint's path where one was loaded, else the preset's name."""
    return (footer.get("checkpoint") or {}).get("path") or footer["model"]


def format_csv(report: Report) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    columns = ["test", "kind", "tokens", "batch", "state", "tps_wall_mean", "tps_wall_std", "tps_device_mean",
               "tps_device_std", "clock_disagreement", "clock_flag", "ttft_ms", "ms_per_token", "ms_per_step",
               "host_us_per_step", "device_us_per_step"] + [name for name, _ in ARM_COLUMNS] + [
               "graph_replays", "graph_launches", "kernel_launches", "commit", "device"] + [
               f"{name}_{stat}" for name in LATENCIES for stat in ("mean", "std", "p50", "p90", "p99")] + [
               "model", "weights"]  # last, so that readers of the columns before keep their positions
    writer.writerow(columns)
    payload = report.to_json()
    for data in payload["rows"]:
        wall, device = data["tps_wall"] or {}, data["tps_device"] or {}
        writer.writerow([data["test"], data["kind"], data["tokens"], data["batch"], data["state"], wall.get("mean"),
                         wall.get("std"), device.get("mean"), device.get("std"), data["clock_disagreement"],
                         data["clock_flag"], data["ttft_ms"]["mean"], data["ms_per_token"], data["ms_per_step"],
                         data.get("host_us_per_step"), data.get("device_us_per_step")]
                        + [data["counters"]["arms"].get(name, 0) for name, _ in ARM_COLUMNS]
                        + [data["counters"]["graph_replays"], data["counters"].get("graph_launches"),
                           sum(data["counters"]["kernels"].values()),
                           payload["footer"]["commit"], payload["footer"]["device"]]
                        + [((data.get("latency") or {}).get(name) or {}).get(stat) for name in LATENCIES
                           for stat in ("mean", "std", "p50", "p90", "p99")]
                        + [csv_model(payload["footer"]), payload["footer"].get("weights")])
    return buffer.getvalue()


def format_json(report: Report) -> str:
    return json.dumps(report.to_json(), indent=2, default=str) + "\n"
