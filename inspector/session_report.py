"""Reports of a session's results: markdown (llama-bench-like tables, one per step kind, and a
footer with commit, device and versions), json, jsonl (the results file itself) and csv.

Plain functions over the results dicts of `inspector.session_runner`, so a recorded results
file renders the same as a fresh run. Knows nothing of engines or argument parsing.
"""

from __future__ import annotations

import csv
import io
import json
from collections import Counter
from typing import Any, Iterable

from engine.printable import printable
from inspector.describe import fill_text

FORMATS = ("md", "json", "jsonl", "csv")
# A replay's verdict when there was nothing to compare (the CLI's heading, the TUI's replay screen): never a match.
NO_STEPS = "the session has no steps to compare"


# --------------------------------------------------------------------------------------------
# Summaries of one run (one configuration of a prompt or compare step)
# --------------------------------------------------------------------------------------------

def run_label(run: dict) -> str:
    """A run's config, and the model it ran on where that was not [engine] model (a compare step's b_model)."""
    model = run.get("model")
    if isinstance(model, dict) and isinstance(model.get("model"), str):
        name = model["model"]  # a long path keeps its end, the part that tells two checkpoints apart
        return f"{run['config']} on {printable(name if len(name) <= 60 else '…' + name[-59:], 80)}"
    return run["config"]


def _moe_label(moe: dict, key: str) -> str:
    arm = moe[key]
    return f"{arm} v{moe['variant']}" if arm == "grouped" and moe.get("variant") is not None else arm


def decided_summary(run: dict) -> str:
    """What the gates chose over every layer of every generated step, e.g. `moe grouped v0 x16; attn fused x16`."""
    moe = Counter(_moe_label(entry["moe"], "decided") for entry in run["decisions"] if "moe" in entry)
    attention = Counter(entry["attention"]["decided"] + (" (mask dropped)" if entry["attention"]["applied_mask"]
                                                         != entry["attention"]["mask"] else "")
                        for entry in run["decisions"] if "attention" in entry)
    parts = []
    if moe:
        parts.append("moe " + ", ".join(f"{label} x{count}" for label, count in moe.items()))
    if attention:
        parts.append("attn " + ", ".join(f"{label} x{count}" for label, count in attention.items()))
    return "; ".join(parts)


def executed_summary(run: dict) -> str:
    """What the launch counters say ran: every arm with a non-zero count, then Triton kernels."""
    counters = run["counters"]  # a family may be absent or null (the results schema): none counted
    arms = ", ".join(f"{name} {count}" for name, count in (counters.get("arms") or {}).items() if count)
    kernels = ", ".join(f"{name} {count}" for name, count in (counters.get("kernels") or {}).items() if count)
    return arms + (f"; kernels {kernels}" if kernels else "")


def shared_summary(run: dict) -> str:
    """Where the shared experts ran over every layer of every generated step, e.g. `apart x12, routed launches x4`;
    "" for a model without them, or a run recorded before their path was (the field absent or null)."""
    paths = Counter(entry["moe"]["shared_path"] for entry in run["decisions"]
                    if "moe" in entry and entry["moe"].get("shared_path"))
    return ", ".join(f"{path} x{count}" for path, count in paths.items())


def shared_reasons(run: dict) -> list[str]:
    """Each distinct `path: why` of the run's shared experts, in first-seen order."""
    return list(dict.fromkeys(
        entry["moe"]["shared_path"] + (f": {entry['moe']['shared_reason']}" if entry["moe"].get("shared_reason") else "")
        for entry in run["decisions"] if "moe" in entry and entry["moe"].get("shared_path")))


def prefill_summary(run: dict) -> str:
    """The prefill width and the MoE arm the gate chose for it (the width is what the gates read)."""
    prefill = [entry for entry in run["decisions"] if entry["phase"] == "prefill" and "moe" in entry]
    if not prefill:
        return ""
    labels = sorted({_moe_label(entry["moe"], "decided") for entry in prefill})
    return f"n={prefill[0]['n_tokens']}: {', '.join(labels)}"


def stand_ins(steps: Iterable[dict]) -> list[str]:
    """`decided -> executed` pairs where an arm without an implementation here ran on its reference."""
    pairs = set()
    for step in steps:
        for run in step.get("runs", []):
            for entry in run["decisions"]:
                for family in ("moe", "attention"):
                    if family in entry and entry[family]["decided"] != entry[family]["executed"]:
                        decided = _moe_label(entry[family], "decided") if family == "moe" else entry[family]["decided"]
                        pairs.add(f"{decided} -> {entry[family]['executed']}")
    return sorted(pairs)


def _flag_overrides(run: dict, header: dict) -> str:
    base = {name: entry["value"] for name, entry in (header.get("flags") or {}).items()}
    return ", ".join(f"{name}={_format_flag(value)}" for name, value in run["flags"].items()
                     if base.get(name) != value)


def _format_flag(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _text(value: str, width: int = 24) -> str:
    shown = f"'{printable(value, limit=None)}'"  # \xNN for bytes outside UTF-8, as generate and the TUI show them
    return shown if len(shown) <= width else shown[:width - 1] + "…"


def check_cell(check: dict | None) -> str:
    if check is None:
        return ""
    return f"{check['expect']}: {'held' if check['held'] else 'FAILED'}"


# --------------------------------------------------------------------------------------------
# Table rows (shared by markdown and csv)
# --------------------------------------------------------------------------------------------

def generation_rows(header: dict, steps: list[dict]) -> list[dict]:
    rows = []
    for step in steps:
        if step["action"] not in ("prompt", "compare"):
            continue
        numbers = step.get("numbers", {})
        for side, run in enumerate(step["runs"]):
            first = side == 0
            divergence = numbers.get("first_divergence") if first and len(step["runs"]) > 1 else None
            error = numbers.get("max_logit_rel_err") if first else None
            rows.append({
                "step": step["step"], "action": step["action"], "config": run_label(run),
                "overrides": _flag_overrides(run, header), "prompt tokens": run["prompt_tokens"],
                "tokens": len(run["tokens"]), "text": run["text"], "prefill": prefill_summary(run),
                "prefill reason": run["reasons"][0] if run.get("reasons") else "",
                "decided": decided_summary(run), "ran (counters)": executed_summary(run),
                "shared experts": shared_summary(run), "shared experts why": "; ".join(shared_reasons(run)),
                "first divergence": ("none" if len(step["runs"]) > 1 and first and divergence is None else
                                     "" if divergence is None else str(divergence)),
                "max logit rel err": "" if error is None else f"{error:.2e}",
                "wall s": f"{run['timings']['wall_s']:.2f}",
                "check": check_cell(step["check"]) if first else "",
            })
    return rows


def curve_rows(step: dict) -> list[dict]:
    return [{"step": step["step"], "n": row["n"], "woken": f"{row['woken']:.1f}",
             "pairs/woken": f"{row['pairs_per_woken']:.2f}",
             "fill": fill_text(row["pairs_per_woken"], step["numbers"]["tile_m"]),
             "amortizes": "yes" if row["amortizes"] else "no"} for row in step["numbers"]["rows"]]


def attention_rows(steps: list[dict]) -> list[dict]:
    rows = []
    for step in steps:
        if step["action"] != "check-attention":
            continue
        numbers, definition = step["numbers"], step["definition"]
        rows.append({
            "step": step["step"], "mode": definition["mode"], "seq_len": definition["seq_len"],
            "verdict": numbers.get("verdict", ""), "expected": definition.get("expect", ""),
            "check": check_cell(step["check"]), "dtype": numbers.get("dtype", ""),
            "sentence": numbers.get("sentence", ""),
        })
    return rows


def quant_rows(steps: list[dict]) -> list[dict]:
    """One row per token count of every check-quant step: the arm against the dequantized experts (it must sit
    on them) and against the original weights (the quantization error), beside the 1-ULP control."""
    rows = []
    for step in steps:
        if step["action"] != "check-quant":
            continue
        config = step["numbers"].get("config", {})
        for row in (step["numbers"].get("rows") or []):
            errors, control = row.get("errors", {}), row.get("control")
            times = (f"{errors['dequantized'] / control:.3g}x" if isinstance(control, (int, float)) and control > 0
                     and isinstance(errors.get("dequantized"), (int, float)) else "")
            rows.append({"step": step["step"], "layer": config.get("layer", ""), "format": config.get("format", ""),
                         "arm": config.get("arm", ""), "tokens": row.get("tokens", ""),
                         "control": _float(control), "vs dequantized": _float(errors.get("dequantized")),
                         "x control": times, "vs original": _float(errors.get("original")),
                         "verdict": row.get("verdict", ""), "check": check_cell(step.get("check"))})
    return rows


def _float(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else "" if value is None else str(value)


def sweep_rows(steps: list[dict]) -> list[dict]:
    rows = []
    for step in steps:
        if step["action"] != "sweep":
            continue
        for row in (step["numbers"].get("rows") or []):
            rows.append({"step": step["step"], **{key: value for key, value in row.items()
                                                  if not isinstance(value, (dict, list))}})
    return rows


def bench_rows(steps: list[dict]) -> list[dict]:
    """One row per llama-bench row of every bench step (engine.bench's JSON report in `numbers`)."""
    rows = []
    for step in steps:
        if step["action"] != "bench":
            continue
        for row in (step["numbers"].get("rows") or []):
            wall, device = row.get("tps_wall"), row.get("tps_device")
            arms = row.get("counters", {}).get("arms", {})
            rows.append({
                "step": step["step"], "config": step["definition"].get("config", "base"), "test": row["test"],
                "t/s (wall)": "admitting" if wall is None else f"{wall['mean']:.2f} ± {wall['std']:.2f}",
                "t/s (device)": "n/a" if device is None else f"{device['mean']:.2f} ± {device['std']:.2f}",
                "TTFT ms": f"{row['ttft_ms']['mean']:.1f}", "state": row.get("state", ""),
                "launches": ", ".join(f"{name} {count}" for name, count in arms.items() if count),
            })
    return rows


# --------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------

def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: list[dict], columns: list[str] | None = None, right: Iterable[str] = ()) -> str:
    """A Markdown table of `rows` (columns: the given ones, else the first row's keys; no rows and no columns:
    the words "(no rows)")."""
    if not rows and not columns:
        return "(no rows)"
    columns = columns or list(rows[0])
    right = set(right)
    lines = ["| " + " | ".join(columns) + " |",
             "|" + "|".join("---:" if column in right else "---" for column in columns) + "|"]
    lines += ["| " + " | ".join(_cell(row.get(column, "")) for column in columns) + " |" for row in rows]
    return "\n".join(lines)


def check_counts(steps: list[dict]) -> tuple[int, int]:
    checks = [step["check"] for step in steps if step.get("check") is not None]
    held = sum(1 for check in checks if check["held"])
    return held, len(checks) - held


def build_line(header: dict) -> str:
    """llama-bench's footer: what ran this, where, when."""
    commit = header.get("commit")
    build = (commit[:10] + (" (with local changes)" if header.get("commit_dirty") else "")) if commit else "no git"
    return (f"moe-inspector {header.get('package_version')} · commit {build} · device {header.get('device')} · "
            f"torch {header.get('torch')} · triton {header.get('triton') or 'not installed'} · "
            f"python {header.get('python')} · model {header.get('model')} seed {header.get('seed')} · "
            + (f"expert parallel over {header['ep']} ranks · " if header.get("ep", 1) > 1 else "")
            + f"{header.get('started_at')}")


def flags_line(header: dict) -> str:
    return ", ".join(f"{name}={_format_flag(entry['value'])} ({entry['source']})"
                     for name, entry in (header.get("flags") or {}).items())


def footer(header: dict) -> str:
    return "\n".join(["---", build_line(header), "", f"flags: {flags_line(header)}"])


def render_markdown(header: dict, steps: list[dict], description: str | None = None, cancelled: bool = False) -> str:
    held, failed = check_counts(steps)
    checks = (f"{held} check{'s' if held != 1 else ''} held, {failed} failed" if held or failed else "no checks")
    count = f"{len(steps)} step{'s' if len(steps) != 1 else ''}"
    out = [f"# session `{header.get('session')}`: {count}, {checks}", ""]
    if cancelled:
        out += [f"**Cancelled** (Ctrl-C) after {count}: the steps after {'it' if len(steps) == 1 else 'them'} "
                "did not run.", ""]
    if description:
        out += [description, ""]
    rows = [{**row, "text": _text(row["text"])} for row in generation_rows(header, steps)]
    if rows:
        shared = any(row["shared experts"] for row in rows)  # a column only for models with shared experts
        out += ["## prompt and compare", "",
                markdown_table(rows, ["step", "config", "overrides", "tokens", "text", "prefill", "decided",
                                      "ran (counters)"] + (["shared experts"] if shared else [])
                               + ["first divergence", "max logit rel err", "wall s", "check"],
                               right=("step", "tokens", "first divergence", "max logit rel err", "wall s")), ""]
        out += ["Why, at prefill (the first MoE layer of each run):", ""]
        out += [f"- step {row['step']} {row['config']}, {row['prefill']}: {row['prefill reason']}"
                for row in rows] + [""]
        if shared:
            out += ["Where the shared experts ran, and why:", ""]
            out += [f"- step {row['step']} {row['config']}: {row['shared experts why']}"
                    for row in rows if row["shared experts"]] + [""]
    for step in steps:
        if step["action"] == "curve":
            numbers = step["numbers"]
            out += [f"## curve (step {step['step']}): top-{numbers['k']} of {numbers['experts']} experts, "
                    f"TILE_M={numbers['tile_m']}: m-tiles amortize from {numbers['min_tokens']} tokens", "",
                    markdown_table(curve_rows(step), ["n", "woken", "pairs/woken", "fill", "amortizes"],
                                   right=("n", "woken", "pairs/woken", "fill")), ""]
    rows = attention_rows(steps)
    if rows:
        out += ["## check-attention", "",
                markdown_table(rows, ["step", "mode", "seq_len", "dtype", "verdict", "expected", "check"],
                               right=("step", "seq_len")), ""]
        out += [f"- step {row['step']} ({row['mode']}): {row['sentence']}" for row in rows if row["sentence"]] + [""]
    rows = quant_rows(steps)
    if rows:
        out += ["## check-quant", "", markdown_table(rows, right=("step", "layer", "tokens", "control",
                                                                  "vs dequantized", "x control", "vs original")), ""]
        out += [f"- step {step['step']}: {step['numbers']['sentence']}" for step in steps
                if step["action"] == "check-quant" and step["numbers"].get("sentence")] + [""]
    rows = sweep_rows(steps)
    if rows:
        out += ["## sweep", "", markdown_table(rows), ""]
    rows = bench_rows(steps)
    if rows:
        out += ["## bench", "", markdown_table(rows, right=("step", "t/s (wall)", "t/s (device)", "TTFT ms")), "",
                "t/s: mean ± stddev over the timed repetitions (warm-up excluded); launches: each arm's launch "
                "counter over them. The numbers are engine.bench's; the results file holds its whole report.", ""]
    notes = []
    pairs = stand_ins(steps)
    if pairs:
        notes.append(f"On {header.get('device')}, arms with no implementation here executed on their reference "
                     f"({'; '.join(pairs)}). The `decided` column is what the gates chose; `ran (counters)` is "
                     f"what executed. Identical outputs here show the decisions and the reference math agree, "
                     f"not that the decided kernels do: run the session on a GPU to compare the kernels.")
    failures = [f"step {step['step']} ({step['action']}): {step['check']['detail']}"
                for step in steps if step.get("check") and not step["check"]["held"]]
    if failures:
        notes.append("Checks that failed: " + "; ".join(failures))
    if notes:
        out += ["## notes", ""] + [f"- {note}" for note in notes] + [""]
    out.append(footer(header))
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------------------------
# json, jsonl, csv
# --------------------------------------------------------------------------------------------

def render_csv(header: dict, steps: list[dict]) -> str:
    rows = [{"table": "generation", **row} for row in generation_rows(header, steps)]
    for step in steps:
        if step["action"] == "curve":
            rows += [{"table": "curve", **row} for row in curve_rows(step)]
    rows += [{"table": "check-attention", **row} for row in attention_rows(steps)]
    rows += [{"table": "check-quant", **row} for row in quant_rows(steps)]
    rows += [{"table": "sweep", **row} for row in sweep_rows(steps)]
    rows += [{"table": "bench", **row} for row in bench_rows(steps)]
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns or ["table"], lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def render(header: dict, steps: list[dict], fmt: str, description: str | None = None, cancelled: bool = False) -> str:
    if fmt == "md":
        return render_markdown(header, steps, description, cancelled)
    if fmt == "json":
        held, failed = check_counts(steps)
        return json.dumps({"header": header, "steps": steps,
                           "summary": {"steps": len(steps), "checks_held": held, "checks_failed": failed},
                           "cancelled": cancelled}, indent=2, ensure_ascii=False) + "\n"
    if fmt == "jsonl":
        from inspector.session_runner import dumps_results

        return dumps_results(header, steps)
    if fmt == "csv":
        return render_csv(header, steps)
    raise ValueError(f"unknown report format {fmt!r}")


# --------------------------------------------------------------------------------------------
# Replay
# --------------------------------------------------------------------------------------------

def _same(old: Any, new: Any) -> str:
    return "match" if old == new else "DIFFERS"


def replay_rows(recorded: list[dict], rerun: list[dict]) -> list[dict]:
    from inspector.session_runner import decisions_match, quant_verdicts  # what the diff compares

    rows = []
    for old, new in zip(recorded, rerun):
        runs = list(zip(old.get("runs", []), new.get("runs", [])))
        if runs:
            for run_old, run_new in runs:
                rows.append({
                    "step": old["step"], "action": old["action"], "config": run_label(run_new),  # where B loaded now
                    "tokens": _same(run_old["tokens"], run_new["tokens"]),
                    "counters": _same(run_old["counters"], run_new["counters"]),
                    "decisions": "match" if decisions_match(run_old["decisions"], run_new["decisions"]) else "DIFFERS",
                    "wall s recorded": f"{run_old['timings']['wall_s']:.2f}",
                    "wall s now": f"{run_new['timings']['wall_s']:.2f}",
                })
        else:
            if old["action"] == "bench":  # rows, token counts and counters; never the rates
                from inspector.session_runner import diff_bench

                verdict = "DIFFERS" if diff_bench("", old["numbers"], new["numbers"]) else "match"
            else:
                verdict = (_same(old["numbers"].get("verdict"), new["numbers"].get("verdict"))
                           if old["action"] == "check-attention" else
                           _same(quant_verdicts(old), quant_verdicts(new)) if old["action"] == "check-quant" else
                           _same(old["numbers"], new["numbers"]) if old["action"] == "curve" else "not compared")
            rows.append({"step": old["step"], "action": old["action"], "config": "", "tokens": "", "counters": "",
                         "decisions": verdict, "wall s recorded": f"{old['wall_s']:.2f}",
                         "wall s now": f"{new['wall_s']:.2f}"})
    return rows


def replay_json(recorded_header: dict, recorded: list[dict], rerun_header: dict, rerun: list[dict],
                differences: list[str], cancelled: bool = False) -> dict:
    """The replay for machines: whether it matches, every difference in words, a row per step and
    configuration (tokens, counters, decisions: match or DIFFERS), the checks, both headers and the re-run.
    `matches` is null where nothing was compared (no steps; `note` says so), as the heading claims no match."""
    held, failed = check_counts(rerun)
    compared = bool(recorded or rerun or differences)
    return {"session": recorded_header.get("session"),
            "matches": (not differences and not cancelled) if compared else None,
            **({} if compared else {"note": NO_STEPS}), "differences": differences, "rows": replay_rows(recorded, rerun),
            "checks": {"held": held, "failed": failed}, "steps_recorded": len(recorded), "steps_rerun": len(rerun),
            "cancelled": cancelled, "recorded_header": recorded_header, "rerun_header": rerun_header,
            "rerun": rerun}


def render_replay(recorded_header: dict, recorded: list[dict], rerun_header: dict, rerun: list[dict],
                  differences: list[str], cancelled: bool = False) -> str:
    """The replay for people: a heading with the verdict, a row per step and configuration, the differences,
    both build lines. A session with no steps says so in its heading and claims no match: nothing was compared."""
    if differences:
        verdict = f"{len(differences)} difference{'s' if len(differences) != 1 else ''} from the recording"
    else:
        verdict = "matches the recording" if recorded or rerun else NO_STEPS
    out = [f"# replay of `{recorded_header.get('session')}`: {verdict}", ""]
    if cancelled:
        out += [f"**Cancelled** (Ctrl-C) after {len(rerun)} of {len(recorded)} steps: only those are compared.", ""]
    if recorded or rerun:
        out += ["Tokens, counters and decisions must match; timings are shown, not compared.", "",
                markdown_table(replay_rows(recorded, rerun),
                               right=("step", "wall s recorded", "wall s now")), ""]
    if differences:
        out += ["## differences", ""] + [f"- {difference}" for difference in differences] + [""]
    held, failed = check_counts(rerun)
    if failed:
        out += [f"Checks on the re-run: {held} held, {failed} FAILED.", ""]
    out += ["---", f"recorded: {build_line(recorded_header)}", "", f"now: {build_line(rerun_header)}", "",
            f"flags: {flags_line(rerun_header)}"]
    return "\n".join(out) + "\n"
