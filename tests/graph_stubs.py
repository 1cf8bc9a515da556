"""Shared by the CPU tests of the batch runner's graph path (tests/test_graph_replay_host.py,
tests/test_graph_steps_host.py): bench/host_step.py's stub graphs, loaded once as a module; a runner
that takes the graph path with them; a driver that steps a run as Engine.generate_batch does; and step
records without their clocks."""

import importlib.util
import time
from pathlib import Path

from engine import flags
from engine.batch_runner import BatchRunner
from engine.runtime import Dispatcher, Engine
from engine.scheduler import Scheduler
from engine.sequence import Sequence

_SPEC = importlib.util.spec_from_file_location("host_step",
                                               Path(__file__).resolve().parents[1] / "bench" / "host_step.py")
host_step = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(host_step)


def stub_runner(engine, slots, capacity, run_ahead=True, race=False):
    runner = BatchRunner(engine, slots, capacity, graphs=True)
    host_step.stub_graphs(runner, run_ahead, race)
    return runner


def drive(engine, runner, prompts, max_tokens, add_later=(), steps_per_graph=1):
    """Run as Engine.generate_batch does, watching each step: after it, what was launched ahead (the
    step's rows' state then, and the positions the launched replay writes). `add_later`: (after step
    index, prompt, max_tokens) sequences added between steps. Returns (sequences, step records, launched
    ahead, counters)."""
    resolved = flags.resolve([f"steps_per_graph={steps_per_graph}"], environ={})
    chunk = resolved["prefill_chunk"]
    scheduler = Scheduler(runner.max_slots, runner.capacity, max(chunk, 2048), chunk)
    dispatcher = Dispatcher(engine, resolved, timed=False)
    counts = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else max_tokens
    sequences = [Sequence(prompt, count) for prompt, count in zip(prompts, counts)]
    for sequence in sequences:
        scheduler.add(sequence, 0.0)
    steps, launched = [], []
    while scheduler.has_work():
        before = len(steps)
        steps.extend(Engine._next_steps(scheduler, runner, dispatcher, time.perf_counter))
        ahead = runner.ahead
        if ahead is not None:
            launched.append({"after": steps[-1]["step"], "waiting": len(scheduler.waiting),
                             "left": [s.max_tokens - len(s.generated) for s in scheduler.running],
                             "positions": [position for _, _, position in ahead.expected]})
        for index, prompt, count in add_later:
            if before <= index < len(steps):  # after that step, or after the served steps it came with
                sequence = Sequence(prompt, count)
                sequences.append(sequence)
                scheduler.add(sequence, 0.0)
    return sequences, steps, launched, dispatcher.counters.to_json()


def without_clocks(steps, clocks):
    """The records without the fields in `clocks`, request ids as their order of first appearance (each
    run's sequences get fresh ids)."""
    order: dict[int, int] = {}
    out = []
    for step in steps:
        record = {key: value for key, value in step.items() if key not in clocks}
        record["rows"] = [{**row, "request_id": order.setdefault(row["request_id"], len(order))}
                          for row in step["rows"]]
        out.append(record)
    return out
