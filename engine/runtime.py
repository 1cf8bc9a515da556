"""The engine loop: load a preset, generate greedily at temperature 0 (one prompt, or many at once
with continuous batching: `generate_batch`), and record for every layer of every step which arm
was decided, which executed, and why.

On a GPU the executed arm is the decided arm. On a CPU every layer executes its reference arm,
which emulates the decided arm's semantics (a fused arm with `fused_mask=drop` is computed as
plain causal attention), so every flag changes what a CPU run computes exactly as on a GPU.
At most one device->host sync per step carries the next token and every observed count.

Knows nothing of screens, sessions or argument parsing.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine import calibration, dispatch
from engine.arms import ARMS, Counters
from engine.attention_dispatch import UNFUSED, decide_attention
from engine.config import PRESETS, ModelConfig, from_name
from engine.decode_fused import pack_qkv
from engine.errors import UserError
from engine.flags import ResolvedFlags
from engine.model import KVCache, forward, random_weights
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.shipped import load_shipped, shipped_directory
from engine.tokenizer import ByteTokenizer
from kernels import launches
from kernels.reference import MaskSpec

log = logging.getLogger("moe_inspector.engine")

PREFILL, DECODE, MIXED = "prefill", "decode", "mixed"

# (MoE pairs, woken experts) -> pairs per woken expert, rounded to 3 digits (`_pairs_per_woken`)
_PAIRS_PER_WOKEN: dict[tuple[int, int], float] = {}


def _pairs_per_woken(pairs: int, woken: int) -> float:
    """MoE pairs per woken expert, rounded to 3 digits: a decimal conversion, made once per (pairs, woken)."""
    ratio = _PAIRS_PER_WOKEN.get((pairs, woken))
    if ratio is None:
        if len(_PAIRS_PER_WOKEN) >= 4096:
            _PAIRS_PER_WOKEN.clear()
        ratio = _PAIRS_PER_WOKEN[(pairs, woken)] = round(pairs / woken, 3)
    return ratio


# `_batch_step`'s launch snapshot for a step launched already (ahead): the runner counts such a step's launches
# from its capture and only asks whether to count them (not None)
_COUNT_REPLAYED: dict[str, int] = {}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise UserError(f"unknown device {name!r}: use auto, cpu or cuda")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {name}: no CUDA GPU is visible here; use --device cpu or auto")
    return torch.device(name)


def device_label(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


# Runs inside `cyclic_gc_paused` now (the process's collector is off while any one runs), and whether
# it was on when the first of them began (it is turned back on only then, when the last one ends).
_gc_pause = {"runs": 0, "was_enabled": False}
_gc_pause_lock = threading.Lock()


@contextlib.contextmanager
def cyclic_gc_paused():
    """Python's cyclic garbage collector off while a batch-generation run steps (issue 7: host time per
    decode step). Each step keeps its record (a few containers), so the collector started about every
    100 steps, inside a step, and traversed the young objects, or now and then every object of the
    process (with torch, Triton and CUDA loaded, a full collection takes tens of ms): on the H200,
    bench/host_step.py counted 40 us per replayed step on average. A run makes no reference cycles
    (tests/test_graph_replay_host.py: 5000 stub steps leave no cyclic garbage), so reference counting
    frees everything a step drops and the collector, off, leaves nothing unreclaimed that it would
    have reclaimed. It is turned back on when the run ends, also on an error, unless it was off before;
    runs in several threads at once count: the last to end turns it back on. Turning it off or on
    collects nothing by itself."""
    with _gc_pause_lock:
        if _gc_pause["runs"] == 0:
            _gc_pause["was_enabled"] = gc.isenabled()
            gc.disable()
        _gc_pause["runs"] += 1
    try:
        yield
    finally:
        with _gc_pause_lock:
            _gc_pause["runs"] -= 1
            if _gc_pause["runs"] == 0 and _gc_pause["was_enabled"]:
                gc.enable()


class _Timer:
    """Per-call timing: CUDA events on a GPU (read after the step's one sync), the wall clock on
    a CPU, where work is synchronous."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def start(self):
        if self.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            return (begin, end)
        return time.perf_counter()

    def stop(self, handle):
        if self.cuda:
            handle[1].record()
            return handle
        return (time.perf_counter() - handle) * 1e6

    def microseconds(self, stopped) -> float:
        return stopped[0].elapsed_time(stopped[1]) * 1e3 if self.cuda else stopped


class Dispatcher:
    """The engine's per-run layer hooks: decides, executes, counts and records."""

    def __init__(self, engine: "Engine", flags: ResolvedFlags, timed: bool) -> None:
        self.engine, self.flags, self.timed = engine, flags, timed
        self.counters = Counters()
        # engine.decode_fused.StepOutputs while the batch runner has a decode step's folds write its outputs
        self.outputs = None
        self.timer = _Timer(engine.device)
        self.engaged: set[tuple] = set()
        self.engagements: list[str] = []
        config = engine.config
        self.crossover = calibration.find_crossover(device_label(engine.device), config.top_k, config.n_experts,
                                                    config.hidden, config.intermediate, flags["tile_m"])
        self.begin_step(0, PREFILL, 0)

    def begin_step(self, step: int, phase: str, n_tokens: int) -> None:
        self.step, self.phase, self.n_tokens = step, phase, n_tokens
        self.moe_records: list[dict] = []
        self.attention_records: list[dict] = []
        self.pending_woken: list[torch.Tensor] = []
        self.pending_times: list[tuple[dict, object]] = []
        self._replay_records = None  # what `replayed_records` copies from this dispatcher's records, made once
        self._template: Dispatcher | None = None  # the capture a replayed step replays (`replay`)

    def _engage(self, family: str, arm: str, variant, shape_class: str, message: str) -> None:
        key = (family, arm, variant, shape_class)
        if key not in self.engaged:
            self.engaged.add(key)
            self.engagements.append(message)
            log.info(message)

    def _run(self, record: dict, launch: Callable):
        if not self.timed:
            return launch()
        handle = self.timer.start()
        out = launch()
        self.pending_times.append((record, self.timer.stop(handle)))
        return out

    def moe(self, layer, h, w13, w2, topk_ids, topk_weights, experts=None, woken=None):
        """`experts`: a family's expert math that no kernel arm computes (engine.model.FamilyExperts,
        e.g. gpt-oss's biased, clamped SwiGLU); it then runs on the reference arm, and the record says so.
        `woken`: the number of distinct experts in topk_ids (0-d int64) when the caller's routing kernel
        already counted it (engine.decode_fused); else it is counted here."""
        config, flags, device = self.engine.config, self.flags, self.engine.device
        n = h.shape[0]
        decision = dispatch.decide(dispatch.GateInputs(
            n_tokens=n, k=config.top_k, n_experts=config.n_experts, tile_m=flags["tile_m"],
            policy=flags["moe_gate"], decode_floor=flags["decode_floor"], moe_max_tokens=flags["moe_max_tokens"],
            grouped_variant=flags["grouped_variant"], measured_crossover=self.crossover))
        arm = ARMS[decision.arm]
        if experts is not None:
            executed = ARMS[dispatch.REFERENCE]
            note = (f"{decision.arm} computes plain SwiGLU experts: the reference arm computes {experts.description}"
                    if decision.arm != dispatch.REFERENCE else "")
        elif arm.supports(device):
            executed, note = arm, ""
        else:
            executed = ARMS[dispatch.REFERENCE]
            note = (f"{decision.arm} cannot run on {device.type}: the reference arm computes the same function"
                    if decision.arm != dispatch.REFERENCE else "")
        predicted = dispatch.woken_experts(n, config.top_k, config.n_experts)
        record = {
            "step": self.step, "layer": layer, "phase": self.phase, "n_tokens": n, "k": config.top_k,
            "experts": config.n_experts, "tile_m": flags["tile_m"], "woken_predicted": round(predicted, 2),
            "woken_observed": None,
            "pairs_per_woken": round(dispatch.pairs_per_woken_expert(n, config.top_k, config.n_experts), 3),
            "fill": round(dispatch.tile_fill(n, config.top_k, config.n_experts, flags["tile_m"]), 4),
            "boundary": decision.boundary, "policy": flags["moe_gate"],
            "decided_arm": decision.arm, "executed_arm": executed.name, "variant": decision.variant,
            "reason": decision.reason, "execution_note": note, "us": None,
        }
        if woken is not None:
            self.pending_woken.append(woken)
        elif h.is_cuda:  # one launch (kernels.router); the torch form is three
            from kernels.router import count_distinct

            self.pending_woken.append(count_distinct(topk_ids, config.n_experts))
        else:
            woken = torch.zeros(config.n_experts, device=h.device, dtype=torch.int32)
            woken.scatter_(0, topk_ids.reshape(-1).long(), 1)
            self.pending_woken.append(woken.sum())
        label = executed.name if executed.name != dispatch.GROUPED else f"grouped_v{decision.variant}"
        self.counters.bump(label)
        self._engage("moe", executed.name, decision.variant, self.phase,
                     f"MoE: {label} engaged ({self.phase}, {n} tokens x top-{config.top_k} of {config.n_experts} "
                     f"experts; m-tiles {100 * record['fill']:.1f}% full at TILE_M={flags['tile_m']}"
                     + (f"; decided {decision.arm}" if executed.name != decision.arm else "") + ")")
        self.moe_records.append(record)
        if experts is not None:
            return self._run(record, lambda: experts(h, w13, w2, topk_ids, topk_weights))
        return self._run(record, lambda: executed.launch(h, w13, w2, topk_ids, topk_weights,
                                                         tile_m=flags["tile_m"], variant=decision.variant))

    def attention(self, layer, q, k_cache, v_cache, sinks, q_start, length):
        config, flags, device = self.engine.config, self.flags, self.engine.device
        layer_mask = config.layer_masks[layer]
        decision = decide_attention(config.head_dim, layer_mask.kind, layer_mask.describe(), flags["flash_512"],
                                    flags["fused_mask"])
        spec = (MaskSpec("causal") if decision.applied_mask == "causal"
                else MaskSpec(layer_mask.kind, layer_mask.window, layer_mask.block))
        arm = ARMS[decision.arm]
        executed = arm if arm.supports(device) else ARMS[UNFUSED]
        note = "" if executed is arm else f"{decision.arm} cannot run on {device.type}: the unfused reference " \
                                          f"computes its semantics ({decision.applied_mask} mask)"
        record = {
            "step": self.step, "layer": layer, "phase": self.phase, "n_tokens": self.n_tokens,
            "head_dim": config.head_dim,
            "decided_arm": decision.arm, "executed_arm": executed.name, "mask": decision.mask,
            "applied_mask": decision.applied_mask, "declined": decision.declined, "reason": decision.reason,
            "execution_note": note, "us": None,
        }
        self.counters.bump(executed.name)
        self._engage("attention", executed.name, decision.applied_mask, self.phase,
                     f"attention: {executed.name} engaged ({self.phase}, {decision.mask} mask, applies "
                     f"{decision.applied_mask})" + (f"; decided {decision.arm}" if executed is not arm else ""))
        self.attention_records.append(record)
        return self._run(record, lambda: executed.launch(q, k_cache[:, :length], v_cache[:, :length], sinks, spec,
                                                         q_start, None))

    def end_step(self, next_token: torch.Tensor) -> int:
        """The step's one sync: the next token and every observed count together."""
        return self.end_step_batch(next_token.reshape(1))[0]

    def end_step_batch(self, next_tokens: torch.Tensor) -> list[int]:
        """The step's one sync for a batch: each row's next token [B] and every observed count."""
        rows = next_tokens.numel()
        values = torch.cat([next_tokens.reshape(-1).long(), torch.stack(self.pending_woken).long()]).tolist()
        self._observe(values[rows:])
        for record, stopped in self.pending_times:
            record["us"] = round(self.timer.microseconds(stopped), 1)
        return values[:rows]

    def end_replay(self, values: list[int], rows: int) -> list[int]:
        """A replayed step's outputs, read by the batch runner at the step's one sync: `values`
        [B + MoE layers] is the graph's static output as copied to the host (the next tokens, then each
        layer's woken experts, as `end_step_batch` concatenates them). The step's records are made here,
        the capture's with what the replay observed (`replayed_records`)."""
        self.moe_records, self.attention_records = self.replayed_records(self._template, self.step, values, rows)
        return values[:rows]

    def _observe(self, woken_counts: list[int]) -> None:
        for record, woken in zip(self.moe_records, woken_counts):
            record["woken_observed"] = woken
            record["pairs_per_woken_observed"] = _pairs_per_woken(record["n_tokens"] * record["k"], woken)

    def replay(self, template: "Dispatcher", kernels: dict[str, int], step: int, n_tokens: int,
               times: int = 1) -> None:
        """Step `step` is a CUDA-graph replay of the step `template` captured: begins it, as
        `begin_step(step, DECODE, n_tokens)` would, and counts the capture's arms and launches (`kernels`)
        again, since a replayed kernel never passes through Python (`times` replays: `Counters.replay`). The
        step's records come with its outputs (`end_replay`). Runs on the host path of every step that launches
        a replay (the batch runner calls it once the replay is issued); the later steps of a graph of several
        steps are counted and recorded together (`Engine._served_steps`)."""
        self.step, self.phase, self.n_tokens = step, DECODE, n_tokens
        self.pending_times = []
        self._replay_records = None
        self._template = template
        self.counters.replay(template.counters.arms, kernels, times)
        self.pending_woken = template.pending_woken  # read, never extended: the step records no layer

    @staticmethod
    def replayed_records(template: "Dispatcher", step: int, values: list[int], rows: int
                         ) -> tuple[list[dict], list[dict]]:
        """Replayed step `step`'s (MoE, attention) records: the capture's (`template`'s), renumbered to this
        step, each MoE record with the woken experts its layer observed (`values`: as `end_replay`'s). Each
        is one copy of a dict prepared once per capture."""
        prepared = template._replay_records
        if prepared is None:
            prepared = template._replay_records = (
                [dict(record, graph="replay", phase=DECODE) for record in template.moe_records],
                [dict(record, graph="replay", phase=DECODE) for record in template.attention_records])
        moe = []
        for record, woken in zip(prepared[0], values[rows:]):
            record = record.copy()
            record["step"], record["woken_observed"] = step, woken
            record["pairs_per_woken_observed"] = _pairs_per_woken(record["n_tokens"] * record["k"], woken)
            moe.append(record)
        attention = []
        for record in prepared[1]:
            record = record.copy()
            record["step"] = step
            attention.append(record)
        return moe, attention

    def step_record(self) -> dict:
        return {"step": self.step, "phase": self.phase, "n_tokens": self.n_tokens,
                "moe": self.moe_records, "attention": self.attention_records}


@dataclass
class Generation:
    model: str
    device: str
    prompt_tokens: list[int]
    tokens: list[int]
    text: str
    flags: ResolvedFlags
    steps: list[dict]
    counters: dict
    logits: list[torch.Tensor] = field(repr=False)  # per step, the last position's [V] fp32 on the CPU
    engagements: list[str]
    cancelled: bool = False
    weights: str = ""  # where the weights came from: a shipped checkpoint or "random, seed N"

    def to_json(self) -> dict:
        return {
            "model": self.model, "device": self.device, "weights": self.weights,
            "prompt_tokens": len(self.prompt_tokens),
            "text": self.text, "tokens": self.tokens, "flags": self.flags.to_json(), "steps": self.steps,
            "counters": self.counters, "engagements": self.engagements, "cancelled": self.cancelled,
        }


@dataclass
class BatchGeneration:
    """A batched run: the sequences (in the order given, each with its own request id and time
    stamps) and, per step, the decision records plus the rows it ran and its clocks."""

    model: str
    device: str
    flags: ResolvedFlags
    sequences: list[Sequence]
    steps: list[dict]
    counters: dict
    engagements: list[str]
    graphs: str  # "on", or "off (why)"

    @property
    def tokens(self) -> list[list[int]]:
        return [list(sequence.generated) for sequence in self.sequences]


class Engine:
    """A model on a device, ready to generate."""

    def __init__(self, config: ModelConfig, device: torch.device, seed: int = 0,
                 weights: dict[str, torch.Tensor] | None = None, tokenizer=None,
                 weights_source: str | None = None) -> None:
        self.config, self.device, self.seed = config, device, seed
        self.dtype = self.dtype_for(device)
        self.weights = weights if weights is not None else random_weights(config, seed, device, self.dtype)
        if device.type == "cuda":  # the fused decode step reads q/k/v with one GEMV (engine.decode_fused)
            pack_qkv(config, self.weights)
        self.weights_source = weights_source or (f"random, seed {seed}" if weights is None else "given")
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()

    @staticmethod
    def dtype_for(device: torch.device) -> torch.dtype:
        return torch.bfloat16 if device.type == "cuda" else torch.float32

    @classmethod
    def load(cls, model: str = "demo", device: str = "auto", seed: int = 0, weights: str = "auto") -> "Engine":
        """A preset by name, or a Hugging Face-format checkpoint directory (engine.hf_loader). A preset
        name wins over a directory of the same name (write ./NAME for the directory).

        weights="auto" loads a preset's shipped checkpoint where one exists (the trained demo), else
        random weights from `seed`; weights="random" always draws random weights."""
        if weights not in ("auto", "random"):
            raise UserError(f"--weights {weights!r}: use auto (a shipped checkpoint where there is one) or random")
        if model not in PRESETS and os.path.isdir(model):
            from engine.hf_loader import load_checkpoint  # tokenizers is imported only for directories

            torch_device = resolve_device(device)
            loaded = load_checkpoint(model, torch_device, cls.dtype_for(torch_device))
            return cls(loaded.config, torch_device, seed, weights=loaded.weights, tokenizer=loaded.tokenizer,
                       weights_source=f"{loaded.family} checkpoint {model}")
        if model not in PRESETS and (os.sep in model or "/" in model or os.path.exists(model)):
            raise UserError(f"--model {model}: not a directory; give a preset ({', '.join(PRESETS)}) or a Hugging "
                            f"Face-format checkpoint directory (config.json, *.safetensors, tokenizer.json)")
        config, torch_device = from_name(model), resolve_device(device)
        directory = shipped_directory(model) if weights == "auto" else None
        if directory is None:
            return cls(config, torch_device, seed)
        return cls(config, torch_device, seed, weights=load_shipped(config, directory, torch_device,
                                                                     cls.dtype_for(torch_device)),
                   weights_source=f"trained checkpoint {directory.relative_to(directory.parents[2])}")

    @property
    def device_label(self) -> str:
        return device_label(self.device)

    def encode_prompt(self, prompt: str) -> list[int]:
        if not prompt:
            raise UserError("the prompt is empty: give some text to run")
        return self.tokenizer.encode(prompt)

    def check_length(self, prompt_tokens: list[int], max_tokens: int) -> None:
        context = self.config.max_seq_len
        if max_tokens < 1:
            raise UserError(f"--max-tokens must be >= 1, got {max_tokens}")
        if len(prompt_tokens) > context:
            raise UserError(f"the prompt is {len(prompt_tokens)} tokens, longer than the {self.config.name} "
                            f"context of {context}: shorten it")
        if len(prompt_tokens) + max_tokens > context:
            raise UserError(f"the prompt ({len(prompt_tokens)} tokens) plus --max-tokens {max_tokens} exceeds the "
                            f"{self.config.name} context of {context}: ask for at most "
                            f"{context - len(prompt_tokens)} tokens")

    @torch.inference_mode()
    def generate(self, prompt: str | list[int], max_tokens: int, flags: ResolvedFlags,
                 on_step: Callable[[dict, int], None] | None = None, cancel: threading.Event | None = None,
                 timed: bool = True) -> Generation:
        """Greedy decoding at temperature 0; ties go to the lowest token id (argmax takes the first)."""
        prompt_tokens = self.encode_prompt(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_length(prompt_tokens, max_tokens)
        dispatcher = Dispatcher(self, flags, timed)
        cache = KVCache.allocate(self.config, 1, len(prompt_tokens) + max_tokens, self.device, self.dtype)
        inputs = torch.tensor([prompt_tokens], device=self.device)
        start, generated, steps, logits_per_step = 0, [], [], []
        cancelled = False
        for step in range(max_tokens):
            if cancel is not None and cancel.is_set():
                cancelled = True
                break
            dispatcher.begin_step(step, PREFILL if step == 0 else DECODE, inputs.shape[1])
            logits = forward(self.config, self.weights, inputs, start, cache, dispatcher)  # [1, V]
            token = dispatcher.end_step(torch.argmax(logits[0]))
            start += inputs.shape[1]
            generated.append(token)
            logits_per_step.append(logits[0].float().cpu())
            record = dispatcher.step_record()
            record["token"] = token
            steps.append(record)
            if on_step is not None:
                on_step(record, token)
            inputs = torch.tensor([[token]], device=self.device)
        return Generation(
            model=self.config.name, device=self.device_label, prompt_tokens=prompt_tokens, tokens=generated,
            text=self.tokenizer.decode(generated), flags=flags, steps=steps, counters=dispatcher.counters.to_json(),
            logits=logits_per_step, engagements=dispatcher.engagements, cancelled=cancelled,
            weights=self.weights_source)

    @torch.inference_mode()
    def generate_batch(self, prompts: list[list[int]], max_tokens: int | list[int], flags: ResolvedFlags, *,
                       max_slots: int | None = None, token_budget: int | None = None, graphs: bool | None = None,
                       runner=None, clock: Callable[[], float] = time.perf_counter,
                       timed: bool = False) -> BatchGeneration:
        """Greedy decoding of many prompts at once with continuous batching (engine.scheduler) and
        the batch runner (engine.batch_runner): chunked prefill of `prefill_chunk` tokens, then a
        decode cohort. Every sequence gets a fresh request id; pass `runner` to reuse a KV cache
        and its captured graphs across runs. The steps run with the cyclic garbage collector off
        (`cyclic_gc_paused`), turned back on when they end."""
        from engine.batch_runner import BatchRunner  # it imports this module for the Dispatcher

        counts = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
        sequences = [Sequence(prompt, count) for prompt, count in zip(prompts, counts, strict=True)]
        for sequence in sequences:
            self.check_length(list(sequence.prompt), sequence.max_tokens)
        if runner is None:
            runner = BatchRunner(self, max_slots or len(sequences), max(s.positions_needed for s in sequences), graphs)
        chunk = flags["prefill_chunk"]
        scheduler = Scheduler(runner.max_slots, runner.capacity, token_budget or max(chunk, 2048), chunk)
        dispatcher = Dispatcher(self, flags, timed)
        arrived = clock()
        for sequence in sequences:
            scheduler.add(sequence, arrived)
        steps = []
        next_steps, has_work, extend = self._next_steps, scheduler.has_work, steps.extend
        try:
            with cyclic_gc_paused():  # no collector pauses inside the steps: a run makes no reference cycles
                while has_work():
                    extend(next_steps(scheduler, runner, dispatcher, clock))
        finally:  # a run that ended early must not leave a launched-ahead step (or served steps) for the next run
            if runner.ahead is not None or runner.served is not None:
                runner.drop_ahead()
        return BatchGeneration(model=self.config.name, device=self.device_label, flags=flags, sequences=sequences,
                               steps=steps, counters=dispatcher.counters.to_json(),
                               engagements=dispatcher.engagements, graphs=runner.graphs_note)

    @staticmethod
    def _next_steps(scheduler: Scheduler, runner, dispatcher: Dispatcher, clock) -> list[dict]:
        """The next scheduled step's record (`_batch_step`) and, where that step launched and synced a graph of
        several steps, its later steps' records (`_served_steps`): what `generate_batch` runs per loop."""
        step = Engine._batch_step(scheduler, runner, dispatcher, clock)
        if runner.served is None:
            return [step]
        return [step, *Engine._served_steps(scheduler, runner, dispatcher, clock, step)]

    @staticmethod
    def _served_steps(scheduler: Scheduler, runner, dispatcher: Dispatcher, clock, launching: dict) -> list[dict]:
        """The later steps of the graph of several steps that step `launching` launched and synced (the runner's
        `served`): their tokens and woken counts are on the host already, so they are served in one loop,
        launching and waiting for nothing, each recorded as a replayed step of its own (`launching`'s record,
        with its own number, decisions, observed counts, rows, launches and clocks), the scheduler advancing
        the reserved cohort by its tokens (`Scheduler.serve_reserved`). A served step's host time runs from
        the previous step's end (the launch's sync, for the first) to the end of its own work, its record made;
        `ended`, its tokens' time, is stamped before they are handed to the scheduler.
        Each step costs the host a few µs where a scheduled, run and postprocessed step cost about 10 (issue
        7: host time per decode step; bench/host_step.py)."""
        served = runner.take_served(dispatcher, scheduler.reserved)
        template, values, first, size = served.captured.template, served.values, served.first, len(served.rows)
        counters, arms = dispatcher.counters, template.counters.arms
        for kernels, times in served.block.later_kernels:
            counters.replay(arms, kernels, times)
        replayed, serve, kernels_of = dispatcher.replayed_records, scheduler.serve_reserved, served.block.step_launches
        perf = time.perf_counter
        previous = runner.synced_at
        steps = []
        moe = attention = None
        for index in range(1, len(values)):
            outputs, step = values[index], first + index
            moe, attention = replayed(template, step, outputs, size)
            ended = clock()
            cohort = serve(step, outputs, ended)
            record = launching.copy()
            record["step"], record["moe"], record["attention"] = step, moe, attention
            record["started"], record["ended"], record["device_us"] = served.started, ended, served.device_us
            record["kernel_launches"], record["span_index"] = dict(kernels_of(index)), index
            record["rows"] = [{"request_id": sequence.request_id, "slot": sequence.slot, "start": sequence.cached - 1,
                               "tokens": 1, "emitted": token} for sequence, token in zip(cohort, outputs)]
            steps.append(record)
            now = perf()  # the step's work done: its host time ends here
            record["host_us"] = (now - previous) * 1e6
            previous = now
        runner.synced_at = previous  # the next launch's host time starts at the last served step's end
        dispatcher.step, dispatcher.moe_records, dispatcher.attention_records = step, moe, attention
        return steps

    @staticmethod
    def _batch_step(scheduler: Scheduler, runner, dispatcher: Dispatcher, clock) -> dict:
        """One scheduled step and its record. `started` is stamped before the step's launch and
        `host_us` is the host time from the step's start to its launch. A step the runner launched
        ahead (engine.batch_runner, run-ahead: before the previous replayed step's sync, its next step
        reserved by the scheduler) was stamped by the runner right before that launch, so its `started`
        precedes the previous step's `ended`; its host_us is the runner's: the host's busy time per
        step, from the previous step's sync to this step's wait for its own (everything but waiting
        for the device, which, two steps in flight, waits for the host only when this exceeds a step)."""
        ahead = runner.ahead
        # a replayed step counts what its capture recorded, not a difference of snapshots: any mapping says "count"
        kernels_before = _COUNT_REPLAYED if ahead is not None else launches.snapshot()
        if ahead is None:
            started = clock()  # stamped BEFORE the step: a request that finishes inside it is still timed
            # host_us is measured on perf_counter, the clock the runner stamps launched_at with
            host_started = started if clock is time.perf_counter else time.perf_counter()
        else:  # launched already, its start stamped before that launch; host time measured by the runner
            started, host_started = ahead.started, None
        batch = scheduler.schedule(started)
        # counts launches before its sync; may launch the next step before its sync, if the scheduler reserves it
        next_tokens, timing = runner.run(batch, dispatcher, kernels_before, scheduler.reserve_next, clock)
        ended = clock()
        scheduler.postprocess(batch, next_tokens, ended)
        host_us = timing.host_us
        if host_us is None:
            host_us = (timing.launched_at - host_started) * 1e6
        # dispatcher.step_record()'s keys, then the step's clocks and rows, written as one literal: a call
        # with keyword arguments costs about a microsecond more per step (tests/test_engine.py keeps the keys)
        return {"step": dispatcher.step, "phase": dispatcher.phase, "n_tokens": dispatcher.n_tokens,
                "moe": dispatcher.moe_records, "attention": dispatcher.attention_records,
                "started": started, "ended": ended, "host_us": host_us, "device_us": timing.device_us,
                "graph": timing.graph, "eager_reason": timing.eager_reason, "kernel_launches": timing.kernel_launches,
                "span": timing.span, "span_index": timing.span_index,
                "rows": [{"request_id": row.sequence.request_id, "slot": row.sequence.slot, "start": row.start,
                          "tokens": len(row.tokens), "emitted": token if row.emits else None}
                         for row, token in zip(batch.rows, next_tokens)]}
