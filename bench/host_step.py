"""Host time of a CUDA-graph decode step: the quantity `moe-inspector bench` reports as host µs/step.

Drives `Engine._next_steps` exactly as `Engine.generate_batch` does (the scheduler, the batch runner,
one dispatcher per run) and reads each replayed step's `host_us` (engine.batch_runner): a step
launched the usual way, the time from its start until its replay and end event are issued; a step
launched ahead (run-ahead, two in flight), the host's busy time per step, from the previous step's
sync to this step's wait for its own. Also prints the whole host loop per step (the time between the
starts of consecutive replayed steps: with the sync, the postprocess and the step record), which on
a CPU stub is all host time.

    python bench/host_step.py                      # CPU stub, demo (2 layers), batch 1
    python bench/host_step.py --layers 1           # the v4-shape record count (1 layer)
    python bench/host_step.py --profile            # plus the top cProfile entries of the replayed steps
    python bench/host_step.py --breakdown          # plus each piece of the path before the launch, timed per call
    python bench/host_step.py --pieces             # plus each function and C call of the default path, per step
    python bench/host_step.py --device cuda --model v4-shape   # a real graph on a GPU

--device cpu (no GPU): the real scheduler, runner and dispatcher, with a stub graph. The first
decode step of a cohort runs eagerly as a capture step does, and stores a `_DecodeGraph` whose
template dispatcher holds the records a real capture would have (one MoE and one attention record
per layer, from an eager forward through it) plus the Triton launches a capture on a GPU records (5
per layer). The current stream is a stub stream (`StubStream`): the replay, the input copy and the
copy of the outputs to a landing buffer are enqueued on it, in order, and run only when an event
recorded after them is waited on (then everything enqueued so far runs: a device that raced ahead).
A replay writes a stand-in next token (`stand_in_token` of the token and position it holds) into
`observed` and feeds itself, as the real graph does, so a step that read another step's outputs, or
read them before its wait, returns the wrong tokens. The stub measures the Python of the path, not
the C calls a GPU step adds (the current stream's id, event records, the graph launch, the copy).
--device cuda: the real runner with real graph capture and CUDA events, weights drawn on the GPU.

Run-ahead (engine.batch_runner): a steady cohort's next replay is launched before the step's sync,
two in flight. The whole host loop is timed with it off, then on (the default): start to next start,
launch to next launch, and the next replay's launch relative to this step's sync (positive: the device
idles that long after the sync returns; negative: launched before the sync, two in flight).

Also printed: how many replays copied their inputs in (a steady cohort copies none: the graph
feeds itself), which a slow host_us on a GPU should be checked against first.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import gc
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402 - after the sys.path line above, like the engine imports

from engine import flags as flag_registry  # noqa: E402
from engine import runtime  # noqa: E402
from engine.batch_runner import BatchRunner, _DecodeGraph  # noqa: E402
from engine.config import PRESETS  # noqa: E402
from engine.runtime import Dispatcher, Engine  # noqa: E402
from engine.scheduler import DECODE, Scheduler  # noqa: E402
from engine.sequence import Sequence  # noqa: E402

# What Engine.generate_batch runs its steps inside: the cyclic collector off (engine.runtime).
paused_gc = getattr(runtime, "cyclic_gc_paused", contextlib.nullcontext)

# What a capture of one decode layer records on a GPU (gemv MoE, split-KV decode attention).
KERNELS_PER_LAYER = ("moe_align.fused", "moe_gemv.gate_up", "moe_gemv.down", "flash_decode_split",
                     "flash_decode_combine")


class StubStream:
    """A CUDA stream's order on the host: work is enqueued and runs, in order, only when an event
    recorded after it is waited on: up to that event, or with `race`, everything enqueued so far (a
    device that ran ahead of what the host waits for). `depths`: how many replays were pending (not
    yet run) at each wait."""

    def __init__(self, race: bool = False) -> None:
        self.race = race
        self.queue: list = []
        self.depths: list[int] = []

    def enqueue(self, work) -> None:
        self.queue.append(work)

    def run(self, marker: object) -> None:
        self.depths.append(sum(isinstance(work, _Replay) for work in self.queue))
        if self.race or marker not in self.queue:  # not in it: run already
            queue, self.queue = self.queue, []
        else:
            index = self.queue.index(marker) + 1
            queue, self.queue = self.queue[:index], self.queue[index:]
        for work in queue:
            if callable(work):  # else an event's marker
                work()


class _StubEvent:
    def __init__(self, stream: StubStream | None = None) -> None:
        self.stream, self.marker = stream, None

    def record(self, stream=None) -> None:
        if isinstance(stream, StubStream):
            self.marker = object()
            stream.enqueue(self.marker)

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.run(self.marker)

    def elapsed_time(self, other) -> float:
        return 0.25  # ms


def stand_in_token(token: int, position: int, vocab_size: int) -> int:
    """What a stub replay writes as the next token of a row holding `token` at `position`."""
    return (31 * token + 7 * position + 1) % vocab_size


class _Replay:
    """One stub replay, run by the stream: the stand-in next tokens into `observed`, and the graph's next
    inputs (those tokens, one position on) into `inputs`, as kernels.next_tokens does."""

    def __init__(self, inputs, observed, vocab_size: int) -> None:
        self.inputs, self.observed, self.vocab_size = inputs, observed, vocab_size

    def __call__(self) -> None:
        inputs, size = self.inputs, self.inputs.shape[1]
        tokens = [stand_in_token(token, position, self.vocab_size) for token, position in zip(*inputs.tolist())]
        self.observed[:size] = torch.tensor(tokens, dtype=self.observed.dtype)
        inputs[0] = torch.tensor(tokens, dtype=inputs.dtype)
        inputs[1] += 1


class _BlockReplay:
    """A stub replay of a graph of several steps: `_Replay` once per row of `landing` [steps, B + layers], each
    step fed by the one before (as the graph's steps feed each other on the device)."""

    def __init__(self, inputs, landing, vocab_size: int) -> None:
        self.steps = [_Replay(inputs, observed, vocab_size) for observed in landing]

    def __call__(self) -> None:
        for step in self.steps:
            step()


class _StubGraph:
    def __init__(self, stream: StubStream | None = None, work=None) -> None:
        self.stream, self.work = stream, work

    def replay(self) -> None:
        if self.stream is not None:
            self.stream.enqueue(self.work)


def stub_graphs(runner: BatchRunner, run_ahead: bool | None = True, race: bool = False) -> None:
    """Make a CPU runner take the graph path: capture runs the step eagerly and stores a stub graph.
    `run_ahead`: on (a CUDA runner's default), off, or None: as MOEI_RUN_AHEAD says
    (engine.batch_runner.run_ahead_default), where the runner has the switch. `race`: the stub
    stream's wait runs everything enqueued (`StubStream`)."""
    engine = runner.engine
    runner.graphs_enabled = True
    runner.graphs_note = "on (CPU stub: replays write stand-in tokens)"
    stream = runner.stub_stream = StubStream(race)
    if hasattr(runner, "use_events"):
        runner.use_events(lambda: _StubEvent(stream))
    else:  # an older runner: its events by name
        runner._events = (_StubEvent(stream), _StubEvent(stream))
        runner._records = tuple(event.record for event in runner._events)
        runner._spare_events = (_StubEvent(stream), _StubEvent(stream))
        runner._spare_records = tuple(event.record for event in runner._spare_events)
    if hasattr(runner, "run_ahead"):
        if run_ahead is None:
            from engine.batch_runner import run_ahead_default

            run_ahead = run_ahead_default()
        runner.run_ahead = run_ahead
    runner._current_stream = lambda: stream
    runner._capture_blocker = lambda size, dispatcher: ""

    def capture(batch, dispatcher, key, values):
        next_tokens = runner._eager(batch, dispatcher)  # the capture step itself runs eagerly
        size = len(batch.rows)
        template = Dispatcher(engine, dispatcher.flags, timed=False)
        template.begin_step(batch.step, DECODE, size)
        static_next = runner._eager(batch, template)  # what the capture records, per layer
        kernels = {name: engine.config.n_layers for name in KERNELS_PER_LAYER}
        inputs = torch.tensor(values, dtype=torch.int64)
        staging = torch.empty((2, size), dtype=torch.int64)
        fields = {field.name for field in dataclasses.fields(_DecodeGraph)}
        if "launches" in fields:  # two instances, each writing its own host buffer: a launch copies nothing
            outputs = tuple(torch.cat([static_next.long(), torch.stack(template.pending_woken).long()])
                            for _ in range(2))
            graphs = tuple(_StubGraph(stream, _Replay(inputs, output, engine.config.vocab_size)) for output in outputs)
            captured = runner._graphs[key] = _DecodeGraph(graphs, inputs, staging, outputs, template, kernels)
            captured.feed = lambda: stream.enqueue(lambda: inputs.copy_(staging))
            steps = dispatcher.flags.values.get("steps_per_graph", 1)
            made = []  # the graph of several steps beside it, sharing its inputs, and its tails (halving to 2)
            while steps > 1 and "block" in fields and (not made or "tails" in fields):
                blocks = tuple(outputs[0].repeat(steps, 1) for _ in range(2))
                graphs = tuple(_StubGraph(stream, _BlockReplay(inputs, block, engine.config.vocab_size))
                               for block in blocks)
                made.append(_DecodeGraph(graphs, inputs, staging, blocks, template, kernels, steps=steps))
                steps //= 2
            if made:
                captured.block = made[0]
                if "tails" in fields:
                    captured.tails = tuple(made[1:])
            return next_tokens
        if "observed" in fields:  # the graph's one static output: next tokens, then each layer's woken count
            output = torch.cat([static_next.long(), torch.stack(template.pending_woken).long()])
        else:  # before the observed buffer (for before/after numbers): the next tokens alone
            output = static_next.clone()
        graph = _StubGraph(stream, _Replay(inputs, output, engine.config.vocab_size))
        captured = runner._graphs[key] = _DecodeGraph(graph, inputs, staging, output, template, kernels)
        if hasattr(captured, "copies"):  # the copies a launch enqueues, on the stub stream
            captured.feed = lambda: stream.enqueue(lambda: inputs.copy_(staging))
            captured.copies = tuple((lambda landing=landing: stream.enqueue(lambda: landing.copy_(output)))
                                    for landing in captured.landing)
        return next_tokens

    runner._capture = capture


def build_engine(args) -> Engine:
    config = PRESETS[args.model]
    if args.layers is not None:
        masks = (config.layer_masks * args.layers)[:args.layers]
        config = dataclasses.replace(config, n_layers=args.layers, layer_masks=masks)
    device = torch.device(args.device)
    if device.type == "cuda":
        from engine import bench

        return Engine(config, device, 0, weights=bench.device_random_weights(config, 0, device, torch.bfloat16))
    return Engine(config, device, 0)


def run_once(engine, runner, flags, prompts, max_tokens, profiler=None, schedulers=None, synced=None,
             launched=None) -> list[dict]:
    """One batched run, step by step as `Engine.generate_batch` runs it (the steps inside `paused_gc`); the
    profiler (if any) is on only inside steps that follow a capture or replay (the steady decode steps). The run's
    scheduler is appended to `schedulers` when given; each step's sync time (the runner's `synced_at`
    after a replayed step, else None) to `synced`; each step's launch time (perf_counter) to `launched`."""
    clock = time.perf_counter
    chunk = flags["prefill_chunk"]
    scheduler = Scheduler(runner.max_slots, runner.capacity, max(chunk, 2048), chunk)
    if schedulers is not None:
        schedulers.append(scheduler)
    dispatcher = Dispatcher(engine, flags, timed=False)
    arrived = clock()
    for prompt in prompts:
        scheduler.add(Sequence(prompt, max_tokens), arrived)
    steps, launched_ahead = [], None
    # one step, and the steps served with it (a graph of several steps); an older engine: one step per call
    next_steps = getattr(Engine, "_next_steps", None) or (lambda *args: [Engine._batch_step(*args)])
    with paused_gc():  # as generate_batch steps (an older engine without it: the collector stays on)
        while scheduler.has_work():
            steady = profiler is not None and steps and steps[-1]["graph"] in ("capture", "replay")
            if steady:
                profiler.enable()
            made = next_steps(scheduler, runner, dispatcher, clock)
            if steady:
                profiler.disable()
            steps += made
            for step in made:  # a served step: the sync time and launch of its graph's launching step
                if synced is not None:
                    synced.append(getattr(runner, "synced_at", None) if step["graph"] == "replay" else None)
                if launched is not None:  # launched ahead: the runner's stamp; else the step's start + host_us
                    launched.append(launched_ahead if launched_ahead is not None
                                    else step["started"] + step["host_us"] / 1e6)
            if launched is not None:
                ahead = getattr(runner, "ahead", None)
                launched_ahead = None if ahead is None else ahead.launched_at
    return steps


def breakdown(engine, runner, flags, prompts, max_tokens, steps: int) -> list[tuple[str, list[float]]]:
    """Each piece of a replayed step's path before its launch, timed per call (perf_counter around
    it) over the replayed steps of separate runs: (label, µs per replayed step) rows, nested rows
    indented; then the time between the pieces, host_us itself with the timers on, and an empty
    call timed the same way (the timer's own share of each row). A piece the runner does not have
    (an older runner) is left out."""
    clock = time.perf_counter
    spans: dict[str, list] = {}
    step = [None]

    def timed(label, function):
        calls = spans.setdefault(label, [])

        def wrapper(*args):
            started = clock()
            out = function(*args)
            calls.append((step[0], clock() - started))
            return out
        return wrapper

    def timed_schedule(function):
        calls = spans.setdefault("scheduler.schedule", [])

        def wrapper(scheduler, now=None):
            started = clock()
            batch = function(scheduler, now)
            spent = clock() - started
            step[0] = (id(scheduler), batch.step)  # what follows is charged to this step
            calls.append((step[0], spent))
            return batch
        return wrapper

    schedule = Scheduler.schedule
    saved = {name: getattr(runner, name) for name in ("_graph_for", "_current_stream", "_records", "_replay",
                                                      "run_ahead", "_pairs")
             if hasattr(runner, name)}
    if "run_ahead" in saved:  # the path of a step launched the usual way (a run-ahead step launches earlier)
        runner.run_ahead = False
    graphs = [(captured, getattr(captured, "launch", None), getattr(captured, "launches", None),
               getattr(captured, "copies", None))  # one launch (older runners) or one per instance
              for captured in runner._graphs.values() if hasattr(captured, "launch") or hasattr(captured, "launches")]
    Scheduler.schedule = timed_schedule(schedule)
    runner._graph_for = timed("BatchRunner._graph_for", saved["_graph_for"])
    runner._current_stream = timed("BatchRunner._current_stream", saved["_current_stream"])
    runner._replay = timed("BatchRunner._replay (inputs check + launch)", saved["_replay"])
    if saved.get("_pairs") is not None:  # a replay launched the usual way records the first pair
        events, records, *rest = saved["_pairs"][0]  # rest: wait (and elapsed, in a newer runner)
        runner._pairs = ((events, (timed("start event record", records[0]), timed("end event record", records[1])),
                          *rest), saved["_pairs"][1])
    elif saved.get("_records") is not None:
        runner._records = (timed("start event record", saved["_records"][0]),
                           timed("end event record", saved["_records"][1]))
    for captured, launch, instances, copies in graphs:
        if launch is not None:
            captured.launch = timed("graph launch", launch)
        if instances is not None:
            captured.launches = tuple(timed("graph launch", instance) for instance in instances)
        if copies:
            captured.copies = tuple(timed("copy of the outputs to a landing buffer", copy) for copy in copies)
    empty_label = "an empty call, timed the same way"
    empty = timed(empty_label, lambda: None)
    host, schedulers = {}, []
    try:
        while len(host) < steps:
            for record in run_once(engine, runner, flags, prompts, max_tokens, schedulers=schedulers):
                if record["graph"] == "replay":
                    host[(id(schedulers[-1]), record["step"])] = record["host_us"]
                    empty()
    finally:
        Scheduler.schedule = schedule
        for name, value in saved.items():
            setattr(runner, name, value)
        for captured, launch, instances, copies in graphs:
            if launch is not None:
                captured.launch = launch
            if instances is not None:
                captured.launches = instances
            if copies:
                captured.copies = copies
    order = [("scheduler.schedule", 0), ("BatchRunner._graph_for", 0), ("BatchRunner._current_stream", 0),
             ("start event record", 0), ("BatchRunner._replay (inputs check + launch)", 0), ("graph launch", 1),
             ("copy of the outputs to a landing buffer", 0), ("end event record", 0)]
    rows, between = [], dict(host)
    for label, depth in order:
        if not spans.get(label):
            continue
        per_step: dict = {}
        for key, spent in spans[label]:
            per_step[key] = per_step.get(key, 0.0) + spent * 1e6
        rows.append(("  " * depth + label, [per_step[key] for key in host if key in per_step]))
        if depth == 0:
            for key in host:
                between[key] -= per_step.get(key, 0.0)
    rows.append(("between them: clock reads, calls into run/_run/_run_replay, timers", list(between.values())))
    rows.append(("host_us with these timers on", list(host.values())))
    rows.append((empty_label, [spent * 1e6 for _, spent in spans[empty_label]]))
    return rows


def pieces(engine, runner, flags, prompts, max_tokens, steps: int) -> tuple[list[tuple[str, float]], float, float]:
    """Where the host's time per replayed step goes on the default path (run-ahead, graphs of several steps): the
    functions and C calls of the path, each timed per call (perf_counter around it) over separate runs, summed
    and divided by the replayed steps: (label, µs per replayed step) rows, nested calls indented under their
    caller (whose time includes theirs and their timers); then host_us per step with the timers on and the
    launches per replayed step. The sync's wait is timed too, and left out of the launching step's row, as
    host_us leaves it out. A launching step's row counts replayed steps only (not an eager or capture step's)."""
    clock = time.perf_counter
    wait_label, launching_label = "sync: the wait for the step's end event (not host time)", \
        "a step that launches (Engine._batch_step, less the sync's wait)"
    labels = [launching_label, "  Scheduler.schedule", "  Scheduler.reserve_next",
              "  BatchRunner._launch_ahead (the next launch, two in flight)", "    event record (C)",
              "    graph launch (C)", "  Dispatcher.replay (arm and launch counts)",
              "  elapsed time of the step's events (C)", "  Dispatcher.end_replay (the step's records)",
              "  Scheduler.postprocess", "the later steps of its graph (Engine._served_steps, one loop)",
              "  BatchRunner.take_served (the rows checked)", "  Dispatcher.replayed_records",
              "  Scheduler.serve_reserved", wait_label, "an empty call, timed the same way"]
    spent = dict.fromkeys(labels, 0.0)

    def timed(label, function):
        def wrapper(*args, **kwargs):
            started = clock()
            out = function(*args, **kwargs)
            spent[label] += clock() - started
            return out
        return wrapper

    batch_step = Engine._batch_step
    waits = [0.0]

    def launching(*args):  # a replayed step's time, less its wait
        waited = spent[wait_label]
        started = clock()
        out = batch_step(*args)
        if out["graph"] == "replay":
            spent[launching_label] += clock() - started - (spent[wait_label] - waited)
        else:
            waits[0] += spent[wait_label] - waited
        return out

    methods = [(Scheduler, "schedule", 1), (Scheduler, "reserve_next", 2), (BatchRunner, "_launch_ahead", 3),
               (runtime.Dispatcher, "replay", 6), (runtime.Dispatcher, "end_replay", 8), (Scheduler, "postprocess", 9),
               (Engine, "_served_steps", 10), (BatchRunner, "take_served", 11),
               (runtime.Dispatcher, "replayed_records", 12), (Scheduler, "serve_reserved", 13)]
    methods = [entry for entry in methods if hasattr(entry[0], entry[1])]
    saved = [(owner, name, vars(owner)[name]) for owner, name, _ in methods] + [(Engine, "_batch_step",
                                                                                  vars(Engine)["_batch_step"])]
    for owner, name, index in methods:
        function, static = getattr(owner, name), isinstance(vars(owner)[name], staticmethod)
        setattr(owner, name, staticmethod(timed(labels[index], function)) if static else timed(labels[index], function))
    Engine._batch_step = staticmethod(launching)
    pairs = runner._pairs
    graphs = [graph for captured in runner._graphs.values()
              for graph in (captured, captured.block, *captured.tails) if graph is not None]
    launches = {id(graph): graph.launches for graph in graphs}
    runner._pairs = tuple((events, tuple(timed(labels[4], record) for record in records), timed(wait_label, wait),
                           timed(labels[7], elapsed)) for events, records, wait, elapsed in pairs)
    for graph in graphs:
        graph.launches = tuple(timed(labels[5], launch) for launch in graph.launches)
    empty = timed(labels[-1], lambda: None)
    host, launched = [], 0
    try:
        while len(host) < steps:
            before = runner.run_ahead_launches
            for record in run_once(engine, runner, flags, prompts, max_tokens):
                if record["graph"] == "replay":
                    host.append(record["host_us"])
                    empty()
            launched += runner.run_ahead_launches - before
    finally:
        for owner, name, function in saved:
            setattr(owner, name, function)
        runner._pairs = pairs
        for graph in graphs:
            graph.launches = launches[id(graph)]
    spent[wait_label] -= waits[0]  # the replayed steps' waits only
    return [(label, seconds * 1e6 / len(host)) for label, seconds in spent.items()], statistics.fmean(host), \
        launched / len(host)


class GcPauses:
    """Collections the garbage collector ran (and their time) while it is installed."""

    def __init__(self) -> None:
        self.count, self.full, self.seconds, self._started = 0, 0, 0.0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        self.seconds += time.perf_counter() - self._started
        self.count += 1
        self.full += info["generation"] == 2


def summary(values: list[float]) -> str:
    ordered = sorted(values)
    return (f"mean {statistics.fmean(values):7.2f}  median {statistics.median(values):7.2f}  "
            f"p10 {ordered[len(ordered) // 10]:7.2f}  p90 {ordered[9 * len(ordered) // 10]:7.2f}  (n={len(values)})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--model", default="demo", choices=sorted(PRESETS))
    parser.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5000, help="replayed decode steps to time")
    parser.add_argument("--tokens", type=int, default=500, help="tokens per sequence per run")
    parser.add_argument("--prompt", type=int, default=8, help="prompt tokens per sequence")
    parser.add_argument("--set", dest="set_flags", action="append", default=[], metavar="FLAG=VALUE")
    parser.add_argument("--no-gc", action="store_true",
                        help="disable the garbage collector while timing (isolates its pauses from the code's cost)")
    parser.add_argument("--profile", action="store_true", help="print the top cProfile entries")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--pieces", action="store_true",
                        help="also time the functions and C calls of the default path (run-ahead, graphs of several "
                             "steps) per replayed step (separate runs)")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time each piece of the path before the launch, per call (separate runs)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible")

    engine = build_engine(args)
    flags = flag_registry.resolve(args.set_flags, environ={})
    tokens = min(args.tokens, engine.config.max_seq_len - args.prompt)
    runner = BatchRunner(engine, args.batch, args.prompt + tokens - 1, graphs=True)
    if engine.device.type == "cpu":
        stub_graphs(runner)
    prompts = [[(7 * row + 3 * index) % engine.config.vocab_size for index in range(args.prompt)]
               for row in range(args.batch)]
    modes = [False, True] if hasattr(runner, "run_ahead") else [None]
    loops = {}
    with torch.inference_mode():
        run_once(engine, runner, flags, prompts, tokens)  # warm-up: the capture, caches, allocator
        for mode in modes:  # run-ahead off, then on (what the rest of the report shows)
            if mode is not None:
                runner.run_ahead = mode
            host, loop, device, launch_loop, gap = [], [], [], [], []
            by_kind = {"launching": [], "served": []}  # host_us of a graph's first step and of its later ones
            copies_before, replays_before = getattr(runner, "input_copies", None), 0
            ahead_before = getattr(runner, "run_ahead_launches", 0)
            profiler = cProfile.Profile() if args.profile and mode is not False else None
            pauses = GcPauses()
            gc.callbacks.append(pauses)
            if args.no_gc:
                gc.disable()
            while len(host) < args.steps:
                synced, launched = [], []
                steps = run_once(engine, runner, flags, prompts, tokens, profiler, synced=synced, launched=launched)
                replays = [index for index, step in enumerate(steps) if step["graph"] == "replay"]
                if not replays:
                    raise SystemExit(f"no replayed steps: {[step['eager_reason'] for step in steps]}")
                host += [steps[index]["host_us"] for index in replays]
                for index in replays:
                    by_kind["served" if steps[index].get("span_index") else "launching"].append(steps[index]["host_us"])
                replays_before += len(replays)
                device += [steps[index]["device_us"] for index in replays if steps[index]["device_us"] is not None]
                loop += [(steps[index + 1]["started"] - steps[index]["started"]) * 1e6
                         for index in replays if index + 1 < len(steps)]
                pairs = [index for index in replays if index + 1 < len(steps) and steps[index + 1]["graph"] == "replay"]
                launch_loop += [(launched[index + 1] - launched[index]) * 1e6 for index in pairs]
                gap += [(launched[index + 1] - synced[index]) * 1e6 for index in pairs if synced[index] is not None]
            gc.callbacks.remove(pauses)
            gc.enable()
            loops[mode] = (loop, launch_loop, gap, getattr(runner, "run_ahead_launches", 0) - ahead_before)
        if args.pieces:
            runner.run_ahead = True
        parts = pieces(engine, runner, flags, prompts, tokens, args.steps) if args.pieces else None
        pieces_before = breakdown(engine, runner, flags, prompts, tokens, args.steps) if args.breakdown else None
    config = engine.config
    print(f"{config.name}, {config.n_layers} layer(s), batch {args.batch}, {args.device}"
          f"{' (stub graph)' if args.device == 'cpu' else ''}; torch {torch.__version__}, "
          f"python {sys.version.split()[0]}; replayed decode steps per run: {len(replays)}; "
          f"steps_per_graph={flags.values.get('steps_per_graph', 1)}")
    if flags.values.get("steps_per_graph", 1) > 1:
        print("  (a graph of several steps serves its later steps from the host: they start with its launch and "
              "launch nothing, so the loop rows below mix launches with served steps, and the breakdown times "
              "only the launching steps; --set steps_per_graph=1 for one launch per step)")
    on = "" if modes == [None] else " (run-ahead on)"
    print(f"host_us per replayed step (bench's host µs/step){on}:  {summary(host)}")
    if by_kind["served"]:  # graphs of several steps: the steps that launch (and sync) and those served
        print(f"  of which steps that launch a graph:                  {summary(by_kind['launching'])}")
        print(f"  of which later steps of a graph, served from the host: {summary(by_kind['served'])}")
    for mode, (mode_loop, launch_loop, gap, ahead) in loops.items():
        label = {None: "", False: "run-ahead off: ", True: f"run-ahead on ({ahead} launched ahead): "}[mode]
        print(f"{label}host loop per replayed step (start to next start):   {summary(mode_loop)}")
        print(f"{label}host loop per replayed step (launch to next launch): {summary(launch_loop)}")
        print(f"{label}next replay's launch minus this step's sync:         {summary(gap)}")
    if device:
        print(f"device_us per replayed step:                      {summary(device)}")
    if copies_before is not None:
        print(f"replays that copied their inputs in: {runner.input_copies - copies_before} of {replays_before} "
              f"(one per run: its first replay; a steady cohort feeds itself)")
    print(f"garbage collections while timing: {pauses.count} ({pauses.full} full), "
          f"{pauses.seconds * 1e6 / max(1, len(host)):.2f} µs per replayed step on average")
    if pieces_before is not None:
        print("before the launch of a replayed step, per call in µs (separate runs with timers on, which slow what "
              "they time: compare the last two rows with host_us above; each piece holds one empty call's time):")
        for label, values in pieces_before:
            print(f"  {label:<72} {summary(values)}")
    if parts is not None:
        rows, timed_host, launched = parts
        print(f"the default path (run-ahead, {launched:.3f} launches per replayed step), µs per replayed step, summed "
              f"over separate runs with timers on (host_us then {timed_host:.2f}; a row holds its nested rows and "
              f"their timers):")
        for label, per_step in rows:
            print(f"  {label:<80} {per_step:8.2f}")
    if profiler is not None:
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumulative").print_stats(args.top)
        print(text.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
