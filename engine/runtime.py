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
import os
import threading
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine import layer_timing, routing_record
from engine.model_source import check_fits, model_config, refuse_missing_directory, resolve_model_path  # noqa: F401
from engine.batch_runner import BatchRunner
from engine.config import PRESETS, ModelConfig, from_name
from engine import decode_fused
from engine.decode_fused import pack_qkv
from engine.devices import device_label, resolve_device  # noqa: F401 - re-exported for callers
from engine.dispatcher import DECODE, MIXED, PREFILL, Dispatcher  # noqa: F401 - re-exported for callers
from engine.errors import UserError
from engine.flags import ResolvedFlags
from engine.model import random_weights, random_weights_on
from engine.progress import SILENT
from engine.records import StepRecord
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.shipped import load_shipped, shipped_directory
from engine.tokenizer import ByteTokenizer
from kernels import launches

# `_batch_step`'s launch snapshot for a step launched already (ahead): the runner counts such a step's launches
# from its capture and only asks whether to count them (not None)
_COUNT_REPLAYED: dict[str, int] = {}


# Runs inside `cyclic_gc_paused` now (the process's collector is off while any one runs), and whether
# it was on when the first of them began (it is turned back on only then, when the last one ends).
_gc_pause = {"runs": 0, "was_enabled": False}
_gc_pause_lock = threading.Lock()


@contextlib.contextmanager
def cyclic_gc_paused():
    """Python's cyclic garbage collector off while a batch-generation run steps (the host-time target: host time per
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


def _directory_tokenizer(directory: Path, config: ModelConfig) -> tuple[object, str]:
    """tokenizer.json where the directory has it and `tokenizers` is installed; else the byte tokenizer, and a
    note every header and report carries (the bench and random-weights runs need token ids, not words; text
    through byte tokens is not the model's)."""
    from engine.trellis_checkpoint import byte_tokenizer

    if byte_tokenizer(directory):  # a trellis checkpoint of a byte-vocabulary preset (demo, tiny)
        return ByteTokenizer(), ""
    if (directory / "tokenizer.json").is_file():
        try:
            from engine.hf_tokenizer import HFTokenizer

            return HFTokenizer(directory / "tokenizer.json"), ""
        except UserError as error:
            reason = str(error).split(": ", 1)[-1]
    elif os.path.lexists(directory / "tokenizer.json"):  # a pipe, a device, a link that leads nowhere
        reason = "tokenizer.json is not a regular file"
    else:
        reason = "no tokenizer.json"
    if config.vocab_size < 256:
        raise UserError(f"{directory}: {reason}, and a vocabulary of {config.vocab_size} is too small for byte "
                        f"tokens: add tokenizer.json")
    return ByteTokenizer(), f" (prompts as byte tokens: {reason})"


def _text_refusal(directory: Path, note: str) -> str:
    """Why a checkpoint's own weights take no text prompt: `note` (_directory_tokenizer's) says what its tokenizer
    lacks; text through byte tokens would not be the model's text."""
    return (f"{directory}{note.removeprefix(' (prompts as byte tokens').rstrip(')')}: a text prompt needs the "
            f"checkpoint's tokenizer.json (and the tokenizers package); token-id workloads (bench) run without it")


@contextlib.contextmanager
def _kernel_profile(enabled: bool):
    """torch.profiler over the steps (CUDA activity only: the device kernels) when `enabled`, else nothing."""
    if not enabled:
        yield None
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        yield prof


def _device_kernels(prof) -> list[tuple[str, float, float]]:
    """(name, start µs, duration µs) of every device kernel the profile recorded (copies and memsets left out)."""
    kernels = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and not getattr(event, "is_user_annotation", False):
            name = event.name
            if not name.startswith(("Memcpy", "Memset", "cudaMemcpy", "cudaMemset")):
                kernels.append((name, event.time_range.start, event.time_range.elapsed_us()))
    return kernels


def _timing_note(mode: str, cuda: bool, profiled: bool, attributed: str) -> str:
    if attributed and not profiled:
        return f"cuda events around each call on eager steps; {attributed}"
    if mode == "off":
        return "off: no per-layer µs (layer_timing=off)"
    if not cuda:
        return "cpu wall clock around each call (the CPU runs synchronously)"
    if mode == "events":
        return "cuda events around each call, every step eager (layer_timing=events: graphs off)"
    if not profiled:
        return "cuda events around each call (graphs off for this run)"
    return f"replayed steps profiled (CUPTI), eager steps by cuda events around each call: {attributed}"


@dataclass
class Generation:
    model: str
    device: str
    prompt_tokens: list[int]
    tokens: list[int]
    text: str
    flags: ResolvedFlags
    steps: list[StepRecord]
    counters: dict
    logits: list[torch.Tensor] = field(repr=False)  # per step, the last position's [V] fp32 on the CPU
    engagements: list[str]
    cancelled: bool = False
    weights: str = ""  # where the weights came from: a shipped checkpoint or "random, seed N"
    graphs: str = ""  # whether decode steps replayed CUDA graphs: "on", or "off (why)"
    layer_timing: str = ""  # how the records' per-layer µs were measured, for people
    decode_glue: str = ""  # what computed decode steps around the arms (Engine.decode_glue)
    # With the flag record_routing: every step's top-k ids and weights per MoE layer (engine.routing_record)
    routing: object = field(default=None, repr=False)

    def to_json(self) -> dict:
        return {
            "model": self.model, "device": self.device, "weights": self.weights,
            "prompt_tokens": len(self.prompt_tokens),
            "text": self.text, "tokens": self.tokens, "flags": self.flags.to_json(), "steps": self.steps,
            "counters": self.counters, "engagements": self.engagements, "cancelled": self.cancelled,
            "graphs": self.graphs, "layer_timing": self.layer_timing, "decode_glue": self.decode_glue,
        }


@dataclass
class BatchGeneration:
    """A batched run: the sequences (in the order given, each with its own request id and time
    stamps) and, per step, the decision records plus the rows it ran and its clocks."""

    model: str
    device: str
    flags: ResolvedFlags
    sequences: list[Sequence]
    steps: list[StepRecord]
    counters: dict
    engagements: list[str]
    graphs: str  # "on", or "off (why)"
    cancelled: bool = False  # the caller's cancel event ended the run early
    # With keep_logits: per sequence (in the order given), the logits [V] float32 on the host of each token it
    # generated; else None.
    logits: list[list[torch.Tensor]] | None = field(default=None, repr=False)
    layer_timing: str = ""  # how the records' per-layer µs were measured, for people
    decode_glue: str = ""  # on a GPU: "fused", or why decode steps keep the torch forward around the arms
    # With the flag record_routing: an engine.routing_record.RoutingRecording of every step; else None.
    routing: object = field(default=None, repr=False)

    @property
    def tokens(self) -> list[list[int]]:
        return [list(sequence.generated) for sequence in self.sequences]


def _random_source(seed: int) -> str:
    """Random weights as results headers name them."""
    return f"random, seed {seed}"


def _shipped_source(directory: Path) -> str:
    """A preset's shipped checkpoint as results headers name it (engine.shipped)."""
    return f"trained checkpoint {directory.relative_to(directory.parents[2])}"


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
        self.weights_source = weights_source or (_random_source(seed) if weights is None else "given")
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self._runner: BatchRunner | None = None  # the last batch runner made (`runner_for`): its cache and graphs
        self.checkpoint: dict | None = None  # a checkpoint directory's provenance (engine.model_source), or None
        self.model_spec = config.name  # the model as the user named it (`load`: a preset or a directory's path)
        self.text_refusal = ""  # why a text prompt cannot be encoded for this model ("" when it can)
        # engine.expert_parallel.ExpertGroup once `expert_parallel.shard` kept this rank's experts; None = one device
        self.expert_group = None

    @staticmethod
    def dtype_for(device: torch.device) -> torch.dtype:
        return torch.bfloat16 if device.type == "cuda" else torch.float32

    @classmethod
    def load(cls, model: str = "demo", device: str = "auto", seed: int = 0, weights: str = "auto",
             base: str | Path | None = None, text: bool = False, progress: bool = True) -> "Engine":
        """`text`: the caller will encode a text prompt, so a checkpoint whose tokenizer cannot is refused before
        a weight is read (else the prompt is refused when it comes, `encode_prompt`). `progress`: a checkpoint's
        loading lines on stderr (off for --no-progress)."""
        engine = cls._load(model, device, seed, weights, base, text, progress)
        engine.model_spec = model
        return engine

    @classmethod
    def _load(cls, model: str, device: str, seed: int, weights: str, base: str | Path | None,
              text: bool = False, progress: bool = True) -> "Engine":
        """A preset by name, or a Hugging Face-format checkpoint directory (engine.hf_loader; a relative path
        taken from `base` when given, e.g. a session file's directory). A preset name wins over a directory
        of the same name (write ./NAME for the directory).

        weights="auto" loads a preset's shipped checkpoint where one exists (the trained demo), else
        random weights from `seed`, and a directory's safetensors files; weights="random" always draws random
        weights (for a directory: of the family and shape its config.json gives, on the device)."""
        if weights not in ("auto", "random"):
            raise UserError(f"--weights {weights!r}: use auto (a shipped checkpoint where there is one) or random")
        if model not in PRESETS and resolve_model_path(model, base).is_dir():
            return cls._load_directory(resolve_model_path(model, base), resolve_device(device), seed, weights, model,
                                       text, progress)
        refuse_missing_directory(model, base)
        config, torch_device = from_name(model), resolve_device(device)
        # a preset's weights are drawn (or read) whole: refused before a byte, as a directory's are
        check_fits(config, torch_device, cls.dtype_for(torch_device), f"--model {model}",
                   f"use a smaller preset ({', '.join(name for name in PRESETS if name != model)}) or a device with "
                   f"more memory, or free memory")
        directory = shipped_directory(model) if weights == "auto" else None
        if directory is None:
            return cls(config, torch_device, seed)
        return cls(config, torch_device, seed, weights=load_shipped(config, directory, torch_device,
                                                                     cls.dtype_for(torch_device)),
                   weights_source=_shipped_source(directory))

    @classmethod
    def provenance_before_load(cls, model: str, device: torch.device, seed: int = 0, weights: str = "auto",
                               base: str | Path | None = None) -> tuple[str | None, dict | None]:
        """What `load` with these arguments records of its weights, (weights_source, checkpoint), known without
        loading a weight (config.json's bytes, the weight files' sizes): a preset's source in words and no
        checkpoint; a directory's provenance (engine.model_source.describe_checkpoint) and None for the words
        (they name its tokenizer, which is not read here). Why: a replay refuses other weights before it runs."""
        checkpoint = None if model in PRESETS else resolve_model_path(model, base)
        if checkpoint is not None and checkpoint.is_dir():
            from engine import model_source
            from engine.hf_loader import read_config

            _, family = read_config(checkpoint)
            return None, model_source.describe_checkpoint(checkpoint, family, weights, seed, device)
        from_name(model)  # the unknown-model error, as `load` gives it
        directory = shipped_directory(model) if weights == "auto" else None
        return (_random_source(seed) if directory is None else _shipped_source(directory)), None

    @classmethod
    def _load_directory(cls, directory: Path, device: torch.device, seed: int, weights: str,
                        shown: str | None = None, text: bool = False, progress: bool = True) -> "Engine":
        """A Hugging Face-format checkpoint directory: its safetensors files (engine.hf_loader), or with
        weights="random" random weights of the family and shape its config.json gives, drawn on `device`.
        Refused in this order, before a byte is read or drawn: missing weights (their fix is --weights random or a
        download, whatever the size), a model larger than the device's free memory, a missing tokenizer (`text`: a
        text prompt needs tokenizer.json). `shown`: the path
        as the user gave it (a session's relative path), which the weights' source names."""
        from engine import model_source
        from engine.hf_loader import load_checkpoint, read_config  # tokenizers is imported only for directories

        config, family = read_config(directory)
        dtype = cls.dtype_for(device)
        if weights != "random":  # first: with --weights random no tokenizer is needed, so the fix is that
            has_weights = any(directory.glob("*.safetensors")) or (directory / "model.safetensors.index.json").exists()
            if not has_weights:
                from engine.trellis_checkpoint import is_trellis_directory

                if is_trellis_directory(directory):  # quantize --shape-only's: codes of a shape, nothing to download
                    raise UserError(f"{directory}: a trellis shape (config.json alone, no codes): give --weights "
                                    f"random to draw random codes of it, or quantize the model without --shape-only")
                raise UserError(f"{directory}: config.json but no *.safetensors: give --weights random to draw "
                                f"random weights of this {family} shape, or download the weights")
        model_source.check_fits(config, device, dtype, str(directory))
        checkpoint = model_source.describe_checkpoint(directory, family, weights, seed, device)
        tokenizer, note = _directory_tokenizer(directory, config)
        if text and note and weights != "random":  # before a weight is read: a load of minutes for a refusal
            raise UserError(_text_refusal(directory, note))
        if weights == "random":
            from engine import trellis_checkpoint

            drawn = (trellis_checkpoint.random_weights(directory, config, seed, device, dtype)
                     if trellis_checkpoint.is_trellis_directory(directory) else
                     random_weights_on(config, seed, device, dtype))
            engine = cls(config, device, seed, weights=drawn, tokenizer=tokenizer,
                         weights_source=f"{family} shape of {shown or directory}, random weights, seed {seed}, "
                                        f"drawn on the {'CPU' if device.type == 'cpu' else 'GPU'}{note}")
        else:
            loaded = load_checkpoint(directory, device, dtype, tokenizer=tokenizer, stream=None if progress else SILENT)
            engine = cls(loaded.config, device, seed, weights=loaded.weights, tokenizer=loaded.tokenizer,
                         weights_source=f"{loaded.family} checkpoint {shown or directory}{note}")
            if note:  # the model's own weights: text through byte tokens would not be its text
                engine.text_refusal = _text_refusal(directory, note)
        engine.checkpoint = checkpoint
        return engine

    @property
    def device_label(self) -> str:
        return device_label(self.device)

    @property
    def decode_glue(self) -> str:
        """What computes a decode step around its arms: on a GPU the fused step (engine.decode_fused) where the
        architecture allows it, else the torch forward and why; on a CPU always the torch forward."""
        if self.device.type != "cuda":
            return "torch forward (CPU)"
        reason = decode_fused.ineligible(self.config)
        return "fused" if not reason else f"torch forward: the fused step has no {reason}"

    def provenance(self) -> dict:
        """What a results header records of this engine's model: the preset, or the checkpoint directory
        (path, family, config.json hash, the weights' files or random seed), and the weights' source."""
        model = {"name": self.config.name, "weights": self.weights_source}
        if self.checkpoint is not None:
            model["checkpoint"] = self.checkpoint
        if self.expert_group is not None:
            model["expert_parallel"] = self.expert_parallel_summary()
        return model

    def expert_parallel_summary(self) -> dict:
        """What a results header records of an expert-parallel run: ranks, backend, experts per rank."""
        group = self.expert_group
        return {"ep": group.size, "backend": group.backend, "local_experts": self.config.n_experts // group.size}

    def encode_prompt(self, prompt: str) -> list[int]:
        if not prompt:
            raise UserError("the prompt is empty: give some text to run")
        if self.text_refusal:
            raise UserError(self.text_refusal)
        return self.tokenizer.encode(prompt)

    def check_length(self, prompt_tokens: list[int], max_tokens: int, *,
                     max_tokens_name: str = "--max-tokens") -> None:
        """Raises UserError unless `max_tokens` >= 1 and the prompt plus `max_tokens` fit the model's context.
        `max_tokens_name` is what the caller's user sets the count with, named in the refusal: the command
        line's option by default; the TUI passes its field's label."""
        context = self.config.max_seq_len
        if max_tokens < 1:
            raise UserError(f"{max_tokens_name} must be >= 1, got {max_tokens}")
        if len(prompt_tokens) > context:
            raise UserError(f"the prompt is {len(prompt_tokens)} tokens, longer than the {self.config.name} "
                            f"context of {context}: shorten it")
        if len(prompt_tokens) + max_tokens > context:
            raise UserError(f"the prompt ({len(prompt_tokens)} tokens) plus {max_tokens_name} {max_tokens} exceeds the "
                            f"{self.config.name} context of {context}: ask for at most "
                            f"{context - len(prompt_tokens)} tokens")

    def runner_for(self, slots: int, capacity: int, graphs: bool | None = None,
                   run_ahead: bool | None = None) -> BatchRunner:
        """A batch runner with at least `slots` KV-cache rows of `capacity` positions: the last one made when it
        is large enough (its captured graphs are reused: the TUI's next prompt replays at once), else a new one
        sized with room to spare (capacity rounded up to a power of two, within the context). `run_ahead`: the
        run's flag run_ahead (None: the runner's default)."""
        runner = self._runner
        if (runner is not None and runner.max_slots >= slots and runner.capacity >= capacity
                and runner.graphs_requested == graphs):
            if run_ahead is not None:
                runner.run_ahead = runner.graphs_enabled and run_ahead
            return runner
        rounded = min(max(256, 1 << max(0, capacity - 1).bit_length()), max(capacity, self.config.max_seq_len))
        self._runner = None  # its cache is freed before the next is allocated
        self._runner = BatchRunner(self, slots, rounded, graphs, run_ahead=run_ahead)
        return self._runner

    def generate(self, prompt: str | list[int], max_tokens: int, flags: ResolvedFlags,
                 on_step: Callable[[dict, int], None] | None = None, cancel: threading.Event | None = None,
                 keep_logits: bool = True, graphs: bool | None = None, timed: bool | None = None) -> Generation:
        """Greedy decoding of one prompt at temperature 0 (ties go to the lowest token id) through the batched
        runtime every entry point uses (`generate_batch`): chunked prefill, then decode steps that replay CUDA
        graphs on a GPU. `on_step(record, token)` is called as each step's record is made (`token` None for a
        prefill chunk that emits nothing); `cancel` ends the run after the step in flight. `keep_logits`: each
        generated token's logits come back (`Generation.logits`; compare needs them). `timed`: as
        `generate_batch`'s (None: the flag layer_timing)."""
        prompt_tokens = self.encode_prompt(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_length(prompt_tokens, max_tokens)

        def each_step(record: dict) -> None:
            emitted = record["rows"][0]["emitted"] if record["rows"] else None
            record["token"] = emitted
            if on_step is not None:
                on_step(record, emitted)

        run = self.generate_batch([prompt_tokens], max_tokens, flags, on_step=each_step, cancel=cancel,
                                  keep_logits=keep_logits, graphs=graphs, timed=timed)
        generated = run.tokens[0]
        if run.routing is not None and isinstance(prompt, str):
            routing_record.add_prompt_text(run.routing.header, prompt)
        return Generation(
            model=self.config.name, device=self.device_label, prompt_tokens=prompt_tokens, tokens=generated,
            text=self.tokenizer.decode(generated), flags=flags, steps=run.steps, counters=run.counters,
            logits=run.logits[0] if run.logits is not None else [], engagements=run.engagements,
            cancelled=run.cancelled, weights=self.weights_source, graphs=run.graphs, layer_timing=run.layer_timing,
            decode_glue=run.decode_glue, routing=run.routing)

    @torch.inference_mode()
    def generate_batch(self, prompts: list[list[int]], max_tokens: int | list[int], flags: ResolvedFlags, *,
                       max_slots: int | None = None, token_budget: int | None = None, graphs: bool | None = None,
                       runner=None, clock: Callable[[], float] = time.perf_counter,
                       timed: bool | None = None, on_step: Callable[[dict], None] | None = None,
                       cancel: threading.Event | None = None, keep_logits: bool = False) -> BatchGeneration:
        """Greedy decoding of many prompts at once with continuous batching (engine.scheduler) and
        the batch runner (engine.batch_runner): chunked prefill of `prefill_chunk` tokens, then a
        decode cohort. Every sequence gets a fresh request id; pass `runner` to reuse a KV cache
        and its captured graphs across runs (else the engine's own, `runner_for`). `on_step` is called with
        each step's record as it is made; `cancel` (set from another thread) ends the run after the step in
        flight, the result then says `cancelled`. Per-layer µs as the flag layer_timing says (`timed` True or
        False overrides it: the bench times whole steps and asks for none): on a GPU, `profile` runs the steps
        under torch.profiler and reads each replayed layer's kernels back from it (engine.layer_timing), eager
        steps timed by events around each call; `events` runs every step eagerly (no graphs) with those events;
        on a CPU both time each call by the wall clock. The steps run with the cyclic garbage collector off
        (`cyclic_gc_paused`), turned back on when they end."""
        counts = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
        sequences = [Sequence(prompt, count) for prompt, count in zip(prompts, counts, strict=True)]
        vocab = self.config.vocab_size
        for sequence in sequences:
            self.check_length(list(sequence.prompt), sequence.max_tokens)
            if not all(isinstance(token, int) and 0 <= token < vocab for token in sequence.prompt):
                bad = next(token for token in sequence.prompt if not (isinstance(token, int) and 0 <= token < vocab))
                raise UserError(f"prompt token {bad!r} is not a token id of {self.config.name} (0..{vocab - 1})")
        mode = flags["layer_timing"] if timed is None else ("profile" if timed else "off")
        cuda = self.device.type == "cuda"
        if cuda and mode == "events":  # every call timed by events around it: the eager path, no graphs
            graphs = False
        if runner is None:
            runner = self.runner_for(max_slots or len(sequences), max(s.positions_needed for s in sequences), graphs,
                                     run_ahead=flags["run_ahead"])
        chunk = flags["prefill_chunk"]
        scheduler = Scheduler(runner.max_slots, runner.capacity, token_budget or max(chunk, 2048), chunk,
                              mixed=flags["mixed_steps"])
        dispatcher = Dispatcher(self, flags, mode != "off", keep_logits=keep_logits)
        arrived = clock()
        for sequence in sequences:
            scheduler.add(sequence, arrived)
        kept: dict[int, list[torch.Tensor]] | None = {s.request_id: [] for s in sequences} if keep_logits else None
        steps = []
        next_steps, has_work, extend = self._next_steps, scheduler.has_work, steps.extend
        cancelled = False
        profiled = cuda and mode == "profile" and runner.graphs_enabled
        timing_note = ""
        if profiled and torch._C._autograd._profiler_enabled():  # the caller's profiler runs: not a second one
            profiled, timing_note = False, "another profiler is running (the caller's): replayed layers not timed"
        try:
            with cyclic_gc_paused(), _kernel_profile(profiled) as profile:  # no collector pauses inside the steps
                while has_work():
                    if cancel is not None and cancel.is_set():
                        cancelled = True
                        break
                    made = next_steps(scheduler, runner, dispatcher, clock, kept)
                    extend(made)
                    if on_step is not None:
                        for record in made:
                            on_step(record)
        finally:  # a run that ended early must not leave a launched-ahead step (or served steps) for the next run
            if runner.ahead is not None or runner.served is not None:
                runner.drop_ahead()
        if profiled:
            timing_note = layer_timing.attribute(steps, _device_kernels(profile))
        if self.expert_group is not None:  # every rank's records to rank 0, side by side (a collective)
            from engine import expert_parallel

            expert_parallel.gather_records(self.expert_group, steps)
        routing = None
        if dispatcher.routing is not None:
            routing = dispatcher.routing.finish(routing_record.run_header(self, flags, prompts))
        return BatchGeneration(model=self.config.name, device=self.device_label, flags=flags, sequences=sequences,
                               steps=steps, counters=dispatcher.counters.to_json(),
                               engagements=dispatcher.engagements, graphs=runner.graphs_note, cancelled=cancelled,
                               logits=None if kept is None else [kept[s.request_id] for s in sequences],
                               layer_timing=_timing_note(mode, cuda, profiled, timing_note),
                               decode_glue=self.decode_glue, routing=routing)

    @staticmethod
    def _next_steps(scheduler: Scheduler, runner, dispatcher: Dispatcher, clock,
                    kept: dict[int, list[torch.Tensor]] | None = None) -> list[StepRecord]:
        """The next scheduled step's record (`_batch_step`) and, where that step launched and synced a graph of
        several steps, its later steps' records (`_served_steps`): what `generate_batch` runs per loop. `kept`
        (request id -> logits of each token it generated) collects the steps' logits where the run keeps them."""
        step = Engine._batch_step(scheduler, runner, dispatcher, clock, kept)
        if runner.served is None:
            return [step]
        return [step, *Engine._served_steps(scheduler, runner, dispatcher, clock, step, kept)]

    @staticmethod
    def _served_steps(scheduler: Scheduler, runner, dispatcher: Dispatcher, clock, launching: dict,
                      kept: dict[int, list[torch.Tensor]] | None = None) -> list[StepRecord]:
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
                               "tokens": 1, "emitted": token, "prefill": False} for sequence, token in zip(cohort, outputs)]
            if kept is not None:
                for row, sequence in enumerate(cohort):
                    kept[sequence.request_id].append(served.logits[index, row])
            steps.append(record)
            now = perf()  # the step's work done: its host time ends here
            record["host_us"] = (now - previous) * 1e6
            previous = now
        runner.synced_at = previous  # the next launch's host time starts at the last served step's end
        dispatcher.step, dispatcher.moe_records, dispatcher.attention_records = step, moe, attention
        return steps

    @staticmethod
    def _batch_step(scheduler: Scheduler, runner, dispatcher: Dispatcher, clock,
                    kept: dict[int, list[torch.Tensor]] | None = None) -> StepRecord:
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
        if kept is not None:
            for index, row in enumerate(batch.rows):
                if row.emits:
                    kept[row.sequence.request_id].append(timing.logits[index])
        host_us = timing.host_us
        if host_us is None:
            host_us = (timing.launched_at - host_started) * 1e6
        # an engine.records.StepRecord: dispatcher.step_record()'s keys, then the step's clocks and rows
        return {"step": dispatcher.step, "phase": dispatcher.phase, "n_tokens": dispatcher.n_tokens,
                "moe": dispatcher.moe_records, "attention": dispatcher.attention_records,
                "started": started, "ended": ended, "host_us": host_us, "device_us": timing.device_us,
                "graph": timing.graph, "eager_reason": timing.eager_reason, "kernel_launches": timing.kernel_launches,
                "span": timing.span, "span_index": timing.span_index,
                "rows": [{"request_id": row.sequence.request_id, "slot": row.sequence.slot, "start": row.start,
                          "tokens": len(row.tokens), "emitted": token if row.emits else None,
                          "prefill": row.start < len(row.sequence.prompt)}
                         for row, token in zip(batch.rows, next_tokens)]}
