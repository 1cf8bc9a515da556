"""What a routing recording says per MoE layer, over a scope of its steps: the load of every expert (tokens
routed to it), its imbalance along the expert axis, the experts woken against the uniform prediction, the
hottest experts. The TUI's routing screen and `moe-inspector routing` show the same numbers.

Shape legend: T = rows (routed tokens) in the scope, S = its steps, L = MoE layers, E = experts, k = top-k.

    load[l, e]        tokens of the scope layer l sent to expert e (each token counts once per expert it picks)
    mean              T * k / E                       the load of every expert under perfect balance
    max / mean        1 = balanced; E / k when every token picks the same k experts
    cv                std(load) / mean, the population std along the expert axis (0 = balanced)
    woken per step    distinct experts a step's tokens picked, averaged over the scope's steps, beside the
                      uniform prediction E * (1 - (1 - k/E)^n) averaged over the same steps (engine.dispatch)
    woken (scope)     distinct experts over the whole scope, beside the prediction at its T tokens

Knows nothing of files (engine.routing_file) or screens.
"""

from __future__ import annotations

import csv
import io
import math
import re
from dataclasses import dataclass

import numpy as np

from engine import dispatch
from engine.errors import UserError
from engine.routing_record import RoutingRecording

HEAT = " ▁▂▃▄▅▆▇█"


@dataclass(frozen=True)
class Scope:
    """Which steps a summary covers: the whole run, its last step, or a window of its last `steps` steps."""

    kind: str  # "run", "last" or "window"
    steps: int = 0

    def describe(self) -> str:
        return {"run": "the whole run", "last": "the last step"}.get(self.kind, f"the last {self.steps} steps")

    def bounds(self, recorded_steps: int) -> tuple[int, int]:
        """(first, end) indices into the recorded steps."""
        if self.kind == "run":
            return 0, recorded_steps
        count = 1 if self.kind == "last" else self.steps
        return max(0, recorded_steps - count), recorded_steps


RUN, LAST = Scope("run"), Scope("last")


def parse_scope(text: str, option: str = "--scope") -> Scope:
    """'run', 'last' or 'window:N' (N >= 1)."""
    value = text.strip().lower()
    if value in ("run", "all"):
        return RUN
    if value == "last":
        return LAST
    match = re.fullmatch(r"window:(\d{1,9})", value)
    if match and int(match.group(1)) >= 1:
        return Scope("window", int(match.group(1)))
    raise UserError(f"{option} {text!r}: give run (the whole run), last (its last step) or window:N (its last N "
                    f"steps, N >= 1)")


@dataclass(frozen=True)
class LayerStats:
    layer: int  # the MoE layer's index in the model
    tokens: int  # T
    load: np.ndarray  # [E] int64
    mean: float
    max_over_mean: float
    cv: float
    woken: int  # distinct experts over the scope
    woken_predicted: float  # uniform routing at T tokens
    woken_per_step: float  # mean over the scope's steps
    woken_per_step_predicted: float
    hottest: tuple[tuple[int, int, float], ...]  # (expert, load, share of the layer's pairs), hottest first

    def to_json(self) -> dict:
        return {"layer": self.layer, "tokens": self.tokens, "mean_load": self.mean,
                "max_over_mean": self.max_over_mean, "cv": self.cv, "woken": self.woken,
                "woken_predicted": self.woken_predicted, "woken_per_step": self.woken_per_step,
                "woken_per_step_predicted": self.woken_per_step_predicted,
                "hottest": [{"expert": expert, "load": load, "share": share} for expert, load, share in self.hottest]}


@dataclass(frozen=True)
class Summary:
    scope: Scope
    first_step: int | None  # the scope's first and last step numbers (None: nothing recorded)
    last_step: int | None
    steps: int
    tokens: int
    experts: int
    top_k: int
    layers: tuple[LayerStats, ...]

    @property
    def load(self) -> np.ndarray:
        """[L, E] the heatmap's values."""
        if not self.layers:
            return np.zeros((0, self.experts), np.int64)
        return np.stack([stats.load for stats in self.layers])

    def to_json(self) -> dict:
        return {"scope": self.scope.describe(), "first_step": self.first_step, "last_step": self.last_step,
                "steps": self.steps, "tokens": self.tokens, "experts": self.experts, "top_k": self.top_k,
                "layers": [stats.to_json() for stats in self.layers]}


def _woken_per_step(ids: np.ndarray, offsets: np.ndarray, experts: int) -> np.ndarray:
    """ids [T, k] of one layer, offsets [S + 1] into it -> [S] distinct experts per step: the distinct (step,
    expert) keys, counted per step, in memory of the ids' size (a [steps, E] mask took gigabytes at E = 2**20)."""
    steps = len(offsets) - 1
    step_of_row = np.repeat(np.arange(steps, dtype=np.int64), np.diff(offsets))  # [T]
    keys = np.repeat(step_of_row, ids.shape[1]) * experts + ids.reshape(-1).astype(np.int64)
    return np.bincount(np.unique(keys) // experts, minlength=steps).astype(np.int64)


def summarize(recording: RoutingRecording, scope: Scope = RUN, top: int = 3) -> Summary:
    """Every MoE layer's statistics over `scope` (the module docstring)."""
    first, end = scope.bounds(recording.n_steps)
    experts, k = recording.experts, recording.top_k
    if end <= first:
        return Summary(scope, None, None, 0, 0, experts, k, ())
    begin_row, end_row = int(recording.offsets[first]), int(recording.offsets[end])
    offsets = recording.offsets[first:end + 1] - begin_row
    lengths = np.diff(offsets)
    tokens = end_row - begin_row
    per_step_predicted = float(np.mean([dispatch.woken_experts(int(n), k, experts) for n in lengths]))
    ids = recording.ids[begin_row:end_row]  # [T, L, k]
    layers = []
    for position, layer in enumerate(recording.layers):
        layer_ids = ids[:, position, :]
        load = np.bincount(layer_ids.reshape(-1), minlength=experts).astype(np.int64)
        mean = tokens * k / experts
        order = np.argsort(-load, kind="stable")[:top]
        pairs = max(1, tokens * k)
        hottest = tuple((int(expert), int(load[expert]), float(load[expert]) / pairs) for expert in order
                        if load[expert] > 0)
        woken_steps = _woken_per_step(layer_ids, offsets, experts)
        layers.append(LayerStats(
            layer=int(layer), tokens=tokens, load=load, mean=mean,
            max_over_mean=float(load.max()) / mean if mean else math.nan,
            cv=float(load.std()) / mean if mean else math.nan,
            woken=int(np.count_nonzero(load)), woken_predicted=dispatch.woken_experts(tokens, k, experts),
            woken_per_step=float(woken_steps.mean()), woken_per_step_predicted=per_step_predicted,
            hottest=hottest))
    return Summary(scope, int(recording.steps[first]), int(recording.steps[end - 1]), end - first, tokens,
                   experts, k, tuple(layers))


def heat_strip(load: np.ndarray, columns: int, top: float | None = None) -> str:
    """One layer's load as a row of block characters, experts binned to at most `columns` cells (a cell
    shows its bin's hottest expert), scaled to `top` (default: the row's own maximum)."""
    binned = bin_load(load, columns)
    peak = float(top if top is not None else binned.max(initial=0))
    if peak <= 0:
        return HEAT[0] * len(binned)
    return "".join(HEAT[min(len(HEAT) - 1, int(math.ceil(value / peak * (len(HEAT) - 1))))] for value in binned)


def bin_load(load: np.ndarray, columns: int) -> np.ndarray:
    """[E] -> [min(E, columns)]: each bin's maximum over the experts it covers (so a hot expert stays visible)."""
    experts = len(load)
    if experts <= columns:
        return load.astype(np.float64)
    edges = np.linspace(0, experts, columns + 1).round().astype(int)
    return np.array([load[edges[i]:edges[i + 1]].max() for i in range(columns)], np.float64)


def experts_per_cell(experts: int, columns: int) -> float:
    return max(1.0, experts / columns)


def loads_csv(summary: Summary) -> str:
    """layer,expert,load,share,rank: one row per (MoE layer, expert) of the summary's scope."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["layer", "expert", "load", "share", "rank"])
    for stats in summary.layers:
        pairs = max(1, int(stats.load.sum()))
        ranks = np.empty(len(stats.load), np.int64)
        ranks[np.argsort(-stats.load, kind="stable")] = np.arange(1, len(stats.load) + 1)
        for expert, load in enumerate(stats.load):
            writer.writerow([stats.layer, expert, int(load), f"{load / pairs:.6f}", int(ranks[expert])])
    return out.getvalue()


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def format_summary(summary: Summary, header: dict | None = None, columns: int = 64) -> str:
    """The text `moe-inspector routing` prints: what was recorded, then a line per MoE layer and its heat strip."""
    lines = []
    if header:
        prompt = header.get("prompt", {})
        text = prompt.get("text")
        lines.append(f"model {header.get('model', '?')} on {header.get('device', '?')} ({header.get('weights', '')})")
        tokens = prompt.get("tokens") or []
        lines.append(f"prompts: {prompt.get('count', '?')} ({', '.join(map(str, tokens[:8]))}"
                     f"{', ...' if len(tokens) > 8 else ''} tokens)" + (f": {text[:80]!r}" if text else ""))
    if not summary.layers:
        lines.append(f"{summary.scope.describe()}: no steps recorded")
        return "\n".join(lines)
    lines.append(f"{summary.scope.describe()}: steps {summary.first_step}..{summary.last_step} "
                 f"({_count(summary.steps, 'step')}, {_count(summary.tokens, 'routed token')}), "
                 f"top-{summary.top_k} of {summary.experts} experts")
    lines.append("")
    table = [["layer", "max/mean", "cv", "woken/step", "uniform", "woken", "uniform", "hottest (share)"]]
    for stats in summary.layers:
        table.append([str(stats.layer), f"{stats.max_over_mean:.2f}", f"{stats.cv:.2f}",
                      f"{stats.woken_per_step:.1f}", f"{stats.woken_per_step_predicted:.1f}", str(stats.woken),
                      f"{stats.woken_predicted:.1f}",
                      ", ".join(f"{expert} ({100 * share:.1f}%)" for expert, _, share in stats.hottest)])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for index, row in enumerate(table):
        lines.append("  ".join(cell.rjust(width) if column < 7 else cell
                               for column, (cell, width) in enumerate(zip(row, widths))))
        if index == 0:
            lines.append("  ".join("-" * width for width in widths))
    lines.append("")
    per_cell = experts_per_cell(summary.experts, columns)
    lines.append(f"load per expert (tokens; {'one expert' if per_cell == 1 else f'{per_cell:.1f} experts, their max,'} "
                 f"per cell; every row scaled to the hottest cell of all layers):")
    top = max(float(bin_load(stats.load, columns).max(initial=0)) for stats in summary.layers)
    for stats in summary.layers:
        lines.append(f"  {stats.layer:>4} |{heat_strip(stats.load, columns, top)}|")
    return "\n".join(lines)
