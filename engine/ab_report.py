"""An A/B report (engine.ab.Outcome.to_json) in markdown. Plain functions over the JSON, so a saved report
renders the same as a fresh one (the TUI's A/B screen reads the same JSON)."""

from __future__ import annotations

import json

from engine import ab_stats


def _value(value: float) -> str:
    return f"{value:,.3f}" if value < 100 else f"{value:,.1f}"


def _side_cell(data: dict) -> str:
    return f"{_value(data['median'])} (±{100 * data['mad_rel']:.1f} %)"


def row_cells(row: dict) -> list[str]:
    """| row | unit | A median (MAD) | B median (MAD) | B/A | 95 % interval | verdict |"""
    if row.get("refused"):
        return [row["row"], row.get("unit", ""), "", "", "", "", f"refused: {row['refused']}"]
    interval = row.get("interval")
    return [row["row"], row["unit"], _side_cell(row["a"]), _side_cell(row["b"]), f"{row['ratio']:.4f}",
            "—" if interval is None else f"[{interval[0]:.4f}, {interval[1]:.4f}]", row["verdict"]]


def _shown(name: str, value) -> str:
    """A side's flag value as --set spells it (on/off for a switch); a name the registry lacks, as given."""
    from engine import flags

    return flags.format_value(name, value) if name in flags.SPECS else str(value)


def format_markdown(report: dict, fail_on_regression: float | None = None) -> str:
    sides, rule = report["sides"], report["rule"]
    workload = report["workload"]
    done = sorted({run["round"] for run in report["runs"]})
    lines = [f"A/B: {workload['describe']}; {len(done)} of {report['rounds_asked']} rounds "
             f"(A B, B A, ...), {report['warmup']} warm-up run(s) per side, {report['processes']}", ""]
    # each side's runs pass the common --set and then its own flags as --set: the common ones are those both pass
    common = [assignment for assignment in sides["A"]["set"] if assignment in sides["B"]["set"]]
    for name in ("A", "B"):
        side = sides[name]
        flags = ", ".join(f"{key}={_shown(key, value)}" for key, value in side["overrides"].items()) or "no overrides"
        lines.append(f"- **{name}**: {side['tree']}; {flags}")
    lines.append(f"- both sides: --set {' '.join(common)}" if common else "- both sides: no --set")
    header = ["row", "unit", "A median (MAD)", "B median (MAD)", "B/A", f"{100 * rule['confidence']:g} % interval",
              "verdict"]
    lines += ["", f"| {' | '.join(header)} |", "|:---|:---|---:|---:|---:|---:|:---|"]
    for row in report["rows"]:
        cells = row_cells(row)
        if fail_on_regression is not None and not row.get("refused") and ab_stats.regression_beyond(row,
                                                                                                   fail_on_regression):
            cells[-1] += f" (beyond {fail_on_regression:g} %)"
        lines.append(f"| {' | '.join(cell.replace('|', '/') for cell in cells)} |")
    lines.append("")
    lines.append(f"B/A: median(B) / median(A) of a time (lower is better; above 1, B takes longer). Interval: "
                 f"percentile bootstrap, {rule['resamples']} resamples of the rounds (A and B of a round kept "
                 f"together), seed {rule['seed']}. Verdict: fewer than {rule['min_rounds']} rounds → insufficient "
                 f"data; the interval inside ±{100 * rule['tolerance']:g} % → no change; entirely above 1 → slower; "
                 "entirely below 1 → faster; else insufficient data (too noisy). MAD: the median absolute deviation "
                 "over a side's rounds, relative to its median.")
    for row in report["rows"]:
        if row.get("verdict"):
            lines.append(f"- {row['row']}: {row['why']}")
        for note in row.get("notes", []):
            lines.append(f"- {row['row']}: {note}")
    if report.get("failure"):
        failure = report["failure"]
        lines += ["", f"**Stopped**: side {failure['side']}: {failure['line']} (the rounds measured before it are "
                      "kept above)"]
    return "\n".join(lines) + "\n"


def format_json(report: dict) -> str:
    return json.dumps(report, indent=1, default=str) + "\n"
