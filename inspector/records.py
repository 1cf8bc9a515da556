"""The dispatch log as rows: one per MoE layer and per attention layer of every step, flat and
the same for `generate --format csv|jsonl`, `compare --format csv|jsonl` and the TUI's export.

A row carries the whole decision: what the gate read (n tokens, k, E, TILE_M, predicted and
observed woken experts, pairs per woken expert, fill, the policy and its boundary), what it
decided (arm, variant) and why, what executed, the mask (attention), and the µs with how they
were measured. Keys a record lacks are empty. Knows nothing of widgets.
"""

from __future__ import annotations

import csv
import io
import json
import math
from typing import Any, Iterable

from inspector.describe import fill_text, timing_method  # noqa: F401 - fill_text is also for callers

COLUMNS = (
    "config", "step", "phase", "n_tokens", "family", "layer", "decided_arm", "variant", "executed_arm", "reason",
    "execution_note", "policy", "boundary", "k", "experts", "tile_m", "woken_predicted", "woken_observed",
    "pairs_per_woken", "pairs_per_woken_observed", "fill", "fill_text", "head_dim", "mask", "applied_mask",
    "declined", "us", "timing", "graph", "token",
    # expert-parallel runs (engine.expert_parallel): this rank's place and exchange, and on rank 0 every rank's
    # view of the layer (`ranks`) with the imbalance of routed pairs across ranks (max/mean)
    "ep_rank", "ep_ranks", "local_experts", "exchange_bytes", "exchange_us", "imbalance", "ranks",
    # a MoE layer with shared experts (DeepSeek, Qwen2-MoE): where they ran ("routed launches" or "apart") and why
    "shared_path", "shared_reason",
    # a MoE layer's expert storage ("bf16", "trellis hyb K=2 V=2 L=16"), its bits per weight and the expert bytes
    # the step read; and the model the row ran (a preset's name or a checkpoint's path: compare --b-model's A and
    # B, or rows of several runs joined, say which is which)
    "weight_format", "bits_per_weight", "bytes_moved", "model",
)


def record_row(config: str, step: dict, family: str, record: dict, device_type: str,
               model: str | None = None) -> dict[str, Any]:
    """One flat row of a MoE (`family` "moe") or attention record of `step` (an engine step record)."""
    row: dict[str, Any] = {column: None for column in COLUMNS}
    row.update({key: record.get(key) for key in COLUMNS if key in record})
    row.update(config=config, step=record.get("step", step.get("step")), phase=record.get("phase", step.get("phase")),
               n_tokens=record.get("n_tokens", step.get("n_tokens")), family=family, token=step.get("token"),
               timing=timing_method(record, device_type), model=model)
    if family == "moe" and record.get("pairs_per_woken") is not None and record.get("tile_m"):
        row["fill_text"] = fill_text(record["pairs_per_woken"], record["tile_m"])
    ep = record.get("ep")
    if ep is not None:
        row.update(ep_rank=ep["rank"], ep_ranks=ep["ranks"], local_experts=ep["local_experts"],
                   exchange_bytes=ep["exchange"]["bytes"], exchange_us=ep["exchange"]["us"])
    return row


def rows_of(config: str, steps: Iterable[dict], device_type: str, model: str | None = None) -> list[dict[str, Any]]:
    """Every record of `steps` in the dispatch log's order: per step its MoE layers, then its attention layers."""
    rows = []
    for step in steps:
        rows += [record_row(config, step, "moe", record, device_type, model) for record in step["moe"]]
        rows += [record_row(config, step, "attention", record, device_type, model) for record in step["attention"]]
    return rows


def _plain(value: Any) -> Any:
    """Strict JSON: a non-finite float becomes a string ("nan", "inf")."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def to_csv(rows: list[dict[str, Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(COLUMNS), lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    writer.writerows([{key: json.dumps(value) if isinstance(value, (list, dict)) else value
                       for key, value in row.items()} for row in rows])
    return buffer.getvalue()


def to_jsonl(rows: list[dict[str, Any]]) -> str:
    return "".join(json.dumps({key: _plain(value) for key, value in row.items()}, ensure_ascii=False) + "\n"
                   for row in rows)


def to_json(rows: list[dict[str, Any]], about: dict[str, Any] | None = None) -> str:
    """One object: what the rows are of (`about`: model, device, flags, ...) and the rows."""
    payload = {**(about or {}), "columns": list(COLUMNS),
               "rows": [{key: _plain(value) for key, value in row.items()} for row in rows]}
    return json.dumps(payload, indent=1, ensure_ascii=False) + "\n"


EXPORTS = {"csv": to_csv, "jsonl": to_jsonl}  # `json` takes the `about` header too: to_json


# --------------------------------------------------------------------------------------------
# The arm table: the rows aggregated over layers and steps
# --------------------------------------------------------------------------------------------

def arm_label(row: dict[str, Any], key: str) -> str:
    """`decided_arm` or `executed_arm` of a row, with the grouped variant where the decision names one."""
    arm = row[key]
    if row["family"] == "moe" and key == "decided_arm" and row.get("variant") is not None:
        return f"{arm} v{row['variant']}"
    return str(arm)


def mask_label(row: dict[str, Any]) -> str:
    """An attention row's mask, and the mask applied where that differs (a dropped mask); "" for MoE."""
    if row["family"] != "attention" or row.get("mask") is None:
        return ""
    return row["mask"] if row["mask"] == row["applied_mask"] else f"{row['mask']} → {row['applied_mask']}"


def arm_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (config, family, phase, decided, executed, mask): how many layer-steps, over which n, the
    µs spent (where timed), and the reasons given (the most frequent first)."""
    groups: dict[tuple, dict[str, Any]] = {}
    for row in rows:
        key = (row["config"], row["family"], row["phase"], arm_label(row, "decided_arm"), str(row["executed_arm"]),
               mask_label(row))
        entry = groups.get(key)
        if entry is None:
            entry = groups[key] = {"config": key[0], "family": key[1], "phase": key[2], "decided": key[3],
                                   "executed": key[4], "mask": key[5], "count": 0, "steps": set(), "n_min": row["n_tokens"],
                                   "n_max": row["n_tokens"], "us_total": None, "timed": 0, "reasons": {}}
        entry["count"] += 1
        entry["steps"].add(row["step"])
        entry["n_min"], entry["n_max"] = min(entry["n_min"], row["n_tokens"]), max(entry["n_max"], row["n_tokens"])
        if row.get("us") is not None:
            entry["us_total"] = (entry["us_total"] or 0.0) + row["us"]
            entry["timed"] += 1
        reason = ("declined: " if row.get("declined") else "") + str(row.get("reason") or "")
        entry["reasons"][reason] = entry["reasons"].get(reason, 0) + 1
    table = []
    for entry in groups.values():
        reasons = sorted(entry.pop("reasons").items(), key=lambda item: -item[1])
        timed = entry.pop("timed")
        entry.update(steps=len(entry["steps"]), reasons=[{"reason": reason, "count": count} for reason, count in reasons],
                     us_total=None if entry["us_total"] is None else round(entry["us_total"], 1),
                     us_mean=None if not timed else round(entry["us_total"] / timed, 2))
        table.append(entry)
    return table


def format_arm_table(table: list[dict[str, Any]]) -> str:
    """The arm table for people: aligned columns, each reason numbered once below the table, whole."""
    header = ["family", "phase", "n", "decided", "executed", "mask", "layer-steps", "µs total", "µs mean", "why"]
    numbers: dict[str, int] = {}
    lines = [header]
    for entry in table:
        n = str(entry["n_min"]) if entry["n_min"] == entry["n_max"] else f"{entry['n_min']}-{entry['n_max']}"
        why = ", ".join(str(numbers.setdefault(reason["reason"], len(numbers) + 1)) for reason in entry["reasons"])
        lines.append(["MoE" if entry["family"] == "moe" else "attention", entry["phase"], n, entry["decided"],
                      entry["executed"], entry["mask"], str(entry["count"]),
                      "" if entry["us_total"] is None else f"{entry['us_total']:.1f}",
                      "" if entry["us_mean"] is None else f"{entry['us_mean']:.1f}", why])
    widths = [max(len(line[column]) for line in lines) for column in range(len(header))]
    right = {2, 6, 7, 8}
    out = ["  ".join(cell.rjust(w) if index in right else cell.ljust(w)
                     for index, (cell, w) in enumerate(zip(line, widths))).rstrip() for line in lines]
    out += [f"  why {number}: {reason}" for reason, number in numbers.items()]
    return "\n".join(out)
