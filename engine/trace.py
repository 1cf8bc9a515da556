"""Chrome / Perfetto traces (the JSON trace-event format) of what the engine ran: built from the step records
the runtime already makes and, on a GPU, from torch.profiler's kernel events of a profiled repetition.

Tracks: one process per configuration (A, B, a bench's flags, a session's configs), with
    thread 1 "host"    a slice per run (a bench repetition, a prompt), per step inside it, per layer inside
                       a step, and the layer's attention and MoE slices carrying the decision (arm, variant,
                       n, woken experts, fill, reason, mask; a layer with shared experts their path and why).
                       A step slice is the step's record clocks (started .. ended); where a record has
                       per-layer µs (the eager, timed `generate`) the attention and MoE slices are that long,
                       else the step's span is shared evenly among its layers (args `placement` says which: no
                       per-layer clock is invented)
    thread 2 "device"  (profiled runs on a GPU) a slice per step's kernels, per layer inside it, per kernel
                       inside that: the kernels' own device times, each attributed to its layer and arm
Kernel attribution (`attribute`): a step's kernels in start order are its capture order (one stream: a CUDA
graph replays its kernels in the order they were captured, and an eager step launches them in that order).
Each is classed by its function name (attention, MoE or other: the device kernels a record says its arm
launched, `arm_kernels`, then the Triton kernels of kernels/attention*.py, kernels/moe_*.py, kernels/router.py); the i-th run of attention kernels is layer i's attention, the
kernels after it up to the last MoE kernel before the next layer's attention belong to layer i, those after
that to layer i + 1 (its norm and q/k/v), and those after the last layer's MoE kernels to the LM head
(`head`). Under programmatic dependent launch a kernel starts while the one before it runs; its slice then
starts where the one before ends (so slices nest on one track) and its args keep its own start and time.

Size: about 370 bytes an event; `bench --model demo --tg 128 --batch 32 --pp none --trace` on the CPU (6
repetitions, 768 steps of 2 layers, 5386 events) wrote 1.98 MB; a GPU bench adds its profiled repetition's
kernels, about 20 per step (tests/test_trace.py checks a proxy against the 20 MB budget).

Also the NVTX ranges of the same names (`nvtx`), pushed only where the host walks layers (eager and capture
steps) and around a profiled step; never on a replayed step's timed path.

Knows nothing of argument parsing; the commands call `Trace.add_*`, then write `Trace.dumps()` as they write
every output (inspector.output_paths.write_output).
"""

from __future__ import annotations

import json
import math
import statistics

HOST, DEVICE = 1, 2
ATTENTION, MOE, OTHER = "attention", "moe", "other"
_FAMILY_MODULES = {ATTENTION: ("attention", "attention_decode"),
                   MOE: ("moe_gemv", "moe_grouped", "moe_align", "moe_peer", "router")}


# ------------------------------------------------------------------------------------------------- NVTX

class Nvtx:
    """torch.cuda.nvtx ranges when `enabled` (a trace was asked for, on a CUDA device); no-ops otherwise."""

    enabled = False

    def push(self, name: str) -> None:
        if self.enabled:
            import torch

            torch.cuda.nvtx.range_push(name)

    def pop(self) -> None:
        if self.enabled:
            import torch

            torch.cuda.nvtx.range_pop()


nvtx = Nvtx()


def enable_nvtx(device) -> None:
    nvtx.enabled = getattr(device, "type", str(device)) == "cuda"


def moe_name(record: dict) -> str:
    """The slice and NVTX name of a MoE decision: `L0 moe grouped v2 n=32`."""
    arm = record["executed_arm"] + (f" v{record['variant']}" if record.get("variant") is not None
                                    and record["executed_arm"] == "grouped" else "")
    return f"L{record['layer']} moe {arm} n={record['n_tokens']}"


def attention_name(record: dict) -> str:
    return f"L{record['layer']} attention {record['executed_arm']} {record['applied_mask']}"


def layer_range_name(record: dict) -> str:
    return moe_name(record) if "k" in record else attention_name(record)


def step_name(step: dict) -> str:
    return f"step {step['step']} {step['phase']} n={step['n_tokens']}"


# ------------------------------------------------------------------------------------------------- kernels

_FAMILY_CACHE: dict[str, str] | None = None


def kernel_families() -> dict[str, str]:
    """Every Triton kernel function name of the kernels package -> its family (attention, MoE or other, by
    module: `_FAMILY_MODULES`)."""
    global _FAMILY_CACHE
    if _FAMILY_CACHE is None:
        import importlib

        import pkgutil

        import kernels

        families: dict[str, str] = {}
        try:
            from triton.runtime.jit import JITFunction
        except ImportError:  # no triton: no Triton kernel names to class
            _FAMILY_CACHE = families
            return families
        try:  # under TRITON_INTERPRET=1 a @triton.jit function is one of these
            from triton.runtime.interpreter import InterpretedFunction
            jitted = (JITFunction, InterpretedFunction)
        except ImportError:
            jitted = (JITFunction,)
        module_family = {module: family for family, modules in _FAMILY_MODULES.items() for module in modules}
        for module in pkgutil.iter_modules(kernels.__path__):
            try:
                loaded = importlib.import_module(f"kernels.{module.name}")
            except ImportError:
                continue
            for value in vars(loaded).values():
                # a name two modules share (moe_gemv's and moe_grouped's _gate_up_kernel) keeps one family
                if isinstance(value, jitted) and value.fn.__module__ == loaded.__name__:
                    families.setdefault(value.fn.__name__, module_family.get(module.name, OTHER))
        _FAMILY_CACHE = families
    return _FAMILY_CACHE


def family_of(kernel: str, families: dict[str, str] | None = None) -> str:
    """A kernel's family by its profiled name: the function name, or (older Triton) that name followed by a
    specialization suffix (`_gate_up_kernel_0d1d2d`)."""
    families = kernel_families() if families is None else families
    family = families.get(kernel)
    if family is None and "_" in kernel[1:]:
        family = next((value for name, value in families.items() if kernel.startswith(name + "_")), None)
    return family or OTHER


def attribute(kernels: list[tuple[str, float, float]], layers: int,
              families: dict[str, str] | None = None) -> tuple[list[str], str]:
    """Each of a step's kernels (name, start, duration; in start order: the capture order) -> its layer
    ("0", "1", ..., or "head"), by the rule in the module docstring; and '' or why the rule did not fit
    (then every kernel is "unattributed")."""
    classes = [family_of(name, families) for name, _, _ in kernels]
    runs = []  # (first, last) index of each run of attention kernels
    for index, family in enumerate(classes):
        if family == ATTENTION:
            if runs and runs[-1][1] == index - 1:
                runs[-1][1] = index
            else:
                runs.append([index, index])
    if len(runs) != layers:
        return ["unattributed"] * len(kernels), f"{len(runs)} runs of attention kernels for {layers} layers"
    owner = [""] * len(kernels)
    for layer, (first, last) in enumerate(runs):
        for index in range(first, last + 1):
            owner[index] = str(layer)
    boundaries = [run[0] for run in runs] + [len(kernels)]
    for index in range(runs[0][0]):  # before the first attention: layer 0's norm and q/k/v
        owner[index] = "0"
    for layer, (first, last) in enumerate(runs):
        following = boundaries[layer + 1]
        moe = [index for index in range(last + 1, following) if classes[index] == MOE]
        cut = moe[-1] + 1 if moe else following
        for index in range(last + 1, following):
            owner[index] = str(layer) if index < cut else ("head" if layer + 1 == layers else str(layer + 1))
    return owner, ""


# ------------------------------------------------------------------------------------------------- the trace

class StepClock:
    """An `on_step` for Engine.generate, whose step records carry no clocks: a step ends when its record
    arrives (after the step's one sync) and starts where the one before ended (the first at this object's
    creation). `stamped(steps)` gives copies of the records with `started` and `ended` (seconds,
    perf_counter); the records themselves are left as they are."""

    def __init__(self, chained=None) -> None:
        import time

        self._clock = time.perf_counter
        self._last = self._clock()
        self._stamps: list[tuple[float, float]] = []
        self._chained = chained

    def __call__(self, record: dict, token: int) -> None:
        now = self._clock()
        self._stamps.append((self._last, now))
        self._last = now
        if self._chained is not None:
            self._chained(record, token)

    def stamped(self, steps: list[dict]) -> list[dict]:
        """Records with clocks: their own where they carry them (the batched runtime's), else the stamps."""
        if all(step.get("started") is not None and step.get("ended") is not None for step in steps):
            return steps
        return [dict(step, started=begin, ended=end) for step, (begin, end) in zip(steps, self._stamps)]


class Trace:
    """Events of one trace file; configurations become processes, in the order first seen."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.processes: dict[str, int] = {}
        self.notes: list[str] = []
        self.attributions: list[dict] = []  # per profiled run: kernels, attributed, in graph replays, ...

    def _pid(self, configuration: str) -> int:
        if configuration not in self.processes:
            pid = self.processes[configuration] = len(self.processes) + 1
            self.events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                                "args": {"name": configuration}})
            self.events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                                "args": {"sort_index": pid}})
            for tid, name in ((HOST, "host: runs, steps, layers (decisions)"),
                              (DEVICE, "device: profiled kernels by step and layer")):
                self.events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
        return self.processes[configuration]

    def _slice(self, pid: int, tid: int, name: str, category: str, begin_us: float, end_us: float,
               args: dict | None = None) -> None:
        event = {"name": name, "cat": category, "ph": "X", "ts": begin_us, "dur": max(0.0, end_us - begin_us),
                 "pid": pid, "tid": tid}  # rounded in to_json, where both ends are rounded alike
        if args:
            event["args"] = args
        self.events.append(event)

    # ---------------------------------------------------------------------------------------- host

    def add_run(self, configuration: str, label: str, steps: list[dict], args: dict | None = None) -> None:
        """One run's steps (records with `started` and `ended` in seconds on one clock) on the host track.
        Steps are laid one after another: a step shown starts no earlier than the one before ends (the later
        steps of a graph of several steps share their launch's start), its args keep its own clocks."""
        timed = [step for step in steps if step.get("started") is not None and step.get("ended") is not None]
        if not timed:
            return
        pid = self._pid(configuration)
        first = timed[0]["started"] * 1e6
        previous_end = first
        shown = []
        for step in timed:
            begin = max(step["started"] * 1e6, previous_end)
            end = max(begin, step["ended"] * 1e6)
            shown.append((step, begin, end))
            previous_end = end
        self._slice(pid, HOST, label, "run", first, previous_end, args)
        for step, begin, end in shown:
            self._step(pid, step, begin, end)

    def _step(self, pid: int, step: dict, begin: float, end: float) -> None:
        args = {"phase": step["phase"], "n_tokens": step["n_tokens"], "started_s": step["started"],
                "ended_s": step["ended"]}
        for key in ("graph", "eager_reason", "span", "span_index", "device_us", "host_us"):
            if step.get(key) not in (None, ""):
                args[key] = round(step[key], 2) if isinstance(step[key], float) else step[key]
        if step.get("rows"):
            args["rows"] = len(step["rows"])
        self._slice(pid, HOST, step_name(step), "step", begin, end, args)
        moe = {record["layer"]: record for record in step.get("moe", ())}
        attention = {record["layer"]: record for record in step.get("attention", ())}
        layers = sorted(set(moe) | set(attention))
        if not layers:
            return
        measured = all(record.get("us") is not None for record in (*moe.values(), *attention.values()))
        span = end - begin
        if measured:
            parts = [(attention[layer]["us"] if layer in attention else 0.0) +
                     (moe[layer]["us"] if layer in moe else 0.0) for layer in layers]
            rest = max(0.0, span - sum(parts)) / len(layers)
            scale = min(1.0, span / sum(parts)) if sum(parts) > 0 else 1.0
            widths = [part * scale + rest for part in parts]
            placement = "the attention and MoE slices are their measured µs; the rest of the step's span is shared evenly"
        else:
            widths = [span / len(layers)] * len(layers)
            placement = "no per-layer clock in this run: the step's span shared evenly among its layers"
        cursor = begin
        for layer, width in zip(layers, widths):
            slot_end = min(end, cursor + width)
            self._slice(pid, HOST, f"L{layer}", "layer", cursor, slot_end, {"layer": layer, "placement": placement})
            half = (slot_end - cursor) / 2
            if layer in attention:
                record = attention[layer]
                length = record["us"] * (scale if measured else 1) if measured else half
                self._slice(pid, HOST, attention_name(record), "attention", cursor, min(slot_end, cursor + length),
                            _attention_args(record))
            if layer in moe:
                record = moe[layer]
                length = record["us"] * (scale if measured else 1) if measured else half
                self._slice(pid, HOST, moe_name(record), "moe", max(cursor, slot_end - length), slot_end,
                            _moe_args(record))
            cursor = slot_end

    # ---------------------------------------------------------------------------------------- device

    def add_profile(self, configuration: str, kernels: list[tuple[str, float, float]],
                    step_ranges: dict[int, tuple[float, float]], steps: list[dict],
                    families: dict[str, str] | None = None) -> dict:
        """A profiled run's kernels (name, start µs, duration µs on the profiler's clock) on the device track,
        per step (those starting inside its host range `step_ranges`, the profiler's `moei.step.N`) and per
        layer (`attribute`). The profiler's clock is moved onto the records' (`started`, seconds) by the
        median offset of the steps' starts. Returns counts: kernels, attributed, in graph replays, unattributed."""
        records = {step["step"]: step for step in steps}
        shared = [step for step in step_ranges if step in records and records[step].get("started") is not None]
        counts = {"kernels": 0, "attributed": 0, "in_replays": 0, "replays_attributed": 0, "unattributed_steps": []}
        if not shared:
            self.notes.append(f"{configuration}: no profiled step matches a record: kernels not traced")
            return counts
        offset = statistics.median(records[step]["started"] * 1e6 - step_ranges[step][0] for step in shared)
        pid = self._pid(configuration)
        # the records name the device kernels each arm launched (`arm_kernels`, engine.dispatcher): those class
        # first, the kernels package's modules after
        families = dict(kernel_families() if families is None else families)
        for step in steps:
            for family, key in ((MOE, "moe"), (ATTENTION, "attention")):
                for record in step.get(key, ()):
                    for name in record.get("arm_kernels") or ():
                        families[name] = family
        ordered = sorted(kernels, key=lambda kernel: kernel[1])
        for step_number in sorted(shared):
            start, end = step_ranges[step_number]
            chosen = [kernel for kernel in ordered if start <= kernel[1] <= end]
            if not chosen:
                continue
            record = records[step_number]
            moe = {str(r["layer"]): r for r in record.get("moe", ())}
            attention = {str(r["layer"]): r for r in record.get("attention", ())}
            layers = len(set(moe) | set(attention))
            owners, problem = attribute(chosen, layers, families)
            replay = record.get("graph") == "replay"
            counts["kernels"] += len(chosen)
            counts["in_replays"] += len(chosen) if replay else 0
            if problem:
                counts["unattributed_steps"].append(f"step {step_number}: {problem}")
            else:
                counts["attributed"] += len(chosen)
                counts["replays_attributed"] += len(chosen) if replay else 0
            shown, previous_end = [], None
            for (name, begin, duration), owner in zip(chosen, owners):
                begin += offset
                shown_begin = begin if previous_end is None else max(begin, previous_end)
                shown_end = max(shown_begin, begin + duration)
                shown.append((name, begin, duration, owner, shown_begin, shown_end))
                previous_end = shown_end
            step_args = {"graph": record.get("graph"), "kernels": len(chosen),
                         "attribution": problem or "by capture order (start order on one stream)"}
            launched = record.get("kernel_launches")
            if launched:
                known = kernel_families() if families is None else families
                triton = sum(1 for name, *_ in chosen if name in known or any(name.startswith(k + "_") for k in known))
                step_args["capture_launches"] = sum(launched.values())
                step_args["triton_kernels_profiled"] = triton
            self._slice(pid, DEVICE, step_name(record) + " (device)", "device step", shown[0][4], shown[-1][5],
                        step_args)
            groups: list[list] = []
            for entry in shown:
                if groups and groups[-1][0] == entry[3]:
                    groups[-1][1].append(entry)
                else:
                    groups.append([entry[3], [entry]])
            for owner, members in groups:
                label = "head" if owner == "head" else owner if owner == "unattributed" else f"L{owner}"
                own_us = sum(member[2] for member in members)
                self._slice(pid, DEVICE, f"{label} (device)", "device layer", members[0][4], members[-1][5],
                            {"layer": owner, "kernels": len(members), "kernel_us": round(own_us, 2)})
                for name, begin, duration, _, shown_begin, shown_end in members:
                    family = family_of(name, families)
                    decision = moe.get(owner) if family == MOE else attention.get(owner) if family == ATTENTION else None
                    args = {"layer": owner, "family": family, "device_us": round(duration, 3),
                            "start_us": round(begin, 3), "graph": record.get("graph")}
                    if decision is not None:
                        args["arm"] = decision["executed_arm"]
                        if decision.get("variant") is not None:
                            args["variant"] = decision["variant"]
                        if decision.get("shared_path"):
                            args["shared_path"] = decision["shared_path"]
                    self._slice(pid, DEVICE, name, "kernel", shown_begin, shown_end, args)
        return counts

    def add_profiled(self, configuration: str, label: str, steps: list[dict], kernels, step_ranges) -> dict:
        """A profiled run (engine.bench's profiled repetition): its steps on the host track and its kernels on
        the device track; the attribution counts are kept in `attributions`."""
        self.add_run(configuration, label, steps)
        counts = self.add_profile(configuration, kernels, step_ranges, steps)
        self.attributions.append({"configuration": configuration, "run": label, **counts})
        return counts

    # ---------------------------------------------------------------------------------------- output

    def to_json(self) -> dict:
        timed = [event for event in self.events if event["ph"] == "X"]
        origin = min((event["ts"] for event in timed), default=0.0)
        events = []
        for event in self.events:
            if event["ph"] == "X":  # both ends rounded to ns, so a child ending with its parent ends at its ns
                begin, end = round(event["ts"] - origin, 3), round(event["ts"] + event["dur"] - origin, 3)
                event = dict(event, ts=begin, dur=round(end - begin, 3))
            events.append(event)
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"producer": "moe-inspector", "notes": self.notes, "attributions": self.attributions,
                              "clock": "the step records' clock (perf_counter), µs from the first event"}}

    def dumps(self) -> bytes:
        """The trace as UTF-8 JSON, validated first (ValueError where it does not follow the format)."""
        payload = self.to_json()
        problems = validate(payload)
        if problems:
            raise ValueError(f"the trace does not follow the trace-event format: {problems[0]}")
        return json.dumps(payload, separators=(",", ":"), default=str).encode("utf-8")


def _moe_args(record: dict) -> dict:
    args = {key: record.get(key) for key in ("decided_arm", "executed_arm", "variant", "n_tokens", "woken_predicted",
                                             "woken_observed", "fill", "policy", "reason", "us")}
    if record.get("execution_note"):
        args["execution_note"] = record["execution_note"]
    if record.get("shared_path"):  # only layers with shared experts: the others' slices are unchanged
        args["shared_path"], args["shared_reason"] = record["shared_path"], record.get("shared_reason")
    return args


def _attention_args(record: dict) -> dict:
    args = {key: record.get(key) for key in ("decided_arm", "executed_arm", "mask", "applied_mask", "declined",
                                             "reason", "us")}
    if record.get("execution_note"):
        args["execution_note"] = record["execution_note"]
    return args


# ------------------------------------------------------------------------------------------------- validation

_PHASES = {"X": ("name", "ts", "dur", "pid", "tid"), "M": ("name", "pid", "args"), "i": ("name", "ts", "pid"),
           "B": ("name", "ts", "pid", "tid"), "E": ("ts", "pid", "tid")}
_METADATA = ("process_name", "process_sort_index", "thread_name", "thread_sort_index", "process_labels")


def validate(payload: dict) -> list[str]:
    """What in `payload` breaks the JSON object form of the trace-event format (Chrome's "Trace Event
    Format" document: `traceEvents`, each event's required fields for its phase, numbers for ts/dur/pid/tid,
    metadata names) or Perfetto's import of complete events (on one thread, slices nest: a slice starting
    inside another ends inside it). Empty when it is a valid trace."""
    problems = []
    events = payload.get("traceEvents") if isinstance(payload, dict) else None
    if not isinstance(events, list):
        return ["no traceEvents list"]
    by_thread: dict[tuple, list[tuple[float, float, str]]] = {}
    for index, event in enumerate(events):
        if not isinstance(event, dict) or event.get("ph") not in _PHASES:
            problems.append(f"event {index}: phase {event.get('ph') if isinstance(event, dict) else event!r} unknown")
            continue
        phase = event["ph"]
        missing = [key for key in _PHASES[phase] if key not in event]
        if missing:
            problems.append(f"event {index} ({phase}): missing {', '.join(missing)}")
            continue
        for key in ("ts", "dur"):
            if key in event and not (isinstance(event[key], (int, float)) and math.isfinite(event[key])
                                     and (key == "ts" or event[key] >= 0)):
                problems.append(f"event {index}: {key} {event[key]!r} is not a finite (non-negative) number")
        for key in ("pid", "tid"):
            if key in event and not isinstance(event[key], int):
                problems.append(f"event {index}: {key} {event[key]!r} is not an integer")
        if "args" in event and not isinstance(event["args"], dict):
            problems.append(f"event {index}: args is not an object")
        if phase == "M" and event["name"] not in _METADATA:
            problems.append(f"event {index}: metadata name {event['name']!r} unknown")
        if phase == "X" and not problems:
            by_thread.setdefault((event["pid"], event["tid"]), []).append(
                (event["ts"], event["ts"] + event["dur"], event["name"]))
    for thread, slices in by_thread.items():
        slices.sort(key=lambda item: (item[0], -item[1]))
        open_ends: list[tuple[float, str]] = []
        for begin, end, name in slices:
            while open_ends and open_ends[-1][0] <= begin + 2e-3:
                open_ends.pop()
            if open_ends and end > open_ends[-1][0] + 2e-3:
                problems.append(f"thread {thread}: slice {name!r} [{begin}, {end}] overlaps {open_ends[-1][1]!r} "
                                f"ending at {open_ends[-1][0]} without nesting in it")
                break
            open_ends.append((end, name))
    return problems
