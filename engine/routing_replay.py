"""Recorded routing replayed into the MoE kernels: the token sets the sweep (engine.sweep) times each arm on, per
MoE layer of a recording, and what they fill against the uniform prediction. Plain functions over numpy arrays.

Shape legend: T = the recording's rows (routed tokens), n = the token count timed, k = top-k, E = experts.

A layer's sets at n tokens are `count` windows of n consecutive rows of its recording (the order the run routed
them: each step's rows in batch order, step after step), starting at evenly spaced rows, so the timed ids keep
whatever correlation neighbouring tokens had (a prefill chunk's tokens come from one prompt; a decode step's from
the cohort's sequences). Where n > T the rows repeat from the start (`wrapped`): a token's routing then appears
more than once in a set, and the woken count is at most what the recording woke.

Per (layer, n) beside the uniform prediction (engine.dispatch): the observed woken experts (mean over the sets),
pairs per woken expert, the m-tile fill, and from the timed rows the crossover this layer would want; the fill
crossover is the smallest n from which the observed pairs per woken expert reach TILE_M at every larger n.

Knows nothing of CUDA, timing or files.
"""

from __future__ import annotations

import numpy as np

from engine import dispatch


def windows(ids: np.ndarray, weights: np.ndarray, tokens: int, count: int) -> tuple[list, bool]:
    """ids, weights [T, k] of one layer -> (`count` (ids [n, k] int32, weights [n, k] float32) windows of n =
    `tokens` rows, whether rows had to repeat because n > T). Where the recording holds count x n rows the
    windows follow each other from the middle of the recording, so the timed calls, cycling through them, replay
    the recorded steps in order as the runtime ran them (consecutive steps share experts, and what one call
    leaves in L2 serves the next); else they are spread over the recording."""
    rows = ids.shape[0]
    if rows == 0:
        raise ValueError("a layer with no recorded rows has no routing to replay")
    wrapped = tokens > rows
    if not wrapped and count * tokens <= rows:
        first = (rows - count * tokens) // 2
        starts = [first + index * tokens for index in range(count)]
    elif wrapped:
        repeats = -(-tokens // rows) + 1
        ids, weights = np.tile(ids, (repeats, 1)), np.tile(weights, (repeats, 1))
        starts = [int(round(index * rows / count)) % rows for index in range(count)]
    else:
        last = rows - tokens
        starts = [int(round(index * last / max(1, count - 1))) if count > 1 else 0 for index in range(count)]
    sets = [(np.ascontiguousarray(ids[start:start + tokens], np.int32),
             np.ascontiguousarray(weights[start:start + tokens], np.float32)) for start in starts]
    return sets, wrapped


def distinct_experts(ids: np.ndarray) -> int:
    return int(np.unique(ids).size)


def fill_row(tokens: int, woken: float, top_k: int, experts: int, tile_m: int) -> dict:
    """The observed and the uniform-predicted woken experts, pairs per woken expert and m-tile fill at n = tokens."""
    pairs = tokens * top_k / woken if woken else 0.0
    predicted = dispatch.woken_experts(tokens, top_k, experts)
    predicted_pairs = dispatch.pairs_per_woken_expert(tokens, top_k, experts)
    return {"woken_experts": woken, "woken_predicted": predicted,
            "pairs_per_woken_expert": pairs, "pairs_per_woken_predicted": predicted_pairs,
            "fill_observed": pairs / tile_m, "fill_predicted": predicted_pairs / tile_m}


def fill_crossover(rows: list[dict], tile_m: int) -> int | None:
    """Smallest measured n from which the observed pairs per woken expert reach `tile_m` at every larger
    measured n; None when the largest does not."""
    crossover = None
    for row in sorted(rows, key=lambda r: r["tokens"], reverse=True):
        if row["pairs_per_woken_expert"] >= tile_m:
            crossover = row["tokens"]
        else:
            break
    return crossover


def summed_rows(layers: list[list[dict]]) -> list[dict]:
    """Per n, each arm's µs summed over the layers (the whole model's MoE time at that n): rows the crossover
    rule (engine.sweep.crossover_tokens) reads. An arm missing in any layer at an n is missing in the sum."""
    if not layers:
        return []
    out = []
    for position, first in enumerate(layers[0]):
        arms = {}
        for arm in first["arms"]:
            values = [rows[position]["arms"].get(arm, {}).get("us") for rows in layers]
            arms[arm] = {"us": None if any(value is None for value in values) else sum(values)}
        out.append({"tokens": first["tokens"], "arms": arms})
    return out


def differences(layers: list[dict], uniform_timed: int | None, uniform_formula: int, tile_m: int) -> list[str]:
    """Lines saying, per layer, where the crossover on its recorded routing differs from the uniform ones: the
    crossover timed on uniform routing, and the formula's tile-fill flip (engine.dispatch.min_tokens)."""
    lines = []
    for entry in layers:
        timed, fill = entry["crossover_tokens"], entry["fill_crossover_tokens"]
        parts = [f"layer {entry['layer']}: recorded routing's crossover "
                 + ("none measured" if timed is None else f"{timed} tokens"),
                 "uniform routing's (timed) " + ("none measured" if uniform_timed is None else f"{uniform_timed}"),
                 f"the uniform formula's tile-fill flip {uniform_formula}",
                 "observed tiles fill (pairs/woken >= TILE_M="
                 f"{tile_m}) from " + ("no measured n" if fill is None else f"{fill}")]
        verdict = ("the same as uniform routing's" if timed == uniform_timed else
                   "differs from uniform routing's")
        lines.append("; ".join(parts) + f": {verdict}")
    return lines
