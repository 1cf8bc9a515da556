"""The MoE arms sweep: times every MoE arm on one layer per token count, against this GPU's own
ceilings measured in the same run, and finds the GEMV/grouped crossover the `measured` gate uses.

Shape legend: n = tokens, k = experts per token, E = experts, D = hidden, F = expert intermediate.

Per token count n it reports
    woken experts   observed (distinct experts in the drawn routing, mean over the rotated sets)
    bandwidth bound (woken * 3*D*F weights + n*D read + n*D written) * bytes / copy bandwidth
    tensor bound    2 * n*k * 3*D*F FLOPs / bf16 matmul rate
    each arm        median device µs per call, its ratio to the larger bound, its relative error
                    against `moe_reference` on the same inputs, and its launches per call
    align           median µs of `moe_align` alone (the sort/schedule every grouped call pays)

How it times (each arm's row says which; docs/ab.md gives the why), inputs (x, routing) rotating
among ROTATIONS sets either way:
    graph (default: the runtime's way)  calls back to back captured in one CUDA graph, launched with the
        options the runtime's launches use (kernels.pdl: programmatic dependent launch on Hopper; the
        weights' L2 policy of kernels.streaming), replayed; the median over replays of the replay's
        device time over its calls. As in a decode step's graph, each call's first kernel launches while
        the one before drains and the L2 holds what the calls before left there. The calibration that
        `moe_gate=measured` reads is written only from this method.
    cold: before each timed call a clean read of twice the L2 evicts everything (a read, not a write,
        so no dirty lines are written back inside the timed call), then a device spin gives the host time
        to queue all of the arm's launches, and CUDA events bracket that one eager call: a cold-cache,
        one-call figure (its ramp-up and drain counted whole). Median of up to MAX_REPS calls.
An arm that a graph cannot capture is timed cold, and its row says so.

Routing (the token sets' expert ids): uniform by default; `skew` > 0 (`--skew zipf:S`) draws each token's k
experts weighted by a Zipf popularity over a fixed random order of the experts; `routing` (`--routing FILE`, a
recording of this model's routing: engine.routing_file) times every arm again on each recorded MoE layer's ids
(engine.routing_replay: windows of n consecutive recorded tokens), beside the uniform rows, and reports per layer
the observed woken experts, pairs per woken expert and tile fill against the uniform prediction and the crossover
that layer would want. The calibration is then written from the recording: the model's crossover (its layers' µs
summed per n) and each layer's, with the file named, for `moe_gate=measured` to read per layer.

Knows nothing of screens or sessions; the model shapes are a local table until the preset
registry (engine/config.py) lands.
"""

from __future__ import annotations

import datetime as _datetime
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from engine import calibration, routing_replay
from engine.errors import MeasurementError, UserError
from engine.flags import LAUNCH_FLAGS
from engine.provenance import commit_and_dirty


@dataclass(frozen=True)
class MoeShape:
    experts: int  # E
    top_k: int  # k
    hidden: int  # D
    intermediate: int  # F

    def expert_weight_bytes(self, element_bytes: int = 2) -> int:
        """w13 (2F x D) plus w2 (D x F) of one expert."""
        return 3 * self.hidden * self.intermediate * element_bytes


def moe_shape(model: str) -> MoeShape:
    """The MoE layer shape of a preset (engine.config), so the sweep times what the model runs."""
    from engine.model_source import model_config

    config = model_config(model)  # a preset, or a checkpoint directory's config.json
    return MoeShape(experts=config.n_experts, top_k=config.top_k, hidden=config.hidden,
                    intermediate=config.intermediate)


ARMS = ("gemv", "grouped_v0", "grouped_v1", "grouped_v2", "torch_grouped_mm")
GROUPED_ARMS = ("grouped_v0", "grouped_v1", "grouped_v2")
# trellis experts (--experts trellis:K=2,code=hyb): their three arms, timed on random packed codes
TRELLIS_ARMS = ("trellis_gemv", "trellis_grouped", "trellis_dequant")
DEFAULT_TOKENS = (1, 2, 4, 8, 9, 16, 32, 64, 128, 256, 512, 683, 1024, 2048, 4096, 8192)
MAX_TOKENS = 65536
ROTATIONS = 4  # routing / activation sets cycled through the timed calls
MIN_REPS = 5
MAX_REPS = 100
BUDGET_MS = 150.0  # target timed milliseconds per (arm, n); MIN_REPS wins for slow calls
SPIN_CYCLES = 1_000_000  # ~0.5 ms at H200 clocks: longer than any arm's host launch time
MATMUL_SIZE = 8192
COPY_BYTES = 1 << 30  # bytes of the copy source (the copy moves twice this)
CHECK_TOLERANCE = 1e-2  # relative error vs reference in bf16 (see tests/test_moe_kernels.py)
TIMINGS = ("graph", "cold", "neighbours")
GRAPH_REPLAY_US = 1000.0  # calls per captured graph: about a millisecond of them, so a replay's ends weigh little
MAX_GRAPH_CALLS = 64
TIMING_DESCRIPTIONS = {
    "graph": "the runtime's way: calls back to back in one CUDA graph replay (PDL and the weights' L2 policy as "
             "the runtime launches them, L2 warm from the calls before), device time per call, median over replays",
    "cold": "one eager call after a clean 2x-L2 read and a device spin, CUDA events around it, median over calls",
    "neighbours": "between the runtime's neighbours: a graph of (router, arm, next norm) calls less one of (router, "
                  "next norm) calls, per call, median over replays (what the step's profile calls the arm's adds µs)",
}


def parse_tokens(text: str) -> tuple[int, ...]:
    """'1,2,4' -> (1, 2, 4), sorted and without repeats; a bad value is a UserError naming it."""
    values = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or not 1 <= int(part) <= MAX_TOKENS:
            raise UserError(f"--tokens: {part!r} is not a token count; give integers in 1..{MAX_TOKENS} "
                            "separated by commas, e.g. --tokens 1,2,4,8,16")
        values.append(int(part))
    return tuple(sorted(set(values)))


def parse_skew(text: str) -> float:
    """'uniform' -> 0.0, 'zipf:S' -> S (a Zipf exponent >= 0; zipf:0 is uniform)."""
    value = text.strip().lower()
    if value == "uniform":
        return 0.0
    head, _, exponent = value.partition(":")
    try:
        skew = float(exponent) if head == "zipf" and exponent else math.nan
    except ValueError:
        skew = math.nan
    if not (math.isfinite(skew) and 0 <= skew <= 100):
        raise UserError(f"--skew {text!r}: give uniform or zipf:S with a Zipf exponent 0 <= S <= 100 "
                        f"(e.g. zipf:1.2); a recorded run's routing is --routing FILE")
    return skew


def parse_layers(text: str) -> tuple[int, ...]:
    """'0,3' -> (0, 3): MoE layers of a routing file to time (its own layer indices)."""
    values = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit():
            raise UserError(f"--layers: {part!r} is not a layer index; give MoE layer indices separated by commas")
        if int(part) not in values:
            values.append(int(part))
    return tuple(values)


def parse_experts(text: str):
    """'bf16' -> None; 'trellis:K=2,code=hyb' -> that TrellisCode (engine.trellis_job's syntax, as `quantize`
    takes it). UserError otherwise."""
    if text.strip() == "bf16":
        return None
    from engine.trellis_job import parse_experts as parse_trellis

    return parse_trellis(text.strip())


def parse_arms(text: str) -> tuple[str, ...]:
    arms = []
    for part in text.split(","):
        part = part.strip()
        if part not in ARMS + TRELLIS_ARMS:
            raise UserError(f"--arms: unknown arm {part!r}; choose from {', '.join(ARMS + TRELLIS_ARMS)}")
        if part not in arms:
            arms.append(part)
    return tuple(arms)


@dataclass(frozen=True)
class SweepConfig:
    model: str
    tokens: tuple[int, ...] = DEFAULT_TOKENS
    arms: tuple[str, ...] = ARMS
    skew: float = 0.0
    tile_m: int = 16
    seed: int = 0
    calibration: Path | None = None
    timing: str = "graph"
    routing: Path | None = None  # a routing file of this model: time every arm on each recorded layer's ids too
    layers: tuple[int, ...] | None = None  # the routing file's MoE layers to time (None: every one)
    experts: object = None  # a kernels.trellis_reference.TrellisCode for trellis experts; None = bf16
    shape: MoeShape = field(init=False)
    recording: object = field(init=False, repr=False, compare=False)  # the routing file's, checked

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", moe_shape(self.model))
        object.__setattr__(self, "recording", None)
        if self.routing is not None:
            from engine import routing_file
            from engine.model_source import model_config

            if self.skew:
                raise UserError("--skew and --routing: the recording is the routing; give one of them")
            recording = routing_file.load(self.routing)
            routing_file.check_model(recording, model_config(self.model), self.routing, self.model)
            unknown = [layer for layer in self.layers or () if layer not in recording.layers]
            if unknown:
                raise UserError(f"--layers {unknown}: {self.routing} recorded MoE layers {list(recording.layers)}")
            object.__setattr__(self, "recording", recording)
        elif self.layers is not None:
            raise UserError("--layers picks layers of a routing file: give --routing FILE too")
        if self.timing not in TIMINGS:
            raise UserError(f"--timing {self.timing!r}: choose graph (the runtime's way), neighbours (between the "
                            f"runtime's router and next norm) or cold")
        expected = TRELLIS_ARMS if self.experts is not None else ARMS
        wrong = [arm for arm in self.arms if arm not in expected]
        if wrong:
            kind = "trellis" if self.experts is not None else "bf16"
            raise UserError(f"--arms: {', '.join(wrong)} cannot run {kind} experts; choose from {', '.join(expected)}")
        if not self.tokens:
            raise UserError("--tokens: give at least one token count")
        if not self.arms:
            raise UserError("--arms: give at least one arm")
        if not (math.isfinite(self.skew) and self.skew >= 0):
            raise UserError(f"--skew: {self.skew} is not a Zipf exponent; give a number >= 0 (0 = uniform)")
        from kernels.moe_grouped import TILE_M_CHOICES  # the gate's TILE_M comes from the kernel

        if self.tile_m not in TILE_M_CHOICES:
            raise UserError(f"--tile-m: {self.tile_m} is not supported; choose from "
                            f"{', '.join(map(str, TILE_M_CHOICES))}")


# ---------------------------------------------------------------------------------------------
# The arithmetic of the bounds and the crossover: plain functions over plain values
# ---------------------------------------------------------------------------------------------

def bandwidth_bound_us(shape: MoeShape, tokens: int, woken_experts: float, copy_bandwidth_gbs: float,
                       element_bytes: int = 2, expert_bytes: int | None = None) -> float:
    """`expert_bytes`: one expert's stored weights when they are not bf16 (trellis: packed codes and scales)."""
    per_expert = shape.expert_weight_bytes(element_bytes) if expert_bytes is None else expert_bytes
    moved = woken_experts * per_expert + 2 * tokens * shape.hidden * element_bytes
    return moved / (copy_bandwidth_gbs * 1e9) * 1e6


def tensor_core_bound_us(shape: MoeShape, tokens: int, matmul_tflops: float) -> float:
    flops = 2 * tokens * shape.top_k * 3 * shape.hidden * shape.intermediate
    return flops / (matmul_tflops * 1e12) * 1e6


def crossover_tokens(rows: list[dict], gemv_arm: str = "gemv", grouped_arms: tuple = GROUPED_ARMS) -> int | None:
    """Smallest measured n from which the best grouped variant beats GEMV at every larger
    measured n; None when GEMV or every grouped variant was not measured, or GEMV wins the last.
    Trellis: (trellis_gemv, (trellis_grouped,)), and (trellis_grouped, (trellis_dequant,)) for the
    dequantize crossover."""
    crossover = None
    for row in sorted(rows, key=lambda r: r["tokens"], reverse=True):
        arms = row["arms"]
        grouped = [arms[name]["us"] for name in grouped_arms if arms.get(name, {}).get("us") is not None]
        gemv = arms.get(gemv_arm, {}).get("us")
        if gemv is None or not grouped:
            return None
        if min(grouped) < gemv:
            crossover = row["tokens"]
        else:
            break
    return crossover


def zipf_popularity(experts: int, skew: float, permutation: list[int]) -> list[float]:
    """Expert e's share of routing: (rank + 1)^-skew, ranks in a fixed random order."""
    weights = [0.0] * experts
    for rank, expert in enumerate(permutation):
        weights[expert] = (rank + 1) ** -skew
    total = sum(weights)
    return [w / total for w in weights]


def git_commit() -> str | None:
    return commit_and_dirty()[0]


# ---------------------------------------------------------------------------------------------
# Measurement (needs a CUDA GPU)
# ---------------------------------------------------------------------------------------------

def require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise UserError("sweep needs a CUDA GPU; this machine has none (torch.cuda.is_available() is "
                        "False): run the same command on a machine with one (a CPU has no kernels to time)")


class _Timer:
    """Median device time of a callable, with L2 evicted by a clean read and launches queued
    ahead of the timed region (see the module docstring)."""

    def __init__(self, device) -> None:
        import torch

        self.torch = torch
        l2_bytes = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (60 << 20)
        self.flush = torch.ones(2 * l2_bytes // 4, dtype=torch.float32, device=device)
        self.flush_sink = torch.empty((), dtype=torch.float32, device=device)
        self.spin = getattr(torch.cuda, "_sleep", None)

    def _first_call_ms(self, fn) -> float:
        """One call of `fn` after a warm-up call (compiles it), timed with events: what a budget is sized from."""
        torch = self.torch
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def median_us(self, fn, budget_ms: float = BUDGET_MS) -> float:
        torch = self.torch
        estimate_ms = max(self._first_call_ms(fn), 1e-3)
        reps = int(min(MAX_REPS, max(MIN_REPS, budget_ms / estimate_ms)))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for begin, finish in events:
            torch.sum(self.flush, dim=0, out=self.flush_sink)
            if self.spin is not None:
                self.spin(SPIN_CYCLES)
            begin.record()
            fn()
            finish.record()
        torch.cuda.synchronize()
        times_us = [begin.elapsed_time(finish) * 1e3 for begin, finish in events]
        median = statistics.median(times_us)
        if not (math.isfinite(median) and median > 0):
            raise MeasurementError(f"a timing came back as {median} µs: refusing to report it")
        return median

    def graph_us(self, fn, budget_ms: float = BUDGET_MS) -> float:
        """Median device µs per call of `fn` the runtime's way: back-to-back calls captured in one CUDA graph
        (`fn` rotates its inputs per call), replayed; each replay's time over its calls. Raises what the
        capture raises (an arm a graph cannot capture)."""
        torch = self.torch
        estimate_us = max(self._first_call_ms(fn) * 1e3, 1.0)
        calls = int(min(MAX_GRAPH_CALLS, max(ROTATIONS, math.ceil(GRAPH_REPLAY_US / estimate_us / ROTATIONS)
                                             * ROTATIONS)))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()  # the first replay uploads the graph
        torch.cuda.synchronize()
        replays = int(min(MAX_REPS, max(MIN_REPS, budget_ms * 1e3 / (estimate_us * calls))))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
        for begin, finish in events:
            if self.spin is not None:
                self.spin(SPIN_CYCLES // 4)  # the host queues the replay behind it: device time only
            begin.record()
            graph.replay()
            finish.record()
        torch.cuda.synchronize()
        del graph
        median = statistics.median(begin.elapsed_time(finish) * 1e3 / calls for begin, finish in events)
        if not (math.isfinite(median) and median > 0):
            raise MeasurementError(f"a timing came back as {median} µs: refusing to report it")
        return median


    def between_us(self, fn, neighbours, budget_ms: float = BUDGET_MS) -> float:
        """Device µs `fn` adds between `neighbours` (engine.sweep_neighbours): graph_us of (before, fn, after)
        less graph_us of (before, after), per call."""
        def with_arm():
            neighbours.before()
            neighbours.after(fn())

        def without():
            neighbours.before()
            neighbours.after(neighbours.stand_in)

        added = self.graph_us(with_arm, budget_ms) - self.graph_us(without, budget_ms)
        if not (math.isfinite(added) and added > 0):
            raise MeasurementError(f"the arm added {added} µs between its neighbours: refusing to report it")
        return added


def _copy_bandwidth_gbs(timer: _Timer, device) -> float:
    import torch

    source = torch.empty(COPY_BYTES // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    target = torch.empty_like(source)
    us = timer.median_us(lambda: target.copy_(source))
    del source, target
    return 2 * COPY_BYTES / (us * 1e-6) / 1e9


def _matmul_tflops(timer: _Timer, device, generator) -> float:
    import torch

    size = MATMUL_SIZE
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device, generator=generator)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=device, generator=generator)
    c = torch.empty(size, size, dtype=torch.bfloat16, device=device)
    us = timer.median_us(lambda: torch.mm(a, b, out=c))
    del a, b, c
    return 2 * size**3 / (us * 1e-6) / 1e12


def _random_weights(shape: MoeShape, device, generator):
    """bf16 experts drawn on the GPU in place (12.9 GB at v4-shape: never through the host)."""
    import torch

    E, D, F = shape.experts, shape.hidden, shape.intermediate
    w13 = torch.randn(E, 2 * F, D, dtype=torch.bfloat16, device=device, generator=generator)
    w13.mul_(D**-0.5)
    w2 = torch.randn(E, D, F, dtype=torch.bfloat16, device=device, generator=generator)
    w2.mul_(F**-0.5)
    return w13, w2


# The routing weights' dtype, the activations': the runtime's router hands the arms weights in h's dtype
# (engine.decode_fused, engine.model), and float32 weights compile other kernels (bench/RESULTS.md, "A/B and one
# arm, one number": the GEMV arm's graph timing 83.3 µs with them against 75.2 in the runtime). The calibration
# reads only entries timed so (engine.calibration.TIMED_AS).
ROUTING_WEIGHT_DTYPE = calibration.TIMED_AS["routing_weights"]


def _routing(shape: MoeShape, tokens: int, popularity, device, generator):
    """top-k experts per token without replacement: uniform, or weighted by `popularity` (the
    Gumbel top-k trick samples k distinct experts with probability proportional to it); their weights a softmax,
    in ROUTING_WEIGHT_DTYPE."""
    import torch

    scores = torch.rand(tokens, shape.experts, device=device, generator=generator)
    if popularity is not None:
        gumbel = -torch.log(-torch.log(scores.clamp_min(1e-20)))
        scores = popularity.log().unsqueeze(0) + gumbel
    topk_ids = scores.topk(shape.top_k, dim=1).indices.to(torch.int32)
    logits = torch.randn(tokens, shape.top_k, device=device, generator=generator)
    topk_weights = torch.softmax(logits, dim=1).to(getattr(torch, ROUTING_WEIGHT_DTYPE))
    return topk_ids, topk_weights


def _random_trellis(shape: MoeShape, code, device, seed: int):
    """Random packed stacks w13 [E, 2F, D] and w2 [E, D, F] drawn on the device (the decode's cost does not
    depend on the codes' values), and their dequantized experts in float32 for the reference check (26 GB
    at v4-shape: in bf16 the reference's own rounding would take a third of the check's tolerance)."""
    import torch

    from kernels.trellis_reference import dequantize, hadamard_block, random_trellis_matrix

    E, D, F = shape.experts, shape.hidden, shape.intermediate
    w13 = random_trellis_matrix(E, 2 * F, D, code, seed=seed, device=device, row_block=hadamard_block(F))
    w2 = random_trellis_matrix(E, D, F, code, seed=seed + 1, device=device)
    dense = []
    for stack in (w13, w2):  # expert by expert: float32 rotations of one expert at a time
        dense.append(torch.stack([dequantize(stack.expert(e))[0] for e in range(E)]))
    return w13, w2, dense[0], dense[1]


def _arm_functions(arms, tile_m: int):
    from kernels.moe_gemv import moe_gemv
    from kernels.moe_grouped import moe_grouped
    from kernels.moe_peer import moe_torch_grouped_mm
    from kernels.trellis_gemv import moe_trellis_gemv
    from kernels.trellis_grouped import moe_trellis_dequant, moe_trellis_grouped

    table = {
        "trellis_gemv": moe_trellis_gemv,
        "trellis_grouped": lambda *a: moe_trellis_grouped(*a, tile_m=tile_m),
        "trellis_dequant": lambda *a: moe_trellis_dequant(*a, tile_m=tile_m),
        "gemv": moe_gemv,
        "grouped_v0": lambda *a: moe_grouped(*a, tile_m=tile_m, variant=0),
        "grouped_v1": lambda *a: moe_grouped(*a, tile_m=tile_m, variant=1),
        "grouped_v2": lambda *a: moe_grouped(*a, tile_m=tile_m, variant=2),
        "torch_grouped_mm": moe_torch_grouped_mm,
    }
    return {arm: table[arm] for arm in arms}


# The flags a sweep's results record: the kernels' launch switches, and the fold the neighbours timing launches
# after an arm (engine.sweep_neighbours)
RECORDED_FLAGS = (*LAUNCH_FLAGS, "qkv_norm_fold")


def run_sweep(config: SweepConfig, progress=None, flags=None) -> dict:
    """Measure everything `config` asks for; returns the JSON-ready result. Needs CUDA. The arms launch as
    `flags` (engine.flags.ResolvedFlags; None: the defaults and the environment) set the launch switches,
    which the result records."""
    require_cuda()
    import torch

    from engine.flags import from_environment, launch_settings
    from kernels import settings as kernel_settings
    from kernels import launches
    from kernels.moe_align import moe_align
    from kernels.moe_grouped import ROWS_PER_PROGRAM
    from kernels.moe_peer import grouped_mm_available
    from kernels.reference import moe_reference

    def step(note: str = "") -> None:
        if progress is not None:
            progress.advance(note=note)

    flags = flags if flags is not None else from_environment()
    kernel_settings.apply(launch_settings(flags))
    device = torch.device("cuda", torch.cuda.current_device())
    shape = config.shape
    generator = torch.Generator(device=device)
    generator.manual_seed(config.seed)
    timer = _Timer(device)
    copy_gbs = _copy_bandwidth_gbs(timer, device)
    step("copy bandwidth")
    matmul_tflops = _matmul_tflops(timer, device, generator)
    step("matmul rate")

    trellis = config.experts
    if trellis is None:
        w13, w2 = _random_weights(shape, device, generator)
        reference_w13, reference_w2, expert_bytes = w13, w2, None
    else:
        w13, w2, reference_w13, reference_w2 = _random_trellis(shape, trellis, device, config.seed)
        expert_bytes = w13.bytes_per_expert + w2.bytes_per_expert
    popularity = None
    if config.skew > 0:
        permutation = torch.randperm(shape.experts, generator=generator, device=device).tolist()
        popularity = torch.tensor(zipf_popularity(shape.experts, config.skew, permutation), device=device)
    arm_functions = _arm_functions(config.arms, config.tile_m)
    unavailable = {}
    if "torch_grouped_mm" in arm_functions and not grouped_mm_available(device):
        unavailable["torch_grouped_mm"] = "torch._grouped_mm does not run on this GPU"
        del arm_functions["torch_grouped_mm"]

    check_failed = False
    neighbour_sets = {}

    def neighbours(tokens: int):
        """The runtime's kernels around an arm at n = tokens (engine.sweep_neighbours), drawn once per n."""
        if tokens not in neighbour_sets:
            from engine.sweep_neighbours import runtime_neighbours

            neighbour_sets[tokens] = runtime_neighbours(shape.hidden, shape.experts, shape.top_k, tokens,
                                                        torch.bfloat16, device, generator,
                                                        fold_next=bool(flags["qkv_norm_fold"]))
        return neighbour_sets[tokens]

    def measure(tokens: int, sets: list, extra: dict) -> dict:
        """Every arm timed at n = tokens on `sets` (ROTATIONS (x, ids, weights) on the device): one row."""
        nonlocal check_failed
        woken = statistics.mean(int(torch.unique(ids).numel()) for _, ids, _ in sets)
        reference = moe_reference(sets[0][0], reference_w13, reference_w2, sets[0][1], sets[0][2]).float()
        reference_norm = reference.norm().item()
        label = extra.get("source", "")

        arms_result = {}
        for arm, function in arm_functions.items():
            before = launches.snapshot()
            out = function(sets[0][0], w13, w2, sets[0][1], sets[0][2])
            per_call = launches.since(before)
            rel_err = (out.float() - reference).norm().item() / max(reference_norm, 1e-30)
            del out
            check_failed |= not rel_err <= CHECK_TOLERANCE
            counter = iter(range(1 << 62))

            def call(function=function, counter=counter):
                x, ids, weights = sets[next(counter) % ROTATIONS]
                return function(x, w13, w2, ids, weights)

            timing, note = config.timing, ""
            if timing in ("graph", "neighbours"):
                try:
                    us = timer.graph_us(call) if timing == "graph" else timer.between_us(call, neighbours(tokens))
                except MeasurementError:
                    raise
                except Exception as error:  # noqa: BLE001 - an arm a graph cannot capture is timed cold, and says so
                    torch.cuda.synchronize()
                    timing, note = "cold", f"graph capture failed ({type(error).__name__}): timed cold"
                    us = timer.median_us(call)
            else:
                us = timer.median_us(call)
            arms_result[arm] = {"us": us, "rel_err": rel_err, "launches_per_call": per_call, "timing": timing}
            if note:
                arms_result[arm]["timing_note"] = note
            elif timing == "neighbours":  # which router the arm was timed after (folded at one row)
                arms_result[arm]["neighbours"] = neighbours(tokens).describe
            step(f"{label}n={tokens} {arm}")
        for arm, why in unavailable.items():
            arms_result[arm] = {"us": None, "rel_err": None, "launches_per_call": {}, "unavailable": why}
            step(f"{label}n={tokens} {arm} unavailable")

        align_counter = iter(range(1 << 62))
        align_us = timer.median_us(lambda: moe_align(sets[next(align_counter) % ROTATIONS][1], shape.experts,
                                                     config.tile_m, window_rows=ROWS_PER_PROGRAM))
        step(f"{label}n={tokens} align")
        del reference

        bandwidth_us = bandwidth_bound_us(shape, tokens, woken, copy_gbs, expert_bytes=expert_bytes)
        tensor_us = tensor_core_bound_us(shape, tokens, matmul_tflops)
        bound = max(bandwidth_us, tensor_us)
        for result in arms_result.values():
            result["ratio"] = None if result["us"] is None else result["us"] / bound
        fills = routing_replay.fill_row(tokens, woken, shape.top_k, shape.experts, config.tile_m)
        return {
            "tokens": tokens,
            "woken_experts": woken,
            "pairs_per_woken_expert": tokens * shape.top_k / woken,
            **{name: value for name, value in fills.items() if name not in ("woken_experts", "pairs_per_woken_expert")},
            **{name: value for name, value in extra.items() if name != "source"},
            "bandwidth_bound_us": bandwidth_us,
            "tensor_core_bound_us": tensor_us,
            "bound_us": bound,
            "align_us": align_us,
            "arms": arms_result,
        }

    rows = []
    for tokens in config.tokens:
        sets = []
        for _ in range(ROTATIONS):
            x = torch.randn(tokens, shape.hidden, dtype=torch.bfloat16, device=device, generator=generator)
            topk_ids, topk_weights = _routing(shape, tokens, popularity, device, generator)
            sets.append((x, topk_ids, topk_weights))
        rows.append(measure(tokens, sets, {}))
        del sets

    recorded = None
    recording = config.recording
    if recording is not None:
        layer_entries = []
        for position, layer in enumerate(recording.layers):
            if config.layers is not None and layer not in config.layers:
                continue
            layer_ids, layer_weights = recording.ids[:, position, :], recording.weights[:, position, :]
            layer_rows = []
            for tokens in config.tokens:
                windows, wrapped = routing_replay.windows(layer_ids, layer_weights, tokens, ROTATIONS)
                sets = [(torch.randn(tokens, shape.hidden, dtype=torch.bfloat16, device=device, generator=generator),
                         torch.from_numpy(ids).to(device),
                         torch.from_numpy(weights).to(device, getattr(torch, ROUTING_WEIGHT_DTYPE)))
                        for ids, weights in windows]
                layer_rows.append(measure(tokens, sets, {"source": f"layer {layer} ", "wrapped": wrapped}))
                del sets
            layer_entries.append({"layer": layer, "rows": layer_rows, "crossover_tokens": crossover_tokens(layer_rows),
                                  "fill_crossover_tokens": routing_replay.fill_crossover(layer_rows, config.tile_m)})
        from engine import dispatch

        formula = dispatch.min_tokens(shape.top_k, shape.experts, config.tile_m)
        uniform_crossover = crossover_tokens(rows)
        recorded = {
            "file": str(config.routing), "sha256": _sha256(config.routing), "model": recording.header.get("model"),
            "recorded_steps": recording.n_steps, "recorded_tokens": recording.tokens,
            "truncated": recording.truncated,
            "windows": f"{ROTATIONS} windows of n consecutive recorded tokens per layer, following each other (the "
                       f"recorded steps in order) where the recording holds {ROTATIONS} x n (rows repeat where n exceeds "
                       f"the {recording.tokens} recorded)",
            "layers": layer_entries,
            "model_crossover_tokens": crossover_tokens(routing_replay.summed_rows([e["rows"] for e in layer_entries])),
            "uniform_crossover_tokens": uniform_crossover,
            "uniform_formula_tokens": formula,
            "differences": routing_replay.differences(layer_entries, uniform_crossover, formula, config.tile_m),
        }

    if trellis is None:
        crossover, dequant_crossover = crossover_tokens(rows), None
    else:
        crossover = crossover_tokens(rows, "trellis_gemv", ("trellis_grouped",))
        dequant_crossover = crossover_tokens(rows, "trellis_grouped", ("trellis_dequant",))
    device_name = torch.cuda.get_device_name(device)
    commit = git_commit()
    calibration_file = None
    calibration_note = None
    timed_rows = rows + [row for entry in (recorded or {}).get("layers", []) for row in entry["rows"]]
    calibrated, calibrating = {}, crossover
    if recorded is not None:  # calibrate from the recording: the model's crossover, and each layer's
        calibrating = recorded["model_crossover_tokens"]
        calibrated = {"routing": {"file": Path(config.routing).name, "sha256": recorded["sha256"],
                                  "model": recorded["model"], "layers": list(recording.layers)},
                      "layer_crossovers": {str(entry["layer"]): entry["crossover_tokens"]
                                           for entry in recorded["layers"] if entry["crossover_tokens"] is not None}}
    if recorded is not None and len(recorded["layers"]) != len(recording.layers):
        calibration_note = (f"--layers timed {len(recorded['layers'])} of the recording's {len(recording.layers)} "
                            f"MoE layers: no model crossover, so the calibration was not written")
    elif calibrating is None:
        calibration_note = ("no crossover measured (needs gemv and a grouped arm, grouped winning at the largest n)"
                            + (" on the recorded routing" if recorded is not None else ""))
    elif config.skew > 0:
        calibration_note = "skewed routing: the calibration (uniform routing) was not written"
    elif config.timing != "graph" or any(result.get("timing") != "graph" for row in timed_rows
                                         for result in row["arms"].values() if result["us"] is not None):
        calibration_note = ("not every arm was timed the runtime's way (--timing graph): the calibration that "
                            "moe_gate=measured reads was not written")
    else:
        entry = {
            "device": device_name,
            "k": shape.top_k,
            "experts": shape.experts,
            "hidden": shape.hidden,
            "intermediate": shape.intermediate,
            "tile_m": config.tile_m,
            "crossover_tokens": calibrating,
            "measured_at": _datetime.datetime.now(_datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit,
            **calibration.TIMED_AS,
            **calibrated,
        }
        if trellis is not None:
            entry["weight_format"] = calibration.trellis_format(trellis.code, trellis.K)
            entry["dequant_crossover_tokens"] = dequant_crossover
        calibration_file = str(calibration.save_entry(entry, config.calibration))
    return {
        "device": device_name,
        "model": config.model,
        "shape": {"experts": shape.experts, "top_k": shape.top_k, "hidden": shape.hidden,
                  "intermediate": shape.intermediate},
        "dtype": "bfloat16",
        "experts": "bf16" if trellis is None else trellis.describe(),
        "expert_bytes": shape.expert_weight_bytes() if trellis is None else expert_bytes,
        "dequant_crossover_tokens": dequant_crossover,
        "tile_m": config.tile_m,
        "skew": config.skew,
        "timing": {"method": config.timing, "describe": TIMING_DESCRIPTIONS[config.timing]},
        "copy_bandwidth_gbs": copy_gbs,
        "matmul_tflops": matmul_tflops,
        "rows": rows,
        "crossover_tokens": crossover,
        "calibration_path": calibration_file,
        "calibration_note": calibration_note,
        "check_tolerance": CHECK_TOLERANCE,
        "check_failed": check_failed,
        "routing": recorded,
        "commit": commit,
        "versions": {"torch": torch.__version__, "triton": _triton_version()},
        "flags": {name: entry for name, entry in flags.to_json().items() if name in RECORDED_FLAGS},
    }


def _sha256(path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__
