"""CUDA-graph capture of a decode step, in one place: what a captured step is (`DecodeGraph`), when a step
cannot be captured (`capture_blocker`), and the capture itself (`capture`).

A decode cohort of B rows in cache rows 0..B-1 is captured the first time it occurs, per (B, flags): the
step runs once eagerly from static buffers (the warm-up the capture needs, and a real step), then twice
into graphs, two instances launched alternately so two replays can be in flight. Each instance writes the
step's outputs straight into its own pinned host buffer (`landing`: each row's next token, then each MoE
layer's woken-expert count) and feeds the next replay its own inputs (tokens one position on), so a steady
cohort's replay copies nothing either way. With steps_per_graph = K > 1 the same step is also captured K
times in a row into one graph (`block`), step k writing row k of a [K, B + layers] landing buffer, and
graphs of K/2, ..., 2 steps beside it (`tails`) for a run's last steps. A replay counts the launches its
capture recorded (`kernels`, per step `step_launches`), since replayed kernels never pass through Python.

Knows nothing of scheduling or of the runner's launch path (engine.batch_runner replays what is here).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable

import torch

from engine import dispatch, routing_record
from engine.arms import ARMS
from engine.attention_dispatch import UNFUSED, decide_layer_attention
from engine.decode_fused import StepOutputs, carried_launches
from engine.dispatcher import Dispatcher
from engine.model import StepLayout, forward
from engine.scheduler import DECODE, Batch
from engine.weight_format import expert_format
from kernels import launches


def _launcher(graph) -> Callable[[], None]:
    """graph.replay without torch's Python layer: torch.cuda.CUDAGraph.replay checks input liveness when
    the capture asked for it (ours does not: `_tracker` is None), then calls the C replay."""
    if isinstance(graph, torch.cuda.CUDAGraph) and getattr(graph, "_tracker", None) is None:
        return super(torch.cuda.CUDAGraph, graph).replay
    return graph.replay


@dataclass
class DecodeGraph:
    """A captured decode step: two instances of it, launched alternately, each of whose kernels write the
    step's outputs straight into its own pinned host buffer, so a launch copies nothing."""

    graphs: tuple  # two torch.cuda.CUDAGraph instances of the step
    inputs: torch.Tensor  # [2, B] int64 static: row 0 the tokens fed, row 1 their positions
    staging: torch.Tensor  # [2, B] int64 pinned host copy of the next inputs
    # per instance, [B + MoE layers] int64 pinned: the next tokens, then each layer's woken experts; a step
    # reads its own after its sync while the next step in flight writes the other
    landing: tuple
    template: object  # the capture's Dispatcher: decisions, arm counts, observed-count outputs
    kernels: dict[str, int]  # Triton launches the capture recorded (and a replay repeats)
    # What `inputs` holds after the last replay (the graph feeds its own output one position on):
    # one (request id, token, position) per row; a step that matches needs no host->device copy.
    holds: list[tuple[int, int, int]] | None = None
    turn: int = 0  # the instance / landing buffer of the next launch (alternates per launch)
    steps: int = 1  # decode steps one launch runs; a block's landing buffers are [steps, B + MoE layers]
    # The graph of `steps_per_graph` steps beside this one-step graph (same inputs, its own two instances and
    # landing buffers; its `kernels` are per step), or None. Its launches take this graph's `turn` and `holds`.
    block: "DecodeGraph | None" = None
    # Graphs of fewer steps beside `block`, halving down to 2 (K / 2, K / 4, ...: a run's last steps, fewer than
    # K, still go by few launches), largest first; like `block`, or empty.
    tails: tuple = ()
    # A block's launches per step when they differ from `kernels` (a step whose first norm the step before carried:
    # engine.decode_fused.StepOutputs.carry), else None; and the buffers its graphs write and read besides.
    step_kernels: tuple[dict[str, int], ...] | None = None
    buffers: tuple = ()
    # Per instance, [steps, B, V] float32 pinned: each step's logits, copied by the graph itself, where the run
    # keeps them (the dispatcher's `keep_logits`: compare and the TUI's side-by-side error); else None.
    logits: tuple | None = None
    # Per instance, [steps, B, W] int16 pinned: each step's packed routing (engine.routing_record), copied by the
    # graph itself, where the run records it (the flag record_routing); else None. `routing_layers`: the MoE
    # layers packed, in order; `routing_device`: the device buffers the graph packs into (kept alive with it).
    routing: tuple | None = None
    routing_layers: tuple = ()
    routing_device: tuple = ()
    routing_views: tuple | None = field(init=False, repr=False)  # numpy views of `routing`, read at a sync
    launches: tuple[Callable[[], None], ...] = field(init=False, repr=False)  # per turn
    feed: Callable[[], object] | None = field(init=False, repr=False)  # enqueue staging -> inputs
    # The launches of steps 1 .. steps - 1 (served from the host after the launch's sync), as (launches, steps)
    # groups of consecutive equal ones: what serving them counts, one group at a time.
    later_kernels: tuple[tuple[dict[str, int], int], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        groups: list[list] = []
        for index in range(1, self.steps):
            kernels = self.step_launches(index)
            if groups and groups[-1][0] == kernels:
                groups[-1][1] += 1
            else:
                groups.append([kernels, 1])
        self.later_kernels = tuple((kernels, times) for kernels, times in groups)
        inputs = self.inputs
        # Tensor.copy_ is a C method: the partial costs one call; non_blocking from pinned host memory, so it
        # is only enqueued on the current stream (the replay's).
        self.feed = None if inputs is None else partial(inputs.copy_, self.staging, non_blocking=True)
        self.launches = tuple(_launcher(graph) for graph in self.graphs)
        self.routing_views = None if self.routing is None else tuple(landing.numpy() for landing in self.routing)

    def step_launches(self, index: int) -> dict[str, int]:
        """The launches of this graph's step `index` (`kernels`, unless a step before carried its first norm)."""
        return self.kernels if self.step_kernels is None else self.step_kernels[index]


def capture_blocker(runner, size: int, dispatcher) -> str:
    config, flags = runner.engine.config, dispatcher.flags
    weights = runner.engine.weights
    first_moe = config.moe_layers[0]
    coded = expert_format(weights, first_moe).coded
    trellis = dispatcher.trellis_gate(weights[f"layers.{first_moe}.w13"], weights[f"layers.{first_moe}.w2"]) \
        if coded else {}  # the trellis arm the layers will take (engine.dispatcher): they never sync
    # every MoE layer's decision (a calibration from a routing recording gives each layer its own crossover)
    for crossover in {dispatcher.crossover, *getattr(dispatcher, "layer_crossovers", {}).values()}:
        gate = dispatch.GateInputs(
            n_tokens=size, k=config.top_k, n_experts=config.n_experts, tile_m=flags["tile_m"],
            policy=flags["moe_gate"], decode_floor=flags["decode_floor"], moe_max_tokens=flags["moe_max_tokens"],
            grouped_variant=flags["grouped_variant"], measured_crossover=crossover)
        decision = dispatch.decide(replace(gate, **trellis) if coded else gate)
        if not config.plain_experts and decision.arm != dispatch.GEMV:
            return (f"this family's experts (biases, clamped SwiGLU) run on the reference arm at the {decision.arm} "
                    f"arm's widths, which syncs the host; only the GEMV arm computes them on the device")
        if coded and (decision.arm == dispatch.REFERENCE or not ARMS[decision.arm].supports(runner.device)):
            return "trellis experts on the reference arm (it dequantizes the woken experts) sync the host"
        if decision.arm == dispatch.REFERENCE or not ARMS[decision.arm].supports(runner.device):
            return "the MoE reference arm syncs the host (torch.unique), which a CUDA graph cannot capture"
    for layer in range(config.n_layers):
        attention = decide_layer_attention(config, layer, flags)
        if attention.arm == UNFUSED:
            return "the unfused attention reference syncs the host, which a CUDA graph cannot capture"
    return ""


def capture(runner, batch: Batch, dispatcher, key: tuple, values: list[list[int]]) -> torch.Tensor:
    """Run this step eagerly from static buffers (the warm-up a capture needs), then capture it: the
    one-step graph, and with the flag steps_per_graph > 1 the graph of that many steps beside it."""
    config, size = runner.engine.config, len(batch.rows)
    inputs = torch.tensor(values, dtype=torch.int64, device=runner.device)  # [2, B] static
    layout = StepLayout(inputs[1], runner.capacity)  # rows 0..B-1, the whole cache as keys
    tokens = inputs[0].view(size, 1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # as an eager step computes its tokens (eager and graphed runs count alike)
        next_tokens = runner._next_tokens(tokens, layout, dispatcher, True)
    torch.cuda.current_stream().wait_stream(side)

    # Two instances of the step, launched alternately (run-ahead keeps two in flight). Each writes the step's
    # outputs straight into its own pinned host buffer, which the host reads after the step's sync: the
    # next tokens, then each MoE layer's woken-expert count (what `end_step_batch` concatenates on an eager
    # step). The folds write there where they run (engine.decode_fused.StepOutputs: the router's count,
    # the LM head's argmax, which also feeds the next replay its inputs); what they did not write is
    # copied or written there after the forward. A launch then copies nothing (bench/experiments/probe_launch.py:
    # a Triton store into pinned host memory, and a device-to-host copy captured in a graph, both land).
    landing = tuple(torch.empty(size + config.n_moe_layers, dtype=torch.int64, pin_memory=True) for _ in range(2))
    logits = _logit_landings(runner, dispatcher, 1, size)
    routing = _routing_landings(runner, dispatcher, 1, size)
    try:
        graphs, template, per_step = _capture_instances(runner, batch, dispatcher, inputs, tokens, layout,
                                                        [observed.view(1, -1) for observed in landing],
                                                        logits=logits, routing=routing)
        counted = per_step[0][0]
    except Exception as error:  # noqa: BLE001 - a kernel that cannot be captured: say so, run eagerly
        runner._refused[key] = f"capture failed: {type(error).__name__}: {str(error).splitlines()[0][:160]}"
        return next_tokens
    staging = torch.empty((2, size), dtype=torch.int64, pin_memory=True)
    captured = runner._graphs[key] = DecodeGraph(graphs, inputs, staging, landing, template, counted, logits=logits,
                                                 **_routing_fields(routing))
    steps = dispatcher.flags["steps_per_graph"]
    if steps > 1:
        # The graph of several steps: the same step captured `steps` times in a row, each step's outputs in
        # its own row of the instance's landing buffer, each step feeding the next its inputs on the device;
        # then, for a run's last steps, graphs of half as many, down to 2 (`tails`).
        # Each step but the last may carry the next one's first norm (the LM head's pick writes it into these
        # buffers, one pair per instance, shared by the graphs, which never run at once); the launches of each
        # step are checked against the one-step graph's.
        carry = tuple((torch.empty((size, config.hidden), dtype=runner.engine.dtype, device=runner.device),
                       torch.empty((size, config.hidden), dtype=runner.engine.dtype, device=runner.device))
                      for _ in range(2)) if dispatcher.flags["carry_norm"] else (None, None)
        blocks = []
        while steps > 1:
            block = _capture_block(runner, batch, dispatcher, key, inputs, tokens, layout, staging, template, counted,
                                   steps, carry)
            if block is None:
                break
            blocks.append(block)
            steps //= 2
        if blocks:
            captured.block, captured.tails = blocks[0], tuple(blocks[1:])
    return next_tokens


def _logit_landings(runner, dispatcher, steps: int, size: int) -> tuple | None:
    """Two [steps, B, V] float32 pinned buffers a graph copies each step's logits into, where the run keeps
    them; else None (the graph then writes only tokens and counts)."""
    if not dispatcher.keep_logits:
        return None
    vocab = runner.engine.config.vocab_size
    return tuple(torch.empty((steps, size, vocab), dtype=torch.float32, pin_memory=True) for _ in range(2))


def _routing_landings(runner, dispatcher, steps: int, size: int) -> tuple | None:
    """Where the run records routing (the dispatcher's `routing`): (the MoE layers, per instance a [steps, B, W]
    int16 pinned landing buffer, per instance a device buffer of the same shape the graph packs each step into);
    else None. The layers are the ones the capture's eager step routed (still pending on `dispatcher`)."""
    if dispatcher.routing is None:
        return None
    layers = tuple(layer for layer, _, _ in dispatcher.pending_routing)
    words = routing_record.words_per_token(len(layers), runner.engine.config.top_k)
    host = tuple(torch.empty((steps, size, words), dtype=torch.int16, pin_memory=True) for _ in range(2))
    device = tuple(torch.empty((steps, size, words), dtype=torch.int16, device=runner.device) for _ in range(2))
    return layers, host, device


def _routing_fields(routing: tuple | None) -> dict:
    if routing is None:
        return {}
    return {"routing": routing[1], "routing_layers": routing[0], "routing_device": routing[2]}


def _capture_block(runner, batch: Batch, dispatcher, key, inputs, tokens, layout, staging, template,
                   counted: dict[str, int], steps: int, carry: tuple) -> "DecodeGraph | None":
    """The graph of `steps` steps (`_DecodeGraph.block` or one of its `tails`), or None with a note in
    `block_notes` (the one-step graph and any larger graph captured serve)."""
    size = inputs.shape[1]
    landings = tuple(torch.empty((steps, size + runner.engine.config.n_moe_layers), dtype=torch.int64,
                                 pin_memory=True) for _ in range(2))
    logits = _logit_landings(runner, dispatcher, steps, size)
    routing = _routing_landings(runner, dispatcher, steps, size)
    try:
        graphs, _, per_step = _capture_instances(runner, batch, dispatcher, inputs, tokens, layout, landings, carry,
                                                 logits, routing)
        expected = [carried_launches(counted, index > 0 and per_step[index - 1][1], carried_out)
                    for index, (_, carried_out) in enumerate(per_step)]
        if [launched for launched, _ in per_step] != expected:
            raise RuntimeError(f"{steps} steps launch {[launched for launched, _ in per_step]}, not {expected}")
    except Exception as error:  # noqa: BLE001 - the one-step graph serves; the steps say span 1
        runner.block_notes[key] = (f"graph of {steps} steps not captured: {type(error).__name__}: "
                                   f"{str(error).splitlines()[0][:160]}")
        return None
    chained = any(carried_out for _, carried_out in per_step)
    return DecodeGraph(graphs, inputs, staging, landings, template, counted, steps=steps,
                       step_kernels=tuple(expected) if chained else None, buffers=carry, logits=logits,
                       **_routing_fields(routing))


def _capture_instances(runner, batch: Batch, dispatcher, inputs, tokens, layout, landings: list,
                       carry: tuple = (None, None), logits: tuple | None = None, routing: tuple | None = None
                       ) -> tuple[tuple, object, list[tuple[dict[str, int], bool]]]:
    """One graph per landing buffer [steps, B + MoE layers], each the decode step captured `steps` times in
    a row, step k writing its outputs into row k (and, with `logits`, its logits into row k of that instance's
    [steps, B, V] buffer); the first step's template dispatcher (its decisions and outputs, which a replay
    copies per step) and, per step of an instance, its launches and whether its LM head carried the next
    step's first norm into that instance's `carry` buffers (x, h; None: no carry).

    With `routing` (`_routing_landings`), each step's routing is packed into the instance's device buffer on a
    side stream forked after the step, and the whole buffer is copied to the instance's landing buffer once,
    after the last step, the side stream joined at the graph's end: the packs and the copy run beside the next
    steps' kernels, off the chain of launches programmatic dependent launch overlaps."""
    from kernels.next_tokens import next_tokens as next_tokens_into  # Triton: GPU only

    config, weights, size = runner.engine.config, runner.engine.weights, inputs.shape[1]
    graphs, templates, counted = [], [], []
    side = torch.cuda.Stream() if routing is not None else None
    for instance, (landing, buffers) in enumerate(zip(landings, carry)):
        logit_landing = None if logits is None else logits[instance]
        steps = []  # made before the capture: nothing of a dispatcher's set-up belongs in the graph
        for index, observed in enumerate(landing):
            template = Dispatcher(runner.engine, dispatcher.flags, timed=False)
            template.begin_step(batch.step + index, DECODE, size)
            steps.append((template, observed))
        per_step = []
        captured_from = launches.snapshot()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=runner._pool):
                carried = None
                for index, (template, observed) in enumerate(steps):
                    before = launches.snapshot()
                    template.outputs = outputs = StepOutputs(
                        observed, inputs, carry=buffers if index + 1 < len(steps) else None, carried=carried)
                    try:
                        step_logits = forward(config, weights, tokens, layout, runner.cache, template)  # [B, V]
                    finally:
                        template.outputs = None
                    if logit_landing is not None:
                        logit_landing[index].copy_(step_logits, non_blocking=True)
                    woken = template.pending_woken
                    if len(woken) != config.n_moe_layers:
                        raise RuntimeError(f"{len(woken)} woken counts for {config.n_moe_layers} MoE layers")
                    if any(count.data_ptr() != observed[size + layer].data_ptr()
                           for layer, count in enumerate(woken)):
                        observed[size:].copy_(torch.stack([count.long() for count in woken]), non_blocking=True)
                    # The cohort's next step feeds these tokens one position on: the graph prepares its own
                    # inputs (for its own next step, or the next replay), so a steady cohort needs no
                    # host->device copy (the host checks, see `holds`). One kernel where the LM head did not:
                    # argmax into `observed`, the same tokens into inputs[0], inputs[1] + 1.
                    if not outputs.picked:
                        next_tokens_into(step_logits.float(), observed, inputs)
                    per_step.append((launches.since(before), outputs.carried_out))
                    carried = buffers if outputs.carried_out else None
                    if routing is not None:
                        _pack_routing(template, routing, routing[2][instance][index], side)
                if routing is not None:  # every step's rows at once, then the side stream joins the graph
                    with torch.cuda.stream(side):
                        routing[1][instance].copy_(routing[2][instance], non_blocking=True)
                    torch.cuda.current_stream().wait_stream(side)
        finally:
            for name, count in launches.since(captured_from).items():  # captured, not launched: replays count them
                launches.record(name, -count)
        counted.append(per_step)
        graphs.append(graph)
        templates.append(steps[0][0])
    if counted[0] != counted[1]:
        raise RuntimeError(f"the two instances launch {counted[0]} and {counted[1]}")
    return tuple(graphs), templates[0], counted[0]


def _pack_routing(template: Dispatcher, routing: tuple, out: torch.Tensor, side) -> None:
    """Inside a capture: the step's routing (pending on its template) packed into `out` [B, W] on `side`, after
    the step's work on the capturing stream."""
    layers = tuple(layer for layer, _, _ in template.pending_routing)
    if layers != routing[0]:
        raise RuntimeError(f"the captured step routed MoE layers {layers}, its eager step {routing[0]}")
    # any cast (ids not int32, weights not bf16: none on the presets' paths) on the capturing stream, kept alive
    # with the template, so the side stream only reads
    template.routing_inputs = views = routing_record.int16_views(
        [(ids, weights) for _, ids, weights in template.pending_routing])
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cat(views, dim=1, out=out)
