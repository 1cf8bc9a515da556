"""Routing records: what each step's router chose, for every MoE layer, kept in host memory for one run.

Shape legend: T = routed tokens (rows) of the run, S = steps, L = MoE layers, k = experts per token,
W = 3 * L * k int16 words per token.

    per step, on the device      pack(): for each layer its ids [n, k] int32 and weights [n, k] bf16,
                                 viewed as int16 and laid side by side: one [n, W] int16 tensor, one kernel
    per step, to the host        eager: one non-blocking copy into a pinned buffer, enqueued before the
                                 step's one sync (engine.dispatcher.end_step_batch) and read after it; a
                                 replayed CUDA graph: the graph packs each step on a side stream and copies
                                 its steps' rows into a pinned landing buffer itself (engine.graphs), read
                                 at the launch's sync (engine.batch_runner). No sync, and no copy issued by
                                 the host, per layer or per replayed step.
    in host memory               `RoutingRecorder`: the rows in chunks of CHUNK_ROWS tokens, each row its
                                 packed routing and its step's number and phase (int16 [rows, W + 3]).

Memory grows linearly with the routed tokens (6 bytes per token, MoE layer and pick, plus 6 per token)
and never past the flag routing_cap_mb: a step that would not fit is not recorded, nor is any step after it
(the recording says from which step: `truncated`), so a recording is always a prefix of the run.

A run's record becomes a `RoutingRecording` when the run ends; engine.routing_file writes and reads it,
engine.routing_stats summarizes it. Knows nothing of files, statistics or screens.
"""

from __future__ import annotations

import datetime as _datetime
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

PHASES = ("prefill", "decode", "mixed")
_PHASE_CODE = {phase: code for code, phase in enumerate(PHASES)}
_DECODE = _PHASE_CODE["decode"]
CHUNK_ROWS = 4096  # tokens per chunk of rows: a chunk is allocated when the one before is full
_STEP_WORDS = 3  # int16 words per row after its routing: its step's number (int32) and phase
PROMPT_CHARS = 4096  # a text prompt kept in the header is cut to this many characters


def words_per_token(layers: int, top_k: int) -> int:
    """int16 words per token of a packed step: each layer's k ids (int32: 2 words) and k weights (bf16: 1)."""
    return 3 * layers * top_k


def _int16_view(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.contiguous()
    return tensor.view(torch.int16) if tensor.dim() else tensor.reshape(1).view(torch.int16)


def int16_views(pairs) -> list[torch.Tensor]:
    """What `pack` concatenates (a CUDA graph, into a buffer of its own: engine.graphs): each layer's ids [n, k]
    int32 as [n, 2k] int16, then each layer's weights [n, k] bf16 as [n, k] int16 (cast first where they are not)."""
    ids = [_int16_view(topk_ids if topk_ids.dtype == torch.int32 else topk_ids.to(torch.int32))
           for topk_ids, _ in pairs]
    weights = [_int16_view(topk_weights if topk_weights.dtype == torch.bfloat16 else topk_weights.to(torch.bfloat16))
               for _, topk_weights in pairs]
    return ids + weights


def pack(pairs) -> torch.Tensor:
    """[(topk_ids [n, k], topk_weights [n, k]) per MoE layer] -> [n, W] int16, on their device (one kernel on a
    GPU, where the ids are int32 and the weights bf16 already). CPU weights (float32) are rounded to bf16."""
    return torch.cat(int16_views(pairs), dim=1)


def unpack(rows: np.ndarray, layers: int, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """[T, W] int16 -> (ids [T, L, k] int32, weight bits [T, L, k] uint16: bf16 as stored)."""
    count = rows.shape[0]
    split = 2 * layers * top_k
    ids = np.ascontiguousarray(rows[:, :split]).view(np.int32).reshape(count, layers, top_k)
    bits = np.ascontiguousarray(rows[:, split:]).view(np.uint16).reshape(count, layers, top_k)
    return ids, bits


def bf16_to_float(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> the float32 values they are (exact: bf16 is float32's top half)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


@dataclass
class RoutingRecording:
    """One run's routing: per routed token (in the order the steps routed them, each step's rows in batch
    order) and MoE layer, the k expert ids and their weights; per step its number, phase and its tokens'
    rows (`offsets[s]:offsets[s + 1]`). `header`: model, prompts, flags and provenance (engine.routing_file
    keeps it in the file). A recorder's rows are unpacked when first read."""

    layers: tuple[int, ...]  # the MoE layers' indices in the model, in order
    experts: int  # E
    top_k: int  # k
    steps: np.ndarray  # [S] int64 step numbers
    offsets: np.ndarray  # [S + 1] int64 first row of each step; offsets[-1] = T
    phases: np.ndarray  # [S] uint8 index into PHASES
    header: dict = field(default_factory=dict)
    truncated: dict | None = None  # {"at_step", "dropped_steps", "dropped_tokens", "cap_bytes"} at the cap
    unrecorded: list = field(default_factory=list)  # [[first step, steps, why]] replayed without routing landings
    memory_bytes: int = 0  # host memory the recorder held for it (0 for a file's)
    _ids: np.ndarray | None = field(default=None, repr=False)  # [T, L, k] int32
    _bits: np.ndarray | None = field(default=None, repr=False)  # [T, L, k] uint16 (bf16)
    _rows: list = field(default_factory=list, repr=False)  # a recorder's int16 chunks, until unpacked

    @property
    def tokens(self) -> int:
        return int(self.offsets[-1]) if len(self.offsets) else 0

    @property
    def n_steps(self) -> int:
        return len(self.steps)

    def _unpack(self) -> None:
        if self._ids is None:
            words = words_per_token(len(self.layers), self.top_k)
            rows = np.concatenate(self._rows) if self._rows else np.zeros((0, words), np.int16)
            self._ids, self._bits = unpack(rows[:self.tokens], len(self.layers), self.top_k)
            self._rows = []

    @property
    def ids(self) -> np.ndarray:
        """[T, L, k] int32."""
        self._unpack()
        return self._ids

    @property
    def weight_bits(self) -> np.ndarray:
        """[T, L, k] uint16: the weights' bf16 bits."""
        self._unpack()
        return self._bits

    @cached_property
    def weights(self) -> np.ndarray:
        """[T, L, k] float32."""
        return bf16_to_float(self.weight_bits)

    def step_rows(self, index: int) -> slice:
        """The rows of step `index` (its position among the recorded steps, not its number)."""
        return slice(int(self.offsets[index]), int(self.offsets[index + 1]))

    def phase(self, index: int) -> str:
        return PHASES[int(self.phases[index])]


class RoutingRecorder:
    """A run's routing in host memory, bounded by `cap_bytes` (the module docstring). The dispatcher appends
    each eager step (`append`), the batch runner each replayed launch's steps (`append_block`).

    One pool of rows: int16 [rows, W + 3], a token's packed routing then its step's number (int32, two words)
    and phase (one word), in chunks of CHUNK_ROWS rows (the last one only as long as the cap leaves), so the
    memory held is exactly the rows' and a step fits exactly when its rows do."""

    def __init__(self, experts: int, top_k: int, cap_bytes: int) -> None:
        self.experts, self.top_k, self.cap_bytes = experts, top_k, cap_bytes
        self.layers: tuple[int, ...] | None = None
        self.words = 0  # W
        self._chunks: list[np.ndarray] = []  # int16 [rows, W + 3], each full but the last
        self._capacity = 0  # rows of every chunk allocated
        self._current = 0  # the chunk being filled, and the row of the pool it starts at
        self._chunk_start = 0
        self.rows = 0
        self.n_steps = 0
        self.truncated: dict | None = None
        self.unrecorded: list[list] = []

    # -- appending -----------------------------------------------------------------------------------------

    def _layers(self, layers: tuple[int, ...]) -> None:
        if self.layers is None:
            self.layers, self.words = tuple(layers), words_per_token(len(layers), self.top_k)
        elif tuple(layers) != self.layers:
            raise RuntimeError(f"a step routed MoE layers {tuple(layers)}, the run's first step {self.layers}")

    @property
    def row_bytes(self) -> int:
        return 2 * (self.words + _STEP_WORDS)

    def _room(self, rows: int) -> bool:
        """Allocate chunks for `rows` more rows within the cap; False (nothing allocated) when they do not fit."""
        need = self.rows + rows - self._capacity
        if need <= 0:
            return True
        limit = self.cap_bytes // self.row_bytes  # the most rows the cap holds
        if self.rows + rows > limit:
            return False
        size = min(max(need, CHUNK_ROWS), limit - self._capacity)
        self._chunks.append(np.empty((size, self.words + _STEP_WORDS), np.int16))
        self._capacity += size
        return True

    def _write(self, values: np.ndarray, first_step: int, steps: int, phase: int) -> None:
        """Copy `values` [steps * B, W] (B rows per step, steps numbered from `first_step`) into the chunks from
        row `rows` on, with each row's step number and phase, spilling from one chunk into the next (which
        `_room` allocated). The host path of every recorded step: a few numpy copies, no Python loop per row."""
        total, words, batch = len(values), self.words, len(values) // steps
        written = 0
        while written < total:
            chunk = self._chunks[self._current]
            offset = self.rows - self._chunk_start
            count = min(chunk.shape[0] - offset, total - written)
            if count <= 0:  # this chunk is full: the next one
                self._chunk_start += chunk.shape[0]
                self._current += 1
                continue
            rows = chunk[offset:offset + count]
            rows[:, :words] = values[written:written + count]
            numbers = rows[:, words:words + 2].view(np.int32)[:, 0]  # [count] the step number's two words
            if steps == 1:
                numbers[:] = first_step
            elif batch == 1:
                numbers[:] = np.arange(first_step + written, first_step + written + count, dtype=np.int32)
            else:
                numbers[:] = first_step + np.arange(written, written + count, dtype=np.int32) // batch
            rows[:, words + 2] = phase
            written += count
            self.rows += count

    def _stop(self, step: int, steps: int, tokens: int) -> None:
        if self.truncated is None:
            self.truncated = {"at_step": step, "dropped_steps": 0, "dropped_tokens": 0, "cap_bytes": self.cap_bytes}
        self.truncated["dropped_steps"] += steps
        self.truncated["dropped_tokens"] += tokens

    def append(self, step: int, phase: str, layers: tuple[int, ...], rows: np.ndarray) -> None:
        """One step's packed rows [n, W] int16 (read after the step's sync; copied here)."""
        if self.layers is None or layers != self.layers:
            self._layers(layers)
        count = rows.shape[0]
        if self.truncated is not None or not self._room(count):
            self._stop(step, 1, count)
            return
        self._write(rows, step, 1, _PHASE_CODE[phase])
        self.n_steps += 1

    def append_block(self, first_step: int, layers: tuple[int, ...], block: np.ndarray) -> None:
        """A replayed launch's decode steps first_step, first_step + 1, ...: block [steps, B, W] int16 (a landing
        buffer, read at the launch's sync; copied here). At the cap, the steps that fit are kept."""
        if self.layers is None or layers != self.layers:
            self._layers(layers)
        steps, batch = block.shape[0], block.shape[1]
        fitting = 0
        if self.truncated is None:
            fitting = steps
            while fitting and not self._room(fitting * batch):
                fitting -= 1
        if fitting:
            self._write(block[:fitting].reshape(fitting * batch, self.words), first_step, fitting, _DECODE)
            self.n_steps += fitting
        if fitting < steps:
            self._stop(first_step + fitting, steps - fitting, (steps - fitting) * batch)

    def skip(self, first_step: int, steps: int, why: str) -> None:
        """Steps that ran without their routing reaching the host (a graph captured without routing landings):
        named in the recording, never silently missing."""
        if self.unrecorded and self.unrecorded[-1][0] + self.unrecorded[-1][1] == first_step \
                and self.unrecorded[-1][2] == why:
            self.unrecorded[-1][1] += steps
        else:
            self.unrecorded.append([first_step, steps, why])

    # -- reading --------------------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Host memory the record holds: every chunk allocated."""
        return self._capacity * self.row_bytes if self.words else 0

    def finish(self, header: dict | None = None) -> RoutingRecording:
        """The recording of what was appended (the recorder keeps nothing afterwards)."""
        layers = self.layers or ()
        if not self.rows:
            recording = RoutingRecording(layers=layers, experts=self.experts, top_k=self.top_k,
                                         steps=np.zeros(0, np.int64), offsets=np.zeros(1, np.int64),
                                         phases=np.zeros(0, np.uint8), header=dict(header or {}),
                                         truncated=self.truncated, unrecorded=[list(e) for e in self.unrecorded])
            recording._ids = np.zeros((0, len(layers), self.top_k), np.int32)
            recording._bits = np.zeros((0, len(layers), self.top_k), np.uint16)
            return recording
        held = self.nbytes
        pool = np.concatenate(self._chunks)[:self.rows]  # [T, W + 3]
        self._chunks, self._capacity, self._current, self._chunk_start = [], 0, 0, 0
        numbers = np.ascontiguousarray(pool[:, self.words:self.words + 2]).view(np.int32).reshape(-1)
        starts = np.flatnonzero(np.diff(numbers, prepend=numbers[0] - 1))  # each step's first row
        offsets = np.append(starts, len(numbers)).astype(np.int64)
        return RoutingRecording(layers=layers, experts=self.experts, top_k=self.top_k,
                                steps=numbers[starts].astype(np.int64), offsets=offsets,
                                phases=pool[starts, self.words + 2].astype(np.uint8), header=dict(header or {}),
                                truncated=self.truncated, unrecorded=[list(entry) for entry in self.unrecorded],
                                memory_bytes=held, _rows=[pool[:, :self.words]])


_COMMIT: list[str] = []  # the commit label, asked of git once per process (a run's header, after its steps)


def run_header(engine, flags, prompts: list[list[int]], text: str | None = None) -> dict:
    """What a recording says about its run: the model (as named, its shape), the prompts (token counts, and
    the text when one prompt was given as text, cut to PROMPT_CHARS), the resolved flags and provenance."""
    from engine.provenance import commit_label

    if not _COMMIT:
        _COMMIT.append(commit_label())
    config = engine.config
    prompt: dict = {"count": len(prompts), "tokens": [len(tokens) for tokens in prompts[:64]]}
    if len(prompts) > 64:
        prompt["tokens_note"] = f"the first 64 of {len(prompts)} prompts"
    header = {
        "model": getattr(engine, "model_spec", config.name),
        "config": {"name": config.name, "n_layers": config.n_layers, "experts": config.n_experts,
                   "top_k": config.top_k, "hidden": config.hidden, "intermediate": config.intermediate},
        "prompt": prompt,
        "flags": {name: value for name, value in flags.values.items()},
        "device": getattr(engine, "device_label", str(engine.device)),
        "weights": getattr(engine, "weights_source", ""),
        "commit": _COMMIT[0],
        "recorded_at": _datetime.datetime.now(_datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if text is not None:
        add_prompt_text(header, text)
    return header


def add_prompt_text(header: dict, text: str) -> None:
    """The prompt's text in a run header (one prompt given as text), cut to PROMPT_CHARS."""
    prompt = header.setdefault("prompt", {})
    prompt["text"] = text[:PROMPT_CHARS]
    if len(text) > PROMPT_CHARS:
        prompt["text_note"] = f"the first {PROMPT_CHARS} of {len(text)} characters"
